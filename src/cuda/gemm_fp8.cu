// Host side of the sm_90a FP8 block-scaled GEMM (kernel: kernels/sm90_fp8_gemm.cuh): argument
// checks, TMA tensor maps, tile choice (gemm_heuristics.hpp) and the persistent launch.
//
//   D [M, N] = A [M, K] * B [N, K]^T (+ D)
//   A [M, K] e4m3 row-major, scales [K/128, ld(M)] f32 M-major (1x128)
//   B [N, K] e4m3 row-major, scales [ceil(N/128), K/128] f32 (128x128) or [K/128, ld(N)] (1x128)
//   D [M, N] bf16 | f32 row-major (row stride may exceed N)
#include <cuda.h>

#include <mutex>

#include "cuda_check.hpp"
#include "kernel_api.hpp"
#include "kernels/sm90_fp8_gemm.cuh"

namespace fp8moe::cuda {

namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// NOTES: the driver function is fetched through the runtime so that the library does not link
// libcuda.so directly: binaries then still load (and GPU tests skip) on machines without a driver.
EncodeTiledFn encode_tiled_fn() {
  static EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    FP8MOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    FP8MOE_CHECK(q == cudaDriverEntryPointSuccess && p != nullptr,
                 "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled): symbol not found");
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// 2-D tensor map of a row-major [outer, inner] tensor; box [box_outer, box_inner].
CUtensorMap make_tmap_2d(const void* ptr, CUtensorMapDataType dtype, int elem_bytes, uint64_t inner, uint64_t outer,
                         uint64_t row_stride_elems, uint32_t box_inner, uint32_t box_outer, CUtensorMapSwizzle swizzle,
                         const char* what) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_stride_elems * uint64_t(elem_bytes)};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled_fn()(&map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    const char* s = nullptr;
    // The error string comes through the runtime's driver-entry query too; keep the code.
    throw Error(std::string("cuTensorMapEncodeTiled(") + what + ") failed with CUresult " + std::to_string(int(r)) +
                (s ? s : ""));
  }
  return map;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_row_major(const TensorView& t, const char* arg) {
  FP8MOE_CHECK(t.ndim == 2 && t.strides[1] == 1 && t.strides[0] == t.shape[1],
               arg << ": expected a contiguous row-major 2-D tensor, got " << t.str());
}

template <int BM, int BN, bool kB1x128, bool kTmaEpi, int kMC, bool kPipe>
void launch(const CUtensorMap& ta, const CUtensorMap& tb, const CUtensorMap& tsa, const CUtensorMap& tsb,
            const CUtensorMap& td, GemmKernelArgs args, cudaStream_t stream) {
  using T = GemmTraits<BM, BN, kB1x128, kTmaEpi, kMC, kPipe>;
  auto kernel = sm90_fp8_gemm_kernel<BM, BN, kB1x128, kTmaEpi, kMC, kPipe>;
  static std::once_flag once;
  std::call_once(once, [&] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
  });
  // Units of kMC vertically adjacent tiles; one cluster of kMC CTAs per unit.
  const int64_t units = int64_t((args.M + BM * kMC - 1) / (BM * kMC)) * int64_t((args.N + BN - 1) / BN);
  const int grid = int(std::min<int64_t>(units, device_props().multiProcessorCount / kMC)) * kMC;
  // TMA-store epilogue only when D has the staging dtype (the caller checked alignment).
  args.epi.tma_store = args.epi.tma_store && T::kTmaStoreOk && (args.epi.d_f32 == T::kStageF32);
  if constexpr (kMC == 1) {
    kernel<<<grid, T::kNumThreads, T::kSmemBytes, stream>>>(ta, tb, tsa, tsb, td, args);
  } else {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(unsigned(grid));
    cfg.blockDim = dim3(T::kNumThreads);
    cfg.dynamicSmemBytes = T::kSmemBytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kMC;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    FP8MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, ta, tb, tsa, tsb, td, args));
  }
  FP8MOE_CUDA_CHECK_LAUNCH("sm90_fp8_gemm_kernel");
}

template <int BM, int BN, bool kB1x128, bool kTmaEpi = true, int kMC = 1, bool kPipe = false>
bool try_launch(const GemmTile& t, const CUtensorMap& ta, const CUtensorMap& tb, const CUtensorMap& tsa,
                const CUtensorMap& tsb, const CUtensorMap& td, const GemmKernelArgs& args, cudaStream_t stream) {
  if (t.block_m != BM || t.block_n != BN || t.tma_epilogue != kTmaEpi || t.multicast != kMC || t.pipelined != kPipe)
    return false;
  launch<BM, BN, kB1x128, kTmaEpi, kMC, kPipe>(ta, tb, tsa, tsb, td, args, stream);
  return true;
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
    return query(sm90_fp8_gemm_kernel<128, 128, true, true, 2, false>, T::kSmemBytes, T::kNumThreads);
  }
  if (tile.tma_epilogue) {
    using T = GemmTraits<128, 128, false, true, 2>;
    return query(sm90_fp8_gemm_kernel<128, 128, false, true, 2, false>, T::kSmemBytes, T::kNumThreads);
  }
  using T = GemmTraits<128, 128, false, false, 2>;
  return query(sm90_fp8_gemm_kernel<128, 128, false, false, 2, false>, T::kSmemBytes, T::kNumThreads);
}

bool sm90_available() {
  const cudaDeviceProp& p = device_props();
  return p.major == 9 && p.minor == 0;
}

GemmTile gemm_fp8_sm90_tile(int64_t M, int64_t N, int64_t K, bool b_1x128) {
  return choose_gemm_tile(M, N, K, b_1x128, device_props().multiProcessorCount);
}

void gemm_fp8_sm90(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate,
                   cudaStream_t stream, const GemmTile* tile) {
  check_quantized(a, "a", ScaleKind::tile_1x128);
  check_quantized(b, "b", b.kind);
  FP8MOE_CHECK(a.values.dtype == DType::e4m3, "a: the sm90 kernel takes e4m3 values, got " << a.values.str());
  FP8MOE_CHECK(b.values.dtype == DType::e4m3, "b: the sm90 kernel takes e4m3 values, got " << b.values.str());
  for (const TensorView* t : {&a.values, &a.scales, &b.values, &b.scales, &d})
    FP8MOE_CHECK(t->device == Device::cuda, "gemm_fp8: every tensor must be on the GPU, got " << t->str());
  const int64_t M = a.rows(), K = a.cols(), N = b.rows();
  FP8MOE_CHECK(b.cols() == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.values.str());
  FP8MOE_CHECK(K % kBlockK == 0 && K > 0, "a: K = " << K << " must be a positive multiple of 128 (pad K with zeros)");
  // D may have a row stride > N (check_tensor would insist on contiguity).
  FP8MOE_CHECK(d.data != nullptr && d.ndim == 2, "d: expected a 2-D tensor, got " << d.str());
  FP8MOE_CHECK(d.dtype == DType::f32 || d.dtype == DType::bf16, "d: expected f32 or bf16, got " << d.str());
  FP8MOE_CHECK(d.shape[0] == M && d.shape[1] == N, "d: expected shape [" << M << ", " << N << "], got " << d.str());
  FP8MOE_CHECK(!accumulate || d.dtype == DType::f32, "d: accumulate needs an f32 output, got " << d.str());
  FP8MOE_CHECK(d.strides[1] == 1 && d.strides[0] >= N, "d: expected row-major rows (stride 1 along N), got " << d.str());
  check_row_major(a.values, "a.values");
  check_row_major(b.values, "b.values");
  check_row_major(a.scales, "a.scales");
  check_row_major(b.scales, "b.scales");
  FP8MOE_CHECK(aligned16(a.values.data) && aligned16(b.values.data), "gemm_fp8: a.values and b.values must be 16-byte aligned");
  FP8MOE_CHECK(aligned16(a.scales.data) && aligned16(b.scales.data), "gemm_fp8: a.scales and b.scales must be 16-byte aligned");
  FP8MOE_CHECK(M < (int64_t(1) << 31) && N < (int64_t(1) << 31) && K < (int64_t(1) << 31),
               "gemm_fp8: M, N, K must be below 2^31");
  FP8MOE_CHECK(sm90_available(), "gemm_fp8: the sm_90a kernel needs a Hopper (compute capability 9.0) GPU, got "
                                     << device_props().major << "." << device_props().minor);
  if (M == 0 || N == 0) return;

  const bool b_1x128 = b.kind == ScaleKind::tile_1x128;
  const GemmTile t = tile ? *tile : gemm_fp8_sm90_tile(M, N, K, b_1x128);

  const CUtensorMap ta = make_tmap_2d(a.values.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(K), uint64_t(M),
                                      uint64_t(K), kBlockK, uint32_t(t.block_m), CU_TENSOR_MAP_SWIZZLE_128B, "a.values");
  const CUtensorMap tb = make_tmap_2d(b.values.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(K), uint64_t(N),
                                      uint64_t(K), kBlockK, uint32_t(t.block_n / t.multicast), CU_TENSOR_MAP_SWIZZLE_128B,
                                      "b.values");
  const uint64_t lda = uint64_t(a.scales.size(1));
  const CUtensorMap tsa = make_tmap_2d(a.scales.data, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, lda, uint64_t(K / kBlockK),
                                       lda, uint32_t(t.block_m), 1, CU_TENSOR_MAP_SWIZZLE_NONE, "a.scales");
  CUtensorMap tsb = tsa;  // unused by the 1d2d kernel
  if (b_1x128) {
    const uint64_t ldb = uint64_t(b.scales.size(1));
    tsb = make_tmap_2d(b.scales.data, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ldb, uint64_t(K / kBlockK), ldb,
                       uint32_t(t.block_n), 1, CU_TENSOR_MAP_SWIZZLE_NONE, "b.scales");
  }

  GemmKernelArgs args{};
  args.sb_blk = b_1x128 ? nullptr : b.scales.ptr<const float>();
  args.M = uint32_t(M);
  args.N = uint32_t(N);
  args.K = uint32_t(K);
  args.epi.d = d.data;
  args.epi.ldd = d.strides[0];
  args.epi.M = uint32_t(M);
  args.epi.N = uint32_t(N);
  args.epi.d_f32 = d.dtype == DType::f32;
  args.epi.accumulate = accumulate;
  const uintptr_t pair_align = args.epi.d_f32 ? 8 : 4;
  args.epi.pair_ok = (d.strides[0] % 2 == 0) && (reinterpret_cast<uintptr_t>(d.data) % pair_align == 0);
  // TMA-store epilogue: 16-byte aligned rows (the kernel also needs D's dtype = its staging dtype).
  const int esize = int(dtype_size(d.dtype));
  args.epi.tma_store = aligned16(d.data) && (d.strides[0] * esize) % 16 == 0;
  CUtensorMap td = tsa;  // unused when tma_store is off
  if (args.epi.tma_store)
    td = make_tmap_2d(d.data, args.epi.d_f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                      esize, uint64_t(N), uint64_t(M), uint64_t(d.strides[0]), uint32_t(128 / esize), 64,
                      CU_TENSOR_MAP_SWIZZLE_128B, "d");

  bool ok = false;
  if (b_1x128) {
    ok = try_launch<64, 64, true>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<64, 128, true>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 64, true>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 128, true>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 128, true, true, 2>(t, ta, tb, tsa, tsb, td, args, stream);
  } else {
    ok = try_launch<64, 16, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<64, 32, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<64, 64, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<64, 128, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 16, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 32, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 64, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 128, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 128, false, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 128, false, true, 1, true>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 128, false, false, 1, true>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 160, false, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 192, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 192, false, false>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 128, false, true, 2>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<128, 128, false, false, 2>(t, ta, tb, tsa, tsb, td, args, stream) ||
         try_launch<256, 128, false, false>(t, ta, tb, tsa, tsb, td, args, stream);
  }
  FP8MOE_CHECK(ok, "gemm_fp8: tile " << t.block_m << "x" << t.block_n << " is not compiled for "
                                     << (b_1x128 ? "1x128" : "128x128") << " B scales");
}

}  // namespace fp8moe::cuda
