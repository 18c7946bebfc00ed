// CUDA causal softmax attention within sequences (src/cpu/ops_attention.cpp is the
// specification), out of FP8 and TF32 as the report keeps it, in one of two computes (the
// recipe's attn_compute): f32, FP32 throughout (the fp32 recipe), or bf16, BF16 GEMM operands
// with FP32 accumulation and softmax (the bf16 and FP8 recipes): with bf = round to nearest even
// BF16, s = scale * bf(Q) bf(K)^T, P = softmax(s), out = bf(P) bf(V); backward dv = bf(P)^T
// bf(dout), dP = bf(dout) bf(V)^T, dS = P * (dP - Di) * scale with Di = rowsum(dout * out) of
// the unrounded FP32 tensors, dq = bf(dS) bf(K), dk = bf(dS)^T bf(Q). Both paths
// (model_ops.hpp, AttentionPath) compute either:
//   gemm    scores materialized per chunk of sequences and the matrix work as cuBLASLt GEMMs
//           (FP32 or BF16 operands, FP32 accumulation; model_ops_attention_gemm.cu), looped or
//           batched over the chunk (bitwise equal); taken whenever one sequence's workspace fits
//           under the cap (512 MiB by default).
//   flash   the kernels below, FlashAttention-2 style on the CUDA cores in FP32, no workspace:
//           the fallback for sequences too long for the workspace. In bf16 they round the
//           operands to BF16 as they stage them and P, dS before they multiply.
// This file checks the arguments, picks the path, and holds the flash kernels and the Di pass the
// two backwards share:
//   forward     one block per (32-query tile, head, sequence); 32-key tiles of K and V staged in
//               shared memory; online softmax; writes out [T, H, Dv] and lse [H, T]. In bf16 a
//               first pass over the key tiles finds each row's final max and sum, so that the
//               second rounds the final probabilities bf(P) (scores computed twice).
//   backward    Di = rowsum(dout * out) first; then dq per query tile (as the forward, P rebuilt
//               from lse) and dk, dv per key tile (looping over the query tiles at or after it).
//               Two passes instead of atomics: the results are deterministic.
// Layout inside a block: 8 warps x 4 rows = 32 rows; for scores, lane c is key (or query) c of
// the tile; for the accumulators, lane l owns the head-dim columns l, l + 32, ... (kCols of them).
// Head dims up to 256 (kCols <= 8); T = B * seq_len, rows of one sequence contiguous.
#include <algorithm>
#include <string>
#include <type_traits>

#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kTile = 32;                       // query rows and key rows per tile
constexpr int kWarps = 8;                       // 256 threads
constexpr int kRowsPerWarp = kTile / kWarps;    // 4
constexpr int kMaxHeadDim = 256;

// An odd row stride: lane-indexed rows then fall in distinct banks.
__host__ __device__ constexpr int odd_stride(int d) { return d | 1; }

// x as a GEMM operand of the compute: rounded to BF16 (kBf16) or FP32 as it is.
template <bool kBf16>
__device__ __forceinline__ float operand(float x) {
  if constexpr (kBf16) return bf16_rounded(x);
  return x;
}

// dst [kTile, stride] <- rows j0.. of x [T, H, D] (head h of sequence b) as operands (kBf16:
// rounded to BF16), zeros past the sequence end and in the stride padding.
template <bool kBf16>
__device__ __forceinline__ void load_tile(float* dst, int stride, const float* __restrict__ x, int64_t b, int64_t S,
                                          int64_t H, int64_t h, int64_t j0, int D) {
  for (int e = threadIdx.x; e < kTile * stride; e += kWarps * 32) {
    const int r = e / stride, c = e - r * stride;
    const int64_t j = j0 + r;
    dst[e] = (c < D && j < S) ? operand<kBf16>(x[((b * S + j) * H + h) * D + c]) : 0.0f;
  }
}

// dot[rr] = rows[r0 + rr] . x over D columns for this warp's rows of a tile (rows [32, D], read as
// broadcasts; x this lane's row of the other tile), FMAs in column order.
__device__ __forceinline__ void warp_dots(const float* rows, const float* x, int D, int r0,
                                          float (&dot)[kRowsPerWarp]) {
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) dot[rr] = 0.0f;
  for (int d = 0; d < D; ++d) {
    const float xd = x[d];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) dot[rr] = fmaf(rows[(r0 + rr) * D + d], xd, dot[rr]);
  }
}

// The forward's scaled scores s[rr] of this warp's rows r0 + rr of the query tile at i0 (Qs
// [32, Dk]) against key j0 + lane (Ks [32, ks], lane-indexed), -inf where masked (a key after the
// query, a row past the sequence end).
__device__ __forceinline__ void tile_scores(const float* Qs, const float* Ks, int Dk, int ks, int r0, int lane,
                                            int64_t i0, int64_t j0, int64_t S, float scale,
                                            float (&s)[kRowsPerWarp]) {
  warp_dots(Qs, Ks + lane * ks, Dk, r0, s);
  const int64_t j = j0 + lane;
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = i0 + r0 + rr;
    s[rr] = (i < S && j <= i) ? s[rr] * scale : -INFINITY;
  }
}

// One online-softmax step of a row over a key tile (s: this lane's key's score, -inf where
// masked): folds the tile into the row's running max m and sum l, returns exp(s - m) with the new
// max, and sets corr = exp(m_old - m_new), the factor the row's earlier terms take (1 while the
// row has no valid key, a row past the sequence end).
__device__ __forceinline__ float online_softmax(float s, float& m, float& l, float& corr) {
  const float m_new = fmaxf(m, warp_max(s));
  corr = 1.0f;
  if (m_new == -INFINITY) return 0.0f;
  const float p = s == -INFINITY ? 0.0f : expf(s - m_new);
  corr = m == -INFINITY ? 0.0f : expf(m - m_new);
  l = l * corr + warp_sum(p);
  m = m_new;
  return p;
}

// out [T, H, Dv], lse [H, T] from q, k [T, H, Dk], v [T, H, Dv]. Grid (ceil(S/32), H, B).
template <int kCols, bool kBf16>
__global__ void __launch_bounds__(kWarps * 32) attention_forward_kernel(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, float* __restrict__ out,
    float* __restrict__ lse, int64_t T, int64_t S, int64_t H, int Dk, int Dv, float scale) {
  extern __shared__ float smem[];
  const int ks = odd_stride(Dk), vs = kCols * 32;
  float* Qs = smem;                 // [32, Dk]  query rows (read as broadcasts)
  float* Ks = Qs + kTile * Dk;      // [32, ks]  key rows (lane-indexed)
  float* Vs = Ks + kTile * ks;      // [32, kCols*32] value rows, zero past Dv
  const int64_t i0 = int64_t(blockIdx.x) * kTile, h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * kRowsPerWarp;
  load_tile<kBf16>(Qs, Dk, q, b, S, H, h, i0, Dk);

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kCols];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[rr][c] = 0.0f;
  }
  const int64_t last = min(S - 1, i0 + kTile - 1);  // the tile's last query row
  if constexpr (kBf16) {  // the first pass: each row's final max and sum
    for (int64_t j0 = 0; j0 <= last; j0 += kTile) {
      __syncthreads();  // the previous K tile is consumed (and Q is loaded, first time)
      load_tile<true>(Ks, ks, k, b, S, H, h, j0, Dk);
      __syncthreads();
      float s[kRowsPerWarp], corr;
      tile_scores(Qs, Ks, Dk, ks, r0, lane, i0, j0, S, scale, s);
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) online_softmax(s[rr], m[rr], l[rr], corr);
    }
  }
  for (int64_t j0 = 0; j0 <= last; j0 += kTile) {
    __syncthreads();  // the previous K, V tiles are consumed (and Q is loaded, first time)
    load_tile<kBf16>(Ks, ks, k, b, S, H, h, j0, Dk);
    load_tile<kBf16>(Vs, vs, v, b, S, H, h, j0, Dv);
    __syncthreads();
    float s[kRowsPerWarp], p[kRowsPerWarp];
    tile_scores(Qs, Ks, Dk, ks, r0, lane, i0, j0, S, scale, s);
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      if constexpr (kBf16) {  // bf(P) with the final max and sum
        p[rr] = s[rr] == -INFINITY ? 0.0f : bf16_rounded(expf(s[rr] - m[rr]) * (1.0f / l[rr]));
      } else {
        float corr;
        p[rr] = online_softmax(s[rr], m[rr], l[rr], corr);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[rr][c] *= corr;
      }
    }
    // acc += P V: key c's probability comes from lane c.
    for (int c = 0; c < kTile; ++c) {
      const float* vr = Vs + c * vs + lane;
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float pc = __shfl_sync(0xffffffffu, p[rr], c);
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) acc[rr][cc] = fmaf(pc, vr[cc * 32], acc[rr][cc]);
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = i0 + r0 + rr;
    if (i >= S) continue;
    const int64_t ti = b * S + i;
    const float inv = kBf16 ? 1.0f : 1.0f / l[rr];  // bf16: P was normalized before it was rounded
    float* o = out + (ti * H + h) * Dv;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d < Dv) o[d] = acc[rr][c] * inv;
    }
    if (lane == 0) lse[h * T + ti] = m[rr] + logf(l[rr]);
  }
}

// di [H, T] = sum_d dout * out (FP64 sum), one warp per (t, h).
__global__ void attention_di_kernel(const float* __restrict__ out, const float* __restrict__ dout,
                                    float* __restrict__ di, int64_t T, int64_t H, int Dv) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= T * H) return;
  const int64_t t = w / H, h = w - t * H;
  const float* o = out + w * Dv;
  const float* g = dout + w * Dv;
  double acc = 0;
  for (int d = lane; d < Dv; d += 32) acc += double(g[d]) * double(o[d]);
  acc = warp_sum(acc);
  if (lane == 0) di[h * T + t] = float(acc);
}

// dq [T, H, Dk] for one query tile. Grid (ceil(S/32), H, B).
template <int kCols, bool kBf16>
__global__ void __launch_bounds__(kWarps * 32) attention_dq_kernel(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ lse, const float* __restrict__ di, const float* __restrict__ dout,
    float* __restrict__ dq, int64_t T, int64_t S, int64_t H, int Dk, int Dv, float scale) {
  extern __shared__ float smem[];
  const int ks = odd_stride(Dk), vs = odd_stride(Dv);
  float* Qs = smem;                // [32, Dk] query rows (broadcast)
  float* Gs = Qs + kTile * Dk;     // [32, Dv] dout rows (broadcast)
  float* Ks = Gs + kTile * Dv;     // [32, ks] key rows
  float* Vs = Ks + kTile * ks;     // [32, vs] value rows
  const int64_t i0 = int64_t(blockIdx.x) * kTile, h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * kRowsPerWarp;
  load_tile<kBf16>(Qs, Dk, q, b, S, H, h, i0, Dk);
  load_tile<kBf16>(Gs, Dv, dout, b, S, H, h, i0, Dv);
  float row_lse[kRowsPerWarp], row_di[kRowsPerWarp], acc[kRowsPerWarp][kCols];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = i0 + r0 + rr;
    row_lse[rr] = i < S ? lse[h * T + b * S + i] : 0.0f;
    row_di[rr] = i < S ? di[h * T + b * S + i] : 0.0f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[rr][c] = 0.0f;
  }
  const int64_t last = min(S - 1, i0 + kTile - 1);
  for (int64_t j0 = 0; j0 <= last; j0 += kTile) {
    __syncthreads();
    load_tile<kBf16>(Ks, ks, k, b, S, H, h, j0, Dk);
    load_tile<kBf16>(Vs, vs, v, b, S, H, h, j0, Dv);
    __syncthreads();
    float s[kRowsPerWarp], dp[kRowsPerWarp];
    warp_dots(Qs, Ks + lane * ks, Dk, r0, s);
    warp_dots(Gs, Vs + lane * vs, Dv, r0, dp);
    const int64_t j = j0 + lane;
    float ds[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int64_t i = i0 + r0 + rr;
      const float p = (i < S && j <= i) ? expf(s[rr] * scale - row_lse[rr]) : 0.0f;
      ds[rr] = operand<kBf16>(p * (dp[rr] - row_di[rr]) * scale);
    }
    // dq += dS K: key c's ds comes from lane c.
    for (int c = 0; c < kTile; ++c) {
      const float* kc = Ks + c * ks;
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float dsc = __shfl_sync(0xffffffffu, ds[rr], c);
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
          const int d = lane + 32 * cc;
          if (d < Dk) acc[rr][cc] = fmaf(dsc, kc[d], acc[rr][cc]);
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t i = i0 + r0 + rr;
    if (i >= S) continue;
    float* o = dq + ((b * S + i) * H + h) * Dk;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d < Dk) o[d] = acc[rr][c];
    }
  }
}

// dk [T, H, Dk], dv [T, H, Dv] for one key tile. Grid (ceil(S/32), H, B).
template <int kCols, bool kBf16>
__global__ void __launch_bounds__(kWarps * 32) attention_dkv_kernel(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ lse, const float* __restrict__ di, const float* __restrict__ dout,
    float* __restrict__ dk, float* __restrict__ dv, int64_t T, int64_t S, int64_t H, int Dk, int Dv, float scale) {
  extern __shared__ float smem[];
  const int qs = odd_stride(Dk), gs = odd_stride(Dv);
  float* Ks = smem;                // [32, Dk] key rows (broadcast)
  float* Vs = Ks + kTile * Dk;     // [32, Dv] value rows (broadcast)
  float* Qs = Vs + kTile * Dv;     // [32, qs] query rows
  float* Gs = Qs + kTile * qs;     // [32, gs] dout rows
  float* Ls = Gs + kTile * gs;     // [32] lse of the query rows
  float* Ds = Ls + kTile;          // [32] Di of the query rows
  const int64_t j0 = int64_t(blockIdx.x) * kTile, h = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, r0 = (threadIdx.x >> 5) * kRowsPerWarp;
  load_tile<kBf16>(Ks, Dk, k, b, S, H, h, j0, Dk);
  load_tile<kBf16>(Vs, Dv, v, b, S, H, h, j0, Dv);
  float dka[kRowsPerWarp][kCols], dva[kRowsPerWarp][kCols];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr)
#pragma unroll
    for (int c = 0; c < kCols; ++c) dka[rr][c] = dva[rr][c] = 0.0f;
  for (int64_t i0 = j0; i0 < S; i0 += kTile) {
    __syncthreads();
    load_tile<kBf16>(Qs, qs, q, b, S, H, h, i0, Dk);
    load_tile<kBf16>(Gs, gs, dout, b, S, H, h, i0, Dv);
    if (threadIdx.x < kTile) {
      const int64_t i = i0 + threadIdx.x;
      Ls[threadIdx.x] = i < S ? lse[h * T + b * S + i] : 0.0f;
      Ds[threadIdx.x] = i < S ? di[h * T + b * S + i] : 0.0f;
    }
    __syncthreads();
    // Scores of query i0 + lane against this warp's keys.
    float s[kRowsPerWarp], dp[kRowsPerWarp];
    warp_dots(Ks, Qs + lane * qs, Dk, r0, s);
    warp_dots(Vs, Gs + lane * gs, Dv, r0, dp);
    const int64_t i = i0 + lane;
    float p[kRowsPerWarp], ds[kRowsPerWarp];
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int64_t j = j0 + r0 + rr;
      const float pr = (i < S && j <= i) ? expf(s[rr] * scale - Ls[lane]) : 0.0f;
      ds[rr] = operand<kBf16>(pr * (dp[rr] - Ds[lane]) * scale);
      p[rr] = operand<kBf16>(pr);
    }
    // dv += P^T dout, dk += dS^T Q: query c's p and ds come from lane c.
    for (int c = 0; c < kTile; ++c) {
      const float* qc = Qs + c * qs;
      const float* gc = Gs + c * gs;
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const float pc = __shfl_sync(0xffffffffu, p[rr], c);
        const float dsc = __shfl_sync(0xffffffffu, ds[rr], c);
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
          const int d = lane + 32 * cc;
          if (d < Dv) dva[rr][cc] = fmaf(pc, gc[d], dva[rr][cc]);
          if (d < Dk) dka[rr][cc] = fmaf(dsc, qc[d], dka[rr][cc]);
        }
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const int64_t j = j0 + r0 + rr;
    if (j >= S) continue;
    float* okk = dk + ((b * S + j) * H + h) * Dk;
    float* ovv = dv + ((b * S + j) * H + h) * Dv;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d < Dk) okk[d] = dka[rr][c];
      if (d < Dv) ovv[d] = dva[rr][c];
    }
  }
}

// Checks the arguments; true when compute is bf16.
bool check_attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                     const TensorView& lse, int64_t seq_len, DType compute, const char* op) {
  check_f32(q, op, "q", 3);
  check_f32(k, op, "k", 3);
  check_f32(v, op, "v", 3);
  check_f32(out, op, "out", 3);
  check_f32(lse, op, "lse", 2);
  const int64_t N = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2);
  check_shape(k, (std::string(op) + ": k").c_str(), {N, H, Dk});
  check_shape(v, (std::string(op) + ": v").c_str(), {N, H, Dv});
  check_shape(out, (std::string(op) + ": out").c_str(), {N, H, Dv});
  check_shape(lse, (std::string(op) + ": lse").c_str(), {H, N});
  FP8MOE_CHECK(seq_len > 0 && N % seq_len == 0, op << ": seq_len = " << seq_len << " must divide T = " << N);
  FP8MOE_CHECK(Dk >= 1 && Dv >= 1, op << ": head dims Dk = " << Dk << ", Dv = " << Dv << " must be positive");
  FP8MOE_CHECK(compute == DType::bf16 || compute == DType::f32,
               op << ": compute = " << dtype_name(compute) << " must be bf16 or the tensors' dtype f32");
  return compute == DType::bf16;
}

// Whether the GEMM path runs batched (AttentionPath::gemm_batched) for this call.
bool gemm_batched(AttentionPath path, int64_t B, int64_t S, int64_t H) {
  if (path == AttentionPath::gemm_looped || path == AttentionPath::gemm_batched)
    return path == AttentionPath::gemm_batched;
  return cuda_attention_batched(B, S, H);
}

// The GEMM path's sequences per chunk for this call (the forward's or the backward's
// workspace), or 0 for the flash kernels.
int64_t gemm_chunk(AttentionPath path, int64_t B, int64_t S, int64_t H, int64_t Dk, int64_t Dv, DType compute,
                   bool backward, size_t cap, const char* op) {
  if (path == AttentionPath::flash) return 0;
  const size_t per = cuda_attention_workspace_bytes(S, H, Dk, Dv, compute, backward, gemm_batched(path, B, S, H));
  const int64_t chunk = attention_gemm_chunk(B, per, cap);
  FP8MOE_CHECK(chunk > 0 || path == AttentionPath::automatic,
               op << ": the GEMM path needs " << per << " bytes of workspace for one sequence (H = " << H
                  << ", seq_len = " << S << ", compute " << dtype_name(compute) << "), over the cap of " << cap
                  << " bytes");
  return chunk;
}

// The flash kernels' limits: head dims up to kMaxHeadDim, H and B within a grid dimension.
void check_flash(int64_t H, int64_t B, int Dk, int Dv, const char* op) {
  FP8MOE_CHECK(Dk <= kMaxHeadDim && Dv <= kMaxHeadDim,
               op << ": head dims Dk = " << Dk << ", Dv = " << Dv << " must be in [1, " << kMaxHeadDim
                  << "] for cuda's flash kernels (the GEMM path takes any, within its workspace cap)");
  FP8MOE_CHECK(H <= 65535 && B <= 65535,
               op << ": H = " << H << " and B = " << B << " must be at most 65535 for cuda's flash kernels");
}

// Launches kernel<kCols, kBf16> with kCols = the smallest of 1, 2, 4, 8 covering
// ceil(max(Dk, Dv) / 32): launch(cols, bf16) with std::integral_constant arguments.
template <class Launch>
void dispatch_kernel(int Dk, int Dv, bool bf16, Launch&& launch) {
  const auto with_cols = [&](auto cols) {
    if (bf16)
      launch(cols, std::true_type{});
    else
      launch(cols, std::false_type{});
  };
  const int need = (std::max(Dk, Dv) + 31) / 32;
  if (need <= 1)
    with_cols(std::integral_constant<int, 1>{});
  else if (need <= 2)
    with_cols(std::integral_constant<int, 2>{});
  else if (need <= 4)
    with_cols(std::integral_constant<int, 4>{});
  else
    with_cols(std::integral_constant<int, 8>{});
}

template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

}  // namespace

bool cuda_attention_batched(int64_t B, int64_t S, int64_t H) {
  int dev = 0, sms = 0;
  FP8MOE_CUDA_CHECK(cudaGetDevice(&dev));
  FP8MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t tiles = std::max(B, H) * ceil_div(S, 128) * ceil_div(S, 128);  // a looped scores GEMM's
  return tiles < sms;
}

void cuda_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, int64_t seq_len, double scale, DType compute, cudaStream_t stream, AttentionPath path,
                            size_t workspace_cap) {
  const char* op = "attention_forward";
  const bool bf16 = check_attention(q, k, v, out, lse, seq_len, compute, op);
  const int64_t T = q.size(0), H = q.size(1), S = seq_len, B = T / S;
  const int Dk = int(q.size(2)), Dv = int(v.size(2));
  if (T == 0 || H == 0) return;
  if (const int64_t chunk = gemm_chunk(path, B, S, H, Dk, Dv, compute, false, workspace_cap, op)) {
    attention_gemm_forward(q, k, v, out, lse, seq_len, scale, bf16, chunk, gemm_batched(path, B, S, H), stream);
    return;
  }
  check_flash(H, B, Dk, Dv, op);
  const dim3 grid(unsigned(ceil_div(S, kTile)), unsigned(H), unsigned(B));
  dispatch_kernel(Dk, Dv, bf16, [&](auto cols, auto bf) {
    constexpr int kCols = decltype(cols)::value;
    constexpr bool kBf16 = decltype(bf)::value;
    const size_t smem = sizeof(float) * size_t(kTile) * size_t(Dk + odd_stride(Dk) + kCols * 32);
    allow_smem(attention_forward_kernel<kCols, kBf16>, smem);
    attention_forward_kernel<kCols, kBf16><<<grid, kWarps * 32, smem, stream>>>(
        q.ptr<const float>(), k.ptr<const float>(), v.ptr<const float>(), out.ptr<float>(), lse.ptr<float>(), T, S,
        H, Dk, Dv, float(scale));
    FP8MOE_CUDA_CHECK_LAUNCH("attention_forward_kernel");
  });
}

void cuda_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& lse, const TensorView& dout, const TensorView& dq,
                             const TensorView& dk, const TensorView& dv, int64_t seq_len, double scale,
                             DType compute, cudaStream_t stream, AttentionPath path, size_t workspace_cap) {
  const char* op = "attention_backward";
  const bool bf16 = check_attention(q, k, v, out, lse, seq_len, compute, op);
  const int64_t T = q.size(0), H = q.size(1), S = seq_len, B = T / S;
  const int Dk = int(q.size(2)), Dv = int(v.size(2));
  check_f32(dout, op, "dout", 3);
  check_shape(dout, "attention_backward: dout", {T, H, Dv});
  check_f32(dq, op, "dq", 3);
  check_shape(dq, "attention_backward: dq", {T, H, Dk});
  check_f32(dk, op, "dk", 3);
  check_shape(dk, "attention_backward: dk", {T, H, Dk});
  check_f32(dv, op, "dv", 3);
  check_shape(dv, "attention_backward: dv", {T, H, Dv});
  if (T == 0 || H == 0) return;
  const int64_t chunk = gemm_chunk(path, B, S, H, Dk, Dv, compute, true, workspace_cap, op);
  if (!chunk) check_flash(H, B, Dk, Dv, op);
  DeviceBuffer di(size_t(H * T) * sizeof(float), stream);  // [H, T] rowsum(dout * out)
  attention_di_kernel<<<grid_for(T * H * 32, 256, INT32_MAX), 256, 0, stream>>>(out.ptr<const float>(), dout.ptr<const float>(),
                                                                     di.as<float>(), T, H, Dv);
  FP8MOE_CUDA_CHECK_LAUNCH("attention_di_kernel");
  if (chunk) {
    attention_gemm_backward(q, k, v, lse, di.as<const float>(), dout, dq, dk, dv, seq_len, scale, bf16, chunk,
                            gemm_batched(path, B, S, H), stream);
    return;
  }
  const dim3 grid(unsigned(ceil_div(S, kTile)), unsigned(H), unsigned(B));
  dispatch_kernel(Dk, Dv, bf16, [&](auto cols, auto bf) {
    constexpr int kCols = decltype(cols)::value;
    constexpr bool kBf16 = decltype(bf)::value;
    const size_t smem_q = sizeof(float) * size_t(kTile) * size_t(Dk + Dv + odd_stride(Dk) + odd_stride(Dv));
    allow_smem(attention_dq_kernel<kCols, kBf16>, smem_q);
    attention_dq_kernel<kCols, kBf16><<<grid, kWarps * 32, smem_q, stream>>>(
        q.ptr<const float>(), k.ptr<const float>(), v.ptr<const float>(), lse.ptr<const float>(),
        di.as<const float>(), dout.ptr<const float>(), dq.ptr<float>(), T, S, H, Dk, Dv, float(scale));
    FP8MOE_CUDA_CHECK_LAUNCH("attention_dq_kernel");
    const size_t smem_kv = smem_q + sizeof(float) * 2 * kTile;
    allow_smem(attention_dkv_kernel<kCols, kBf16>, smem_kv);
    attention_dkv_kernel<kCols, kBf16><<<grid, kWarps * 32, smem_kv, stream>>>(
        q.ptr<const float>(), k.ptr<const float>(), v.ptr<const float>(), lse.ptr<const float>(),
        di.as<const float>(), dout.ptr<const float>(), dk.ptr<float>(), dv.ptr<float>(), T, S, H, Dk, Dv,
        float(scale));
    FP8MOE_CUDA_CHECK_LAUNCH("attention_dkv_kernel");
  });
}

}  // namespace fp8moe::cuda
