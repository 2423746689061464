// The runner's generate mode (generate.cpp): greedy generation with a mobizo inference program.
#pragma once

#include <stdexcept>

namespace mobizo {

// Bad arguments to the generate mode (exit code 2).
struct GenerateUsage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs `mobizo_runner generate ARGS...` (argv without the program name and "generate"); returns the exit code.
int generate(int argc, char** argv);

}  // namespace mobizo
