// What the runner's modes share about a loaded ExecuTorch program (main.cpp trains, evaluate.cpp evaluates,
// generate.cpp generates, forward.cpp times forwards).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include "runner_io.h"

namespace mobizo {

// An ExecuTorch error as a RunnerError naming what failed.
inline void check(executorch::runtime::Error err, const std::string& what) {
  if (err != executorch::runtime::Error::Ok) throw RunnerError(what + ": " + executorch::runtime::to_string(err));
}

// D, the length of the program's B: the size of set_lora_b's input (the B buffer itself holds nothing before
// it is set). Training and inference programs both take a flat B.
inline size_t b_size(executorch::extension::Module& module) {
  auto meta = module.method_meta("set_lora_b");
  check(meta.error(), "set_lora_b metadata");
  auto b = meta->input_tensor_meta(0);
  check(b.error(), "set_lora_b input 0");
  if (b->sizes().size() != 1) throw RunnerError("set_lora_b does not take a flat B");
  return static_cast<size_t>(b->sizes()[0]);
}

// Sets the program's B with set_lora_b (a training program's optimizer state restarts from zeros; an inference
// program's KV cache empties).
inline void set_lora_b(executorch::extension::Module& module, std::vector<float> b) {
  const auto size = static_cast<executorch::aten::SizesType>(b.size());
  const executorch::extension::TensorPtr tensor =
      executorch::extension::from_blob(b.data(), {size}, executorch::aten::ScalarType::Float);
  check(module.execute("set_lora_b", std::vector<executorch::runtime::EValue>{executorch::runtime::EValue(tensor)})
            .error(),
        "set_lora_b");
}

// With --min-width, the batch keeps only its last `width` columns: its longest row, at least the
// minimum (device_agent.batches.fit_width). Rows are left-padded, so the columns cut are padding.
// Returns the width; min_width 0 keeps every column.
inline uint32_t fit_width(StepBatch& batch, uint32_t rows, uint32_t columns, uint64_t min_width) {
  if (min_width == 0) return columns;
  uint32_t first = columns;
  for (uint32_t r = 0; r < rows; ++r)
    for (uint32_t c = 0; c < first; ++c)
      if (batch.attention_mask[size_t(r) * columns + c]) {
        first = c;
        break;
      }
  const uint32_t width =
      std::max<uint32_t>(columns - first, static_cast<uint32_t>(std::min<uint64_t>(min_width, columns)));
  if (width == columns) return columns;
  for (auto* values : {&batch.input_ids, &batch.attention_mask}) {
    for (uint32_t r = 0; r < rows; ++r)
      std::copy_n(values->begin() + size_t(r) * columns + (columns - width), width, values->begin() + size_t(r) * width);
    values->resize(size_t(rows) * width);
  }
  return width;
}

// A method's token inputs against a batches file: input_ids (input 0) must be [rows, seq_len] (its largest width,
// for a program of dynamic widths) and targets (input 2) [rows, answer_len]; a RunnerError naming the mismatch
// otherwise. A training program's forward and evaluate both take them so.
inline void check_batch_shapes(executorch::extension::Module& module, const std::string& method,
                               const BatchesReader& batches) {
  auto meta = module.method_meta(method);
  check(meta.error(), method + " metadata");
  auto ids = meta->input_tensor_meta(0);
  auto answers = meta->input_tensor_meta(2);
  check(ids.error(), method + " input 0");
  check(answers.error(), method + " input 2");
  const auto s = ids->sizes();
  const auto t = answers->sizes();
  if (s.size() != 2 || t.size() != 2 || uint32_t(s[0]) != batches.rows() || uint32_t(s[1]) != batches.seq_len() ||
      uint32_t(t[0]) != batches.rows() || uint32_t(t[1]) != batches.answer_len())
    throw RunnerError("batches shape [" + std::to_string(batches.rows()) + "," + std::to_string(batches.seq_len()) +
                      "] answer " + std::to_string(batches.answer_len()) + " does not match the program's " + method +
                      " inputs");
}

}  // namespace mobizo
