// Readers and atomic writers for the runner's files (layouts: see runner_io.h).
#include "runner_io.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace mobizo {
namespace {

constexpr char kBatchesMagic[8] = {'M', 'Z', 'B', 'A', 'T', 'C', 'H', '2'};
constexpr char kCheckpointMagic[8] = {'M', 'Z', 'C', 'K', 'P', 'T', '0', '1'};
constexpr size_t kBatchesHeaderSize = 32;
constexpr size_t kStepHeadSize = 16;  // seed int64, lr float32, 4 reserved bytes
constexpr uint32_t kMaxJobIdLen = 4096;

static_assert(sizeof(float) == 4, "float32 expected");

// The formats are little-endian; every target we build for (x86-64, arm64 Android) is too.
bool host_is_little_endian() {
  const uint16_t probe = 1;
  return *reinterpret_cast<const uint8_t*>(&probe) == 1;
}

std::string errno_text() { return std::strerror(errno); }

std::vector<uint8_t> read_all(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw RunnerError("cannot open " + path + ": " + errno_text());
  std::vector<uint8_t> data;
  uint8_t chunk[1 << 16];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof(chunk), f)) > 0) data.insert(data.end(), chunk, chunk + n);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) throw RunnerError("cannot read " + path);
  return data;
}

// Writes to PATH.tmp, fsyncs, renames over PATH and fsyncs the directory: a reader sees the old
// file or the new one, never a torn one, even across a power cut.
void write_atomically(const std::string& path, const std::vector<uint8_t>& data) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw RunnerError("cannot create " + tmp + ": " + errno_text());
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      ::close(fd);
      throw RunnerError("cannot write " + tmp + ": " + errno_text());
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) throw RunnerError("cannot sync " + tmp + ": " + errno_text());
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw RunnerError("cannot rename " + tmp + ": " + errno_text());
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dfd = ::open(dir.c_str(), O_RDONLY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

template <typename T>
void put(std::vector<uint8_t>& out, const T& value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
T get(const std::vector<uint8_t>& in, size_t& pos, const std::string& path) {
  if (pos + sizeof(T) > in.size()) throw RunnerError(path + ": truncated checkpoint");
  T value;
  std::memcpy(&value, in.data() + pos, sizeof(T));
  pos += sizeof(T);
  return value;
}

template <typename Stored>
void widen(const std::vector<uint8_t>& raw, size_t offset, size_t count, std::vector<int64_t>& out) {
  out.resize(count);
  for (size_t i = 0; i < count; ++i) {
    Stored v;
    std::memcpy(&v, raw.data() + offset + i * sizeof(Stored), sizeof(Stored));
    out[i] = static_cast<int64_t>(v);
  }
}

}  // namespace

std::map<std::string, std::string> parse_pairs(int argc, char** argv, const std::set<std::string>& known,
                                               const std::set<std::string>& required) {
  std::map<std::string, std::string> kv;
  for (int i = 0; i < argc; i += 2) {
    const std::string key = argv[i];
    if (key.rfind("--", 0) != 0 || i + 1 >= argc) throw UsageError("expected --name value pairs near " + key);
    if (!known.count(key)) throw UsageError("unknown argument " + key);
    kv[key] = argv[i + 1];
  }
  for (const std::string& key : required)
    if (!kv.count(key)) throw UsageError(key + " is required");
  return kv;
}

uint64_t parse_count(const std::string& name, const std::string& text) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || text[0] == '-' || *end != '\0') throw UsageError(name + ": not a count: " + text);
  return v;
}

void print_floats(const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (i) std::fputc(',', stdout);
    if (std::isnan(v[i])) std::fputs("NaN", stdout);
    else if (std::isinf(v[i])) std::fputs(v[i] > 0 ? "Infinity" : "-Infinity", stdout);
    else std::printf("%.9g", static_cast<double>(v[i]));
  }
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

BatchesReader::BatchesReader(const std::string& path) : path_(path) {
  if (!host_is_little_endian()) throw RunnerError("big-endian hosts are not supported");
  file_ = std::fopen(path.c_str(), "rb");
  if (!file_) throw RunnerError("cannot open " + path + ": " + errno_text());
  uint8_t header[kBatchesHeaderSize];
  if (std::fread(header, 1, sizeof(header), file_) != sizeof(header))
    throw RunnerError(path + ": too short for a batches header");
  if (std::memcmp(header, kBatchesMagic, sizeof(kBatchesMagic)) != 0)
    throw RunnerError(path + ": not a mobizo batches file of this version (bad magic, expected MZBATCH2)");
  std::memcpy(&rows_, header + 8, 4);
  std::memcpy(&seq_len_, header + 12, 4);
  std::memcpy(&answer_len_, header + 16, 4);
  std::memcpy(&steps_, header + 20, 4);
  if (rows_ == 0 || seq_len_ == 0 || answer_len_ == 0 || answer_len_ >= seq_len_)
    throw RunnerError(path + ": bad shape in header");
  struct stat st;
  if (::fstat(fileno(file_), &st) != 0) throw RunnerError("cannot stat " + path);
  const uint64_t expected = kBatchesHeaderSize + record_size() * steps_;
  if (static_cast<uint64_t>(st.st_size) != expected)
    throw RunnerError(path + ": size " + std::to_string(st.st_size) + " does not match its header (" +
                      std::to_string(expected) + " bytes)");
}

BatchesReader::~BatchesReader() {
  if (file_) std::fclose(file_);
}

uint64_t BatchesReader::record_size() const {
  const uint64_t cells = uint64_t(rows_) * seq_len_;
  return kStepHeadSize + cells * 4 + cells * 1 + uint64_t(rows_) * answer_len_ * 4;
}

StepBatch BatchesReader::read(uint32_t step) {
  if (step >= steps_) throw RunnerError(path_ + ": no step " + std::to_string(step));
  std::vector<uint8_t> raw(record_size());
  const uint64_t offset = kBatchesHeaderSize + record_size() * step;
  if (::fseeko(file_, static_cast<off_t>(offset), SEEK_SET) != 0 ||
      std::fread(raw.data(), 1, raw.size(), file_) != raw.size())
    throw RunnerError(path_ + ": cannot read step " + std::to_string(step));
  const size_t cells = size_t(rows_) * seq_len_;
  StepBatch batch;
  std::memcpy(&batch.seed, raw.data(), 8);
  std::memcpy(&batch.lr, raw.data() + 8, 4);
  if (!std::isfinite(batch.lr) || batch.lr <= 0)
    throw RunnerError(path_ + ": step " + std::to_string(step) + " has no positive finite lr");
  widen<int32_t>(raw, kStepHeadSize, cells, batch.input_ids);
  widen<uint8_t>(raw, kStepHeadSize + cells * 4, cells, batch.attention_mask);
  widen<int32_t>(raw, kStepHeadSize + cells * 5, size_t(rows_) * answer_len_, batch.targets);
  return batch;
}

std::vector<float> read_b(const std::string& path) {
  const std::vector<uint8_t> raw = read_all(path);
  if (raw.size() % 4 != 0) throw RunnerError(path + ": size is not a multiple of 4 (float32)");
  std::vector<float> b(raw.size() / 4);
  std::memcpy(b.data(), raw.data(), raw.size());
  return b;
}

void write_b(const std::string& path, const std::vector<float>& b) {
  std::vector<uint8_t> raw(b.size() * 4);
  std::memcpy(raw.data(), b.data(), raw.size());
  write_atomically(path, raw);
}

Checkpoint read_checkpoint(const std::string& path) {
  const std::vector<uint8_t> raw = read_all(path);
  if (raw.size() < 8 || std::memcmp(raw.data(), kCheckpointMagic, 8) != 0)
    throw RunnerError(path + ": not a mobizo checkpoint (bad magic)");
  size_t pos = 8;
  Checkpoint ckpt;
  ckpt.next_step = get<uint64_t>(raw, pos, path);
  const auto id_len = get<uint32_t>(raw, pos, path);
  if (id_len > kMaxJobIdLen || pos + id_len > raw.size()) throw RunnerError(path + ": bad job id length");
  ckpt.job_id.assign(reinterpret_cast<const char*>(raw.data() + pos), id_len);
  pos += id_len;
  const auto d = get<uint64_t>(raw, pos, path);
  if (raw.size() - pos != d * 4) throw RunnerError(path + ": B length does not match the file size");
  ckpt.b.resize(d);
  std::memcpy(ckpt.b.data(), raw.data() + pos, d * 4);
  return ckpt;
}

void write_checkpoint(const std::string& path, const Checkpoint& ckpt) {
  std::vector<uint8_t> raw(kCheckpointMagic, kCheckpointMagic + 8);
  put<uint64_t>(raw, ckpt.next_step);
  put<uint32_t>(raw, static_cast<uint32_t>(ckpt.job_id.size()));
  raw.insert(raw.end(), ckpt.job_id.begin(), ckpt.job_id.end());
  put<uint64_t>(raw, ckpt.b.size());
  const auto* p = reinterpret_cast<const uint8_t*>(ckpt.b.data());
  raw.insert(raw.end(), p, p + ckpt.b.size() * 4);
  write_atomically(path, raw);
}

}  // namespace mobizo
