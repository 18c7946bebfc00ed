// Device memory and kernels of the two-micro-batch layer steps (two_batch_device.hpp).
#include "serve/two_batch_device.hpp"

#include <cmath>

#include "cuda/kernel_api.hpp"
#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/swiglu_device.cuh"
#include "cuda/quant/quantize_device.cuh"

namespace fp8moe::serve::detail {

namespace {

constexpr float kE4m3Max = 448.0f;

// One warp per (row, 128-column tile), four columns a lane; whole warps return together.
__global__ void swiglu_quantize_rows_kernel(const float* __restrict__ g, const float* __restrict__ u, int64_t R,
                                            int64_t F, const int32_t* __restrict__ counts, int64_t rows_per_group,
                                            const int32_t* __restrict__ row_group, uint8_t* __restrict__ q,
                                            float* __restrict__ s, int64_t ld) {
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x % 32);
  const int64_t tiles = F / 128, row = warp / tiles, tile = warp % tiles;
  if (row >= R) return;
  if (row_group ? row_group[row] < 0 : row % rows_per_group >= counts[row / rows_per_group]) return;
  const int64_t c0 = row * F + tile * 128 + lane * 4;
  const float4 gv = *reinterpret_cast<const float4*>(g + c0), uv = *reinterpret_cast<const float4*>(u + c0);
  const float a[4] = {cuda::swiglu_value(gv.x, uv.x), cuda::swiglu_value(gv.y, uv.y), cuda::swiglu_value(gv.z, uv.z),
                      cuda::swiglu_value(gv.w, uv.w)};
  float amax = 0.0f;
  for (float v : a) amax = cuda::amax_nan(amax, v);
  amax = cuda::lanes_amax<32>(amax);
  const float sc = cuda::scale_of(amax, kE4m3Max, false);
  *reinterpret_cast<uint32_t*>(q + c0) = cuda::quantize4<false>(a, cuda::inv_scale(sc));
  if (lane == 0) s[tile * ld + row] = sc;
}

}  // namespace

QuantizedView QBuf::block_rows(int64_t r0, int64_t n) const {
  const int64_t sc = scale_shape(kind, rows, cols)[1];
  return {values.view(DType::e4m3, n, cols, r0), scales.view(DType::f32, (n + 127) / 128, sc, r0 / 128), kind};
}

QuantizedTensor QBuf::host() const {
  QuantizedTensor h = make_quantized_host(rows, cols, DType::e4m3, kind);
  FP8MOE_CUDA_CHECK(cudaMemcpy(h.values.ptr<uint8_t>(), values.p, size_t(rows * cols), cudaMemcpyDeviceToHost));
  FP8MOE_CUDA_CHECK(cudaMemcpy(h.scales.ptr<float>(), scales.p, size_t(h.scales.numel()) * 4, cudaMemcpyDeviceToHost));
  return h;
}

// In slices through one bf16 temporary, so that a large weight needs no large staging buffer.
std::unique_ptr<QBuf> random_weight(int64_t rows, int64_t cols, uint64_t seed) {
  auto w = std::make_unique<QBuf>(rows, cols, ScaleKind::block_128x128);
  const int64_t step = std::max<int64_t>(128, ((int64_t(64) << 20) / (cols * 2)) / 128 * 128);
  Buf tmp(size_t(std::min(step, rows) * cols) * 2);
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    const int64_t n = std::min(step, rows - r0);
    cuda::fill_normal_bf16(tmp.p, n * cols, seed * 1000003 + uint64_t(r0), float(1.0 / std::sqrt(double(cols))));
    cuda::quantize_128x128_cuda(tmp.view(DType::bf16, n, cols), w->block_rows(r0, n), ScaleMode::fp32, nullptr, false);
  }
  return w;
}

TwoBatchLayer::MoeInput moe_input_of(const QBuf& mq, const std::vector<int32_t>& idx, const std::vector<float>& w) {
  const int64_t T = mq.rows, D = mq.cols, G = D / 128, ld = scale_ld(T);
  TwoBatchLayer::MoeInput in;
  in.x = download<uint8_t>(mq.values.p, size_t(T * D));
  const std::vector<float> sc = download<float>(mq.scales.p, size_t(G * ld));
  in.scales.resize(size_t(T * G));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) in.scales[size_t(t * G + g)] = sc[size_t(g * ld + t)];
  in.idx = idx;
  in.w = w;
  return in;
}

void swiglu_quantize_rows(const float* g, const float* u, int64_t R, int64_t F, const int32_t* counts,
                          int64_t rows_per_group, const int32_t* row_group, uint8_t* q, float* s, cudaStream_t st) {
  const int64_t warps = R * (F / 128);
  if (warps == 0) return;
  swiglu_quantize_rows_kernel<<<unsigned((warps * 32 + 255) / 256), 256, 0, st>>>(g, u, R, F, counts, rows_per_group,
                                                                                 row_group, q, s, scale_ld(R));
  FP8MOE_CUDA_CHECK_LAUNCH("swiglu_quantize_rows_kernel");
}

}  // namespace fp8moe::serve::detail
