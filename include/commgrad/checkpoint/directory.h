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

}  // namespace commgrad::checkpoint
