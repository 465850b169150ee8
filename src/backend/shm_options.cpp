// Resolving ShmOptions: what each default (0 or -1) becomes, read from the
// environment through commgrad::env or derived from the group's size.

#include "detail/shm_defaults.h"

#include "commgrad/util/env.h"

#include <c10/util/Exception.h>

#include <sched.h>

#include <algorithm>
#include <thread>

namespace commgrad::backend::detail {
namespace {

// A non-negative integer from the environment; -1 when unset.
int64_t env_int(const char* name, const char* unit) { return env::get_count(name, unit).value_or(-1); }

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

}  // namespace

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

ShmOptions resolve(ShmOptions o, int size) {
  int64_t chunk = o.chunk_bytes() > 0 ? o.chunk_bytes() : env_int("COMMGRAD_SHM_CHUNK_BYTES", "bytes");
  if (chunk <= 0) {
    // A rank writes a set's lines again three steps after its readers read
    // them; while those still sit in a reader's cache, every write waits
    // for their copies to be invalidated. With one peer to read from, 2 x
    // 256 KiB sets kept that distance (3 x 256 KiB) inside a core's L2 here
    // (1 MiB, AMD EPYC), and 512 KiB per rank took 1.2-1.3x less time for
    // 1-4 MiB all-reduces and all-to-alls, 1.4-2.6x for 256 KiB-16 MiB
    // broadcasts (2 ranks, alternating processes, fresh inputs); with more
    // peers the distance is already (n - 1) x 3 x 256 KiB, and 4 ranks (on
    // 2 cores) took up to 1.7x longer with 512 KiB (all-to-all 1-4 MiB).
    chunk = size == 2 ? 512 * 1024 : 256 * 1024;
  }
  o.chunk_bytes(std::max<int64_t>(round_up(chunk, 64), 64 * static_cast<int64_t>(size)));
  int64_t mailbox = o.mailbox_bytes();
  if (mailbox <= 0 && size > 1) {
    mailbox = std::clamp<int64_t>((16 << 20) / (static_cast<int64_t>(size) * (size - 1)), 4096, 1 << 20);
  }
  o.mailbox_bytes(round_up(std::max<int64_t>(mailbox, 64), 64));
  if (o.spin_us() < 0) {
    // Longer than a futex wake-up takes on a VM (p50 18-62 us measured):
    // with a spin below it, a rank woken late makes its peer sleep in turn,
    // and the spin never grows back (docs/shm.md, "Waiting").
    const int64_t env = env_int("COMMGRAD_SHM_SPIN_US", "microseconds");
    o.spin_us(env >= 0 ? static_cast<int>(env) : (size <= usable_cpus() ? 200 : 0));
  }
  if (o.async_bytes() < 0) {
    const int64_t env = env_int("COMMGRAD_SHM_ASYNC_BYTES", "bytes");
    o.async_bytes(env >= 0 ? env : int64_t{1} << 20);
  }
  if (o.single_copy_bytes() < 0) {
    // Off: with streaming stores where ordinary ones run slow, the staged
    // all-reduce of freshly written tensors is faster at every size
    // measured (2 ranks, 4 MiB: 271-277 us against 408-419; docs/shm.md).
    const int64_t env = env_int("COMMGRAD_SHM_SINGLE_COPY_BYTES", "bytes");
    o.single_copy_bytes(env >= 0 ? env : 0);
  }
  if (o.single_copy_max_bytes() < 0) {
    const int64_t env = env_int("COMMGRAD_SHM_SINGLE_COPY_MAX_BYTES", "bytes");
    o.single_copy_max_bytes(env >= 0 ? env : int64_t{16} << 20);
  }
  if (o.single_copy_piece_bytes() < 0) {
    const int64_t env = env_int("COMMGRAD_SHM_SINGLE_COPY_PIECE_BYTES", "bytes");
    // Off, as the all-reduce's: with freshly written tensors and streaming
    // stores the staged all-to-all was as fast or faster at every size
    // measured (2 ranks, blocks of calls alternating the two: 4 MiB level,
    // 16 MiB 16-20 % and 64 MiB 9-10 % faster staged), and the kernel's
    // copy in process_vm_readv has no guard against the slow rep movsb
    // distances (2 MiB: 325 us against 100 staged in some processes).
    o.single_copy_piece_bytes(env >= 0 ? env : 0);
  }
  if (o.eager_worker() < 0) {
    const int64_t env = env_int("COMMGRAD_SHM_EAGER_WORKER", "0 or 1");
    o.eager_worker(env >= 0 ? (env != 0 ? 1 : 0) : (2 * size <= usable_cpus() ? 1 : 0));
  }
  if (o.group_name().empty()) o.group_name("shm");
  const char* const expected =
      "; expected 0 (ordinary stores), 1 (streaming) or 2 (streaming while ordinary ones run slow)";
  if (o.streaming_stores() < 0) {
    const int64_t env = env_int("COMMGRAD_SHM_STREAMING_STORES", "0, 1 or 2");
    TORCH_CHECK(env <= 2, "[commgrad] shm group '", o.group_name(), "': $COMMGRAD_SHM_STREAMING_STORES is ", env,
                expected);
    o.streaming_stores(env >= 0 ? static_cast<int>(env) : 2);
  }
  TORCH_CHECK(o.streaming_stores() <= 2, "[commgrad] shm group '", o.group_name(), "': streaming_stores is ",
              o.streaming_stores(), expected);
  return o;
}

}  // namespace commgrad::backend::detail
