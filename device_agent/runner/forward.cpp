// mobizo_runner forward: times a program's forward on the device's runtime, the inference side of the step-to-
// inference comparisons (benchmarks/runner_memory.py).
//
//   mobizo_runner forward --program P.pte --data W.ptd --iterations N
// Runs `forward` N times on inputs of ones at the method's own input shapes: every input must be an int64 tensor
// (token rows, masks, targets: an inference forward, not a training step, whose lr and eps are floats). A program
// with a `set_lora_b` has its B set to zeros first (the base model). stdout: one JSON line per call
// {"iteration":k,"seconds":s}, flushed at once. Exit codes: 0 done, 1 failure, 2 bad arguments.
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
using executorch::runtime::Tag;

int forward(int argc, char** argv) {
  std::map<std::string, std::string> kv =
      parse_pairs(argc, argv, {"--program", "--data", "--iterations"}, {"--program", "--data", "--iterations"});
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
    tensors.push_back(from_blob(values.back().data(), sizes, ScalarType::Long));
  }
  if (has_b) {
    std::vector<float> b(b_size(module), 0.0f);
    const TensorPtr tensor = from_blob(b.data(), {static_cast<SizesType>(b.size())}, ScalarType::Float);
    check(module.execute("set_lora_b", std::vector<EValue>{EValue(tensor)}).error(), "set_lora_b");
  }
  for (uint64_t k = 0; k < iterations; ++k) {
    const auto started = std::chrono::steady_clock::now();
    check(module.execute("forward", std::vector<EValue>(tensors.begin(), tensors.end())).error(),
          "forward at iteration " + std::to_string(k));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("{\"iteration\":%llu,\"seconds\":%.6f}\n", static_cast<unsigned long long>(k), seconds);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace mobizo
