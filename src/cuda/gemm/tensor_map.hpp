// TMA tensor maps (CUtensorMap) of 2-D row-major tensors, encoded through the driver's
// cuTensorMapEncodeTiled: the GEMMs' operands (gemm_launch.cuh) and the requantizer's tiles.
#pragma once
#include <cuda.h>

#include <string>

#include "cuda/runtime/cuda_check.hpp"

namespace fp8moe::cuda {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// NOTES: the driver function is fetched through the runtime so that the library does not link
// libcuda.so directly: binaries then still load (and GPU tests skip) on machines without a driver.
inline EncodeTiledFn encode_tiled_fn() {
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
inline CUtensorMap make_tmap_2d(const void* ptr, CUtensorMapDataType dtype, int elem_bytes, uint64_t inner,
                                uint64_t outer, uint64_t row_stride_elems, uint32_t box_inner, uint32_t box_outer,
                                CUtensorMapSwizzle swizzle, const char* what) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_stride_elems * uint64_t(elem_bytes)};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled_fn()(&map, dtype, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  // The error string would need the driver API too; the code is enough to look up.
  if (r != CUDA_SUCCESS)
    throw Error(std::string("cuTensorMapEncodeTiled(") + what + ") failed with CUresult " + std::to_string(int(r)));
  return map;
}

}  // namespace fp8moe::cuda
