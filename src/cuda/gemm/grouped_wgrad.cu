// Host side of the K-grouped FP8 Wgrad of the MoE experts (contract in moe_api.hpp and
// backend.hpp): argument checks, tensor maps, tile choice, launch of the sm_90a kernel's 1x128 x
// 1x128 ("1d1d") path with Grouping::k_grouped (kernels/grouping.cuh).
//
//   d[g] [N, K] (+)= dy_t[:, seg g] * x_t[:, seg g]^T,  seg g = tokens [offsets[g], offsets[g+1])
//   dy_t [N, R], x_t [K, R] e4m3 1x128-scaled along R (scales [R/128, ld(N)], [R/128, ld(K)]);
//   offsets [G + 1] i32 on the device, multiples of 128; d [G*N, K] f32.
// The launch covers G * ceil(N / BM) * ceil(K / BN) tiles whatever the offsets say; a tile of an
// empty segment writes zeros (or nothing, when accumulating).
#include "cuda/runtime/cuda_check.hpp"
#include "cuda/gemm/gemm_launch.cuh"
#include "cuda/kernel_api.hpp"
#include "cuda/moe/moe_api.hpp"

namespace fp8moe::cuda {

void grouped_wgrad_fp8_cuda(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                            const TensorView& d, bool accumulate, cudaStream_t stream, const GemmTile* tile) {
  const char* op = "grouped_wgrad_fp8";
  check_operand(dy_t, op, "dy_t", ScaleKind::tile_1x128);
  check_operand(x_t, op, "x_t", ScaleKind::tile_1x128);
  const int64_t G = check_grouped_wgrad(dy_t, x_t, offsets, d, accumulate, op);
  const int64_t N = dy_t.rows(), K = x_t.rows(), R = dy_t.cols();
  FP8MOE_CHECK(sm90_available(), op << ": the sm_90a kernel needs a Hopper (compute capability 9.0) GPU, got "
                                    << device_props().major << "." << device_props().minor);
  if (G * N == 0 || K == 0) return;
  if (R == 0) {  // every segment empty (no tensor map over zero columns)
    if (!accumulate)
      FP8MOE_CUDA_CHECK(cudaMemset2DAsync(d.data, size_t(d.strides[0]) * 4, 0, size_t(K) * 4, size_t(G * N), stream));
    return;
  }

  const GemmTile t = tile ? *tile : grouped_gemm_tile(G * N, K, R / G, true, /*d_f32=*/true);
  check_grouped_tile(t, true, /*contiguous=*/false, op);
  GemmMaps maps{};
  maps.a = make_values_map(dy_t.values, uint32_t(t.block_m), "dy_t.values");
  maps.b = make_values_map(x_t.values, uint32_t(t.block_n), "x_t.values");
  maps.sa = make_scales_map(dy_t.scales, uint32_t(t.block_m), "dy_t.scales");
  maps.sb = make_scales_map(x_t.scales, uint32_t(t.block_n), "x_t.scales");
  maps.d = maps.a;  // replaced for the TMA-store epilogue
  GemmKernelArgs args{};
  args.sb_blk = nullptr;
  args.M = uint32_t(G * N);
  args.N = uint32_t(K);
  args.K = uint32_t(R);
  args.group.table = offsets.ptr<const int32_t>();
  args.group.groups = uint32_t(G);
  args.group.group_rows = uint32_t(N);
  args.epi = make_epilogue(d, accumulate, maps);
  launch_gemm<true, Grouping::k_grouped>(t, maps, args, stream, op);
}

}  // namespace fp8moe::cuda
