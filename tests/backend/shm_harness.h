#pragma once
// Test helpers for the shm backend: N ranks as threads of this process, each
// with its own ShmProcessGroup (and optionally a Gloo group, for reference
// results) over one shared in-memory store; deterministic per-rank inputs;
// reference reductions computed locally in the backend's fixed rank order.

#include "harness/expect_error.h"
#include "commgrad/backend/shm_process_group.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace shm_test {

using commgrad::backend::ShmOptions;
using commgrad::backend::ShmProcessGroup;
using RedOpType = c10d::ReduceOp::RedOpType;

/// What one rank's thread gets.
struct Rank {
  int rank = 0;
  int size = 1;
  c10::intrusive_ptr<ShmProcessGroup> shm;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;  // null unless RunOptions::gloo
  c10::intrusive_ptr<c10d::Store> store;            // shared by all ranks (unprefixed)
};

struct RunOptions {
  ShmOptions shm = ShmOptions().timeout(std::chrono::seconds(30));
  bool gloo = false;
  /// The whole run is aborted (naming the stuck ranks) after this long.
  std::chrono::seconds limit{90};
};

/// Runs body(rank) on n threads; an exception in a rank is a test failure
/// naming the rank. A run that exceeds `limit` aborts the binary instead of
/// hanging the suite.
inline void run_ranks(int n, const RunOptions& options, const std::function<void(Rank&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mutex;
  std::condition_variable cv;
  std::vector<bool> done(n, false);
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        Rank rank;
        rank.rank = r;
        rank.size = n;
        rank.store = store;
        rank.shm = c10::make_intrusive<ShmProcessGroup>(c10::make_intrusive<c10d::PrefixStore>("shm", store), r, n,
                                                        options.shm);
        // COMMGRAD_SHM_TEST_GLOO=0 leaves Gloo out (ThreadSanitizer runs:
        // uninstrumented Gloo threads only add noise there).
        const char* gloo_env = std::getenv("COMMGRAD_SHM_TEST_GLOO");
        if (options.gloo && !(gloo_env != nullptr && std::string(gloo_env) == "0")) {
          auto o = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
          o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
          rank.gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>("gloo", store),
                                                                  r, n, o);
        }
        body(rank);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mutex);
        errors[r] = e.what();
      }
      std::lock_guard<std::mutex> lock(mutex);
      done[r] = true;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    const bool finished = cv.wait_for(lock, options.limit, [&] {
      for (bool d : done) {
        if (!d) return false;
      }
      return true;
    });
    if (!finished) {
      std::cerr << "run_ranks: ranks did not finish within " << options.limit.count() << "s:";
      for (int r = 0; r < n; ++r) {
        if (!done[r]) std::cerr << " " << r;
      }
      std::cerr << std::endl;
      std::abort();
    }
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (!errors[r].empty()) ADD_FAILURE() << "rank " << r << "/" << n << " threw: " << errors[r];
  }
}

/// Deterministic input of rank `rank` for call `salt`: normal floats (near 1
/// for products), small integers, random bools.
inline at::Tensor make_input(int64_t numel, at::ScalarType dtype, int rank, uint64_t salt, bool for_product = false) {
  auto gen = at::detail::createCPUGenerator(salt * 1000003ULL + static_cast<uint64_t>(rank) * 7919ULL + 17);
  const auto f = at::TensorOptions().dtype(at::kFloat);
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kComplexFloat:
    case at::kComplexDouble: {
      at::Tensor t = at::randn({numel}, gen, f);
      if (for_product) t = 1 + 0.1 * t;
      if (dtype == at::kComplexFloat || dtype == at::kComplexDouble) {
        return at::complex(t, at::randn({numel}, gen, f)).to(dtype);
      }
      return t.to(dtype);
    }
    case at::kBool:
      return at::randint(0, 2, {numel}, gen, f).to(at::kBool);
    case at::kByte:
      return at::randint(0, for_product ? 3 : 100, {numel}, gen, f).to(dtype);
    default:
      return at::randint(for_product ? -2 : -50, for_product ? 3 : 50, {numel}, gen, f).to(dtype);
  }
}

/// The reduction the shm backend computes: inputs combined in rank order,
/// half/bfloat16 in float32 and rounded once, AVG dividing the sum (of
/// integers, summed in int64: it does not overflow the dtype).
inline at::Tensor reference_reduce(const std::vector<at::Tensor>& inputs, RedOpType op) {
  const auto dtype = inputs[0].scalar_type();
  const bool low = dtype == at::kHalf || dtype == at::kBFloat16;
  const bool is_bool = dtype == at::kBool;
  const bool wide = op == RedOpType::AVG && at::isIntegralType(dtype, /*includeBool=*/false);
  const auto acc_type = low ? at::kFloat : wide ? at::kLong : dtype;
  at::Tensor acc = inputs[0].to(acc_type, /*non_blocking=*/false, /*copy=*/true);
  for (size_t i = 1; i < inputs.size(); ++i) {
    const at::Tensor x = inputs[i].to(acc_type);
    switch (op) {
      case RedOpType::SUM:
      case RedOpType::AVG:
        acc = is_bool ? at::logical_or(acc, x) : acc + x;
        break;
      case RedOpType::PRODUCT:
        acc = is_bool ? at::logical_and(acc, x) : acc * x;
        break;
      case RedOpType::MAX:
        acc = is_bool ? at::logical_or(acc, x) : at::maximum(acc, x);
        break;
      case RedOpType::MIN:
        acc = is_bool ? at::logical_and(acc, x) : at::minimum(acc, x);
        break;
      case RedOpType::BAND:
        acc = is_bool ? at::logical_and(acc, x) : at::bitwise_and(acc, x);
        break;
      case RedOpType::BOR:
        acc = is_bool ? at::logical_or(acc, x) : at::bitwise_or(acc, x);
        break;
      case RedOpType::BXOR:
        acc = is_bool ? at::logical_xor(acc, x) : at::bitwise_xor(acc, x);
        break;
      default:
        throw std::runtime_error("reference_reduce: unsupported op");
    }
  }
  if (op == RedOpType::AVG) {
    const auto n = static_cast<int64_t>(inputs.size());
    if (at::isIntegralType(acc.scalar_type(), /*includeBool=*/false)) {
      acc = at::div(acc, n, "trunc");
    } else if (acc.is_complex()) {
      // Each component divided by n (complex division would round differently).
      const at::Tensor parts = at::view_as_real(acc);
      acc = at::view_as_complex(parts / at::full_like(parts, static_cast<double>(n)));
    } else {
      acc = acc / at::full_like(acc, static_cast<double>(n));  // true division, element by element
    }
  }
  return acc.to(dtype);
}

/// Same values and dtype, bit for bit (NaN-free inputs).
inline bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && at::equal(a, b);
}

inline const char* op_name(RedOpType op) {
  switch (op) {
    case RedOpType::SUM:
      return "SUM";
    case RedOpType::AVG:
      return "AVG";
    case RedOpType::PRODUCT:
      return "PRODUCT";
    case RedOpType::MIN:
      return "MIN";
    case RedOpType::MAX:
      return "MAX";
    case RedOpType::BAND:
      return "BAND";
    case RedOpType::BOR:
      return "BOR";
    case RedOpType::BXOR:
      return "BXOR";
    default:
      return "?";
  }
}

using commgrad::testing::error_of;

}  // namespace shm_test
