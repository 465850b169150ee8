/* The copy bandwidth of this machine, for bench/compare_transports.sh's
 * floor column: N processes (one per rank) each copy SIZE bytes from one
 * private buffer to another with memcpy, all at once (a shared barrier
 * before every copy). Prints, per size, the median time of one copy on
 * rank 0 (us) and its bandwidth (GB/s, bytes copied per second).
 *
 *   copy_floor N MINBYTES MAXBYTES FACTOR ITERS */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc != 6) {
    fprintf(stderr, "usage: copy_floor N MIN MAX FACTOR ITERS\n");
    return 2;
  }
  const int n = atoi(argv[1]);
  const long min = atol(argv[2]), max = atol(argv[3]), factor = atol(argv[4]);
  const int iters = atoi(argv[5]);
  if (n < 1 || min < 1 || max < min || factor < 2 || iters < 1) {
    fprintf(stderr, "copy_floor: bad arguments\n");
    return 2;
  }
  pthread_barrier_t* bar = mmap(NULL, sizeof(*bar), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  pthread_barrierattr_t attr;
  pthread_barrierattr_init(&attr);
  pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_barrier_init(bar, &attr, (unsigned)n);
  int rank = 0;
  for (int r = 1; r < n; ++r) {
    if (fork() == 0) {
      rank = r;
      break;
    }
  }
  char* src = malloc((size_t)max);
  char* dst = malloc((size_t)max);
  if (src == NULL || dst == NULL) {
    fprintf(stderr, "copy_floor: out of memory\n");
    return 1;
  }
  memset(src, 1, (size_t)max);
  memset(dst, 2, (size_t)max);
  double* t = malloc(sizeof(double) * (size_t)iters);
  if (t == NULL) return 1;
  if (rank == 0) {
    printf("# copy_floor: %d processes copying at once; time of one memcpy on rank 0\n", n);
    printf("#%11s %12s %10s\n", "size", "time_us", "GB/s");
  }
  for (long size = min; size <= max; size *= factor) {
    for (int i = -3; i < iters; ++i) {
      pthread_barrier_wait(bar);
      const double t0 = now_us();
      memcpy(dst, src, (size_t)size);
      if (i >= 0) t[i] = now_us() - t0;
    }
    qsort(t, (size_t)iters, sizeof(double), cmp);
    const double med = t[iters / 2];
    if (rank == 0) printf("%12ld %12.1f %10.3f\n", size, med, size / med / 1e3);
  }
  if (rank == 0) {
    for (int r = 1; r < n; ++r) wait(NULL);
  }
  return 0;
}
