// mobizo_runner evaluate: a training program's `evaluate` method (the master B, no perturbation) on rows of a
// batches file under one or more B's: the held-out evaluation of a device that trains with the runner
// (device_agent/runner_evaluator.py).
//
//   mobizo_runner evaluate --program P.pte --data W.ptd --batches R.mzb --b B.f32 [--min-width W]
// --batches: a batches file (device_agent/batches.py) whose records are chunks of rows at the program's shape; their
// seed and lr are not read. --b: raw float32, K >= 1 B's of the program's D values back to back; each is set in turn
// (set_lora_b) and every chunk evaluated under it. --min-width: as in training, each chunk runs at its longest row,
// at least W columns (a program of dynamic widths; absent: at the file's seq_len).
// stdout: one JSON line per (B, chunk), B-major, flushed at once:
// {"b":k,"chunk":c,"shape":[...],"values":[...],"seconds":t}: the method's output (per-row losses [rows], or a
// classification program's candidate scores [rows, C]) row-major, %.9g; t the call's own wall-clock seconds.
// Exit codes: 0 done, 1 failure (message on stderr), 2 bad arguments.
#include <chrono>
#include <cstdio>
#include <map>
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

namespace {

// One line of output: the evaluate method's output tensor for chunk `chunk` under B number `point`.
void print_output(size_t point, uint32_t chunk, const executorch::aten::Tensor& out, double seconds) {
  if (out.scalar_type() != ScalarType::Float) throw RunnerError("evaluate did not return a float32 tensor");
  std::printf("{\"b\":%zu,\"chunk\":%u,\"shape\":[", point, chunk);
  for (size_t i = 0; i < out.sizes().size(); ++i) std::printf(i ? ",%lld" : "%lld", static_cast<long long>(out.size(i)));
  std::fputs("],\"values\":[", stdout);
  print_floats(out.const_data_ptr<float>(), out.numel());
  std::printf("],\"seconds\":%.6f}\n", seconds);
  std::fflush(stdout);
}

}  // namespace

int evaluate(int argc, char** argv) {
  std::map<std::string, std::string> kv =
      parse_pairs(argc, argv, {"--program", "--data", "--batches", "--b", "--min-width"},
                  {"--program", "--data", "--batches", "--b"});
  const uint64_t min_width = kv.count("--min-width") ? parse_count("--min-width", kv["--min-width"]) : 0;
  for (const std::string& path : {kv["--program"], kv["--data"]})
    if (!file_exists(path)) throw RunnerError("cannot open " + path + ": no such file");
  BatchesReader batches(kv["--batches"]);
  if (batches.steps() == 0) throw UsageError("--batches: the file holds no rows");

  Module module(kv["--program"], kv["--data"], Module::LoadMode::Mmap, nullptr, nullptr, nullptr,
                /*share_memory_arenas=*/true);
  check(module.load(), "loading the program");
  // Both methods before any runs: loading a method re-initialises the shared B buffer.
  for (const char* name : {"evaluate", "set_lora_b"}) check(module.load_method(name), std::string("loading ") + name);
  check_batch_shapes(module, "evaluate", batches);
  const size_t d = b_size(module);
  const std::vector<float> all = read_b(kv["--b"]);
  if (all.empty() || all.size() % d != 0)
    throw RunnerError(kv["--b"] + ": " + std::to_string(all.size()) + " values, not a whole number of the program's B (" +
                      std::to_string(d) + " values each)");

  const auto rows = static_cast<SizesType>(batches.rows());
  const auto ans = static_cast<SizesType>(batches.answer_len());
  for (size_t point = 0; point < all.size() / d; ++point) {
    set_lora_b(module, std::vector<float>(all.begin() + point * d, all.begin() + (point + 1) * d));
    for (uint32_t chunk = 0; chunk < batches.steps(); ++chunk) {
      StepBatch batch = batches.read(chunk);
      const auto seq = static_cast<SizesType>(fit_width(batch, batches.rows(), batches.seq_len(), min_width));
      // The TensorPtrs own the tensors' metadata, so they must outlive the EValues that view them.
      const std::vector<TensorPtr> tensors{from_blob(batch.input_ids.data(), {rows, seq}, ScalarType::Long),
                                           from_blob(batch.attention_mask.data(), {rows, seq}, ScalarType::Long),
                                           from_blob(batch.targets.data(), {rows, ans}, ScalarType::Long)};
      const auto started = std::chrono::steady_clock::now();
      auto out = module.execute("evaluate", std::vector<EValue>(tensors.begin(), tensors.end()));
      check(out.error(), "evaluate at chunk " + std::to_string(chunk));
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      print_output(point, chunk, out.get().at(0).toTensor(), seconds);
    }
  }
  return 0;
}

}  // namespace mobizo
