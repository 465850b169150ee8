// commgrad._C: the extension `import commgrad` loads. It makes commgrad's
// c10d backend for torch.distributed's creator function, and says which
// transport a group runs on. Built against the LibTorch of the torch it is
// imported with (only one LibTorch may live in a process); c10d's Store and
// Backend cross into Python through torch's own pybind11 types.

#include "torch_backend.h"

#include <commgrad/dist/build_info.h>

#include <torch/csrc/utils/pybind.h>

#include <chrono>

namespace py = pybind11;

namespace {

c10::intrusive_ptr<c10d::Backend> create_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                 double timeout_s, const std::string& group_name) {
  py::gil_scoped_release no_gil;  // connecting waits for the other ranks
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  return c10::make_intrusive<commgrad::python::TorchBackend>(store, rank, size, timeout, group_name);
}

const commgrad::python::TorchBackend& checked(const c10::intrusive_ptr<c10d::Backend>& backend) {
  const auto* b = dynamic_cast<const commgrad::python::TorchBackend*>(backend.get());
  TORCH_CHECK(b != nullptr, "[commgrad] the backend '", backend->getBackendName(), "' is not commgrad's");
  return *b;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "commgrad's c10d backend for torch.distributed";
  m.def("_create_backend", &create_backend, py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
        py::arg("group_name"), "Connects commgrad's transport for one group (c10d's creator function calls it).");
  m.def(
      "_transport", [](const c10::intrusive_ptr<c10d::Backend>& b) { return checked(b).transport_name(); },
      "The transport of a commgrad backend: 'shm', 'gloo' or 'hierarchical'.");
  m.def(
      "_describe", [](const c10::intrusive_ptr<c10d::Backend>& b) { return checked(b).describe(); },
      "\"rank 0/4 group '0' (shm)\"");
  m.def(
      "build_info", [] { return commgrad::build_info().to_string(); }, "What this build of commgrad is.");
}
