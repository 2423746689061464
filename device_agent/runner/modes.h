// The runner's modes besides training (main.cpp): each takes argv without the program name and the mode's name,
// and returns the exit code; bad arguments throw mobizo::UsageError (exit code 2).
#pragma once

namespace mobizo {

// `mobizo_runner evaluate ARGS...` (evaluate.cpp): a training program's evaluate method on rows, under given B's.
int evaluate(int argc, char** argv);

// `mobizo_runner generate ARGS...` (generate.cpp): greedy generation with a mobizo inference program.
int generate(int argc, char** argv);

// `mobizo_runner forward ARGS...` (forward.cpp): times a program's forward on rows of ones.
int forward(int argc, char** argv);

}  // namespace mobizo
