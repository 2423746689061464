// File formats of the mobizo runner. The formats themselves are specified once, in Python:
//   batches file  -> device_agent/batches.py      (the writer)
//   checkpoint    -> device_agent/checkpoint.py   (reader and writer of the same bytes)
//   B files       -> raw little-endian float32, D values, no header (--init-b, --out-b)
// This header only mirrors those layouts for the C++ side.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace mobizo {

// A failure that ends the run with exit code 1 and its message on stderr.
struct RunnerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bad arguments: the run ends with exit code 2 and the message on stderr.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A mode's arguments, `--name value` pairs, as a map; a name outside `known` or a name without a value is a
// UsageError, and so is a missing name of `required`.
std::map<std::string, std::string> parse_pairs(int argc, char** argv, const std::set<std::string>& known,
                                               const std::set<std::string>& required);

// A non-negative decimal count; anything else is a UsageError naming the argument.
uint64_t parse_count(const std::string& name, const std::string& text);

// One training step's data, widened to the int64 tensors the program takes, and its learning rate.
struct StepBatch {
  int64_t seed = 0;
  float lr = 0;                         // the step's float32 lr (the job's schedule, written by the agent)
  std::vector<int64_t> input_ids;       // [rows * seq_len]
  std::vector<int64_t> attention_mask;  // [rows * seq_len]
  std::vector<int64_t> targets;         // [rows * answer_len]
};

// Reads fixed-size step records from a batches file; records are addressed by step index,
// so resuming at step k is one seek.
class BatchesReader {
 public:
  explicit BatchesReader(const std::string& path);
  ~BatchesReader();
  BatchesReader(const BatchesReader&) = delete;
  BatchesReader& operator=(const BatchesReader&) = delete;

  uint32_t rows() const { return rows_; }
  uint32_t seq_len() const { return seq_len_; }
  uint32_t answer_len() const { return answer_len_; }
  uint32_t steps() const { return steps_; }
  StepBatch read(uint32_t step);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  uint32_t rows_ = 0, seq_len_ = 0, answer_len_ = 0, steps_ = 0;
  uint64_t record_size() const;
};

struct Checkpoint {
  uint64_t next_step = 0;
  std::string job_id;
  std::vector<float> b;
};

bool file_exists(const std::string& path);
// n float32 values to stdout, comma-separated: %.9g round-trips a float32 exactly; non-finite values use the
// spellings Python's json reads.
void print_floats(const float* v, int64_t n);
std::vector<float> read_b(const std::string& path);
void write_b(const std::string& path, const std::vector<float>& b);
Checkpoint read_checkpoint(const std::string& path);
void write_checkpoint(const std::string& path, const Checkpoint& ckpt);

}  // namespace mobizo
