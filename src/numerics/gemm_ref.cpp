// Reference FP8 GEMM with per-128 scales and promotion, and its Tensor Core accumulation
// emulation. Contracts: include/fp8moe/gemm_ref.hpp.
#include "fp8moe/gemm_ref.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "fp8moe/codecs.hpp"

namespace fp8moe {

namespace {

constexpr int kMmaK = 32;  // K of one FP8 WGMMA instruction

// Decodes the FP8 values of q [R, C] into floats (no scaling).
std::vector<float> decode_all(const QuantizedView& q) {
  std::vector<float> out(size_t(q.rows() * q.cols()));
  const int64_t n = int64_t(out.size());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = decode_value(q.values.dtype, q.values.data, i);
  return out;
}

// Scales by row and K group: [rows, K/128] f32, row-major.
std::vector<float> group_scales(const QuantizedView& q) {
  const int64_t R = q.rows(), G = q.cols() / kQuantGroup;
  std::vector<float> s(size_t(R * G));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) s[size_t(r * G + g)] = q.scale_at(r, g * kQuantGroup);
  return s;
}

constexpr int64_t kBlockM = 4, kBlockN = 16;

// D rows [m0, m0 + 4) x columns [n0, n0 + 16) of the FP32-promotion GEMM: per 128-wide K group an
// FP32 sum over k (products of decoded FP8 values are exact in FP32), times s_a * s_b, added to
// the FP32 accumulator. bt is B transposed: [K, N].
// NOTES: compiled for AVX-512, AVX2 and baseline x86-64 with run-time selection; the 4x16
// partial sums stay in vector registers through a group.
[[gnu::target_clones("avx512f", "avx2", "default")]]
void fp8_block(const float* av, const float* bt, const float* sa, const float* sb, int64_t M, int64_t N, int64_t K,
               int64_t m0, int64_t n0, float* out /* [4, 16] */) {
  const int64_t G = K / kQuantGroup;
  const int64_t rows = std::min(kBlockM, M - m0), cols = std::min(kBlockN, N - n0);
  float acc[kBlockM][kBlockN] = {};
  for (int64_t g = 0; g < G; ++g) {
    float c[kBlockM][kBlockN] = {};
    for (int64_t k = g * kQuantGroup; k < (g + 1) * kQuantGroup; ++k) {
      const float* br = bt + k * N + n0;
      float b[kBlockN];
      for (int64_t j = 0; j < kBlockN; ++j) b[j] = j < cols ? br[j] : 0.0f;
      for (int64_t r = 0; r < kBlockM; ++r) {
        const float a = r < rows ? av[(m0 + r) * K + k] : 0.0f;
#pragma GCC unroll 16
        for (int64_t j = 0; j < kBlockN; ++j) c[r][j] += a * b[j];
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) acc[r][j] += c[r][j] * (sa[(m0 + r) * G + g] * sb[(n0 + j) * G + g]);
  }
  for (int64_t r = 0; r < kBlockM; ++r)
    for (int64_t j = 0; j < kBlockN; ++j) out[r * kBlockN + j] = acc[r][j];
}

void gemm_fp8_fp32_accum(const float* av, const float* bv, const std::vector<float>& sa, const std::vector<float>& sb,
                         int64_t M, int64_t N, int64_t K, const TensorView& d, bool accumulate) {
  std::vector<float> bt(size_t(K * N));
#pragma omp parallel for schedule(static)
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) bt[size_t(k * N + n)] = bv[n * K + k];
  const int64_t MB = ceil_div(M, kBlockM), NB = ceil_div(N, kBlockN);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t nb = 0; nb < NB; ++nb)
    for (int64_t mb = 0; mb < MB; ++mb) {
      float out[kBlockM * kBlockN];
      fp8_block(av, bt.data(), sa.data(), sb.data(), M, N, K, mb * kBlockM, nb * kBlockN, out);
      for (int64_t r = 0; r < kBlockM && mb * kBlockM + r < M; ++r)
        for (int64_t j = 0; j < kBlockN && nb * kBlockN + j < N; ++j) {
          const int64_t i = (mb * kBlockM + r) * N + nb * kBlockN + j;
          store_float(d, i, accumulate ? d.ptr<float>()[i] + out[r * kBlockN + j] : out[r * kBlockN + j]);
        }
    }
}

}  // namespace

double tensor_core_accumulate(double acc, const double* products, int n, int bits) {
  int emax = INT32_MIN;
  auto upd = [&](double v) {
    if (v != 0) emax = std::max(emax, std::ilogb(v));
  };
  upd(acc);
  for (int i = 0; i < n; ++i) upd(products[i]);
  if (emax == INT32_MIN) return 0.0;
  const double quantum = std::ldexp(1.0, emax - (bits - 1));
  auto trunc_q = [&](double v) { return std::trunc(v / quantum) * quantum; };
  double sum = trunc_q(acc);
  for (int i = 0; i < n; ++i) sum += trunc_q(products[i]);
  return sum;
}

void gemm_fp8_ref(const QuantizedView& a, const QuantizedView& b, const TensorView& d, const GemmOptions& opt) {
  check_quantized(a, "a", ScaleKind::tile_1x128);
  check_quantized(b, "b", b.kind);
  FP8MOE_CHECK(a.values.device == Device::cpu && b.values.device == Device::cpu && d.device == Device::cpu,
               "gemm_fp8_ref: a, b and d must be host tensors");
  const int64_t M = a.rows(), K = a.cols(), N = b.rows();
  FP8MOE_CHECK(b.cols() == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.values.str());
  FP8MOE_CHECK(K % kQuantGroup == 0, "a: K = " << K << " is not a multiple of " << kQuantGroup
                                               << " (pad K with zeros)");
  check_tensor(d, "d", {DType::f32, DType::bf16}, 2);
  check_shape(d, "d", {M, N});
  FP8MOE_CHECK(!opt.accumulate || d.dtype == DType::f32, "d: accumulate needs an f32 output, got " << d.str());
  const AccumConfig& acc_cfg = opt.accum;
  const bool emulate = acc_cfg.mode == AccumMode::tensor_core;
  int64_t nc = acc_cfg.promote_every == 0 ? K : acc_cfg.promote_every;
  if (emulate) {
    FP8MOE_CHECK(acc_cfg.mantissa_bits >= 1 && acc_cfg.mantissa_bits <= 52,
                 "accum.mantissa_bits must be in [1, 52], got " << acc_cfg.mantissa_bits);
    FP8MOE_CHECK(acc_cfg.promote_every >= 0 && acc_cfg.promote_every % kMmaK == 0,
                 "accum.promote_every (N_c) must be 0 (never) or a positive multiple of 32, got "
                     << acc_cfg.promote_every);
  }
  // Products enter the Tensor Core sum pre-scaled when one promotion interval spans scale groups.
  const bool group_scaled_mma = emulate && (nc > kQuantGroup || kQuantGroup % nc != 0);

  const std::vector<float> av = decode_all(a), bv = decode_all(b);
  if (!emulate) {
    gemm_fp8_fp32_accum(av.data(), bv.data(), group_scales(a), group_scales(b), M, N, K, d, opt.accumulate);
    return;
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const float* ar = &av[size_t(m * K)];
      const float* br = &bv[size_t(n * K)];
      float acc = 0;
      double tc = 0;
      double products[kMmaK];
      for (int64_t k0 = 0; k0 < K; k0 += kMmaK) {
        const double s = double(a.scale_at(m, k0)) * double(b.scale_at(n, k0));
        for (int j = 0; j < kMmaK; ++j) {
          products[j] = double(ar[k0 + j]) * double(br[k0 + j]);
          if (group_scaled_mma) products[j] *= s;
        }
        tc = tensor_core_accumulate(tc, products, kMmaK, acc_cfg.mantissa_bits);
        const int64_t done = k0 + kMmaK;
        if (done % nc == 0 || done == K) {  // promotion to FP32 on CUDA cores
          acc += float(tc) * (group_scaled_mma ? 1.0f : float(s));
          tc = 0;
        }
      }
      const int64_t i = m * N + n;
      if (opt.accumulate) acc += d.ptr<float>()[i];
      store_float(d, i, acc);
    }
  }
}

void gemm_ref(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate) {
  check_tensor(a, "a", {DType::f32, DType::bf16}, 2);
  check_tensor(b, "b", {DType::f32, DType::bf16}, 2);
  check_tensor(d, "d", {DType::f32, DType::bf16}, 2);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  FP8MOE_CHECK(b.size(1) == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.str());
  check_shape(d, "d", {M, N});
  std::vector<float> av(size_t(M * K)), bv(size_t(N * K));
  for (int64_t i = 0; i < M * K; ++i) av[size_t(i)] = load_float(a, i);
  for (int64_t i = 0; i < N * K; ++i) bv[size_t(i)] = load_float(b, i);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += av[size_t(m * K + k)] * bv[size_t(n * K + k)];
      if (accumulate) acc += load_float(d, m * N + n);
      store_float(d, m * N + n, acc);
    }
}

std::vector<double> dequantized_product(const QuantizedView& a, const QuantizedView& b) {
  const int64_t M = a.rows(), N = b.rows(), K = a.cols();
  FP8MOE_CHECK(b.cols() == K, "dequantized_product: b must have K = " << K << " columns, got " << b.cols());
  Tensor da = Tensor::host(DType::f32, {M, K}), db = Tensor::host(DType::f32, {N, K});
  dequantize(a, da);
  dequantize(b, db);
  std::vector<double> out(size_t(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(da.ptr<float>()[m * K + k]) * db.ptr<float>()[n * K + k];
      out[size_t(m * N + n)] = s;
    }
  return out;
}

}  // namespace fp8moe
