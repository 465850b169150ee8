// What the one-file C probes of bench/ (broadcast_paths.c, core_latency.c)
// share: a monotonic clock and pinning the calling process to one CPU.
// Header-only, so that each probe still builds with one `cc` command.
#pragma once

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <sched.h>
#include <time.h>

static inline double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e9 + t.tv_nsec;
}

// 0 on success, else -1 with errno set (sched_setaffinity's).
static inline int pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return sched_setaffinity(0, sizeof set, &set);
}
