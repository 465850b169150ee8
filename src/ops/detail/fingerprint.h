#pragma once
// The debug-mode cross-rank checks (internal to commgrad_ops; see ops/debug.h).

#include "call.h"

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace commgrad::ops::detail {

/// How the fingerprints of the ranks must relate beyond equal text.
enum class CrossCheck {
  kNone,        // lists unused
  kEqualLists,  // `a` (per-rank sizes) is the same list on every rank
  kTransposed,  // all_to_all: a (input splits) of rank r [s] == b (output splits) of rank s [r]
};

/// Debug mode: exchanges "<signature>" and the sequence number with every
/// member and throws on every rank, showing both sides, when they disagree.
/// A no-op when debug checks are off.
void check_fingerprint(const Call& call, const std::string& signature, const std::vector<int64_t>& a = {},
                       const std::vector<int64_t>& b = {}, CrossCheck cross = CrossCheck::kNone);

/// Debug mode for send/recv: a send's header (sizes, dtype, requires_grad,
/// tag) goes to the receiver just before the message, on the same tag; once
/// `works` are waited (exactly once: a Gloo work waited twice waits for a
/// second message), the receiver's verify() throws, naming both sides, when
/// it differs from what the recv expects (a send's does nothing). Nothing
/// blocks when a header is posted.
struct P2pHeader {
  std::vector<commgrad::detail::WorkPtr> works;  // the header's send or receive
  std::function<void()> verify;
};

/// Posts the header of a send (`sending`: to `peer`) or its receive (a
/// recv: from `peer`) on wire tag `tag`, the message's own. Null when debug
/// checks are off.
std::shared_ptr<P2pHeader> post_p2p_header(const Call& call, int peer, int tag, bool sending, at::IntArrayRef sizes,
                                           at::ScalarType dtype, bool requires_grad);

}  // namespace commgrad::ops::detail
