#pragma once
// The gradient reducer behind DistributedDataParallel (internal).

#include "commgrad/dp/comm_hooks.h"
#include "commgrad/dp/distributed_data_parallel.h"
#include "commgrad/dp/replicas.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace torch::autograd {
struct Node;
}

namespace commgrad::dp::detail {

// The op named in DistributedDataParallel's errors.
constexpr const char* kDdpOp = "DistributedDataParallel";

using dp::NamedTensor;

/// Splits tensors (given in reduction order) into buckets: one dtype per
/// bucket; a bucket closes once it holds at least its limit in bytes (the
/// first bucket of each dtype `first_cap_bytes`, the others `cap_bytes`).
/// A tensor whose `alone` entry is set gets a bucket of its own (and closes
/// the open bucket of its dtype). Returns tensor indices per bucket,
/// ordered by their first tensor.
std::vector<std::vector<size_t>> assign_buckets(const std::vector<at::Tensor>& tensors, int64_t first_cap_bytes,
                                                int64_t cap_bytes, const std::vector<char>& alone = {});

/// Everything DistributedDataParallel does after construction: the hooks,
/// the buckets, and the end-of-backward reduction.
class DdpReducer : public std::enable_shared_from_this<DdpReducer> {
 public:
  /// `params` are the parameters that require grad, in registration order.
  DdpReducer(Group group, DistributedDataParallelOptions options, std::vector<NamedTensor> params,
             std::vector<at::Tensor> buffers);
  ~DdpReducer();

  /// Registers one post hook on each parameter's gradient accumulator.
  void install_hooks();
  /// Removes them again (the destructor does it too).
  void remove_hooks();

  bool sync_enabled() const;
  void set_sync_enabled(bool enabled);
  void set_comm_hook(CommHook hook);
  /// Runs `check` at the start of every backward (before any bucket is
  /// reduced): DistributedDataParallel's debug check of TP replicas.
  void set_backward_check(std::function<void()> check) { backward_check_ = std::move(check); }
  void sync_buffers();

  const Group& group() const { return group_; }
  const DistributedDataParallelOptions& options() const { return options_; }
  std::vector<DdpBucketInfo> bucket_info() const;
  DdpStepStats last_step() const;

  /// Called by the end-of-backward callback, or when a backward failed
  /// before reaching it (its callback was dropped).
  void finalize_backward();
  void abandon_backward();

 private:
  struct Param {
    std::string name;
    at::Tensor tensor;
    size_t bucket = 0;
    size_t slot = 0;  // position in the bucket
    commgrad::detail::NodePtr accumulator;
    uintptr_t hook_key = 0;
  };
  struct Bucket {
    at::ScalarType dtype;        // of the buffer (the reduction)
    at::ScalarType param_dtype;  // of the parameters and their gradients
    AverageSplit average;        // division before and after the sum
    std::vector<size_t> params;
    std::vector<std::string> names;
    int64_t bytes = 0;
    int64_t numel = 0;              // elements of the parameters
    int64_t padded_numel = 0;       // of the buffer (numel rounded up to bucket_multiple)
    std::vector<int64_t> offsets;   // of each parameter's slot
    at::Tensor buffer;              // flat gradients (allocated on demand with release_gradients)
    std::vector<at::Tensor> views;  // one per parameter, shaped like it
    size_t pending = 0;             // parameters not ready yet in this backward
    bool launched = false;
    bool finished = false;  // waited for, its `then` run
    CommWork work;
  };

  void on_gradient_ready(size_t index);
  void begin_backward();
  void mark_ready(size_t index);
  void launch_ready_buckets(bool during_backward);
  void ensure_buffer(Bucket& bucket);
  void release_buffer(Bucket& bucket);  // with release_gradients: free it until the next backward
  void finish_bucket(size_t b, std::exception_ptr& error);
  bool release() const { return options_.release_gradients(); }
  bool as_bucket_view(const Bucket& b) const {
    return options_.gradient_as_bucket_view() && !release() && b.dtype == b.param_dtype;
  }
  void write_back(const std::vector<int32_t>& global_use);
  void wait_all_quietly();
  void reset_backward_state();
  std::string bucket_context(size_t b) const;

  Group group_;
  DistributedDataParallelOptions options_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> buffers_;
  CommHook comm_hook_;

  mutable std::recursive_mutex mutex_;
  bool sync_enabled_ = true;
  std::function<void()> backward_check_;
  bool in_backward_ = false;           // a synchronised backward is running
  std::vector<char> ready_;            // per parameter, this backward
  std::vector<char> used_since_sync_;  // got a gradient since the last reduction
  size_t next_bucket_ = 0;
  int64_t launched_in_backward_ = 0;
  DdpStepStats last_step_;
};

}  // namespace commgrad::dp::detail
