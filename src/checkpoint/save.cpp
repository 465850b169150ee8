// checkpoint::save in four phases, each ending in one status exchange
// (detail/agree.h), so that a failure on any rank makes every rank throw:
//
//   describe  each rank checks its pieces and all-gathers their descriptors;
//             every rank then builds the same plan from the same list:
//             tensors by name (dtype and global shape must agree), who
//             writes which piece (the lowest rank of identical replicas),
//             and a check that the written pieces cover each tensor exactly
//             once (pairwise box intersection, then an element count)
//   prepare   rank 0 creates root, removes stale partial directories and
//             creates root/.step-N.partial
//   write     each writer writes rank-<r>.safetensors (fsync), reports its
//             size and the crc32 of every piece
//   publish   rank 0 writes index.json, renames the partial directory to
//             step-N (fsync of root), replaces `latest` atomically
//             (latest.tmp, fsync, rename, fsync of root), prunes
//
// Until `publish` renames the directory nothing of step N is visible; until
// it replaces `latest`, load() without a step keeps finding the previous
// step. The cost beyond the data: two small all-gathers per phase.

#include "commgrad/checkpoint/save.h"

#include "detail/agree.h"
#include "detail/boxes.h"
#include "detail/directory.h"
#include "detail/files.h"
#include "detail/index.h"
#include "detail/safetensors.h"

#include "commgrad/checkpoint/directory.h"
#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <map>

namespace commgrad::checkpoint {

namespace fs = std::filesystem;
using detail::PieceInfo;

namespace {

constexpr const char* kSaveOp = "checkpoint::save";

std::string rank_file_name(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "rank-%05d.safetensors", rank);
  return buf;
}

// A piece as the plan knows it: its descriptor and where it came from.
struct PlannedPiece {
  PieceInfo info;
  int rank = 0;
  size_t local_index = 0;  // in that rank's list of pieces
  bool writes = false;     // this copy is the one written
  std::string key;         // in the writer's file
};

struct Plan {
  detail::Index index;
  std::vector<std::vector<PlannedPiece>> by_rank;  // every rank's pieces, in order
};

std::string piece_place(const PlannedPiece& p) {
  return c10::str("box ", detail::box_name(p.info.box), " elements [", p.info.flat_begin, ", ", p.info.flat_end,
                  ") on rank ", p.rank);
}

Plan make_plan(const std::vector<std::string>& described, int64_t step, const Group& group) {
  Plan plan;
  plan.by_rank.resize(described.size());
  std::map<std::string, std::vector<PlannedPiece*>> by_name;
  for (size_t r = 0; r < described.size(); ++r) {
    const auto j = nlohmann::json::parse(described[r]);
    COMMGRAD_CHECK(j.at("step").get<int64_t>() == step, kSaveOp, group, "rank ", r, " saves step ",
                   j.at("step").get<int64_t>(), ", this rank step ", step);
    for (const auto& p : j.at("pieces")) {
      plan.by_rank[r].push_back(
          PlannedPiece{detail::piece_from_json(p), static_cast<int>(r), plan.by_rank[r].size(), false, ""});
    }
  }
  for (auto& pieces : plan.by_rank) {
    for (auto& p : pieces) by_name[p.info.name].push_back(&p);
  }
  for (auto& [name, pieces] : by_name) {
    const PlannedPiece& first = *pieces.front();
    detail::SavedTensor saved{first.info.dtype, first.info.global_shape, false, {}};
    std::vector<PlannedPiece*> written;
    for (PlannedPiece* p : pieces) {
      COMMGRAD_CHECK(p->info.dtype == saved.dtype && p->info.global_shape == saved.global_shape, kSaveOp, group,
                     "tensor '", name, "' is ", saved.dtype, " ", shape_name(saved.global_shape), " on rank ",
                     first.rank, " but ", p->info.dtype, " ", shape_name(p->info.global_shape), " on rank ", p->rank);
      saved.required = saved.required || p->info.required;
      if (!p->info.write) continue;
      bool replica = false;
      for (const PlannedPiece* w : written) replica = replica || w->info.same_region(p->info);
      if (replica) continue;  // a lower rank writes the same region
      for (const PlannedPiece* w : written) {
        const bool overlap =
            w->info.box == p->info.box
                ? (p->info.flat_begin < w->info.flat_end && w->info.flat_begin < p->info.flat_end)
                : detail::intersect(w->info.box, p->info.box).has_value() && p->info.count() > 0 && w->info.count() > 0;
        COMMGRAD_CHECK(!overlap, kSaveOp, group, "tensor '", name, "': the pieces ", piece_place(*w), " and ",
                       piece_place(*p), " overlap; mark all but one copy write = false");
      }
      p->writes = true;
      written.push_back(p);
    }
    int64_t covered = 0;
    for (const PlannedPiece* w : written) covered += w->info.count();
    const int64_t total = detail::volume(saved.global_shape);
    COMMGRAD_CHECK(covered == total, kSaveOp, group, "tensor '", name, "' ", saved.dtype, " ",
                   shape_name(saved.global_shape), ": the pieces written cover ", covered, " of its ", total,
                   " elements");
    // Keys in each writer's file: the name, or name#k for a rank's k-th piece of it.
    std::map<int, int> per_rank;
    for (const PlannedPiece* w : written) per_rank[w->rank]++;
    std::map<int, int> seen;
    for (PlannedPiece* w : written) {
      w->key = per_rank[w->rank] == 1 ? name : c10::str(name, "#", seen[w->rank]++);
      detail::SavedPiece sp;
      sp.box = w->info.box;
      sp.flat_begin = w->info.flat_begin;
      sp.flat_end = w->info.flat_end;
      sp.file = rank_file_name(w->rank);
      sp.key = w->key;
      plan.index.files[sp.file].rank = w->rank;
      saved.pieces.push_back(std::move(sp));
    }
    plan.index.tensors.emplace(name, std::move(saved));
  }
  return plan;
}

void notify(const SaveOptions& options, const std::string& path, int64_t bytes) {
  if (options.on_file_written()) options.on_file_written()(path, bytes);
}

// The four phases of a save (the file comment), each agreed by every rank.
struct SaveRun {
  const std::string& root;
  int64_t step;
  const std::vector<TensorPiece>& pieces;
  const SaveOptions& options;
  Group group;
  int rank;
  fs::path final_dir, partial_dir;

  // describe: every rank's pieces, checked locally.
  std::vector<std::string> describe() const {
    return detail::run_phase(kSaveOp, group, [&] {
      COMMGRAD_CHECK(step >= 0, kSaveOp, group, "steps are non-negative, got ", step);
      COMMGRAD_CHECK(!root.empty(), kSaveOp, group, "the checkpoint root is empty");
      nlohmann::json list = nlohmann::json::array();
      for (const auto& piece : pieces) {
        try {
          list.push_back(detail::to_json(detail::check_piece(piece)));
        } catch (const c10::Error& e) {
          COMMGRAD_CHECK(false, kSaveOp, group, e.what_without_backtrace());
        }
      }
      return nlohmann::json{{"step", step}, {"pieces", list}}.dump();
    });
  }

  // prepare: rank 0 makes the root and an empty partial directory.
  void prepare() const {
    detail::run_phase(kSaveOp, group, [&] {
      if (rank != 0) return std::string();
      std::error_code ec;
      fs::create_directories(root, ec);
      COMMGRAD_CHECK(fs::is_directory(root), kSaveOp, group, "cannot create the checkpoint root ", root, ": ",
                     ec ? ec.message() : "it is not a directory");
      detail::remove_stale_partials(root);
      detail::prune_before_save(root, options.keep(), step);
      COMMGRAD_CHECK(fs::create_directory(partial_dir, ec), kSaveOp, group, "cannot create ", partial_dir.string(),
                     ": ", ec.message());
      return std::string();
    });
  }

  // write: each rank its file; returns every rank's bytes and checksums.
  std::vector<std::string> write(const Plan& plan, int64_t& bytes_written) const {
    return detail::run_phase(kSaveOp, group, [&] {
      std::vector<detail::SafetensorsEntry> entries;
      for (const PlannedPiece& p : plan.by_rank[rank]) {
        if (!p.writes) continue;
        const at::Tensor& t = pieces[p.local_index].tensor;
        entries.push_back({p.key, t.detach().to(at::kCPU).contiguous().reshape({-1})});
        // A whole box is stored in its shape, a flat range as 1-d, so a
        // Python reader sees the tensor it expects.
        if (p.info.whole_box()) entries.back().tensor = entries.back().tensor.view(p.info.box.shape);
      }
      if (entries.empty()) return std::string("{}");
      const std::string path = (partial_dir / rank_file_name(rank)).string();
      std::vector<detail::WrittenEntry> crcs;
      const std::map<std::string, std::string> meta = {
          {"format", "pt"}, {"commgrad.step", std::to_string(step)}, {"commgrad.rank", std::to_string(rank)}};
      bytes_written = detail::write_safetensors(path, entries, meta, crcs);
      notify(options, path, bytes_written);
      nlohmann::json out = {{"bytes", bytes_written}, {"crc32", nlohmann::json::object()}};
      for (const auto& c : crcs) out["crc32"][c.key] = c.crc32;
      return out.dump();
    });
  }

  void published(const char* what) const {
    if (options.on_publish()) options.on_publish()(what);
  }

  // A failed write or publish: rank 0 removes the partial directory, so that
  // a full disk is not kept full (a rank killed instead leaves it to the next save).
  void clean_up() const {
    if (rank != 0) return;
    std::error_code ec;
    fs::remove_all(partial_dir, ec);
  }

  // publish: rank 0 completes the index, renames the directory into place,
  // points "latest" at it and prunes old steps.
  void publish(Plan& plan, const std::vector<std::string>& written) const {
    detail::run_phase(kSaveOp, group, [&] {
      if (rank != 0) return std::string();
      for (size_t r = 0; r < written.size(); ++r) {
        const auto j = nlohmann::json::parse(written[r]);
        if (!j.contains("bytes")) continue;
        const std::string file = rank_file_name(static_cast<int>(r));
        plan.index.files[file].bytes = j.at("bytes").get<int64_t>();
        for (auto& [name, tensor] : plan.index.tensors) {
          for (auto& p : tensor.pieces) {
            if (p.file == file) p.crc32 = j.at("crc32").at(p.key).get<uint32_t>();
          }
        }
      }
      const std::string index_path = (partial_dir / kIndexFileName).string();
      const std::string text = detail::serialize_index(plan.index);
      detail::write_file_durably(index_path, text);
      detail::fsync_directory(partial_dir.string());
      notify(options, index_path, static_cast<int64_t>(text.size()));
      published("index");
      detail::rename_directory_into_place(partial_dir.string(), final_dir.string());
      detail::fsync_directory(root);
      published("renamed");
      const std::string latest = (fs::path(root) / kLatestFileName).string();
      const std::string pointer = step_directory_name(step) + "\n";
      detail::write_file_durably(latest + ".tmp", pointer);
      published("latest.tmp");
      COMMGRAD_CHECK(std::rename((latest + ".tmp").c_str(), latest.c_str()) == 0, kSaveOp, group, "cannot rename ",
                     latest, ".tmp to ", latest, ": ", detail::errno_message());
      detail::fsync_directory(root);
      notify(options, latest, static_cast<int64_t>(pointer.size()));
      published("latest");
      detail::prune_steps(root, options.keep(), step);
      published("pruned");
      return std::string();
    });
  }
};

}  // namespace

SaveResult save(const std::string& root, int64_t step, const std::vector<TensorPiece>& pieces,
                const nlohmann::json& metadata, const SaveOptions& options, const Group& group_in) {
  const Group group = ops::raw::resolve_group(group_in);
  check_member(kSaveOp, group);
  SaveRun run{root, step, pieces, options, group, group.rank(), {}, {}};
  Plan plan = make_plan(run.describe(), step, group);  // checks the step before it names a directory
  run.final_dir = fs::path(root) / step_directory_name(step);
  run.partial_dir = fs::path(root) / detail::partial_directory_name(step);
  plan.index.step = step;
  plan.index.world_size = group.size();
  plan.index.metadata = metadata;
  run.prepare();
  int64_t bytes_written = 0;
  try {
    const auto written = run.write(plan, bytes_written);
    run.publish(plan, written);
  } catch (...) {
    run.clean_up();
    throw;
  }
  return SaveResult{step, run.final_dir.string(), bytes_written};
}

}  // namespace commgrad::checkpoint
