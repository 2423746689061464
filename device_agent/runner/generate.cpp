// mobizo_runner generate: greedy generation with a mobizo inference program (.pte + the model's .ptd).
//
//   mobizo_runner generate --program P.pte --data W.ptd --prompt-ids 1,2,3 --max-new-tokens N
//                          [--b B.f32] [--stop-ids 2,7]
// stdout: one JSON line per new token {"token":id,"seconds":s}, flushed at once (the first line's time includes
// the prompt's prefill). Greedy: the first token of highest logit, as torch.argmax picks. The program's forward
// takes (tokens [1,T], input_pos [T]) and keeps the KV cache itself; set_lora_b (--b, else zeros) sets the adapter
// and empties the cache.
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include "modes.h"
#include "program_calls.h"
#include "runner_io.h"

namespace mobizo {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::extension::from_blob;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::runtime::Error;
using executorch::runtime::EValue;

std::vector<int64_t> parse_ids(const std::string& name, const std::string& text) {
  std::vector<int64_t> ids;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string part = text.substr(start, end - start);
    char* stop = nullptr;
    const long long v = std::strtoll(part.c_str(), &stop, 10);
    if (part.empty() || *stop != '\0' || v < 0) throw UsageError(name + ": not a list of token ids: " + text);
    ids.push_back(v);
    start = end + 1;
  }
  return ids;
}

// The next token from the logits of the last position: the first maximum.
int64_t argmax_last(const executorch::aten::Tensor& logits) {
  const int64_t vocab = logits.size(2), t = logits.size(1);
  const float* row = logits.const_data_ptr<float>() + (t - 1) * vocab;
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i)
    if (row[i] > row[best]) best = i;
  return best;
}

}  // namespace

int generate(int argc, char** argv) {
  std::map<std::string, std::string> kv =
      parse_pairs(argc, argv, {"--program", "--data", "--prompt-ids", "--max-new-tokens", "--b", "--stop-ids"},
                  {"--program", "--data", "--prompt-ids", "--max-new-tokens"});
  std::vector<int64_t> tokens = parse_ids("--prompt-ids", kv["--prompt-ids"]);
  const std::vector<int64_t> max_new = parse_ids("--max-new-tokens", kv["--max-new-tokens"]);
  if (tokens.empty() || max_new.size() != 1 || max_new[0] < 1) throw UsageError("--prompt-ids and --max-new-tokens must be non-empty");
  std::set<int64_t> stop;
  if (kv.count("--stop-ids"))
    for (int64_t id : parse_ids("--stop-ids", kv["--stop-ids"])) stop.insert(id);
  for (const std::string& path : {kv["--program"], kv["--data"]})
    if (!file_exists(path)) throw RunnerError("cannot open " + path + ": no such file");

  Module module(kv["--program"], kv["--data"], Module::LoadMode::Mmap, nullptr, nullptr, nullptr,
                /*share_memory_arenas=*/true);
  check(module.load(), "loading the program");
  // Both methods before any runs: loading a method re-initialises the shared B and KV-cache buffers.
  for (const char* name : {"forward", "set_lora_b"}) check(module.load_method(name), std::string("loading ") + name);
  // Always set, zeros without --b: set_lora_b also empties the KV cache, which the program does not store.
  set_lora_b(module, kv.count("--b") ? read_b(kv["--b"]) : std::vector<float>(b_size(module), 0.0f));
  size_t position = 0;
  for (int64_t n = 0; n < max_new[0]; ++n) {
    const auto started = std::chrono::steady_clock::now();
    std::vector<int64_t> fresh(tokens.begin() + position, tokens.end()), pos(fresh.size());
    for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int64_t>(position + i);
    const auto count = static_cast<SizesType>(fresh.size());
    const std::vector<TensorPtr> inputs{from_blob(fresh.data(), {1, count}, ScalarType::Long),
                                        from_blob(pos.data(), {count}, ScalarType::Long)};
    auto out = module.execute("forward", std::vector<EValue>(inputs.begin(), inputs.end()));
    check(out.error(), "forward at position " + std::to_string(position));
    const int64_t token = argmax_last(out.get().at(0).toTensor());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("{\"token\":%lld,\"seconds\":%.6f}\n", static_cast<long long>(token), seconds);
    std::fflush(stdout);
    position = tokens.size();
    tokens.push_back(token);
    if (stop.count(token)) break;
  }
  return 0;
}

}  // namespace mobizo
