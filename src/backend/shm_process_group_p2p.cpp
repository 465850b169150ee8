// ShmProcessGroup's point-to-point messages: send, recv and recvAnysource.
//
// Each runs on an executor of its own peer and direction (peer_executor),
// created on first use, so a send that waits for a slow receiver holds up
// no traffic with anyone else. When nothing is queued before it, it runs on
// the calling thread if the message fits into the mailbox (send) or is
// already waiting (recv). Unlike a collective, a rejected send or recv
// throws on its own rank only: there is no collective for the peer to fail.

#include "commgrad/backend/shm_process_group.h"

#include "detail/shm_comm.h"
#include "detail/shm_executor.h"
#include "detail/shm_staged.h"
#include "detail/shm_work.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

namespace commgrad::backend {
using detail::Call;
using detail::Comm;
using detail::ShmWork;
using detail::Staged;

detail::Executor& ShmProcessGroup::peer_executor(bool sending, int peer) {
  std::lock_guard<std::mutex> lock(peers_mutex_);
  auto& slot = sending ? senders_[peer] : receivers_[peer];
  if (!slot) slot = std::make_unique<detail::Executor>();
  return *slot;
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  const Staged s(p2p_tensor("send", tensors, dst_rank, "destination"));
  return detail::run_or_queue(peer_executor(true, dst_rank), comm_->send_fits(dst_rank, s.bytes()), *comm_, "send",
                              options_.timeout(), getRank(), c10d::OpType::SEND, {},
                              [s, dst_rank, tag](Comm& c, const Call& call) {
                                c.send(call, dst_rank, tag, s.data(), s.bytes(), s.buffer.scalar_type());
                              });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  const Staged s(p2p_tensor("recv", tensors, src_rank, "source"));
  return detail::run_or_queue(peer_executor(false, src_rank), comm_->recv_ready(src_rank, s.bytes()), *comm_, "recv",
                              options_.timeout(), getRank(), c10d::OpType::RECV, tensors,
                              [s, src_rank, tag](Comm& c, const Call& call) {
                                c.recv(call, src_rank, tag, s.data(), s.bytes(), s.buffer.scalar_type());
                                s.finish();
                              });
}

c10::intrusive_ptr<c10d::Work> ShmProcessGroup::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const int any = getRank() == 0 ? 1 : 0;  // a valid peer, for the checks only
  const Staged s(p2p_tensor("recvAnysource", tensors, getSize() > 1 ? any : -1, "source"));
  auto work = c10::make_intrusive<ShmWork>(getRank(), c10d::OpType::RECVANYSOURCE, tensors);
  {
    std::lock_guard<std::mutex> lock(peers_mutex_);
    if (!any_source_receiver_) any_source_receiver_ = std::make_unique<detail::Executor>();
  }
  any_source_receiver_->submit(detail::completing(
      work, comm_.get(), "recvAnysource", options_.timeout(), [s, tag, work](Comm& c, const Call& call) {
        work->set_source_rank(c.recv_any(call, tag, s.data(), s.bytes(), s.buffer.scalar_type()));
        s.finish();
      }));
  return work;
}

const at::Tensor& ShmProcessGroup::p2p_tensor(const char* op, const std::vector<at::Tensor>& tensors, int peer,
                                              const char* role) const {
  const std::string where = c10::str("[commgrad] ", op, " ", comm_->context(), ": ");
  TORCH_CHECK(tensors.size() == 1, where, "expects exactly one tensor per call, got ", tensors.size());
  TORCH_CHECK(peer >= 0 && peer < getSize() && peer != getRank(), where, role, " rank ", peer,
              " must be another rank of the group [0, ", getSize(), ")");
  TORCH_CHECK(detail::is_cpu_dense(tensors[0]), where, "the tensor must be a defined CPU tensor with strided layout");
  return tensors[0];
}

}  // namespace commgrad::backend
