#pragma once
// commgrad::cp: context parallelism, attention split along the sequence over
// a context-parallel group (docs/context_parallel.md). Family 2 gradient
// semantics: one loss over the tokens of the whole sequence.
//
//   sequence.h   which tokens a rank holds (contiguous, head-tail), shard/unshard
//   attention.h  cp::attention: all-gather K/V, ring, Ulysses
//   ulysses.h    the all-to-alls between sequence parts and head parts
//
// Example:
//   auto out = commgrad::cp::attention(q, k, v, commgrad::cp::ContextParallelOptions(cp_group));

#include "commgrad/cp/attention.h"
#include "commgrad/cp/sequence.h"
#include "commgrad/cp/ulysses.h"
