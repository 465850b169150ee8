#pragma once
// VocabParallelEmbedding: an embedding table whose rows (the vocabulary) are
// split across the tensor-parallel group.
//
// Rank r holds rows [r V/n, (r+1) V/n). Every rank looks up every id: ids
// outside its range are mapped to row 0 and their results zeroed, so after
// summing over the group (reduce_from_tp_region, "g") each id carries exactly
// the row of the rank that owns it. Backward needs no communication: the
// gradient of "g" is the identity and each rank accumulates the rows it owns.

#include "commgrad/dist/group.h"
#include "commgrad/tp/sharding.h"

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

namespace commgrad::tp {

/// The full embedding table [V, D] built from `seed` (N(0, 1), like
/// torch::nn::Embedding): what every VocabParallelEmbedding built from `seed`
/// holds a shard of.
///
/// Example:
///   torch::nn::Embedding ref(1000, 64);
///   torch::NoGradGuard no_grad;
///   ref->weight.copy_(tp::init_embedding(1000, 64, 3));
at::Tensor init_embedding(int64_t num_embeddings, int64_t embedding_dim, uint64_t seed);

/// Options of VocabParallelEmbedding.
///
/// Example:
///   tp::VocabParallelEmbeddingOptions(50304, 1024, tp_group).seed(3)
struct VocabParallelEmbeddingOptions {
  VocabParallelEmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim, Group group = Group());
  /// Full vocabulary size V (divisible by the TP size; pad the vocabulary).
  TORCH_ARG(int64_t, num_embeddings);
  /// Embedding width D.
  TORCH_ARG(int64_t, embedding_dim);
  /// Tensor-parallel group; empty: the current parallel state's.
  TORCH_ARG(Group, group);
  /// Reduce-scatter the result along dim 0 (ids are [s, b], sequence first)
  /// instead of all-reducing it: each rank gets its sequence chunk.
  TORCH_ARG(bool, sequence_parallel) = false;
  /// Seed of the full-table initialisation. Without one (the default) the
  /// layer draws a seed from LibTorch's default CPU generator, so two layers
  /// differ and torch::manual_seed() makes them reproducible; every rank of
  /// the group draws and takes group rank 0's draw (resolve_seed() in
  /// random.h: one broadcast), and options.seed() then holds it. With a seed
  /// nothing is drawn or communicated.
  TORCH_ARG(std::optional<uint64_t>, seed) = std::nullopt;
};

/// forward(ids): ids is an integer tensor [..] of global token ids in
/// [0, V), identical on every TP rank; the result is [.., D] (replicated), or
/// this rank's chunk of dim 0 under sequence parallelism.
///
/// Example:
///   tp::VocabParallelEmbedding emb(tp::VocabParallelEmbeddingOptions(50304, 1024, tp_group));
///   auto h = emb(tokens);   // [s, b, 1024]
class VocabParallelEmbeddingImpl : public torch::nn::Cloneable<VocabParallelEmbeddingImpl>, public ShardedModule {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit VocabParallelEmbeddingImpl(VocabParallelEmbeddingOptions options);

  void reset() override;
  /// Redraws the shard of the full initialisation from options.seed() (the
  /// seed given, or the one drawn when the layer was built: the same table).
  void reset_parameters();
  /// "commgrad::tp::VocabParallelEmbedding(num_embeddings=50304, embedding_dim=1024, tp=4)".
  void pretty_print(std::ostream& stream) const override;

  at::Tensor forward(const at::Tensor& ids);

  /// First vocabulary row held by this rank, and one past the last.
  int64_t vocab_start() const { return vocab_start_; }
  int64_t vocab_end() const { return vocab_end_; }

  /// The options, with the group and the seed resolved.
  VocabParallelEmbeddingOptions options;
  /// This rank's rows of the table, [V/n, D].
  at::Tensor weight;

 private:
  int64_t vocab_start_ = 0;
  int64_t vocab_end_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace commgrad::tp
