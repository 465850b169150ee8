// Creates and drops model-parallel states in a row, for group_churn_test
// (started by commgrad-run):
//
//   group_churn_job STATES    every rank creates commgrad::make_model_parallel(world
//                             size) STATES times, dropping each at once, then
//                             all-reduces once on the world and prints "rank r ok"
//
// A rank that drops a group the moment it has connected must not strand a
// slower member still connecting its Gloo pairs to it.

#include <commgrad/commgrad.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <iostream>

int main(int argc, char** argv) {
  const int states = argc > 1 ? std::atoi(argv[1]) : 12;
  auto world = commgrad::init_process_group(commgrad::InitOptions().backend("gloo"));
  for (int i = 0; i < states; ++i) {
    auto state = commgrad::make_model_parallel(world.size());
    (void)state;  // dropped right away
  }
  const auto sum = commgrad::ops::all_reduce(at::ones({1}));
  if (sum.item<float>() != world.size()) return 1;
  std::cout << "rank " << world.rank() << " ok" << std::endl;
  commgrad::destroy_process_group();
  return 0;
}
