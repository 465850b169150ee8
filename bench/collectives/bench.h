#pragma once
// commgrad-bench: nccl-tests for commgrad. One descriptor per collective
// (collectives.cpp) and a shared harness (main.cpp) that sweeps sizes, times
// the raw transport call, the differentiable forward and forward+backward,
// and checks every result against expected values.

#include "commgrad/dist/group.h"
#include "commgrad/ops/reduce_op.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace commgrad::bench {

/// What one size of one collective runs with.
struct Setup {
  Group group;
  int rank = 0;
  int size = 1;
  at::ScalarType dtype = at::kFloat;
  int64_t count = 0;  // elements, as nccl-tests counts them (see each descriptor)
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  /// --offset: every buffer the raw call reads or writes starts this many
  /// bytes past a 64-byte boundary (a multiple of the element size).
  int64_t offset_bytes = 0;
};

/// One size of one collective, ready to run repeatedly.
struct Instance {
  /// One bare c10d transport call on preallocated buffers (waited).
  std::function<void()> raw;
  /// Wrong elements of the result of one raw call on fresh inputs.
  std::function<int64_t()> check_raw;
  /// The differentiable op on `x` (waited); returns its result.
  std::function<at::Tensor(const at::Tensor& x)> op;
  /// Wrong elements of an op result.
  std::function<int64_t(const at::Tensor& y)> check_op;
  /// Forward and backward through the op; empty when the op has no gradient.
  std::function<void()> forward_backward;
  /// The op's input on this rank.
  at::Tensor input;
  /// What the raw call reads on this rank (undefined where it reads nothing,
  /// a broadcast's non-root): --fresh-input writes it again before every call.
  at::Tensor raw_source;
};

/// What one call must move across the busiest host link, for the link
/// floor (--link-gbps): `volume` bytes per byte of the table's size, in the
/// busier direction of that link, and `rounds` latencies (steps among hosts).
struct LinkCost {
  double volume = 0;
  int rounds = 0;
};

/// A collective: its name, how its sizes count, and how to build it.
struct Collective {
  std::string name;
  bool has_redop = false;
  bool has_root = false;
  /// Elements must be a multiple of this (times the group size when `per_rank_split`).
  bool per_rank_split = false;
  /// nccl-tests' bus bandwidth factor for n ranks.
  std::function<double(int n)> bus_factor;
  std::function<Instance(const Setup&)> make;
  /// The link cost on hosts of `ranks_per_host` ranks; empty: no floor.
  std::function<LinkCost(const std::vector<int>& ranks_per_host)> link = {};
};

/// Every collective commgrad-bench knows, in the order `--op all` runs them.
const std::vector<Collective>& collectives();

/// Number of elements of `got` that differ from `want` (relative tolerance
/// for floating types, exact otherwise).
int64_t count_wrong(const at::Tensor& got, const at::Tensor& want);

}  // namespace commgrad::bench
