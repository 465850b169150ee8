/* MPI_Allreduce (float32, SUM, in place) timed the way commgrad-bench times
 * its raw transport call, for bench/compare_transports.sh:
 *
 *   mpirun -n N mpi_allreduce MINBYTES MAXBYTES FACTOR ITERS WARMUP
 *
 * For every size: WARMUP untimed calls, then ITERS rounds of (MPI_Barrier,
 * one timed MPI_Allreduce); rank 0 prints the median in commgrad-bench's
 * column layout (size count type redop root | time algbw busbw #wrong), so
 * that one parser reads both. #wrong comes from a separate checked call on
 * small integers (rank + 1 everywhere, expecting n(n+1)/2). */

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int compare_doubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 6) {
    if (rank == 0) fprintf(stderr, "usage: mpi_allreduce MINBYTES MAXBYTES FACTOR ITERS WARMUP\n");
    MPI_Finalize();
    return 2;
  }
  const long min_bytes = atol(argv[1]), max_bytes = atol(argv[2]);
  const long factor = atol(argv[3]);
  const int iters = atoi(argv[4]), warmup = atoi(argv[5]);
  float* buf = malloc((size_t)max_bytes);
  double* times = malloc(sizeof(double) * (size_t)(iters > 0 ? iters : 1));
  if (buf == NULL || times == NULL || factor < 2 || iters < 1) {
    fprintf(stderr, "mpi_allreduce: bad arguments or out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (rank == 0) {
    printf("# mpi_allreduce: %d ranks, float, iters %d, warmup %d\n", size, iters, warmup);
    printf("#       size      count     type  redop root |     time   algbw   busbw #wrong\n");
  }
  for (long bytes = min_bytes; bytes <= max_bytes; bytes *= factor) {
    const int count = (int)(bytes / (long)sizeof(float));
    /* Correctness first, on exact small integers. */
    for (int i = 0; i < count; ++i) buf[i] = (float)(rank + 1);
    MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    long wrong = 0;
    for (int i = 0; i < count; ++i) wrong += buf[i] != (float)(size * (size + 1) / 2);
    long total_wrong = 0;
    MPI_Reduce(&wrong, &total_wrong, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    for (int i = 0; i < count; ++i) buf[i] = 1.0f;
    for (int i = 0; i < warmup; ++i) MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    for (int i = 0; i < iters; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      times[i] = (MPI_Wtime() - start) * 1e6;
    }
    if (rank == 0) {
      qsort(times, (size_t)iters, sizeof(double), compare_doubles);
      const double us = times[iters / 2];
      const double algbw = (double)bytes / us / 1e3;
      const double busbw = algbw * 2.0 * (size - 1) / size;
      printf("%12ld %10d %8s %6s %4d | %8.1f %7.3f %7.3f %6ld\n", bytes, count, "float", "sum", -1, us, algbw, busbw,
             total_wrong);
      fflush(stdout);
    }
  }
  free(times);
  free(buf);
  MPI_Finalize();
  return 0;
}
