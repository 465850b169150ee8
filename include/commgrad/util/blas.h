#pragma once
// Which BLAS LibTorch's matmuls run on, and its own thread pool.

#include <string>

namespace commgrad {

/// Name of the BLAS library LibTorch's matmuls run on ("OpenBLAS 0.3.21 (pthread)",
/// "reference BLAS (slow!)", ...), read from the libraries loaded in this process.
std::string active_blas();

/// Sets the thread count of OpenBLAS's own pthread pool, which
/// at::set_num_threads() does not reach (Debian's LibTorch calls the pthread
/// OpenBLAS, whose pool starts one thread per core). init_process_group calls
/// it with the rank's intra-op thread count. Returns the count in force, or
/// 0 when the BLAS in this process is not OpenBLAS.
int set_blas_threads(int threads);

}  // namespace commgrad
