// Every shm op against a reference computed locally in the backend's fixed
// rank order (bit for bit, which also proves every rank got the same bits)
// and, where Gloo has the op and dtype, against Gloo over the same store.
// Sizes 0, 1, odd, unaligned and larger than the segment (chunk_bytes is
// 1 KiB here, so anything above it is pipelined); 1, 2, 3, 4 and 8 ranks
// (8 threads on a 2-core machine: oversubscribed).

#include "backend/shm_harness.h"

#include <cstring>
#include <numeric>
#include <string>
#include <thread>

namespace {

using namespace shm_test;

const std::vector<int64_t> kSizes = {0, 1, 7, 33, 1000, 5003};

RunOptions chunked(bool gloo) {
  RunOptions o;
  o.shm.chunk_bytes(1024).mailbox_bytes(4096);
  o.gloo = gloo;
  return o;
}

bool shm_reduces(at::ScalarType t, RedOpType op) {
  const bool bitwise = op == RedOpType::BAND || op == RedOpType::BOR || op == RedOpType::BXOR;
  if (t == at::kComplexFloat || t == at::kComplexDouble) return op == RedOpType::SUM || op == RedOpType::AVG;
  if (t == at::kBool) return op != RedOpType::AVG;
  if (at::isFloatingType(t)) return !bitwise;
  return true;
}

bool gloo_reduces(at::ScalarType t, RedOpType op) {
  const bool type_ok =
      t == at::kFloat || t == at::kDouble || t == at::kInt || t == at::kLong || t == at::kChar || t == at::kByte;
  return type_ok && (op == RedOpType::SUM || op == RedOpType::PRODUCT || op == RedOpType::MIN || op == RedOpType::MAX);
}

void expect_close_to_gloo(const at::Tensor& shm, const at::Tensor& gloo, const std::string& what) {
  if (at::isFloatingType(shm.scalar_type())) {
    EXPECT_TRUE(at::allclose(shm, gloo, 1e-5, 1e-5)) << what << ": shm and Gloo differ beyond reordering";
  } else {
    EXPECT_TRUE(at::equal(shm, gloo)) << what << ": shm and Gloo differ";
  }
}

c10d::AllreduceOptions allreduce_op(RedOpType op) {
  c10d::AllreduceOptions o;
  o.reduceOp = op;
  return o;
}

// Every rank may read every other one here (threads of one process), so
// these options send every all-reduce of 64 bytes and more through the
// single-copy algorithm.
RunOptions single_copy() {
  RunOptions o = chunked(false);
  o.shm.single_copy_bytes(64).single_copy_max_bytes(int64_t{1} << 40);
  return o;
}

// All-to-all pieces of 40 bytes and more are read straight from the
// sender, smaller ones staged: most calls below mix the two.
RunOptions direct_pieces() {
  RunOptions o = chunked(true);
  o.shm.single_copy_piece_bytes(40);
  return o;
}

class ShmOps : public ::testing::TestWithParam<int> {};

void allreduce_every_dtype_and_op(int ranks, const RunOptions& options) {
  run_ranks(ranks, options, [](Rank& r) {
    uint64_t salt = 0;
    for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kComplexFloat, at::kChar, at::kShort,
                       at::kInt, at::kLong, at::kByte, at::kBool}) {
      for (auto op : {RedOpType::SUM, RedOpType::AVG, RedOpType::PRODUCT, RedOpType::MIN, RedOpType::MAX,
                      RedOpType::BAND, RedOpType::BOR, RedOpType::BXOR}) {
        if (!shm_reduces(dtype, op)) continue;
        for (int64_t numel : kSizes) {
          ++salt;
          std::vector<at::Tensor> all;
          for (int q = 0; q < r.size; ++q) all.push_back(make_input(numel, dtype, q, salt, op == RedOpType::PRODUCT));
          const at::Tensor expected = reference_reduce(all, op);
          std::vector<at::Tensor> t{all[r.rank].clone()};
          r.shm->allreduce(t, allreduce_op(op))->wait();
          const std::string what = c10::str("allreduce ", dtype, " ", op_name(op), " numel ", numel);
          EXPECT_TRUE(same_bits(t[0], expected)) << what;
          // The out-of-place form: the same bits, and the input untouched.
          const at::Tensor input = all[r.rank].clone();
          const at::Tensor out = at::empty_like(input);
          r.shm->allreduce_out(input, out, allreduce_op(op))->wait();
          EXPECT_TRUE(same_bits(out, expected)) << what << " out of place";
          EXPECT_TRUE(same_bits(input, all[r.rank])) << what << " out of place changed its input";
          if (r.gloo && gloo_reduces(dtype, op) && numel > 0 && numel != 7 && numel != 33) {
            std::vector<at::Tensor> g{all[r.rank].clone()};
            r.gloo->allreduce(g, allreduce_op(op))->wait();
            expect_close_to_gloo(t[0], g[0], what);
          }
        }
      }
    }
  });
}

TEST_P(ShmOps, AllreduceEveryDtypeAndOp) { allreduce_every_dtype_and_op(GetParam(), chunked(true)); }

TEST_P(ShmOps, AllreduceSingleCopyEveryDtypeAndOp) { allreduce_every_dtype_and_op(GetParam(), single_copy()); }

// Several single-copy steps (2 MiB per rank each), the last one short, so
// some ranks' slices are empty; in place and out of place.
TEST_P(ShmOps, AllreduceSingleCopyAcrossSteps) {
  if (GetParam() > 4) GTEST_SKIP() << "tens of MiB per rank at 8 ranks; 2-4 cover the steps";
  run_ranks(GetParam(), single_copy(), [](Rank& r) {
    const int64_t numel = (int64_t{1} << 19) * r.size + 1001;
    std::vector<at::Tensor> all;
    for (int q = 0; q < r.size; ++q) all.push_back(make_input(numel, at::kFloat, q, 500));
    const at::Tensor expected = reference_reduce(all, RedOpType::SUM);
    std::vector<at::Tensor> t{all[r.rank].clone()};
    r.shm->allreduce(t)->wait();
    EXPECT_TRUE(same_bits(t[0], expected)) << "in place";
    const at::Tensor out = at::empty_like(all[r.rank]);
    r.shm->allreduce_out(all[r.rank], out, allreduce_op(RedOpType::SUM))->wait();
    EXPECT_TRUE(same_bits(out, expected)) << "out of place";
  });
}

TEST_P(ShmOps, AllreduceUnalignedAndNonContiguous) {
  run_ranks(GetParam(), chunked(false), [](Rank& r) {
    for (int64_t numel : kSizes) {
      // A view one element into its storage: contiguous, but not 64-byte aligned.
      std::vector<at::Tensor> all;
      for (int q = 0; q < r.size; ++q) all.push_back(make_input(numel, at::kFloat, q, 100 + numel));
      const at::Tensor expected = reference_reduce(all, RedOpType::SUM);
      at::Tensor base = at::full({numel + 2}, 42.0f);
      base.narrow(0, 1, numel).copy_(all[r.rank]);
      std::vector<at::Tensor> t{base.narrow(0, 1, numel)};
      r.shm->allreduce(t)->wait();
      EXPECT_TRUE(same_bits(t[0], expected)) << "unaligned numel " << numel;
      EXPECT_EQ(base[0].item<float>(), 42.0f);
      EXPECT_EQ(base[numel + 1].item<float>(), 42.0f);
      // A transposed view: staged through a contiguous copy and copied back.
      at::Tensor m = all[r.rank].repeat({3}).reshape({3, numel}).t();
      std::vector<at::Tensor> v{m};
      r.shm->allreduce(v)->wait();
      EXPECT_TRUE(same_bits(m.t().contiguous()[1], expected)) << "transposed numel " << numel;
    }
  });
}

TEST_P(ShmOps, AllreduceDefaultChunkAcrossThresholds) {
  RunOptions o;
  run_ranks(GetParam(), o, [](Rank& r) {
    // Around the small-message threshold (32 KiB) and above one chunk (256 KiB, 512 KiB at 2 ranks).
    for (int64_t numel : {8191, 8192, 8193, 20000, 70001, 200000}) {
      std::vector<at::Tensor> all;
      for (int q = 0; q < r.size; ++q) all.push_back(make_input(numel, at::kFloat, q, 300 + numel));
      std::vector<at::Tensor> t{all[r.rank].clone()};
      r.shm->allreduce(t)->wait();
      EXPECT_TRUE(same_bits(t[0], reference_reduce(all, RedOpType::SUM))) << "numel " << numel;
    }
  });
}

TEST_P(ShmOps, ReduceToEveryRoot) {
  run_ranks(GetParam(), chunked(true), [](Rank& r) {
    uint64_t salt = 1000;
    for (int root = 0; root < r.size; ++root) {
      for (auto dtype : {at::kFloat, at::kHalf, at::kInt}) {
        for (auto op : {RedOpType::SUM, RedOpType::AVG, RedOpType::MAX}) {
          for (int64_t numel : kSizes) {
            ++salt;
            std::vector<at::Tensor> all;
            for (int q = 0; q < r.size; ++q) all.push_back(make_input(numel, dtype, q, salt));
            std::vector<at::Tensor> t{all[r.rank].clone()};
            c10d::ReduceOptions o;
            o.reduceOp = op;
            o.rootRank = root;
            r.shm->reduce(t, o)->wait();
            const std::string what = c10::str("reduce root ", root, " ", dtype, " ", op_name(op), " numel ", numel);
            // The out-of-place form: the root's output, and no other tensor, changes.
            const at::Tensor input = all[r.rank].clone();
            const at::Tensor out = at::zeros_like(input);
            r.shm->reduce_out(input, out, o)->wait();
            EXPECT_TRUE(same_bits(input, all[r.rank])) << what << " out of place changed its input";
            if (r.rank == root) {
              EXPECT_TRUE(same_bits(t[0], reference_reduce(all, op))) << what;
              EXPECT_TRUE(same_bits(out, reference_reduce(all, op))) << what << " out of place";
            } else {
              EXPECT_TRUE(same_bits(t[0], all[r.rank])) << what << ": a non-root input changed";
              EXPECT_TRUE(same_bits(out, at::zeros_like(input))) << what << " out of place wrote a non-root output";
            }
            if (r.gloo && dtype == at::kFloat && op == RedOpType::SUM && numel == 1000) {
              std::vector<at::Tensor> g{all[r.rank].clone()};
              r.gloo->reduce(g, o)->wait();
              if (r.rank == root) expect_close_to_gloo(t[0], g[0], what);
            }
          }
        }
      }
    }
  });
}

TEST_P(ShmOps, BroadcastFromEveryRoot) {
  run_ranks(GetParam(), chunked(true), [](Rank& r) {
    uint64_t salt = 2000;
    for (int root = 0; root < r.size; ++root) {
      for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong, at::kBool}) {
        for (int64_t numel : kSizes) {
          ++salt;
          const at::Tensor src = make_input(numel, dtype, root, salt);
          std::vector<at::Tensor> t{r.rank == root ? src.clone() : make_input(numel, dtype, r.rank, salt + 7)};
          c10d::BroadcastOptions o;
          o.rootRank = root;
          r.shm->broadcast(t, o)->wait();
          EXPECT_TRUE(same_bits(t[0], src)) << "broadcast root " << root << " " << dtype << " numel " << numel;
          if (r.gloo && dtype == at::kFloat && numel == 5003) {
            std::vector<at::Tensor> g{r.rank == root ? src.clone() : at::zeros_like(src)};
            r.gloo->broadcast(g, o)->wait();
            EXPECT_TRUE(at::equal(g[0], t[0]));
          }
        }
      }
    }
  });
}

TEST_P(ShmOps, AllgatherListFlatAndUneven) {
  run_ranks(GetParam(), chunked(true), [](Rank& r) {
    uint64_t salt = 3000;
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kByte}) {
      for (int64_t numel : kSizes) {
        ++salt;
        std::vector<at::Tensor> all;
        for (int q = 0; q < r.size; ++q) all.push_back(make_input(numel, dtype, q, salt));
        std::vector<at::Tensor> in{all[r.rank]};
        std::vector<std::vector<at::Tensor>> out(1);
        for (int q = 0; q < r.size; ++q) out[0].push_back(at::empty({numel}, at::TensorOptions().dtype(dtype)));
        r.shm->allgather(out, in)->wait();
        for (int q = 0; q < r.size; ++q) EXPECT_TRUE(same_bits(out[0][q], all[q])) << "allgather piece " << q;
        // Flat output (Gloo has no _allgather_base).
        at::Tensor flat = at::empty({numel * r.size}, at::TensorOptions().dtype(dtype));
        r.shm->_allgather_base(flat, in[0])->wait();
        EXPECT_TRUE(same_bits(flat, at::cat(all))) << "_allgather_base numel " << numel;
        // In place: the input is this rank's part of the output (FSDP's form).
        at::Tensor inplace = at::zeros({numel * r.size}, at::TensorOptions().dtype(dtype));
        at::Tensor mine = inplace.narrow(0, numel * r.rank, numel);
        mine.copy_(in[0]);
        r.shm->_allgather_base(inplace, mine)->wait();
        EXPECT_TRUE(same_bits(inplace, at::cat(all))) << "_allgather_base in place, numel " << numel;
        // Different sizes per rank (Gloo cannot).
        std::vector<at::Tensor> uneven;
        for (int q = 0; q < r.size; ++q) uneven.push_back(make_input(numel + 3 * q, dtype, q, salt + 99));
        std::vector<at::Tensor> uin{uneven[r.rank]};
        std::vector<std::vector<at::Tensor>> uout(1);
        for (int q = 0; q < r.size; ++q)
          uout[0].push_back(at::empty({numel + 3 * q}, at::TensorOptions().dtype(dtype)));
        r.shm->allgather(uout, uin)->wait();
        for (int q = 0; q < r.size; ++q) EXPECT_TRUE(same_bits(uout[0][q], uneven[q])) << "uneven piece " << q;
        if (r.gloo && dtype == at::kFloat && numel == 1000) {
          std::vector<std::vector<at::Tensor>> g(1);
          for (int q = 0; q < r.size; ++q) g[0].push_back(at::empty({numel}));
          r.gloo->allgather(g, in)->wait();
          for (int q = 0; q < r.size; ++q) EXPECT_TRUE(at::equal(g[0][q], out[0][q]));
        }
      }
    }
  });
}

// A broadcast, all-gather (gather) or scatter part of 16 KiB to a quarter of its
// room moves to the next page-aligned position with each collective (see
// staging_offset): a run of such calls, from every root and with parts of
// different sizes per rank (some moving, some not), must land every byte
// where its readers look.
TEST_P(ShmOps, SmallPartsMoveThroughTheSlots) {
  RunOptions options;
  options.shm.chunk_bytes(128 * 1024);  // broadcast room 128 KiB x ranks; all-gather room 128 KiB
  run_ranks(GetParam(), options, [](Rank& r) {
    uint64_t salt = 9000;
    for (int call = 0; call < 24; ++call) {
      ++salt;
      const int root = call % r.size;
      const int64_t numel = (call % 3 == 0 ? 1024 : call % 3 == 1 ? 4100 : 7000) + call;  // 4-28 KiB of floats
      const at::Tensor src = make_input(numel, at::kFloat, root, salt);
      std::vector<at::Tensor> t{r.rank == root ? src.clone() : make_input(numel, at::kFloat, r.rank, salt + 7)};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      r.shm->broadcast(t, o)->wait();
      EXPECT_TRUE(same_bits(t[0], src)) << "broadcast " << call << " from root " << root << ", numel " << numel;
      std::vector<at::Tensor> parts;
      for (int q = 0; q < r.size; ++q) parts.push_back(make_input(2000 + 2100 * q + call, at::kFloat, q, salt + 11));
      std::vector<at::Tensor> in{parts[r.rank]};
      std::vector<std::vector<at::Tensor>> out(1);
      for (int q = 0; q < r.size; ++q) out[0].push_back(at::empty_like(parts[q]));
      r.shm->allgather(out, in)->wait();
      for (int q = 0; q < r.size; ++q) {
        EXPECT_TRUE(same_bits(out[0][q], parts[q])) << "all-gather " << call << ", part of rank " << q;
      }
      std::vector<std::vector<at::Tensor>> gathered;
      if (r.rank == root) {
        gathered.emplace_back();
        for (int q = 0; q < r.size; ++q) gathered[0].push_back(at::empty_like(parts[q]));
      }
      c10d::GatherOptions go;
      go.rootRank = root;
      r.shm->gather(gathered, in, go)->wait();
      for (int q = 0; r.rank == root && q < r.size; ++q) {
        EXPECT_TRUE(same_bits(gathered[0][q], parts[q])) << "gather " << call << ", part of rank " << q;
      }
      std::vector<std::vector<at::Tensor>> pieces;
      if (r.rank == root) pieces.push_back(parts);
      std::vector<at::Tensor> piece{at::empty_like(parts[r.rank])};
      c10d::ScatterOptions so;
      so.rootRank = root;
      r.shm->scatter(piece, pieces, so)->wait();
      EXPECT_TRUE(same_bits(piece[0], parts[r.rank])) << "scatter " << call << " from root " << root;
    }
  });
}

// A reduce-scatter or all-to-all piece of 16 KiB to a quarter of its
// destination's room moves through that room with each collective (see
// piece_offset): with 1 MiB slots the rooms are 144 KiB (8 ranks) to 1 MiB
// (2 ranks), and pieces of 16-44 KiB, different for every pair, some
// moving and some not at 8 ranks, must land where their readers look.
TEST_P(ShmOps, SmallPiecesMoveThroughTheirRooms) {
  RunOptions options;
  options.shm.chunk_bytes(1024 * 1024);
  run_ranks(GetParam(), options, [](Rank& r) {
    uint64_t salt = 9500;
    for (int call = 0; call < 24; ++call) {
      ++salt;
      const int64_t numel = 4100 + 150 * (call % 5);
      auto piece = [&](int x, int q) { return make_input(numel, at::kFloat, x, salt * 64 + q); };
      std::vector<at::Tensor> mine_for_me;
      for (int x = 0; x < r.size; ++x) mine_for_me.push_back(piece(x, r.rank));
      std::vector<std::vector<at::Tensor>> in(1);
      for (int q = 0; q < r.size; ++q) in[0].push_back(piece(r.rank, q));
      std::vector<at::Tensor> out{at::empty({numel})};
      r.shm->reduce_scatter(out, in, c10d::ReduceScatterOptions{})->wait();
      EXPECT_TRUE(same_bits(out[0], reference_reduce(mine_for_me, RedOpType::SUM)))
          << "reduce_scatter " << call << ", numel " << numel;
      // Rank x sends rank q 16-44 KiB, different for every pair and call.
      auto sends = [&](int x, int q) { return 4100 + 1000 * ((3 * x + q + call) % 8) + call; };
      std::vector<at::Tensor> lin, lout;
      for (int q = 0; q < r.size; ++q) {
        lin.push_back(make_input(sends(r.rank, q), at::kFloat, r.rank, salt * 64 + q));
        lout.push_back(at::empty({sends(q, r.rank)}));
      }
      r.shm->alltoall(lout, lin)->wait();
      for (int q = 0; q < r.size; ++q) {
        EXPECT_TRUE(same_bits(lout[q], make_input(sends(q, r.rank), at::kFloat, q, salt * 64 + r.rank)))
            << "alltoall " << call << ", piece from rank " << q;
      }
    }
  });
}

TEST_P(ShmOps, GatherAndScatterEveryRoot) {
  run_ranks(GetParam(), chunked(true), [](Rank& r) {
    uint64_t salt = 4000;
    for (int root = 0; root < r.size; ++root) {
      for (int64_t numel : kSizes) {
        ++salt;
        std::vector<at::Tensor> all;
        for (int q = 0; q < r.size; ++q) all.push_back(make_input(numel, at::kFloat, q, salt));
        std::vector<at::Tensor> in{all[r.rank]};
        std::vector<std::vector<at::Tensor>> out;
        if (r.rank == root) {
          out.resize(1);
          for (int q = 0; q < r.size; ++q) out[0].push_back(at::empty({numel}));
        }
        c10d::GatherOptions go;
        go.rootRank = root;
        r.shm->gather(out, in, go)->wait();
        if (r.rank == root) {
          for (int q = 0; q < r.size; ++q) EXPECT_TRUE(same_bits(out[0][q], all[q])) << "gather piece " << q;
        }
        if (r.gloo && numel == 1000) {
          std::vector<std::vector<at::Tensor>> g;
          if (r.rank == root) g = {std::vector<at::Tensor>(r.size)};
          if (r.rank == root) {
            for (auto& t : g[0]) t = at::empty({numel});
          }
          r.gloo->gather(g, in, go)->wait();
          if (r.rank == root) {
            for (int q = 0; q < r.size; ++q) EXPECT_TRUE(at::equal(g[0][q], out[0][q]));
          }
        }
        // Scatter: the root's piece q (numel + q elements) goes to rank q.
        std::vector<std::vector<at::Tensor>> pieces;
        if (r.rank == root) {
          pieces.resize(1);
          for (int q = 0; q < r.size; ++q) pieces[0].push_back(make_input(numel + q, at::kInt, q, salt + 5));
        }
        std::vector<at::Tensor> mine{at::empty({numel + r.rank}, at::kInt)};
        c10d::ScatterOptions so;
        so.rootRank = root;
        r.shm->scatter(mine, pieces, so)->wait();
        EXPECT_TRUE(same_bits(mine[0], make_input(numel + r.rank, at::kInt, r.rank, salt + 5)))
            << "scatter root " << root << " numel " << numel;
      }
    }
  });
}

TEST_P(ShmOps, ReduceScatterListAndFlat) {
  run_ranks(GetParam(), chunked(false), [](Rank& r) {
    uint64_t salt = 5000;
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kInt}) {
      for (auto op : {RedOpType::SUM, RedOpType::AVG, RedOpType::MAX}) {
        for (int64_t numel : kSizes) {
          ++salt;
          // Rank x's piece for rank q: input(x, salt * 64 + q).
          auto piece = [&](int x, int q) { return make_input(numel, dtype, x, salt * 64 + q); };
          std::vector<at::Tensor> mine_for_me;
          for (int x = 0; x < r.size; ++x) mine_for_me.push_back(piece(x, r.rank));
          const at::Tensor expected = reference_reduce(mine_for_me, op);
          std::vector<std::vector<at::Tensor>> in(1);
          for (int q = 0; q < r.size; ++q) in[0].push_back(piece(r.rank, q));
          std::vector<at::Tensor> out{at::empty({numel}, at::TensorOptions().dtype(dtype))};
          c10d::ReduceScatterOptions o;
          o.reduceOp = op;
          r.shm->reduce_scatter(out, in, o)->wait();
          const std::string what = c10::str("reduce_scatter ", dtype, " ", op_name(op), " numel ", numel);
          EXPECT_TRUE(same_bits(out[0], expected)) << what;
          at::Tensor flat_in = at::cat(in[0]);
          at::Tensor flat_out = at::empty({numel}, at::TensorOptions().dtype(dtype));
          r.shm->_reduce_scatter_base(flat_out, flat_in, o)->wait();
          EXPECT_TRUE(same_bits(flat_out, expected)) << "_" << what << "_base";
        }
      }
    }
  });
}

void alltoall_equal_uneven_and_list(int ranks, const RunOptions& options) {
  run_ranks(ranks, options, [](Rank& r) {
    const int n = r.size;
    uint64_t salt = 6000;
    for (int64_t rows : {0, 1, 5, 300}) {
      ++salt;
      // Equal splits: rank x's input holds n pieces of `rows` rows of 3.
      auto input_of = [&](int x) { return make_input(n * rows * 3, at::kFloat, x, salt).reshape({n * rows, 3}); };
      at::Tensor in = input_of(r.rank);
      at::Tensor out = at::empty({n * rows, 3});
      std::vector<int64_t> none;
      r.shm->alltoall_base(out, in, none, none)->wait();
      std::vector<at::Tensor> expected;
      for (int q = 0; q < n; ++q) expected.push_back(input_of(q).narrow(0, r.rank * rows, rows));
      EXPECT_TRUE(same_bits(out, at::cat(expected))) << "alltoall_base equal rows " << rows;
      // In place: what this rank sends is overwritten by what it receives.
      at::Tensor both = in.clone();
      r.shm->alltoall_base(both, both, none, none)->wait();
      EXPECT_TRUE(same_bits(both, out)) << "alltoall_base in place, rows " << rows;
      if (r.gloo && rows == 300) {
        at::Tensor g = at::empty_like(out);
        r.gloo->alltoall_base(g, in, none, none)->wait();
        EXPECT_TRUE(at::equal(g, out));
      }
      // Uneven: rank x sends (x + 2q) % 4 * rows rows to rank q.
      auto rows_from_to = [&](int x, int q) { return (x + 2 * q) % 4 * rows + (x == q ? 1 : 0); };
      auto uneven_input = [&](int x) {
        int64_t total = 0;
        for (int q = 0; q < n; ++q) total += rows_from_to(x, q);
        return make_input(total * 2, at::kDouble, x, salt + 1).reshape({total, 2});
      };
      std::vector<int64_t> in_splits, out_splits;
      for (int q = 0; q < n; ++q) {
        in_splits.push_back(rows_from_to(r.rank, q));
        out_splits.push_back(rows_from_to(q, r.rank));
      }
      at::Tensor uin = uneven_input(r.rank);
      const int64_t out_rows = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
      at::Tensor uout = at::empty({out_rows, 2}, at::kDouble);
      r.shm->alltoall_base(uout, uin, out_splits, in_splits)->wait();
      std::vector<at::Tensor> uexp;
      for (int q = 0; q < n; ++q) {
        int64_t start = 0;
        for (int p = 0; p < r.rank; ++p) start += rows_from_to(q, p);
        uexp.push_back(uneven_input(q).narrow(0, start, rows_from_to(q, r.rank)));
      }
      EXPECT_TRUE(same_bits(uout, at::cat(uexp))) << "alltoall_base uneven rows " << rows;
      if (r.gloo && rows == 5) {
        at::Tensor g = at::empty_like(uout);
        r.gloo->alltoall_base(g, uin, out_splits, in_splits)->wait();
        EXPECT_TRUE(at::equal(g, uout));
      }
      // In place with uneven splits that do not line up: rank x sends
      // (q - x) mod n * rows rows to rank q, so each rank receives in the
      // order opposite to the one it sends in (3 ranks: rank 0 sends 0, 2, 1
      // pieces and receives 0, 1, 2), and what it receives from one rank
      // lands where it has yet to send to another.
      auto shifted = [&](int x, int q) { return (q - x + n) % n * rows; };
      std::vector<int64_t> sin, sout;
      std::vector<at::Tensor> sexp;
      for (int q = 0; q < n; ++q) {
        sin.push_back(shifted(r.rank, q));
        sout.push_back(shifted(q, r.rank));
      }
      auto shifted_input = [&](int x) {
        const int64_t total = n * (n - 1) / 2 * rows;
        return make_input(total * 3, at::kFloat, x, salt + 2).reshape({total, 3});
      };
      for (int q = 0; q < n; ++q) {
        int64_t start = 0;
        for (int p = 0; p < r.rank; ++p) start += shifted(q, p);
        sexp.push_back(shifted_input(q).narrow(0, start, shifted(q, r.rank)));
      }
      at::Tensor sboth = shifted_input(r.rank);
      r.shm->alltoall_base(sboth, sboth, sout, sin)->wait();
      EXPECT_TRUE(same_bits(sboth, at::cat(sexp))) << "alltoall_base in place, uneven, rows " << rows;
      // List form with a different size for every pair.
      std::vector<at::Tensor> lin, lout;
      for (int q = 0; q < n; ++q) {
        lin.push_back(make_input(rows * (r.rank + 1) + q, at::kShort, r.rank, salt * 100 + q));
        lout.push_back(at::empty({rows * (q + 1) + r.rank}, at::kShort));
      }
      r.shm->alltoall(lout, lin)->wait();
      for (int q = 0; q < n; ++q) {
        EXPECT_TRUE(same_bits(lout[q], make_input(rows * (q + 1) + r.rank, at::kShort, q, salt * 100 + r.rank)))
            << "alltoall list from " << q << " rows " << rows;
      }
    }
  });
}

TEST_P(ShmOps, AlltoallEqualUnevenAndList) { alltoall_equal_uneven_and_list(GetParam(), chunked(true)); }

TEST_P(ShmOps, AlltoallReadingPiecesDirectlyEqualUnevenAndList) {
  alltoall_equal_uneven_and_list(GetParam(), direct_pieces());
}

TEST_P(ShmOps, SendRecvRingAndLargerThanMailbox) {
  if (GetParam() == 1) GTEST_SKIP() << "point to point needs two ranks";
  run_ranks(GetParam(), chunked(false), [](Rank& r) {
    const int next = (r.rank + 1) % r.size;
    const int prev = (r.rank + r.size - 1) % r.size;
    for (int64_t numel : kSizes) {
      for (int tag : {0, 7}) {
        // The mailbox holds 4 KiB: 5003 floats go through it in pieces.
        std::vector<at::Tensor> out{make_input(numel, at::kFloat, r.rank, 7000 + numel + tag)};
        std::vector<at::Tensor> in{at::empty({numel})};
        auto recv = r.shm->recv(in, prev, tag);
        auto send = r.shm->send(out, next, tag);
        send->wait();
        recv->wait();
        EXPECT_TRUE(same_bits(in[0], make_input(numel, at::kFloat, prev, 7000 + numel + tag)))
            << "recv from " << prev << " numel " << numel << " tag " << tag;
      }
    }
  });
}

TEST_P(ShmOps, IntegerAverageDoesNotOverflow) {
  run_ranks(GetParam(), chunked(false), [](Rank& r) {
    const std::vector<std::pair<at::ScalarType, int64_t>> cases{
        {at::kChar, 100}, {at::kByte, 250}, {at::kShort, 32000}, {at::kInt, 2147483000}, {at::kLong, int64_t{1} << 62}};
    for (const auto& [dtype, value] : cases) {
      // Every rank holds value - rank: the sum overflows the dtype from two ranks on.
      std::vector<at::Tensor> t{at::full({700}, value - r.rank, at::TensorOptions().dtype(dtype))};
      r.shm->allreduce(t, allreduce_op(RedOpType::AVG))->wait();
      __int128 sum = 0;  // int64's own sum overflows
      for (int q = 0; q < r.size; ++q) sum += value - q;
      const auto mean = static_cast<int64_t>(sum / r.size);
      EXPECT_TRUE(same_bits(t[0], at::full({700}, mean, at::TensorOptions().dtype(dtype))))
          << dtype << " AVG of " << value << " - rank: " << t[0][0].item<int64_t>();
    }
  });
}

TEST_P(ShmOps, RecvFromAnySourceNamesTheSender) {
  if (GetParam() == 1) GTEST_SKIP() << "point to point needs two ranks";
  run_ranks(GetParam(), chunked(false), [](Rank& r) {
    // Every other rank sends rank 0 two floats (its rank) with tag 4, then
    // 5003 floats (larger than the 4 KiB mailbox) with tag 3. Rank 0 takes
    // them from any source, tag by tag, and learns each sender.
    if (r.rank != 0) {
      std::vector<at::Tensor> small{at::full({2}, static_cast<float>(r.rank))};
      std::vector<at::Tensor> large{make_input(5003, at::kFloat, r.rank, 77)};
      r.shm->send(small, 0, /*tag=*/4)->wait();
      r.shm->send(large, 0, /*tag=*/3)->wait();
    } else {
      for (int tag : {4, 3}) {
        std::vector<int> senders;
        for (int i = 1; i < r.size; ++i) {
          std::vector<at::Tensor> in{at::empty({tag == 4 ? 2 : 5003})};
          auto work = r.shm->recvAnysource(in, tag);
          work->wait();
          const int from = work->sourceRank();
          senders.push_back(from);
          const at::Tensor want =
              tag == 4 ? at::full({2}, static_cast<float>(from)) : make_input(5003, at::kFloat, from, 77);
          EXPECT_TRUE(same_bits(in[0], want)) << "tag " << tag << " from " << from;
        }
        std::sort(senders.begin(), senders.end());
        std::vector<int> everyone;
        for (int q = 1; q < r.size; ++q) everyone.push_back(q);
        EXPECT_EQ(senders, everyone) << "tag " << tag;
      }
    }
  });
}

TEST_P(ShmOps, RecvFromAnySourceLeavesOtherTagsWaiting) {
  if (GetParam() < 3) GTEST_SKIP() << "needs two senders";
  run_ranks(GetParam(), chunked(false), [](Rank& r) {
    std::vector<at::Tensor> t{at::full({3}, static_cast<float>(r.rank))};
    if (r.rank == 1) r.shm->send(t, 0, /*tag=*/5)->wait();
    r.shm->barrier()->wait();  // rank 1's message is waiting before rank 2 sends
    if (r.rank == 2) r.shm->send(t, 0, /*tag=*/6)->wait();
    if (r.rank == 0) {
      std::vector<at::Tensor> in{at::empty({3})};
      auto work = r.shm->recvAnysource(in, /*tag=*/6);
      work->wait();
      EXPECT_EQ(work->sourceRank(), 2);
      EXPECT_TRUE(same_bits(in[0], at::full({3}, 2.0f)));
      r.shm->recv(in, 1, /*tag=*/5)->wait();
      EXPECT_TRUE(same_bits(in[0], at::full({3}, 1.0f)));
    }
  });
}

TEST_P(ShmOps, BarrierWaitsForTheSlowestRank) {
  run_ranks(GetParam(), chunked(false), [](Rank& r) {
    for (int i = 0; i < 50; ++i) r.shm->barrier()->wait();
    if (r.rank == r.size - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto start = std::chrono::steady_clock::now();
    r.shm->barrier()->wait();
    const auto waited = std::chrono::steady_clock::now() - start;
    if (r.rank != r.size - 1) {
      EXPECT_GE(waited, std::chrono::milliseconds(80)) << "barrier did not wait";
    }
  });
}

// Every staged collective with streaming stores for every large write into
// the segment (the default 256 KiB chunks: writes of 64 KiB and more),
// on odd sizes at odd addresses (one float past an aligned start), so that
// the streaming copy's unaligned head and short tail carry data too.
TEST_P(ShmOps, StreamingStoresOddSizesAtOddAddresses) {
  RunOptions o;
  o.shm.streaming_stores(1).single_copy_bytes(0).single_copy_piece_bytes(0);
  run_ranks(GetParam(), o, [](Rank& r) {
    const int n = r.size;
    uint64_t salt = 9000;
    auto at_odd_address = [](const at::Tensor& t) {
      at::Tensor backing = at::empty({t.numel() + 1}, t.options());
      at::Tensor view = backing.narrow(0, 1, t.numel());
      view.copy_(t);
      return view;
    };
    for (int64_t numel : {int64_t{65536 / 4 + 3}, int64_t{300007}}) {
      ++salt;
      std::vector<at::Tensor> all;
      for (int q = 0; q < n; ++q) all.push_back(make_input(numel, at::kFloat, q, salt));
      at::Tensor mine = at_odd_address(all[r.rank]);
      std::vector<at::Tensor> t{mine.clone()};
      r.shm->allreduce(t)->wait();
      EXPECT_TRUE(same_bits(t[0], reference_reduce(all, RedOpType::SUM))) << "allreduce numel " << numel;
      std::vector<at::Tensor> b{r.rank == n - 1 ? at_odd_address(all[n - 1]) : at_odd_address(at::zeros({numel}))};
      c10d::BroadcastOptions bo;
      bo.rootRank = n - 1;
      r.shm->broadcast(b, bo)->wait();
      EXPECT_TRUE(same_bits(b[0], all[n - 1])) << "broadcast numel " << numel;
      at::Tensor gathered = at_odd_address(at::zeros({numel * n}));
      r.shm->_allgather_base(gathered, mine)->wait();
      EXPECT_TRUE(same_bits(gathered, at::cat(all))) << "_allgather_base numel " << numel;
      at::Tensor pieces = at_odd_address(mine.repeat({n}));
      at::Tensor reduced = at::empty({numel});
      r.shm->_reduce_scatter_base(reduced, pieces)->wait();
      EXPECT_TRUE(same_bits(reduced, reference_reduce(all, RedOpType::SUM))) << "_reduce_scatter_base numel " << numel;
      at::Tensor exchanged = at::empty({numel * n});
      std::vector<int64_t> none;
      r.shm->alltoall_base(exchanged, pieces, none, none)->wait();
      EXPECT_TRUE(same_bits(exchanged, at::cat(all))) << "alltoall_base numel " << numel;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmOps, ::testing::Values(1, 2, 3, 4, 8),
                         [](const ::testing::TestParamInfo<int>& info) { return "n" + std::to_string(info.param); });

}  // namespace
