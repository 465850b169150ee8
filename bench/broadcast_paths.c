// The ways one core can hand another a buffer on this machine, timed as a
// 2-rank broadcast loop (root on CPU 0, receiver on CPU 1, fork()ed):
//
//   staged  the root copies the buffer into shared memory (three rotating
//           sets, as the shm transport's steps) and rings; the receiver
//           copies it out and acknowledges
//   stream  the same, but the root publishes its progress every PIECE bytes
//           and the receiver copies each piece as soon as it is there
//   direct  the receiver reads the root's buffer with process_vm_readv, as
//           OpenMPI's vader "cma" single copy does; the root rings and waits
//           until the read is done before the next call
//
// `direct` runs twice: with the root's buffer unchanged between calls (what
// a benchmark loop does; the lines stay in the root's cache, clean) and
// with the root rewriting it before every call (what a training step does).
// The medians tell how much of a transport's time at 16 KiB-1 MiB is the
// machine's cross-core copy, and how much the benchmark's loop helps a
// single copy.
//
//   cc -O2 -o /tmp/broadcast_paths bench/broadcast_paths.c
//   /tmp/broadcast_paths [BYTES...]        (default: 16K 64K 256K)
#define _GNU_SOURCE
#include "cpu_probe.h"

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

enum { kStaged, kStream, kDirect, kDirectRewritten };
static const char* const kNames[] = {"staged", "stream (16 KiB pieces)", "direct, source unchanged",
                                     "direct, source rewritten"};
enum { kIters = 2000, kPiece = 16384 };

static pid_t g_receiver;  // in the root: the receiver, whose death ends the probe

static void wait_for(_Atomic uint64_t* word, uint64_t value) {
  for (uint64_t spins = 1; atomic_load_explicit(word, memory_order_acquire) < value; ++spins) {
    __builtin_ia32_pause();
    if (g_receiver > 0 && spins % (1u << 20) == 0 && waitpid(g_receiver, NULL, WNOHANG) == g_receiver) {
      fprintf(stderr, "broadcast_paths: the receiver died\n");
      exit(1);
    }
  }
}

struct Shared {
  _Atomic uint64_t ring __attribute__((aligned(64)));      // calls the root has started
  _Atomic uint64_t ack __attribute__((aligned(64)));       // calls the receiver has finished
  _Atomic uint64_t progress __attribute__((aligned(64)));  // bytes the root has staged, over all calls
  uint64_t source __attribute__((aligned(64)));            // the root's buffer, for process_vm_readv
};

static void receive(struct Shared* s, char* sets, size_t set_bytes, size_t n, int mode, pid_t root) {
  if (pin(1) != 0) _exit(1);
  char* dst = aligned_alloc(4096, n);
  memset(dst, 0, n);
  for (uint64_t k = 1; k <= kIters; ++k) {
    wait_for(&s->ring, k);
    char* staged = sets + (k % 3) * set_bytes;
    if (mode == kStaged) {
      memcpy(dst, staged, n);
    } else if (mode == kStream) {
      for (size_t done = 0; done < n;) {
        wait_for(&s->progress, (k - 1) * n + done + 1);
        // The root may be staging the next call already: this call's part ends at n.
        size_t ready = atomic_load_explicit(&s->progress, memory_order_acquire) - (k - 1) * n;
        if (ready > n) ready = n;
        memcpy(dst + done, staged + done, ready - done);
        done = ready;
      }
    } else {
      struct iovec local = {dst, n}, remote = {(void*)s->source, n};
      if (process_vm_readv(root, &local, 1, &remote, 1, 0) != (ssize_t)n) {
        perror("process_vm_readv");
        _exit(1);
      }
    }
    atomic_store_explicit(&s->ack, k, memory_order_release);
  }
  _exit(0);
}

// Microseconds per call over the second half of the calls.
static double run(size_t n, int mode) {
  const size_t set_bytes = (n + 4095) / 4096 * 4096;
  struct Shared* s =
      mmap(0, sizeof(struct Shared) + 3 * set_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  char* sets = (char*)(s + 1);
  memset(s, 0, sizeof *s);
  memset(sets, 0, 3 * set_bytes);
  char* src = aligned_alloc(4096, n);
  memset(src, 1, n);
  s->source = (uint64_t)(uintptr_t)src;
  const pid_t root = getpid();
  const pid_t child = fork();
  if (child == 0) receive(s, sets, set_bytes, n, mode, root);
  g_receiver = child;
  if (pin(0) != 0) {
    perror("broadcast_paths: CPU 0");
    exit(1);
  }
  double start = 0;
  for (uint64_t k = 1; k <= kIters; ++k) {
    if (k == kIters / 2) start = now_ns();
    if (mode == kDirect || mode == kDirectRewritten) {
      wait_for(&s->ack, k - 1);  // the receiver reads src: it must not change meanwhile
      if (mode == kDirectRewritten) memset(src, (int)k, n);
      atomic_store_explicit(&s->ring, k, memory_order_release);
      continue;
    }
    if (k > 2) wait_for(&s->ack, k - 2);  // set k % 3 was last read in call k - 3
    char* staged = sets + (k % 3) * set_bytes;
    if (mode == kStaged) {
      memcpy(staged, src, n);
      atomic_store_explicit(&s->ring, k, memory_order_release);
    } else {
      atomic_store_explicit(&s->ring, k, memory_order_release);
      for (size_t at = 0; at < n; at += kPiece) {
        const size_t len = n - at < kPiece ? n - at : kPiece;
        memcpy(staged + at, src + at, len);
        atomic_store_explicit(&s->progress, (k - 1) * n + at + len, memory_order_release);
      }
    }
  }
  wait_for(&s->ack, kIters);
  const double us = (now_ns() - start) / 1e3 / (kIters - kIters / 2);
  waitpid(child, NULL, 0);
  g_receiver = 0;
  munmap(s, sizeof(struct Shared) + 3 * set_bytes);
  free(src);
  return us;
}

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  const char* defaults[] = {"16384", "65536", "262144"};
  const int nsizes = argc > 1 ? argc - 1 : 3;
  printf("# broadcast_paths: %d calls per run, medians of 5 runs alternating the modes (us per call)\n", kIters);
  printf("# %10s  %12s  %24s  %26s  %26s\n", "bytes", kNames[0], kNames[1], kNames[2], kNames[3]);
  for (int i = 0; i < nsizes; ++i) {
    const size_t n = (size_t)atol(argc > 1 ? argv[i + 1] : defaults[i]);
    double times[4][5];
    for (int round = 0; round < 5; ++round) {
      for (int mode = 0; mode < 4; ++mode) times[mode][round] = run(n, mode);
    }
    printf("  %10zu", n);
    for (int mode = 0; mode < 4; ++mode) {
      qsort(times[mode], 5, sizeof(double), by_value);
      printf("  %*.2f", mode == 0 ? 12 : mode == 1 ? 24 : 26, times[mode][2]);
    }
    printf("\n");
  }
  return 0;
}
