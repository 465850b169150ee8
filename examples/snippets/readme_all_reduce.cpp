// The program README.md opens with, word for word (the lines between the
// region markers; tests/util/snippets_test.cpp keeps them equal): the
// founding example on commgrad's own differentiable all_reduce. Every rank
// prints x.grad, [W, W, W, W] on W ranks (tests/examples/
// getting_started_test.cpp runs it at 2 and checks both ranks' lines):
//
//   commgrad-run -n 2 readme_all_reduce
//   [0] tensor([2., 2., 2., 2.])
//   [1] tensor([2., 2., 2., 2.])

// [all_reduce]
#include <commgrad/commgrad.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  commgrad::init_process_group();  // RANK/WORLD_SIZE/MASTER_* from the launcher
  auto x = torch::ones({4}, torch::requires_grad());
  auto y = commgrad::ops::all_reduce(x);                   // forward: sum over ranks
  y.sum().backward();                                      // backward: sum over ranks
  std::cout << commgrad::format_tensor(x.grad()) << "\n";  // tensor([4., 4., 4., 4.]) on 4 ranks
  commgrad::destroy_process_group();
}
// [end all_reduce]
