#pragma once
// Single-copy transfers between the ranks' private memory (Linux cross
// memory attach, process_vm_readv), which the shm all-reduce uses for large
// tensors: a rank reads its peers' tensors straight into its own buffers
// instead of every byte going through the shared segment (copied in by the
// owner, copied out by the reader). OpenMPI's vader transport does the same
// ("cma"). It needs the permission to read a peer (same user, ptrace
// allowed: no Yama restriction or container seccomp profile that forbids
// it): every rank probes its peers when the group is created, and the group
// uses it only when every rank can read every other one. Internal to
// commgrad_backend.

#include <cstdint>
#include <string>

namespace commgrad::backend::detail {

/// The value of the word peers read to test whether they may read this process.
constexpr uint64_t kSingleCopyProbe = 0x79706f63656c6773ULL;  // "sglecopy"

/// The address of that word in this process.
uint64_t single_copy_probe_address();

/// True when this process can read process `pid` at `probe_address` (and
/// finds the probe word there).
bool can_read_process(int32_t pid, uint64_t probe_address);

/// Reads `bytes` at `remote_address` in process `pid` into `local`. Returns
/// 0, or the errno of the failure (ESRCH: the process is gone).
int read_process(int32_t pid, uint64_t remote_address, void* local, int64_t bytes);

/// The text of a read_process error for messages.
std::string read_process_error(int err);

}  // namespace commgrad::backend::detail
