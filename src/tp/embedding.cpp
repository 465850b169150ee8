// VocabParallelEmbedding: an embedding table split by vocabulary rows.
//
// The vocabulary V is split into n contiguous ranges, rank r owning
// [r V/n, (r+1) V/n) (the same split as vocab_parallel_cross_entropy's
// logits). Every rank looks up every id in its own rows; ids it does not
// own read row 0 and are zeroed, and the sum over the group ("g",
// reduce_from_tp_region; reduce-scatter along the sequence under sequence
// parallelism) leaves each id with its owner's row. Backward needs no
// communication.

#include "commgrad/tp/embedding.h"

#include "detail/common.h"

#include "commgrad/tp/mappings.h"
#include "commgrad/tp/parallel_state.h"
#include "commgrad/tp/random.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace commgrad::tp {

at::Tensor init_embedding(int64_t num_embeddings, int64_t embedding_dim, uint64_t seed) {
  TORCH_CHECK(num_embeddings >= 1 && embedding_dim >= 1, "[commgrad] init_embedding: sizes must be positive, got ",
              num_embeddings, " x ", embedding_dim);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::empty({num_embeddings, embedding_dim}, at::kFloat).normal_(0.0, 1.0, gen);
}

VocabParallelEmbeddingOptions::VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim, Group group)
    : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim), group_(std::move(group)) {}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options_)
    : options(std::move(options_)) {
  reset();
}

void VocabParallelEmbeddingImpl::reset() {
  const char* op = "VocabParallelEmbedding";
  options.group(resolve_tp_group(options.group(), op));
  const Group& g = options.group();
  COMMGRAD_CHECK(options.num_embeddings() >= 1 && options.embedding_dim() >= 1, op, g, "num_embeddings (",
                 options.num_embeddings(), ") and embedding_dim (", options.embedding_dim(), ") must be positive");
  COMMGRAD_CHECK(options.num_embeddings() % g.size() == 0, op, g, "num_embeddings (", options.num_embeddings(),
                 ") is not divisible by the tensor-parallel size (", g.size(), "); pad the vocabulary");
  const int64_t local = options.num_embeddings() / g.size();
  vocab_start_ = g.rank() * local;
  vocab_end_ = vocab_start_ + local;
  weight = register_parameter("weight", at::empty({local, options.embedding_dim()}));
  set_shard_spec("weight", ShardSpec::partitioned(0), g);
  options.seed(resolve_seed(options.seed(), g));
  reset_parameters();
}

void VocabParallelEmbeddingImpl::reset_parameters() {
  const Group& g = options.group();
  auto full = init_embedding(options.num_embeddings(), options.embedding_dim(), options.seed().value());
  at::NoGradGuard no_grad;
  weight.copy_(shard_tensor(full, ShardSpec::partitioned(0), g.rank(), g.size()));
}

void VocabParallelEmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "commgrad::tp::VocabParallelEmbedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim() << ", tp=" << options.group().size();
  if (options.sequence_parallel()) stream << ", sequence_parallel=true";
  stream << ")";
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& ids) {
  const char* op = "VocabParallelEmbedding";
  const Group& g = options.group();
  const int64_t V = options.num_embeddings();
  COMMGRAD_CHECK(ids.defined(), op, g, "got undefined ids");
  COMMGRAD_CHECK(at::isIntegralType(ids.scalar_type(), /*includeBool=*/false), op, g,
                 "ids must be an integer tensor, got ", detail::describe(ids));
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>();
    const int64_t hi = ids.max().item<int64_t>();
    COMMGRAD_CHECK(lo >= 0 && hi < V, op, g, "ids must be in [0, ", V, "), got values in [", lo, ", ", hi, "]");
  }
  if (options.sequence_parallel()) {
    COMMGRAD_CHECK(ids.dim() >= 1 && ids.size(0) % g.size() == 0, op, g,
                   "with sequence_parallel dim 0 (the sequence) of ids ", detail::describe(ids),
                   " must be divisible by the tensor-parallel size ", g.size());
  }
  const at::Tensor long_ids = ids.to(at::kLong);
  at::Tensor out;
  if (g.size() == 1) {
    out = at::embedding(weight, long_ids);
  } else {
    const at::Tensor foreign = long_ids.lt(vocab_start_).logical_or_(long_ids.ge(vocab_end_));
    const at::Tensor local = (long_ids - vocab_start_).masked_fill_(foreign, 0);
    out = at::embedding(weight, local).masked_fill(foreign.unsqueeze(-1), 0);
  }
  return options.sequence_parallel() ? reduce_scatter_to_sequence_parallel_region(out, g)
                                     : reduce_from_tp_region(out, g);
}

}  // namespace commgrad::tp
