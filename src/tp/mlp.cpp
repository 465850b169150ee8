// ParallelMLP: ColumnParallelLinear -> GELU -> RowParallelLinear.
//
// The block adds no communication of its own: fc1 (column-parallel) leaves
// the hidden activation split across the group, fc2 (row-parallel, input
// already parallel) reduces it, so the block all-reduces once forward (fc2's
// "g") and once backward (fc1's input gradient, "f"), or, under sequence
// parallelism, all-gathers before fc1 and reduce-scatters after fc2.

#include "commgrad/tp/mlp.h"

#include "commgrad/tp/parallel_state.h"
#include "commgrad/tp/random.h"

#include <ATen/ATen.h>

namespace commgrad::tp {

// ~~~ ParallelMLP ~~~

ParallelMLPOptions::ParallelMLPOptions(int64_t hidden_size, int64_t ffn_hidden_size, Group group)
    : hidden_size_(hidden_size), ffn_hidden_size_(ffn_hidden_size), group_(std::move(group)) {}

ParallelMLPImpl::ParallelMLPImpl(ParallelMLPOptions options_) : options(std::move(options_)) { reset(); }

void ParallelMLPImpl::reset() {
  options.group(resolve_tp_group(options.group(), "ParallelMLP"));
  const Group& g = options.group();
  options.seed(resolve_seed(options.seed(), g));
  const uint64_t seed = *options.seed();
  fc1 = register_module(
      "fc1", ColumnParallelLinear(ColumnParallelLinearOptions(options.hidden_size(), options.ffn_hidden_size(), g)
                                      .bias(options.bias())
                                      .sequence_parallel(options.sequence_parallel())
                                      .seed(seed)));
  fc2 = register_module("fc2",
                        RowParallelLinear(RowParallelLinearOptions(options.ffn_hidden_size(), options.hidden_size(), g)
                                              .bias(options.bias())
                                              .input_is_parallel(true)
                                              .sequence_parallel(options.sequence_parallel())
                                              .seed(seed + 1)));
}

void ParallelMLPImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::tp::ParallelMLP(hidden=" << options.hidden_size() << ", ffn=" << options.ffn_hidden_size()
         << ", tp=" << options.group().size();
  if (!options.bias()) stream << ", bias=false";
  if (options.sequence_parallel()) stream << ", sequence_parallel=true";
  stream << ")";
}

at::Tensor ParallelMLPImpl::forward(const at::Tensor& input) { return fc2->forward(at::gelu(fc1->forward(input))); }

}  // namespace commgrad::tp
