// Uses commgrad through its installed headers and libraries only.
#include <commgrad/commgrad.h>

#include <ATen/ATen.h>

#include <iostream>

// The package passes on the C++ standard its LibTorch needs.
static_assert(__cplusplus >= (COMMGRAD_CXX_STANDARD >= 20 ? 202002L : 201703L),
              "commgrad::commgrad must carry its C++ standard to its users");

int main() {
  std::cout << commgrad::build_info().to_string() << std::endl;
  auto world = commgrad::init_process_group();
  auto x = at::ones({2}).requires_grad_(true);
  std::vector<at::Tensor> buf{x.detach().clone()};
  world.transport().allreduce(buf)->wait();
  (buf[0] * x).sum().backward();
  std::cout << "consumer: x.grad = " << commgrad::format_tensor(x.grad()) << std::endl;
  commgrad::destroy_process_group();
  return 0;
}
