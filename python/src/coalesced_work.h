#pragma once
// The Work of a coalesced call: several collectives issued one after the
// other, finished when all of them are.

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

namespace commgrad::python {

/// Completes when every one of `works` has; wait() rethrows the first
/// failure; the Future holds `outputs` (as c10d's coalesced ops do) or the
/// first error.
///
/// Example:
///   return c10::make_intrusive<CoalescedWork>(std::move(works), outputs, c10d::OpType::COALESCED);
class CoalescedWork final : public c10d::Work {
 public:
  CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> works, std::vector<at::Tensor> outputs, c10d::OpType type);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override { return outputs_; }
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace commgrad::python
