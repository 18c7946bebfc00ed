// Reference FP8 GEMM with per-128 scales and promotion, and its Tensor Core accumulation
// emulation. Contracts: include/fp8moe/gemm_ref.hpp.
#include "fp8moe/gemm_ref.hpp"

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
  const int64_t G = K / kQuantGroup;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      const float* ar = &av[size_t(m * K)];
      const float* br = &bv[size_t(n * K)];
      float acc = 0;
      if (!emulate) {
        for (int64_t g = 0; g < G; ++g) {
          // Eight partial sums: FP32 accumulation order close to a Tensor Core's, and fast.
          float part[8] = {};
          for (int64_t k = g * kQuantGroup; k < (g + 1) * kQuantGroup; k += 8)
            for (int j = 0; j < 8; ++j) part[j] += ar[k + j] * br[k + j];
          float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
          acc += sum * (a.scale_at(m, g * kQuantGroup) * b.scale_at(n, g * kQuantGroup));
        }
      } else {
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

}  // namespace fp8moe
