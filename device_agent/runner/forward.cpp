// mobizo_runner forward: times a program's forward on the device's runtime, the inference side of the step-to-
// inference comparisons (benchmarks/runner_memory.py).
//
//   mobizo_runner forward --program P.pte --data W.ptd --iterations N [--batches F.mzb]
// Runs `forward` N times at the method's own input shapes: every input must be an int64 tensor (token rows, masks,
// targets: an inference forward, not a training step, whose lr and eps are floats). Inputs are ones, or with
// --batches the rows of a training program's batches file: call k runs step k's input_ids, attention_mask and
// targets (cycling through the file's steps), each row repeated to fill the program's rows in order (an inference
// program of a step's 2q·E paths gets every row twice, as benchmarks/program.py's inputs do). Real tokens matter to
// memory: a lookup maps in the pages of the embedding rows it reads, which rows of ones never touch. A program
// with a `set_lora_b` has its B set to zeros first (the base model). stdout: one JSON line per call
// {"iteration":k,"seconds":s[,"output":[...]]}, flushed at once: "output" is the first output where it is a float
// tensor of at most 4,096 values (an inference program's per-row losses). Exit codes: 0 done, 1 failure, 2 bad
// arguments.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include "modes.h"
#include "program_calls.h"
#include "runner_io.h"

namespace mobizo {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::extension::from_blob;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::runtime::EValue;
using executorch::runtime::Tag;

// The first output goes to stdout where it is a float tensor this small (an inference program's per-row losses),
// not a generation program's logits.
constexpr int64_t kMaxPrinted = 4096;

// dst [R, width] from src [rows, width], row r of dst being row r % rows of src.
void tile_rows(std::vector<int64_t>& dst, const std::vector<int64_t>& src, size_t rows, size_t width) {
  for (size_t r = 0; r < dst.size() / width; ++r)
    std::copy_n(src.begin() + static_cast<std::ptrdiff_t>((r % rows) * width), width,
                dst.begin() + static_cast<std::ptrdiff_t>(r * width));
}

// The forward's first three inputs must be input_ids [R, seq_len], attention_mask [R, seq_len] and targets
// [R, answer_len] of the batches file's widths, R a multiple of its rows; a UsageError naming the mismatch otherwise.
void check_batch_inputs(const std::vector<std::vector<SizesType>>& shapes, const BatchesReader& batches) {
  const std::vector<SizesType> widths{static_cast<SizesType>(batches.seq_len()),
                                      static_cast<SizesType>(batches.seq_len()),
                                      static_cast<SizesType>(batches.answer_len())};
  if (shapes.size() < 3) throw UsageError("--batches: the program's forward takes fewer than 3 inputs");
  for (size_t i = 0; i < 3; ++i) {
    const auto& s = shapes[i];
    if (s.size() != 2 || s[1] != widths[i] || s[0] % static_cast<SizesType>(batches.rows()) != 0)
      throw UsageError("--batches: forward input " + std::to_string(i) + " is not [k * " +
                       std::to_string(batches.rows()) + ", " + std::to_string(widths[i]) + "] (the file's rows)");
  }
}

int forward(int argc, char** argv) {
  std::map<std::string, std::string> kv =
      parse_pairs(argc, argv, {"--program", "--data", "--iterations", "--batches"},
                  {"--program", "--data", "--iterations"});
  const uint64_t iterations = parse_count("--iterations", kv["--iterations"]);
  if (iterations < 1) throw UsageError("--iterations must be at least 1");
  for (const std::string& path : {kv["--program"], kv["--data"]})
    if (!file_exists(path)) throw RunnerError("cannot open " + path + ": no such file");

  Module module(kv["--program"], kv["--data"], Module::LoadMode::Mmap, nullptr, nullptr, nullptr,
                /*share_memory_arenas=*/true);
  check(module.load(), "loading the program");
  auto names = module.method_names();
  check(names.error(), "the program's methods");
  const bool has_b = names->count("set_lora_b") > 0;
  // Every method used before any runs: loading a method re-initialises the shared buffers.
  check(module.load_method("forward"), "loading forward");
  if (has_b) check(module.load_method("set_lora_b"), "loading set_lora_b");

  auto meta = module.method_meta("forward");
  check(meta.error(), "forward metadata");
  std::vector<std::vector<int64_t>> values;
  std::vector<std::vector<SizesType>> shapes;
  values.reserve(meta->num_inputs());
  std::vector<TensorPtr> tensors;  // own the tensors' metadata: they outlive the EValues that view them
  for (size_t i = 0; i < meta->num_inputs(); ++i) {
    auto tag = meta->input_tag(i);
    check(tag.error(), "forward input " + std::to_string(i));
    auto input = meta->input_tensor_meta(i);
    if (*tag != Tag::Tensor || input.error() != executorch::runtime::Error::Ok ||
        input->scalar_type() != ScalarType::Long)
      throw RunnerError("forward input " + std::to_string(i) +
                        " is not an int64 tensor: the forward mode runs inference forwards (token rows), not "
                        "training steps");
    std::vector<SizesType> sizes(input->sizes().begin(), input->sizes().end());
    size_t numel = 1;
    for (SizesType s : sizes) numel *= static_cast<size_t>(s);
    values.emplace_back(numel, 1);
    shapes.push_back(sizes);
    tensors.push_back(from_blob(values.back().data(), sizes, ScalarType::Long));
  }
  if (has_b) set_lora_b(module, std::vector<float>(b_size(module), 0.0f));
  std::unique_ptr<BatchesReader> batches;
  if (!kv["--batches"].empty()) {
    batches = std::make_unique<BatchesReader>(kv["--batches"]);
    if (batches->steps() == 0) throw UsageError("--batches: the file holds no steps");
    check_batch_inputs(shapes, *batches);
  }
  for (uint64_t k = 0; k < iterations; ++k) {
    if (batches) {
      StepBatch batch = batches->read(static_cast<uint32_t>(k % batches->steps()));
      tile_rows(values[0], batch.input_ids, batches->rows(), batches->seq_len());
      tile_rows(values[1], batch.attention_mask, batches->rows(), batches->seq_len());
      tile_rows(values[2], batch.targets, batches->rows(), batches->answer_len());
    }
    const auto started = std::chrono::steady_clock::now();
    auto out = module.execute("forward", std::vector<EValue>(tensors.begin(), tensors.end()));
    check(out.error(), "forward at iteration " + std::to_string(k));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("{\"iteration\":%llu,\"seconds\":%.6f", static_cast<unsigned long long>(k), seconds);
    const auto& first = out.get().at(0);
    if (first.isTensor() && first.toTensor().scalar_type() == ScalarType::Float &&
        first.toTensor().numel() <= kMaxPrinted) {
      std::fputs(",\"output\":[", stdout);
      print_floats(first.toTensor().const_data_ptr<float>(), first.toTensor().numel());
      std::fputc(']', stdout);
    }
    std::fputs("}\n", stdout);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace mobizo
