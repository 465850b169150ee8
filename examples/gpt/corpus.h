#pragma once
// The training data of the GPT example: a deterministic synthetic corpus,
// or the bytes of a text file. Batch k is a function of k alone, so every
// layout (and a resumed run) sees the same batches.

#include <torch/torch.h>

#include <string>
#include <utility>

namespace gpt {

class Corpus {
 public:
  /// Words of a small alphabet with a repeating structure (the loss falls
  /// within a few steps): row i of batch k is start_i * 5 + t * 3 +
  /// floor(t / 4) * 7 (mod vocab), with start_i drawn from a generator
  /// seeded with 7 + k.
  static Corpus synthetic(int64_t vocab);
  /// The bytes of a file (vocabulary 256); each row of a batch is a window
  /// at an offset drawn from a generator seeded with 7 + k. Errors when the
  /// file cannot be read or is shorter than two sequences.
  static Corpus from_file(const std::string& path, int64_t sequence);

  int64_t vocab() const { return vocab_; }
  /// "synthetic (vocabulary 64)" or "<path> (12345 bytes)".
  std::string describe() const;
  /// Batch `k`: inputs [rows, sequence] and targets (the next tokens).
  std::pair<torch::Tensor, torch::Tensor> batch(int k, int64_t rows, int64_t sequence) const;

 private:
  int64_t vocab_ = 0;
  std::string path_;
  torch::Tensor bytes_;  // int64, the file's bytes; undefined for the synthetic corpus
};

}  // namespace gpt
