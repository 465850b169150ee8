#pragma once
// The tensors a ShmProcessGroup job hands the engine: which ones it takes
// (is_cpu_dense) and how they reach it (Staged). Header-only: both sit on
// the path of every call.

#include <ATen/ATen.h>
#include <c10/util/SmallVector.h>

#include <cstdint>

namespace commgrad::backend::detail {

/// What a call holds per rank (tensors, pointers, sizes): on the stack up to
/// 8 ranks, since a 4 KiB collective would notice a heap allocation each.
template <class T>
using PerRank = c10::SmallVector<T, 8>;

/// Whether the engine takes `t` at all: defined, on the CPU, strided.
inline bool is_cpu_dense(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided;
}

/// A tensor as the engine sees it: contiguous memory, copied back into the
/// caller's tensor afterwards when that one is not contiguous. Its address
/// and size are read once: a call asks for them several times, and each
/// of the tensor's own accessors checks its storage again.
struct Staged {
  at::Tensor buffer;  // the caller's tensor when contiguous, else a contiguous copy
  at::Tensor user;    // the caller's tensor when `buffer` is a copy; undefined otherwise (one reference less to count)

  explicit Staged(const at::Tensor& t)
      : buffer(t.is_contiguous() ? t : t.contiguous()),
        user(t.is_contiguous() ? at::Tensor() : t),
        data_(static_cast<uint8_t*>(buffer.data_ptr())),
        bytes_(static_cast<int64_t>(buffer.nbytes())) {}
  uint8_t* data() const { return data_; }
  int64_t bytes() const { return bytes_; }
  void finish() const {
    if (user.defined()) user.copy_(buffer);
  }

 private:
  uint8_t* data_;
  int64_t bytes_;
};

}  // namespace commgrad::backend::detail
