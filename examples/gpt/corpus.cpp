#include "corpus.h"

#include <fstream>
#include <iterator>
#include <stdexcept>
#include <vector>

namespace gpt {

Corpus Corpus::synthetic(int64_t vocab) {
  Corpus c;
  c.vocab_ = vocab;
  return c;
}

Corpus Corpus::from_file(const std::string& path, int64_t sequence) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument("--text " + path + ": cannot be read");
  std::vector<unsigned char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (static_cast<int64_t>(data.size()) < 2 * (sequence + 1)) {
    throw std::invalid_argument("--text " + path + ": " + std::to_string(data.size()) +
                                " bytes, fewer than two sequences of " + std::to_string(sequence + 1));
  }
  Corpus c;
  c.vocab_ = 256;
  c.path_ = path;
  c.bytes_ = torch::from_blob(data.data(), {static_cast<int64_t>(data.size())}, torch::kUInt8).to(torch::kLong);
  return c;
}

std::string Corpus::describe() const {
  if (!bytes_.defined()) return "synthetic (vocabulary " + std::to_string(vocab_) + ")";
  return path_ + " (" + std::to_string(bytes_.numel()) + " bytes)";
}

std::pair<torch::Tensor, torch::Tensor> Corpus::batch(int k, int64_t rows, int64_t sequence) const {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + k);
  torch::Tensor tokens;
  if (!bytes_.defined()) {
    auto start = at::randint(0, vocab_, {rows, 1}, gen);
    auto t = at::arange(sequence + 1).unsqueeze(0);
    tokens = (start * 5 + t * 3 + t.div(4, "floor") * 7).remainder(vocab_);
  } else {
    auto offsets = at::randint(0, bytes_.numel() - sequence, {rows, 1}, gen);
    tokens = bytes_.index({offsets + at::arange(sequence + 1).unsqueeze(0)});
  }
  return {tokens.narrow(1, 0, sequence).contiguous(), tokens.narrow(1, 1, sequence).contiguous()};
}

}  // namespace gpt
