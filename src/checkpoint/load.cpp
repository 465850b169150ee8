// checkpoint::load in two phases, each ending in one status exchange
// (detail/agree.h):
//
//   plan   each rank finds the step (LoadOptions::step or root/latest),
//          parses index.json, checks its destination pieces against it
//          (name present, same dtype, same global shape) and all-gathers
//          the names it loads; with strict(), every rank then checks that
//          each required tensor of the checkpoint is loaded by some rank,
//          in the sections (name up to its first '/') that are loaded at all
//   read   each rank assembles every destination piece into a temporary
//          buffer (detail/reshard.h), reading only the saved pieces that
//          overlap it and checking their checksums
// Only when every rank has read everything are the destinations written, so
// a load that fails anywhere fails everywhere and changes nothing.

#include "commgrad/checkpoint/load.h"

#include "detail/agree.h"
#include "detail/directory.h"
#include "detail/files.h"
#include "detail/index.h"
#include "detail/reshard.h"
#include "detail/safetensors.h"

#include "commgrad/checkpoint/directory.h"
#include "commgrad/dist/check.h"
#include "commgrad/ops/raw.h"
#include "commgrad/util/names.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <filesystem>
#include <set>

namespace commgrad::checkpoint {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLoadOp = "checkpoint::load";

std::string list_names(const std::vector<std::string>& names, size_t most = 8) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < most; ++i) out += c10::str(i ? ", " : "", "'", names[i], "'");
  if (names.size() > most) out += c10::str(", ... (", names.size(), " in all)");
  return out;
}

// "model/" of "model/fc1.weight": the name up to its first '/' ("" for none).
std::string section_of(const std::string& name) {
  const auto slash = name.find('/');
  return slash == std::string::npos ? std::string() : name.substr(0, slash + 1);
}

std::string list_steps(const std::string& root) {
  const auto steps = saved_steps(root);
  if (steps.empty()) return "none";
  std::string out;
  for (size_t i = 0; i < steps.size(); ++i) out += c10::str(i ? ", " : "", steps[i]);
  return out;
}

// The step directory to load, or an error saying why there is none.
std::string find_step_directory(const std::string& root, const std::optional<int64_t>& step) {
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(root, ec), "the checkpoint root ", root, " does not exist or is not a directory");
  int64_t chosen = 0;
  if (step) {
    chosen = *step;
  } else {
    const auto latest = latest_step(root);
    TORCH_CHECK(latest.has_value(), root, " is not a checkpoint root: it has no '", kLatestFileName,
                "' file (complete steps in it: ", list_steps(root), ")");
    chosen = *latest;
  }
  const fs::path dir = fs::path(root) / step_directory_name(chosen);
  TORCH_CHECK(fs::exists(dir / kIndexFileName, ec), dir.string(), " is not a checkpoint step: ",
              fs::exists(dir, ec) ? "it has no " + std::string(kIndexFileName) : std::string("it does not exist"),
              " (complete steps in ", root, ": ", list_steps(root), ")");
  return dir.string();
}

// One load, phase by phase (the file comment): plan, agree, read, copy.
struct LoadRun {
  const std::string& root;
  const std::vector<TensorPiece>& pieces;
  const LoadOptions& options;
  Group group;
  LoadResult result;
  detail::Index index;
  std::vector<detail::PieceInfo> dests;
  std::vector<bool> skip;

  LoadRun(const std::string& r, const std::vector<TensorPiece>& p, const LoadOptions& o, Group g)
      : root(r), pieces(p), options(o), group(std::move(g)), dests(p.size()), skip(p.size(), false) {}

  // Checks piece i against the index; false when the checkpoint lacks it
  // (`missing` when the piece is required, skipped otherwise).
  bool match_piece(size_t i, std::vector<std::string>& missing) {
    try {
      dests[i] = detail::check_piece(pieces[i]);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, e.what_without_backtrace());
    }
    const auto it = index.tensors.find(dests[i].name);
    if (it == index.tensors.end()) {
      if (pieces[i].required) {
        missing.push_back(dests[i].name);
      } else {
        skip[i] = true;
        result.skipped.push_back(dests[i].name);
      }
      return false;
    }
    const detail::SavedTensor& saved = it->second;
    TORCH_CHECK(saved.dtype == dests[i].dtype, "tensor '", dests[i].name, "' was saved as ", saved.dtype, " ",
                shape_name(saved.global_shape), "; the destination is ", dests[i].dtype, " (", describe(pieces[i]),
                ")");
    TORCH_CHECK(saved.global_shape == dests[i].global_shape, "tensor '", dests[i].name, "' has global shape ",
                shape_name(saved.global_shape), " in the checkpoint, but ", shape_name(dests[i].global_shape),
                " here (", describe(pieces[i]), ")");
    return true;
  }

  // plan: each rank finds the step, reads the index and matches its pieces;
  // returns every rank's step and the names it loads.
  std::vector<std::string> plan() {
    return detail::run_phase(kLoadOp, group, [&] {
      result.directory = find_step_directory(root, options.step());
      const std::string index_path = (fs::path(result.directory) / kIndexFileName).string();
      index = detail::parse_index(detail::read_whole_file(index_path), index_path);
      result.step = index.step;
      result.metadata = index.metadata;
      result.saved_world_size = index.world_size;
      std::vector<std::string> missing;
      nlohmann::json names = nlohmann::json::array();
      for (size_t i = 0; i < pieces.size(); ++i) {
        if (match_piece(i, missing)) names.push_back(dests[i].name);
      }
      std::sort(missing.begin(), missing.end());
      missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
      TORCH_CHECK(missing.empty(), "the checkpoint ", result.directory, " has no tensor ", list_names(missing),
                  ", which this rank loads (a checkpoint of another model?)");
      return nlohmann::json{{"step", index.step}, {"names", names}}.dump();
    });
  }

  // agree: every rank resolved `latest` itself (a save that replaced it
  // meanwhile would split them); strict: nothing of a loaded section is left.
  void agree(const std::vector<std::string>& requested) const {
    std::set<std::string> loaded;
    for (size_t r = 0; r < requested.size(); ++r) {
      const auto j = nlohmann::json::parse(requested[r]);
      COMMGRAD_CHECK(j.at("step").get<int64_t>() == index.step, kLoadOp, group, "rank ", r, " found step ",
                     j.at("step").get<int64_t>(), " in ", root, ", this rank step ", index.step,
                     " (did a save replace 'latest' during the load?)");
      for (const auto& name : j.at("names")) loaded.insert(name.get<std::string>());
    }
    if (!options.strict()) return;
    // Only sections some rank loads count: a weights-only load of a training
    // checkpoint ("model/" without "optim/" and "rng/") is strict about the model.
    std::set<std::string> sections;
    for (const auto& name : loaded) sections.insert(section_of(name));
    std::vector<std::string> extra;
    for (const auto& [name, saved] : index.tensors) {
      if (saved.required && !loaded.count(name) && sections.count(section_of(name))) extra.push_back(name);
    }
    COMMGRAD_CHECK(extra.empty(), kLoadOp, group, "the checkpoint ", result.directory, " holds ", extra.size(),
                   " tensor", extra.size() == 1 ? "" : "s", " that no rank loads: ", list_names(extra),
                   " (a checkpoint of another model? LoadOptions().strict(false) ignores them)");
  }

  // read, grouped by name so that the reader's cache holds one tensor's
  // pieces at a time; then copy into the destinations.
  void read_and_copy() {
    std::vector<size_t> order;
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (!skip[i]) order.push_back(i);
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return dests[a].name < dests[b].name; });
    std::vector<at::Tensor> staged(pieces.size());
    detail::run_phase(kLoadOp, group, [&] {
      detail::ShardReader reader(result.directory, index);
      for (size_t k = 0; k < order.size(); ++k) {
        const size_t i = order[k];
        if (k > 0 && dests[order[k - 1]].name != dests[i].name) reader.clear();
        staged[i] = detail::assemble(dests[i], index.tensors.at(dests[i].name), reader);
      }
      return std::string();
    });
    c10::AutoGradMode no_grad(false);
    for (const size_t i : order) {
      at::Tensor dest = pieces[i].tensor;
      dest.copy_(staged[i].view(dest.sizes()));
    }
  }
};

}  // namespace

LoadResult load(const std::string& root, const std::vector<TensorPiece>& pieces, const LoadOptions& options,
                const Group& group_in) {
  const Group group = ops::raw::resolve_group(group_in);
  check_member(kLoadOp, group);
  LoadRun run(root, pieces, options, group);
  run.agree(run.plan());
  run.read_and_copy();
  return run.result;
}

}  // namespace commgrad::checkpoint
