// `fp8moe bench grouped` (bench.hpp): the grouped FP8 GEMMs of the MoE experts (moe_api.hpp)
// against a loop of cuBLASLt block-scaled GEMMs, one per expert, measured side by side.
//
//   contiguous  G experts, per-expert M = mean * U(0.7, 1.3), segments padded to 128 rows (padding
//               rows of A zero, as moe_permute_quantize writes them); D bf16 = A * B[g]^T.
//   masked      G groups x M_max rows, all valid (counts = M_max), D bf16; timed beside the
//               contiguous kernel on the same rows (G segments of M_max) for masked / contiguous.
//               --set decode: 8 or 32 groups of 32..128 tokens in buffers of M_max = 128.
//   wgrad       K-grouped Wgrad dW[g] += dY_g^T X_g over G experts x mean tokens (per-expert
//               tokens as above), D f32 accumulated.
// TFLOPS count the real rows (tokens), not the padding. The cuBLASLt loop runs each expert's
// 128-aligned slice from its own tensors (cuBLASLt takes no strided scale views), all GEMMs
// queued back to back and timed as a whole. The dense kernel on the same rows (one expert's
// weights; wgrad: all tokens into one dW) shows what the grouping costs. Timing as in bench.cpp: L2
// flushed before every timed run, median of `iters`, a case's kernels taking turns launch by
// launch. Correctness: sampled rows of 4 groups against FP64 host references
// (calc_diff vs the unquantized BF16 inputs, kerr vs the dequantized FP8 inputs, the latter rounded
// to bf16 for bf16 D), padding rows must be zero; vs_lt: calc_diff ours vs the cuBLASLt loop on
// all of D. FP8MOE_BENCH_TILES (see bench_util.hpp) times extra grouped tiles, D checked bit for
// bit against the chosen tile's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/bench_util.hpp"
#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/similarity.hpp"
#include "cuda/kernel_api.hpp"
#include "cuda/moe/moe_api.hpp"

namespace fp8moe::cuda {

using namespace bench;

namespace {

enum class Kind { contiguous, masked, wgrad };

const char* kind_name(Kind k) {
  return k == Kind::contiguous ? "contiguous" : k == Kind::masked ? "masked" : "wgrad";
}

struct GroupedCase {
  Kind kind;
  int64_t G, M;  // groups; rows (tokens) per group: the mean (contiguous, wgrad) or M_max (masked)
  int64_t N, K;  // D [rows, N] = A [rows, K] * B[g]^T; wgrad: dW[g] [N, K]
};

std::vector<GroupedCase> grouped_cases(const std::string& set) {
  const int64_t nk[2][2] = {{4096, 7168}, {7168, 2048}};
  std::vector<GroupedCase> v;
  const bool all = set == "all";
  if (all || set == "contiguous")
    for (const auto& gm : {std::pair<int64_t, int64_t>{4, 8192}, std::pair<int64_t, int64_t>{8, 4096},
                           std::pair<int64_t, int64_t>{32, 1024}})
      for (auto& p : nk) v.push_back({Kind::contiguous, gm.first, gm.second, p[0], p[1]});
  if (all || set == "masked")
    for (int64_t G : {1, 2, 4})
      for (int64_t Mmax : {256, 512, 1024})
        for (auto& p : nk) v.push_back({Kind::masked, G, Mmax, p[0], p[1]});
  // Decode (not in "all"): many experts with few tokens each, in masked buffers of M_max = the
  // count rounded up to 128.
  if (set == "decode")
    for (int64_t G : {8, 32})
      for (int64_t M : {32, 64, 128})
        for (auto& p : nk) v.push_back({Kind::masked, G, M, p[0], p[1]});
  if (all || set == "wgrad")
    for (int64_t G : {4, 8})
      for (auto& p : nk) v.push_back({Kind::wgrad, G, 4096, p[0], p[1]});
  FP8MOE_CHECK(!v.empty(), "bench grouped: unknown --set '" << set << "' (all | contiguous | masked | wgrad | decode)");
  return v;
}

// Expert segments of the contiguous layout: counts[g] real rows at offsets[g], padded to 128.
struct Segments {
  std::vector<int64_t> counts, offsets;
  int64_t rows() const { return offsets.back(); }
  int64_t real_rows() const {
    int64_t s = 0;
    for (int64_t c : counts) s += c;
    return s;
  }
};

Segments make_segments(std::mt19937_64& rng, int64_t G, int64_t mean, bool jitter) {
  Segments s;
  std::uniform_real_distribution<double> u(0.7, 1.3);
  s.offsets.push_back(0);
  for (int64_t g = 0; g < G; ++g) {
    s.counts.push_back(jitter ? std::llround(double(mean) * u(rng)) : mean);
    s.offsets.push_back(s.offsets.back() + (s.counts.back() + 127) / 128 * 128);
  }
  return s;
}

std::vector<int32_t> row_groups(const Segments& s) {
  std::vector<int32_t> rg(size_t(s.rows()), -1);
  for (size_t g = 0; g < s.counts.size(); ++g)
    for (int64_t r = 0; r < s.counts[g]; ++r) rg[size_t(s.offsets[g] + r)] = int32_t(g);
  return rg;
}

template <class T>
std::unique_ptr<DeviceBuffer> upload_i32(const std::vector<T>& v) {
  std::vector<int32_t> h(v.begin(), v.end());
  auto d = std::make_unique<DeviceBuffer>(h.size() * 4);
  FP8MOE_CUDA_CHECK(cudaMemcpy(d->p, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

// bf16 [rows, C] on the device, N(0, 1).
std::unique_ptr<DeviceBuffer> random_bf16(int64_t rows, int64_t C, uint64_t seed) {
  auto d = std::make_unique<DeviceBuffer>(size_t(rows * C) * 2);
  fill_normal_bf16(d->p, rows * C, seed);
  return d;
}

// bf16 [s.rows(), C] on the device, N(0, 1) on the rows of the experts, zero on the padding rows.
std::unique_ptr<DeviceBuffer> random_rows_bf16(const Segments& s, int64_t C, uint64_t seed) {
  auto d = random_bf16(s.rows(), C, seed);
  for (size_t g = 0; g < s.counts.size(); ++g) {
    const int64_t r0 = s.offsets[g] + s.counts[g], r1 = s.offsets[g + 1];
    if (r1 > r0)
      FP8MOE_CUDA_CHECK(cudaMemset(static_cast<char*>(d->p) + r0 * C * 2, 0, size_t((r1 - r0) * C) * 2));
  }
  return d;
}

std::vector<float> host_bf16_rows(const void* dev, int64_t row0, int64_t rows, int64_t C) {
  const auto h = to_host<uint16_t>(static_cast<const char*>(dev) + row0 * C * 2, size_t(rows * C));
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = bf16_bits_to_float(h[i]);
  return f;
}

std::vector<float> host_e4m3_rows(const void* dev, int64_t row0, int64_t rows, int64_t C) {
  const auto h = to_host<uint8_t>(static_cast<const char*>(dev) + row0 * C, size_t(rows * C));
  std::vector<float> f(h.size());
  for (size_t i = 0; i < h.size(); ++i) f[i] = e4m3_decode(h[i]);
  return f;
}

// The groups whose rows are checked: the first, two inner ones and the last.
std::vector<int64_t> checked_groups(int64_t G) {
  std::vector<int64_t> v{0, G / 3, (2 * G) / 3, G - 1};
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

struct Check {
  double cd = NAN, kerr = NAN;
  bool zeros_ok = true;  // padding rows / rows past a count exactly zero
};

// m-grouped (contiguous, masked): check_rows / 4 rows spread over each checked group's segment
// (padding rows included) of D [*, N] (bf16, `ours`) against A [*, K] * B[g]^T; rows past counts[g]
// must be zero.
Check check_m_grouped(const Segments& s, const std::vector<double>& ours, const DeviceBuffer& a16,
                      const DeviceQuantized& aq, const DeviceBuffer& b16, const DeviceQuantized& bq, int64_t N,
                      int64_t K, int check_rows) {
  const int64_t KB = K / 128, lda = aq.view.scales.size(1);
  const auto sa = to_host<float>(aq.scales.p, aq.scales.bytes / 4);
  std::vector<double> got, ref_unq, ref_deq;
  Check c;
  const int per_group = std::max(1, check_rows / 4);
  for (int64_t g : checked_groups(int64_t(s.counts.size()))) {
    const std::vector<float> bu = host_bf16_rows(b16.p, g * N, N, K), bd = host_e4m3_rows(bq.values.p, g * N, N, K);
    const auto sb = to_host<float>(static_cast<const float*>(bq.scales.p) + (g * N / 128) * KB, size_t(N / 128 * KB));
    const int64_t r0 = s.offsets[size_t(g)], rows = s.offsets[size_t(g) + 1] - r0;
    for (int i = 0; i < per_group && rows > 0; ++i) {
      const int64_t r = r0 + (per_group == 1 ? 0 : int64_t(i) * (rows - 1) / (per_group - 1));
      if (r - r0 >= s.counts[size_t(g)]) {  // padding row
        for (int64_t n = 0; n < N; ++n) c.zeros_ok = c.zeros_ok && ours[size_t(r * N + n)] == 0.0;
        continue;
      }
      const std::vector<float> au = host_bf16_rows(a16.p, r, 1, K), ad = host_e4m3_rows(aq.values.p, r, 1, K);
      std::vector<double> u(static_cast<size_t>(N)), d(static_cast<size_t>(N));
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        double su = 0, sd = 0;
        for (int64_t kb = 0; kb < KB; ++kb) {
          double gu = 0, gd = 0;
          for (int64_t k = kb * 128; k < (kb + 1) * 128; ++k) {
            gu += double(au[size_t(k)]) * double(bu[size_t(n * K + k)]);
            gd += double(ad[size_t(k)]) * double(bd[size_t(n * K + k)]);
          }
          su += gu;
          sd += gd * double(sa[size_t(kb * lda + r)]) * double(sb[size_t((n / 128) * KB + kb)]);
        }
        u[size_t(n)] = su;
        d[size_t(n)] = double(bf16_round(float(sd)));
      }
      for (int64_t n = 0; n < N; ++n) got.push_back(ours[size_t(r * N + n)]);
      ref_unq.insert(ref_unq.end(), u.begin(), u.end());
      ref_deq.insert(ref_deq.end(), d.begin(), d.end());
    }
  }
  c.cd = calc_diff(got, ref_unq);
  c.kerr = rel_error(got, ref_deq);
  return c;
}

// wgrad: check_rows / 4 rows n of dW[g] [N, K] (f32, `ours`) per checked group against the sum over
// the segment's tokens of dY[t, n] X[t, k]; dy16 [R, N], x16 [R, K] token-major, dyq [N, R], xq [K, R].
Check check_wgrad(const Segments& s, const std::vector<double>& ours, const DeviceBuffer& dy16, const DeviceBuffer& x16,
                  const DeviceQuantized& dyq, const DeviceQuantized& xq, int64_t N, int64_t K, int check_rows) {
  const int64_t R = s.rows(), ldn = dyq.view.scales.size(1), ldk = xq.view.scales.size(1);
  const auto sdy = to_host<float>(dyq.scales.p, dyq.scales.bytes / 4);
  const auto sx = to_host<float>(xq.scales.p, xq.scales.bytes / 4);
  std::vector<double> got, ref_unq, ref_deq;
  const int per_group = std::max(1, check_rows / 4);
  for (int64_t g : checked_groups(int64_t(s.counts.size()))) {
    const int64_t t0 = s.offsets[size_t(g)], T = s.offsets[size_t(g) + 1] - t0;
    // X of the segment, token-major [T, K]: the bf16 values and the e4m3 values of x_t [K, R].
    const std::vector<float> xu = host_bf16_rows(x16.p, t0, T, K);
    std::vector<uint8_t> xqh(size_t(K * T));
    FP8MOE_CUDA_CHECK(cudaMemcpy2D(xqh.data(), size_t(T), static_cast<const char*>(xq.values.p) + t0, size_t(R),
                                   size_t(T), size_t(K), cudaMemcpyDeviceToHost));
    std::vector<float> xd(size_t(T * K));
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t t = 0; t < T; ++t) xd[size_t(t * K + k)] = e4m3_decode(xqh[size_t(k * T + t)]);
    for (int i = 0; i < per_group; ++i) {
      const int64_t n = per_group == 1 ? 0 : int64_t(i) * (N - 1) / (per_group - 1);
      std::vector<uint16_t> dyc(static_cast<size_t>(T));  // dY[t0 .. t0 + T, n]
      FP8MOE_CUDA_CHECK(cudaMemcpy2D(dyc.data(), 2, static_cast<const char*>(dy16.p) + (t0 * N + n) * 2, size_t(N) * 2, 2,
                                     size_t(T), cudaMemcpyDeviceToHost));
      const std::vector<float> dyd = host_e4m3_rows(static_cast<const char*>(dyq.values.p) + n * R + t0, 0, 1, T);
      std::vector<double> u(static_cast<size_t>(K), 0.0), d(static_cast<size_t>(K), 0.0);
      // Chunks of 256 columns k, the tokens streamed in order (rows of xu / xd).
      constexpr int64_t kChunk = 256;
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const int64_t k1 = std::min(K, k0 + kChunk);
        double gd[kChunk];
        for (int64_t tb = 0; tb < T / 128; ++tb) {
          std::fill(gd, gd + kChunk, 0.0);
          for (int64_t t = tb * 128; t < (tb + 1) * 128; ++t) {
            const double au = bf16_bits_to_float(dyc[size_t(t)]), ad = dyd[size_t(t)];
            for (int64_t k = k0; k < k1; ++k) {
              u[size_t(k)] += au * double(xu[size_t(t * K + k)]);
              gd[k - k0] += ad * double(xd[size_t(t * K + k)]);
            }
          }
          const int64_t blk = t0 / 128 + tb;
          const double s_dy = sdy[size_t(blk * ldn + n)];
          for (int64_t k = k0; k < k1; ++k) d[size_t(k)] += gd[k - k0] * s_dy * double(sx[size_t(blk * ldk + k)]);
        }
      }
      for (int64_t k = 0; k < K; ++k) got.push_back(ours[size_t((g * N + n) * K + k)]);
      ref_unq.insert(ref_unq.end(), u.begin(), u.end());
      ref_deq.insert(ref_deq.end(), d.begin(), d.end());
    }
  }
  Check c;
  c.cd = calc_diff(got, ref_unq);
  c.kerr = rel_error(got, ref_deq);
  return c;
}

// One case's operands and launches: ours (optionally with a forced tile), the cuBLASLt loop, the
// dense kernel on the same rows (the grouping's cost), the contiguous kernel on the masked case's
// rows, and the correctness check of ours' D. The launches refer to the Problem itself: it is
// filled in place and never moved.
struct Problem {
  Segments seg;
  int64_t d_rows = 0, d_cols = 0;
  bool d_f32 = false, accumulate = false;
  double flops = 0;
  std::vector<std::unique_ptr<DeviceBuffer>> keep;         // operands
  std::vector<std::unique_ptr<DeviceQuantized>> keep_q;    // quantized operands (incl. per-expert copies)
  std::unique_ptr<DeviceBuffer> d_ours, d_lt, d_alt;
  std::function<void(const GemmTile*, void*)> ours;        // ours into the given D
  std::function<void()> lt;                                 // the cuBLASLt loop into d_lt
  std::function<void()> dense;                              // the dense kernel on all rows into d_alt
  std::function<void()> contiguous;                         // masked only: the contiguous kernel into d_alt
  std::function<Check(const std::vector<double>&)> check;  // ours' D (as doubles) -> check
  size_t d_bytes() const { return size_t(d_rows * d_cols) * (d_f32 ? 4 : 2); }
  Problem() = default;
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
};

DeviceQuantized& add_q(Problem& p, int64_t rows, int64_t cols, ScaleKind kind) {
  p.keep_q.push_back(std::make_unique<DeviceQuantized>(rows, cols, kind));
  return *p.keep_q.back();
}

// Per-expert copy of rows [r0, r0 + rows) of x16 [*, K] quantized 1x128 (same values and scales as
// in the whole tensor: 1x128 tiles lie within a row).
const QuantizedView& slice_1x128(Problem& p, const DeviceBuffer& x16, int64_t r0, int64_t rows, int64_t K) {
  DeviceQuantized& q = add_q(p, rows, K, ScaleKind::tile_1x128);
  quantize_1x128_cuda(dview(static_cast<char*>(x16.p) + r0 * K * 2, DType::bf16, rows, K), q.view, ScaleMode::fp32,
                      nullptr, false);
  return q.view;
}

// Rows [g*N, (g+1)*N) of the stacked 128x128-scaled B [G*N, K].
QuantizedView expert_weights(const DeviceQuantized& bq, int64_t g, int64_t N, int64_t K) {
  const int64_t KB = K / 128;
  return {dview(static_cast<char*>(bq.values.p) + g * N * K, DType::e4m3, N, K),
          dview(static_cast<float*>(bq.scales.p) + (g * N / 128) * KB, DType::f32, N / 128, KB), ScaleKind::block_128x128};
}

void make_m_grouped(Problem& p, const GroupedCase& gc, std::mt19937_64& rng, uint64_t seed, int check_rows) {
  const int64_t G = gc.G, N = gc.N, K = gc.K;
  const bool masked = gc.kind == Kind::masked;
  p.seg = make_segments(rng, G, gc.M, !masked);
  const int64_t R = p.seg.rows();
  p.d_rows = R;
  p.d_cols = N;
  p.flops = 2.0 * double(p.seg.real_rows()) * double(N) * double(K);
  p.keep.push_back(random_rows_bf16(p.seg, K, seed));
  const DeviceBuffer& a16 = *p.keep.back();
  p.keep.push_back(random_bf16(G * N, K, seed + 1));
  const DeviceBuffer& b16 = *p.keep.back();
  DeviceQuantized& aq = add_q(p, R, K, ScaleKind::tile_1x128);
  DeviceQuantized& bq = add_q(p, G * N, K, ScaleKind::block_128x128);
  quantize_1x128_cuda(dview(a16.p, DType::bf16, R, K), aq.view, ScaleMode::fp32, nullptr, false);
  quantize_128x128_cuda(dview(b16.p, DType::bf16, G * N, K), bq.view, ScaleMode::fp32, nullptr, false);
  p.keep.push_back(upload_i32(row_groups(p.seg)));
  const TensorView rg = TensorView(p.keep.back()->p, DType::i32, {R}, Device::cuda);
  p.keep.push_back(upload_i32(p.seg.counts));
  const TensorView counts = TensorView(p.keep.back()->p, DType::i32, {G}, Device::cuda);
  const QuantizedView a = aq.view, b = bq.view;
  if (masked) {
    p.ours = [=](const GemmTile* t, void* d) {
      grouped_gemm_fp8_masked_cuda(a, b, counts, G, dview(d, DType::bf16, R, N), false, nullptr, t);
    };
    p.contiguous = [=, &p] {
      grouped_gemm_fp8_contiguous_cuda(a, b, rg, G, dview(p.d_alt->p, DType::bf16, R, N), false, nullptr);
    };
  } else {
    p.ours = [=](const GemmTile* t, void* d) {
      grouped_gemm_fp8_contiguous_cuda(a, b, rg, G, dview(d, DType::bf16, R, N), false, nullptr, t);
    };
  }
  // Dense: all rows against expert 0's weights.
  const QuantizedView b0 = expert_weights(bq, 0, N, K);
  p.dense = [=, &p] { gemm_fp8_sm90(a, b0, dview(p.d_alt->p, DType::bf16, R, N), false, nullptr); };
  std::vector<std::pair<QuantizedView, QuantizedView>> per_expert;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = p.seg.offsets[size_t(g)], rows = p.seg.offsets[size_t(g) + 1] - r0;
    per_expert.push_back({slice_1x128(p, a16, r0, rows, K), expert_weights(bq, g, N, K)});
  }
  p.lt = [per_expert, &p, N] {
    for (size_t g = 0; g < per_expert.size(); ++g) {
      const auto& [ag, bg] = per_expert[g];
      if (ag.rows() == 0) continue;
      gemm_fp8_cublaslt(ag, bg, dview(static_cast<char*>(p.d_lt->p) + p.seg.offsets[g] * N * 2, DType::bf16, ag.rows(), N),
                        false, nullptr);
    }
  };
  p.check = [&p, &a16, &aq, &b16, &bq, N, K, check_rows](const std::vector<double>& ours) {
    return check_m_grouped(p.seg, ours, a16, aq, b16, bq, N, K, check_rows);
  };
}

void make_wgrad(Problem& p, const GroupedCase& gc, std::mt19937_64& rng, uint64_t seed, int check_rows) {
  const int64_t G = gc.G, N = gc.N, K = gc.K;
  p.seg = make_segments(rng, G, gc.M, true);
  const int64_t R = p.seg.rows();
  p.d_rows = G * N;
  p.d_cols = K;
  p.d_f32 = p.accumulate = true;
  p.flops = 2.0 * double(p.seg.real_rows()) * double(N) * double(K);
  p.keep.push_back(random_rows_bf16(p.seg, N, seed));
  const DeviceBuffer& dy16 = *p.keep.back();
  p.keep.push_back(random_rows_bf16(p.seg, K, seed + 1));
  const DeviceBuffer& x16 = *p.keep.back();
  DeviceQuantized& dyq = add_q(p, N, R, ScaleKind::tile_1x128);
  DeviceQuantized& xq = add_q(p, K, R, ScaleKind::tile_1x128);
  quantize_128x1_cuda(dview(dy16.p, DType::bf16, R, N), dyq.view, ScaleMode::fp32, nullptr, false);
  quantize_128x1_cuda(dview(x16.p, DType::bf16, R, K), xq.view, ScaleMode::fp32, nullptr, false);
  p.keep.push_back(upload_i32(p.seg.offsets));
  const TensorView off = TensorView(p.keep.back()->p, DType::i32, {G + 1}, Device::cuda);
  const QuantizedView dy = dyq.view, x = xq.view;
  p.ours = [=](const GemmTile* t, void* d) {
    grouped_wgrad_fp8_cuda(dy, x, off, dview(d, DType::f32, G * N, K), true, nullptr, t);
  };
  // Dense: all tokens into one dW.
  p.dense = [=, &p] { gemm_fp8_sm90(dy, x, dview(p.d_alt->p, DType::f32, N, K), true, nullptr); };
  // Per-expert dY_g^T [N, T_g] and X_g^T [K, T_g], quantized along the segment's tokens.
  std::vector<std::pair<QuantizedView, QuantizedView>> per_expert;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t t0 = p.seg.offsets[size_t(g)], T = p.seg.offsets[size_t(g) + 1] - t0;
    DeviceQuantized& dg = add_q(p, N, T, ScaleKind::tile_1x128);
    DeviceQuantized& xg = add_q(p, K, T, ScaleKind::tile_1x128);
    if (T > 0) {
      quantize_128x1_cuda(dview(static_cast<char*>(dy16.p) + t0 * N * 2, DType::bf16, T, N), dg.view, ScaleMode::fp32,
                          nullptr, false);
      quantize_128x1_cuda(dview(static_cast<char*>(x16.p) + t0 * K * 2, DType::bf16, T, K), xg.view, ScaleMode::fp32,
                          nullptr, false);
    }
    per_expert.push_back({dg.view, xg.view});
  }
  p.lt = [per_expert, &p, N, K] {
    for (size_t g = 0; g < per_expert.size(); ++g) {
      const auto& [dg, xg] = per_expert[g];
      if (dg.cols() == 0) continue;
      gemm_fp8_cublaslt(dg, xg, dview(static_cast<char*>(p.d_lt->p) + int64_t(g) * N * K * 4, DType::f32, N, K), true,
                        nullptr);
    }
  };
  p.check = [&p, &dy16, &x16, &dyq, &xq, N, K, check_rows](const std::vector<double>& ours) {
    return check_wgrad(p.seg, ours, dy16, x16, dyq, xq, N, K, check_rows);
  };
}

}  // namespace

int run_grouped_bench(const GroupedBenchOptions& opt) {
  const cudaDeviceProp& prop = device_props();
  FP8MOE_CHECK(sm90_available(), "bench grouped: needs a Hopper GPU (sm_90), found " << prop.name);
  const uint64_t seed = opt.seed ? opt.seed : (uint64_t(std::random_device{}()) << 32 | std::random_device{}());
  std::mt19937_64 rng(seed);
  std::printf("# fp8moe bench grouped on %s (%d SMs), seed %llu, median of %d (warm-up %d, L2 flushed)\n", prop.name,
              prop.multiProcessorCount, (unsigned long long)seed, opt.iters, opt.warmup);
  std::printf("# contiguous / masked: A 1x128 x B[g] 128x128 -> bf16; wgrad: dY^T 1x128 x X^T 1x128 -> f32, D += ...; "
              "M/group: mean rows (x U(0.7, 1.3)) or M_max (masked, all rows valid); rows: real rows (tokens)\n");
  std::printf("# cuBLASLt loop: one block-scaled FP8 GEMM per expert; dense us: our dense kernel on the same rows (one "
              "expert's weights; wgrad: all tokens into one dW); contig us: the contiguous kernel on the masked case's "
              "rows; calc_diff / kerr: sampled rows vs FP64 (unquantized / dequantized inputs); vs_lt: calc_diff ours vs "
              "the cuBLASLt loop\n");
  std::printf("| kind | G | M/group | rows | N | K | tile | ours us | ours TFLOPS | cuBLASLt-loop TFLOPS | ours/cuBLASLt | "
              "dense us | contig us | masked/contig | calc_diff | kerr | vs_lt |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);

  Timer timer;
  bool all_ok = true;
  const std::vector<GemmTile> extra = extra_tiles_from_env();
  std::map<Kind, std::vector<double>> vs_lt_ratio;
  std::map<Kind, std::vector<double>> ceil_vs_lt[2];  // --ceiling: loop time / ceiling time, [bare, promoted]
  timer.clocks = opt.ceiling;
  std::vector<double> masked_ratio;
  double min_vs_lt = INFINITY;
  int case_id = 0;
  for (const GroupedCase& gc : grouped_cases(opt.set)) {
    ++case_id;
    const uint64_t case_seed = seed + 16 * uint64_t(case_id);
    Problem p;
    if (gc.kind == Kind::wgrad) make_wgrad(p, gc, rng, case_seed, opt.check_rows);
    else make_m_grouped(p, gc, rng, case_seed, opt.check_rows);
    const size_t dbytes = p.d_bytes();
    p.d_ours = std::make_unique<DeviceBuffer>(dbytes);
    p.d_lt = std::make_unique<DeviceBuffer>(dbytes);
    p.d_alt = std::make_unique<DeviceBuffer>(dbytes);
    const bool wgrad = gc.kind == Kind::wgrad;
    const int64_t rows_all = wgrad ? gc.G * gc.N : p.seg.rows();
    // The m-grouped cases write bf16 D, the Wgrad f32.
    const GemmTile tile = wgrad ? grouped_gemm_tile(rows_all, gc.K, p.seg.rows() / gc.G, true, true)
                                : grouped_gemm_tile(rows_all, gc.N, gc.K, false, false,
                                                    gc.kind == Kind::contiguous ? gc.G : 0);
    // Correctness outputs start poisoned (NaN) when overwritten, zeroed when accumulated.
    const int fill = p.accumulate ? 0x00 : 0xFF;
    auto run_fresh = [&](const std::function<void()>& fn, void* d) {
      FP8MOE_CUDA_CHECK(cudaMemset(d, fill, dbytes));
      fn();
      FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
    };

    // One untimed run each names a failing side; then the kernels that ran take turns launch by
    // launch (Timer::interleaved), so that all are timed under the same clock.
    std::string err_ours, err_lt;
    double t_ours = NAN, t_lt = NAN, t_contig = NAN, t_dense = NAN;
    std::vector<std::function<void()>> fns;
    std::vector<std::pair<double*, double*>> dst;  // time, clock
    auto add = [&](std::function<void()> fn, double* t, std::string& err, double* ghz = nullptr) {
      try {
        fn();
        FP8MOE_CUDA_CHECK(cudaDeviceSynchronize());
        fns.push_back(std::move(fn));
        dst.push_back({t, ghz});
      } catch (const std::exception& e) {
        if (err.empty()) err = e.what();
      }
    };
    add([&] { p.ours(nullptr, p.d_ours->p); }, &t_ours, err_ours);
    if (err_ours.empty() && p.contiguous) add(p.contiguous, &t_contig, err_ours);
    if (err_ours.empty()) add(p.dense, &t_dense, err_ours);
    add(p.lt, &t_lt, err_lt);
    // --ceiling: the Tensor Cores' ceiling for the case's FLOPs, on its first two quantized operands.
    Ceilings ceilings(wgrad, p.flops);
    std::string err_ceil;
    if (opt.ceiling) {
      const auto launches = ceilings.launches(p.keep_q[0]->view, p.keep_q[1]->view);
      const auto results = ceilings.results();
      for (size_t i = 0; i < launches.size(); ++i) add(launches[i], &results[i]->us, err_ceil, &results[i]->ghz);
    }
    if (!fns.empty()) {
      const std::vector<Timing> t = timer.interleaved(fns, opt.warmup, opt.iters);
      for (size_t i = 0; i < t.size(); ++i) {
        *dst[i].first = t[i].us;
        if (dst[i].second) *dst[i].second = t[i].ghz;
      }
    }
    if (!err_ours.empty()) t_ours = NAN;

    Check c;
    double vs_lt = NAN;
    bool ok = err_ours.empty();
    std::vector<std::string> extra_rows;
    if (ok) {
      run_fresh([&] { p.ours(nullptr, p.d_ours->p); }, p.d_ours->p);
      const std::vector<double> ours = d_to_doubles(p.d_ours->p, p.d_rows, p.d_cols, p.d_f32);
      if (err_lt.empty()) {
        run_fresh(p.lt, p.d_lt->p);
        vs_lt = calc_diff(ours, d_to_doubles(p.d_lt->p, p.d_rows, p.d_cols, p.d_f32));
      }
      if (opt.check) {
        c = p.check(ours);
        ok = !has_nan(ours) && c.zeros_ok && c.cd < 1e-3 && c.kerr < (p.d_f32 ? 1e-3 : 2e-3);
      }
      if (p.contiguous) {  // the contiguous kernel on the masked rows: the same D
        run_fresh(p.contiguous, p.d_alt->p);
        ok = ok && to_host<uint8_t>(p.d_alt->p, dbytes) == to_host<uint8_t>(p.d_ours->p, dbytes);
      }
      // Extra tiles: timed, D bit for bit against the chosen tile's.
      const auto want = extra.empty() ? std::vector<uint8_t>{} : to_host<uint8_t>(p.d_ours->p, dbytes);
      for (const GemmTile& xt : extra) {
        if (!grouped_tile_ok(xt, wgrad, gc.kind == Kind::contiguous)) continue;
        double tx = NAN;
        bool same = false;
        try {
          run_fresh([&] { p.ours(&xt, p.d_alt->p); }, p.d_alt->p);
          same = to_host<uint8_t>(p.d_alt->p, dbytes) == want;
          tx = timer.median_us([&] { p.ours(&xt, p.d_alt->p); }, opt.warmup, opt.iters);
        } catch (const std::exception&) {
          continue;  // not compiled for this kind
        }
        char row[192];
        std::snprintf(row, sizeof row, "#   tile %s: %.1f us, %.0f TFLOPS, %.3fx the chosen tile, D %s",
                      tile_name(xt).c_str(), tx, p.flops / (tx * 1e-6) / 1e12, t_ours / tx,
                      same ? "bit-identical" : "DIFFERS");
        extra_rows.push_back(row);
        ok = ok && same;
      }
    }
    all_ok = all_ok && ok;

    auto tf = [&](double us) { return std::isnan(us) ? NAN : p.flops / (us * 1e-6) / 1e12; };
    const double ratio = t_lt / t_ours, mratio = t_ours / t_contig;
    if (std::isfinite(ratio)) {
      vs_lt_ratio[gc.kind].push_back(ratio);
      min_vs_lt = std::min(min_vs_lt, ratio);
    }
    if (std::isfinite(mratio)) masked_ratio.push_back(mratio);
    char contig_s[32] = "-", mratio_s[32] = "-";
    if (p.contiguous) {
      std::snprintf(contig_s, sizeof contig_s, "%.1f", t_contig);
      std::snprintf(mratio_s, sizeof mratio_s, "%.3f", mratio);
    }
    std::printf("| %s | %lld | %lld | %lld | %lld | %lld | %s | %.1f | %.0f | %.0f | %.3f | %.1f | %s | %s | %.2e | %.2e | %.2e |%s\n",
                kind_name(gc.kind), (long long)gc.G, (long long)gc.M, (long long)p.seg.real_rows(), (long long)gc.N,
                (long long)gc.K, tile_name(tile).c_str(), t_ours, tf(t_ours), tf(t_lt), ratio, t_dense, contig_s, mratio_s,
                c.cd, c.kerr, vs_lt, ok ? "" : " FAIL");
    for (const std::string& r : extra_rows) std::printf("%s\n", r.c_str());
    if (opt.ceiling && err_ceil.empty()) {
      std::printf("%s\n", ceilings.line(t_ours, t_lt, "the cuBLASLt loop").c_str());
      for (int k = 0; k < 2; ++k) ceil_vs_lt[k][gc.kind].push_back(t_lt / ceilings.us(k));
    }
    if (!err_ceil.empty()) std::printf("#   ceiling: %s\n", err_ceil.c_str());
    if (!c.zeros_ok) std::printf("#   padding rows of D not zero\n");
    if (!err_ours.empty()) std::printf("#   ours: %s\n", err_ours.c_str());
    if (!err_lt.empty()) std::printf("#   cuBLASLt: %s\n", err_lt.c_str());
    std::fflush(stdout);
  }
  std::printf("# geomean ours/cuBLASLt-loop: contiguous %.3f (%zu) | masked %.3f (%zu) | wgrad %.3f (%zu); "
              "lowest %.3f (target >= 1.3)\n",
              geomean(vs_lt_ratio[Kind::contiguous]), vs_lt_ratio[Kind::contiguous].size(),
              geomean(vs_lt_ratio[Kind::masked]), vs_lt_ratio[Kind::masked].size(), geomean(vs_lt_ratio[Kind::wgrad]),
              vs_lt_ratio[Kind::wgrad].size(), min_vs_lt);
  for (int k = 0; k < (opt.ceiling ? 2 : 0); ++k) {
    double lowest = INFINITY;
    for (const auto& [kind, v] : ceil_vs_lt[k])
      for (double r : v) lowest = std::min(lowest, r);
    std::printf("# geomean cuBLASLt-loop time / %s Tensor Core ceiling time (the most a kernel at that ceiling could be "
                "ahead of the loop): contiguous %.3f | masked %.3f | wgrad %.3f; lowest %.3f\n",
                k == 0 ? "bare" : "promoted", geomean(ceil_vs_lt[k][Kind::contiguous]),
                geomean(ceil_vs_lt[k][Kind::masked]), geomean(ceil_vs_lt[k][Kind::wgrad]), lowest);
  }
  if (!masked_ratio.empty())
    std::printf("# masked / contiguous time: geomean %.3f, worst %.3f (target <= 1.10)\n", geomean(masked_ratio),
                *std::max_element(masked_ratio.begin(), masked_ratio.end()));
  std::printf("# correctness: %s\n", all_ok ? "all passed" : "FAILURES (see FAIL rows)");
  return all_ok ? 0 : 1;
}

}  // namespace fp8moe::cuda
