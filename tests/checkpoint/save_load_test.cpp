// Round trips of checkpoint::save / load: every dtype, non-contiguous
// sources and destinations, odd shapes (0-d, empty, 4-d), 1-4 ranks, flat
// ranges resharded 3 ways -> 2 ways, replicas written once, steps, `latest`,
// keep(k), and a save that fails on one rank (the previous step survives).
// Python's safetensors reads a shard file.

#include "checkpoint/checkpoint_util.h"
#include "harness/spawn_ranks.h"
#include "harness/subprocess.h"

#include <commgrad/checkpoint.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

namespace commgrad::testing {
namespace {

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kLong,
                                             at::kInt,   at::kShort,  at::kChar,     at::kByte, at::kBool};

std::string key(at::ScalarType dtype) { return std::string("t/") + c10::toString(dtype); }

// Saves every dtype's [2n+1, 3] tensor split by rows over `n` ranks, loads
// it split by columns into zeros, and compares with the global tensor.
void round_trip_every_dtype(int n) {
  TempRoot root(std::to_string(n));
  spawn_ranks(n, [&](Group& g) {
    std::vector<checkpoint::TensorPiece> pieces;
    for (const auto dtype : kDtypes)
      pieces.push_back(row_piece(key(dtype), global_tensor({2 * n + 1, 3}, dtype), 0, n, g.rank()));
    const auto saved = checkpoint::save(root.str(), 3, pieces, {{"note", "dtypes"}}, {}, g);
    EXPECT_EQ(saved.step, 3);
    std::vector<checkpoint::TensorPiece> dests;
    std::vector<at::Tensor> expected;
    for (const auto dtype : kDtypes) {
      auto p = row_piece(key(dtype), global_tensor({2 * n + 1, 3}, dtype), 1, n, g.rank());
      expected.push_back(p.tensor.clone());
      p.tensor.zero_();
      dests.push_back(p);
    }
    const auto result = checkpoint::load(root.str(), dests, {}, g);
    EXPECT_EQ(result.step, 3);
    EXPECT_EQ(result.metadata.at("note"), "dtypes");
    EXPECT_EQ(result.saved_world_size, n);
    for (size_t i = 0; i < dests.size(); ++i) {
      EXPECT_TRUE(at::equal(dests[i].tensor, expected[i])) << dests[i].name;
      EXPECT_EQ(dests[i].tensor.scalar_type(), kDtypes[i]);
    }
  });
}

TEST(CheckpointRoundTrip, EveryDtypeOneRank) { round_trip_every_dtype(1); }
TEST(CheckpointRoundTrip, EveryDtypeTwoRanks) { round_trip_every_dtype(2); }
TEST(CheckpointRoundTrip, EveryDtypeThreeRanks) { round_trip_every_dtype(3); }
TEST(CheckpointRoundTrip, EveryDtypeFourRanks) { round_trip_every_dtype(4); }

TEST(CheckpointRoundTrip, NonContiguousSourcesAndDestinations) {
  TempRoot root("nc");
  const at::Tensor full = global_tensor({6, 4}, at::kFloat);
  spawn_ranks(2, [&](Group& g) {
    // Source: this rank's rows, held transposed ([4, 3] storage viewed as [3, 4]).
    auto p = row_piece("w", full, 0, 2, g.rank());
    p.tensor = p.tensor.t().contiguous().t();
    ASSERT_FALSE(p.tensor.is_contiguous());
    checkpoint::save(root.str(), 1, {p}, {}, {}, g);
    // Destination: column c of a larger buffer, strided; the rest must stay untouched.
    at::Tensor big = at::full({6, 4, 2}, -1.0f);
    checkpoint::TensorPiece d = checkpoint::TensorPiece::whole("w", big.select(2, 1));
    ASSERT_FALSE(d.tensor.is_contiguous());
    checkpoint::load(root.str(), {d}, {}, g);
    EXPECT_TRUE(at::equal(big.select(2, 1), full));
    EXPECT_TRUE(at::equal(big.select(2, 0), at::full({6, 4}, -1.0f)));
  });
}

TEST(CheckpointRoundTrip, OddShapes) {
  TempRoot root("odd");
  const at::Tensor scalar = at::full({}, 7.5, at::kDouble);
  const at::Tensor empty = at::zeros({0, 3});
  const at::Tensor one = at::full({1}, int64_t(42));
  const at::Tensor four_d = global_tensor({2, 3, 5, 7}, at::kFloat);
  spawn_ranks(3, [&](Group& g) {
    std::vector<checkpoint::TensorPiece> pieces = {checkpoint::TensorPiece::whole("scalar", scalar.clone()),
                                                   checkpoint::TensorPiece::whole("empty", empty.clone()),
                                                   checkpoint::TensorPiece::whole("one", one.clone()),
                                                   row_piece("four_d", four_d, 2, 3, g.rank())};
    checkpoint::save(root.str(), 0, pieces, {}, {}, g);
  });
  spawn_ranks(2, [&](Group& g) {
    std::vector<checkpoint::TensorPiece> dests = {checkpoint::TensorPiece::whole("scalar", at::zeros({}, at::kDouble)),
                                                  checkpoint::TensorPiece::whole("empty", at::ones({0, 3})),
                                                  checkpoint::TensorPiece::whole("one", at::zeros({1}, at::kLong)),
                                                  row_piece("four_d", four_d, 3, 2, g.rank())};
    const at::Tensor expected = dests[3].tensor.clone();
    dests[3].tensor.zero_();
    checkpoint::load(root.str(), dests, {}, g);
    EXPECT_EQ(dests[0].tensor.item<double>(), 7.5);
    EXPECT_EQ(dests[2].tensor.item<int64_t>(), 42);
    EXPECT_TRUE(at::equal(dests[3].tensor, expected));
  });
}

// ZeRO-style state: each rank holds a flat range of a box (here the TP
// shard [5, 7] of a [10, 7] tensor, and the whole of a [11] bias).
checkpoint::TensorPiece flat_piece(const std::string& name, const at::Tensor& full, std::vector<int64_t> offset,
                                   std::vector<int64_t> shape, int n, int i) {
  checkpoint::TensorPiece p;
  p.name = name;
  p.global_shape = full.sizes().vec();
  p.box_offset = offset;
  p.box_shape = shape;
  at::Tensor box = full;
  for (size_t d = 0; d < shape.size(); ++d) box = box.narrow(d, offset[d], shape[d]);
  const auto [b, e] = split(box.numel(), n, i);
  p.flat_begin = b;
  p.flat_end = e;
  p.tensor = box.reshape({-1}).narrow(0, b, e - b).clone();
  return p;
}

TEST(CheckpointReshard, FlatRangesSavedThreeWaysLoadTwoWays) {
  TempRoot root("flat");
  const at::Tensor w = global_tensor({10, 7}, at::kFloat);
  const at::Tensor b = global_tensor({11}, at::kDouble);
  // Save: 2 boxes (rows 0-4 and 5-9) each split 3 ways, on 6 ranks; the bias split 6 ways.
  spawn_ranks(6, [&](Group& g) {
    const int box = g.rank() / 3;
    std::vector<checkpoint::TensorPiece> pieces = {flat_piece("w", w, {5 * box, 0}, {5, 7}, 3, g.rank() % 3),
                                                   flat_piece("b", b, {0}, {11}, 6, g.rank())};
    checkpoint::save(root.str(), 1, pieces, {}, {}, g);
  });
  // Load: flat ranges of other boxes (rows 0-2, 3-9) split 2 ways, on 4 ranks.
  spawn_ranks(4, [&](Group& g) {
    const int box = g.rank() / 2;
    const std::vector<int64_t> offset = {box == 0 ? 0 : 3, 0};
    const std::vector<int64_t> shape = {box == 0 ? 3 : 7, 7};
    std::vector<checkpoint::TensorPiece> dests = {flat_piece("w", w, offset, shape, 2, g.rank() % 2),
                                                  flat_piece("b", b, {0}, {11}, 4, g.rank())};
    std::vector<at::Tensor> expected;
    for (auto& d : dests) {
      expected.push_back(d.tensor.clone());
      d.tensor.fill_(-1);
    }
    checkpoint::load(root.str(), dests, {}, g);
    for (size_t i = 0; i < dests.size(); ++i) EXPECT_TRUE(at::equal(dests[i].tensor, expected[i])) << dests[i].name;
  });
  // And whole boxes from the flat ranges, on one rank.
  spawn_ranks(1, [&](Group& g) {
    auto d = checkpoint::TensorPiece::whole("w", at::zeros({10, 7}));
    auto e = checkpoint::TensorPiece::whole("b", at::zeros({11}, at::kDouble));
    checkpoint::load(root.str(), {d, e}, {}, g);
    EXPECT_TRUE(at::equal(d.tensor, w));
    EXPECT_TRUE(at::equal(e.tensor, b));
  });
}

TEST(CheckpointSave, ReplicasAreWrittenOnceByTheLowestRank) {
  TempRoot root("dedup");
  spawn_ranks(4, [&](Group& g) {
    // "r" is replicated on every rank; "s" is split in 2 and replicated twice (DP = 2).
    const at::Tensor s = global_tensor({4, 2}, at::kFloat);
    std::vector<checkpoint::TensorPiece> pieces = {checkpoint::TensorPiece::whole("r", at::ones({3})),
                                                   row_piece("s", s, 0, 2, g.rank() % 2)};
    const auto result = checkpoint::save(root.str(), 2, pieces, {}, {}, g);
    EXPECT_EQ(result.bytes_written > 0, g.rank() < 2) << "rank " << g.rank();
  });
  EXPECT_TRUE(fs::exists(root.path() / "step-00000002" / "rank-00000.safetensors"));
  EXPECT_TRUE(fs::exists(root.path() / "step-00000002" / "rank-00001.safetensors"));
  EXPECT_FALSE(fs::exists(root.path() / "step-00000002" / "rank-00002.safetensors"));
  EXPECT_FALSE(fs::exists(root.path() / "step-00000002" / "rank-00003.safetensors"));
}

TEST(CheckpointSave, StepsLatestKeepAndResave) {
  TempRoot root("steps");
  spawn_ranks(2, [&](Group& g) {
    for (int64_t step : {1, 2, 3}) {
      auto p = checkpoint::TensorPiece::whole("x", at::full({2}, float(step)));
      checkpoint::save(root.str(), step, {p}, {{"step_was", step}}, checkpoint::SaveOptions().keep(2), g);
    }
    EXPECT_EQ(checkpoint::saved_steps(root.str()), (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(checkpoint::latest_step(root.str()), 3);
    auto d = checkpoint::TensorPiece::whole("x", at::zeros({2}));
    auto result = checkpoint::load(root.str(), {d}, checkpoint::LoadOptions().step(2), g);
    EXPECT_EQ(result.step, 2);
    EXPECT_EQ(result.metadata.at("step_was"), 2);
    EXPECT_TRUE(at::equal(d.tensor, at::full({2}, 2.0f)));
    // Saving step 3 again replaces it (the directory is exchanged atomically).
    checkpoint::save(root.str(), 3, {checkpoint::TensorPiece::whole("x", at::full({2}, 33.0f))}, {}, {}, g);
    result = checkpoint::load(root.str(), {d}, {}, g);
    EXPECT_EQ(result.step, 3);
    EXPECT_TRUE(at::equal(d.tensor, at::full({2}, 33.0f)));
  });
  EXPECT_THAT(checkpoint::step_directory_name(10), "step-00000010");
}

TEST(CheckpointCrashSafety, FailureOnOneRankKeepsThePreviousStepAndLeavesNoPartialDirectory) {
  TempRoot root("fail");
  spawn_ranks(3, [&](Group& g) {
    auto piece = [&](float v) { return row_piece("x", at::full({6}, v), 0, 3, g.rank()); };
    checkpoint::save(root.str(), 5, {piece(5)}, {}, {}, g);
    // Rank 1 fails right after its shard file is on disk.
    auto options = checkpoint::SaveOptions().on_file_written([&](const std::string& path, int64_t bytes) {
      EXPECT_GT(bytes, 8);
      if (g.rank() == 1 && path.find("rank-00001.safetensors") != std::string::npos) {
        throw std::runtime_error("simulated crash after " + path);
      }
    });
    expect_error([&] { checkpoint::save(root.str(), 10, {piece(10)}, {}, options, g); },
                 {"[commgrad] checkpoint::save rank ", g.rank() == 1 ? "simulated crash after" : "rank 1 failed: "});
    EXPECT_EQ(checkpoint::latest_step(root.str()), 5);
    EXPECT_EQ(checkpoint::saved_steps(root.str()), (std::vector<int64_t>{5}));
    // Rank 0 removed the partial directory before it threw (a killed rank
    // leaves it instead: checkpoint_crash_test).
    if (g.rank() == 0) {
      EXPECT_FALSE(fs::exists(root.path() / ".step-00000010.partial"));
    }
    auto d = row_piece("x", at::zeros({6}), 0, 3, g.rank());
    EXPECT_EQ(checkpoint::load(root.str(), {d}, {}, g).step, 5);
    EXPECT_TRUE(at::equal(d.tensor, at::full({2}, 5.0f)));
    checkpoint::save(root.str(), 10, {piece(10)}, {}, {}, g);
    EXPECT_FALSE(fs::exists(root.path() / ".step-00000010.partial"));
    EXPECT_EQ(checkpoint::load(root.str(), {d}, {}, g).step, 10);
    EXPECT_TRUE(at::equal(d.tensor, at::full({2}, 10.0f)));
  });
}

// ~~~ Python's safetensors reads a shard file ~~~

bool python_has_safetensors() {
  const std::string python = COMMGRAD_TEST_PYTHON;
  if (python.empty() || !fs::exists(python)) return false;
  return run_process({python, "-c", "import safetensors.torch"}, {}, std::chrono::seconds(60)).exit_code == 0;
}

TEST(CheckpointFormat, PythonSafetensorsReadsAShardFile) {
  if (!python_has_safetensors()) {
    GTEST_SKIP() << "no Python with safetensors at '" << COMMGRAD_TEST_PYTHON
                 << "' (configure with -DCOMMGRAD_TEST_PYTHON=<python>; scripts/deps.sh installs it in .venv)";
  }
  TempRoot root("py");
  spawn_ranks(1, [&](Group& g) {
    std::vector<checkpoint::TensorPiece> pieces;
    for (const auto dtype : kDtypes)
      pieces.push_back(checkpoint::TensorPiece::whole(key(dtype), global_tensor({3, 4}, dtype)));
    // Two flat ranges of one box on one rank: entries "flat#0" and "flat#1", 1-d.
    pieces.push_back(flat_piece("flat", global_tensor({4, 5}, at::kFloat), {0, 0}, {4, 5}, 2, 0));
    pieces.push_back(flat_piece("flat", global_tensor({4, 5}, at::kFloat), {0, 0}, {4, 5}, 2, 1));
    checkpoint::save(root.str(), 7, pieces, {}, {}, g);
  });
  const std::string file = (root.path() / "step-00000007" / "rank-00000.safetensors").string();
  const std::string script = R"(
import sys, torch
from safetensors import safe_open
with safe_open(sys.argv[1], framework="pt") as f:
    meta = f.metadata()
    assert meta["commgrad.step"] == "7", meta
    for key in sorted(f.keys()):
        t = f.get_tensor(key)
        n = t.numel()
        ref = torch.arange(10, 20) if key == "flat#1" else torch.arange(n)
        if t.dtype == torch.bool: ref = ref % 3 == 1
        elif t.dtype in (torch.uint8, torch.int8): ref = ref % 100
        assert torch.equal(t.reshape(-1), ref.to(t.dtype)), key
        print(key, str(t.dtype).replace("torch.", ""), list(t.shape))
print("ok")
)";
  const auto result = run_process({COMMGRAD_TEST_PYTHON, "-c", script, file}, {}, std::chrono::seconds(60));
  ASSERT_EQ(result.exit_code, 0) << result.out << result.err;
  EXPECT_THAT(result.out, ::testing::HasSubstr("t/BFloat16 bfloat16 [3, 4]"));
  EXPECT_THAT(result.out, ::testing::HasSubstr("t/Bool bool [3, 4]"));
  EXPECT_THAT(result.out, ::testing::HasSubstr("flat#1 float32 [10]"));
  EXPECT_THAT(result.out, ::testing::HasSubstr("ok"));
}

}  // namespace
}  // namespace commgrad::testing
