// Inputs of the MLA decode attention tests (CPU op and CUDA kernels): a paged latent cache of one
// layer on the host in any of its three forms, filled with N(0, 1) latents and RoPE keys, each
// sequence's blocks scattered over the pool in a random order (non-contiguous tables), spare
// blocks of garbage in between; queries N(0, stddev).
#pragma once
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/codecs.hpp"
#include "testing.hpp"

namespace fp8moe::testing {

struct MlaCase {
  int64_t H, rkv, dr;
  std::vector<int64_t> lengths;  // one per sequence (B = lengths.size())
  DType cache;                   // f32, bf16 or e4m3 (the FP8 form)
  float q_stddev = 1.0f;
  int64_t B() const { return int64_t(lengths.size()); }
  double scale() const { return 1.0 / std::sqrt(double(rkv / 4 + dr)); }  // softmax scale: logits of O(1)
  std::string str() const {
    std::string s = "H=" + std::to_string(H) + " rkv=" + std::to_string(rkv) + " dr=" + std::to_string(dr) +
                    " cache=" + std::string(dtype_name(cache)) + " lengths=";
    for (int64_t l : lengths) s += std::to_string(l) + ",";
    return s;
  }
};

// A case's inputs: made on the host (make_mla_inputs), or their copies on a device.
struct MlaInputs {
  Tensor q, table, lengths;        // [B * H, rkv + dr] f32, [B, max_blocks] i32, [B] i32
  Tensor rows, latent, scale, rope;
  MlaCacheView view() const {
    MlaCacheView v;
    v.rows = rows.view();
    v.latent = latent.view();
    v.scale = scale.view();
    v.rope = rope.view();
    return v;
  }
};

inline MlaInputs make_mla_inputs(std::mt19937_64& rng, const MlaCase& c) {
  const int64_t B = c.B(), W = c.rkv + c.dr, G = c.rkv / kQuantGroup;
  std::vector<int64_t> nb(static_cast<size_t>(B));
  int64_t used = 0, max_blocks = 1;
  for (int64_t b = 0; b < B; ++b) {
    nb[size_t(b)] = (c.lengths[size_t(b)] + kMlaBlockTokens - 1) / kMlaBlockTokens;
    used += nb[size_t(b)];
    max_blocks = std::max(max_blocks, nb[size_t(b)]);
  }
  const int64_t blocks = used + used / 3 + 2, slots = blocks * kMlaBlockTokens;
  std::vector<int32_t> order(static_cast<size_t>(blocks));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  MlaInputs in;
  in.q = random_normal(rng, DType::f32, {B * c.H, W}, c.q_stddev);
  in.table = Tensor::host(DType::i32, {B, max_blocks});
  in.lengths = Tensor::host(DType::i32, {B});
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    in.lengths.ptr<int32_t>()[b] = int32_t(c.lengths[size_t(b)]);
    for (int64_t j = 0; j < max_blocks; ++j)  // entries past the sequence's blocks: -1, never read
      in.table.ptr<int32_t>()[b * max_blocks + j] = j < nb[size_t(b)] ? order[size_t(next++)] : -1;
  }
  const Tensor x = random_normal(rng, DType::f32, {slots, W});  // every slot, the spare ones too
  const float* xv = x.ptr<float>();
  if (c.cache == DType::f32) {
    in.rows = x;
  } else if (c.cache == DType::bf16) {
    in.rows = Tensor::host(DType::bf16, {slots, W});
    for (int64_t i = 0; i < slots * W; ++i) in.rows.ptr<uint16_t>()[i] = bf16_encode(xv[i]);
  } else {
    in.latent = Tensor::host(DType::e4m3, {slots, c.rkv});
    in.scale = Tensor::host(DType::f32, {slots, G});
    in.rope = Tensor::host(DType::bf16, {slots, c.dr});
    for (int64_t s = 0; s < slots; ++s) {
      for (int64_t g = 0; g < G; ++g) {
        float amax = 0;
        for (int64_t i = 0; i < kQuantGroup; ++i) amax = std::max(amax, std::fabs(xv[s * W + g * kQuantGroup + i]));
        const float sc = amax > 0 ? amax / 448.0f : 1.0f;
        in.scale.ptr<float>()[s * G + g] = sc;
        for (int64_t i = 0; i < kQuantGroup; ++i)
          in.latent.ptr<uint8_t>()[s * c.rkv + g * kQuantGroup + i] = e4m3_encode(xv[s * W + g * kQuantGroup + i] / sc);
      }
      for (int64_t i = 0; i < c.dr; ++i) in.rope.ptr<uint16_t>()[s * c.dr + i] = bf16_encode(xv[s * W + c.rkv + i]);
    }
  }
  return in;
}

}  // namespace fp8moe::testing
