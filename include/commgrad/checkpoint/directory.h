#pragma once
// The on-disk layout of a checkpoint root (docs/checkpoints.md):
//
//   root/
//     latest                      "step-00000010\n": the newest complete step
//     step-00000005/
//       index.json                every tensor: dtype, global shape, pieces
//       rank-00000.safetensors    the pieces rank 0 wrote
//       rank-00001.safetensors
//     step-00000010/ ...
//     .step-00000015.partial/     a save in progress (or one that crashed)
//
// A step directory appears only complete (renamed from its partial one when
// every rank has written), and `latest` is replaced atomically after it.
// The publish sequence, in order (a crash between any two leaves `latest`
// naming a complete step): index.json written and fsynced in the partial
// directory, the directory renamed to step-N, root fsynced, latest.tmp
// written and fsynced, renamed over latest, root fsynced; then older steps
// are pruned. A failed save removes its partial directory.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace commgrad::checkpoint {

/// The index file inside a step directory.
inline constexpr const char* kIndexFileName = "index.json";
/// The file in the root that names the newest complete step.
inline constexpr const char* kLatestFileName = "latest";

/// "step-00000010": the directory of step 10 inside a root.
std::string step_directory_name(int64_t step);

/// The step `root/latest` names; nullopt when there is no such file. Throws
/// when the file exists but does not name a step.
///
/// Example:
///   if (auto step = checkpoint::latest_step("ckpt")) std::cout << "resuming from " << *step;
std::optional<int64_t> latest_step(const std::string& root);

/// Every complete step in `root` (a step directory holding an index),
/// ascending; partial directories of interrupted saves are not listed.
std::vector<int64_t> saved_steps(const std::string& root);

/// What latest_complete_step() found.
struct LatestComplete {
  /// The step to resume from; nullopt when `root` holds none that is intact.
  std::optional<int64_t> step;
  /// Each newer step passed over, and why ("step-00000010: rank-00001.safetensors
  /// has 12 bytes, the index records 4242").
  std::vector<std::string> skipped;
};

/// The step a restarting job resumes from: the one `latest` names when its
/// directory is intact (index.json parses and every shard file it lists is
/// there with the size it records), else the newest intact step before it,
/// with a warning on stderr naming every step skipped and why. Steps newer
/// than `latest` (a save killed between its rename and `latest`) are not
/// considered. Reads files only (no collective): every rank that calls it
/// on the same root gets the same answer. The checksums are checked by
/// load(), which still fails on a shard whose bytes changed but not its size.
///
/// Example:
///   if (auto found = checkpoint::latest_complete_step("ckpt"); found.step) {
///     checkpoint::load("ckpt", pieces, checkpoint::LoadOptions().step(*found.step));
///   }
LatestComplete latest_complete_step(const std::string& root);

}  // namespace commgrad::checkpoint
