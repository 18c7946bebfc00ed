// CUDA elementwise and data-movement model ops: convert, axpy, copy_cols, transpose, token
// embedding (forward gather, deterministic backward scatter-add), SwiGLU forward/backward and
// rotary position embedding, the SwiGLU backward from the FP8-cached input and the FP8 recipes'
// SwiGLU forward with its three quantizations in one pass. Semantics are those of
// src/cpu/ops_dense.cpp, ops_embed_loss.cpp, ops_mlp.cpp, ops_attention.cpp (rope) and backends.cpp;
// tests: tests/cuda/test_cuda_model_ops.cpp, tests/cpu/test_backend_ops.cpp (the two FP8 SwiGLU ops).
// NOTES: float products and sums that the CPU rounds separately use __fmul_rn / __fadd_rn so
// that nvcc does not contract them into FMAs: axpy, embedding_backward and the AdamW update are
// then bit-identical to the CPU.
#include "cuda/runtime/device_checks.hpp"
#include "cuda/ops/model_ops.hpp"
#include "cuda/ops/model_ops_util.cuh"
#include "cuda/ops/swiglu_device.cuh"
#include "cuda/quant/quantize_device.cuh"

namespace fp8moe::cuda {

using namespace ops;

namespace {

constexpr int kThreads = 256;

#define FP8MOE_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

// dst [n] = src [n] between f32, f64 and bf16 (through double, as the CPU's load_any/store_any).
__global__ void convert_kernel(const void* src, int sdt, void* dst, int ddt, int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) store_any(dst, ddt, i, load_any(src, sdt, i));
}

// y [n] = a * x + b * y, or y += a * x when beta == 1 (the CPU's two loops).
__global__ void axpy_kernel(float a, const float* __restrict__ x, float b, float* __restrict__ y, int64_t n,
                            bool beta_one) {
  FP8MOE_GRID_STRIDE(i, n) {
    y[i] = beta_one ? __fadd_rn(y[i], __fmul_rn(a, x[i])) : __fadd_rn(__fmul_rn(a, x[i]), __fmul_rn(b, y[i]));
  }
}

// dst [R, Cd] cols [dc, dc + nc) (+)= src [R, Cs] cols [sc, sc + nc), any float dtypes.
__global__ void copy_cols_kernel(const void* src, int sdt, int64_t Cs, int64_t sc, void* dst, int ddt, int64_t Cd,
                                 int64_t dc, int64_t R, int64_t nc, bool accumulate) {
  FP8MOE_GRID_STRIDE(i, R * nc) {
    const int64_t r = i / nc, j = i - r * nc;
    const int64_t di = r * Cd + dc + j;
    double v = load_any(src, sdt, r * Cs + sc + j);
    if (accumulate) v += load_any(dst, ddt, di);
    store_any(dst, ddt, di, v);
  }
}

// dst [C, R] = src [R, C]^T through a 32x32 shared tile (+1 column against bank conflicts).
// Grid (ceil(C/32), ceil(R/32)), block (32, 8).
template <class E>
__global__ void transpose_kernel(const E* __restrict__ src, E* __restrict__ dst, int64_t R, int64_t C) {
  __shared__ E tile[32][33];  // (r, c) of the block's [32, 32] source tile
  const int64_t r0 = int64_t(blockIdx.y) * 32, c0 = int64_t(blockIdx.x) * 32;
  for (int k = threadIdx.y; k < 32; k += 8) {
    const int64_t r = r0 + k, c = c0 + threadIdx.x;
    if (r < R && c < C) tile[k][threadIdx.x] = src[r * C + c];
  }
  __syncthreads();
  for (int k = threadIdx.y; k < 32; k += 8) {
    const int64_t c = c0 + k, r = r0 + threadIdx.x;
    if (r < R && c < C) dst[c * R + r] = tile[threadIdx.x][k];
  }
}

// out [N, D] = table [V, D] rows ids [N] (NaN rows for ids outside [0, V): a deferred range check
// reports them).
__global__ void embedding_forward_kernel(const int32_t* __restrict__ ids, const float* __restrict__ table,
                                         float* __restrict__ out, int64_t N, int64_t D, int64_t V) {
  FP8MOE_GRID_STRIDE(i, N * D) {
    const int64_t t = i / D, j = i - t * D, id = ids[t];
    out[i] = id >= 0 && id < V ? table[id * D + j] : NAN;
  }
}

__global__ void swiglu_forward_kernel(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ o,
                                      int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) o[i] = swiglu_value(g[i], u[i]);
}

__global__ void swiglu_backward_kernel(const float* __restrict__ g, const float* __restrict__ u,
                                       const float* __restrict__ d, float* __restrict__ dg, float* __restrict__ du,
                                       int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) {
    float dgi, dui;
    swiglu_grad(g[i], u[i], d[i], dgi, dui);
    du[i] = dui;
    dg[i] = dgi;
  }
}

// The FP8 SwiGLU input: values [R, F] bytes and 1x128 scales [ceil(F/128), ld] (group-major: the
// scale of (r, c) at (c / 128) * ld + r).
struct Fp8Tiles {
  const uint8_t* __restrict__ q;
  const float* __restrict__ s;
  int64_t ld;
  __device__ float scale(int64_t r, int64_t c) const { return s[(c / kQuantGroup) * ld + r]; }
};

// swiglu_backward_fp8, one element per thread: the fallback for F % 16 != 0 or unaligned tensors.
// g = decode(q) * scale as one IEEE product (dequantize_kernel's), then swiglu_value/swiglu_grad.
template <bool kE5M2>
__global__ void swiglu_backward_fp8_kernel(Fp8Tiles gt, Fp8Tiles ut, const float* __restrict__ d, float* o,
                                           float* __restrict__ dg, float* __restrict__ du, int64_t T, int64_t F) {
  FP8MOE_GRID_STRIDE(i, T * F) {
    const int64_t r = i / F, c = i - r * F;
    const float g = __fmul_rn(decode<kE5M2>(gt.q[i]), gt.scale(r, c));
    const float u = __fmul_rn(decode<kE5M2>(ut.q[i]), ut.scale(r, c));
    if (o) o[i] = swiglu_value(g, u);
    swiglu_grad(g, u, d[i], dg[i], du[i]);
  }
}

// The same with 16 consecutive elements of a row per thread (F % 16 == 0, every tensor 16-byte
// aligned): one 16-byte load of gate and of up bytes, four of dout, four 16-byte stores per
// output; 16 elements never straddle a 128-column tile, so one scale of each per vector.
template <bool kE5M2>
__global__ void swiglu_backward_fp8_vec_kernel(Fp8Tiles gt, Fp8Tiles ut, const float* __restrict__ d, float* o,
                                               float* __restrict__ dg, float* __restrict__ du, int64_t T,
                                               int64_t F) {
  const int64_t vpr = F / 16;  // vectors per row
  FP8MOE_GRID_STRIDE(v, T * vpr) {
    const int64_t r = v / vpr, c0 = (v - r * vpr) * 16, i0 = r * F + c0;
    const uint4 graw = *reinterpret_cast<const uint4*>(gt.q + i0);
    const uint4 uraw = *reinterpret_cast<const uint4*>(ut.q + i0);
    const float sg = gt.scale(r, c0), su = ut.scale(r, c0);
    float4 dv[4], ov[4], dgv[4], duv[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) dv[j] = reinterpret_cast<const float4*>(d + i0)[j];
#pragma unroll
    for (int p = 0; p < 8; ++p) {  // values 2p, 2p + 1: components (2p) % 4, (2p + 1) % 4 of vector p / 2
      const float2 g2 = pair16_fp8<kE5M2>(graw, p), u2 = pair16_fp8<kE5M2>(uraw, p);
      const float g0 = __fmul_rn(g2.x, sg), g1 = __fmul_rn(g2.y, sg);
      const float u0 = __fmul_rn(u2.x, su), u1 = __fmul_rn(u2.y, su);
      const float4& dj = dv[p / 2];
      const float d0 = p % 2 ? dj.z : dj.x, d1 = p % 2 ? dj.w : dj.y;
      float a0, a1, dg0, dg1, du0, du1;
      a0 = swiglu_value(g0, u0);
      a1 = swiglu_value(g1, u1);
      swiglu_grad(g0, u0, d0, dg0, du0);
      swiglu_grad(g1, u1, d1, dg1, du1);
      float4& oj = ov[p / 2];
      float4& gj = dgv[p / 2];
      float4& uj = duv[p / 2];
      if (p % 2) {
        oj.z = a0, oj.w = a1, gj.z = dg0, gj.w = dg1, uj.z = du0, uj.w = du1;
      } else {
        oj.x = a0, oj.y = a1, gj.x = dg0, gj.y = dg1, uj.x = du0, uj.y = du1;
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (o) reinterpret_cast<float4*>(o + i0)[j] = ov[j];
      reinterpret_cast<float4*>(dg + i0)[j] = dgv[j];
      reinterpret_cast<float4*>(du + i0)[j] = duv[j];
    }
  }
}

__device__ int g_swiglu_nonfinite;  // swiglu_forward_fp8: a tile's amax was NaN/Inf

// swiglu_forward_fp8: one warp per (row, 128-column tile), four consecutive columns per lane (one
// 16-byte load of gate and of up and 4-byte code stores when kVec: F % 4 == 0, aligned tensors).
// Each tile's amax over the warp, its scale and codes as quantize_1x128's (quantize_device.cuh),
// the SwiGLU value as swiglu_forward's: bit-identical to the three quantizations and the SwiGLU
// apart. Rows T..R-1 of out get zero codes and scale 1; every scale past the rows (the scale_ld
// padding) gets 1, as the quantizers' fill_padding writes.
template <bool kVec>
__global__ void swiglu_forward_fp8_kernel(const float* __restrict__ g, const float* __restrict__ u,
                                          uint8_t* __restrict__ gq, float* __restrict__ gs, uint8_t* __restrict__ uq,
                                          float* __restrict__ us, uint8_t* __restrict__ aq, float* __restrict__ as,
                                          int64_t T, int64_t R, int64_t F, int64_t ld_t, int64_t ld_r, bool pow2) {
  const int lane = threadIdx.x % 32;
  const int64_t G = (F + 127) / 128, warps = int64_t(gridDim.x) * blockDim.x / 32;
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < ld_r * G; w += warps) {
    const int64_t r = w / G, tile = w - r * G, c0 = tile * 128 + lane * 4, i0 = r * F + c0;
    const int n = cols4(F, c0);
    if (r >= T) {  // padding: out's zero rows, and the scale_ld padding of all three
      if (r < R) store_codes4<kVec>(aq + i0, n, 0);
      if (lane == 0) {
        as[tile * ld_r + r] = 1.0f;
        if (r < ld_t) gs[tile * ld_t + r] = us[tile * ld_t + r] = 1.0f;
      }
      continue;
    }
    float gv[4], uv[4], av[4] = {0, 0, 0, 0};
    load_cols4<kVec>(g + i0, n, gv);
    load_cols4<kVec>(u + i0, n, uv);
    float ga = 0.0f, ua = 0.0f, aa = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k < n) av[k] = swiglu_value(gv[k], uv[k]);
      ga = amax_nan(ga, gv[k]);
      ua = amax_nan(ua, uv[k]);
      aa = amax_nan(aa, av[k]);
    }
    ga = lanes_amax<32>(ga);
    ua = lanes_amax<32>(ua);
    aa = lanes_amax<32>(aa);
    if (lane == 0 && !(is_finite_amax(ga) && is_finite_amax(ua) && is_finite_amax(aa)))
      atomicExch(&g_swiglu_nonfinite, 1);
    const float sg = scale_of(ga, 448.0f, pow2), su = scale_of(ua, 448.0f, pow2), sa = scale_of(aa, 448.0f, pow2);
    const uint32_t cg = quantize4<false>(gv, inv_scale(sg)), cu = quantize4<false>(uv, inv_scale(su)),
                   ca = quantize4<false>(av, inv_scale(sa));
    store_codes4<kVec>(gq + i0, n, cg);
    store_codes4<kVec>(uq + i0, n, cu);
    store_codes4<kVec>(aq + i0, n, ca);
    if (lane == 0) {
      gs[tile * ld_t + r] = sg;
      us[tile * ld_t + r] = su;
      as[tile * ld_r + r] = sa;
    }
  }
}

// The rotation of pair i of rot columns at position `pos`: (s, c) = (sign * sin, cos) of pos *
// theta^(-2i/rot), in FP64 as the CPU op.
__device__ __forceinline__ void rope_angle(int32_t pos, int64_t i, int64_t rot, double theta, double sign, double& s,
                                           double& c) {
  const double freq = pow(theta, -2.0 * double(i) / double(rot));
  const double ang = double(pos) * freq;
  sincos(ang, &s, &c);
  s *= sign;
}
// p[0], p[1] rotated by (s, c), each product rounded on its own (no FMA), as the CPU op.
__device__ __forceinline__ void rope_rotate(float* p, double a, double b, double s, double c) {
  p[0] = __double2float_rn(__dsub_rn(__dmul_rn(a, c), __dmul_rn(b, s)));
  p[1] = __double2float_rn(__dadd_rn(__dmul_rn(a, s), __dmul_rn(b, c)));
}

// In place on x [N, H, C]: one thread per (token t, pair i) rotates pair i of every head.
__global__ void rope_kernel(float* x, const int32_t* __restrict__ pos, int64_t N, int64_t H, int64_t C, int64_t col0,
                            int64_t rot, double theta, double sign) {
  const int64_t half = rot / 2;
  FP8MOE_GRID_STRIDE(k, N * half) {
    const int64_t t = k / half, i = k - t * half;
    double s, c;
    rope_angle(pos[t], i, rot, theta, sign, s, c);
    for (int64_t h = 0; h < H; ++h) {
      float* p = x + (t * H + h) * C + col0 + 2 * i;
      rope_rotate(p, p[0], p[1], s, c);
    }
  }
}

// Backend::mla_split_kv, a block per token: the shared key's pairs rotated into shared memory
// (rope()'s arithmetic), then k [H, dn + dr] and v [H, dv] of the token written from kv and it.
__global__ void mla_split_kv_kernel(const float* __restrict__ kv, const float* __restrict__ ckv, int64_t ldc,
                                    int64_t pe_col, const int32_t* __restrict__ pos, int64_t T, int64_t H, int64_t dn,
                                    int64_t dr, int64_t dv, double theta, float* __restrict__ k, float* __restrict__ v) {
  extern __shared__ float pe[];  // [dr]
  const int64_t dqk = dn + dr, dkv = dn + dv;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    for (int64_t i = threadIdx.x; i < dr / 2; i += blockDim.x) {
      double s, c;
      rope_angle(pos[t], i, dr, theta, 1.0, s, c);
      const float* p = ckv + t * ldc + pe_col + 2 * i;
      rope_rotate(pe + 2 * i, p[0], p[1], s, c);
    }
    __syncthreads();
    const float* src = kv + t * H * dkv;
    for (int64_t j = threadIdx.x; j < H * dqk; j += blockDim.x) {
      const int64_t h = j / dqk, col = j - h * dqk;
      k[t * H * dqk + j] = col < dn ? src[h * dkv + col] : pe[col - dn];
    }
    for (int64_t j = threadIdx.x; j < H * dv; j += blockDim.x) {
      const int64_t h = j / dv, col = j - h * dv;
      v[t * H * dv + j] = src[h * dkv + dn + col];
    }
    __syncthreads();  // pe is the next token's
  }
}

// Its backward, a block per token: dkv's rows from dk and dv, and the shared key's gradient (the
// heads' sum in order, each add as copy_cols' accumulate: in FP64, rounded to f32) rotated back.
__global__ void mla_split_kv_backward_kernel(const float* __restrict__ dk, const float* __restrict__ dv,
                                             const int32_t* __restrict__ pos, int64_t T, int64_t H, int64_t dn,
                                             int64_t dr, int64_t dvw, double theta, float* __restrict__ dkv,
                                             float* __restrict__ dckv, int64_t ldc, int64_t pe_col) {
  const int64_t dqk = dn + dr, dkvw = dn + dvw;
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    const float* k = dk + t * H * dqk;
    for (int64_t j = threadIdx.x; j < H * dkvw; j += blockDim.x) {
      const int64_t h = j / dkvw, col = j - h * dkvw;
      dkv[t * H * dkvw + j] = col < dn ? k[h * dqk + col] : dv[(t * H + h) * dvw + col - dn];
    }
    for (int64_t i = threadIdx.x; i < dr / 2; i += blockDim.x) {
      float a = 0.0f, b = 0.0f;
      for (int64_t h = 0; h < H; ++h) {
        a = float(double(k[h * dqk + dn + 2 * i]) + double(a));
        b = float(double(k[h * dqk + dn + 2 * i + 1]) + double(b));
      }
      double s, c;
      rope_angle(pos[t], i, dr, theta, -1.0, s, c);
      rope_rotate(dckv + t * ldc + pe_col + 2 * i, a, b, s, c);
    }
  }
}

void check_any_dtype(const TensorView& t, const char* op, const char* arg) {
  FP8MOE_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16,
               op << ": " << arg << " must be f32, f64 or bf16, got " << t.str());
}

}  // namespace

void cuda_convert(const TensorView& src, const TensorView& dst, cudaStream_t stream) {
  FP8MOE_CHECK(src.numel() == dst.numel(), "convert: src " << src.str() << " and dst " << dst.str()
                                                           << " differ in element count");
  FP8MOE_CHECK(src.is_contiguous() && dst.is_contiguous(), "convert: src and dst must be contiguous");
  FP8MOE_CHECK(src.device == Device::cuda && dst.device == Device::cuda, "convert: device tensors only, got src "
                                                                            << src.str() << ", dst " << dst.str());
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype == dst.dtype) {
    FP8MOE_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  check_any_dtype(src, "convert", "src");
  check_any_dtype(dst, "convert", "dst");
  convert_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(src.data, int(src.dtype), dst.data, int(dst.dtype), n);
  FP8MOE_CUDA_CHECK_LAUNCH("convert_kernel");
}

void cuda_axpy(double alpha, const TensorView& x, double beta, const TensorView& y, cudaStream_t stream) {
  check_f32(y, "axpy", "y", -1);
  FP8MOE_CHECK(x.dtype == y.dtype && x.numel() == y.numel() && x.is_contiguous() && y.is_contiguous(),
               "axpy: x " << x.str() << " and y " << y.str() << " must match in dtype and size");
  FP8MOE_CHECK(x.device == Device::cuda, "axpy: x must be a device tensor, got " << x.str());
  const int64_t n = y.numel();
  if (n == 0) return;
  axpy_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(float(alpha), x.ptr<const float>(), float(beta), y.ptr<float>(), n,
                                                   beta == 1.0);
  FP8MOE_CUDA_CHECK_LAUNCH("axpy_kernel");
}

void cuda_copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col, int64_t ncols,
                    bool accumulate, cudaStream_t stream) {
  check_2d_any(src, "copy_cols", "src");
  check_2d_any(dst, "copy_cols", "dst");
  check_copy_cols(src, src_col, dst, dst_col, ncols);
  const int64_t R = src.size(0), Cs = src.size(1), Cd = dst.size(1);
  if (R == 0 || ncols == 0) return;
  if (src.dtype == dst.dtype && !accumulate) {
    const size_t es = dtype_size(src.dtype);
    FP8MOE_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst.data) + size_t(dst_col) * es, size_t(Cd) * es,
                                        static_cast<const char*>(src.data) + size_t(src_col) * es, size_t(Cs) * es,
                                        size_t(ncols) * es, size_t(R), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  copy_cols_kernel<<<grid_for(R * ncols, kThreads), kThreads, 0, stream>>>(src.data, int(src.dtype), Cs, src_col, dst.data,
                                                                int(dst.dtype), Cd, dst_col, R, ncols, accumulate);
  FP8MOE_CUDA_CHECK_LAUNCH("copy_cols_kernel");
}

void cuda_transpose(const TensorView& src, const TensorView& dst, cudaStream_t stream) {
  check_2d_any(src, "transpose", "src");
  check_2d_any(dst, "transpose", "dst");
  FP8MOE_CHECK(src.dtype == dst.dtype, "transpose: src " << src.str() << " and dst " << dst.str() << " differ in dtype");
  check_shape(dst, "transpose: dst", {src.size(1), src.size(0)});
  const int64_t R = src.size(0), C = src.size(1);
  if (R == 0 || C == 0) return;
  FP8MOE_CHECK(ceil_div(R, 32) <= 65535, "transpose: src " << src.str() << " has too many rows for one launch");
  const dim3 grid(unsigned(ceil_div(C, 32)), unsigned(ceil_div(R, 32))), block(32, 8);
  switch (dtype_size(src.dtype)) {
    case 2: transpose_kernel<<<grid, block, 0, stream>>>(src.ptr<const uint16_t>(), dst.ptr<uint16_t>(), R, C); break;
    case 4: transpose_kernel<<<grid, block, 0, stream>>>(src.ptr<const uint32_t>(), dst.ptr<uint32_t>(), R, C); break;
    default: transpose_kernel<<<grid, block, 0, stream>>>(src.ptr<const uint64_t>(), dst.ptr<uint64_t>(), R, C); break;
  }
  FP8MOE_CUDA_CHECK_LAUNCH("transpose_kernel");
}

void cuda_embedding_forward(const TensorView& ids, const TensorView& table, const TensorView& out, cudaStream_t stream) {
  check_dev(ids, "embedding_forward", "ids", DType::i32, 1);
  check_f32(table, "embedding_forward", "table", 2);
  check_f32(out, "embedding_forward", "out", 2);
  const int64_t N = ids.size(0), V = table.size(0), D = table.size(1);
  check_shape(out, "embedding_forward: out", {N, D});
  int32_t bad = 0;
  const int64_t t = first_out_of_range(ids.ptr<const int32_t>(), N, 0, V, &bad, "embedding_forward: ids", stream);
  FP8MOE_CHECK(t < 0, "embedding_forward: ids[" << t << "] = " << bad << " outside [0, " << V << ")");
  if (N * D == 0) return;
  embedding_forward_kernel<<<grid_for(N * D, kThreads), kThreads, 0, stream>>>(ids.ptr<const int32_t>(), table.ptr<const float>(),
                                                                    out.ptr<float>(), N, D, V);
  FP8MOE_CUDA_CHECK_LAUNCH("embedding_forward_kernel");
}

void cuda_embedding_backward(const TensorView& ids, const TensorView& dout, const TensorView& dtable, cudaStream_t stream) {
  check_dev(ids, "embedding_backward", "ids", DType::i32, 1);
  check_f32(dtable, "embedding_backward", "dtable", 2);
  check_f32(dout, "embedding_backward", "dout", 2);
  const int64_t N = ids.size(0), V = dtable.size(0), D = dtable.size(1);
  check_shape(dout, "embedding_backward: dout", {N, D});
  // NOTES: the CPU op does not check ids here (the forward did); an id outside the table would
  // write outside dtable on the device, so the range is checked again.
  int32_t bad = 0;
  const int64_t t = first_out_of_range(ids.ptr<const int32_t>(), N, 0, V, &bad, "embedding_backward: ids", stream);
  FP8MOE_CHECK(t < 0, "embedding_backward: ids[" << t << "] = " << bad << " outside [0, " << V << ")");
  if (N == 0 || D == 0) return;
  DeviceBuffer keys(size_t(N) * sizeof(int32_t), stream), pos(size_t(N) * sizeof(int32_t), stream);
  stable_sort_by_key(ids.ptr<const int32_t>(), N, V, keys.as<int32_t>(), pos.as<int32_t>(), stream);
  sorted_scatter_add(keys.as<int32_t>(), pos.as<int32_t>(), N, nullptr, dout.ptr<const float>(), dtable.ptr<float>(), D,
                     V, stream);
}

void cuda_swiglu_forward(const TensorView& gate, const TensorView& up, const TensorView& out, cudaStream_t stream) {
  check_f32(gate, "swiglu_forward", "gate", 2);
  check_f32(up, "swiglu_forward", "up", 2);
  check_f32(out, "swiglu_forward", "out", 2);
  check_shape(up, "swiglu_forward: up", {gate.size(0), gate.size(1)});
  check_shape(out, "swiglu_forward: out", {gate.size(0), gate.size(1)});
  const int64_t n = gate.numel();
  if (n == 0) return;
  swiglu_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(gate.ptr<const float>(), up.ptr<const float>(),
                                                             out.ptr<float>(), n);
  FP8MOE_CUDA_CHECK_LAUNCH("swiglu_forward_kernel");
}

void cuda_swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dout,
                          const TensorView& dgate, const TensorView& dup, cudaStream_t stream) {
  check_f32(gate, "swiglu_backward", "gate", 2);
  for (auto [t, name] : {std::pair{&up, "up"}, {&dout, "dout"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
    check_f32(*t, "swiglu_backward", name, 2);
    FP8MOE_CHECK(t->size(0) == gate.size(0) && t->size(1) == gate.size(1),
                 "swiglu_backward: " << name << " " << t->str() << " differs from gate " << gate.str());
  }
  const int64_t n = gate.numel();
  if (n == 0) return;
  swiglu_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(gate.ptr<const float>(), up.ptr<const float>(),
                                                              dout.ptr<const float>(), dgate.ptr<float>(),
                                                              dup.ptr<float>(), n);
  FP8MOE_CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}

void cuda_swiglu_backward_fp8(const QuantizedView& gate, const QuantizedView& up, const TensorView& dout,
                              const TensorView& out, const TensorView& dgate, const TensorView& dup, cudaStream_t stream) {
  const char* op = "swiglu_backward_fp8";
  check_f32(dout, op, "dout", 2);
  const int64_t T = dout.size(0), F = dout.size(1);
  for (auto [q, name] : {std::pair{&gate, "gate"}, {&up, "up"}}) {
    check_quantized(*q, name, ScaleKind::tile_1x128);
    FP8MOE_CHECK(q->values.dtype == DType::e4m3 || q->values.dtype == DType::e5m2,
                 op << ": " << name << " must be e4m3 or e5m2, got " << q->values.str());
    check_dev(q->values, op, name, gate.values.dtype, 2);  // up: gate's dtype
    check_dev(q->scales, op, name, DType::f32, 2);
    check_covers_rows(*q, op, name, T, F, "dout " + dout.str());
  }
  for (auto [t, name] : {std::pair{&out, "out"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
    if (t == &out && !out.defined()) continue;
    check_f32(*t, op, name, 2);
    FP8MOE_CHECK(t->size(0) == T && t->size(1) == F,
                 op << ": " << name << " " << t->str() << " differs from dout " << dout.str());
  }
  if (T == 0 || F == 0) return;
  const Fp8Tiles gt{gate.values.ptr<const uint8_t>(), gate.scales.ptr<const float>(), gate.scales.size(1)};
  const Fp8Tiles ut{up.values.ptr<const uint8_t>(), up.scales.ptr<const float>(), up.scales.size(1)};
  const float* d = dout.ptr<const float>();
  float* o = out.defined() ? out.ptr<float>() : nullptr;
  float *dg = dgate.ptr<float>(), *du = dup.ptr<float>();
  auto al = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  const bool vec = F % 16 == 0 && al(gt.q) && al(ut.q) && al(d) && (!o || al(o)) && al(dg) && al(du);
  const bool e5m2 = gate.values.dtype == DType::e5m2;
  if (vec) {
    const unsigned grid = grid_for(T * (F / 16), kThreads);
    if (e5m2) swiglu_backward_fp8_vec_kernel<true><<<grid, kThreads, 0, stream>>>(gt, ut, d, o, dg, du, T, F);
    else swiglu_backward_fp8_vec_kernel<false><<<grid, kThreads, 0, stream>>>(gt, ut, d, o, dg, du, T, F);
    FP8MOE_CUDA_CHECK_LAUNCH("swiglu_backward_fp8_vec_kernel");
  } else {
    const unsigned grid = grid_for(T * F, kThreads);
    if (e5m2) swiglu_backward_fp8_kernel<true><<<grid, kThreads, 0, stream>>>(gt, ut, d, o, dg, du, T, F);
    else swiglu_backward_fp8_kernel<false><<<grid, kThreads, 0, stream>>>(gt, ut, d, o, dg, du, T, F);
    FP8MOE_CUDA_CHECK_LAUNCH("swiglu_backward_fp8_kernel");
  }
}

void cuda_swiglu_forward_fp8(const TensorView& gate, const TensorView& up, const QuantizedView& gq,
                             const QuantizedView& uq, const QuantizedView& out, ScaleMode mode, cudaStream_t stream) {
  const char* op = "swiglu_forward_fp8";
  check_f32(gate, op, "gate", 2);
  check_f32(up, op, "up", 2);
  const int64_t T = gate.size(0), F = gate.size(1);
  FP8MOE_CHECK(up.size(0) == T && up.size(1) == F, op << ": up " << up.str() << " differs from gate " << gate.str());
  for (auto [q, name] : {std::pair{&gq, "gq"}, {&uq, "uq"}, {&out, "out"}}) {
    check_quantized(*q, name, ScaleKind::tile_1x128);
    check_dev(q->values, op, name, DType::e4m3, 2);
    check_dev(q->scales, op, name, DType::f32, 2);
    check_covers_rows(*q, op, name, T, F, "gate " + gate.str(), q == &out);  // gq, uq: exactly T rows
  }
  const int64_t R = out.rows(), ld_t = gq.scales.size(1), ld_r = out.scales.size(1), G = (F + 127) / 128;
  FP8MOE_CHECK(uq.scales.size(1) == ld_t && ld_r >= ld_t, op << ": scale layouts of gq, uq, out differ");
  if (F == 0 || ld_r == 0) return;
  int* flag = nullptr;
  FP8MOE_CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&flag), g_swiglu_nonfinite));
  clear_flag(flag, stream);
  auto al = [](const void* p, int n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; };
  const bool vec = F % 4 == 0 && al(gate.data, 16) && al(up.data, 16) && al(gq.values.data, 4) &&
                   al(uq.values.data, 4) && al(out.values.data, 4);
  const unsigned grid = grid_for(ld_r * G * 32, kThreads);
  const bool pow2 = mode == ScaleMode::pow2;
  auto go = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(gate.ptr<const float>(), up.ptr<const float>(), gq.values.ptr<uint8_t>(),
                               gq.scales.ptr<float>(), uq.values.ptr<uint8_t>(), uq.scales.ptr<float>(),
                               out.values.ptr<uint8_t>(), out.scales.ptr<float>(), T, R, F, ld_t, ld_r, pow2);
  };
  if (vec) go(swiglu_forward_fp8_kernel<true>);
  else go(swiglu_forward_fp8_kernel<false>);
  FP8MOE_CUDA_CHECK_LAUNCH("swiglu_forward_fp8_kernel");
  raise_if_flag_set(flag, stream, "gate, up", "non-finite value (NaN/Inf input is refused by the quantizers)");
}

void cuda_rope(const TensorView& x, int64_t col0, int64_t rot, const TensorView& positions, double theta,
               bool inverse, cudaStream_t stream) {
  check_dev(positions, "rope", "positions", DType::i32, 1);
  check_f32(x, "rope", "x", 3);
  const int64_t N = x.size(0), H = x.size(1), C = x.size(2);
  check_shape(positions, "rope: positions", {N});
  FP8MOE_CHECK(rot % 2 == 0 && rot > 0, "rope: rot = " << rot << " must be even and positive");
  FP8MOE_CHECK(col0 >= 0 && col0 + rot <= C, "rope: columns [" << col0 << ", " << col0 + rot << ") outside x "
                                                               << x.str());
  if (N == 0 || H == 0) return;
  rope_kernel<<<grid_for(N * (rot / 2), 128), 128, 0, stream>>>(x.ptr<float>(), positions.ptr<const int32_t>(), N, H, C, col0,
                                                      rot, theta, inverse ? -1.0 : 1.0);
  FP8MOE_CUDA_CHECK_LAUNCH("rope_kernel");
}

namespace {
// mla_split_kv's checks and shapes on the device, for the forward's (kv, ckv, k, v) or the
// backward's (dkv, dckv, dk, dv) under their names.
std::array<int64_t, 5> check_mla_split_dev(const char* op, const TensorView& kv, const TensorView& ckv, int64_t pe_col,
                                           const TensorView& k, const TensorView& v, const TensorView& positions,
                                           const std::array<const char*, 4>& names) {
  const std::array<int64_t, 5> shapes = check_mla_split_kv(op, kv, ckv, pe_col, k, v);
  check_f32(kv, op, names[0], 2);
  check_f32(ckv, op, names[1], 2);
  check_f32(k, op, names[2], 3);
  check_f32(v, op, names[3], 3);
  check_dev(positions, op, "positions", DType::i32, 1);
  FP8MOE_CHECK(positions.size(0) == shapes[0], op << ": positions " << positions.str() << " must have a row per token");
  return shapes;
}
}  // namespace

void cuda_mla_split_kv(const TensorView& kv, const TensorView& ckv, int64_t pe_col, const TensorView& positions,
                       double theta, const TensorView& k, const TensorView& v, cudaStream_t stream) {
  const auto [T, H, dn, dr, dv] =
      check_mla_split_dev("mla_split_kv", kv, ckv, pe_col, k, v, positions, {"kv", "ckv", "k", "v"});
  if (T == 0) return;
  mla_split_kv_kernel<<<unsigned(std::min<int64_t>(T, 65535)), 128, size_t(dr) * sizeof(float), stream>>>(
      kv.ptr<const float>(), ckv.ptr<const float>(), ckv.strides[0], pe_col, positions.ptr<const int32_t>(), T, H, dn, dr,
      dv, theta, k.ptr<float>(), v.ptr<float>());
  FP8MOE_CUDA_CHECK_LAUNCH("mla_split_kv_kernel");
}

void cuda_mla_split_kv_backward(const TensorView& dk, const TensorView& dv, const TensorView& positions, double theta,
                                const TensorView& dkv, const TensorView& dckv, int64_t pe_col, cudaStream_t stream) {
  const auto [T, H, dn, dr, dvw] = check_mla_split_dev("mla_split_kv_backward", dkv, dckv, pe_col, dk, dv, positions,
                                                       {"dkv", "dckv", "dk", "dv"});
  if (T == 0) return;
  mla_split_kv_backward_kernel<<<unsigned(std::min<int64_t>(T, 65535)), 128, 0, stream>>>(
      dk.ptr<const float>(), dv.ptr<const float>(), positions.ptr<const int32_t>(), T, H, dn, dr, dvw, theta,
      dkv.ptr<float>(), dckv.ptr<float>(), dckv.strides[0], pe_col);
  FP8MOE_CUDA_CHECK_LAUNCH("mla_split_kv_backward_kernel");
}

}  // namespace fp8moe::cuda
