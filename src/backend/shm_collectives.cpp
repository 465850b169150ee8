// The shm collectives: every rank of a group, in one segment, step by step.
// (Waiting, agreement and point to point are in shm_comm.cpp.)
//
// Steps and buffer sets. A collective is a sequence of steps. In a step
// each rank writes what the others need into buffer set `step % 3` of the
// segment (its own slot of chunk_bytes, or, for a root, the whole set),
// arrives at the group barrier, and then reads what it needs. A set is
// read at most until the reader arrives at the barrier two steps later,
// and written again only three steps later, after that barrier: so no
// step waits for a reader to release a buffer (but in a broadcast's paced
// steps, below), and consecutive steps (and consecutive collectives)
// pipeline with one barrier each.
//
// All-reduce, large: each chunk of chunk_bytes per rank is cut into n
// slices, one per rank. Iteration j copies this rank's chunk j, minus its
// own slice, into its slot; reduces its own slice of chunk j-1 over all
// ranks in rank order (its own contribution straight from its input) into
// its output and into its slot; arrives; then copies the other ranks'
// reduced slices of chunk j-1 into its output. Reduction work is spread
// over all ranks and every element is reduced once, by one rank, in a
// fixed order: results are bitwise identical everywhere. Per rank, a
// 2-rank all-reduce of B bytes copies B/2 in, reduces B/2 and copies B/2
// out. All-reduce, small (up to kSmallBytes): every rank copies its whole
// input in, arrives once, and reduces everything itself, in rank order, so
// the result is again identical on every rank; one barrier instead of two.
//
// All-reduce, single copy (large tensors, when every rank may read the
// others' memory): see shm_single_copy.cpp.
//
// Broadcast stages up to n x chunk_bytes of the root's tensor per step.
// Only the root writes, so between its first step (every rank, for the
// agreement) and its last (every rank, so that the next collective finds
// the sets as after any other), the steps are paced by the root alone: a
// reader waits for the root's arrival only, not for the other readers, and
// the root writes a set again once every rank has arrived at the step
// after the one that set last held (at most two steps ahead of the slowest
// reader). Readers no longer move in lockstep: with ranks outnumbering
// cores, 4 ranks on 2, a 4-64 MiB broadcast took 3-21 % fewer cycles.
//
// The other collectives take one step (one barrier) per chunk: all-gather
// and gather stage chunk_bytes of every rank's input in its slot; scatter
// stages a part for each rank in that rank's slot; reduce-scatter and
// all-to-all stage a piece of chunk_bytes / n for each destination in the
// sender's slot, where each destination has a room of its own (see
// piece_offset). All-to-all pieces of single_copy_piece_bytes and more
// (when every rank may read every other one) skip the segment: the sender
// publishes their addresses with its descriptor, the receiver reads each
// with one process_vm_readv after the first barrier, and a closing barrier
// keeps every input as it is until its readers are done. Both ends of a
// pair know the piece's size (they must agree on it, and do so before any
// read), so both decide alike; smaller pieces of the same call are
// staged. Sizes may differ between ranks where the op allows it
// (all-gather, gather, scatter, all-to-all): every rank publishes its
// sizes with its descriptor, all ranks check them against each other, and
// the number of steps is the largest staged piece over all ranks.

#include "detail/shm_comm.h"
#include "detail/shm_copy.h"
#include "detail/shm_memory.h"

#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <cstring>

namespace commgrad::backend::detail {
namespace {

// Up to this many bytes an all-reduce uses the one-barrier algorithm.
constexpr int64_t kSmallBytes = 32 * 1024;
// Up to this many bytes an all-gather copies a rank's own part between its
// arrival and its wait (see Comm::allgather).
constexpr int64_t kOwnAtArrivalBytes = 16 * 1024;
// From this size on a broadcast's or all-gather's result goes from the
// segment into the caller's tensor with streaming stores: a result this
// large leaves the caches anyway, and ordinary stores would first fetch
// every line of it from memory. Blocks of calls alternating the two inside
// one process: broadcast 16-64 MiB 7-18 % fewer cycles at 2 and 4 ranks
// (4 MiB: between 8 % more and 10 % fewer, hence 16), all-gather 16-64 MiB
// 1-17 %. All-reduce and all-to-all were level or slower and copy out with
// ordinary stores.
constexpr int64_t kStreamResultBytes = 16 << 20;

// Where a staged part of `len` bytes that one step holds goes in its room
// of `room` bytes (a broadcast's set, an all-gather's or a scatter's slot)
// in collective `seq`: page-aligned positions taken in turn, so that a rank
// writes lines its readers last read several calls ago, gone from their
// caches, rather than the lines they read at the last use of the set (a
// write to those waits for every reader's copy to be invalidated: the
// "slow mode" of the 64 KiB broadcast). Every rank computes it alike from
// the part's size. Blocks of calls alternating with the fixed position
// inside one process, fresh inputs, time per collective B/A, 256 KiB
// slots: 2 ranks, broadcast 16 KiB 0.92, 32 KiB 0.87, 64 KiB 0.88,
// 128 KiB 0.86 (0.99 in processes fast either way); all-gather of 16, 32
// and 64 KiB parts 0.99, 0.96 and 0.92; 4 ranks, broadcast 64 KiB 0.76,
// 128 KiB 0.83 (2 processes of 15 at 1.38), 256 KiB 0.92, all-gather of
// 16 KiB parts 0.93, scatter of 16 and 64 KiB parts 0.81 and 0.79; 2 ranks'
// 512 KiB slots, scatter of 32 and 128 KiB parts 0.93 and 0.87. Parts under
// kMinMovingBytes, whose copies wait on latency, not bandwidth, lose
// (broadcast 4 KiB 1.40, all-gather of 2 and 8 KiB parts 1.12 and 1.01),
// and so do parts with fewer than kMinPositions positions (2 ranks' 256 KiB
// slots: broadcast 256 KiB 0.99, 128 KiB all-gather parts 1.02): both stay
// at the start of their room.
constexpr int64_t kMinMovingBytes = 16 * 1024;
constexpr int64_t kMinPositions = 4;
int64_t staging_offset(uint64_t seq, int64_t len, int64_t room) {
  const int64_t stride = (len + 4095) / 4096 * 4096;
  if (len < kMinMovingBytes || room / stride < kMinPositions) return 0;
  return static_cast<int64_t>(seq % static_cast<uint64_t>(room / stride)) * stride;
}

// Where the part that rank `from` sends rank `to` goes in from's slot of
// `chunk` bytes, in a reduce-scatter or all-to-all of `n` ranks and
// collective `seq`: each of from's n - 1 destinations has a room of 1/(n-1)
// of the slot (page-aligned where that still holds a step's `piece`; its
// own part never leaves home), and a part of a quarter of its room or less
// moves through it (staging_offset). Blocks of calls alternating with the
// old layout (one piece of chunk/n per rank, fixed), fresh inputs, time
// per collective B/A: 2 ranks (512 KiB slots), all-to-all 64 and 256 KiB
// 0.87 and 0.90, reduce-scatter 0.87 and 0.84; 4 ranks, reduce-scatter
// 64 KiB 0.85, all-to-all 64 KiB 0.97; sizes whose parts stay put level.
int64_t piece_offset(uint64_t seq, int from, int to, int64_t len, int64_t piece, int64_t chunk, int n) {
  const int64_t share = chunk / (n - 1);
  const int64_t room = share / 4096 * 4096 >= piece ? share / 4096 * 4096 : share / 64 * 64;
  return (to - (to > from ? 1 : 0)) * room + staging_offset(seq, len, room);
}

int64_t clamp_len(int64_t total, int64_t off, int64_t cap) { return std::max<int64_t>(0, std::min(cap, total - off)); }

// memmove where the two may overlap (a caller's in-place buffers), else copy_bytes.
void copy(void* dst, const void* src, int64_t bytes) {
  if (bytes <= 0 || dst == src) return;
  if (overlap(dst, bytes, src, bytes)) {
    std::memmove(dst, src, static_cast<size_t>(bytes));
  } else {
    copy_bytes(dst, src, bytes);
  }
}

// True when writing this rank's outputs may change an input before it is
// sent: an output overlaps an input other than its twin (outs[q] == ins[q]
// with the same size, in place: step k writes the part that step k has
// already staged), or, when peers may read the inputs directly
// (`direct`), any input but this rank's own overlaps an output.
bool outputs_overlap_inputs(const void* const* ins, const int64_t* in_bytes, void* const* outs,
                            const int64_t* out_bytes, int n, int rank, bool direct) {
  for (int q = 0; q < n; ++q) {
    for (int p = 0; p < n; ++p) {
      if (!overlap(ins[q], in_bytes[q], outs[p], out_bytes[p])) continue;
      const bool twin = p == q && ins[q] == outs[p] && in_bytes[q] == out_bytes[p];
      if (!twin || (direct && q != rank)) return true;
    }
  }
  return false;
}

// Copies the n inputs into `storage` and returns where each copy is.
std::vector<const void*> copy_inputs(const void* const* ins, const int64_t* in_bytes, int n,
                                     std::vector<uint8_t>* storage) {
  int64_t total = 0;
  for (int q = 0; q < n; ++q) total += in_bytes[q];
  storage->resize(static_cast<size_t>(total));
  std::vector<const void*> copies(static_cast<size_t>(n));
  int64_t at = 0;
  for (int q = 0; q < n; at += in_bytes[q], ++q) {
    copy(storage->data() + at, ins[q], in_bytes[q]);
    copies[q] = storage->data() + at;
  }
  return copies;
}

// f(q) for every other rank q, starting after `rank`: ranks that read from
// every peer at once start on different ones.
template <class F>
void for_each_peer(int rank, int n, F&& f) {
  for (int i = 1; i < n; ++i) f((rank + i) % n);
}

}  // namespace

void Comm::copy_result(void* dst, const void* src, int64_t bytes, int64_t result_bytes) const {
  // Large results stream unless the group keeps every store ordinary.
  if (stores_.mode() != StoreMode::kCached && result_bytes >= kStreamResultBytes) {
    copy_streaming(dst, src, bytes);  // a result never overlaps the segment
  } else {
    copy_bytes(dst, src, bytes);
  }
}

void Comm::allreduce(const Call& call, const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op) {
  reduce(call, in, out, count, dtype, op, /*root=*/-1);  // root -1: every rank gets the result
}

void Comm::reduce(const Call& call, const void* in, void* out, int64_t count, c10::ScalarType dtype, RedOp op,
                  int root) {
  const int64_t bytes = count * static_cast<int64_t>(c10::elementSize(dtype));
  const auto* i = static_cast<const uint8_t*>(in);
  auto* o = static_cast<uint8_t*>(out);
  if (bytes <= std::min<int64_t>(kSmallBytes, segment_->layout().chunk_bytes)) {
    allreduce_small(call, i, o, count, dtype, op, root);
  } else if (root < 0 && single_copy(bytes)) {
    allreduce_single_copy(call, i, o, count, dtype, op);
  } else {
    allreduce_pipelined(call, i, o, count, dtype, op, root);
  }
}

void Comm::allreduce_small(const Call& call, const uint8_t* in, uint8_t* out, int64_t count, c10::ScalarType dtype,
                           RedOp op, int root) {
  const int64_t bytes = count * static_cast<int64_t>(c10::elementSize(dtype));
  const OpDescriptor d =
      begin(call, root < 0 ? OpKind::kAllreduce : OpKind::kReduce, dtype, static_cast<int32_t>(op), root, bytes);
  const int set = next_set();
  publish(set, d);
  if (size_ > 1 && rank_ != root) stores_.copy(segment_->slot(set, rank_), in, bytes);
  arrive_and_wait(call, set);
  check_agreement(call, set, true);
  if (root >= 0 && rank_ != root) return;
  for (int q = 0; q < size_; ++q) srcs_[q] = q == rank_ ? in : segment_->slot(set, q);
  reduce_into(out, nullptr, srcs_.data(), size_, count, dtype, op, size_);
}

void Comm::allreduce_pipelined(const Call& call, const uint8_t* in, uint8_t* out, int64_t count, c10::ScalarType dtype,
                               RedOp op, int root) {
  const auto es = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t chunk = static_cast<int64_t>(segment_->layout().chunk_bytes) / es;  // elements per step
  const int64_t nchunks = ceil_div(count, chunk);
  const int64_t align = std::max<int64_t>(1, 64 / es);
  const bool gets_result = root < 0 || root == rank_;
  // Slice q of a chunk of c elements: [begin(c, q), begin(c, q + 1)).
  auto begin_of = [&](int64_t c, int q) { return slice_begin(c, q, size_, align); };
  const OpDescriptor d =
      begin(call, root < 0 ? OpKind::kAllreduce : OpKind::kReduce, dtype, static_cast<int32_t>(op), root, count * es);
  int prev_set = 0;
  int64_t prev_off = 0;
  int64_t prev_c = 0;
  for (int64_t j = 0; j <= nchunks; ++j) {
    const int set = next_set();
    if (j == 0) publish(set, d);
    const int64_t off = j * chunk;
    const int64_t c = j < nchunks ? std::min(chunk, count - off) : 0;
    if (c > 0) {
      // Everything but this rank's own slice: the others reduce it.
      const int64_t b = begin_of(c, rank_);
      const int64_t e = begin_of(c, rank_ + 1);
      uint8_t* s = segment_->slot(set, rank_);
      stores_.copy(s, in + off * es, b * es);
      stores_.copy(s + e * es, in + (off + e) * es, (c - e) * es);
    }
    if (j > 0) {
      const int64_t b = begin_of(prev_c, rank_);
      const int64_t e = begin_of(prev_c, rank_ + 1);
      if (e > b) {
        for (int q = 0; q < size_; ++q) {
          srcs_[q] = (q == rank_ ? in + prev_off * es : segment_->slot(prev_set, q)) + b * es;
        }
        void* to_shm = (root < 0 || root != rank_) ? segment_->slot(prev_set, rank_) + b * es : nullptr;
        void* to_out = gets_result ? out + (prev_off + b) * es : nullptr;
        reduce_into(to_shm, to_out, srcs_.data(), size_, e - b, dtype, op, size_);
      }
    }
    arrive_and_wait(call, set);
    if (j == 0) check_agreement(call, set, true);
    if (j > 0 && gets_result) {
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        const int64_t b = begin_of(prev_c, q);
        const int64_t e = begin_of(prev_c, q + 1);
        copy(out + (prev_off + b) * es, segment_->slot(prev_set, q) + b * es, (e - b) * es);
      }
    }
    prev_set = set;
    prev_off = off;
    prev_c = c;
  }
}

void Comm::broadcast(const Call& call, void* data, int64_t bytes, c10::ScalarType dtype, int root) {
  auto* p = static_cast<uint8_t*>(data);
  const OpDescriptor d = begin(call, OpKind::kBroadcast, dtype, -1, root, bytes);
  const int64_t cap = static_cast<int64_t>(segment_->layout().chunk_bytes) * size_;  // the whole set
  const int64_t nsteps = std::max<int64_t>(1, ceil_div(bytes, cap));
  std::array<Arrival, kSets> arrivals{};  // this rank's arrivals at the last kSets steps
  // Where one step's broadcast goes in the set (staging_offset; 0 for a longer one).
  const int64_t at_offset = staging_offset(d.seq, bytes, cap);
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) publish(set, d);
    const int64_t len = clamp_len(bytes, k * cap, cap);
    // Steps between the first and the last are paced by the root (see the top of this file).
    const bool paced = k > 0 && k < nsteps - 1;
    if (rank_ == root && size_ > 1) {
      // The set last held step k - kSets, which every rank has read once it
      // arrived at the step after it (known without a wait after a step with a barrier).
      if (k >= kSets - 1) wait_for_peers(call, arrivals[(k - (kSets - 1)) % kSets]);
      stores_.copy(segment_->slot(set, 0) + at_offset, p + k * cap, len);
    }
    const Arrival at = arrive(set, paced && rank_ == root ? Wake::kAnySleeper : Wake::kWhenAllArrived);
    arrivals[k % kSets] = at;
    if (!paced) {
      wait_for_peers(call, at);
      if (k == 0) check_agreement(call, set, true);
    } else if (rank_ != root) {
      wait_for_rank(call, at, root);
    }
    if (rank_ != root) copy_result(p + k * cap, segment_->slot(set, 0) + at_offset, len, bytes);
  }
}

void Comm::allgather(const Call& call, const void* in, int64_t in_bytes, void* const* outs, const int64_t* out_bytes,
                     c10::ScalarType dtype, int root) {
  const auto* src = static_cast<const uint8_t*>(in);
  const bool receives = root < 0 || root == rank_;
  const bool stages = size_ > 1 && rank_ != root;
  // This rank's own part goes into its output with each step's write into
  // the segment, block by block, so that the input is read once (the
  // second copy reads from L1), unless the two overlap. A small part is
  // copied after the arrival instead, while the peers learn of it (2 ranks:
  // 4 and 16 KiB 1-5 % faster; 64 KiB, reading the input twice, 1 % slower).
  auto* own = receives ? static_cast<uint8_t*>(outs[rank_]) : nullptr;
  const bool own_with_steps =
      stages && own != nullptr && out_bytes[rank_] == in_bytes && !overlap(own, in_bytes, src, in_bytes);
  const int64_t cap = static_cast<int64_t>(segment_->layout().chunk_bytes);
  const bool own_at_arrival = own_with_steps && in_bytes <= std::min(cap, kOwnAtArrivalBytes);
  const OpDescriptor d = begin(call, root < 0 ? OpKind::kAllgather : OpKind::kGather, dtype, -1, root, in_bytes);
  int64_t result_bytes = 0;
  for (int q = 0; receives && q < size_; ++q) result_bytes += out_bytes[q];
  int64_t nsteps = 1;  // known after the first barrier
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) {
      int64_t* aux = segment_->aux(set, rank_);
      for (int q = 0; q < size_; ++q) aux[q] = receives ? out_bytes[q] : -1;
      publish(set, d);
    }
    const int64_t off = k * cap;
    // A part of one step moves through its slot (staging_offset: 0 for a
    // longer one); after its step such a part copies nothing.
    uint8_t* mine = segment_->slot(set, rank_) + staging_offset(d.seq, in_bytes, cap);
    if (own_with_steps && !own_at_arrival) {
      stores_.copy_twice(mine, own + off, src + off, clamp_len(in_bytes, off, cap));
    } else if (stages) {
      stores_.copy(mine, src + off, clamp_len(in_bytes, off, cap));
    }
    const Arrival at = arrive(set);
    if (k == 0 && own_at_arrival) copy(own, src, in_bytes);
    wait_for_peers(call, at);
    if (k == 0) {
      check_agreement(call, set, false);
      int64_t most = 0;
      for (int q = 0; q < size_; ++q) {
        const int64_t sends = segment_->desc(set, q).bytes;
        most = std::max(most, sends);
        for (int x = 0; x < size_; ++x) {
          const int64_t expects = segment_->aux(set, x)[q];
          if (expects >= 0 && expects != sends) {
            fail(call, c10::str("rank ", x, " expects ", expects, " bytes from rank ", q, ", which sends ", sends,
                                " bytes (output sizes must match every rank's input)"));
          }
        }
      }
      nsteps = std::max<int64_t>(1, ceil_div(most, cap));
      if (receives && !own_with_steps) copy(own, src, in_bytes);
    }
    if (!receives) continue;
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      const uint8_t* theirs = segment_->slot(set, q) + staging_offset(d.seq, out_bytes[q], cap);
      copy_result(static_cast<uint8_t*>(outs[q]) + off, theirs, clamp_len(out_bytes[q], off, cap), result_bytes);
    }
  }
}

void Comm::scatter(const Call& call, const void* const* ins, const int64_t* in_bytes, void* out, int64_t out_bytes,
                   c10::ScalarType dtype, int root) {
  auto* dst = static_cast<uint8_t*>(out);
  const OpDescriptor d = begin(call, OpKind::kScatter, dtype, -1, root, out_bytes);
  const int64_t cap = static_cast<int64_t>(segment_->layout().chunk_bytes);
  int64_t nsteps = 1;
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) {
      int64_t* aux = segment_->aux(set, rank_);
      for (int q = 0; q < size_; ++q) aux[q] = rank_ == root ? in_bytes[q] : -1;
      publish(set, d);
    }
    const int64_t off = k * cap;
    if (rank_ == root) {
      for (int q = 0; q < size_; ++q) {
        if (q == rank_) continue;
        const int64_t at = staging_offset(d.seq, in_bytes[q], cap);
        stores_.copy(segment_->slot(set, q) + at, static_cast<const uint8_t*>(ins[q]) + off,
                     clamp_len(in_bytes[q], off, cap));
      }
    }
    arrive_and_wait(call, set);
    if (k == 0) {
      check_agreement(call, set, false);
      int64_t most = 0;
      for (int q = 0; q < size_; ++q) {
        const int64_t expects = segment_->desc(set, q).bytes;
        const int64_t sends = segment_->aux(set, root)[q];
        most = std::max(most, sends);
        if (expects != sends) {
          fail(call,
               c10::str("root ", root, " sends ", sends, " bytes to rank ", q, ", which expects ", expects, " bytes"));
        }
      }
      nsteps = std::max<int64_t>(1, ceil_div(most, cap));
      if (rank_ == root) copy(dst, ins[rank_], out_bytes);
    }
    const int64_t at = staging_offset(d.seq, out_bytes, cap);
    if (rank_ != root) copy(dst + off, segment_->slot(set, rank_) + at, clamp_len(out_bytes, off, cap));
  }
}

void Comm::reduce_scatter(const Call& call, const void* const* ins, void* out, int64_t count, c10::ScalarType dtype,
                          RedOp op) {
  const auto es = static_cast<int64_t>(c10::elementSize(dtype));
  auto* dst = static_cast<uint8_t*>(out);
  // A step takes one piece per destination rank (see piece_offset).
  const auto chunk = static_cast<int64_t>(segment_->layout().chunk_bytes);
  const int64_t piece = chunk / size_ / 64 * 64;
  const int64_t per = piece / es;
  const OpDescriptor d = begin(call, OpKind::kReduceScatter, dtype, static_cast<int32_t>(op), -1, count * es);
  const int64_t nsteps = std::max<int64_t>(1, ceil_div(count, per));
  for (int64_t k = 0; k < nsteps; ++k) {
    const int set = next_set();
    if (k == 0) publish(set, d);
    const int64_t off = k * per;
    const int64_t c = clamp_len(count, off, per);
    uint8_t* mine = segment_->slot(set, rank_);
    for (int q = 0; q < size_; ++q) {
      if (q != rank_)
        stores_.copy(mine + piece_offset(d.seq, rank_, q, count * es, piece, chunk, size_),
                     static_cast<const uint8_t*>(ins[q]) + off * es, c * es);
    }
    arrive_and_wait(call, set);
    if (k == 0) check_agreement(call, set, true);
    if (c == 0) continue;
    for (int x = 0; x < size_; ++x) {
      srcs_[x] = x == rank_ ? static_cast<const uint8_t*>(ins[rank_]) + off * es
                            : segment_->slot(set, x) + piece_offset(d.seq, x, rank_, count * es, piece, chunk, size_);
    }
    reduce_into(dst + off * es, nullptr, srcs_.data(), size_, c, dtype, op, size_);
  }
}

void Comm::alltoall(const Call& call, const void* const* ins, const int64_t* in_bytes, void* const* outs,
                    const int64_t* out_bytes, c10::ScalarType dtype) {
  const auto chunk = static_cast<int64_t>(segment_->layout().chunk_bytes);
  const int64_t piece = chunk / size_ / 64 * 64;
  // An output that overlaps an input it does not replace piece for piece
  // (uneven splits in place), or any overlap while peers may read the
  // inputs directly: this rank sends from a copy of its inputs.
  bool may_read_directly = false;
  for (int q = 0; q < size_; ++q) {
    may_read_directly |= q != rank_ && (reads_directly(in_bytes[q]) || reads_directly(out_bytes[q]));
  }
  std::vector<uint8_t> storage;
  std::vector<const void*> copies;
  if (outputs_overlap_inputs(ins, in_bytes, outs, out_bytes, size_, rank_, may_read_directly)) {
    copies = copy_inputs(ins, in_bytes, size_, &storage);
    ins = copies.data();
  }
  const OpDescriptor d = begin(call, OpKind::kAlltoall, dtype, -1, -1, 0);
  int64_t nsteps = 1;
  bool any_direct = false;
  int set = 0;
  for (int64_t k = 0; k < nsteps; ++k) {
    set = next_set();
    if (k == 0) {
      int64_t* aux = segment_->aux(set, rank_);
      for (int q = 0; q < size_; ++q) {
        aux[q] = in_bytes[q];
        aux[size_ + q] = out_bytes[q];
        aux[2 * size_ + q] = address_of(ins[q]);
      }
      publish(set, d);
    }
    const int64_t off = k * piece;
    uint8_t* mine = segment_->slot(set, rank_);
    for (int q = 0; q < size_; ++q) {
      if (q != rank_ && !reads_directly(in_bytes[q]))
        stores_.copy(mine + piece_offset(d.seq, rank_, q, in_bytes[q], piece, chunk, size_),
                     static_cast<const uint8_t*>(ins[q]) + off, clamp_len(in_bytes[q], off, piece));
    }
    // This rank's own piece goes over while the arrival travels (when its
    // sizes match; otherwise the agreement below fails the call).
    const bool own_at_arrival = k == 0 && in_bytes[rank_] == out_bytes[rank_];
    const Arrival at = arrive(set);
    if (own_at_arrival) copy(outs[rank_], ins[rank_], in_bytes[rank_]);
    wait_for_peers(call, at);
    if (k == 0) {
      check_agreement(call, set, true);
      int64_t most = 0;
      for (int x = 0; x < size_; ++x) {
        for (int q = 0; q < size_; ++q) {
          const int64_t sends = segment_->aux(set, x)[q];
          const int64_t expects = segment_->aux(set, q)[size_ + x];
          if (sends != expects) {
            fail(call, c10::str("rank ", x, " sends ", sends, " bytes to rank ", q, ", which expects ", expects,
                                " bytes from it (input and output split sizes must match across ranks)"));
          }
          if (x == q) continue;
          if (reads_directly(sends)) {
            any_direct = true;
          } else {
            most = std::max(most, sends);
          }
        }
      }
      nsteps = std::max<int64_t>(1, ceil_div(most, piece));
      for_each_peer(rank_, size_, [&](int q) {
        if (reads_directly(out_bytes[q])) {
          read_peer(call, q, static_cast<uint64_t>(segment_->aux(set, q)[2 * size_ + rank_]), outs[q], out_bytes[q]);
        }
      });
    }
    for (int q = 0; q < size_; ++q) {
      if (q == rank_ || reads_directly(out_bytes[q])) continue;
      copy(static_cast<uint8_t*>(outs[q]) + off,
           segment_->slot(set, q) + piece_offset(d.seq, q, rank_, out_bytes[q], piece, chunk, size_),
           clamp_len(out_bytes[q], off, piece));
    }
  }
  // No rank changes (or frees) an input that a peer still reads.
  if (any_direct) arrive_and_wait(call, set);  // in the last step's set
}

}  // namespace commgrad::backend::detail
