// DistributedDataParallel: construction (replica check, broadcast from the
// first rank) and the public handle; the per-backward work is in reducer.cpp.
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
// (64-byte aligned) into a few flat byte buffers of at most bucket_cap_mb,
// broadcast from group rank 0 and unpacked: one collective per buffer rather
// than one per tensor, and no dtype the transport cannot move.

#include "commgrad/dp/distributed_data_parallel.h"

#include "commgrad/dist/check.h"
#include "commgrad/dist/parallel_state.h"
#include "commgrad/dist/process_group.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/names.h"
#include "detail/reducer.h"

#include <algorithm>

#include <ATen/ATen.h>

#include <sstream>
#include <unordered_set>

namespace commgrad::dp {
namespace detail {
namespace {

constexpr const char* kOp = "DistributedDataParallel";
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

// Throws, on every rank alike, when the replicas' parameters or buffers differ.
void verify_replicas(const Group& group, const std::vector<NamedTensor>& params,
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
  COMMGRAD_CHECK(false, kOp, group, "the replicas differ (parameters and buffers must have the same names, shapes "
                 "and dtypes in the same order on every rank)", report);
}

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
    COMMGRAD_CHECK(t.device() == device, kOp, group, "all parameters and buffers must be on one device, found ",
                   device, " and ", t.device());
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

}  // namespace detail

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module,
                                                 DistributedDataParallelOptions options)
    : module_(std::move(module)) {
  using detail::kOp;
  Group group = options.group().defined() ? options.group() : default_data_parallel_group();
  options.group(group);
  check_member(kOp, group);
  COMMGRAD_CHECK(module_ != nullptr, kOp, group, "the module is null");
  COMMGRAD_CHECK(options.bucket_cap_mb() > 0 && options.first_bucket_cap_mb() > 0, kOp, group,
                 "bucket sizes must be positive, got bucket_cap_mb ", options.bucket_cap_mb(),
                 " and first_bucket_cap_mb ", options.first_bucket_cap_mb());

  // Parameters and buffers, each tensor once (tied weights have several names).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<detail::NamedTensor> params;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    const auto& p = item.value();
    COMMGRAD_CHECK(p.layout() == at::kStrided, kOp, group, "parameter '", item.key(), "' is not a dense tensor");
    COMMGRAD_CHECK(p.is_leaf(), kOp, group, "parameter '", item.key(), "' is not a leaf tensor");
    params.emplace_back(item.key(), p);
  }
  std::vector<detail::NamedTensor> buffers;
  for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
    if (!item.value().defined() || !seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    buffers.emplace_back(item.key(), item.value());
  }

  // Same replicas everywhere, then rank 0's values everywhere.
  detail::verify_replicas(group, params, buffers);
  std::vector<at::Tensor> state;
  for (const auto& p : params) state.push_back(p.second);
  for (const auto& b : buffers) state.push_back(b.second);
  const auto cap = static_cast<int64_t>(options.bucket_cap_mb() * 1024 * 1024);
  detail::broadcast_from_first(group, state, cap);

  std::vector<detail::NamedTensor> trainable;
  for (const auto& p : params) {
    if (p.second.requires_grad() && p.second.numel() > 0) trainable.push_back(p);
  }
  std::vector<at::Tensor> buffer_tensors;
  for (const auto& b : buffers) buffer_tensors.push_back(b.second);
  reducer_ = std::make_shared<detail::DdpReducer>(group, std::move(options), std::move(trainable),
                                                  std::move(buffer_tensors));
  reducer_->install_hooks();
}

DistributedDataParallel::~DistributedDataParallel() {
  if (reducer_) reducer_->remove_hooks();
}

DistributedDataParallel::DistributedDataParallel(DistributedDataParallel&&) noexcept = default;
DistributedDataParallel& DistributedDataParallel::operator=(DistributedDataParallel&& other) noexcept {
  if (this != &other) {
    if (reducer_) reducer_->remove_hooks();
    module_ = std::move(other.module_);
    reducer_ = std::move(other.reducer_);
  }
  return *this;
}

detail::DdpReducer& DistributedDataParallel::reducer() const {
  TORCH_CHECK(reducer_ != nullptr, "[commgrad] DistributedDataParallel: used after it was moved from");
  return *reducer_;
}

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module() const { return module_; }
const Group& DistributedDataParallel::group() const { return reducer().group(); }
const DistributedDataParallelOptions& DistributedDataParallel::options() const { return reducer().options(); }

DistributedDataParallel::NoSync DistributedDataParallel::no_sync() {
  reducer();
  return NoSync(reducer_);
}

DistributedDataParallel::NoSync::NoSync(std::shared_ptr<detail::DdpReducer> reducer) : reducer_(std::move(reducer)) {
  previous_ = reducer_->sync_enabled();
  reducer_->set_sync_enabled(false);
}

DistributedDataParallel::NoSync::NoSync(NoSync&& other) noexcept
    : reducer_(std::move(other.reducer_)), previous_(other.previous_) {
  other.reducer_.reset();
}

DistributedDataParallel::NoSync::~NoSync() {
  if (reducer_) reducer_->set_sync_enabled(previous_);
}

void DistributedDataParallel::register_comm_hook(CommHook hook) { reducer().set_comm_hook(std::move(hook)); }
void DistributedDataParallel::sync_buffers() { reducer().sync_buffers(); }
std::vector<DdpBucketInfo> DistributedDataParallel::buckets() const { return reducer().bucket_info(); }
DdpStepStats DistributedDataParallel::last_step() const { return reducer().last_step(); }

}  // namespace commgrad::dp
