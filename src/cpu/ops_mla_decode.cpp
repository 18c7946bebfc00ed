// The absorbed MLA decode attention over the paged latent cache (Backend::mla_decode_attention),
// the specification the CUDA kernels are tested against: per sequence and head, the scores of
// every cached token, their softmax and the weighted sum of the latents, all in FP64 from the
// stored values (bf16 and e4m3 x scale decoded exactly), rounded to f32 once at the end.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_ops.hpp"
#include "fp8moe/codecs.hpp"

namespace fp8moe::cpu {

void mla_decode_attention(const TensorView& q, const MlaCacheView& c, const TensorView& table,
                          const TensorView& lengths, double scale, const TensorView& o) {
  const MlaDecodeShape s = check_mla_decode(q, c, table, lengths, o, Device::cpu);
  const int64_t W = s.rkv + s.dr, G = s.rkv / kQuantGroup;
  const float* qp = q.ptr<const float>();
  const int32_t* tb = table.ptr<const int32_t>();
  const int32_t* len = lengths.ptr<const int32_t>();
  float* op = o.ptr<float>();
  // Row `slot` of the cache in FP64.
  std::vector<double> row(static_cast<size_t>(W));
  auto load = [&](int64_t slot) {
    if (s.cache == DType::f32) {
      const float* r = c.rows.ptr<const float>() + slot * W;
      for (int64_t i = 0; i < W; ++i) row[size_t(i)] = r[i];
    } else if (s.cache == DType::bf16) {
      const uint16_t* r = c.rows.ptr<const uint16_t>() + slot * W;
      for (int64_t i = 0; i < W; ++i) row[size_t(i)] = bf16_decode(r[i]);
    } else {
      const uint8_t* l = c.latent.ptr<const uint8_t>() + slot * s.rkv;
      const float* sc = c.scale.ptr<const float>() + slot * G;
      const uint16_t* r = c.rope.ptr<const uint16_t>() + slot * s.dr;
      for (int64_t i = 0; i < s.rkv; ++i) row[size_t(i)] = double(e4m3_decode(l[i])) * sc[i / kQuantGroup];
      for (int64_t i = 0; i < s.dr; ++i) row[size_t(s.rkv + i)] = bf16_decode(r[i]);
    }
  };
  std::vector<double> acc;
  std::vector<double> logits;
  std::vector<int64_t> slots;
  for (int64_t b = 0; b < s.B; ++b) {
    // The sequence's tokens that exist: inside its table and the cache (mla_decode.hpp).
    slots.clear();
    const int64_t n = std::min<int64_t>(std::max<int32_t>(len[b], 0), s.max_blocks * kMlaBlockTokens);
    for (int64_t p = 0; p < n; ++p) {
      const int64_t blk = tb[b * s.max_blocks + p / kMlaBlockTokens];
      if (blk >= 0 && (blk + 1) * kMlaBlockTokens <= s.slots) slots.push_back(blk * kMlaBlockTokens + p % kMlaBlockTokens);
    }
    const int64_t T = int64_t(slots.size());
    acc.assign(size_t(s.H * s.rkv), 0.0);
    logits.assign(size_t(s.H * T), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      load(slots[size_t(t)]);
      for (int64_t h = 0; h < s.H; ++h) {
        const float* qr = qp + (b * s.H + h) * W;
        double dot = 0;
        for (int64_t i = 0; i < W; ++i) dot += double(qr[i]) * row[size_t(i)];
        logits[size_t(h * T + t)] = dot * scale;
      }
    }
    for (int64_t h = 0; h < s.H; ++h) {
      double m = -std::numeric_limits<double>::infinity(), sum = 0;
      for (int64_t t = 0; t < T; ++t) m = std::max(m, logits[size_t(h * T + t)]);
      for (int64_t t = 0; t < T; ++t) {
        double& l = logits[size_t(h * T + t)];
        l = std::exp(l - m);
        sum += l;
      }
      for (int64_t t = 0; t < T; ++t) logits[size_t(h * T + t)] /= sum;
    }
    for (int64_t t = 0; t < T; ++t) {
      load(slots[size_t(t)]);
      for (int64_t h = 0; h < s.H; ++h) {
        const double p = logits[size_t(h * T + t)];
        double* a = acc.data() + h * s.rkv;
        for (int64_t i = 0; i < s.rkv; ++i) a[i] += p * row[size_t(i)];
      }
    }
    for (int64_t i = 0; i < s.H * s.rkv; ++i) op[b * s.H * s.rkv + i] = float(acc[size_t(i)]);
  }
}

}  // namespace fp8moe::cpu
