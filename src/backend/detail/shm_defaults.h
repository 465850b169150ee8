#pragma once
// How a ShmProcessGroup fills in the ShmOptions left at their defaults.

#include "commgrad/backend/shm_options.h"

namespace commgrad::backend::detail {

/// `options` for a group of `size` ranks with every default resolved (from
/// the environment, else from the group's size and this process's CPUs),
/// sizes rounded up to 64 bytes and the group named ("shm" by default).
ShmOptions resolve(ShmOptions options, int size);

/// The CPUs this process may run on (its affinity mask), at least 1.
int usable_cpus();

}  // namespace commgrad::backend::detail
