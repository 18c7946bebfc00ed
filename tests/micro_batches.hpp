// Token and target micro-batches of a fixed seed for the pipeline tests: the same on every rank.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "fp8moe/config.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::testing {

// M micro-batches of [batch_size, seq_len] i32 on the host, tokens and targets below 256.
inline void seeded_micro_batches(const ModelConfig& cfg, int M, uint64_t seed, std::vector<Tensor>& tok,
                                 std::vector<Tensor>& tgt) {
  std::mt19937_64 rng(seed);
  for (int m = 0; m < M; ++m) {
    tok.push_back(Tensor::host(DType::i32, {cfg.batch_size, cfg.seq_len}));
    tgt.push_back(Tensor::host(DType::i32, {cfg.batch_size, cfg.seq_len}));
    for (int64_t i = 0; i < tok.back().numel(); ++i) tok.back().ptr<int32_t>()[i] = int32_t(rng() % 256);
    for (int64_t i = 0; i < tgt.back().numel(); ++i) tgt.back().ptr<int32_t>()[i] = int32_t(rng() % 256);
  }
}

}  // namespace fp8moe::testing
