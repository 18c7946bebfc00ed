// CUDA elementwise and data-movement model ops: convert, axpy, copy_cols, transpose, token
// embedding (forward gather, deterministic backward scatter-add), SwiGLU forward/backward and
// rotary position embedding. Semantics are those of src/cpu/ops_dense.cpp, ops_embed_loss.cpp,
// ops_mlp.cpp and ops_attention.cpp (rope); tests: tests/cuda/test_cuda_model_ops.cpp.
// NOTES: float products and sums that the CPU rounds separately use __fmul_rn / __fadd_rn so
// that nvcc does not contract them into FMAs: axpy, embedding_backward and the AdamW update are
// then bit-identical to the CPU.
#include "model_ops.hpp"
#include "model_ops_util.cuh"

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
  FP8MOE_GRID_STRIDE(i, n) {
    const float gi = g[i];
    o[i] = __fmul_rn(__fdiv_rn(gi, __fadd_rn(1.0f, expf(-gi))), u[i]);
  }
}

__global__ void swiglu_backward_kernel(const float* __restrict__ g, const float* __restrict__ u,
                                       const float* __restrict__ d, float* __restrict__ dg, float* __restrict__ du,
                                       int64_t n) {
  FP8MOE_GRID_STRIDE(i, n) {
    const float gi = g[i], di = d[i];
    const float s = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-gi)));
    const float silu = __fmul_rn(gi, s);
    du[i] = __fmul_rn(di, silu);
    // d * u * s * (1 + g * (1 - s)), left to right as in C++.
    dg[i] = __fmul_rn(__fmul_rn(__fmul_rn(di, u[i]), s), __fadd_rn(1.0f, __fmul_rn(gi, __fsub_rn(1.0f, s))));
  }
}

// In place on x [N, H, C]: one thread per (token t, pair i) rotates pair i of every head.
__global__ void rope_kernel(float* x, const int32_t* __restrict__ pos, int64_t N, int64_t H, int64_t C, int64_t col0,
                            int64_t rot, double theta, double sign) {
  const int64_t half = rot / 2;
  FP8MOE_GRID_STRIDE(k, N * half) {
    const int64_t t = k / half, i = k - t * half;
    const double freq = pow(theta, -2.0 * double(i) / double(rot));
    const double ang = double(pos[t]) * freq;
    double s, c;
    sincos(ang, &s, &c);
    s *= sign;
    for (int64_t h = 0; h < H; ++h) {
      float* p = x + (t * H + h) * C + col0 + 2 * i;
      const double a = p[0], b = p[1];
      p[0] = __double2float_rn(__dsub_rn(__dmul_rn(a, c), __dmul_rn(b, s)));
      p[1] = __double2float_rn(__dadd_rn(__dmul_rn(a, s), __dmul_rn(b, c)));
    }
  }
}

void check_any_dtype(const TensorView& t, const char* op, const char* arg) {
  FP8MOE_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16,
               op << ": " << arg << " must be f32, f64 or bf16, got " << t.str());
}

}  // namespace

void cuda_convert(const TensorView& src, const TensorView& dst) {
  FP8MOE_CHECK(src.numel() == dst.numel(), "convert: src " << src.str() << " and dst " << dst.str()
                                                           << " differ in element count");
  FP8MOE_CHECK(src.is_contiguous() && dst.is_contiguous(), "convert: src and dst must be contiguous");
  FP8MOE_CHECK(src.device == Device::cuda && dst.device == Device::cuda, "convert: device tensors only, got src "
                                                                            << src.str() << ", dst " << dst.str());
  const int64_t n = src.numel();
  if (n == 0) return;
  if (src.dtype == dst.dtype) {
    FP8MOE_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, nullptr));
    return;
  }
  check_any_dtype(src, "convert", "src");
  check_any_dtype(dst, "convert", "dst");
  convert_kernel<<<grid_for(n, kThreads), kThreads>>>(src.data, int(src.dtype), dst.data, int(dst.dtype), n);
  FP8MOE_CUDA_CHECK_LAUNCH("convert_kernel");
}

void cuda_axpy(double alpha, const TensorView& x, double beta, const TensorView& y) {
  check_f32(y, "axpy", "y", -1);
  FP8MOE_CHECK(x.dtype == y.dtype && x.numel() == y.numel() && x.is_contiguous() && y.is_contiguous(),
               "axpy: x " << x.str() << " and y " << y.str() << " must match in dtype and size");
  FP8MOE_CHECK(x.device == Device::cuda, "axpy: x must be a device tensor, got " << x.str());
  const int64_t n = y.numel();
  if (n == 0) return;
  axpy_kernel<<<grid_for(n, kThreads), kThreads>>>(float(alpha), x.ptr<const float>(), float(beta), y.ptr<float>(), n,
                                                   beta == 1.0);
  FP8MOE_CUDA_CHECK_LAUNCH("axpy_kernel");
}

void cuda_copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col, int64_t ncols,
                    bool accumulate) {
  check_2d_any(src, "copy_cols", "src");
  check_2d_any(dst, "copy_cols", "dst");
  check_copy_cols(src, src_col, dst, dst_col, ncols);
  const int64_t R = src.size(0), Cs = src.size(1), Cd = dst.size(1);
  if (R == 0 || ncols == 0) return;
  if (src.dtype == dst.dtype && !accumulate) {
    const size_t es = dtype_size(src.dtype);
    FP8MOE_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst.data) + size_t(dst_col) * es, size_t(Cd) * es,
                                        static_cast<const char*>(src.data) + size_t(src_col) * es, size_t(Cs) * es,
                                        size_t(ncols) * es, size_t(R), cudaMemcpyDeviceToDevice, nullptr));
    return;
  }
  copy_cols_kernel<<<grid_for(R * ncols, kThreads), kThreads>>>(src.data, int(src.dtype), Cs, src_col, dst.data,
                                                                int(dst.dtype), Cd, dst_col, R, ncols, accumulate);
  FP8MOE_CUDA_CHECK_LAUNCH("copy_cols_kernel");
}

void cuda_transpose(const TensorView& src, const TensorView& dst) {
  check_2d_any(src, "transpose", "src");
  check_2d_any(dst, "transpose", "dst");
  FP8MOE_CHECK(src.dtype == dst.dtype, "transpose: src " << src.str() << " and dst " << dst.str() << " differ in dtype");
  check_shape(dst, "transpose: dst", {src.size(1), src.size(0)});
  const int64_t R = src.size(0), C = src.size(1);
  if (R == 0 || C == 0) return;
  FP8MOE_CHECK(ceil_div(R, 32) <= 65535, "transpose: src " << src.str() << " has too many rows for one launch");
  const dim3 grid(unsigned(ceil_div(C, 32)), unsigned(ceil_div(R, 32))), block(32, 8);
  switch (dtype_size(src.dtype)) {
    case 2: transpose_kernel<<<grid, block>>>(src.ptr<const uint16_t>(), dst.ptr<uint16_t>(), R, C); break;
    case 4: transpose_kernel<<<grid, block>>>(src.ptr<const uint32_t>(), dst.ptr<uint32_t>(), R, C); break;
    default: transpose_kernel<<<grid, block>>>(src.ptr<const uint64_t>(), dst.ptr<uint64_t>(), R, C); break;
  }
  FP8MOE_CUDA_CHECK_LAUNCH("transpose_kernel");
}

void cuda_embedding_forward(const TensorView& ids, const TensorView& table, const TensorView& out) {
  check_dev(ids, "embedding_forward", "ids", DType::i32, 1);
  check_f32(table, "embedding_forward", "table", 2);
  check_f32(out, "embedding_forward", "out", 2);
  const int64_t N = ids.size(0), V = table.size(0), D = table.size(1);
  check_shape(out, "embedding_forward: out", {N, D});
  int32_t bad = 0;
  const int64_t t = first_out_of_range(ids.ptr<const int32_t>(), N, 0, V, &bad, "embedding_forward: ids");
  FP8MOE_CHECK(t < 0, "embedding_forward: ids[" << t << "] = " << bad << " outside [0, " << V << ")");
  if (N * D == 0) return;
  embedding_forward_kernel<<<grid_for(N * D, kThreads), kThreads>>>(ids.ptr<const int32_t>(), table.ptr<const float>(),
                                                                    out.ptr<float>(), N, D, V);
  FP8MOE_CUDA_CHECK_LAUNCH("embedding_forward_kernel");
}

void cuda_embedding_backward(const TensorView& ids, const TensorView& dout, const TensorView& dtable) {
  check_dev(ids, "embedding_backward", "ids", DType::i32, 1);
  check_f32(dtable, "embedding_backward", "dtable", 2);
  check_f32(dout, "embedding_backward", "dout", 2);
  const int64_t N = ids.size(0), V = dtable.size(0), D = dtable.size(1);
  check_shape(dout, "embedding_backward: dout", {N, D});
  // NOTES: the CPU op does not check ids here (the forward did); an id outside the table would
  // write outside dtable on the device, so the range is checked again.
  int32_t bad = 0;
  const int64_t t = first_out_of_range(ids.ptr<const int32_t>(), N, 0, V, &bad, "embedding_backward: ids");
  FP8MOE_CHECK(t < 0, "embedding_backward: ids[" << t << "] = " << bad << " outside [0, " << V << ")");
  if (N == 0 || D == 0) return;
  DeviceBuffer keys(size_t(N) * sizeof(int32_t)), pos(size_t(N) * sizeof(int32_t));
  stable_sort_by_key(ids.ptr<const int32_t>(), N, V, keys.as<int32_t>(), pos.as<int32_t>());
  sorted_scatter_add(keys.as<int32_t>(), pos.as<int32_t>(), N, nullptr, dout.ptr<const float>(), dtable.ptr<float>(), D,
                     V);
}

void cuda_swiglu_forward(const TensorView& gate, const TensorView& up, const TensorView& out) {
  check_f32(gate, "swiglu_forward", "gate", 2);
  check_f32(up, "swiglu_forward", "up", 2);
  check_f32(out, "swiglu_forward", "out", 2);
  check_shape(up, "swiglu_forward: up", {gate.size(0), gate.size(1)});
  check_shape(out, "swiglu_forward: out", {gate.size(0), gate.size(1)});
  const int64_t n = gate.numel();
  if (n == 0) return;
  swiglu_forward_kernel<<<grid_for(n, kThreads), kThreads>>>(gate.ptr<const float>(), up.ptr<const float>(),
                                                             out.ptr<float>(), n);
  FP8MOE_CUDA_CHECK_LAUNCH("swiglu_forward_kernel");
}

void cuda_swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dout,
                          const TensorView& dgate, const TensorView& dup) {
  check_f32(gate, "swiglu_backward", "gate", 2);
  for (auto [t, name] : {std::pair{&up, "up"}, {&dout, "dout"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
    check_f32(*t, "swiglu_backward", name, 2);
    FP8MOE_CHECK(t->size(0) == gate.size(0) && t->size(1) == gate.size(1),
                 "swiglu_backward: " << name << " " << t->str() << " differs from gate " << gate.str());
  }
  const int64_t n = gate.numel();
  if (n == 0) return;
  swiglu_backward_kernel<<<grid_for(n, kThreads), kThreads>>>(gate.ptr<const float>(), up.ptr<const float>(),
                                                              dout.ptr<const float>(), dgate.ptr<float>(),
                                                              dup.ptr<float>(), n);
  FP8MOE_CUDA_CHECK_LAUNCH("swiglu_backward_kernel");
}

void cuda_rope(const TensorView& x, int64_t col0, int64_t rot, const TensorView& positions, double theta,
               bool inverse) {
  check_dev(positions, "rope", "positions", DType::i32, 1);
  check_f32(x, "rope", "x", 3);
  const int64_t N = x.size(0), H = x.size(1), C = x.size(2);
  check_shape(positions, "rope: positions", {N});
  FP8MOE_CHECK(rot % 2 == 0 && rot > 0, "rope: rot = " << rot << " must be even and positive");
  FP8MOE_CHECK(col0 >= 0 && col0 + rot <= C, "rope: columns [" << col0 << ", " << col0 + rot << ") outside x "
                                                               << x.str());
  if (N == 0 || H == 0) return;
  rope_kernel<<<grid_for(N * (rot / 2), 128), 128>>>(x.ptr<float>(), positions.ptr<const int32_t>(), N, H, C, col0,
                                                      rot, theta, inverse ? -1.0 : 1.0);
  FP8MOE_CUDA_CHECK_LAUNCH("rope_kernel");
}

}  // namespace fp8moe::cuda
