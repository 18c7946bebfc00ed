// CPU dense ops of the model: float GEMM (all four transpose cases), dtype conversion, axpy,
// column-block copies and transposes. The GEMM computes 4x128 blocks of D, OpenMP over blocks:
// every case is reduced to d[i, :] += sum_k A(i, k) * B[k, :] with B row-major [K, N] (b^T is
// materialized once for trans_b), so the inner loop is contiguous and vectorizes.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu_ops.hpp"
#include "fp8moe/codecs.hpp"

namespace fp8moe::cpu {

void check_op_tensor(const TensorView& t, const char* op, const char* arg, DType dtype, int ndim) {
  FP8MOE_CHECK(t.device == Device::cpu, op << ": " << arg << " must be a host tensor, got " << t.str());
  FP8MOE_CHECK(t.data != nullptr, op << ": " << arg << " is undefined");
  FP8MOE_CHECK(t.dtype == dtype, op << ": " << arg << " must be " << dtype_name(dtype) << ", got " << t.str());
  FP8MOE_CHECK(ndim < 0 || t.ndim == ndim, op << ": " << arg << " must have " << ndim << " dims, got " << t.str());
  FP8MOE_CHECK(t.is_contiguous(), op << ": " << arg << " must be contiguous, got " << t.str());
}

namespace {

constexpr int64_t kRows = 4, kCols = 128;  // the D block one kernel call computes

// D rows [i0, i0 + 4) x columns [j0, j0 + 128) (clipped) (+)= A(i, k) * B [K, N] over all K;
// A [M, K] or, with ta, [K, M].
// NOTES: 4x16 sub-blocks are accumulated in registers over all of K (B rows stream from L1/L2),
// and D is written once. Compiled for AVX-512, AVX2 and baseline x86-64 with
// run-time selection (target_clones), since the build targets baseline x86-64; OpenMP stays in
// the caller because outlined parallel regions do not inherit the clone's target.
template <class T>
[[gnu::always_inline]] inline void gemm_block(const T* A, const T* B, T* D, int64_t M, int64_t N, int64_t K, bool ta,
                                              bool accumulate, int64_t i0, int64_t j0) {
  auto a_at = [&](int64_t i, int64_t k) { return ta ? A[k * M + i] : A[i * K + k]; };
  const int64_t rows = std::min(kRows, M - i0), cols = std::min(kCols, N - j0);
  alignas(64) T acc[kRows][kCols] = {};
  if (rows == kRows && cols == kCols) {
    // 4 x 16 accumulators stay in vector registers over the whole K loop.
    constexpr int64_t kW = 16;
    for (int64_t jc = 0; jc < kCols; jc += kW) {
      T c0[kW] = {}, c1[kW] = {}, c2[kW] = {}, c3[kW] = {};
      for (int64_t k = 0; k < K; ++k) {
        const T a0 = a_at(i0, k), a1 = a_at(i0 + 1, k), a2 = a_at(i0 + 2, k), a3 = a_at(i0 + 3, k);
        const T* br = B + k * N + j0 + jc;
#pragma GCC unroll 16
        for (int64_t j = 0; j < kW; ++j) {
          const T bv = br[j];
          c0[j] += a0 * bv;
          c1[j] += a1 * bv;
          c2[j] += a2 * bv;
          c3[j] += a3 * bv;
        }
      }
      for (int64_t j = 0; j < kW; ++j) {
        acc[0][jc + j] = c0[j];
        acc[1][jc + j] = c1[j];
        acc[2][jc + j] = c2[j];
        acc[3][jc + j] = c3[j];
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const T* br = B + k * N + j0;
      for (int64_t r = 0; r < rows; ++r) {
        const T av = a_at(i0 + r, k);
        for (int64_t j = 0; j < cols; ++j) acc[r][j] += av * br[j];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dr = D + (i0 + r) * N + j0;
    for (int64_t j = 0; j < cols; ++j) dr[j] = accumulate ? dr[j] + acc[r][j] : acc[r][j];
  }
}

[[gnu::target_clones("avx512f", "avx2", "default")]]
void gemm_block_f32(const float* A, const float* B, float* D, int64_t M, int64_t N, int64_t K, bool ta, bool acc,
                    int64_t i0, int64_t j0) {
  gemm_block<float>(A, B, D, M, N, K, ta, acc, i0, j0);
}
[[gnu::target_clones("avx512f", "avx2", "default")]]
void gemm_block_f64(const double* A, const double* B, double* D, int64_t M, int64_t N, int64_t K, bool ta, bool acc,
                    int64_t i0, int64_t j0) {
  gemm_block<double>(A, B, D, M, N, K, ta, acc, i0, j0);
}

template <class T>
void gemm_driver(const TensorView& a, const TensorView& b, const TensorView& d, bool ta, bool tb, bool accumulate) {
  const int64_t M = d.size(0), N = d.size(1);
  const int64_t K = ta ? a.size(0) : a.size(1);
  FP8MOE_CHECK((ta ? a.size(1) : a.size(0)) == M, "gemm: a " << a.str() << " does not give M = " << M);
  FP8MOE_CHECK((tb ? b.size(1) : b.size(0)) == K && (tb ? b.size(0) : b.size(1)) == N,
               "gemm: b " << b.str() << " does not match K = " << K << ", N = " << N);
  const T* A = a.ptr<const T>();
  T* D = d.ptr<T>();
  // B as row-major [K, N].
  std::vector<T> bt;
  const T* B = b.ptr<const T>();
  if (tb) {
    bt.resize(size_t(K * N));
    const int64_t R = N, C = K;  // b is [N, K]
#pragma omp parallel for schedule(static) if (R * C > kParallelWork)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t r = 0; r < R; ++r) bt[size_t(c * R + r)] = B[r * C + c];
    B = bt.data();
  }
  const int64_t MB = ceil_div(M, kRows), NB = ceil_div(N, kCols);
#pragma omp parallel for collapse(2) schedule(dynamic, 1) if (M * N * K > 4 * kParallelWork)
  // Column panels outermost: one [K, 128] panel of B stays in L2 while every row block uses it.
  for (int64_t jb = 0; jb < NB; ++jb)
    for (int64_t ib = 0; ib < MB; ++ib) {
      if constexpr (sizeof(T) == 4) {
        gemm_block_f32(A, B, D, M, N, K, ta, accumulate, ib * kRows, jb * kCols);
      } else {
        gemm_block_f64(A, B, D, M, N, K, ta, accumulate, ib * kRows, jb * kCols);
      }
    }
}

double load_any(const TensorView& t, int64_t i) {
  switch (t.dtype) {
    case DType::f32: return t.ptr<const float>()[i];
    case DType::f64: return t.ptr<const double>()[i];
    case DType::bf16: return bf16_decode(t.ptr<const uint16_t>()[i]);
    default: break;
  }
  FP8MOE_CHECK(false, "unsupported dtype " << t.str());
}

void store_any(const TensorView& t, int64_t i, double v) {
  switch (t.dtype) {
    case DType::f32: t.ptr<float>()[i] = float(v); return;
    case DType::f64: t.ptr<double>()[i] = v; return;
    case DType::bf16: t.ptr<uint16_t>()[i] = bf16_encode(float(v)); return;
    default: break;
  }
  FP8MOE_CHECK(false, "unsupported dtype " << t.str());
}

void check_2d_any(const TensorView& t, const char* op, const char* arg) {
  FP8MOE_CHECK(t.device == Device::cpu && t.data, op << ": " << arg << " must be a defined host tensor");
  FP8MOE_CHECK(t.ndim == 2 && t.is_contiguous(), op << ": " << arg << " must be 2-D contiguous, got " << t.str());
  FP8MOE_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64 || t.dtype == DType::bf16,
               op << ": " << arg << " must be f32, f64 or bf16, got " << t.str());
}

}  // namespace

void gemm(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_a, bool trans_b, bool accumulate) {
  if (a.dtype == DType::bf16 || b.dtype == DType::bf16) {
    // BF16 operands widen to FP32 exactly; the FP32 GEMM then accumulates their exact products.
    check_op_tensor(a, "gemm", "a", DType::bf16, 2);
    check_op_tensor(b, "gemm", "b", DType::bf16, 2);
    check_op_tensor(d, "gemm", "d", DType::f32, 2);
    std::vector<float> af(size_t(a.numel())), bf(size_t(b.numel()));
    const TensorView av(af.data(), DType::f32, {a.size(0), a.size(1)}, Device::cpu);
    const TensorView bv(bf.data(), DType::f32, {b.size(0), b.size(1)}, Device::cpu);
    convert(a, av);
    convert(b, bv);
    gemm_driver<float>(av, bv, d, trans_a, trans_b, accumulate);
    return;
  }
  dispatch_float(d, "gemm", "d", [&](auto tag) {
    using T = decltype(tag);
    constexpr DType dt = sizeof(T) == 4 ? DType::f32 : DType::f64;
    check_op_tensor(a, "gemm", "a", dt, 2);
    check_op_tensor(b, "gemm", "b", dt, 2);
    check_op_tensor(d, "gemm", "d", dt, 2);
    gemm_driver<T>(a, b, d, trans_a, trans_b, accumulate);
  });
}

namespace {
// Matrix g of a 3-D view [G, R, C] (unit column stride) to or from contiguous [R, C] storage.
void copy_matrix(const TensorView& t, int64_t g, float* dense, bool to_dense) {
  const int64_t R = t.size(1), C = t.size(2);
  float* m = t.ptr<float>() + g * t.strides[0];
  for (int64_t r = 0; r < R; ++r)
    to_dense ? std::copy_n(m + r * t.strides[1], C, dense + r * C) : std::copy_n(dense + r * C, C, m + r * t.strides[1]);
}
}  // namespace

// Each matrix copied out to contiguous storage and through the one GEMM: the bits of gemm alone.
void gemm_strided_batched(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_b, bool accumulate) {
  const BatchedGemmDims g = check_gemm_strided_batched(Device::cpu, a, b, d, trans_b);
  std::vector<float> am(size_t(g.M * g.K)), bm(size_t(g.K * g.N)), dm(size_t(g.M * g.N));
  const TensorView av(am.data(), DType::f32, {g.M, g.K}, Device::cpu), dv(dm.data(), DType::f32, {g.M, g.N}, Device::cpu);
  const TensorView bv = trans_b ? TensorView(bm.data(), DType::f32, {g.N, g.K}, Device::cpu)
                                : TensorView(bm.data(), DType::f32, {g.K, g.N}, Device::cpu);
  for (int64_t i = 0; i < g.G; ++i) {
    copy_matrix(a, i, am.data(), true);
    copy_matrix(b, i, bm.data(), true);
    if (accumulate) copy_matrix(d, i, dm.data(), true);
    gemm_driver<float>(av, bv, dv, false, trans_b, accumulate);
    copy_matrix(d, i, dm.data(), false);
  }
}

void convert(const TensorView& src, const TensorView& dst) {
  FP8MOE_CHECK(src.numel() == dst.numel(), "convert: src " << src.str() << " and dst " << dst.str()
                                                           << " differ in element count");
  FP8MOE_CHECK(src.is_contiguous() && dst.is_contiguous(), "convert: src and dst must be contiguous");
  FP8MOE_CHECK(src.device == Device::cpu && dst.device == Device::cpu, "convert: host tensors only");
  const int64_t n = src.numel();
  if (src.dtype == dst.dtype) {
    std::memcpy(dst.data, src.data, src.nbytes());
    return;
  }
#pragma omp parallel for schedule(static) if (n > kParallelWork)
  for (int64_t i = 0; i < n; ++i) store_any(dst, i, load_any(src, i));
}

void axpy(double alpha, const TensorView& x, double beta, const TensorView& y) {
  dispatch_float(y, "axpy", "y", [&](auto tag) {
    using T = decltype(tag);
    FP8MOE_CHECK(x.dtype == y.dtype && x.numel() == y.numel() && x.is_contiguous() && y.is_contiguous(),
                 "axpy: x " << x.str() << " and y " << y.str() << " must match in dtype and size");
    const T* xp = x.ptr<const T>();
    T* yp = y.ptr<T>();
    const T a = T(alpha), bb = T(beta);
    const int64_t n = y.numel();
    if (beta == 1.0) {
#pragma omp parallel for simd schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) yp[i] += a * xp[i];
    } else {
#pragma omp parallel for simd schedule(static) if (n > kParallelWork)
      for (int64_t i = 0; i < n; ++i) yp[i] = a * xp[i] + bb * yp[i];
    }
  });
}

void copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col, int64_t ncols,
               bool accumulate) {
  check_2d_any(src, "copy_cols", "src");
  check_2d_any(dst, "copy_cols", "dst");
  check_copy_cols(src, src_col, dst, dst_col, ncols);
  const int64_t R = src.size(0), Cs = src.size(1), Cd = dst.size(1);
  if (src.dtype == dst.dtype && !accumulate) {
    const size_t es = dtype_size(src.dtype);
#pragma omp parallel for schedule(static) if (R * ncols > kParallelWork)
    for (int64_t r = 0; r < R; ++r)
      std::memcpy(static_cast<char*>(dst.data) + (r * Cd + dst_col) * es,
                  static_cast<const char*>(src.data) + (r * Cs + src_col) * es, size_t(ncols) * es);
    return;
  }
#pragma omp parallel for schedule(static) if (R * ncols > kParallelWork)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) {
      const int64_t di = r * Cd + dst_col + j;
      double v = load_any(src, r * Cs + src_col + j);
      if (accumulate) v += load_any(dst, di);
      store_any(dst, di, v);
    }
}

void transpose(const TensorView& src, const TensorView& dst) {
  check_2d_any(src, "transpose", "src");
  check_2d_any(dst, "transpose", "dst");
  FP8MOE_CHECK(src.dtype == dst.dtype, "transpose: src " << src.str() << " and dst " << dst.str() << " differ in dtype");
  check_shape(dst, "transpose: dst", {src.size(1), src.size(0)});
  const int64_t R = src.size(0), C = src.size(1);
  const size_t es = dtype_size(src.dtype);
  constexpr int64_t kB = 32;  // cache blocking
#pragma omp parallel for collapse(2) schedule(static) if (R * C > kParallelWork)
  for (int64_t r0 = 0; r0 < R; r0 += kB)
    for (int64_t c0 = 0; c0 < C; c0 += kB)
      for (int64_t r = r0; r < std::min(R, r0 + kB); ++r)
        for (int64_t c = c0; c < std::min(C, c0 + kB); ++c)
          std::memcpy(static_cast<char*>(dst.data) + (c * R + r) * es,
                      static_cast<const char*>(src.data) + (r * C + c) * es, es);
}

}  // namespace fp8moe::cpu
