// The founding example: an autograd AllReduce whose forward and backward both
// all-reduce. On n ranks, x = ones(4) gives y = [n, n, n, n] and
// x.grad = [n, n, n, n] on every rank.
//
//   commgrad-run -n 4 tp_autograd_comm
//   [0] x.grad = tensor([4., 4., 4., 4.])
//
// With `--device cuda` the tensors live on each rank's GPU (cuda:LOCAL_RANK)
// and travel on the group's CUDA transport (NCCL, or Gloo where ranks share
// a GPU).
//
// Unlike the Python version this is usually written from, it modifies
// neither its input nor the caller's gradient: that version all-reduces
// `x.contiguous()` in place, which *is* x when x is contiguous, so the leaf
// silently becomes [n, n, n, n] (x._version stays 0, autograd cannot
// notice), and its backward likewise overwrites a contiguous incoming
// gradient. Here each direction writes into one fresh contiguous copy.
//
// Every rank checks its own results and the program exits non-zero on a
// mismatch, so the tests can run it at any world size.

#include "cli/cli.h"

#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <iostream>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// All-reduces (SUM) a copy of `t` over the world; `t` is left untouched.
torch::Tensor all_reduce_copy(const torch::Tensor& t) {
  // One copy, straight into contiguous memory (the transport needs it).
  std::vector<torch::Tensor> buffer{t.clone(at::MemoryFormat::Contiguous)};
  commgrad::world().transport(t.device().type()).allreduce(buffer)->wait();
  return buffer[0];
}

/// forward: y = sum over ranks of x;  backward: grad_x = sum over ranks of grad_y.
struct AllReduce : public torch::autograd::Function<AllReduce> {
  static torch::Tensor forward(AutogradContext* /*ctx*/, const torch::Tensor& x) { return all_reduce_copy(x); }

  static tensor_list backward(AutogradContext* /*ctx*/, tensor_list grad_outputs) {
    return {all_reduce_copy(grad_outputs[0])};
  }
};

int failures = 0;

void expect_equal(const char* what, const torch::Tensor& got, const torch::Tensor& want_cpu) {
  const auto want = want_cpu.to(got.defined() ? got.device() : want_cpu.device());
  if (!got.defined() || !torch::equal(got, want)) {
    std::cerr << "rank " << commgrad::rank() << ": " << what << " = "
              << (got.defined() ? commgrad::format_tensor(got) : "undefined") << ", expected "
              << commgrad::format_tensor(want) << "\n";
    ++failures;
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool cuda = false;
  commgrad::cli::App app("tp_autograd_comm",
                         "The founding example: an autograd all-reduce whose forward and backward both all-reduce;\n"
                         "every rank checks y and x.grad (= world size) and exits non-zero on a mismatch.\n"
                         "  commgrad-run -n 4 tp_autograd_comm");
  commgrad::cli::add_device_option(app, cuda, "where the tensors live (cuda: this rank's GPU)");
  if (const auto code = commgrad::cli::parse(app, argc, argv)) return *code;
  try {
    commgrad::init_process_group();
    if (cuda && commgrad::cuda_device_count() == 0) {
      std::cerr << "tp_autograd_comm: --device cuda, but this process sees no CUDA device\n";
      return 1;
    }
    const auto device = cuda ? commgrad::device() : torch::Device(torch::kCPU);
    const auto on_device = torch::TensorOptions().device(device);
    const int n = commgrad::world_size();
    const bool speaker = commgrad::rank() == 0;
    if (speaker) {
      std::cout << commgrad::build_info().to_string() << "\n";
      std::cout << "world: " << n << " ranks, backend " << commgrad::world().backend_name()
                << ", BLAS: " << commgrad::active_blas() << "\n";
      if (cuda) {
        std::cout << "device: " << device << ", CUDA tensors over " << commgrad::world().cuda_backend_name() << "\n";
      }
    }

    // The article's program.
    auto x = torch::ones({4}, on_device.requires_grad(true));
    auto y = AllReduce::apply(x);
    y.sum().backward();
    if (speaker) {
      std::cout << "y = " << commgrad::format_tensor(y) << "\n";
      std::cout << "x.grad = " << commgrad::format_tensor(x.grad()) << "\n";
      std::cout << "x = " << commgrad::format_tensor(x.detach()) << "\n";
    }
    const auto all_n = torch::full({4}, static_cast<float>(n));
    expect_equal("y", y.detach(), all_n);
    expect_equal("x.grad", x.grad(), all_n);
    expect_equal("x", x.detach(), torch::ones({4}));

    // The caller's gradient is not overwritten either.
    auto x2 = torch::ones({4}, on_device.requires_grad(true));
    auto g = torch::ones({4}, on_device);
    AllReduce::apply(x2).backward(g);
    if (speaker) std::cout << "after y.backward(g): g = " << commgrad::format_tensor(g) << "\n";
    expect_equal("g", g, torch::ones({4}));
    expect_equal("x2.grad", x2.grad(), all_n);

    commgrad::destroy_process_group();
  } catch (const c10::Error& e) {
    std::cerr << "tp_autograd_comm: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "tp_autograd_comm: " << e.what() << "\n";
    return 1;
  }
  if (failures > 0) {
    std::cerr << "tp_autograd_comm: " << failures << " check(s) failed\n";
    return 1;
  }
  return 0;
}
