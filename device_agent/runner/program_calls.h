// Calls on a loaded ExecuTorch program that both runner modes make (main.cpp trains, generate.cpp generates).
#pragma once

#include <cstddef>
#include <string>

#include <executorch/extension/module/module.h>

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

}  // namespace mobizo
