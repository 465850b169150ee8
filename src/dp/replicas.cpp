// The replicas of a data-parallel group made equal at construction.
//
// Replica check. Each rank describes its module as one line per parameter
// and buffer ("param 'fc1.weight' [8, 4] Float") and all-gathers a 64-bit
// FNV-1a hash of the lines: one tiny collective when the replicas agree.
// When the hashes differ, the ranks all-gather the full descriptions (sizes
// first, then the padded bytes), so every rank can name, for each rank that
// differs from rank 0, the first line where it does, and all ranks throw the
// same error instead of hanging in a later collective of mismatched size.
//
// Broadcast. Parameters and buffers of any dtype are packed as raw bytes
// (64-byte aligned) into a few flat byte buffers of at most `cap_bytes`,
// broadcast from group rank 0 and unpacked: one collective per buffer rather
// than one per tensor, and no dtype the transport cannot move.

#include "commgrad/dp/replicas.h"

#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

namespace commgrad::dp {
namespace {
constexpr int64_t kPackAlignment = 64;

int64_t align_up(int64_t n) { return (n + kPackAlignment - 1) / kPackAlignment * kPackAlignment; }

uint64_t fnv1a(const std::string& text) {
  uint64_t hash = 1469598103934665603ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return hash;
}

std::string describe_tensor(const char* kind, const std::string& name, const at::Tensor& t) {
  return c10::str(kind, " '", name, "' ", tensor_name(t), t.requires_grad() ? "" : " (no grad)");
}

// Every rank's 64-bit `value`, by group rank.
std::vector<int64_t> all_gather_value(const Group& group, int64_t value) {
  const auto all = ops::raw::all_gather(at::full({1}, value, at::kLong), {}, group).wait();
  return std::vector<int64_t>(all.data_ptr<int64_t>(), all.data_ptr<int64_t>() + group.size());
}

// Every rank's `mine`, by group rank.
std::vector<std::string> all_gather_strings(const Group& group, const std::string& mine) {
  const int n = group.size();
  const auto lengths = all_gather_value(group, static_cast<int64_t>(mine.size()));
  const int64_t longest = std::max<int64_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  auto bytes = at::zeros({longest}, at::kByte);
  std::copy(mine.begin(), mine.end(), bytes.data_ptr<uint8_t>());
  const auto gathered = ops::raw::all_gather(bytes, {}, group).wait();
  std::vector<std::string> all;
  for (int r = 0; r < n; ++r) {
    const auto* data = gathered.data_ptr<uint8_t>() + r * longest;
    all.emplace_back(data, data + lengths[r]);
  }
  return all;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

// Throws, on every rank alike, when the replicas' parameters or buffers differ.
void verify_replicas(const char* op, const Group& group, const std::vector<NamedTensor>& params,
                     const std::vector<NamedTensor>& buffers) {
  std::string signature;
  for (const auto& p : params) signature += describe_tensor("parameter", p.first, p.second) + "\n";
  for (const auto& b : buffers) signature += describe_tensor("buffer", b.first, b.second) + "\n";
  if (group.size() == 1) return;

  const auto hashes = all_gather_value(group, static_cast<int64_t>(fnv1a(signature)));
  if (std::all_of(hashes.begin(), hashes.end(), [&](int64_t h) { return h == hashes.front(); })) return;

  const auto all = all_gather_strings(group, signature);
  const auto reference = split_lines(all[0]);
  std::string report;
  for (int r = 1; r < group.size(); ++r) {
    const auto lines = split_lines(all[r]);
    const size_t n = std::max(lines.size(), reference.size());
    for (size_t i = 0; i < n; ++i) {
      const std::string ours = i < lines.size() ? lines[i] : "nothing";
      const std::string theirs = i < reference.size() ? reference[i] : "nothing";
      if (ours == theirs) continue;
      report += c10::str("; entry ", i, ": rank 0 has ", theirs, ", rank ", r, " has ", ours);
      break;
    }
  }
  COMMGRAD_CHECK(false, op, group,
                 "the replicas differ (parameters and buffers must have the same names, shapes "
                 "and dtypes in the same order on every rank)",
                 report);
}

namespace {
at::Tensor as_bytes(const at::Tensor& t) { return t.contiguous().reshape({-1}).view(at::kByte); }
}  // namespace

void broadcast_from_first(const Group& group, const std::vector<at::Tensor>& tensors, int64_t cap_bytes) {
  if (tensors.empty() || group.size() == 1) return;
  at::NoGradGuard no_grad;
  const auto device = tensors.front().device();
  // Pack into chunks of at most cap_bytes (a larger tensor gets its own).
  struct Piece {
    size_t tensor;
    int64_t offset;
  };
  std::vector<std::vector<Piece>> chunks(1);
  std::vector<int64_t> chunk_bytes(1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    COMMGRAD_CHECK(t.device() == device, "broadcast_from_first", group,
                   "all parameters and buffers must be on one device, found ", device, " and ", t.device());
    const int64_t bytes = align_up(t.numel() * static_cast<int64_t>(t.element_size()));
    if (chunk_bytes.back() > 0 && chunk_bytes.back() + bytes > cap_bytes) {
      chunks.emplace_back();
      chunk_bytes.push_back(0);
    }
    chunks.back().push_back(Piece{i, chunk_bytes.back()});
    chunk_bytes.back() += bytes;
  }
  const bool root = group.rank() == 0;
  std::vector<ops::raw::Pending> received;
  for (size_t c = 0; c < chunks.size(); ++c) {
    auto flat = at::empty({std::max<int64_t>(chunk_bytes[c], 1)}, at::TensorOptions(at::kByte).device(device));
    if (root) {
      for (const auto& piece : chunks[c]) {
        const auto bytes = as_bytes(tensors[piece.tensor]);
        flat.narrow(0, piece.offset, bytes.numel()).copy_(bytes);
      }
    }
    received.push_back(ops::raw::broadcast(flat, ops::BroadcastOptions().src(0), group));
  }
  for (size_t c = 0; c < chunks.size(); ++c) {
    const at::Tensor flat = received[c].wait();
    if (root) continue;
    for (const auto& piece : chunks[c]) {
      const auto& t = tensors[piece.tensor];
      const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
      if (bytes == 0) continue;
      t.copy_(flat.narrow(0, piece.offset, bytes).view(t.scalar_type()).reshape(t.sizes()));
    }
  }
}

}  // namespace commgrad::dp
