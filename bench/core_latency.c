// How long a cache line takes to cross between two CPUs, and whether that
// changes while a benchmark runs: two processes pinned to CPUs A and B
// bounce a counter through one shared line, 20000 round trips per block,
// a block every 100 ms for SECONDS; prints the spread of the blocks'
// average round trip. On a VM the host may move the vCPUs between physical
// cores: the AMD EPYC VM of docs/benchmarks.md showed blocks of about 40,
// 125 and 430 ns (presumably SMT siblings, one L3, two L3s), switching within
// seconds to minutes, so that any transport's time at a size depends on the placement
// it met (bench/compare_transports.sh records this next to its runs).
//
//   cc -O2 -o /tmp/core_latency bench/core_latency.c
//   /tmp/core_latency [SECONDS=5] [CPU_A=0] [CPU_B=1]
#define _GNU_SOURCE
#include "cpu_probe.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { kTrips = 20000, kMaxBlocks = 100000 };

struct Line {
  _Atomic uint64_t ping __attribute__((aligned(64)));
  _Atomic uint64_t pong __attribute__((aligned(64)));
  _Atomic int stop __attribute__((aligned(64)));
};

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? atof(argv[1]) : 5;
  const int cpu_a = argc > 2 ? atoi(argv[2]) : 0, cpu_b = argc > 3 ? atoi(argv[3]) : 1;
  struct Line* line = mmap(0, sizeof(struct Line), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  static double blocks[kMaxBlocks];
  if (line == MAP_FAILED || pin(cpu_a) != 0) {
    perror("core_latency");
    return 1;
  }
  const pid_t child = fork();
  if (child == 0) {
    if (pin(cpu_b) != 0) _exit(1);
    uint64_t seen = 0;
    while (!atomic_load(&line->stop)) {
      const uint64_t k = atomic_load_explicit(&line->ping, memory_order_acquire);
      if (k == seen) {
        __builtin_ia32_pause();
        continue;
      }
      seen = k;
      atomic_store_explicit(&line->pong, k, memory_order_release);
    }
    _exit(0);
  }
  int n = 0;
  uint64_t k = 0;
  for (const double end = now_ns() + seconds * 1e9; now_ns() < end && n < kMaxBlocks;) {
    const double start = now_ns();
    for (int i = 0; i < kTrips; ++i) {
      atomic_store_explicit(&line->ping, ++k, memory_order_release);
      while (atomic_load_explicit(&line->pong, memory_order_acquire) != k) __builtin_ia32_pause();
    }
    blocks[n++] = (now_ns() - start) / kTrips;
    usleep(100000);
  }
  atomic_store(&line->stop, 1);
  waitpid(child, NULL, 0);
  if (n == 0) {
    fprintf(stderr, "core_latency: no block measured\n");
    return 1;
  }
  int fast = 0, mid = 0, slow = 0;
  for (int i = 0; i < n; ++i) {
    if (blocks[i] < 60)
      ++fast;
    else if (blocks[i] < 250)
      ++mid;
    else
      ++slow;
  }
  qsort(blocks, (size_t)n, sizeof(double), by_value);
  printf(
      "# cross-core round trip, CPU %d <-> %d, %d blocks of %d over %.0f s (ns): min %.0f, p10 %.0f, median %.0f, "
      "p90 %.0f, max %.0f; blocks under 60 ns %d, 60-250 ns %d, over 250 ns %d\n",
      cpu_a, cpu_b, n, kTrips, seconds, blocks[0], blocks[n / 10], blocks[n / 2], blocks[n * 9 / 10], blocks[n - 1],
      fast, mid, slow);
  return 0;
}
