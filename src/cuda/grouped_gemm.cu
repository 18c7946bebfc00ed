// Host side of the m-grouped FP8 GEMMs (MoE expert layers; contracts in moe_api.hpp and
// backend.hpp): argument checks, tensor maps, tile choice, launch of the sm_90a kernel with
// Grouping::contiguous or Grouping::masked (kernels/grouping.cuh).
//
//   contiguous  D [R, N] = A [R, K] * B[g]^T, g = row_group of the row's 128-row block
//   masked      D [G*M_max, N]: rows g*M_max + [0, counts[g]) = A * B[g]^T, the rest zero
//   A 1x128-scaled e4m3 (scales [K/128, ld(rows)]), B [G*N, K] 128x128-scaled e4m3 (the G expert
//   weights stacked; scales [G*N/128, K/128]), N % 128 == 0, K % 128 == 0; D bf16 | f32.
// The tables (row_group, counts) stay on the device: the launch covers every tile the tables
// could ask for (all R rows; G * ceil(M_max / BM) row tiles), and tiles with nothing to compute
// only write zeros.
#include "cuda_check.hpp"
#include "gemm_launch.cuh"
#include "kernel_api.hpp"
#include "moe_api.hpp"

namespace fp8moe::cuda {

namespace {

// Checks shared by both kinds: the operands, their shapes and the GPU. Returns N, the columns of D.
int64_t check_m_grouped(const QuantizedView& a, const QuantizedView& b, int64_t groups, const char* op) {
  check_operand(a, op, "a", ScaleKind::tile_1x128);
  check_operand(b, op, "b", ScaleKind::block_128x128);
  const int64_t N = check_m_grouped_shapes(a, b, groups, op);
  FP8MOE_CHECK(sm90_available(), op << ": the sm_90a kernel needs a Hopper (compute capability 9.0) GPU, got "
                                    << device_props().major << "." << device_props().minor);
  return N;
}

template <Grouping kG>
void launch_m_grouped(const QuantizedView& a, const QuantizedView& b, const GroupArgs& group, const TensorView& d,
                      bool accumulate, cudaStream_t stream, const GemmTile* tile, const char* op) {
  const int64_t rows = a.rows(), N = group.b_rows, K = a.cols();
  const GemmTile t = tile ? *tile : grouped_gemm_tile(rows, N, K, false, d.dtype == DType::f32);
  check_grouped_tile(t, false, op);
  GemmMaps maps{};
  maps.a = make_values_map(a.values, uint32_t(t.block_m), "a.values");
  maps.b = make_values_map(b.values, uint32_t(t.block_n), "b.values");
  maps.sa = make_scales_map(a.scales, uint32_t(t.block_m), "a.scales");
  maps.sb = maps.d = maps.a;  // unused by 1d2d; maps.d replaced for the TMA-store epilogue
  GemmKernelArgs args{};
  args.sb_blk = b.scales.ptr<const float>();
  args.M = uint32_t(rows);
  args.N = uint32_t(N);
  args.K = uint32_t(K);
  args.group = group;
  args.epi = make_epilogue(d, accumulate, maps);
  launch_gemm<false, kG>(t, maps, args, stream, op);
}

}  // namespace

GemmTile grouped_gemm_tile(int64_t rows, int64_t N, int64_t K, bool b_1x128, bool d_f32) {
  return choose_gemm_tile(rows, N, K, b_1x128, device_props().multiProcessorCount, /*grouped=*/true, d_f32);
}

void grouped_gemm_fp8_contiguous_cuda(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                      int64_t groups, const TensorView& d, bool accumulate, cudaStream_t stream,
                                      const GemmTile* tile) {
  const char* op = "grouped_gemm_fp8_contiguous";
  const int64_t N = check_m_grouped(a, b, groups, op);
  check_group_table(row_group, op, "row_group", a.rows());
  check_output(d, op, a.rows(), N, accumulate);
  if (a.rows() == 0) return;
  GroupArgs group{};
  group.table = row_group.ptr<const int32_t>();
  group.groups = uint32_t(groups);
  group.b_rows = uint32_t(N);
  launch_m_grouped<Grouping::contiguous>(a, b, group, d, accumulate, stream, tile, op);
}

void grouped_gemm_fp8_masked_cuda(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                                  int64_t groups, const TensorView& d, bool accumulate, cudaStream_t stream,
                                  const GemmTile* tile) {
  const char* op = "grouped_gemm_fp8_masked";
  FP8MOE_CHECK(!accumulate, op << ": accumulate is unsupported (the output is overwritten)");
  const int64_t N = check_m_grouped(a, b, groups, op);
  FP8MOE_CHECK(a.rows() % groups == 0,
               "a: " << a.rows() << " rows do not split into " << groups << " groups of M_max (a is [G * M_max, K])");
  check_group_table(counts, op, "counts", groups);
  check_output(d, op, a.rows(), N, false);
  if (a.rows() == 0) return;
  GroupArgs group{};
  group.table = counts.ptr<const int32_t>();
  group.groups = uint32_t(groups);
  group.group_rows = uint32_t(a.rows() / groups);
  group.b_rows = uint32_t(N);
  launch_m_grouped<Grouping::masked>(a, b, group, d, false, stream, tile, op);
}

}  // namespace fp8moe::cuda
