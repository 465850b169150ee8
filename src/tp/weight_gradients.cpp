// WeightGradients and DeferWeightGradients.
//
// The queue is shared (a layer's backward holds it through its autograd
// context) and locked, because autograd may run a backward on another
// thread than the forward's (device threads). The guard is thread-local:
// ranks that are threads of one process each defer into their own.

#include "commgrad/tp/weight_gradients.h"

#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace commgrad::tp {

struct WeightGradients::Queue {
  struct Entry {
    at::Tensor weight;
    std::function<at::Tensor()> gradient;
  };
  std::mutex mutex;
  std::vector<Entry> entries;
  size_t layers = 0;  // forwards that deferred here
};

namespace {
thread_local std::shared_ptr<WeightGradients::Queue> current_queue;
}  // namespace

WeightGradients::WeightGradients() : queue_(std::make_shared<Queue>()) {}
WeightGradients::~WeightGradients() = default;
WeightGradients::WeightGradients(WeightGradients&&) noexcept = default;
WeightGradients& WeightGradients::operator=(WeightGradients&&) noexcept = default;

size_t WeightGradients::size() const {
  if (!queue_) return 0;
  std::lock_guard<std::mutex> lock(queue_->mutex);
  return queue_->entries.size();
}

size_t WeightGradients::deferring_layers() const {
  if (!queue_) return 0;
  std::lock_guard<std::mutex> lock(queue_->mutex);
  return queue_->layers;
}

void WeightGradients::clear() {
  if (!queue_) return;
  std::lock_guard<std::mutex> lock(queue_->mutex);
  queue_->entries.clear();
  queue_->layers = 0;
}

void WeightGradients::compute() {
  if (!queue_) return;
  std::vector<Queue::Entry> entries;
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    entries.swap(queue_->entries);
  }
  if (entries.empty()) return;
  // One gradient per weight (a weight used twice, e.g. tied, gets the sum),
  // in the order the backward deferred them.
  std::vector<at::Tensor> weights, gradients;
  std::map<const void*, size_t> index;
  {
    at::NoGradGuard no_grad;
    for (auto& e : entries) {
      at::Tensor g = e.gradient();
      const auto [it, fresh] = index.emplace(e.weight.unsafeGetTensorImpl(), weights.size());
      if (fresh) {
        weights.push_back(e.weight);
        gradients.push_back(std::move(g));
      } else {
        gradients[it->second] = gradients[it->second] + g;
      }
    }
  }
  // Through autograd, so the weights' AccumulateGrad nodes and their hooks run.
  torch::autograd::backward(weights, gradients);
}

DeferWeightGradients::DeferWeightGradients(WeightGradients& into) : previous_(std::move(current_queue)) {
  current_queue = into.queue();
}

DeferWeightGradients::~DeferWeightGradients() { current_queue = std::move(previous_); }

namespace detail {

std::shared_ptr<WeightGradients::Queue> deferring_weight_gradients() { return current_queue; }

std::shared_ptr<WeightGradients::Queue> exchange_deferring_weight_gradients(
    std::shared_ptr<WeightGradients::Queue> queue) {
  std::swap(queue, current_queue);
  return queue;
}

void note_deferring_layer(WeightGradients::Queue& queue) {
  std::lock_guard<std::mutex> lock(queue.mutex);
  ++queue.layers;
}

void defer_weight_gradient(WeightGradients::Queue& queue, const at::Tensor& weight,
                           std::function<at::Tensor()> gradient) {
  std::lock_guard<std::mutex> lock(queue.mutex);
  queue.entries.push_back({weight, std::move(gradient)});
}

}  // namespace detail
}  // namespace commgrad::tp
