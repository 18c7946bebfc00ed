// Device AdamW update of one parameter: the per-element arithmetic of the CPU op
// (src/cpu/ops_optim.cpp) operation for operation, so the GPU and CPU optimizers produce the
// same bits and their states (FP32 master weights, BF16 or FP32 moments) are interchangeable.
// AdamW (src/train/optimizer.cpp) calls it once per run of parameters adjacent in memory through
// Backend::adamw_step.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

// One element: w, m, v updated in place from g. bc1, bc2: 1 - beta^t in FP64.
// NOTES: every rounding of the CPU loop is spelled out (__fmul_rn, __dadd_rn, ...) so that nvcc
// does not contract it into an FMA; the host compiles that loop for baseline x86-64 (no FMA).
struct AdamWArgs {
  float b1, b2, eps, wd, lr, grad_scale;
  double bc1, bc2;
};
__device__ __forceinline__ void adamw_one(float& w, float g, float& m, float& v, const AdamWArgs& a) {
  const float gj = __fmul_rn(g, a.grad_scale);
  // m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
  m = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(1.0f - a.b1, gj));
  v = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(__fmul_rn(1.0f - a.b2, gj), gj));
  // update = (m / bc1) / (sqrt(v / bc2) + eps);  w -= lr * (update + wd * w), in FP64
  const double update =
      __ddiv_rn(__ddiv_rn(double(m), a.bc1), __dadd_rn(__dsqrt_rn(__ddiv_rn(double(v), a.bc2)), double(a.eps)));
  const double wj = w;
  w = __double2float_rn(__dsub_rn(wj, __dmul_rn(double(a.lr), __dadd_rn(update, __dmul_rn(double(a.wd), wj)))));
}

// The moments as stored: BF16 (kBf16) or FP32.
template <bool kBf16>
__device__ __forceinline__ float load_moment(const void* p, int64_t j) {
  if constexpr (kBf16) return bf16_to_f32(static_cast<const uint16_t*>(p)[j]);
  return static_cast<const float*>(p)[j];
}
template <bool kBf16>
__device__ __forceinline__ void store_moment(void* p, int64_t j, float x) {
  if constexpr (kBf16) {
    static_cast<uint16_t*>(p)[j] = f32_to_bf16(x);
  } else {
    static_cast<float*>(p)[j] = x;
  }
}

// w, g [n] f32; m, v [n] bf16 (kBf16) or f32; any alignment.
template <bool kBf16>
__global__ void adamw_kernel(float* __restrict__ w, const float* __restrict__ g, void* m, void* v, int64_t n,
                             AdamWArgs a) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
    float mj = load_moment<kBf16>(m, j), vj = load_moment<kBf16>(v, j), wj = w[j];
    adamw_one(wj, g[j], mj, vj, a);
    store_moment<kBf16>(m, j, mj);
    store_moment<kBf16>(v, j, vj);
    w[j] = wj;
  }
}

// Four elements per thread with vector loads and stores (w, g 16-byte aligned; m, v 8-byte for
// BF16, 16-byte for FP32): n4 groups of four. The same arithmetic as adamw_kernel per element.
// NOTES: one element per thread reaches about half the copy bandwidth (the FP64
// divisions and square root make each element's chain long); four independent chains per thread
// keep more loads in flight.
template <bool kBf16>
__global__ void adamw_vec4_kernel(float4* __restrict__ w, const float4* __restrict__ g, void* m, void* v, int64_t n4,
                                  AdamWArgs a) {
  using M4 = std::conditional_t<kBf16, ushort4, float4>;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n4; j += int64_t(gridDim.x) * blockDim.x) {
    float4 wj = w[j];
    const float4 gj = g[j];
    M4 mq = static_cast<const M4*>(m)[j], vq = static_cast<const M4*>(v)[j];
    float mf[4], vf[4];
    if constexpr (kBf16) {
      const uint16_t mu[4] = {mq.x, mq.y, mq.z, mq.w}, vu[4] = {vq.x, vq.y, vq.z, vq.w};
      for (int e = 0; e < 4; ++e) mf[e] = bf16_to_f32(mu[e]), vf[e] = bf16_to_f32(vu[e]);
    } else {
      mf[0] = mq.x, mf[1] = mq.y, mf[2] = mq.z, mf[3] = mq.w;
      vf[0] = vq.x, vf[1] = vq.y, vf[2] = vq.z, vf[3] = vq.w;
    }
    adamw_one(wj.x, gj.x, mf[0], vf[0], a);
    adamw_one(wj.y, gj.y, mf[1], vf[1], a);
    adamw_one(wj.z, gj.z, mf[2], vf[2], a);
    adamw_one(wj.w, gj.w, mf[3], vf[3], a);
    if constexpr (kBf16) {
      mq = make_ushort4(f32_to_bf16(mf[0]), f32_to_bf16(mf[1]), f32_to_bf16(mf[2]), f32_to_bf16(mf[3]));
      vq = make_ushort4(f32_to_bf16(vf[0]), f32_to_bf16(vf[1]), f32_to_bf16(vf[2]), f32_to_bf16(vf[3]));
    } else {
      mq = make_float4(mf[0], mf[1], mf[2], mf[3]);
      vq = make_float4(vf[0], vf[1], vf[2], vf[3]);
    }
    static_cast<M4*>(m)[j] = mq;
    static_cast<M4*>(v)[j] = vq;
    w[j] = wj;
  }
}

template <bool kBf16>
void launch_adamw(float* w, const float* g, void* m, void* v, int64_t n, const AdamWArgs& a, cudaStream_t stream) {
  constexpr int kThreads = 256;
  constexpr size_t mb = kBf16 ? 2 : 4;
  const auto aligned = [](const void* p, size_t b) { return reinterpret_cast<uintptr_t>(p) % b == 0; };
  int64_t done = 0;
  if (aligned(w, 16) && aligned(g, 16) && aligned(m, 4 * mb) && aligned(v, 4 * mb)) {
    const int64_t n4 = n / 4;
    if (n4 > 0) {
      adamw_vec4_kernel<kBf16><<<grid_for(n4, kThreads, 65536), kThreads, 0, stream>>>(
          reinterpret_cast<float4*>(w), reinterpret_cast<const float4*>(g), m, v, n4, a);
      FP8MOE_CUDA_CHECK_LAUNCH("adamw_vec4_kernel");
    }
    done = n4 * 4;
  }
  if (done < n) {
    adamw_kernel<kBf16><<<grid_for(n - done, kThreads, 65536), kThreads, 0, stream>>>(
        w + done, g + done, static_cast<char*>(m) + done * mb, static_cast<char*>(v) + done * mb, n - done, a);
    FP8MOE_CUDA_CHECK_LAUNCH("adamw_kernel");
  }
}

}  // namespace

void cuda_adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                     const Backend::AdamWStep& p, cudaStream_t stream) {
  check_f32(w, "adamw_step", "w", -1);
  check_f32(g, "adamw_step", "g", -1);
  const DType md = m.dtype == DType::bf16 ? DType::bf16 : DType::f32;
  check_dev(m, "adamw_step", "m", md, -1);
  check_dev(v, "adamw_step", "v", md, -1);
  const int64_t n = w.numel();
  FP8MOE_CHECK(g.numel() == n && m.numel() == n && v.numel() == n,
               "adamw_step: w " << w.str() << ", g " << g.str() << ", m " << m.str() << ", v " << v.str() << " differ in size");
  FP8MOE_CHECK(p.step >= 1, "adamw_step: step = " << p.step << " must be the 1-based update count");
  // The bias corrections exactly as the CPU op computes them (host std::pow).
  const double bc1 = 1.0 - std::pow(double(p.beta1), double(p.step));
  const double bc2 = 1.0 - std::pow(double(p.beta2), double(p.step));
  if (n == 0) return;
  const AdamWArgs a{p.beta1, p.beta2, p.eps, p.weight_decay, p.lr, p.grad_scale, bc1, bc2};
  if (md == DType::bf16)
    launch_adamw<true>(w.ptr<float>(), g.ptr<const float>(), m.data, v.data, n, a, stream);
  else
    launch_adamw<false>(w.ptr<float>(), g.ptr<const float>(), m.data, v.data, n, a, stream);
}

}  // namespace fp8moe::cuda
