#pragma once
// A developer's A/B of the shm engine inside one process. Comparing two
// builds run one after the other measures the host as much as the change:
// this VM's host moves its vCPUs between placements whose cache-line round
// trips differ 4-10x, within seconds to minutes. Here both variants run in
// the same processes, in alternating blocks of collectives, so a placement
// change hits both alike.
//
// Only a build configured with -DCOMMGRAD_SHM_AB_BLOCK=N (N > 0; see
// docs/shm.md, "Comparing two variants") drives it: Comm then asks it at the
// start of every collective which variant runs, and prints its report when
// the group ends. Production builds never construct one. Internal to
// commgrad_backend.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace commgrad::backend::detail {

/// Variants 0-3 in turn, one block of `block` collectives each: 0 and 2 run
/// the code's A, 1 and 3 its B, so 2 against 0 (and 3 against 1) is an A/A
/// control that says how much two blocks of the same code differ.
class AbBlocks {
 public:
  explicit AbBlocks(int64_t block);

  /// Marks the start of collective `seq` (0, 1, 2, ... in order) at
  /// `now_ns` and returns the variant it runs. A block's time per
  /// collective is recorded when the next block starts; the first block's
  /// (the group's warm-up) is not.
  int begin(uint64_t seq, int64_t now_ns);
  /// True when the collective `begin` last returned for runs variant B.
  bool runs_b() const { return variant_ >= 0 && (variant_ & 1) != 0; }
  /// How many blocks of variant `v` have been timed.
  size_t blocks(int v) const { return per_call_ns_[static_cast<size_t>(v)].size(); }
  /// The median over those blocks of ns per collective (0 when none).
  int64_t median_ns(int v) const;
  /// The same over every block of A (variants 0 and 2) or of B (1 and 3).
  int64_t median_a_ns() const;
  int64_t median_b_ns() const;
  /// One line: "shm A/B <context>: block 1024, blocks 12 12 12 11, ns per
  /// collective: v0 812 v1 790 v2 815 v3 788, A 813 B 789, B/A 0.970,
  /// control v2/v0 1.004 v3/v1 0.997".
  std::string report(const std::string& context) const;

 private:
  int64_t block_;
  int variant_ = -1;  // of the block in progress
  int64_t block_start_ns_ = 0;
  std::array<std::vector<int64_t>, 4> per_call_ns_;
};

}  // namespace commgrad::backend::detail
