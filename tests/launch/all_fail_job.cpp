// A rank that prints kLines lines through buffered stdio and returns 1, as
// every rank of a job that fails alike does: launcher_test checks that every
// line reaches commgrad-run's output although the launcher stops the other
// ranks as soon as the first one exits.

#include <commgrad/dist/process_group.h>

#include <cstdio>

int main() {
  constexpr int kLines = 37;
  commgrad::init_process_group();  // as a real program does (and it links commgrad, which line-buffers stdout)
  const int rank = commgrad::rank();
  for (int i = 0; i < kLines; ++i) std::printf("rank %d line %d\n", rank, i);
  return 1;
}
