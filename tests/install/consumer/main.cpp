// Uses commgrad through its installed headers and libraries only.
#include <commgrad/commgrad.h>

#include <ATen/ATen.h>

#include <iostream>

int main() {
  auto world = commgrad::init_process_group();
  auto x = at::ones({2}).requires_grad_(true);
  std::vector<at::Tensor> buf{x.detach().clone()};
  world.transport().allreduce(buf)->wait();
  (buf[0] * x).sum().backward();
  std::cout << "consumer: x.grad = " << commgrad::format_tensor(x.grad()) << std::endl;
  commgrad::destroy_process_group();
  return 0;
}
