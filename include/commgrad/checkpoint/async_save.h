#pragma once
// checkpoint::AsyncSaver: save() in the background while training goes on
// (torchtitan's async checkpointing). save() copies every piece to host
// memory (the only part the training step waits for), then a thread of the
// saver runs checkpoint::save() on the copies over a group of its own, so its
// collectives never interleave with the training step's. The files, the
// publish order and the crash-safety are save()'s: a rank killed during a
// background write leaves the previous step the one `latest` names.
//
// One save is in flight at a time: the next save() (and wait(), and the
// destructor) waits for the previous one, and raises its error on every rank.

#include "commgrad/checkpoint/save.h"
#include "commgrad/checkpoint/tensor_piece.h"
#include "commgrad/dist/group.h"

#include <nlohmann/json.hpp>

#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace commgrad::checkpoint {

/// Saves checkpoints in the background.
///
/// Example:
///   checkpoint::AsyncSaver saver(world);               // collective: makes its group
///   for (int64_t step = 1; step <= steps; ++step) {
///     trainer.step(batch);
///     if (step % 100 == 0) saver.save("ckpt", step, trainer.pieces());  // returns after the copy
///   }
///   saver.wait();                                      // the last save is on disk
class AsyncSaver {
 public:
  /// Makes the saver's group: the ranks of `group` (empty: the world), through
  /// new_group, so every rank of the world calls this constructor.
  explicit AsyncSaver(const Group& group = Group());
  /// Waits for the save in flight; its error, if any, is dropped (call wait()
  /// to see it).
  ~AsyncSaver();
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  /// Waits for the previous save, copies `pieces` to host memory and starts
  /// saving them as step `step` under `root`; see checkpoint::save() for the
  /// arguments. Collective over the saver's group.
  void save(const std::string& root, int64_t step, const std::vector<TensorPiece>& pieces,
            const nlohmann::json& metadata = nlohmann::json::object(), const SaveOptions& options = {});

  /// Waits for the save in flight and returns what it did (nothing when none
  /// was in flight); raises its error.
  std::optional<SaveResult> wait();

  /// True while a save runs in the background.
  bool in_flight() const { return worker_.joinable(); }

  /// The saver's own group.
  const Group& group() const { return group_; }

 private:
  Group group_;
  std::thread worker_;
  std::optional<SaveResult> result_;
  std::exception_ptr error_;
};

/// `pieces` with each tensor copied to a contiguous CPU tensor of its own
/// (what the background write reads while training changes the originals).
std::vector<TensorPiece> host_copies(const std::vector<TensorPiece>& pieces);

}  // namespace commgrad::checkpoint
