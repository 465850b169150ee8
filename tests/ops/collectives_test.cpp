// Forward values and gradients of every Family 1 collective against a
// single-process reference.
//
// Every rank builds its input from (seed, rank), so each rank can rebuild
// every other rank's input and compute, with plain torch ops, the result the
// collective should give on each rank and the gradient of the summed
// objective L = sum_r (sin(y_r) * w_r).sum() with random per-rank weights w_r
// (a plain sum() would hide wrong routing of gradients). Each case runs for
// world sizes 1-4, float32 and float64, contiguous, transposed, sliced and
// expanded inputs, with and without requires_grad, including 0-element and
// odd shapes.

#include "harness/spawn_ranks.h"

#include <commgrad/ops.h>
#include <commgrad/util/print.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <mutex>

namespace commgrad::ops {
namespace {

using Shape = std::vector<int64_t>;

enum class Layout { kContiguous, kTransposed, kSliced, kExpanded };

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kContiguous:
      return "contiguous";
    case Layout::kTransposed:
      return "transposed";
    case Layout::kSliced:
      return "sliced";
    case Layout::kExpanded:
      return "expanded";
  }
  return "?";
}

struct Variant {
  at::ScalarType dtype = at::kFloat;
  Layout layout = Layout::kContiguous;
  bool requires_grad = true;
};

std::string describe(const Variant& v, const Shape& shape) {
  return c10::str(c10::toString(v.dtype), shape, " ", layout_name(v.layout), v.requires_grad ? " grad" : " no-grad");
}

at::Generator generator(int64_t seed, int rank, int stream) {
  return at::make_generator<at::CPUGeneratorImpl>(seed * 7919 + rank * 31 + stream);
}

// The leaf of rank r (what receives gradients) and the op input made from it
// with the requested memory layout; the same values for every layout.
struct Input {
  at::Tensor leaf;
  at::Tensor x;
};

Input make_input(int64_t seed, int rank, const Shape& shape, Variant v, bool integer_valued = false) {
  if (shape.size() < 2 && v.layout == Layout::kTransposed) v.layout = Layout::kContiguous;
  if (shape.empty()) v.layout = Layout::kContiguous;
  auto opts = at::TensorOptions().dtype(v.dtype);
  auto gen = generator(seed, rank, 0);
  auto draw = [&](const Shape& s) {
    auto t = at::randn(s, gen, opts);
    return integer_valued ? t.mul(1.5).round() : t;
  };
  Input in;
  switch (v.layout) {
    case Layout::kContiguous:
      in.leaf = draw(shape).requires_grad_(v.requires_grad);
      in.x = in.leaf;
      break;
    case Layout::kTransposed: {
      Shape t = shape;
      std::swap(t.front(), t.back());
      in.leaf = draw(t).requires_grad_(v.requires_grad);
      in.x = in.leaf.transpose(0, -1);
      break;
    }
    case Layout::kSliced: {
      Shape t = shape;
      t[0] *= 2;
      in.leaf = draw(t).requires_grad_(v.requires_grad);
      in.x = in.leaf.slice(0, 0, t[0], 2);
      break;
    }
    case Layout::kExpanded: {
      Shape t = shape;
      t[0] = 1;
      in.leaf = draw(t).requires_grad_(v.requires_grad);
      in.x = in.leaf.expand(shape);
      break;
    }
  }
  return in;
}

at::Tensor weight(int64_t seed, int rank, at::IntArrayRef shape, at::ScalarType dtype) {
  auto gen = generator(seed, rank, 1);
  return at::randn(shape, gen, at::TensorOptions().dtype(dtype));
}

at::Tensor objective(const at::Tensor& y, int64_t seed, int rank) {
  return (at::sin(y) * weight(seed, rank, y.sizes(), y.scalar_type())).sum();
}

void expect_close(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": undefined";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.scalar_type(), want.scalar_type()) << what;
  const double tol = got.scalar_type() == at::kDouble ? 1e-10 : 1e-4;
  EXPECT_TRUE(at::allclose(got, want, tol, tol))
      << what << "\n got  " << format_tensor(got) << "\n want " << format_tensor(want);
}

// y on rank r (torch ops on all ranks' inputs, differentiable).
using Reference = std::function<at::Tensor(const std::vector<at::Tensor>& xs, int r, int n)>;
// The collective under test.
using Op = std::function<at::Tensor(const at::Tensor& x, Group& g)>;
// The input shape of rank r in a group of n.
using ShapeOf = std::function<Shape(int r, int n)>;

struct CaseOptions {
  bool replicated = false;      // results bitwise equal on every rank
  bool integer_valued = false;  // inputs with ties (MAX/MIN)
  std::vector<at::ScalarType> dtypes{at::kFloat, at::kDouble};
};

// Runs one op on n ranks for every variant and shape, checking forward
// values, gradients, untouched inputs and (when replicated) bitwise equal
// results against the reference.
void check_op(int n, const std::vector<ShapeOf>& shapes, const Op& op, const Reference& ref,
              const CaseOptions& options = {}) {
  std::vector<Variant> variants;
  for (auto dtype : options.dtypes) {
    for (auto layout : {Layout::kContiguous, Layout::kTransposed, Layout::kSliced, Layout::kExpanded}) {
      for (bool rg : {true, false}) variants.push_back({dtype, layout, rg});
    }
  }
  std::mutex mutex;
  std::vector<std::vector<at::Tensor>> outputs(n);
  testing::spawn_ranks(n, [&](Group& g) {
    const int r = g.rank();
    int64_t seed = 0;
    for (const auto& shape_of : shapes) {
      for (const auto& v : variants) {
        ++seed;
        const Shape shape = shape_of(r, n);
        SCOPED_TRACE(describe(v, shape));
        Input in = make_input(seed, r, shape, v, options.integer_valued);
        const auto before = in.leaf.detach().clone();
        at::Tensor y = op(in.x, g);

        // The reference: every rank's input, every rank's objective.
        std::vector<Input> all;
        std::vector<at::Tensor> xs;
        for (int s = 0; s < n; ++s) {
          Variant rv = v;
          rv.requires_grad = true;
          all.push_back(make_input(seed, s, shape_of(s, n), rv, options.integer_valued));
          xs.push_back(all.back().x);
        }
        at::Tensor total;
        at::Tensor y_ref;
        for (int s = 0; s < n; ++s) {
          auto ys = ref(xs, s, n);
          if (s == r) y_ref = ys.detach();
          auto ls = objective(ys, seed, s);
          total = total.defined() ? total + ls : ls;
        }
        if (total.requires_grad()) total.backward();

        expect_close(y.detach(), y_ref, "forward");
        EXPECT_EQ(y.requires_grad(), v.requires_grad);
        if (v.requires_grad) {
          objective(y, seed, r).backward();
          auto want = all[r].leaf.grad();
          if (!want.defined()) want = at::zeros_like(in.leaf);
          auto got = in.leaf.grad();
          if (!got.defined()) got = at::zeros_like(in.leaf);
          expect_close(got, want, "gradient");
        }
        EXPECT_TRUE(at::equal(in.leaf.detach(), before)) << "the op modified its input";
        if (options.replicated) {
          std::lock_guard<std::mutex> lock(mutex);
          outputs[r].push_back(y.detach().clone());
        }
      }
    }
  });
  if (options.replicated) {
    for (int r = 1; r < n; ++r) {
      ASSERT_EQ(outputs[r].size(), outputs[0].size());
      for (size_t i = 0; i < outputs[0].size(); ++i) {
        EXPECT_TRUE(at::equal(outputs[r][i], outputs[0][i]))
            << "case " << i << ": rank " << r << " differs from rank 0";
      }
    }
  }
}

CaseOptions replicated() {
  CaseOptions o;
  o.replicated = true;
  return o;
}

at::Tensor sum_of(const std::vector<at::Tensor>& xs) {
  at::Tensor s = xs[0];
  for (size_t i = 1; i < xs.size(); ++i) s = s + xs[i];
  return s;
}

ShapeOf fixed(Shape s) {
  return [s](int, int) { return s; };
}

class Collectives : public ::testing::TestWithParam<int> {};

// ~~~ all_reduce ~~~

const std::vector<ShapeOf> kAnyShapes{fixed({5, 3}), fixed({7}), fixed({0}), fixed({2, 0, 3}), fixed({})};

TEST_P(Collectives, AllReduceSum) {
  check_op(
      GetParam(), kAnyShapes, [](const at::Tensor& x, Group& g) { return all_reduce(x, {}, g); },
      [](const std::vector<at::Tensor>& xs, int, int) { return sum_of(xs); }, replicated());
}

TEST_P(Collectives, AllReduceAvg) {
  check_op(
      GetParam(), kAnyShapes,
      [](const at::Tensor& x, Group& g) { return all_reduce(x, AllReduceOptions().op(ReduceOp::kAvg), g); },
      [](const std::vector<at::Tensor>& xs, int, int n) { return sum_of(xs) / n; }, replicated());
}

TEST_P(Collectives, AllReduceMaxMin) {
  for (bool ties : {false, true}) {
    SCOPED_TRACE(ties ? "with ties" : "without ties");
    CaseOptions o = replicated();
    o.integer_valued = ties;
    check_op(
        GetParam(), kAnyShapes,
        [](const at::Tensor& x, Group& g) { return all_reduce(x, AllReduceOptions().op(ReduceOp::kMax), g); },
        [](const std::vector<at::Tensor>& xs, int, int) { return at::stack(xs).amax(0); }, o);
    check_op(
        GetParam(), {fixed({4, 3})},
        [](const at::Tensor& x, Group& g) { return all_reduce(x, AllReduceOptions().op(ReduceOp::kMin), g); },
        [](const std::vector<at::Tensor>& xs, int, int) { return at::stack(xs).amin(0); }, o);
  }
}

TEST_P(Collectives, AllReduceProductForward) {
  const int n = GetParam();
  testing::spawn_ranks(n, [&](Group& g) {
    auto x = at::full({3}, static_cast<double>(g.rank() + 2), at::kDouble);
    auto y = all_reduce(x, AllReduceOptions().op(ReduceOp::kProduct), g);
    double want = 1;
    for (int r = 0; r < n; ++r) want *= r + 2;
    EXPECT_TRUE(at::equal(y, at::full({3}, want, at::kDouble)));
  });
}

// ~~~ all_gather / reduce_scatter ~~~

TEST_P(Collectives, AllGather) {
  for (int64_t dim : {0, 1, -1}) {
    SCOPED_TRACE(c10::str("dim ", dim));
    check_op(
        GetParam(), {fixed({3, 5}), fixed({0, 3}), fixed({2, 3, 1})},
        [dim](const at::Tensor& x, Group& g) { return all_gather(x, AllGatherOptions().dim(dim), g); },
        [dim](const std::vector<at::Tensor>& xs, int, int) { return at::cat(xs, dim); }, replicated());
  }
}

TEST_P(Collectives, AllGatherUneven) {
  auto size_of = [](int r) { return int64_t{(r * 2 + 1) % 4}; };  // 1, 3, 1, 3, ... (with a 0 when r==... none)
  for (int64_t dim : {0, 1}) {
    SCOPED_TRACE(c10::str("dim ", dim));
    ShapeOf shape = [dim, size_of](int r, int) {
      Shape s{3, 2};
      s[dim] = r == 1 ? 0 : size_of(r);  // rank 1 brings nothing
      return s;
    };
    check_op(
        GetParam(), {shape},
        [dim, shape](const at::Tensor& x, Group& g) {
          std::vector<int64_t> sizes;
          for (int r = 0; r < g.size(); ++r) sizes.push_back(shape(r, g.size())[dim]);
          return all_gather(x, AllGatherOptions().dim(dim).sizes(sizes), g);
        },
        [dim](const std::vector<at::Tensor>& xs, int, int) { return at::cat(xs, dim); }, replicated());
  }
}

TEST_P(Collectives, ReduceScatter) {
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    for (int64_t dim : {0, 1, -1}) {
      SCOPED_TRACE(c10::str(op, " dim ", dim));
      ShapeOf shape = [dim](int, int n) {
        Shape s{3, 5};
        s[dim < 0 ? dim + 2 : dim] = 3 * n;
        return s;
      };
      check_op(
          GetParam(), {shape, fixed({0, 0})},
          [dim, op](const at::Tensor& x, Group& g) {
            return reduce_scatter(x, ReduceScatterOptions().dim(dim).op(op), g);
          },
          [dim, op](const std::vector<at::Tensor>& xs, int r, int n) {
            auto s = sum_of(xs);
            if (op == ReduceOp::kAvg) s = s / n;
            return s.chunk(n, dim)[r];
          });
    }
  }
}

TEST_P(Collectives, ReduceScatterUneven) {
  for (int64_t dim : {0, 1}) {
    SCOPED_TRACE(c10::str("dim ", dim));
    auto sizes_of = [](int n) {
      std::vector<int64_t> s;
      for (int r = 0; r < n; ++r) s.push_back(r == 1 ? 0 : r + 1);
      return s;
    };
    ShapeOf shape = [dim, sizes_of](int, int n) {
      Shape s{3, 2};
      auto sizes = sizes_of(n);
      s[dim] = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
      return s;
    };
    check_op(
        GetParam(), {shape},
        [dim, sizes_of](const at::Tensor& x, Group& g) {
          return reduce_scatter(x, ReduceScatterOptions().dim(dim).sizes(sizes_of(g.size())), g);
        },
        [dim, sizes_of](const std::vector<at::Tensor>& xs, int r, int n) {
          return sum_of(xs).split_with_sizes(sizes_of(n), dim)[r];
        });
  }
}

// ~~~ broadcast / reduce / scatter / gather ~~~

TEST_P(Collectives, Broadcast) {
  const int n = GetParam();
  for (int src : {0, n - 1}) {
    SCOPED_TRACE(c10::str("src ", src));
    check_op(
        n, kAnyShapes, [src](const at::Tensor& x, Group& g) { return broadcast(x, BroadcastOptions().src(src), g); },
        [src](const std::vector<at::Tensor>& xs, int, int) { return xs[src] * 1; }, replicated());
  }
}

TEST_P(Collectives, Reduce) {
  const int n = GetParam();
  for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
    const int dst = n - 1;
    SCOPED_TRACE(c10::str(op, " dst ", dst));
    check_op(
        n, {fixed({4, 3}), fixed({0})},
        [dst, op](const at::Tensor& x, Group& g) { return reduce(x, ReduceOptions().dst(dst).op(op), g); },
        [dst, op](const std::vector<at::Tensor>& xs, int r, int n) {
          if (r != dst) return at::zeros_like(xs[0]);
          return op == ReduceOp::kAvg ? sum_of(xs) / n : sum_of(xs);
        });
  }
}

TEST_P(Collectives, ScatterGather) {
  const int n = GetParam();
  const int root = n / 2;
  for (int64_t dim : {0, 1}) {
    SCOPED_TRACE(c10::str("root ", root, " dim ", dim));
    ShapeOf full = [dim](int, int n) {
      Shape s{3, 5};
      s[dim] = 3 * n;
      return s;
    };
    check_op(
        n, {full},
        [root, dim](const at::Tensor& x, Group& g) { return scatter(x, ScatterOptions().src(root).dim(dim), g); },
        [root, dim](const std::vector<at::Tensor>& xs, int r, int n) { return xs[root].chunk(n, dim)[r]; });
    check_op(
        n, {fixed({3, 5}), fixed({0, 2})},
        [root, dim](const at::Tensor& x, Group& g) { return gather(x, GatherOptions().dst(root).dim(dim), g); },
        [root, dim](const std::vector<at::Tensor>& xs, int r, int) {
          auto full = at::cat(xs, dim);
          return r == root ? full : at::zeros_like(full);
        });
  }
}

// ~~~ all_to_all ~~~

TEST_P(Collectives, AllToAllEqual) {
  for (int64_t dim : {0, 1}) {
    SCOPED_TRACE(c10::str("dim ", dim));
    ShapeOf shape = [dim](int, int n) {
      Shape s{3, 5};
      s[dim] = 2 * n;
      return s;
    };
    check_op(
        GetParam(),
        {shape,
         [](int, int n) {
           return Shape{0, 2 * n};
         }},
        [dim](const at::Tensor& x, Group& g) { return all_to_all(x, AllToAllOptions().dim(dim), g); },
        [dim](const std::vector<at::Tensor>& xs, int r, int n) {
          std::vector<at::Tensor> parts;
          for (int s = 0; s < n; ++s) parts.push_back(xs[s].chunk(n, dim)[r]);
          return at::cat(parts, dim);
        });
  }
}

// Rank s sends (s + 2 * r) % 3 rows to rank r (zeros included).
int64_t split(int s, int r) { return (s + 2 * r) % 3; }

TEST_P(Collectives, AllToAllSplits) {
  for (bool give_output : {true, false}) {
    for (int64_t dim : {0, 1}) {
      SCOPED_TRACE(c10::str("dim ", dim, give_output ? " both splits" : " input splits only"));
      ShapeOf shape = [dim](int s, int n) {
        Shape sh{2, 3};
        sh[dim] = 0;
        for (int r = 0; r < n; ++r) sh[dim] += split(s, r);
        return sh;
      };
      check_op(
          GetParam(), {shape},
          [dim, give_output](const at::Tensor& x, Group& g) {
            std::vector<int64_t> in, out;
            for (int r = 0; r < g.size(); ++r) {
              in.push_back(split(g.rank(), r));
              out.push_back(split(r, g.rank()));
            }
            auto o = AllToAllOptions().dim(dim).input_splits(in);
            if (give_output) o.output_splits(out);
            return all_to_all(x, o, g);
          },
          [dim](const std::vector<at::Tensor>& xs, int r, int n) {
            std::vector<at::Tensor> parts;
            for (int s = 0; s < n; ++s) {
              std::vector<int64_t> splits;
              for (int t = 0; t < n; ++t) splits.push_back(split(s, t));
              parts.push_back(xs[s].split_with_sizes(splits, dim)[r]);
            }
            return at::cat(parts, dim);
          });
    }
  }
}

// ~~~ chains, sub-groups, async ~~~

TEST_P(Collectives, Chains) {
  // all_gather then reduce_scatter; all_to_all twice; all_reduce of a broadcast.
  check_op(
      GetParam(), {fixed({2, 3})},
      [](const at::Tensor& x, Group& g) {
        auto a = all_gather(x, AllGatherOptions().dim(1), g);
        return reduce_scatter(a * a, ReduceScatterOptions().dim(1), g);
      },
      [](const std::vector<at::Tensor>& xs, int r, int n) {
        // every rank contributes the same a * a
        return (at::cat(xs, 1).pow(2) * n).chunk(n, 1)[r];
      });
  check_op(
      GetParam(), {[](int, int n) {
        return Shape{2 * n, 3};
      }},
      [](const at::Tensor& x, Group& g) { return all_to_all(all_to_all(x, {}, g).sin(), {}, g); },
      [](const std::vector<at::Tensor>& xs, int r, int n) {
        std::vector<at::Tensor> first(n);
        for (int t = 0; t < n; ++t) {
          std::vector<at::Tensor> parts;
          for (int s = 0; s < n; ++s) parts.push_back(xs[s].chunk(n, 0)[t]);
          first[t] = at::cat(parts, 0).sin();
        }
        std::vector<at::Tensor> parts;
        for (int s = 0; s < n; ++s) parts.push_back(first[s].chunk(n, 0)[r]);
        return at::cat(parts, 0);
      });
}

TEST_P(Collectives, SubGroups) {
  // Ranks split into evens and odds (of different sizes when n is odd); each
  // half all-gathers within itself, then the world all-reduces a reduction
  // of that.
  const int n = GetParam();
  auto members = [n](int parity) {
    std::vector<int> m;
    for (int s = parity; s < n; s += 2) m.push_back(s);
    return m;
  };
  testing::spawn_ranks(n, [&](Group& world) {
    auto evens = new_group(members(0), NewGroupOptions().name("evens"));
    auto odds = n > 1 ? new_group(members(1), NewGroupOptions().name("odds")) : Group();
    auto& mine = world.rank() % 2 == 0 ? evens : odds;
    ASSERT_TRUE(mine.is_member());
    auto build = [&](int r) {
      auto gen = generator(99, r, 0);
      return at::randn({2, 3}, gen, at::kDouble).requires_grad_(true);
    };
    auto x = build(world.rank());
    auto y = all_reduce(all_gather(x, {}, mine).sin().sum(0), {}, world);
    objective(y, 5, world.rank()).backward();

    // Reference.
    std::vector<at::Tensor> xs;
    for (int s = 0; s < n; ++s) xs.push_back(build(s));
    auto half = [&](int parity) {
      std::vector<at::Tensor> parts;
      for (int s : members(parity)) parts.push_back(xs[s]);
      return at::cat(parts, 0).sin().sum(0);
    };
    at::Tensor summed;
    for (int s = 0; s < n; ++s) summed = summed.defined() ? summed + half(s % 2) : half(s % 2);
    at::Tensor total;
    for (int s = 0; s < n; ++s) {
      auto l = objective(summed, 5, s);
      total = total.defined() ? total + l : l;
    }
    total.backward();
    expect_close(y.detach(), summed.detach(), "forward");
    expect_close(x.grad(), xs[world.rank()].grad(), "gradient");
  });
}

TEST_P(Collectives, AsyncMatchesSync) {
  const int n = GetParam();
  testing::spawn_ranks(n, [&](Group& g) {
    auto gen = generator(7, g.rank(), 0);
    auto x = at::randn({2 * n, 3}, gen, at::kDouble).requires_grad_(true);
    auto x2 = x.detach().clone().requires_grad_(true);
    // Start three collectives, then wait in reverse order.
    auto a = all_reduce_async(x, AllReduceOptions().op(ReduceOp::kAvg), g);
    auto b = all_gather_async(x, AllGatherOptions().dim(1), g);
    auto c = reduce_scatter_async(x, {}, g);
    auto yc = c.wait(), yb = b.wait(), ya = a.wait();
    EXPECT_TRUE(c.is_completed());
    EXPECT_TRUE(at::equal(c.wait(), yc));  // wait() twice gives the same tensor
    (objective(ya, 1, g.rank()) + objective(yb, 2, g.rank()) + objective(yc, 3, g.rank())).backward();
    auto za = all_reduce(x2, AllReduceOptions().op(ReduceOp::kAvg), g);
    auto zb = all_gather(x2, AllGatherOptions().dim(1), g);
    auto zc = reduce_scatter(x2, {}, g);
    (objective(za, 1, g.rank()) + objective(zb, 2, g.rank()) + objective(zc, 3, g.rank())).backward();
    EXPECT_TRUE(at::equal(ya, za) && at::equal(yb, zb) && at::equal(yc, zc));
    EXPECT_TRUE(at::allclose(x.grad(), x2.grad(), 1e-12, 1e-12));
    barrier_async(g).wait();
  });
}

TEST_P(Collectives, SendRecvPipeline) {
  // A pipeline 0 -> 1 -> ... -> n-1: each stage multiplies by its weight and
  // sends on; the last stage's loss is sin(y).sum(). Gradients travel back.
  const int n = GetParam();
  if (n < 2) GTEST_SKIP() << "needs two ranks";
  testing::spawn_ranks(n, [&](Group& g) {
    const int r = g.rank();
    auto w = at::full({3}, 1.0 + r, at::kDouble).requires_grad_(true);
    at::Tensor x = r == 0 ? at::linspace(0.1, 0.3, 3, at::kDouble).requires_grad_(true)
                          : recv({3}, RecvOptions(r - 1).dtype(at::kDouble).requires_grad(true), g);
    auto y = x * w;
    if (r < n - 1) {
      auto token = send(y, SendOptions(r + 1), g);
      EXPECT_EQ(token.dim(), 0);
      token.backward();
    } else {
      at::sin(y).sum().backward();
    }
    // Reference: y_last = x0 * prod(w), dL/dw_r = cos(y_last) * x0 * prod_{s != r} w_s.
    double prod = 1;
    for (int s = 0; s < n; ++s) prod *= 1.0 + s;
    auto x0 = at::linspace(0.1, 0.3, 3, at::kDouble);
    auto want = at::cos(x0 * prod) * x0 * (prod / (1.0 + r));
    expect_close(w.grad(), want, "weight gradient");
  });
}

// Deferred gradients: an op's backward starts its gradient collective and
// the engine runs other ready work before waiting for it. Probe's node is
// created before the all_reduce, so a backward that waited on the spot
// would log "a.grad" (the all_reduce's gradient reaching a) first. Over shm,
// a collective below the transport's async_bytes (1 MiB) finishes on the
// call, so there is nothing to overlap and the op waits on the spot.
struct Probe : torch::autograd::Function<Probe> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, std::vector<std::string>* log) {
    ctx->saved_data["log"] = reinterpret_cast<int64_t>(log);
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    reinterpret_cast<std::vector<std::string>*>(ctx->saved_data["log"].toInt())->push_back("probe");
    return {grads[0], at::Tensor()};
  }
};

TEST(Overlap, BackwardRunsOtherReadyWorkWhileAGradientCollectiveIsInFlight) {
  testing::spawn_ranks(2, [](Group& g) {
    for (const int64_t numel : {int64_t{4}, int64_t{1} << 18})
      for (const char* op : {"all_reduce", "all_gather", "broadcast", "all_to_all"}) {
        SCOPED_TRACE(c10::str(op, " of ", numel, " floats over ", g.backend_name()));
        const bool finishes_on_call = g.backend_name() == "shm" && numel == 4;
        const auto order = finishes_on_call ? std::vector<std::string>{"a.grad", "probe"}
                                            : std::vector<std::string>{"probe", "a.grad"};
        std::vector<std::string> log;
        auto a = at::ones({numel}).requires_grad_(true);
        auto b = at::ones({numel}).requires_grad_(true);
        auto probed = Probe::apply(b, &log);
        at::Tensor y;
        if (std::string(op) == "all_reduce") y = all_reduce(a, {}, g);
        if (std::string(op) == "all_gather") y = all_gather(a, {}, g);
        if (std::string(op) == "broadcast") y = broadcast(a, BroadcastOptions().src(1), g);
        if (std::string(op) == "all_to_all") y = all_to_all(a, {}, g);
        a.register_hook([&log](const at::Tensor&) { log.push_back("a.grad"); });
        ((y * 2).sum() + probed.sum()).backward();
        EXPECT_EQ(log, order);
        EXPECT_TRUE(b.grad().equal(at::ones({numel})));
        // d(2y)/dy = 2 on every rank; all_to_all only routes it back, the others sum over the 2 ranks.
        double want = 4.0;
        if (std::string(op) == "all_to_all") want = 2.0;
        if (std::string(op) == "broadcast" && g.rank() != 1) want = 0.0;
        EXPECT_TRUE(a.grad().equal(at::full({numel}, want))) << a.grad();
      }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) { return c10::str("n", info.param); });

}  // namespace
}  // namespace commgrad::ops
