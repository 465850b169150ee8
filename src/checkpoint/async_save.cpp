// checkpoint::AsyncSaver (see the header).
//
// The saver's group is a second group of the same ranks: checkpoint::save()
// runs one status exchange per phase on it from the saver's thread while
// the training thread runs its own collectives on the training groups; each
// group has its own transport and its own collective numbers, so the two
// streams cannot mix. The copy to host memory is a clone of each piece (one
// memcpy per tensor on a CPU model; a device-to-host copy on a GPU).

#include "commgrad/checkpoint/async_save.h"

#include "commgrad/dist/process_group.h"
#include "commgrad/ops/raw.h"

#include <ATen/ATen.h>
#include <c10/util/StringUtil.h>

#include <utility>

namespace commgrad::checkpoint {

std::vector<TensorPiece> host_copies(const std::vector<TensorPiece>& pieces) {
  std::vector<TensorPiece> copies;
  copies.reserve(pieces.size());
  for (const TensorPiece& p : pieces) {
    TensorPiece c = p;
    if (p.tensor.defined()) {
      c.tensor = p.tensor.detach().to(at::TensorOptions().device(at::kCPU), /*non_blocking=*/false, /*copy=*/true,
                                      at::MemoryFormat::Contiguous);
    }
    // save() checks that a piece still views its source: a copy views
    // nothing, so the check is made here, and a piece that fails it keeps
    // its source, so that save() raises the error on every rank.
    const bool views_source = !p.source.defined() || !p.tensor.defined() || p.tensor.is_alias_of(p.source);
    c.source = views_source ? at::Tensor() : p.source;
    copies.push_back(std::move(c));
  }
  return copies;
}

AsyncSaver::AsyncSaver(const Group& group) {
  const Group g = ops::raw::resolve_group(group);
  group_ = new_group(g.ranks(), NewGroupOptions().name(c10::str(g.name(), "-async-save")));
}

AsyncSaver::~AsyncSaver() {
  if (worker_.joinable()) worker_.join();
}

void AsyncSaver::save(const std::string& root, int64_t step, const std::vector<TensorPiece>& pieces,
                      const nlohmann::json& metadata, const SaveOptions& options) {
  wait();
  auto copies = host_copies(pieces);
  result_.reset();
  error_ = nullptr;
  worker_ = std::thread([this, root, step, copies = std::move(copies), metadata, options]() {
    try {
      result_ = checkpoint::save(root, step, copies, metadata, options, group_);
    } catch (...) {
      error_ = std::current_exception();
    }
  });
}

std::optional<SaveResult> AsyncSaver::wait() {
  if (!worker_.joinable()) return std::nullopt;
  worker_.join();
  if (error_) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
  return result_;
}

}  // namespace commgrad::checkpoint
