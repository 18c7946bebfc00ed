// Device AdamW update of one parameter: the per-element arithmetic of the CPU op
// (src/cpu/ops_optim.cpp) operation for operation, so the GPU and CPU optimizers produce the
// same bits and their states (FP32 master weights, BF16 or FP32 moments) are interchangeable.
// AdamW (src/train/optimizer.cpp) updates all its runs of parameters adjacent in memory in one
// launch (Backend::adamw_steps: a block per 64K elements of a run); ZeRO-1 one launch per shard
// range (Backend::adamw_step).
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

// Four elements j*4 .. j*4+3 with vector loads and stores (w, g 16-byte aligned; m, v 8-byte for
// BF16, 16-byte for FP32). The same arithmetic as adamw_kernel per element.
template <bool kBf16>
__device__ __forceinline__ void adamw_four(float4* __restrict__ w, const float4* __restrict__ g, void* m, void* v,
                                           int64_t j, const AdamWArgs& a) {
  using M4 = std::conditional_t<kBf16, ushort4, float4>;
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

// One element j, any alignment.
template <bool kBf16>
__device__ __forceinline__ void adamw_at(float* __restrict__ w, const float* __restrict__ g, void* m, void* v, int64_t j,
                                         const AdamWArgs& a) {
  float mj = load_moment<kBf16>(m, j), vj = load_moment<kBf16>(v, j), wj = w[j];
  adamw_one(wj, g[j], mj, vj, a);
  store_moment<kBf16>(m, j, mj);
  store_moment<kBf16>(v, j, vj);
  w[j] = wj;
}

// w, g [n] f32; m, v [n] bf16 (kBf16) or f32; any alignment.
template <bool kBf16>
__global__ void adamw_kernel(float* __restrict__ w, const float* __restrict__ g, void* m, void* v, int64_t n,
                             AdamWArgs a) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x)
    adamw_at<kBf16>(w, g, m, v, j, a);
}

// n4 groups of four.
// NOTES: one element per thread reaches about half the copy bandwidth (the FP64
// divisions and square root make each element's chain long); four independent chains per thread
// keep more loads in flight.
template <bool kBf16>
__global__ void adamw_vec4_kernel(float4* __restrict__ w, const float4* __restrict__ g, void* m, void* v, int64_t n4,
                                  AdamWArgs a) {
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n4; j += int64_t(gridDim.x) * blockDim.x)
    adamw_four<kBf16>(w, g, m, v, j, a);
}

// adamw_steps: one block per chunk of one parameter, its weight decay in the chunk.
constexpr int64_t kChunk = int64_t(1) << 16;
struct Chunk {
  float* w;
  const float* g;
  void* m;
  void* v;
  int64_t n;
  float weight_decay;
  int vec;  // the pointers aligned for adamw_four
};
static_assert(sizeof(Chunk) == 4 * sizeof(void*) + 16, "no padding: DeviceTable compares entries as bytes");
template <bool kBf16>
__global__ void __launch_bounds__(256) adamw_chunks_kernel(const Chunk* __restrict__ chunks, AdamWArgs a) {
  const Chunk c = chunks[blockIdx.x];
  a.wd = c.weight_decay;
  int64_t done = 0;
  if (c.vec) {
    const int64_t n4 = c.n / 4;
    for (int64_t j = threadIdx.x; j < n4; j += blockDim.x)
      adamw_four<kBf16>(reinterpret_cast<float4*>(c.w), reinterpret_cast<const float4*>(c.g), c.m, c.v, j, a);
    done = n4 * 4;
  }
  for (int64_t j = done + threadIdx.x; j < c.n; j += blockDim.x) adamw_at<kBf16>(c.w, c.g, c.m, c.v, j, a);
}

bool vec_aligned(const void* w, const void* g, const void* m, const void* v, bool bf16) {
  const size_t mb = bf16 ? 2 : 4;
  const auto aligned = [](const void* p, size_t b) { return reinterpret_cast<uintptr_t>(p) % b == 0; };
  return aligned(w, 16) && aligned(g, 16) && aligned(m, 4 * mb) && aligned(v, 4 * mb);
}

template <bool kBf16>
void launch_adamw(float* w, const float* g, void* m, void* v, int64_t n, const AdamWArgs& a, cudaStream_t stream) {
  constexpr int kThreads = 256;
  constexpr size_t mb = kBf16 ? 2 : 4;
  int64_t done = 0;
  if (vec_aligned(w, g, m, v, kBf16)) {
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

// The arguments' checks and the kernels' constants of one update; the moments' dtype.
DType check_adamw(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                  const Backend::AdamWStep& p, float weight_decay, AdamWArgs& a) {
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
  a = {p.beta1, p.beta2, p.eps, weight_decay, p.lr, p.grad_scale, bc1, bc2};
  return md;
}

}  // namespace

void cuda_adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                     const Backend::AdamWStep& p, cudaStream_t stream) {
  AdamWArgs a;
  const DType md = check_adamw(w, g, m, v, p, p.weight_decay, a);
  const int64_t n = w.numel();
  if (n == 0) return;
  if (md == DType::bf16)
    launch_adamw<true>(w.ptr<float>(), g.ptr<const float>(), m.data, v.data, n, a, stream);
  else
    launch_adamw<false>(w.ptr<float>(), g.ptr<const float>(), m.data, v.data, n, a, stream);
}

void cuda_adamw_steps(const std::vector<Backend::AdamWTensors>& ts, const Backend::AdamWStep& p, DeviceTable& table,
                      cudaStream_t stream) {
  std::vector<Chunk> chunks;
  AdamWArgs a{};
  DType md = DType::bf16;
  for (size_t i = 0; i < ts.size(); ++i) {
    const Backend::AdamWTensors& t = ts[i];
    const DType d = check_adamw(t.w, t.g, t.m, t.v, p, t.weight_decay, a);
    FP8MOE_CHECK(i == 0 || d == md, "adamw_steps: the moments of parameter " << i << " are " << dtype_name(d)
                                                                            << ", those before " << dtype_name(md));
    md = d;
    const size_t mb = d == DType::bf16 ? 2 : 4;
    const int vec = vec_aligned(t.w.data, t.g.data, t.m.data, t.v.data, d == DType::bf16);
    for (int64_t j = 0; j < t.w.numel(); j += kChunk)
      chunks.push_back({t.w.ptr<float>() + j, t.g.ptr<const float>() + j, static_cast<char*>(t.m.data) + j * mb,
                        static_cast<char*>(t.v.data) + j * mb, std::min(kChunk, t.w.numel() - j), t.weight_decay, vec});
  }
  FP8MOE_CHECK(chunks.size() < (size_t(1) << 31), "adamw_steps: " << chunks.size() << " chunks exceed the grid");
  // The same tensors every step: the table is copied to the device once (lr, the gradient's scale
  // and the bias corrections, which change, are the launch's arguments).
  const Chunk* dev = table.get(chunks);
  if (chunks.empty()) return;
  if (md == DType::bf16)
    adamw_chunks_kernel<true><<<unsigned(chunks.size()), 256, 0, stream>>>(dev, a);
  else
    adamw_chunks_kernel<false><<<unsigned(chunks.size()), 256, 0, stream>>>(dev, a);
  FP8MOE_CUDA_CHECK_LAUNCH("adamw_chunks_kernel");
}

}  // namespace fp8moe::cuda
