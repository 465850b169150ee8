// Single-copy reads of a peer's memory (process_vm_readv), and the
// all-reduce built on them.
//
// All-reduce, single copy (single_copy_bytes to single_copy_max_bytes, when
// every rank may read every other one): each rank publishes the addresses of
// its input and output with its descriptor and arrives. The tensor is then
// cut into steps of kStepBytes per rank, each step cut into one slice per
// rank. In step j rank r reads slice r of chunk j from every peer's input
// into a private scratch buffer, 256 KiB at a time (so that it is still in
// cache when it is reduced), and reduces it, in rank order, into its
// output (its own contribution straight from its input); and reads the
// other slices of chunk j - 1, which their ranks reduced in step j - 1,
// straight from those ranks' outputs into its own. Every rank arrives after
// each step, so no rank overwrites an input a peer still reads (in-place
// calls included) or returns while a peer still reads its output. Per rank
// and byte: (n-1)/n read from peers twice (once for the reduction, once for
// the result) and one local pass for the reduction; no byte goes through
// the segment. Every element is reduced once, by one rank, in rank order, as
// in the staged algorithms: results are bitwise identical whichever
// algorithm ran.

#include "detail/shm_single_copy.h"

#include "detail/shm_comm.h"
#include "detail/shm_memory.h"

#include "commgrad/util/error.h"

#include <c10/util/StringUtil.h>

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace commgrad::backend::detail {
namespace {

const volatile uint64_t probe_word = kSingleCopyProbe;

// Bytes of its slice each rank reduces per step: large enough that the
// system calls do not count, small enough that a step's data stays in cache.
constexpr int64_t kStepBytes = 2 << 20;
// Bytes of a peer's slice read (and then reduced) at a time: the scratch stays in L2.
constexpr int64_t kPieceBytes = 256 << 10;

}  // namespace

uint64_t single_copy_probe_address() { return reinterpret_cast<uint64_t>(&probe_word); }

int read_process(int32_t pid, uint64_t remote_address, void* local, int64_t bytes) {
  auto* to = static_cast<uint8_t*>(local);
  while (bytes > 0) {
    iovec mine{to, static_cast<size_t>(bytes)};
    iovec theirs{reinterpret_cast<void*>(remote_address), static_cast<size_t>(bytes)};
    const ssize_t got = process_vm_readv(pid, &mine, 1, &theirs, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EFAULT;
    to += got;
    remote_address += static_cast<uint64_t>(got);
    bytes -= got;
  }
  return 0;
}

bool can_read_process(int32_t pid, uint64_t probe_address) {
  uint64_t value = 0;
  return probe_address != 0 && read_process(pid, probe_address, &value, sizeof(value)) == 0 &&
         value == kSingleCopyProbe;
}

std::string read_process_error(int err) {
  return c10::str("process_vm_readv: ", std::strerror(err), " (errno ", err, ")",
                  err == ESRCH ? "; the process is gone" : "");
}

void Comm::agree_on_single_copy(const SingleCopyPolicy& policy) {
  // Peers of another pid namespace have pids that mean nothing here.
  bool can = true;
  for (int q = 0; q < size_ && can; ++q) {
    const RankBlock& b = segment_->rank_block(q);
    can = q == rank_ || (b.pid_namespace == segment_->rank_block(rank_).pid_namespace &&
                         can_read_process(b.pid.load(std::memory_order_acquire), b.probe_address));
  }
  segment_->rank_block(rank_).can_read_peers.store(can ? 1 : 0, std::memory_order_release);
  Call call;
  call.op = "init";
  call.timeout = policy.timeout;
  call.deadline = std::chrono::steady_clock::now() + policy.timeout;
  arrive_and_wait(call, /*set=*/0);  // before any collective: set 0 is free
  for (int q = 0; q < size_; ++q) {
    if (segment_->rank_block(q).can_read_peers.load(std::memory_order_acquire) == 0) return;
  }
  single_copy_ = policy;
}

void Comm::read_peer(const Call& call, int peer, uint64_t address, void* local, int64_t bytes) {
  const int err = read_process(segment_->rank_block(peer).pid.load(std::memory_order_relaxed), address, local, bytes);
  if (err == 0) return;
  const std::string what = c10::str("cannot read ", bytes, " bytes of rank ", peer, "'s tensor (single-copy ", call.op,
                                    "): ", read_process_error(err));
  abort(c10::str("rank ", rank_, ": ", what));
  COMMGRAD_THROW(::commgrad::ErrorKind::kPeerFailed, ::commgrad::make_site(call.op, context_), what);
}

void Comm::allreduce_single_copy(const Call& call, const uint8_t* in, uint8_t* out, int64_t count,
                                 c10::ScalarType dtype, RedOp op) {
  const auto es = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t align = std::max<int64_t>(1, 64 / es);
  const int64_t chunk = std::max<int64_t>(align, kStepBytes / es) * size_;
  const int64_t nchunks = ceil_div(count, chunk);
  const OpDescriptor d = begin(call, OpKind::kAllreduce, dtype, static_cast<int32_t>(op), -1, count * es);
  const int set = next_set();
  int64_t* aux = segment_->aux(set, rank_);
  aux[0] = address_of(in);
  aux[1] = address_of(out);
  publish(set, d);
  arrive_and_wait(call, set);
  check_agreement(call, set, true);
  std::vector<uint64_t> inputs(static_cast<size_t>(size_));
  std::vector<uint64_t> outputs(static_cast<size_t>(size_));
  for (int q = 0; q < size_; ++q) {
    inputs[q] = static_cast<uint64_t>(segment_->aux(set, q)[0]);
    outputs[q] = static_cast<uint64_t>(segment_->aux(set, q)[1]);
  }
  const int64_t piece = std::max<int64_t>(align, kPieceBytes / es);
  scratch_.resize(static_cast<size_t>((size_ - 1) * piece * es));
  // Step j reduces this rank's slice of chunk j and copies the other slices
  // of chunk j - 1, which their ranks reduced in step j - 1.
  for (int64_t j = 0; j <= nchunks; ++j) {
    if (j < nchunks) {
      const int64_t off = j * chunk;
      const int64_t c = std::min(chunk, count - off);
      const int64_t b = off + slice_begin(c, rank_, size_, align);
      const int64_t len = off + slice_begin(c, rank_ + 1, size_, align) - b;
      // Piece by piece, so that what was read is still in cache when it is reduced.
      for (int64_t p = b; p < b + len; p += piece) {
        const int64_t plen = std::min(piece, b + len - p);
        for (int q = 0, k = 0; q < size_; ++q) {
          if (q == rank_) {
            srcs_[q] = in + p * es;
            continue;
          }
          uint8_t* to = scratch_.data() + k++ * piece * es;
          read_peer(call, q, inputs[q] + p * es, to, plen * es);
          srcs_[q] = to;
        }
        reduce_into(out + p * es, nullptr, srcs_.data(), size_, plen, dtype, op, size_);
      }
    }
    if (j > 0) {
      const int64_t off = (j - 1) * chunk;
      const int64_t c = std::min(chunk, count - off);
      for (int q = 0; q < size_; ++q) {
        const int64_t b = off + slice_begin(c, q, size_, align);
        const int64_t e = off + slice_begin(c, q + 1, size_, align);
        if (q != rank_ && e > b) read_peer(call, q, outputs[q] + b * es, out + b * es, (e - b) * es);
      }
    }
    // No rank overwrites an input a peer still reads, or leaves while a peer reads its output.
    arrive_and_wait(call, set);
  }
}

}  // namespace commgrad::backend::detail
