// The parameter EMA's fold on the device (Backend::ema_fold): averages kept beside the weights,
// one memory-bound pass of 12 bytes per weight for all the parameters in one launch. The
// arithmetic is the host fold's (src/train/ema.cpp), rounding for rounding.
#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int64_t kChunk = int64_t(1) << 16;  // elements per block: a table of ~N/64K entries

struct Chunk {  // one block's piece of one parameter
  float* avg;
  const float* x;
  int64_t n;
  int64_t vec;  // both pointers 16-byte aligned: float4 accesses
};
static_assert(sizeof(Chunk) == 2 * sizeof(void*) + 16, "no padding: DeviceTable compares entries as bytes");

// NOTES: __fmul_rn/__fadd_rn keep nvcc from contracting into an FMA; the host compiles its loop
// for baseline x86-64 (no FMA), so both round each product and the sum.
__device__ __forceinline__ float fold_one(float a, float x, float d, float w) {
  return __fadd_rn(__fmul_rn(d, a), __fmul_rn(w, x));
}

__global__ void __launch_bounds__(256) ema_fold_kernel(const Chunk* __restrict__ chunks, float d, float w) {
  const Chunk c = chunks[blockIdx.x];
  int64_t done = 0;
  if (c.vec) {
    const int64_t n4 = c.n / 4;
    auto* a4 = reinterpret_cast<float4*>(c.avg);
    const auto* x4 = reinterpret_cast<const float4*>(c.x);
    for (int64_t j = threadIdx.x; j < n4; j += blockDim.x) {
      float4 a = a4[j];
      const float4 v = x4[j];
      a.x = fold_one(a.x, v.x, d, w);
      a.y = fold_one(a.y, v.y, d, w);
      a.z = fold_one(a.z, v.z, d, w);
      a.w = fold_one(a.w, v.w, d, w);
      a4[j] = a;
    }
    done = n4 * 4;
  }
  for (int64_t j = done + threadIdx.x; j < c.n; j += blockDim.x) c.avg[j] = fold_one(c.avg[j], c.x[j], d, w);
}

}  // namespace

void cuda_ema_fold(const std::vector<TensorView>& averages, const std::vector<TensorView>& values, float decay,
                   DeviceTable& table, cudaStream_t stream) {
  FP8MOE_CHECK(averages.size() == values.size(),
               "ema_fold: " << averages.size() << " averages for " << values.size() << " values");
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < averages.size(); ++i) {
    const TensorView &a = averages[i], &v = values[i];
    FP8MOE_CHECK(a.dtype == DType::f32 && v.dtype == DType::f32 && a.is_contiguous() && v.is_contiguous() &&
                     a.numel() == v.numel(),
                 "ema_fold: average " << a.str() << " and value " << v.str()
                                      << " must be contiguous f32 tensors of one size");
    FP8MOE_CHECK(a.device == Device::cuda && v.device == Device::cuda,
                 "ema_fold: average " << a.str() << " and value " << v.str() << " must be on the device");
    auto* ap = static_cast<float*>(a.data);
    const auto* vp = static_cast<const float*>(v.data);
    const int64_t vec = (reinterpret_cast<uintptr_t>(ap) | reinterpret_cast<uintptr_t>(vp)) % 16 == 0;
    for (int64_t j = 0; j < a.numel(); j += kChunk) chunks.push_back({ap + j, vp + j, std::min(kChunk, a.numel() - j), vec});
  }
  FP8MOE_CHECK(chunks.size() < (size_t(1) << 31), "ema_fold: " << chunks.size() << " chunks exceed the grid");
  // The same tensors every step: the table is copied to the device once.
  const Chunk* dev = table.get(chunks);
  if (chunks.empty()) return;
  const float w = 1 - decay;  // as the host computes it
  ema_fold_kernel<<<unsigned(chunks.size()), 256, 0, stream>>>(dev, decay, w);
  FP8MOE_CUDA_CHECK_LAUNCH("ema_fold_kernel");
}

}  // namespace fp8moe::cuda
