// mobizo_runner: runs a mobizo training program (.pte + .ptd) for steps [start, N) on a device;
// `mobizo_runner evaluate ...` runs the training program's evaluate method on held-out rows under given B's
// (evaluate.cpp), `mobizo_runner generate ...` runs an inference program instead (generate.cpp), and
// `mobizo_runner forward ...` times any program's forward on rows of ones (forward.cpp).
//
// Usage (see README.md):
//   mobizo_runner --program P.pte --data W.ptd --batches F.mzb --eps EPS --out-b B.f32
//                 [--init-b B0.f32] [--checkpoint C.ckpt --checkpoint-every K] [--job-id ID]
//                 [--steps N] [--stop-file PATH] [--min-width W] [--init-state S.f32] [--private P.f32]
// --min-width: the program takes any number of columns from W to the batches' seq_len (its manifest's
// inputs.widths); each step then runs at its longest row (at least W). Absent: every step at seq_len.
// The program carries no B: it is set before step 1, from the checkpoint, --init-b, or zeros.
// --init-state: the optimizer's state (raw float32) for a program whose optimizer keeps one (its methods
// include set_opt_state), set after B, which starts it from zeros: a resumed run's state, rebuilt by the
// agent from the log (shared.replay.replay_state). Absent: from zeros.
// --private: a private program's (forward takes the clip [1] and the noise of its g's [q]) per-step inputs, raw
// float32, step k's clip then its q noise values at k*(1+q), for every step of the batches file; drawn by the
// agent from the device's private seed (device_agent.job.private_noise). Required by a private program.
// Each step's lr is its batches record's (the job's schedule); eps is one value for the run.
// stdout: one JSON line per step {"step":k,"seed":s,"lr":lr,"losses":[...],"g":[...],"seconds":t}, flushed per line
// (t: the forward call's own wall-clock seconds).
// Exit codes: 0 done, 1 failure (message on stderr), 2 bad arguments, 75 stopped (SIGTERM, SIGINT,
// or the stop file appeared) after finishing the current step and writing the checkpoint.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include "modes.h"
#include "program_calls.h"
#include "runner_io.h"

namespace {

using executorch::aten::ScalarType;
using executorch::extension::from_blob;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::runtime::EValue;
using executorch::runtime::Error;
using mobizo::b_size;
using mobizo::check;
using mobizo::RunnerError;
using mobizo::UsageError;
using mobizo::parse_count;
using mobizo::print_floats;

constexpr int kExitUsage = 2;
constexpr int kExitStopped = 75;

volatile std::sig_atomic_t g_stop = 0;
extern "C" void on_stop_signal(int) { g_stop = 1; }

struct Options {
  std::string program, data, batches, out_b, init_b, checkpoint, job_id, stop_file, init_state, private_inputs;
  float eps = 0;
  uint64_t checkpoint_every = 0, steps = UINT64_MAX, min_width = 0;
};

float parse_float(const std::string& name, const std::string& text) {
  char* end = nullptr;
  const float v = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(v)) throw UsageError(name + ": not a finite number: " + text);
  return v;
}

Options parse_args(int argc, char** argv) {
  std::map<std::string, std::string> kv = mobizo::parse_pairs(
      argc, argv,
      {"--program", "--data", "--batches", "--out-b", "--eps", "--init-b", "--init-state", "--private", "--checkpoint",
       "--job-id", "--stop-file", "--checkpoint-every", "--steps", "--min-width"},
      {"--program", "--data", "--batches", "--out-b", "--eps"});
  Options o;
  o.program = kv["--program"];
  o.data = kv["--data"];
  o.batches = kv["--batches"];
  o.out_b = kv["--out-b"];
  o.eps = parse_float("--eps", kv["--eps"]);
  o.init_b = kv["--init-b"];
  o.init_state = kv["--init-state"];
  o.private_inputs = kv["--private"];
  o.checkpoint = kv["--checkpoint"];
  o.job_id = kv["--job-id"];
  o.stop_file = kv["--stop-file"];
  const std::string every = kv["--checkpoint-every"];
  if (!every.empty()) o.checkpoint_every = parse_count("--checkpoint-every", every);
  const std::string steps = kv["--steps"];
  if (!steps.empty()) o.steps = parse_count("--steps", steps);
  const std::string min_width = kv["--min-width"];
  if (!min_width.empty()) o.min_width = parse_count("--min-width", min_width);
  if (o.checkpoint_every > 0 && o.checkpoint.empty()) throw UsageError("--checkpoint-every needs --checkpoint");
  return o;
}

// The program's B as a host vector. Copied at once: with shared arenas the next method call may
// reuse the memory the output lives in.
std::vector<float> get_b(Module& module) {
  auto out = module.execute("get_lora_b");
  check(out.error(), "get_lora_b");
  const auto& t = out.get().at(0).toTensor();
  const float* p = t.const_data_ptr<float>();
  return std::vector<float>(p, p + t.numel());
}

// Loads every method before any runs: loading a method re-initialises the shared B buffer, so a
// method loaded lazily after training began would silently reset B.
void load_methods(Module& module, bool state) {
  check(module.load(), "loading the program");
  for (const char* name : {"forward", "get_lora_b", "set_lora_b"})
    check(module.load_method(name), std::string("loading method ") + name);
  if (state) check(module.load_method("set_opt_state"), "loading method set_opt_state (--init-state)");
}

// The initial B and the first step: from the checkpoint when one exists (resume), else --init-b,
// else zeros. Always set: the program carries no B of its own (its buffer is uninitialised).
uint64_t restore(Module& module, const Options& o, size_t d) {
  if (!o.checkpoint.empty() && mobizo::file_exists(o.checkpoint)) {
    mobizo::Checkpoint ckpt = mobizo::read_checkpoint(o.checkpoint);
    if (ckpt.job_id != o.job_id)
      throw RunnerError(o.checkpoint + " belongs to job '" + ckpt.job_id + "', not '" + o.job_id + "'");
    if (ckpt.b.size() != d)
      throw RunnerError(o.checkpoint + ": B has " + std::to_string(ckpt.b.size()) + " values, the program's B has " +
                        std::to_string(d));
    mobizo::set_lora_b(module, std::move(ckpt.b));
    return ckpt.next_step;
  }
  if (!o.init_b.empty()) {
    std::vector<float> b = mobizo::read_b(o.init_b);
    if (b.size() != d)
      throw RunnerError(o.init_b + ": " + std::to_string(b.size()) + " values, the program's B has " +
                        std::to_string(d));
    mobizo::set_lora_b(module, std::move(b));
  } else {
    mobizo::set_lora_b(module, std::vector<float>(d, 0.0f));
  }
  return 0;
}

// The optimizer's state from --init-state, after B (setting B zeroed it).
void restore_state(Module& module, const Options& o) {
  auto meta = module.method_meta("set_opt_state");
  check(meta.error(), "set_opt_state metadata");
  auto input = meta->input_tensor_meta(0);
  check(input.error(), "set_opt_state input 0");
  const auto size = static_cast<size_t>(input->sizes()[0]);
  std::vector<float> state = mobizo::read_b(o.init_state);
  if (state.size() != size)
    throw RunnerError(o.init_state + ": " + std::to_string(state.size()) + " values, the program's state has " +
                      std::to_string(size));
  const TensorPtr tensor = from_blob(state.data(), {static_cast<executorch::aten::SizesType>(size)}, ScalarType::Float);
  check(module.execute("set_opt_state", std::vector<EValue>{EValue(tensor)}).error(), "set_opt_state");
}

// A private program's per-step clip and noise (--private), checked against the program and the batches: q is the
// size of forward's last input, g_noise. Empty for a program that is not private (forward takes 6 inputs).
struct PrivateInputs {
  std::vector<float> values;
  size_t q = 0;
};

PrivateInputs read_private(Module& module, const Options& o, uint32_t steps) {
  auto meta = module.method_meta("forward");
  check(meta.error(), "forward metadata");
  const bool is_private = meta->num_inputs() == 8;
  if (!is_private) {
    if (!o.private_inputs.empty()) throw RunnerError("--private: the program takes no clip and noise");
    return {};
  }
  if (o.private_inputs.empty()) throw RunnerError("a private program needs --private (its clip and noise)");
  auto noise = meta->input_tensor_meta(7);
  check(noise.error(), "forward input 7");
  PrivateInputs p{mobizo::read_b(o.private_inputs), static_cast<size_t>(noise->sizes()[0])};
  if (p.values.size() != size_t(steps) * (1 + p.q))
    throw RunnerError(o.private_inputs + ": " + std::to_string(p.values.size()) + " values, " + std::to_string(steps) +
                      " steps of 1 + " + std::to_string(p.q) + " expected");
  return p;
}

void run_step(Module& module, mobizo::BatchesReader& batches, const Options& o, const PrivateInputs& priv,
              uint32_t step) {
  mobizo::StepBatch batch = batches.read(step);
  const auto rows = static_cast<executorch::aten::SizesType>(batches.rows());
  const auto seq = static_cast<executorch::aten::SizesType>(
      mobizo::fit_width(batch, batches.rows(), batches.seq_len(), o.min_width));
  const auto ans = static_cast<executorch::aten::SizesType>(batches.answer_len());
  float lr = batch.lr, eps = o.eps;
  // The TensorPtrs own the tensors' metadata, so they must outlive the EValues that view them.
  std::vector<TensorPtr> tensors{
      from_blob(batch.input_ids.data(), {rows, seq}, ScalarType::Long),
      from_blob(batch.attention_mask.data(), {rows, seq}, ScalarType::Long),
      from_blob(batch.targets.data(), {rows, ans}, ScalarType::Long),
      from_blob(&batch.seed, {1}, ScalarType::Long),
      from_blob(&lr, {1}, ScalarType::Float),
      from_blob(&eps, {1}, ScalarType::Float)};
  std::vector<float> clip, noise;  // copies: from_blob takes a mutable pointer
  if (priv.q > 0) {
    const float* at = priv.values.data() + size_t(step) * (1 + priv.q);
    clip.assign(at, at + 1);
    noise.assign(at + 1, at + 1 + priv.q);
    tensors.push_back(from_blob(clip.data(), {1}, ScalarType::Float));
    tensors.push_back(from_blob(noise.data(), {static_cast<executorch::aten::SizesType>(priv.q)}, ScalarType::Float));
  }
  const auto started = std::chrono::steady_clock::now();
  auto out = module.execute("forward", std::vector<EValue>(tensors.begin(), tensors.end()));
  check(out.error(), "forward at step " + std::to_string(step));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const auto& losses = out.get().at(0).toTensor();
  const auto& g = out.get().at(1).toTensor();
  std::printf("{\"step\":%u,\"seed\":%lld,\"lr\":%.9g,\"losses\":[", step, static_cast<long long>(batch.seed),
              static_cast<double>(lr));
  print_floats(losses.const_data_ptr<float>(), losses.numel());
  std::fputs("],\"g\":[", stdout);
  print_floats(g.const_data_ptr<float>(), g.numel());
  std::printf("],\"seconds\":%.6f}\n", seconds);
  std::fflush(stdout);
}

void save_checkpoint(Module& module, const Options& o, uint64_t next_step) {
  if (!o.checkpoint.empty()) mobizo::write_checkpoint(o.checkpoint, {next_step, o.job_id, get_b(module)});
}

// A stop is asked by signal, or, where no signal can be delivered (a phone behind adb), by creating
// the stop file; it is checked once per step, a stat() next to a whole forward pass.
bool stop_requested(const Options& o) {
  return g_stop || (!o.stop_file.empty() && mobizo::file_exists(o.stop_file));
}

int train(const Options& o) {
  for (const std::string& path : {o.program, o.data})
    if (!mobizo::file_exists(path)) throw RunnerError("cannot open " + path + ": no such file");
  mobizo::BatchesReader batches(o.batches);
  Module module(o.program, o.data, Module::LoadMode::Mmap, nullptr, nullptr, nullptr, /*share_memory_arenas=*/true);
  load_methods(module, !o.init_state.empty());
  mobizo::check_batch_shapes(module, "forward", batches);
  const uint64_t end = std::min<uint64_t>(o.steps, batches.steps());
  const PrivateInputs priv = read_private(module, o, batches.steps());
  uint64_t step = restore(module, o, b_size(module));
  if (!o.init_state.empty()) restore_state(module, o);
  for (; step < end; ++step) {
    run_step(module, batches, o, priv, static_cast<uint32_t>(step));
    const bool due = o.checkpoint_every > 0 && (step + 1) % o.checkpoint_every == 0;
    const bool stop = stop_requested(o);
    if (due || stop) save_checkpoint(module, o, step + 1);
    if (stop && step + 1 < end) {
      std::fprintf(stderr, "mobizo_runner: stopped after step %llu\n", static_cast<unsigned long long>(step));
      return kExitStopped;
    }
  }
  save_checkpoint(module, o, std::max(step, end));
  mobizo::write_b(o.out_b, get_b(module));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  try {
    if (argc > 1 && std::string(argv[1]) == "evaluate") return mobizo::evaluate(argc - 2, argv + 2);
    if (argc > 1 && std::string(argv[1]) == "generate") return mobizo::generate(argc - 2, argv + 2);
    if (argc > 1 && std::string(argv[1]) == "forward") return mobizo::forward(argc - 2, argv + 2);
    return train(parse_args(argc - 1, argv + 1));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "mobizo_runner: usage error: %s\n", e.what());
    return kExitUsage;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mobizo_runner: error: %s\n", e.what());
    return 1;
  }
}
