// Host side of the sm_90a FP8 block-scaled GEMM (kernel: kernels/sm90_fp8_gemm.cuh): argument
// checks and tile choice (gemm_heuristics.hpp); tensor maps and the launch are in gemm_launch.cuh.
//
//   D [M, N] = A [M, K] * B [N, K]^T (+ D)
//   A [M, K] e4m3 row-major, scales [K/128, ld(M)] f32 M-major (1x128)
//   B [N, K] e4m3 row-major, scales [ceil(N/128), K/128] f32 (128x128) or [K/128, ld(N)] (1x128)
//   D [M, N] bf16 | f32 row-major (row stride may exceed N)
//
// K slices (GemmTile::split_k = S, dense 1d2d 64x64): the kernel (Grouping::split_k) writes each
// slice's partial product to an FP32 workspace [S * M, N] (stream-ordered allocation), and
// sum_slices_kernel adds the slices in slice order into D: deterministic, like the unsplit kernel.
// Last-wave K slices (GemmTile::tail_split = S, 128x128/pipe and 192x128): gemm_tail_split.
#include <type_traits>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/gemm/gemm_launch.cuh"
#include "cuda/kernel_api.hpp"

namespace fp8moe::cuda {

namespace {

// D [M, N] (row stride ldd) = (accumulate: D +) w[0] + w[1] + ... + w[S - 1], w [S, M, N] f32.
template <class Tout>
__global__ void __launch_bounds__(256) sum_slices_kernel(const float* __restrict__ w, int S, int64_t M, int64_t N,
                                                         Tout* __restrict__ d, int64_t ldd, bool accumulate) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= N) return;
  for (int64_t r = blockIdx.y; r < M; r += gridDim.y) {
    float sum = w[r * N + c];
    for (int k = 1; k < S; ++k) sum += w[(k * M + r) * N + c];
    Tout* p = d + r * ldd + c;
    if constexpr (std::is_same_v<Tout, float>) *p = accumulate ? *p + sum : sum;
    else *p = __float2bfloat16_rn(sum);
  }
}

void gemm_split_k(const GemmTile& t, GemmMaps& maps, GemmKernelArgs args, const TensorView& d, bool accumulate,
                  cudaStream_t stream) {
  const int64_t M = args.M, N = args.N, S = t.split_k;
  FP8MOE_CHECK(S >= 2 && S * M < (int64_t(1) << 31), "gemm_fp8: " << S << " K slices of " << M << " rows");
  float* w = nullptr;
  FP8MOE_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&w), size_t(S * M * N) * 4, stream));
  const TensorView wv(w, DType::f32, {S * M, N}, Device::cuda);
  args.M = uint32_t(S * M);
  args.group.groups = uint32_t(S);
  args.group.group_rows = uint32_t(M);
  args.epi = make_epilogue(wv, false, maps);
  launch_gemm<false, Grouping::split_k>(t, maps, args, stream, "gemm_fp8");
  const dim3 grid(unsigned((N + 255) / 256), unsigned(std::min<int64_t>(M, 65535)));
  if (d.dtype == DType::f32)
    sum_slices_kernel<<<grid, 256, 0, stream>>>(w, int(S), M, N, d.ptr<float>(), d.strides[0], accumulate);
  else
    sum_slices_kernel<<<grid, 256, 0, stream>>>(w, int(S), M, N, d.ptr<__nv_bfloat16>(), d.strides[0], false);
  FP8MOE_CUDA_CHECK_LAUNCH("sum_slices_kernel");
  FP8MOE_CUDA_CHECK(cudaFreeAsync(w, stream));
}

// Last-wave K slices: D = the tiles of the full waves of the grid (dense, one CTA per SM), the R
// tiles after them in S slices each. Workspace (stream-ordered): the per-tile arrival counters
// (zeroed) and the slices' FP32 partial tiles.
void gemm_tail_split(const GemmTile& t, GemmMaps& maps, GemmKernelArgs args, const TensorView& d, bool accumulate,
                     cudaStream_t stream) {
  const LastWave lw = last_wave(gemm_tile_count(args.M, args.N, t.block_m, t.block_n), device_props().multiProcessorCount);
  const int64_t R = lw.rest, S = t.tail_split;
  args.epi = make_epilogue(d, accumulate, maps);
  if (R == 0) {  // whole waves: nothing to split
    GemmTile whole = t;
    whole.tail_split = 1;
    return launch_gemm<false, Grouping::none>(whole, maps, args, stream, "gemm_fp8");
  }
  FP8MOE_CHECK(S >= 2 && R * S < (int64_t(1) << 24), "gemm_fp8: " << S << " last-wave K slices of " << R << " tiles");
  const size_t counters = size_t(R * (t.block_m / 64)) * 4, counters_padded = (counters + 255) / 256 * 256;
  const size_t partials = size_t(R * S) * size_t(t.block_m * t.block_n) * 4;
  uint8_t* w = nullptr;
  FP8MOE_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&w), counters_padded + partials, stream));
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(w, 0, counters, stream));
  args.group.groups = uint32_t(S);
  args.group.group_rows = uint32_t(lw.full);
  args.group.arrivals = reinterpret_cast<int32_t*>(w);
  args.group.partials = reinterpret_cast<float*>(w + counters_padded);
  launch_gemm<false, Grouping::tail_split>(t, maps, args, stream, "gemm_fp8");
  FP8MOE_CUDA_CHECK(cudaFreeAsync(w, stream));
}

}  // namespace

int gemm_fp8_sm90_max_active_clusters(const GemmTile& tile, bool b_1x128) {
  if (tile.multicast == 1 || tile.block_m != 128 || tile.block_n != 128) return 1;
  auto query = [&](auto kernel, int smem, int threads) {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(unsigned(device_props().multiProcessorCount));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = size_t(smem);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    FP8MOE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &cfg));
    return n;
  };
  if (b_1x128) {
    using T = GemmTraits<128, 128, true, true, 2>;
    return query(sm90_fp8_gemm_kernel<128, 128, true, true, 2, false, Grouping::none>, T::kSmemBytes, T::kNumThreads);
  }
  if (tile.tma_epilogue) {
    using T = GemmTraits<128, 128, false, true, 2>;
    return query(sm90_fp8_gemm_kernel<128, 128, false, true, 2, false, Grouping::none>, T::kSmemBytes, T::kNumThreads);
  }
  using T = GemmTraits<128, 128, false, false, 2>;
  return query(sm90_fp8_gemm_kernel<128, 128, false, false, 2, false, Grouping::none>, T::kSmemBytes, T::kNumThreads);
}

bool sm90_available() {
  const cudaDeviceProp& p = device_props();
  return p.major == 9 && p.minor == 0;
}

GemmTile gemm_fp8_sm90_tile(int64_t M, int64_t N, int64_t K, bool b_1x128, bool d_f32) {
  return choose_gemm_tile(M, N, K, b_1x128, device_props().multiProcessorCount, /*grouped=*/false, d_f32);
}

void gemm_fp8_sm90(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                   cudaStream_t stream, const GemmTile* tile) {
  check_operand(a, "gemm_fp8", "a", ScaleKind::tile_1x128);
  check_operand(b, "gemm_fp8", "b", b.kind);
  const int64_t M = a.rows(), K = a.cols(), N = b.rows();
  FP8MOE_CHECK(b.cols() == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.values.str());
  FP8MOE_CHECK(K % kBlockK == 0 && K > 0, "a: K = " << K << " must be a positive multiple of 128 (pad K with zeros)");
  check_output(d, "gemm_fp8", M, N, accumulate);
  FP8MOE_CHECK(M < (int64_t(1) << 31) && N < (int64_t(1) << 31) && K < (int64_t(1) << 31),
               "gemm_fp8: M, N, K must be below 2^31");
  FP8MOE_CHECK(sm90_available(), "gemm_fp8: the sm_90a kernel needs a Hopper (compute capability 9.0) GPU, got "
                                     << device_props().major << "." << device_props().minor);
  if (M == 0 || N == 0) return;

  const bool b_1x128 = b.kind == ScaleKind::tile_1x128;
  if (!tile && !b_1x128 && M <= kSmallMDispatchRows) return gemm_fp8_small_m(a, b, d, accumulate, stream);
  const GemmTile t = tile_for_d(tile ? *tile : gemm_fp8_sm90_tile(M, N, K, b_1x128, d.dtype == DType::f32), b_1x128, d);

  GemmMaps maps{};
  maps.a = make_values_map(a.values, uint32_t(t.block_m), "a.values");
  maps.b = make_values_map(b.values, uint32_t(t.block_n / t.multicast), "b.values");
  maps.sa = make_scales_map(a.scales, uint32_t(t.block_m), "a.scales");
  maps.sb = b_1x128 ? make_scales_map(b.scales, uint32_t(t.block_n), "b.scales") : maps.a;
  maps.d = maps.a;  // replaced when D goes through the TMA-store epilogue

  GemmKernelArgs args{};
  args.sb_blk = b_1x128 ? nullptr : b.scales.ptr<const float>();
  args.M = uint32_t(M);
  args.N = uint32_t(N);
  args.K = uint32_t(K);
  if (t.split_k > 1) {
    FP8MOE_CHECK(split_k_tile_ok(t, b_1x128), "gemm_fp8: tile " << tile_name(t) << " is not compiled with K slices");
    return gemm_split_k(t, maps, args, d, accumulate, stream);
  }
  if (t.tail_split > 1) {
    FP8MOE_CHECK(tail_split_tile_ok(t, b_1x128),
                 "gemm_fp8: tile " << tile_name(t) << " is not compiled with last-wave K slices");
    return gemm_tail_split(t, maps, args, d, accumulate, stream);
  }
  args.epi = make_epilogue(d, accumulate, maps);
  if (b_1x128) launch_gemm<true, Grouping::none>(t, maps, args, stream, "gemm_fp8");
  else launch_gemm<false, Grouping::none>(t, maps, args, stream, "gemm_fp8");
}

}  // namespace fp8moe::cuda
