// Host side of the m-grouped FP8 GEMMs (MoE expert layers; contracts in moe_api.hpp and
// backend.hpp): argument checks, tensor maps, tile choice, launch of the sm_90a kernel with
// Grouping::contiguous or Grouping::masked (kernels/grouping.cuh).
//
//   contiguous  D [R, N] = A [R, K] * B[g]^T, g = row_group of the row's 128-row block (192-row
//               tiles: laid out per segment by contiguous_tiles_kernel first)
//   masked      D [G*M_max, N]: rows g*M_max + [0, counts[g]) = A * B[g]^T, the rest zero
//   A 1x128-scaled e4m3 (scales [K/128, ld(rows)]), B [G*N, K] 128x128-scaled e4m3 (the G expert
//   weights stacked; scales [G*N/128, K/128]), N % 128 == 0, K % 128 == 0; D bf16 | f32.
// The tables (row_group, counts) stay on the device: the launch covers every tile the tables
// could ask for (all R rows; G * ceil(M_max / BM) row tiles), and tiles with nothing to compute
// only write zeros.
#include <cub/block/block_scan.cuh>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/gemm/gemm_launch.cuh"
#include "cuda/kernel_api.hpp"
#include "cuda/moe/moe_api.hpp"

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

// The 192-row tiles of a contiguous layout (grouping.cuh), listed in row order: each segment (a run
// of 128-row blocks whose first rows have one group) is cut into 192-row tiles from its first row,
// so block p of a segment holds the start of one tile, at its row 0 (p % 3 == 0) or 64 (p % 3 ==
// 1), or of none (p % 3 == 2). An entry is the start row | the tile's rows within the segment / 64
// (3, or 2 / 1 when the segment ends in the next block); a padding block (first row outside [0,
// G)) gets a 128-row tile of zeros. tiles[blocks] holds the number of tiles. One CTA walks the
// blocks 1024 at a time: segment starts by a max-scan, list positions by a sum, both carried from
// chunk to chunk.
constexpr int kTileScanThreads = 1024;
__global__ void __launch_bounds__(kTileScanThreads)
    contiguous_tiles_kernel(const int32_t* __restrict__ row_group, int64_t blocks, uint32_t groups,
                            int32_t* __restrict__ tiles) {
  using Scan = cub::BlockScan<int64_t, kTileScanThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int64_t carry_start;
  auto group_of = [&](int64_t blk) -> int32_t {
    if (blk < 0 || blk >= blocks) return -2;
    const int32_t g = __ldg(row_group + blk * 128);
    return g >= 0 && uint32_t(g) < groups ? g : -1;
  };
  auto max_op = [](int64_t x, int64_t y) { return x > y ? x : y; };
  int64_t seg = 0, count = 0;  // the segment the previous chunk ended in, tiles listed so far
  for (int64_t base = 0; base < blocks; base += kTileScanThreads) {
    const int64_t blk = base + threadIdx.x;
    const int32_t g = group_of(blk), prev = group_of(blk - 1), next = group_of(blk + 1);
    int64_t start = blk < blocks && g != prev ? blk : -1;
    Scan(scan).InclusiveScan(start, start, max_op);
    start = max_op(start, seg);
    int32_t e = -1;
    if (blk < blocks) {
      e = int32_t(blk * 128) | 2;  // padding block
      if (g >= 0) {
        const int64_t p = (blk - start) % 3;
        const int32_t off = p == 1 ? 64 : 0;
        e = p == 2 ? -1 : int32_t(blk * 128 + off) | ((next == g ? 192 : 128 - off) / 64);
      }
    }
    __syncthreads();  // the scan's storage is reused
    int64_t pos, n;
    Scan(scan).ExclusiveSum(int64_t(e >= 0), pos, n);
    if (e >= 0) tiles[count + pos] = e;
    if (threadIdx.x == kTileScanThreads - 1) carry_start = start;
    __syncthreads();
    seg = carry_start;
    count += n;
  }
  if (threadIdx.x == 0) tiles[blocks] = int32_t(count);
}

template <Grouping kG>
void launch_m_grouped(const QuantizedView& a, const QuantizedView& b, const GroupArgs& group, const TensorView& d,
                      bool accumulate, cudaStream_t stream, const GemmTile& t, const char* op) {
  const int64_t rows = a.rows(), N = group.b_rows, K = a.cols();
  check_grouped_tile(t, false, kG == Grouping::contiguous, op);
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

GemmTile grouped_gemm_tile(int64_t rows, int64_t N, int64_t K, bool b_1x128, bool d_f32, int64_t contiguous_groups) {
  return choose_gemm_tile(rows, N, K, b_1x128, device_props().multiProcessorCount, /*grouped=*/true, d_f32,
                          /*split=*/false, contiguous_groups);
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
  const GemmTile t =
      tile_for_d(tile ? *tile : grouped_gemm_tile(a.rows(), N, a.cols(), false, d.dtype == DType::f32, groups), false, d);
  if (t.block_m <= 128) {
    launch_m_grouped<Grouping::contiguous>(a, b, group, d, accumulate, stream, t, op);
    return;
  }
  // The tile table lives in stream-ordered memory for the launch (CUDA-graph capture included).
  const int64_t blocks = (a.rows() + 127) / 128;
  int32_t* tiles = nullptr;
  FP8MOE_CUDA_CHECK(cudaMallocAsync(&tiles, size_t(blocks + 1) * sizeof(int32_t), stream));
  contiguous_tiles_kernel<<<1, kTileScanThreads, 0, stream>>>(group.table, blocks, group.groups, tiles);
  FP8MOE_CUDA_CHECK_LAUNCH("contiguous_tiles_kernel");
  group.tiles = tiles;
  launch_m_grouped<Grouping::contiguous>(a, b, group, d, accumulate, stream, t, op);
  FP8MOE_CUDA_CHECK(cudaFreeAsync(tiles, stream));
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
  // Rows past M_max are the next group's: a 64-row store box holds one group's rows when 64 | M_max.
  const GemmTile t = tile_for_d(tile ? *tile : grouped_gemm_tile(a.rows(), N, a.cols(), false, d.dtype == DType::f32),
                                false, d, /*whole_boxes=*/group.group_rows % 64 == 0);
  launch_m_grouped<Grouping::masked>(a, b, group, d, false, stream, t, op);
}

}  // namespace fp8moe::cuda
