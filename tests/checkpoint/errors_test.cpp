// Every error of checkpoint::save / load, each with the substring a user
// sees: not a checkpoint, a missing step, another model's index (missing and
// extra tensors, strict), dtype and global-shape mismatches, destinations
// not covered, malformed pieces, pieces that overlap or leave gaps, missing,
// truncated and corrupt shard files, and a failure on one rank only, which
// every rank reports (the others naming the failed rank) without hanging and
// without touching any destination.

#include "checkpoint/checkpoint_util.h"
#include "harness/spawn_ranks.h"

#include <commgrad/checkpoint.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace commgrad::testing {
namespace {

using checkpoint::TensorPiece;

// Saves "a" [4, 3] float32 (row-split over the ranks) and "b" [5] int64 at step 1.
void save_two(const TempRoot& root, int n) {
  spawn_ranks(n, [&](Group& g) {
    checkpoint::save(root.str(), 1,
                     {row_piece("a", global_tensor({4, 3}, at::kFloat), 0, n, g.rank()),
                      TensorPiece::whole("b", global_tensor({5}, at::kLong))},
                     {}, {}, g);
  });
}

std::vector<TensorPiece> two_dests() {
  return {TensorPiece::whole("a", at::zeros({4, 3})), TensorPiece::whole("b", at::zeros({5}, at::kLong))};
}

void load_one_rank_expecting(const std::string& root, std::vector<TensorPiece> dests,
                             const std::vector<std::string>& parts, checkpoint::LoadOptions options = {}) {
  spawn_ranks(1, [&](Group& g) { expect_error([&] { checkpoint::load(root, dests, options, g); }, parts); });
}

TEST(CheckpointErrors, NotACheckpoint) {
  TempRoot root("not");
  load_one_rank_expecting(root.str(), two_dests(),
                          {"[commgrad] checkpoint::load rank 0/1 group 'world' (gloo): the checkpoint root ",
                           "does not exist or is not a directory"});
  fs::create_directories(root.path());
  load_one_rank_expecting(root.str(), two_dests(),
                          {"is not a checkpoint root: it has no 'latest' file (complete steps in it: none)"});
  std::ofstream(root.path() / "latest") << "garbage\n";
  load_one_rank_expecting(root.str(), two_dests(), {"latest does not name a step directory (it holds 'garbage')"});
  fs::remove(root.path() / "latest");
  fs::create_directories(root.path() / "step-00000004");
  load_one_rank_expecting(root.str(), two_dests(), {"step-00000004 is not a checkpoint step: it has no index.json"},
                          checkpoint::LoadOptions().step(4));
  std::ofstream(root.path() / "step-00000004" / "index.json") << "{\"weights\": [1, 2]}";
  load_one_rank_expecting(root.str(), two_dests(),
                          {"index.json is not a commgrad checkpoint index (no \"format\": \"commgrad-checkpoint\")"},
                          checkpoint::LoadOptions().step(4));
  std::ofstream(root.path() / "step-00000004" / "index.json") << "not json";
  load_one_rank_expecting(root.str(), two_dests(), {"index.json is not a commgrad checkpoint index ("},
                          checkpoint::LoadOptions().step(4));
}

TEST(CheckpointErrors, MissingStep) {
  TempRoot root("step");
  save_two(root, 2);
  load_one_rank_expecting(root.str(), two_dests(),
                          {"step-00000009 is not a checkpoint step: it does not exist (complete steps in ", ": 1)"},
                          checkpoint::LoadOptions().step(9));
}

TEST(CheckpointErrors, RanksThatFindDifferentSteps) {
  TempRoot root("split");
  spawn_ranks(2, [&](Group& g) {
    for (int64_t step : {1, 2})
      checkpoint::save(root.str(), step, {TensorPiece::whole("x", at::zeros({2}))}, {}, {}, g);
    auto d = TensorPiece::whole("x", at::ones({2}));
    expect_error([&] { checkpoint::load(root.str(), {d}, checkpoint::LoadOptions().step(g.rank() + 1), g); },
                 {g.rank() == 0 ? "rank 1 found step 2 in " : "rank 0 found step 1 in ",
                  "(did a save replace 'latest' during the load?)"});
    EXPECT_TRUE(at::equal(d.tensor, at::ones({2})));
  });
}

TEST(CheckpointErrors, AnotherModelsIndex) {
  TempRoot root("model");
  save_two(root, 2);
  // A tensor this rank loads that the checkpoint lacks.
  auto dests = two_dests();
  dests.push_back(TensorPiece::whole("c", at::zeros({2})));
  load_one_rank_expecting(root.str(), dests,
                          {"has no tensor 'c', which this rank loads (a checkpoint of another model?)"});
  // ... unless it is optional.
  spawn_ranks(1, [&](Group& g) {
    auto d = two_dests();
    d.push_back(TensorPiece::whole("c", at::full({2}, 3.0f)));
    d.back().required = false;
    const auto result = checkpoint::load(root.str(), d, {}, g);
    EXPECT_EQ(result.skipped, std::vector<std::string>{"c"});
    EXPECT_TRUE(at::equal(d.back().tensor, at::full({2}, 3.0f)));
  });
  // A tensor of the checkpoint that no rank loads: strict fails, strict(false) passes.
  load_one_rank_expecting(root.str(), {TensorPiece::whole("a", at::zeros({4, 3}))},
                          {"holds 1 tensor that no rank loads: 'b' (a checkpoint of another model? "
                           "LoadOptions().strict(false) ignores them)"});
  spawn_ranks(1, [&](Group& g) {
    checkpoint::load(root.str(), {TensorPiece::whole("a", at::zeros({4, 3}))}, checkpoint::LoadOptions().strict(false),
                     g);
  });
}

TEST(CheckpointErrors, DtypeAndGlobalShapeMismatch) {
  TempRoot root("mismatch");
  save_two(root, 1);
  load_one_rank_expecting(
      root.str(), {TensorPiece::whole("a", at::zeros({4, 3}, at::kDouble)), two_dests()[1]},
      {"tensor 'a' was saved as F32 [4, 3]; the destination is F64 ('a' float64 box [0:4, 0:3] of [4, 3])"});
  load_one_rank_expecting(root.str(), {TensorPiece::whole("a", at::zeros({4, 4})), two_dests()[1]},
                          {"tensor 'a' has global shape [4, 3] in the checkpoint, but [4, 4] here"});
}

TEST(CheckpointErrors, DestinationNotCovered) {
  TempRoot root("cover");
  save_two(root, 2);
  // Drop rank 1's piece of "a" from the index (as if the index were edited).
  const fs::path index_path = root.path() / "step-00000001" / "index.json";
  nlohmann::json index = nlohmann::json::parse(std::ifstream(index_path));
  auto& pieces = index["tensors"]["a"]["pieces"];
  pieces.erase(pieces.begin() + 1);
  std::ofstream(index_path) << index.dump();
  load_one_rank_expecting(root.str(), two_dests(),
                          {"tensor 'a' [4, 3]: the saved pieces (boxes [0:2, 0:3]) cover 6 of the 12 elements of the "
                           "destination box [0:4, 0:3] elements [0, 12)"});
}

TEST(CheckpointErrors, MalformedPieces) {
  TempRoot root("malformed");
  spawn_ranks(2, [&](Group& g) {
    TensorPiece outside;
    outside.name = "w";
    outside.global_shape = {4, 4};
    outside.box_offset = {3, 0};
    outside.box_shape = {2, 4};
    outside.tensor = at::zeros({2, 4});
    TensorPiece wrong_numel = TensorPiece::whole("v", at::zeros({3}));
    wrong_numel.global_shape = {4};
    TensorPiece complex = TensorPiece::whole("z", at::zeros({2}, at::kComplexFloat));
    TensorPiece ok = TensorPiece::whole("ok", at::zeros({2}));
    TensorPiece unnamed = TensorPiece::whole("", at::zeros({2}));
    TensorPiece no_tensor = TensorPiece::whole("t", at::Tensor());
    TensorPiece range = TensorPiece::whole("r", at::zeros({2}));
    range.flat_begin = 1;
    range.flat_end = 3;
    TensorPiece dims = TensorPiece::whole("d", at::zeros({2, 2}));
    dims.box_offset = {0};
    dims.box_shape = {2};
    // A bad piece on rank 1 only: rank 1 says what, rank 0 names rank 1.
    auto on_rank_1 = [&](const TensorPiece& bad) {
      return g.rank() == 1 ? std::vector<TensorPiece>{ok, bad} : std::vector<TensorPiece>{ok};
    };
    expect_error([&] { checkpoint::save(root.str(), 1, on_rank_1(outside), {}, {}, g); },
                 {g.rank() == 1 ? "piece 'w' float32 box [3:5, 0:4] of [4, 4]: the box does not lie inside the global "
                                  "shape (dim 0)"
                                : "[commgrad] checkpoint::save rank 0/2 group 'world' (gloo): rank 1 failed: "});
    expect_error([&] { checkpoint::save(root.str(), 1, on_rank_1(wrong_numel), {}, {}, g); },
                 {g.rank() == 1 ? "its tensor float32[3] has 3 elements, the piece holds 4" : "rank 1 failed"});
    expect_error([&] { checkpoint::save(root.str(), 1, on_rank_1(complex), {}, {}, g); },
                 {g.rank() == 1 ? "checkpoints hold float32, float64, bfloat16" : "rank 1 failed"});
    expect_error([&] { checkpoint::save(root.str(), 1, on_rank_1(unnamed), {}, {}, g); },
                 {g.rank() == 1 ? "a piece has an empty name" : "rank 1 failed"});
    expect_error([&] { checkpoint::save(root.str(), 1, on_rank_1(no_tensor), {}, {}, g); },
                 {g.rank() == 1 ? "piece 't' box [] of [] has no tensor" : "rank 1 failed"});
    expect_error([&] { checkpoint::save(root.str(), 1, on_rank_1(range), {}, {}, g); },
                 {g.rank() == 1 ? "the element range is not inside the box of 2 elements" : "rank 1 failed"});
    expect_error([&] { checkpoint::save(root.str(), 1, on_rank_1(dims), {}, {}, g); },
                 {g.rank() == 1 ? "box_offset and box_shape need 2 dims, like the global shape" : "rank 1 failed"});
    // Steps that differ between ranks.
    expect_error([&] { checkpoint::save(root.str(), g.rank() == 0 ? 1 : 2, {ok}, {}, {}, g); },
                 {g.rank() == 0 ? "rank 1 saves step 2, this rank step 1" : "rank 0 saves step 1, this rank step 2"});
  });
  EXPECT_FALSE(fs::exists(root.path() / "latest"));
}

TEST(CheckpointErrors, PiecesThatDisagreeOverlapOrLeaveGaps) {
  TempRoot root("plan");
  spawn_ranks(2, [&](Group& g) {
    const at::Tensor full = global_tensor({4, 2}, at::kFloat);
    // Rank 1 holds "w" as float64.
    auto w = row_piece("w", g.rank() == 1 ? full.to(at::kDouble) : full, 0, 2, g.rank());
    expect_error([&] { checkpoint::save(root.str(), 1, {w}, {}, {}, g); },
                 {"tensor 'w' is F32 [4, 2] on rank 0 but F64 [4, 2] on rank 1"});
    // Both ranks claim rows 0-2 with different boxes (0:3 and 1:4): overlap.
    TensorPiece a;
    a.name = "w";
    a.global_shape = {4, 2};
    a.box_offset = {g.rank() == 0 ? 0 : 1, 0};
    a.box_shape = {3, 2};
    a.tensor = at::zeros({3, 2});
    expect_error([&] { checkpoint::save(root.str(), 1, {a}, {}, {}, g); },
                 {"tensor 'w': the pieces box [0:3, 0:2] elements [0, 6) on rank 0 and box [1:4, 0:2] elements "
                  "[0, 6) on rank 1 overlap; mark all but one copy write = false"});
    // Only rank 0's half is written.
    auto half = row_piece("w", full, 0, 2, g.rank());
    half.write = g.rank() == 0;
    expect_error([&] { checkpoint::save(root.str(), 1, {half}, {}, {}, g); },
                 {"tensor 'w' F32 [4, 2]: the pieces written cover 4 of its 8 elements"});
  });
}

// An index that parses but does not hold together (edited, or another version).
TEST(CheckpointErrors, InconsistentIndex) {
  TempRoot root("index");
  save_two(root, 2);
  const fs::path index_path = root.path() / "step-00000001" / "index.json";
  const nlohmann::json good = nlohmann::json::parse(std::ifstream(index_path));
  auto with = [&](const std::function<void(nlohmann::json&)>& edit, const std::vector<TensorPiece>& dests,
                  const std::vector<std::string>& parts) {
    nlohmann::json index = good;
    edit(index);
    std::ofstream(index_path) << index.dump();
    load_one_rank_expecting(root.str(), dests, parts);
  };
  with([](nlohmann::json& j) { j["version"] = 2; }, two_dests(),
       {"index.json has index version 2; this commgrad reads version 1"});
  with([](nlohmann::json& j) { j["tensors"]["a"]["pieces"][0]["file"] = "zzz.safetensors"; }, two_dests(),
       {"a piece of 'a' names file 'zzz.safetensors', which the index does not list"});
  with(
      [](nlohmann::json& j) {
        j["tensors"]["a"]["pieces"][0]["box_offset"] = {3, 0};
      },
      two_dests(), {"a piece of 'a' lies outside the tensor's global shape"});
  with([](nlohmann::json& j) { j["tensors"]["a"]["dtype"] = "C64"; }, two_dests(),
       {"tensor 'a' has dtype 'C64', which commgrad does not read"});
  with([](nlohmann::json& j) { j["tensors"]["a"].erase("pieces"); }, two_dests(),
       {"index.json is a corrupt commgrad checkpoint index: "});
  // The index and the shard file disagree: a key, a dtype.
  with([](nlohmann::json& j) { j["tensors"]["a"]["pieces"][1]["key"] = "a2"; }, two_dests(),
       {"rank-00001.safetensors has no entry 'a2' (tensor 'a')"});
  with([](nlohmann::json& j) { j["tensors"]["a"]["dtype"] = "I32"; },
       {TensorPiece::whole("a", at::zeros({4, 3}, at::kInt)), two_dests()[1]},
       {"entry 'a' is F32 [2, 3], the index records I32 with 6 elements"});
}

TEST(CheckpointErrors, RootThatIsAFile) {
  TempRoot root("file");
  fs::create_directories(root.path());
  std::ofstream(root.path() / "plain") << "x";
  spawn_ranks(2, [&](Group& g) {
    expect_error(
        [&] {
          checkpoint::save((root.path() / "plain").string(), 1, {TensorPiece::whole("x", at::zeros({1}))}, {}, {}, g);
        },
        {g.rank() == 0 ? "cannot create the checkpoint root " : "rank 0 failed: "});
    expect_error(
        [&] { checkpoint::load((root.path() / "plain").string(), {TensorPiece::whole("x", at::zeros({1}))}, {}, g); },
        {"plain does not exist or is not a directory"});
  });
}

// Shard files: missing, truncated, longer than recorded, a flipped data byte, a corrupt header.
TEST(CheckpointErrors, BrokenShardFiles) {
  TempRoot root("files");
  save_two(root, 2);
  const fs::path file = root.path() / "step-00000001" / "rank-00001.safetensors";
  const fs::path copy = root.path() / "good.safetensors";
  fs::copy_file(file, copy);
  const auto size = fs::file_size(file);

  fs::remove(file);
  load_one_rank_expecting(
      root.str(), two_dests(),
      {"[commgrad] checkpoint::load rank 0/1", "rank-00001.safetensors is missing (rank 1 of the save wrote it)"});

  fs::copy_file(copy, file);
  fs::resize_file(file, size - 5);
  load_one_rank_expecting(root.str(), two_dests(),
                          {"rank-00001.safetensors is truncated: ",
                           std::to_string(size - 5) + " bytes, the index records " + std::to_string(size)});

  fs::copy_file(copy, file, fs::copy_options::overwrite_existing);
  std::ofstream(file, std::ios::app | std::ios::binary) << "extra";
  load_one_rank_expecting(root.str(), two_dests(),
                          {"rank-00001.safetensors has " + std::to_string(size + 5) + " bytes, the index records " +
                           std::to_string(size) + " (it is not the file this index was written with)"});

  fs::copy_file(copy, file, fs::copy_options::overwrite_existing);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size - 1));
    f.put('\x7f');
  }
  load_one_rank_expecting(
      root.str(), two_dests(),
      {"checksum mismatch in shard file ", "rank-00001.safetensors, entry 'a' (tensor 'a' box [2:4, 0:3]): crc32 0x",
       ", the index records 0x"});

  fs::copy_file(copy, file, fs::copy_options::overwrite_existing);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put('#');
  }
  load_one_rank_expecting(root.str(), two_dests(), {"rank-00001.safetensors has a corrupt safetensors header: "});
}

// A corrupt file that only rank 1 reads: every rank raises, rank 1 with the
// details, rank 0 naming rank 1; no destination is written on any rank.
TEST(CheckpointErrors, FailureOnOneRankRaisesOnEveryRankAndChangesNothing) {
  TempRoot root("one");
  save_two(root, 2);
  const fs::path file = root.path() / "step-00000001" / "rank-00001.safetensors";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(file) - 1));
    f.put('\x7f');
  }
  spawn_ranks(2, [&](Group& g) {
    // Rank r loads row r of "a": only rank 1's rows are in the damaged file... and "b" from rank 0's.
    auto a = row_piece("a", at::full({4, 3}, -1.0f), 0, 2, g.rank());
    auto b = TensorPiece::whole("b", at::full({5}, int64_t(-1)));
    expect_error(
        [&] {
          checkpoint::load(root.str(), {a, b}, {}, g);
        },
        {g.rank() == 1 ? "checksum mismatch in shard file "
                       : "[commgrad] checkpoint::load rank 0/2 group 'world' (gloo): rank 1 failed: "
                         "[commgrad] checkpoint::load rank 1/2"});
    EXPECT_TRUE(at::equal(a.tensor, at::full({2, 3}, -1.0f)));
    EXPECT_TRUE(at::equal(b.tensor, at::full({5}, int64_t(-1))));
  });
}

}  // namespace
}  // namespace commgrad::testing
