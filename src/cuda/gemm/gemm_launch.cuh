// Host side shared by the dense and the grouped sm_90a FP8 GEMMs (gemm_fp8.cu, grouped_gemm.cu,
// grouped_wgrad.cu): TMA tensor maps of the operands, the epilogue arguments of D, and the
// persistent launch of sm90_fp8_gemm_kernel for a tile chosen at run time among the compiled ones
// (Tiles1d2d / Tiles1d1d in gemm_heuristics.hpp). Include from .cu files only.
#pragma once
#include <algorithm>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "cuda/runtime/cuda_check.hpp"
#include "fp8moe/quantize.hpp"
#include "cuda/gemm/gemm_heuristics.hpp"
#include "cuda/gemm/kernels/sm90_fp8_gemm.cuh"
#include "cuda/gemm/tensor_map.hpp"

namespace fp8moe::cuda {

inline void check_row_major(const TensorView& t, const char* arg) {
  FP8MOE_CHECK(t.ndim == 2 && t.strides[1] == 1 && t.strides[0] == t.shape[1],
               arg << ": expected a contiguous row-major 2-D tensor, got " << t.str());
}

// Checks of an operand of the FP8 GEMMs (`op` names the caller): e4m3 values with `kind` scales,
// both contiguous, on the GPU, the values 16-byte aligned and, where `scales_aligned` (the sm_90a
// kernels: the TMA's requirements), the scales too.
inline void check_operand(const QuantizedView& q, const char* op, const char* arg, ScaleKind kind,
                          bool scales_aligned = true) {
  check_quantized(q, arg, kind);
  FP8MOE_CHECK(q.values.dtype == DType::e4m3, arg << ": the FP8 GEMMs take e4m3 values, got " << q.values.str());
  FP8MOE_CHECK(q.values.device == Device::cuda && q.scales.device == Device::cuda,
               op << ": " << arg << " must be on the GPU, got " << q.values.str());
  const std::string values = std::string(arg) + ".values", scales = std::string(arg) + ".scales";
  check_row_major(q.values, values.c_str());
  check_row_major(q.scales, scales.c_str());
  FP8MOE_CHECK(aligned16(q.values.data), op << ": " << values << " must be 16-byte aligned");
  FP8MOE_CHECK(!scales_aligned || aligned16(q.scales.data), op << ": " << scales << " must be 16-byte aligned");
}

// The shapes of an m-grouped GEMM (contiguous or masked, and their emulation): A [rows, K], the
// stacked weights B [groups * N, K], N and K multiples of 128. Returns N, the columns of D.
inline int64_t check_m_grouped_shapes(const QuantizedView& a, const QuantizedView& b, int64_t groups, const char* op) {
  const int64_t K = a.cols();
  FP8MOE_CHECK(groups > 0, op << ": groups must be positive, got " << groups);
  FP8MOE_CHECK(b.rows() % groups == 0,
               "b: " << b.rows() << " rows do not split into " << groups << " groups (b is [G * N, K])");
  const int64_t N = b.rows() / groups;
  FP8MOE_CHECK(N % 128 == 0,
               "b: N = " << N << " per group must be a multiple of 128 (one 128x128 scale block per expert)");
  FP8MOE_CHECK(b.cols() == K, "b: expected K = " << K << " columns (b is [G * N, K]), got " << b.values.str());
  FP8MOE_CHECK(K % 128 == 0 && K > 0, "a: K = " << K << " must be a positive multiple of 128 (pad K with zeros)");
  FP8MOE_CHECK(a.rows() < (int64_t(1) << 31) && b.rows() < (int64_t(1) << 31) && K < (int64_t(1) << 31),
               op << ": the rows of a and b and K must be below 2^31");
  return N;
}

// D [M, N] f32 | bf16 with row-major rows (the row stride may exceed N).
inline void check_output(const TensorView& d, const char* op, int64_t M, int64_t N, bool accumulate) {
  FP8MOE_CHECK(d.data != nullptr && d.ndim == 2, "d: expected a 2-D tensor, got " << d.str());
  FP8MOE_CHECK(d.device == Device::cuda, op << ": d must be on the GPU, got " << d.str());
  FP8MOE_CHECK(d.dtype == DType::f32 || d.dtype == DType::bf16, "d: expected f32 or bf16, got " << d.str());
  FP8MOE_CHECK(d.shape[0] == M && d.shape[1] == N, "d: expected shape [" << M << ", " << N << "], got " << d.str());
  FP8MOE_CHECK(!accumulate || d.dtype == DType::f32, "d: accumulate needs an f32 output, got " << d.str());
  FP8MOE_CHECK(d.strides[1] == 1 && d.strides[0] >= N, "d: expected row-major rows (stride 1 along N), got " << d.str());
}

// A group table (row_group, counts, offsets): i32 [n] on the GPU.
inline void check_group_table(const TensorView& t, const char* op, const char* arg, int64_t n) {
  FP8MOE_CHECK(t.data != nullptr && t.ndim == 1 && t.dtype == DType::i32 && t.strides[0] == 1,
               op << ": " << arg << " must be a contiguous 1-D i32 tensor, got " << t.str());
  FP8MOE_CHECK(t.device == Device::cuda, op << ": " << arg << " must be on the GPU, got " << t.str());
  FP8MOE_CHECK(t.shape[0] == n, op << ": " << arg << " must have " << n << " entries, got " << t.str());
}

// The shapes of a K-grouped Wgrad (grouped_wgrad_fp8, its emulation): dW[g] [N, K] (+)= dy_t
// [N, R] x_t [K, R]^T over g's token segment, segments from offsets [G + 1]; returns G.
inline int64_t check_grouped_wgrad(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                                   const TensorView& d, bool accumulate, const char* op) {
  const int64_t N = dy_t.rows(), K = x_t.rows(), R = dy_t.cols();
  FP8MOE_CHECK(x_t.cols() == R, "x_t: " << x_t.cols() << " token columns, dy_t has " << R);
  FP8MOE_CHECK(R % 128 == 0,
               "dy_t: R = " << R << " token columns must be a multiple of 128 (the rows of the expert layout)");
  FP8MOE_CHECK(offsets.ndim == 1 && offsets.shape[0] >= 2,
               op << ": offsets must hold G + 1 >= 2 segment starts, got " << offsets.str());
  const int64_t G = offsets.shape[0] - 1;
  check_group_table(offsets, op, "offsets", G + 1);
  FP8MOE_CHECK(d.dtype == DType::f32, "d: the Wgrad output must be f32, got " << d.str());
  check_output(d, op, G * N, K, accumulate);
  FP8MOE_CHECK(G * N < (int64_t(1) << 31) && K < (int64_t(1) << 31) && R < (int64_t(1) << 31),
               op << ": G * N, K and R must be below 2^31");
  return G;
}

// Tensor maps of one launch; unused ones are copies of `a` (the kernel never touches them).
struct GemmMaps {
  CUtensorMap a, b, sa, sb, d;
};

// Values [rows, K] e4m3, boxes [box_rows, 128] 128B-swizzled (K-major tiles for WGMMA).
// A tile forced on a grouped GEMM must be one the grouped kernels run.
inline void check_grouped_tile(const GemmTile& t, bool b_1x128, bool contiguous, const char* op) {
  FP8MOE_CHECK(grouped_tile_ok(t, b_1x128, contiguous),
               op << ": tile " << tile_name(t)
                  << " unsupported (grouped tiles have at most 128 rows, or 192 for the contiguous GEMM, and no"
                     " multicast; the K-grouped Wgrad has no pipelined mainloop)");
}

inline CUtensorMap make_values_map(const TensorView& v, uint32_t box_rows, const char* what) {
  return make_tmap_2d(v.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, uint64_t(v.size(1)), uint64_t(v.size(0)),
                      uint64_t(v.size(1)), kBlockK, box_rows, CU_TENSOR_MAP_SWIZZLE_128B, what);
}

// 1x128 scales [K/128, ld(rows)] f32, boxes [1, box_rows].
inline CUtensorMap make_scales_map(const TensorView& s, uint32_t box_rows, const char* what) {
  const uint64_t ld = uint64_t(s.size(1));
  return make_tmap_2d(s.data, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ld, uint64_t(s.size(0)), ld, box_rows, 1,
                      CU_TENSOR_MAP_SWIZZLE_NONE, what);
}

// D's rows 16-byte aligned, as a TMA-store map needs.
inline bool d_rows_aligned16(const TensorView& d) {
  return aligned16(d.data) && (d.strides[0] * int64_t(dtype_size(d.dtype))) % 16 == 0;
}

// Tile t, or its direct_gemm_tile where t stores D through TMA only and D cannot take that: rows
// not 16-byte aligned, D's dtype not t's staging dtype, or (whole_boxes false: the masked GEMM
// with M_max no multiple of 64) 64-row store boxes holding rows of two groups.
inline GemmTile tile_for_d(const GemmTile& t, bool b_1x128, const TensorView& d, bool whole_boxes = true) {
  const bool fits = d_rows_aligned16(d) && (d.dtype == DType::f32) == t.f32_staging && whole_boxes;
  return staged_only_tile(t, b_1x128) && !fits ? direct_gemm_tile(t) : t;
}

// Epilogue arguments of D (rows: d.size(0), columns: d.size(1)) and, when its rows are 16-byte
// aligned, the TMA-store map in maps.d (boxes [64, 128 bytes], 128B-swizzled).
inline EpilogueArgs make_epilogue(const TensorView& d, bool accumulate, GemmMaps& maps) {
  EpilogueArgs e{};
  e.d = d.data;
  e.ldd = d.strides[0];
  e.M = uint32_t(d.size(0));
  e.N = uint32_t(d.size(1));
  e.d_f32 = d.dtype == DType::f32;
  e.accumulate = accumulate;
  const uintptr_t pair_align = e.d_f32 ? 8 : 4;
  e.pair_ok = (d.strides[0] % 2 == 0) && (reinterpret_cast<uintptr_t>(d.data) % pair_align == 0);
  // TMA-store epilogue: 16-byte aligned rows (the kernel also needs D's dtype = its staging dtype).
  const int esize = int(dtype_size(d.dtype));
  e.tma_store = d_rows_aligned16(d);
  if (e.tma_store)
    maps.d = make_tmap_2d(d.data, e.d_f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, esize,
                          uint64_t(d.size(1)), uint64_t(d.size(0)), uint64_t(d.strides[0]), uint32_t(128 / esize), 64,
                          CU_TENSOR_MAP_SWIZZLE_128B, "d");
  return e;
}

template <int BM, int BN, bool kB1x128, bool kTmaEpi, int kMC, bool kPipe, bool kF32Stg, Grouping kG>
void launch_kernel(const GemmMaps& maps, GemmKernelArgs args, cudaStream_t stream) {
  using T = GemmTraits<BM, BN, kB1x128, kTmaEpi, kMC, kPipe, kF32Stg>;
  static_assert(gemm_tile_stages(TileConfig<BM, BN, kTmaEpi, kMC, kPipe, kF32Stg>::tile(), kB1x128) == T::kStages,
                "gemm_tile_stages (gemm_heuristics.hpp) must follow GemmTraits");
  auto kernel = sm90_fp8_gemm_kernel<BM, BN, kB1x128, kTmaEpi, kMC, kPipe, kG, kF32Stg>;
  static std::once_flag once;
  std::call_once(once, [&] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
  });
  // Units of kMC vertically adjacent tiles; one cluster of kMC CTAs per unit.
  const int64_t rows = sched_rows<kG, BM>(args.M, args.group);
  const int64_t units = work_units<kG>(uint32_t((rows + BM * kMC - 1) / (BM * kMC) * ((args.N + BN - 1) / BN)), args.group);
  const int grid = int(std::min<int64_t>(units, device_props().multiProcessorCount / kMC)) * kMC;
  args.sched = sched_divs(uint32_t(rows), args.N, BM, BN, kMC, args.raster_n);
  // TMA-store epilogue only when D has the staging dtype (the caller checked alignment); else
  // the direct stores (e.g. a 64x64 tile on f32 D). Staged-only tiles have none: tile_for_d gave
  // such a D their direct variant, and a D that reaches one anyway is refused here.
  args.epi.tma_store = args.epi.tma_store && T::kTmaStoreOk && (args.epi.d_f32 == T::kStageF32);
  if constexpr (T::kStagedOnly)
    FP8MOE_CHECK(args.epi.tma_store && (kG != Grouping::masked || args.group.group_rows % 64 == 0),
                 "gemm_fp8: tile " << tile_name(TileConfig<BM, BN, kTmaEpi, kMC, kPipe, kF32Stg>::tile())
                                   << " stores D by TMA only; D must have 16-byte aligned rows and "
                                   << (T::kStageF32 ? "f32" : "bf16")
                                   << " elements, a masked D groups of M_max rows a multiple of 64 (tile_for_d)");
  if constexpr (kMC == 1) {
    kernel<<<grid, T::kNumThreads, T::kSmemBytes, stream>>>(maps.a, maps.b, maps.sa, maps.sb, maps.d, args);
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
    FP8MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, maps.a, maps.b, maps.sa, maps.sb, maps.d, args));
  }
  FP8MOE_CUDA_CHECK_LAUNCH("sm90_fp8_gemm_kernel");
}

// Launches the instantiation of TileConfig C when it is tile t (and compiled for grouping kG).
template <bool kB1x128, Grouping kG, int BM, int BN, bool kTmaEpi, int kMC, bool kPipe, bool kF32Stg>
bool try_launch(TileConfig<BM, BN, kTmaEpi, kMC, kPipe, kF32Stg>, const GemmTile& t, const GemmMaps& maps,
                const GemmKernelArgs& args, cudaStream_t stream) {
  constexpr GemmTile kTile = TileConfig<BM, BN, kTmaEpi, kMC, kPipe, kF32Stg>::tile();
  static_assert(staged_only_tile(kTile, kB1x128) == GemmTraits<BM, BN, kB1x128, kTmaEpi, kMC, kPipe, kF32Stg>::kStagedOnly,
                "staged_only_tile (gemm_heuristics.hpp) must follow GemmTraits::kStagedOnly");
  if constexpr (kG == Grouping::split_k      ? !split_k_tile_ok(kTile, kB1x128)
                : kG == Grouping::tail_split ? !tail_split_tile_ok(kTile, kB1x128)
                                             : kG != Grouping::none &&
                                                   !grouped_tile_ok(kTile, kB1x128, kG == Grouping::contiguous)) {
    return false;
  } else {
    if (t.block_m != BM || t.block_n != BN || t.tma_epilogue != kTmaEpi || t.multicast != kMC ||
        t.pipelined != kPipe || t.f32_staging != kF32Stg)
      return false;
    launch_kernel<BM, BN, kB1x128, kTmaEpi, kMC, kPipe, kF32Stg, kG>(maps, args, stream);
    return true;
  }
}

template <bool kB1x128, Grouping kG, class... C>
bool launch_tile(const GemmTile& t, const GemmMaps& maps, const GemmKernelArgs& args, cudaStream_t stream,
                 std::tuple<C...>*) {
  return (try_launch<kB1x128, kG>(C{}, t, maps, args, stream) || ...);
}

// Runs the kernel with tile t; throws when t is not compiled for this kind of B and grouping.
template <bool kB1x128, Grouping kG>
void launch_gemm(const GemmTile& t, const GemmMaps& maps, const GemmKernelArgs& args, cudaStream_t stream,
                 const char* op) {
  using Tiles = std::conditional_t<kB1x128, Tiles1d1d, Tiles1d2d>;
  FP8MOE_CHECK(t.raster_n >= 1, op << ": raster_n " << t.raster_n << " must be >= 1");
  GemmKernelArgs a = args;
  a.raster_n = uint32_t(t.raster_n);
  const bool ok = launch_tile<kB1x128, kG>(t, maps, a, stream, static_cast<Tiles*>(nullptr));
  FP8MOE_CHECK(ok, op << ": tile " << tile_name(t) << " is not compiled for "
                      << (kB1x128 ? "1x128" : "128x128") << " B scales"
                      << (kG == Grouping::none ? "" : " in the grouped kernels"));
}

}  // namespace fp8moe::cuda
