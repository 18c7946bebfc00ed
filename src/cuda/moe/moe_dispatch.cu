// CUDA MoE dispatch (contracts: include/fp8moe/backend.hpp; specification, reproduced bit for bit:
// src/cpu/ops_moe_dispatch.cpp). All work is queued on `stream` and nothing synchronizes with the
// host, so index tables are not validated: an entry out of range is skipped (the row is treated as
// padding, the slot as dropped) and never makes a kernel read or write out of bounds.
//   moe_layout               key of each slot = its expert (G for dropped and out-of-range ids),
//                            stable radix sort of the slots by key (so tokens stay ascending),
//                            each expert's run in the sorted order -> counts, a one-block scan of
//                            the padded counts -> offsets, then one thread per sorted slot writes
//                            row_slot, row_group and slot_row.
//   moe_masked_layout        one block, a warp per group: the warp walks the slots 32 at a time in
//                            order, a ballot of the group's slots gives each its rank (so the rows
//                            keep slot order, as on the CPU); the warp's lane 0 writes the count.
//   moe_permute              one thread per 16 columns of a row, 16-byte loads and stores.
//   moe_permute_quantize     gather and 1x128 quantization in one pass, tiled as quantize_1x128: the
//                            4 lanes of a 128-column tile each hold 32 values, amax by shuffles,
//                            scale, reciprocal and E4M3 bytes as quantize_1x128
//                            (quantize_device.cuh); the same grid writes the scale padding rows
//                            [R, round_up(R, 4)). NaN/Inf inputs, which the CPU op refuses, are not
//                            looked for (that would need a host check).
//   moe_combine              one thread per 8 columns of a token: the k source rows loaded four at a
//                            time, then added in slot order in FP32 (separate mul and add roundings).
//   moe_combine_weight_grad  one thread per slot.
#include <cub/block/block_scan.cuh>

#include <algorithm>

#include "fp8moe/codecs.hpp"
#include "fp8moe/moe_dispatch_args.hpp"
#include "cuda/ops/model_ops_util.cuh"
#include "cuda/moe/moe_api.hpp"
#include "cuda/quant/quantize_device.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

// ---- element stores (loads: to_f32 of quantize_device.cuh); bf16 rounds as the CPU's codec ----
template <class T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  __nv_bfloat16_raw r;
  r.x = f32_to_bf16(v);
  return r;
}

// Columns [c0, c0 + kCols) of a row as floats; columns at or past `limit` read as 0 (limit 0: a
// zero row, nothing read). kVec: the row is 16-byte aligned and limit a multiple of the vector
// width, so each 16-byte vector lies wholly inside or outside the limit.
template <int kCols, bool kVec, class T>
__device__ __forceinline__ void load_cols(const T* __restrict__ row, int64_t c0, int64_t limit, float (&v)[kCols]) {
  constexpr int VEC = 16 / sizeof(T);
#pragma unroll
  for (int h = 0; h < kCols / VEC; ++h) {
    const int64_t c = c0 + h * VEC;
    if constexpr (kVec) {
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (c < limit) raw = *reinterpret_cast<const uint4*>(row + c);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[h * VEC + i] = to_f32(e[i]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[h * VEC + i] = c + i < limit ? to_f32(row[c + i]) : 0.0f;
    }
  }
}

// Stores columns [c0, c0 + kCols) below `limit` of a row (kVec as in load_cols).
template <int kCols, bool kVec, class T>
__device__ __forceinline__ void store_cols(T* __restrict__ row, int64_t c0, int64_t limit, const float (&v)[kCols]) {
  constexpr int VEC = 16 / sizeof(T);
#pragma unroll
  for (int h = 0; h < kCols / VEC; ++h) {
    const int64_t c = c0 + h * VEC;
    if constexpr (kVec) {
      if (c >= limit) continue;
      uint4 raw;
      T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < VEC; ++i) e[i] = from_float<T>(v[h * VEC + i]);
      *reinterpret_cast<uint4*>(row + c) = raw;
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        if (c + i < limit) row[c + i] = from_float<T>(v[h * VEC + i]);
    }
  }
}

// Row-parallel kernels run 256-thread blocks of blockDim.x threads along a row (a multiple of 32,
// so a warp never spans two rows) times blockDim.y rows, numbered row-major on a 1-D grid: block b
// covers row block b / col_blocks and column block b % col_blocks.
// NOTES: row-major order makes consecutive blocks stream along whole rows (row blocks in grid.x
// and column blocks in grid.y would sweep the tensor once per column block instead).
struct RowThread {
  int64_t row, col_thread;  // the thread's row, and its index along the row
};
__device__ __forceinline__ RowThread row_thread(uint32_t col_blocks) {
  const uint32_t rb = blockIdx.x / col_blocks, cb = blockIdx.x - rb * col_blocks;
  return {int64_t(rb) * blockDim.y + threadIdx.y, int64_t(cb) * blockDim.x + threadIdx.x};
}

// ---- moe_layout ----

// keys[i] = expert of slot i, or G for dropped slots and ids outside [0, G).
__global__ void layout_keys_kernel(const int32_t* __restrict__ ids, int64_t n, int32_t G, int32_t* __restrict__ keys) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t g = ids[i];
    keys[i] = g >= 0 && g < G ? g : G;
  }
}

// Each expert's run [begin[g], end[g]) in the sorted keys (both left 0 for an expert without slots).
__global__ void layout_runs_kernel(const int32_t* __restrict__ sorted_keys, int64_t n, int32_t G,
                                   int32_t* __restrict__ begin, int32_t* __restrict__ end) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t g = sorted_keys[i];
    if (g >= G) continue;
    if (i == 0 || sorted_keys[i - 1] != g) begin[g] = int32_t(i);
    if (i == n - 1 || sorted_keys[i + 1] != g) end[g] = int32_t(i + 1);
  }
}

// offsets [G + 1] = exclusive scan of round_up(end - begin, align); one block.
constexpr int kScanThreads = 1024;
__global__ void __launch_bounds__(kScanThreads) layout_offsets_kernel(const int32_t* __restrict__ begin,
                                                                      const int32_t* __restrict__ end, int32_t G,
                                                                      int64_t align, int32_t* __restrict__ offsets) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  int32_t carry = 0;  // fits: offsets[G] <= moe_layout_rows(...) <= INT32_MAX (checked on the host)
  for (int32_t g0 = 0; g0 < G; g0 += kScanThreads) {
    const int32_t g = g0 + int32_t(threadIdx.x);
    const int64_t count = g < G ? end[g] - begin[g] : 0;
    const int32_t padded = int32_t((count + align - 1) / align * align);
    int32_t start, total;
    Scan(temp).ExclusiveSum(padded, start, total);
    if (g < G) offsets[g] = carry + start;
    carry += total;
    __syncthreads();  // temp is reused by the next chunk
  }
  if (threadIdx.x == 0) offsets[G] = carry;
}

// Sorted position i of expert g goes to row offsets[g] + (i - begin[g]); dropped slots get row -1.
// NOTES: rows stay below offsets[G] <= moe_layout_rows(T * k, G, align) <= R (host check), so the
// row writes need no bound.
__global__ void layout_scatter_kernel(const int32_t* __restrict__ sorted_keys, const int32_t* __restrict__ sorted_slots,
                                      int64_t n, int32_t G, const int32_t* __restrict__ begin,
                                      const int32_t* __restrict__ offsets, int32_t* __restrict__ row_slot,
                                      int32_t* __restrict__ row_group, int32_t* __restrict__ slot_row) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t g = sorted_keys[i], slot = sorted_slots[i];
    if (g >= G) {
      slot_row[slot] = -1;
      continue;
    }
    const int32_t row = offsets[g] + int32_t(i - begin[g]);
    row_slot[row] = slot;
    row_group[row] = g;
    slot_row[slot] = row;
  }
}

// ---- moe_masked_layout ----

// The group of slot s = t * K + j: expert_ids[t, j], or every_token_group for j = k.
__device__ __forceinline__ int32_t masked_slot_group(const int32_t* __restrict__ ids, int64_t s, int32_t k, int32_t K,
                                                     int32_t every_token_group) {
  const int64_t t = s / K;
  const int32_t j = int32_t(s - t * K);
  return j < k ? ids[t * k + j] : every_token_group;
}

constexpr int kMaskedLayoutThreads = 1024;
// row_slot is all -1 beforehand. Slots of ids outside [0, G), and those past M in their group, are
// dropped (slot_row -1).
__global__ void __launch_bounds__(kMaskedLayoutThreads)
    masked_layout_kernel(const int32_t* __restrict__ ids, int64_t slots, int32_t k, int32_t K, int32_t G, int32_t M,
                         int32_t every_token_group, int32_t* __restrict__ row_slot, int32_t* __restrict__ slot_row,
                         int32_t* __restrict__ counts, long long* __restrict__ loads) {
  const int32_t lane = int32_t(threadIdx.x % 32), warps = int32_t(blockDim.x / 32);
  for (int32_t g = int32_t(threadIdx.x / 32); g < G; g += warps) {
    int32_t n = 0;
    for (int64_t s0 = 0; s0 < slots; s0 += 32) {
      const int64_t s = s0 + lane;
      const bool hit = s < slots && masked_slot_group(ids, s, k, K, every_token_group) == g;
      const unsigned mask = __ballot_sync(0xffffffffu, hit);
      if (hit) {
        const int32_t i = n + __popc(mask & ((1u << lane) - 1u));
        slot_row[s] = i < M ? g * M + i : -1;
        if (i < M) row_slot[int64_t(g) * M + i] = int32_t(s);
      }
      n += __popc(mask);
    }
    if (lane == 0) {
      const int32_t c = min(n, M);
      counts[g] = c;
      if (loads) loads[g] += c;
    }
  }
  for (int64_t s = threadIdx.x; s < slots; s += blockDim.x) {
    const int32_t g = masked_slot_group(ids, s, k, K, every_token_group);
    if (g < 0 || g >= G) slot_row[s] = -1;
  }
}

// ---- moe_permute ----

// out [R, D] rows r = w[slot] * x[slot / k] for slot = row_slot[r] in [0, slots), else zeros.
constexpr int kPermuteCols = 16;
template <class Tin, class Tout, bool kVec>
__global__ void __launch_bounds__(256) moe_permute_kernel(const Tin* __restrict__ x, const int32_t* __restrict__ row_slot,
                                                          const float* __restrict__ w, int64_t topk, int64_t slots,
                                                          Tout* __restrict__ out, int64_t R, int64_t D,
                                                          uint32_t col_blocks) {
  const RowThread p = row_thread(col_blocks);
  const int64_t r = p.row, c0 = p.col_thread * kPermuteCols;
  if (r >= R || c0 >= D) return;
  const int32_t slot = row_slot[r];
  const bool valid = slot >= 0 && slot < slots;
  float v[kPermuteCols];
  load_cols<kPermuteCols, kVec>(x + (valid ? slot / topk : 0) * D, c0, valid ? D : 0, v);
  if (valid && w) {
    const float wv = w[slot];
#pragma unroll
    for (int i = 0; i < kPermuteCols; ++i) v[i] = __fmul_rn(wv, v[i]);
  }
  store_cols<kPermuteCols, kVec>(out + r * D, c0, D, v);
}

// ---- moe_permute_quantize ----

// q [R, D] e4m3|e5m2 and s [D / 128, ld] of the rows moe_permute would write (as FP32); rows
// [R, ld) write only their scale entries (1). D % 128 == 0, x and q 16-byte aligned.
// Tiles as quantize_1x128 (tile_coords_1x128, quantize_device.cuh): a warp takes one 128-column
// tile of 8 rows, four lanes per row-tile, each lane 32 values from 4 (bf16) or 8 (f32) 16-byte
// loads of its row's source token.
// NOTES: the arithmetic is the shared one (reciprocal scale once per tile, one product per element,
// paired conversions); the weighted value w * x is recomputed in the encoding pass (the same FP32
// product) so that only the raw vectors stay live. Four lanes per tile rather than eight with two
// loads each: twice the bytes in flight per lane behind the row_slot load, one shuffle level less,
// and a warp's 8 scale writes filling one sector (88% of copy; eight lanes per tile reach 78%).
template <class Tin, bool kE5M2, bool kPow2>
__global__ void __launch_bounds__(256, 5) moe_permute_quantize_kernel(
    const Tin* __restrict__ x, const int32_t* __restrict__ row_slot, const float* __restrict__ w, int64_t topk,
    int64_t slots, uint8_t* __restrict__ q, float* __restrict__ s, int64_t R, int64_t D, int64_t ld, float max_finite,
    int wg, int64_t gx) {
  const TileCoords tc = tile_coords_1x128(wg, gx);
  const int64_t G = D / kQuantGroup;
  if (tc.g >= G) return;  // whole warps
  const int64_t r = tc.r;
  const int32_t slot = r < R ? row_slot[r] : -1;
  const bool valid = slot >= 0 && slot < slots;
  uint4 raw[Tile1x128<Tin>::NV];
  load_tile_1x128<Tin, true>(x + (valid ? slot / topk : 0) * D + tc.g * kQuantGroup, valid ? kQuantGroup : 0, tc.t,
                             raw);
  const float wv = valid && w ? w[slot] : 1.0f;
  const bool weighted = valid && w;
  auto f = [=](float2 p) { return weighted ? make_float2(__fmul_rn(wv, p.x), __fmul_rn(wv, p.y)) : p; };
  const float amax = tile_amax_1x128<Tin>(raw, f);
  if (r >= ld) return;
  float* sp = s + tc.g * ld + r;
  if (r >= R) {
    if (tc.t == 0) *sp = 1.0f;
    return;
  }
  const float sc = scale_of(amax, max_finite, kPow2);
  if (tc.t == 0) *sp = sc;
  store_tile_1x128<Tin, kE5M2, true>(q + r * D + tc.g * kQuantGroup, kQuantGroup, tc.t, raw, f, inv_scale(sc));
}

// ---- moe_combine ----

// out [T, N] (+)= sum_j w[t, j] * y[slot_row[t, j]] over rows in [0, R), in slot order.
constexpr int kCombineCols = 8, kCombineBatch = 4;
template <class Ty, bool kVec>
__global__ void __launch_bounds__(256) moe_combine_kernel(const Ty* __restrict__ y, const int32_t* __restrict__ slot_row,
                                                          const float* __restrict__ w, float* __restrict__ out,
                                                          int64_t T, int64_t k, int64_t R, int64_t N, bool accumulate,
                                                          uint32_t col_blocks) {
  const RowThread p = row_thread(col_blocks);
  const int64_t t = p.row, c0 = p.col_thread * kCombineCols;
  if (t >= T || c0 >= N) return;
  float acc[kCombineCols];
  load_cols<kCombineCols, kVec>(out + t * N, c0, accumulate ? N : 0, acc);
  // NOTES: the rows of a batch are all loaded before any is added, so that up to four loads per
  // thread are in flight; the additions still run in slot order.
  for (int64_t j0 = 0; j0 < k; j0 += kCombineBatch) {
    float v[kCombineBatch][kCombineCols];
    bool use[kCombineBatch];
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      const int64_t j = j0 + b;
      const int32_t row = j < k ? slot_row[t * k + j] : -1;
      use[b] = row >= 0 && row < R;
      load_cols<kCombineCols, kVec>(y + (use[b] ? row : 0) * N, c0, use[b] ? N : 0, v[b]);
    }
#pragma unroll
    for (int b = 0; b < kCombineBatch; ++b) {
      if (!use[b]) continue;
      const float wj = w ? w[t * k + j0 + b] : 1.0f;
#pragma unroll
      for (int i = 0; i < kCombineCols; ++i) acc[i] = __fadd_rn(acc[i], w ? __fmul_rn(wj, v[b][i]) : v[b][i]);
    }
  }
  store_cols<kCombineCols, kVec>(out + t * N, c0, N, acc);
}

// dw [n] = v[slot_row[i]] / w[i] for rows in [0, R), else 0.
__global__ void moe_combine_weight_grad_kernel(const float* __restrict__ v, const int32_t* __restrict__ slot_row,
                                               const float* __restrict__ w, float* __restrict__ dw, int64_t n,
                                               int64_t R) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t row = slot_row[i];
    dw[i] = row >= 0 && row < R ? __fdiv_rn(v[row], w[i]) : 0.0f;
  }
}

// ---- host helpers ----

// Launch shape of a row-parallel kernel (row_thread) over `rows` rows of `threads_per_row`
// threads: 256-thread blocks, blockDim.x in {128, 64, 32} leaving the fewest idle threads at the
// row's end (ties: the widest), blockDim.y = 256 / blockDim.x rows.
struct RowGrid {
  dim3 grid, block;
  uint32_t col_blocks;
};
RowGrid row_grid(int64_t rows, int64_t threads_per_row, const char* op) {
  int64_t bx = 128;
  for (int64_t cand : {64, 32})
    if (round_up(threads_per_row, cand) < round_up(threads_per_row, bx)) bx = cand;
  const int64_t by = 256 / bx, row_blocks = ceil_div(rows, by), col_blocks = ceil_div(threads_per_row, bx);
  FP8MOE_CHECK(row_blocks * col_blocks < (int64_t(1) << 31),
               op << ": " << rows << " rows of " << threads_per_row << " threads exceed the launch limits");
  return {dim3(unsigned(row_blocks * col_blocks)), dim3(unsigned(bx), unsigned(by)), uint32_t(col_blocks)};
}

}  // namespace

void moe_layout_cuda(const TensorView& expert_ids, int64_t align, const TensorView& row_slot,
                     const TensorView& row_group, const TensorView& slot_row, const TensorView& offsets,
                     cudaStream_t stream) {
  const MoeDispatchDims d =
      check_moe_layout_args(Device::cuda, expert_ids, align, row_slot, row_group, slot_row, offsets);
  const int64_t n = d.tokens * d.topk;
  const int32_t G = int32_t(d.groups);
  // Scratch: keys, sorted keys, sorted slots [n]; run begin, end [G].
  DeviceBuffer scratch(size_t(3 * n + 2 * d.groups) * sizeof(int32_t), stream);
  int32_t* keys = scratch.as<int32_t>();
  int32_t *sorted_keys = keys + n, *sorted_slots = keys + 2 * n, *begin = keys + 3 * n, *end = begin + G;
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(begin, 0, 2 * size_t(G) * sizeof(int32_t), stream));
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(row_slot.data, 0xFF, size_t(d.rows) * sizeof(int32_t), stream));
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(row_group.data, 0xFF, size_t(d.rows) * sizeof(int32_t), stream));
  if (n > 0) {
    layout_keys_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(expert_ids.ptr<const int32_t>(), n, G, keys);
    FP8MOE_CUDA_CHECK_LAUNCH("layout_keys_kernel");
    stable_sort_by_key(keys, n, d.groups + 1, sorted_keys, sorted_slots, stream);
    layout_runs_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(sorted_keys, n, G, begin, end);
    FP8MOE_CUDA_CHECK_LAUNCH("layout_runs_kernel");
  }
  layout_offsets_kernel<<<1, kScanThreads, 0, stream>>>(begin, end, G, align, offsets.ptr<int32_t>());
  FP8MOE_CUDA_CHECK_LAUNCH("layout_offsets_kernel");
  if (n > 0) {
    layout_scatter_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(
        sorted_keys, sorted_slots, n, G, begin, offsets.ptr<const int32_t>(), row_slot.ptr<int32_t>(),
        row_group.ptr<int32_t>(), slot_row.ptr<int32_t>());
    FP8MOE_CUDA_CHECK_LAUNCH("layout_scatter_kernel");
  }
}

void moe_masked_layout_cuda(const TensorView& expert_ids, int64_t groups, int64_t every_token_group,
                            const TensorView& row_slot, const TensorView& slot_row, const TensorView& counts,
                            const TensorView& loads, cudaStream_t stream) {
  const MoeDispatchDims d = check_moe_masked_layout_args(Device::cuda, expert_ids, groups, every_token_group, row_slot,
                                                         slot_row, counts, loads);
  FP8MOE_CUDA_CHECK(cudaMemsetAsync(row_slot.data, 0xFF, size_t(d.rows) * sizeof(int32_t), stream));
  const int threads = int(std::min<int64_t>(kMaskedLayoutThreads, 32 * groups));
  masked_layout_kernel<<<1, threads, 0, stream>>>(
      expert_ids.ptr<const int32_t>(), d.tokens * d.topk, int32_t(expert_ids.size(1)), int32_t(d.topk),
      int32_t(groups), int32_t(d.rows / groups), int32_t(every_token_group), row_slot.ptr<int32_t>(),
      slot_row.ptr<int32_t>(), counts.ptr<int32_t>(), loads.defined() ? loads.ptr<long long>() : nullptr);
  FP8MOE_CUDA_CHECK_LAUNCH("masked_layout_kernel");
}

void moe_permute_cuda(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                      const TensorView& out, cudaStream_t stream) {
  const MoeDispatchDims d = check_moe_permute_args(Device::cuda, x, row_slot, topk, w, out);
  const int64_t R = d.rows, D = d.cols;
  if (R == 0 || D == 0) return;
  const bool vec = D % 8 == 0 && aligned16(x.data) && aligned16(out.data);
  const RowGrid g = row_grid(R, ceil_div(D, kPermuteCols), "moe_permute");
  const float* wp = w.defined() ? w.ptr<const float>() : nullptr;
  auto go = [&](auto tin, auto tout, auto kvec) {
    using Tin = decltype(tin);
    using Tout = decltype(tout);
    moe_permute_kernel<Tin, Tout, decltype(kvec)::value><<<g.grid, g.block, 0, stream>>>(
        static_cast<const Tin*>(x.data), row_slot.ptr<const int32_t>(), wp, topk, d.tokens * topk,
        static_cast<Tout*>(out.data), R, D, g.col_blocks);
  };
  auto go_out = [&](auto tin, auto kvec) {
    out.dtype == DType::bf16 ? go(tin, __nv_bfloat16{}, kvec) : go(tin, float{}, kvec);
  };
  auto go_vec = [&](auto kvec) { x.dtype == DType::bf16 ? go_out(__nv_bfloat16{}, kvec) : go_out(float{}, kvec); };
  vec ? go_vec(std::true_type{}) : go_vec(std::false_type{});
  FP8MOE_CUDA_CHECK_LAUNCH("moe_permute_kernel");
}

void moe_permute_quantize_cuda(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                               const QuantizedView& out, ScaleMode mode, cudaStream_t stream) {
  const MoeDispatchDims d = check_moe_permute_quantize_args(Device::cuda, x, row_slot, topk, w, out);
  FP8MOE_CHECK(aligned16(x.data) && aligned16(out.values.data),
               "moe_permute_quantize: x and out.values must be 16-byte aligned on cuda");
  const int64_t R = d.rows, D = d.cols, ld = out.scales.size(1);
  if (ld == 0 || D == 0) return;
  const int64_t G = D / kQuantGroup, blocks = tiles_blocks(ld, G), gx = tiles_gx(G);
  const int wg = tiles_wg(G);
  FP8MOE_CHECK(blocks < (int64_t(1) << 31), "moe_permute_quantize: " << ld << " rows of " << D << " columns exceed the launch limits");
  const float* wp = w.defined() ? w.ptr<const float>() : nullptr;
  const float mf = float(max_finite(out.values.dtype));
  auto go = [&](auto tin, auto e5m2, auto pow2) {
    using Tin = decltype(tin);
    moe_permute_quantize_kernel<Tin, decltype(e5m2)::value, decltype(pow2)::value><<<unsigned(blocks), 256, 0, stream>>>(
        static_cast<const Tin*>(x.data), row_slot.ptr<const int32_t>(), wp, topk, d.tokens * topk,
        out.values.ptr<uint8_t>(), out.scales.ptr<float>(), R, D, ld, mf, wg, gx);
  };
  auto go_mode = [&](auto tin, auto e5m2) {
    mode == ScaleMode::pow2 ? go(tin, e5m2, std::true_type{}) : go(tin, e5m2, std::false_type{});
  };
  auto go_out = [&](auto tin) {
    out.values.dtype == DType::e5m2 ? go_mode(tin, std::true_type{}) : go_mode(tin, std::false_type{});
  };
  x.dtype == DType::bf16 ? go_out(__nv_bfloat16{}) : go_out(float{});
  FP8MOE_CUDA_CHECK_LAUNCH("moe_permute_quantize_kernel");
}

void moe_combine_cuda(const TensorView& y, const TensorView& slot_row, const TensorView& w, const TensorView& out,
                      bool accumulate, cudaStream_t stream) {
  const MoeDispatchDims d = check_moe_combine_args(Device::cuda, y, slot_row, w, out);
  const int64_t T = d.tokens, N = d.cols;
  if (T == 0 || N == 0) return;
  const bool vec = N % 8 == 0 && aligned16(y.data) && aligned16(out.data);
  const RowGrid g = row_grid(T, ceil_div(N, kCombineCols), "moe_combine");
  const float* wp = w.defined() ? w.ptr<const float>() : nullptr;
  auto go = [&](auto ty, auto kvec) {
    using Ty = decltype(ty);
    moe_combine_kernel<Ty, decltype(kvec)::value><<<g.grid, g.block, 0, stream>>>(
        static_cast<const Ty*>(y.data), slot_row.ptr<const int32_t>(), wp, out.ptr<float>(), T, d.topk, d.rows, N,
        accumulate, g.col_blocks);
  };
  auto go_vec = [&](auto kvec) { y.dtype == DType::bf16 ? go(__nv_bfloat16{}, kvec) : go(float{}, kvec); };
  vec ? go_vec(std::true_type{}) : go_vec(std::false_type{});
  FP8MOE_CUDA_CHECK_LAUNCH("moe_combine_kernel");
}

void moe_combine_weight_grad_cuda(const TensorView& v, const TensorView& slot_row, const TensorView& w,
                                  const TensorView& dw, cudaStream_t stream) {
  const MoeDispatchDims d = check_moe_combine_weight_grad_args(Device::cuda, v, slot_row, w, dw);
  const int64_t n = d.tokens * d.topk;
  if (n == 0) return;
  moe_combine_weight_grad_kernel<<<grid_for(n, 256, 4096), 256, 0, stream>>>(
      v.ptr<const float>(), slot_row.ptr<const int32_t>(), w.ptr<const float>(), dw.ptr<float>(), n, d.rows);
  FP8MOE_CUDA_CHECK_LAUNCH("moe_combine_weight_grad_kernel");
}

}  // namespace fp8moe::cuda
