/* OpenMPI's collectives (float32; SUM where they reduce) timed the way
 * commgrad-bench times its raw transport call, for bench/compare_transports.sh:
 *
 *   mpirun -n N mpi_collectives OP MINBYTES MAXBYTES FACTOR ITERS WARMUP [SWEEPS [FRESH]]
 *
 * OP is all_reduce (MPI_Allreduce, in place), all_gather (MPI_Allgather),
 * reduce_scatter (MPI_Reduce_scatter_block), broadcast (MPI_Bcast, root 0)
 * or all_to_all (MPI_Alltoall). Sizes count as commgrad-bench's do (those of
 * nccl-tests): all_gather's output, reduce_scatter's input, all_to_all's
 * buffer per rank, the whole tensor for the others; the bus bandwidth factor
 * is nccl-tests' too. For every size: WARMUP untimed calls, then ITERS rounds
 * of (MPI_Barrier, one timed call), the median of which is the sweep's
 * time; the sizes are swept SWEEPS times (default 1) and rank 0 prints the
 * median over the sweeps (as commgrad-bench --sweeps does) in
 * commgrad-bench's column layout (size count type redop root | time algbw
 * busbw #wrong), so that one parser reads both. #wrong comes from a separate
 * checked call on commgrad-bench's inputs, x_r[i] = (i mod 5) + r + 1, whose
 * every result is exact in float. FRESH 1 (commgrad-bench --fresh-input):
 * before each call, untimed, every rank writes what the call reads (the
 * buffer, the input; a broadcast's root only) again with the input's
 * values, as a training step's tensors are freshly written; unchanged, a
 * source may still sit in the readers' caches from the last call, which
 * flatters reading it in place. */

#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum Op { kAllReduce, kAllGather, kReduceScatter, kBroadcast, kAllToAll };

static const char* const kNames[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"};

static int parse_op(const char* name) {
  for (int i = 0; i < (int)(sizeof(kNames) / sizeof(kNames[0])); ++i)
    if (strcmp(name, kNames[i]) == 0) return i;
  return -1;
}

/* Whether the op splits its buffer into one part per rank. */
static int splits(int op) { return op == kAllGather || op == kReduceScatter || op == kAllToAll; }

static double bus_factor(int op, int n) {
  if (op == kAllReduce) return 2.0 * (n - 1) / n;
  if (op == kBroadcast) return 1.0;
  return (double)(n - 1) / n;
}

static float input_value(long i, int rank) { return (float)(i % 5 + rank + 1); }

/* One call of OP on `count` elements (the table's count). */
static void call(int op, float* send, float* recv, long count, int n) {
  const int part = (int)(count / n);
  switch (op) {
    case kAllReduce:
      MPI_Allreduce(MPI_IN_PLACE, send, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case kAllGather:
      MPI_Allgather(send, part, MPI_FLOAT, recv, part, MPI_FLOAT, MPI_COMM_WORLD);
      break;
    case kReduceScatter:
      MPI_Reduce_scatter_block(send, recv, part, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      break;
    case kBroadcast:
      MPI_Bcast(send, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
      break;
    default:
      MPI_Alltoall(send, part, MPI_FLOAT, recv, part, MPI_FLOAT, MPI_COMM_WORLD);
      break;
  }
}

/* Writes this rank's input: the elements the call reads. */
static void fill_input(int op, float* send, long count, int rank, int n) {
  const long in = op == kAllGather ? count / n : count;
  for (long i = 0; i < in; ++i) send[i] = input_value(i, rank);
}

/* Writes what this rank's call reads again (FRESH), so that its lines sit
 * written in this core's cache, as a computed tensor's do. */
static void refresh(int op, float* send, long count, int rank, int n) {
  if (op != kBroadcast || rank == 0) fill_input(op, send, count, rank, n);
}

/* Fills the inputs, runs OP once and counts this rank's wrong elements. */
static long checked_call(int op, float* send, float* recv, long count, int rank, int n) {
  const long part = count / n;
  fill_input(op, send, count, rank, n);
  call(op, send, recv, count, n);
  long wrong = 0;
  switch (op) {
    case kAllReduce:
      for (long i = 0; i < count; ++i) wrong += send[i] != (float)(n * (i % 5) + n * (n + 1) / 2);
      break;
    case kAllGather:
      for (long i = 0; i < count; ++i) wrong += recv[i] != input_value(i % part, (int)(i / part));
      break;
    case kReduceScatter:
      for (long j = 0; j < part; ++j) wrong += recv[j] != (float)(n * ((rank * part + j) % 5) + n * (n + 1) / 2);
      break;
    case kBroadcast:
      for (long i = 0; i < count; ++i) wrong += send[i] != input_value(i, 0);
      break;
    default:
      for (long i = 0; i < count; ++i) wrong += recv[i] != input_value(rank * part + i % part, (int)(i / part));
      break;
  }
  return wrong;
}

static int compare_doubles(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const int op = argc >= 7 && argc <= 9 ? parse_op(argv[1]) : -1;
  if (op < 0) {
    if (rank == 0)
      fprintf(stderr,
              "usage: mpi_collectives all_reduce|all_gather|reduce_scatter|broadcast|all_to_all "
              "MINBYTES MAXBYTES FACTOR ITERS WARMUP [SWEEPS [FRESH]]\n");
    MPI_Finalize();
    return 2;
  }
  const long min_bytes = atol(argv[2]), max_bytes = atol(argv[3]), factor = atol(argv[4]);
  const int iters = atoi(argv[5]), warmup = atoi(argv[6]), sweeps = argc >= 8 ? atoi(argv[7]) : 1;
  const int fresh = argc == 9 ? atoi(argv[8]) : 0;
  int nsizes = 0;
  for (long bytes = min_bytes; bytes >= 1 && bytes <= max_bytes && factor >= 2; bytes *= factor) ++nsizes;
  float* send = malloc((size_t)max_bytes);
  float* recv = malloc((size_t)max_bytes);
  double* times = malloc(sizeof(double) * (size_t)(iters > 0 ? iters : 1));
  double* medians = malloc(sizeof(double) * (size_t)(nsizes > 0 ? nsizes : 1) * (size_t)(sweeps > 0 ? sweeps : 1));
  long* wrongs = calloc((size_t)(nsizes > 0 ? nsizes : 1), sizeof(long));
  if (send == NULL || recv == NULL || times == NULL || medians == NULL || wrongs == NULL || factor < 2 || iters < 1 ||
      min_bytes < 1 || sweeps < 1 || fresh < 0 || fresh > 1) {
    fprintf(stderr, "mpi_collectives: bad arguments or out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (rank == 0) {
    printf("# mpi_collectives %s: %d ranks, float, iters %d, warmup %d, sweeps %d%s\n", kNames[op], n, iters, warmup,
           sweeps, fresh ? ", fresh input" : "");
    printf("#       size      count     type  redop root |     time   algbw   busbw #wrong\n");
  }
  for (int sweep = 0; sweep < sweeps; ++sweep) {
    long bytes = min_bytes;
    for (int size = 0; size < nsizes; ++size, bytes *= factor) {
      const long count = bytes / (long)sizeof(float);
      if (splits(op) && count % n != 0) {
        if (rank == 0) fprintf(stderr, "mpi_collectives: %ld floats do not split among %d ranks\n", count, n);
        MPI_Abort(MPI_COMM_WORLD, 2);
      }
      if (sweep == 0) {
        long wrong = checked_call(op, send, recv, count, rank, n);
        MPI_Reduce(&wrong, &wrongs[size], 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
      }
      for (int i = 0; i < warmup; ++i) {
        if (fresh) refresh(op, send, count, rank, n);
        call(op, send, recv, count, n);
      }
      for (int i = 0; i < iters; ++i) {
        if (fresh) refresh(op, send, count, rank, n);
        MPI_Barrier(MPI_COMM_WORLD);
        const double start = MPI_Wtime();
        call(op, send, recv, count, n);
        times[i] = (MPI_Wtime() - start) * 1e6;
      }
      qsort(times, (size_t)iters, sizeof(double), compare_doubles);
      medians[size * sweeps + sweep] = times[iters / 2];
    }
  }
  long bytes = min_bytes;
  for (int size = 0; size < nsizes && rank == 0; ++size, bytes *= factor) {
    qsort(&medians[size * sweeps], (size_t)sweeps, sizeof(double), compare_doubles);
    const double us = medians[size * sweeps + sweeps / 2];
    const double algbw = (double)bytes / us / 1e3;
    const int reduces = op == kAllReduce || op == kReduceScatter;
    printf("%12ld %10ld %8s %6s %4d | %8.2f %7.3f %7.3f %6ld\n", bytes, bytes / (long)sizeof(float), "float",
           reduces ? "sum" : "-", op == kBroadcast ? 0 : -1, us, algbw, algbw * bus_factor(op, n), wrongs[size]);
  }
  fflush(stdout);
  free(wrongs);
  free(medians);
  free(times);
  free(recv);
  free(send);
  MPI_Finalize();
  return 0;
}
