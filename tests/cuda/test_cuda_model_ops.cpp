// The CUDA model ops (src/cuda/ops/model_ops.hpp) and the device AdamW against the CPU backend, op by
// op, on fresh random inputs of awkward sizes (rows not a multiple of 32, several sequences and
// heads, ragged head dims), device outputs poisoned with NaN before each run. Ops whose CUDA
// arithmetic repeats the CPU's roundings are compared bit for bit (data movement, axpy, convert,
// embedding and scatter-add backward, AdamW); the others within FP32 tolerances (1e-5 relative,
// attention 1e-4, bf16 outputs per bf16 rounding; attention with BF16 operands as its NOTES
// say). Skips without a GPU.
// Run: build/tests/cuda/test_cuda_model_ops, or ctest -R CudaModelOps (FP8MOE_SEED=<n> replays a seed).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "cuda/ops/model_ops.hpp"
#include "cuda_test_util.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/ema.hpp"
#include "fp8moe/optimizer.hpp"

namespace fp8moe::testing {
namespace {

using namespace fp8moe::cuda;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Tensor host_of(DType dt, const TensorView& like) {
  switch (like.ndim) {
    case 1: return Tensor::host(dt, {like.shape[0]});
    case 2: return Tensor::host(dt, {like.shape[0], like.shape[1]});
    default: return Tensor::host(dt, {like.shape[0], like.shape[1], like.shape[2]});
  }
}

// Host tensor of `dtype` and `shape` filled with NaN (f32, f64, bf16) or -1 (i32).
Tensor nan_host(DType dt, std::initializer_list<int64_t> shape) {
  Tensor t = Tensor::host(dt, shape);
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dt == DType::i32)
      t.ptr<int32_t>()[i] = -1;
    else
      store_float(t.view(), i, kNaN);
  }
  return t;
}

Tensor ids_host(std::mt19937_64& rng, int64_t n, int32_t lo, int32_t hi) {
  Tensor t = Tensor::host(DType::i32, {n});
  std::uniform_int_distribution<int32_t> d(lo, hi - 1);
  for (int64_t i = 0; i < n; ++i) t.ptr<int32_t>()[i] = d(rng);
  return t;
}

// Host tensor with the same values in another dtype (f32 <-> bf16 <-> f64).
Tensor as_dtype(const Tensor& x, DType dt) {
  Tensor y = host_of(dt, x.view());
  for (int64_t i = 0; i < x.numel(); ++i) store_float(y.view(), i, load_float(x.view(), i));
  return y;
}

double value_at(const Tensor& t, int64_t i) {
  if (i < 0) return 0;
  if (t.dtype() == DType::u8) return double(t.ptr<const uint8_t>()[i]);
  return t.dtype() == DType::i32 ? double(t.ptr<const int32_t>()[i]) : double(load_float(t.view(), i));
}

// Bytewise equality, reporting the first mismatch.
void expect_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.view().nbytes(), want.view().nbytes()) << what;
  const int64_t i = first_mismatch(got, want);
  EXPECT_EQ(i, -1) << what << ": first mismatch at element " << i << " (got " << value_at(got, i) << ", want "
                   << value_at(want, i) << ")";
}

// |got - want| <= rtol * |want| + atol_frac * max|want| + atol_abs elementwise; NaN or Inf in got
// never passes where want is finite.
void expect_close(const Tensor& got, const Tensor& want, double rtol, const std::string& what,
                  double atol_frac = -1, double atol_abs = 0) {
  ASSERT_EQ(got.numel(), want.numel()) << what;
  if (atol_frac < 0) atol_frac = rtol;
  const std::vector<double> g = to_doubles(got.view()), w = to_doubles(want.view());
  double wmax = 0;
  for (double v : w) wmax = std::max(wmax, std::fabs(v));
  int64_t bad = 0, first = -1;
  double worst = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    const double err = std::fabs(g[i] - w[i]);
    const bool ok = std::isfinite(g[i]) && err <= rtol * std::fabs(w[i]) + atol_frac * wmax + atol_abs;
    if (!ok && std::isfinite(w[i])) {
      if (first < 0) first = int64_t(i);
      ++bad;
    }
    if (std::isfinite(err)) worst = std::max(worst, err / std::max(std::fabs(w[i]), 1e-30));
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << g.size() << " elements off, first at " << first << " (got "
                    << (first >= 0 ? g[size_t(first)] : 0) << ", want " << (first >= 0 ? w[size_t(first)] : 0)
                    << "), max |want| " << wmax << ", worst relative error " << worst;
}

// Expects `f` to throw fp8moe::Error whose message contains `needle`.
template <class F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Rows [r0, r0 + n) of a contiguous 2-D tensor: a view of a device tensor, a copy of a host one.
TensorView row_view(const Tensor& t, int64_t r0, int64_t n) {
  TensorView v = t.view();
  v.data = static_cast<char*>(v.data) + r0 * t.size(1) * int64_t(dtype_size(t.dtype()));
  v.shape[0] = n;
  return v;
}
Tensor host_rows(const Tensor& t, int64_t r0, int64_t n) {
  Tensor c = Tensor::host(t.dtype(), {n, t.size(1)});
  std::memcpy(c.view().data, row_view(t, r0, n).data, c.view().nbytes());
  return c;
}

class CudaModelOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    cpu_ = make_backend("cpu");
    gpu_ = make_backend("cuda");
    rng_ = make_rng();
  }
  // Device copy of a host tensor (1 to 3 dims).
  Tensor dev(const Tensor& h) {
    Tensor d;
    switch (h.view().ndim) {
      case 1: d = gpu_->zeros(h.dtype(), {h.size(0)}); break;
      case 2: d = gpu_->zeros(h.dtype(), {h.size(0), h.size(1)}); break;
      default: d = gpu_->zeros(h.dtype(), {h.size(0), h.size(1), h.size(2)}); break;
    }
    gpu_->copy(d.view(), h.view());
    return d;
  }
  // A NaN-poisoned device tensor.
  Tensor poisoned(DType dt, std::initializer_list<int64_t> shape) { return dev(nan_host(dt, shape)); }
  Tensor host(const Tensor& d) { return gpu_->to_host(d); }
  Tensor randn(std::initializer_list<int64_t> shape, float stddev = 1.0f, DType dt = DType::f32) {
    return random_normal(rng_, dt, shape, stddev);
  }
  // A host copy (separate storage).
  Tensor clone(const Tensor& h) {
    Tensor c = host_of(h.dtype(), h.view());
    std::memcpy(c.view().data, h.view().data, h.view().nbytes());
    return c;
  }

  std::unique_ptr<Backend> cpu_, gpu_;
  std::mt19937_64 rng_;
};

// ---- dense ----

TEST_F(CudaModelOps, GemmF32AllTransposesMatchCpu) {
  struct Mnk {
    int64_t m, n, k;
  };
  for (const Mnk s : {Mnk{37, 53, 29}, Mnk{130, 70, 257}, Mnk{1, 5, 3}, Mnk{64, 96, 128}, Mnk{33, 1, 300}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (bool acc : {false, true}) {
          Tensor a = ta ? randn({s.k, s.m}) : randn({s.m, s.k});
          Tensor b = tb ? randn({s.n, s.k}) : randn({s.k, s.n});
          Tensor d0 = acc ? randn({s.m, s.n}) : nan_host(DType::f32, {s.m, s.n});
          Tensor want = clone(d0);
          cpu_->gemm(a, b, want, ta, tb, acc);
          Tensor d = dev(d0);
          cuda_gemm(dev(a), dev(b), d, ta, tb, acc, nullptr);
          expect_close(host(d), want, 1e-5,
                       "gemm f32 M=" + std::to_string(s.m) + " N=" + std::to_string(s.n) + " K=" +
                           std::to_string(s.k) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                           " acc=" + std::to_string(acc));
        }
}

TEST_F(CudaModelOps, GemmBf16InputsMatchCpuOnRoundedInputs) {
  const int64_t M = 45, N = 70, K = 131;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (DType dd : {DType::f32, DType::bf16}) {
        Tensor a = ta ? randn({K, M}, 1.0f, DType::bf16) : randn({M, K}, 1.0f, DType::bf16);
        Tensor b = tb ? randn({N, K}, 1.0f, DType::bf16) : randn({K, N}, 1.0f, DType::bf16);
        Tensor want = Tensor::host(DType::f32, {M, N});
        cpu_->gemm(as_dtype(a, DType::f32), as_dtype(b, DType::f32), want, ta, tb, false);
        Tensor d = poisoned(dd, {M, N});
        cuda_gemm(dev(a), dev(b), d, ta, tb, false, nullptr);
        const std::string what = "gemm bf16 ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " d " +
                                  std::string(dtype_name(dd));
        expect_close(host(d), want, dd == DType::bf16 ? 1.0 / 256 : 1e-5, what, 1e-5);
      }
}

// The batch-invariant Linear GEMM: within FP32 rounding of the CPU GEMM, and every row the same
// bits computed alone, among other rows, or at another row offset (f32 with 16-byte vectors and
// an odd K without them; bf16 likewise).
TEST_F(CudaModelOps, GemmBatchInvariantRowsDoNotDependOnTheOtherRows) {
  struct Nk {
    int64_t n, k;
  };
  for (DType dt : {DType::f32, DType::bf16})
    for (const Nk s : {Nk{37, 29}, Nk{256, 1024}, Nk{70, 1000}, Nk{1, 300}, Nk{130, 2048}}) {
      const int64_t M = 19;
      const Tensor a = randn({M, s.k}, 1.0f, dt), b = randn({s.n, s.k}, 1.0f, dt);
      Tensor want = Tensor::host(DType::f32, {M, s.n});
      cpu_->gemm(as_dtype(a, DType::f32), as_dtype(b, DType::f32), want, false, true, false);
      const Tensor da = dev(a), db = dev(b);
      Tensor all = poisoned(DType::f32, {M, s.n});
      gpu_->gemm_batch_invariant(da, db, all);
      const std::string what = std::string(dtype_name(dt)) + " N=" + std::to_string(s.n) + " K=" + std::to_string(s.k);
      expect_close(host(all), want, 1e-5, what, 1e-5);
      const Tensor all_h = host(all);
      // Rows [r0, r0 + m) as their own call, for 1..8 rows and more than a CTA's 8.
      for (const auto [r0, m] : {std::pair<int64_t, int64_t>{0, 1}, {5, 1}, {3, 2}, {11, 8}, {2, 13}, {18, 1}}) {
        Tensor part = poisoned(DType::f32, {m, s.n});
        gpu_->gemm_batch_invariant(row_view(da, r0, m), db, part);
        expect_bits(host(part), host_rows(all_h, r0, m), what + " rows " + std::to_string(r0) + "+" + std::to_string(m));
      }
    }
  Tensor a = dev(randn({3, 64})), b = dev(randn({5, 32})), d = poisoned(DType::f32, {3, 5});
  expect_error([&] { gpu_->gemm_batch_invariant(a, b, d); }, "b must be [N, 64]");
  Tensor b2 = dev(randn({5, 64}, 1.0f, DType::bf16));
  expect_error([&] { gpu_->gemm_batch_invariant(a, b2, d); }, "gemm_batch_invariant: b");
}

// The batch-invariant GEMM over G strided matrices (the absorption under batch invariance): every
// matrix the bits of the 2-D call on a contiguous copy of its operands, at 1..8 rows, with the
// heads side by side in the columns; with and without 16-byte vectors (K % 4, the strides).
TEST_F(CudaModelOps, GemmBatchInvariantBatchedEqualsEachMatrixAlone) {
  struct Shape {
    int64_t heads, rows, k, n, pad;
  };
  for (const Shape s : {Shape{32, 1, 128, 512, 64}, Shape{16, 8, 64, 256, 32}, Shape{2, 3, 32, 128, 32},
                        Shape{5, 7, 29, 37, 3}})
    for (const bool uv : {false, true}) {
      const int64_t H = s.heads, B = s.rows, K = s.k, N = s.n, wa = K + s.pad, wd = N + s.pad;
      const Tensor a = randn({B, H * wa}), b = randn({H * (N + 2), K});
      const auto view3 = [](const TensorView& t, int64_t off, int64_t G, int64_t R, int64_t C, int64_t bs, int64_t rs) {
        TensorView v(static_cast<float*>(t.data) + off, DType::f32, {G, R, C}, t.device);
        v.strides = {bs, rs, 1, 0};
        return v;
      };
      const Tensor da = dev(a), db = dev(b);
      Tensor d = poisoned(DType::f32, {B, H * wd});
      // uv: b's matrices two rows into each block of N + 2 (W_UV's offset in kv_b_proj's rows).
      const int64_t b0 = uv ? 2 * K : 0;
      gpu_->gemm_batch_invariant(view3(da.view(), 0, H, B, K, wa, H * wa), view3(db.view(), b0, H, N, K, (N + 2) * K, K),
                                 view3(d.view(), 0, H, B, N, wd, H * wd));
      const Tensor got = host(d);
      for (int64_t h = 0; h < H; ++h) {
        Tensor ah = Tensor::host(DType::f32, {B, K}), bh = Tensor::host(DType::f32, {N, K});
        for (int64_t r = 0; r < B; ++r)
          std::copy_n(a.ptr<float>() + r * H * wa + h * wa, K, ah.ptr<float>() + r * K);
        std::copy_n(b.ptr<float>() + h * (N + 2) * K + b0, N * K, bh.ptr<float>());
        Tensor alone = poisoned(DType::f32, {B, N});
        gpu_->gemm_batch_invariant(dev(ah), dev(bh), alone);
        const Tensor want = host(alone);
        Tensor gh = Tensor::host(DType::f32, {B, N});
        for (int64_t r = 0; r < B; ++r) std::copy_n(got.ptr<float>() + r * H * wd + h * wd, N, gh.ptr<float>() + r * N);
        expect_bits(gh, want, "batched gemm_batch_invariant H=" + std::to_string(H) + " B=" + std::to_string(B) +
                                  " K=" + std::to_string(K) + " head " + std::to_string(h));
      }
    }
}

// The heads of the absorbed MLA decode as one strided batched GEMM: a's and d's matrices side by
// side in the columns of token-major rows, b's the W_UK (K x N) or W_UV (N x K, transposed) row
// blocks of kv_b_proj; within FP32 rounding of the CPU's, and the columns between the matrices
// untouched.
TEST_F(CudaModelOps, GemmStridedBatchedMatchesCpu) {
  struct Shape {
    int64_t heads, rows, k, n;
  };
  const auto matrices = [](const TensorView& t, int64_t offset, int64_t G, int64_t R, int64_t C, int64_t batch,
                           int64_t row) {
    TensorView v(static_cast<float*>(t.data) + offset, DType::f32, {G, R, C}, t.device);
    v.strides = {batch, row, 1, 0};
    return v;
  };
  for (const Shape s : {Shape{32, 1, 128, 512}, Shape{16, 32, 64, 256}, Shape{2, 7, 32, 128}, Shape{5, 3, 29, 37},
                        Shape{128, 256, 128, 512}})
    for (bool tb : {false, true})
      for (bool acc : {false, true}) {
        const int64_t H = s.heads, B = s.rows, K = s.k, N = s.n, wa = K + 3, wd = N + 5, wb = K + N + 2;
        const Tensor a = randn({B, H * wa}), b = randn({H * (tb ? N + 2 : wb), tb ? K : N}), d0 = randn({B, H * wd});
        const int64_t b_batch = (tb ? N + 2 : wb) * (tb ? K : N), b_row = tb ? K : N;
        const auto views = [&](const TensorView& av, const TensorView& bv, const TensorView& dv) {
          return std::array<TensorView, 3>{matrices(av, 0, H, B, K, wa, H * wa),
                                           tb ? matrices(bv, 2 * K, H, N, K, b_batch, b_row)
                                              : matrices(bv, 0, H, K, N, b_batch, b_row),
                                           matrices(dv, 0, H, B, N, wd, H * wd)};
        };
        Tensor want = clone(d0);
        const auto hv = views(a.view(), b.view(), want.view());
        cpu_->gemm_strided_batched(hv[0], hv[1], hv[2], tb, acc);
        const Tensor da = dev(a), db = dev(b);
        Tensor d = dev(d0);
        const auto dv = views(da.view(), db.view(), d.view());
        gpu_->gemm_strided_batched(dv[0], dv[1], dv[2], tb, acc);
        expect_close(host(d), want, 1e-5,
                     "gemm_strided_batched H=" + std::to_string(H) + " M=" + std::to_string(B) + " K=" +
                         std::to_string(K) + " N=" + std::to_string(N) + " tb=" + std::to_string(tb) +
                         " acc=" + std::to_string(acc));
      }
  Tensor a = dev(randn({3, 64})), d = dev(randn({3, 64}));
  const TensorView a3 = matrices(a.view(), 0, 1, 3, 64, 192, 64), d3 = matrices(d.view(), 0, 1, 3, 64, 192, 64);
  const TensorView b3 = matrices(a.view(), 0, 1, 3, 64, 192, 64);  // [1, 3, 64]: K = 64 needs [1, 64, N]
  expect_error([&] { gpu_->gemm_strided_batched(a3, b3, d3, false, false); }, "gemm_strided_batched: b");
  expect_error([&] { gpu_->gemm_strided_batched(a.view(), b3, d3, false, false); }, "gemm_strided_batched: a");
}

TEST_F(CudaModelOps, ConvertBitExact) {
  Tensor x = randn({37, 65}, 3.0f);
  const std::pair<DType, DType> pairs[] = {{DType::f32, DType::bf16}, {DType::bf16, DType::f32},
                                           {DType::f32, DType::f64}, {DType::f64, DType::bf16},
                                           {DType::f32, DType::f32}};
  for (auto [from, to] : pairs) {
    Tensor src = as_dtype(x, from);
    Tensor want = nan_host(to, {37, 65});
    cpu_->convert(src, want);
    Tensor d = poisoned(to, {37, 65});
    cuda_convert(dev(src), d, nullptr);
    expect_bits(host(d), want, "convert " + std::string(dtype_name(from)) + " -> " + std::string(dtype_name(to)));
  }
}

TEST_F(CudaModelOps, AxpyBitExact) {
  for (double beta : {1.0, 0.37, 0.0}) {
    Tensor x = randn({1001}), y0 = randn({1001});
    Tensor want = clone(y0);
    cpu_->axpy(-1.7, x, beta, want);
    Tensor y = dev(y0);
    cuda_axpy(-1.7, dev(x), beta, y, nullptr);
    expect_bits(host(y), want, "axpy beta=" + std::to_string(beta));
  }
}

TEST_F(CudaModelOps, CopyColsBitExact) {
  const int64_t R = 43;
  for (DType sd : {DType::f32, DType::bf16})
    for (DType dd : {DType::f32, DType::bf16})
      for (bool acc : {false, true}) {
        Tensor src = randn({R, 50}, 1.0f, sd);
        Tensor d0 = acc ? randn({R, 77}, 1.0f, dd) : nan_host(dd, {R, 77});
        Tensor want = clone(d0);
        cpu_->copy_cols(src, 7, want, 30, 33, acc);
        Tensor d = dev(d0);
        cuda_copy_cols(dev(src), 7, d, 30, 33, acc, nullptr);
        expect_bits(host(d), want, "copy_cols " + std::string(dtype_name(sd)) + " -> " +
                                       std::string(dtype_name(dd)) + (acc ? " accumulate" : ""));
      }
}

TEST_F(CudaModelOps, TransposeBitExact) {
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (auto [r, c] : {std::pair<int64_t, int64_t>{37, 65}, {1, 100}, {64, 32}, {130, 3}}) {
      Tensor src = randn({r, c}, 1.0f, dt);
      Tensor want = nan_host(dt, {c, r});
      cpu_->transpose(src, want);
      Tensor d = poisoned(dt, {c, r});
      cuda_transpose(dev(src), d, nullptr);
      expect_bits(host(d), want, "transpose " + std::string(dtype_name(dt)) + " [" + std::to_string(r) + ", " +
                                     std::to_string(c) + "]");
    }
}

// ---- embedding, loss ----

TEST_F(CudaModelOps, EmbeddingForwardBackwardBitExact) {
  const int64_t V = 50, D = 70, N = 301;
  Tensor table = randn({V, D});
  Tensor ids = ids_host(rng_, N, 0, 12);  // many repeats: the backward's order matters
  Tensor want = nan_host(DType::f32, {N, D});
  cpu_->embedding_forward(ids, table, want);
  Tensor out = poisoned(DType::f32, {N, D});
  Tensor ids_d = dev(ids);
  cuda_embedding_forward(ids_d, dev(table), out, nullptr);
  expect_bits(host(out), want, "embedding_forward");

  Tensor dout = randn({N, D});
  Tensor dt0 = randn({V, D});
  Tensor dwant = clone(dt0);
  cpu_->embedding_backward(ids, dout, dwant);
  Tensor dt = dev(dt0);
  cuda_embedding_backward(ids_d, dev(dout), dt, nullptr);
  expect_bits(host(dt), dwant, "embedding_backward");
  {
    // Runs longer than the kernel's 128-position chunk (about 330 tokens per id), two column blocks.
    const int64_t N2 = 1000, D2 = 200;
    Tensor ids2 = ids_host(rng_, N2, 0, 3);
    Tensor dout2 = randn({N2, D2});
    Tensor d0 = randn({V, D2});
    Tensor want2 = clone(d0);
    cpu_->embedding_backward(ids2, dout2, want2);
    Tensor d2 = dev(d0);
    cuda_embedding_backward(dev(ids2), dev(dout2), d2, nullptr);
    expect_bits(host(d2), want2, "embedding_backward, long runs");
  }

  ids.ptr<int32_t>()[17] = int32_t(V);
  expect_error([&] { cuda_embedding_forward(dev(ids), dev(table), out, nullptr); }, "ids[17] = 50");
}

TEST_F(CudaModelOps, CrossEntropyMatchesCpu) {
  const int64_t N = 37, V = 1003;
  Tensor logits = randn({N, V}, 2.0f);
  Tensor targets = ids_host(rng_, N, 0, int32_t(V));
  targets.ptr<int32_t>()[3] = -1;
  targets.ptr<int32_t>()[20] = -100;
  for (bool grad : {true, false}) {
    Tensor lw = nan_host(DType::f32, {N}), gw = nan_host(DType::f32, {N, V});
    cpu_->cross_entropy(logits, targets, lw, grad ? gw.view() : TensorView{}, 0.25);
    Tensor l = poisoned(DType::f32, {N}), g = poisoned(DType::f32, {N, V});
    cuda_cross_entropy(dev(logits), dev(targets), l, grad ? g.view() : TensorView{}, 0.25, nullptr);
    expect_close(host(l), lw, 1e-5, "cross_entropy losses");
    if (grad) expect_close(host(g), gw, 1e-5, "cross_entropy dlogits");
  }
  targets.ptr<int32_t>()[5] = int32_t(V);
  Tensor l = poisoned(DType::f32, {N});
  expect_error([&] { cuda_cross_entropy(dev(logits), dev(targets), l, TensorView{}, 1.0, nullptr); }, "targets[5]");
}

// ---- norm, rope, attention, MLP ----

TEST_F(CudaModelOps, RmsnormForwardBackwardMatchCpu) {
  for (auto [N, D] : {std::pair<int64_t, int64_t>{37, 70}, {300, 1000}, {1, 5}}) {
    Tensor x = randn({N, D}), w = randn({D}, 0.5f);
    Tensor yw = nan_host(DType::f32, {N, D}), rw = nan_host(DType::f32, {N});
    cpu_->rmsnorm_forward(x, w, yw, rw, 1e-6);
    Tensor y = poisoned(DType::f32, {N, D}), r = poisoned(DType::f32, {N});
    Tensor xd = dev(x), wd = dev(w);
    cuda_rmsnorm_forward(xd, wd, y, r, 1e-6, nullptr);
    const std::string shape = " [" + std::to_string(N) + ", " + std::to_string(D) + "]";
    expect_close(host(y), yw, 1e-6, "rmsnorm_forward y" + shape);
    expect_close(host(r), rw, 1e-6, "rmsnorm_forward rstd" + shape);

    Tensor dy = randn({N, D});
    for (bool acc : {false, true}) {
      Tensor dx0 = acc ? randn({N, D}) : nan_host(DType::f32, {N, D});
      Tensor dw0 = randn({D});
      Tensor dxw = clone(dx0), dww = clone(dw0);
      cpu_->rmsnorm_backward(x, w, rw, dy, dxw, dww, acc);
      Tensor dx = dev(dx0), dwt = dev(dw0);
      cuda_rmsnorm_backward(xd, wd, dev(rw), dev(dy), dx, dwt, acc, nullptr);
      expect_close(host(dx), dxw, 1e-5, "rmsnorm_backward dx" + shape + (acc ? " accumulate" : ""));
      expect_close(host(dwt), dww, 1e-5, "rmsnorm_backward dw" + shape);
    }
    // Either output undefined: skipped.
    Tensor dx = poisoned(DType::f32, {N, D});
    cuda_rmsnorm_backward(xd, wd, dev(rw), dev(dy), dx, TensorView{}, false, nullptr);
    Tensor dxw = nan_host(DType::f32, {N, D});
    cpu_->rmsnorm_backward(x, w, rw, dy, dxw, TensorView{}, false);
    expect_close(host(dx), dxw, 1e-5, "rmsnorm_backward dx only" + shape);
    Tensor dw0 = randn({D});
    Tensor dwt = dev(dw0);
    cuda_rmsnorm_backward(xd, wd, dev(rw), dev(dy), TensorView{}, dwt, false, nullptr);
    Tensor dww = clone(dw0);
    cpu_->rmsnorm_backward(x, w, rw, dy, TensorView{}, dww, false);
    expect_close(host(dwt), dww, 1e-5, "rmsnorm_backward dw only" + shape);
  }
}

TEST_F(CudaModelOps, RopeForwardInverseMatchCpu) {
  const int64_t N = 75, H = 3, C = 40;
  Tensor pos = ids_host(rng_, N, 0, 4096);
  for (bool inverse : {false, true})
    for (auto [col0, rot] : {std::pair<int64_t, int64_t>{8, 32}, {0, 40}, {38, 2}}) {
      Tensor x0 = randn({N, H, C});
      Tensor want = clone(x0);
      cpu_->rope(want, col0, rot, pos, 10000.0, inverse);
      Tensor x = dev(x0);
      cuda_rope(x, col0, rot, dev(pos), 10000.0, inverse, nullptr);
      expect_close(host(x), want, 1e-5,
                   "rope col0=" + std::to_string(col0) + " rot=" + std::to_string(rot) + (inverse ? " inverse" : ""));
    }
}

// MLA's keys and values: the fused kernels against the composition they replace (Backend's
// default, run on the CUDA backend), bit for bit, and against the CPU backend (rope's tolerance;
// the copies exact). The latent columns of dckv, which the backward leaves alone, keep their values.
TEST_F(CudaModelOps, MlaSplitKvIsItsCompositionBitForBit) {
  const int64_t T = 75, H = 3, dn = 10, dr = 6, dv = 7, rkv = 9;
  const double theta = 10000.0;
  Tensor pos = ids_host(rng_, T, 0, 4096), kv = randn({T, H * (dn + dv)}), ckv = randn({T, rkv + dr});
  Tensor kc = Tensor::host(DType::f32, {T, H, dn + dr}), vc = Tensor::host(DType::f32, {T, H, dv});
  cpu_->mla_split_kv(kv, ckv, rkv, pos, theta, kc, vc);
  Tensor k[2], v[2];
  for (int fused = 0; fused < 2; ++fused) {
    k[fused] = poisoned(DType::f32, {T, H, dn + dr});
    v[fused] = poisoned(DType::f32, {T, H, dv});
    if (fused) gpu_->mla_split_kv(dev(kv), dev(ckv), rkv, dev(pos), theta, k[fused], v[fused]);
    else gpu_->Backend::mla_split_kv(dev(kv), dev(ckv), rkv, dev(pos), theta, k[fused], v[fused]);
  }
  expect_bits(host(k[1]), host(k[0]), "mla_split_kv k");
  expect_bits(host(v[1]), host(v[0]), "mla_split_kv v");
  expect_close(host(k[1]), kc, 1e-5, "mla_split_kv k against the CPU");
  expect_bits(host(v[1]), vc, "mla_split_kv v against the CPU");

  Tensor dk = randn({T, H, dn + dr}), dvv = randn({T, H, dv}), dckv0 = randn({T, rkv + dr});
  Tensor dkvc = Tensor::host(DType::f32, {T, H * (dn + dv)}), dckvc = clone(dckv0);
  cpu_->mla_split_kv_backward(dk, dvv, pos, theta, dkvc, dckvc, rkv);
  Tensor dkv[2], dckv[2];
  for (int fused = 0; fused < 2; ++fused) {
    dkv[fused] = poisoned(DType::f32, {T, H * (dn + dv)});
    dckv[fused] = dev(dckv0);
    if (fused) gpu_->mla_split_kv_backward(dev(dk), dev(dvv), dev(pos), theta, dkv[fused], dckv[fused], rkv);
    else gpu_->Backend::mla_split_kv_backward(dev(dk), dev(dvv), dev(pos), theta, dkv[fused], dckv[fused], rkv);
  }
  expect_bits(host(dkv[1]), host(dkv[0]), "mla_split_kv_backward dkv");
  expect_bits(host(dckv[1]), host(dckv[0]), "mla_split_kv_backward dckv");
  expect_bits(host(dkv[1]), dkvc, "mla_split_kv_backward dkv against the CPU");
  expect_close(host(dckv[1]), dckvc, 1e-5, "mla_split_kv_backward dckv against the CPU");
  const Tensor got = host(dckv[1]);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < rkv; ++c)
      ASSERT_EQ(got.ptr<float>()[t * (rkv + dr) + c], dckv0.ptr<float>()[t * (rkv + dr) + c]) << t << ", " << c;
}

struct AttnCase {
  int64_t B, S, H, Dk, Dv;
  std::string str() const {
    return " B=" + std::to_string(B) + " S=" + std::to_string(S) + " H=" + std::to_string(H) +
           " Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv);
  }
};

const char* path_name(AttentionPath p) {
  return p == AttentionPath::gemm           ? " gemm"
         : p == AttentionPath::gemm_looped  ? " gemm looped"
         : p == AttentionPath::gemm_batched ? " gemm batched"
         : p == AttentionPath::flash        ? " flash"
                                            : " automatic";
}

// ||got - want|| / ||want|| over a tensor.
double rel_norm(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = to_doubles(got.view()), w = to_doubles(want.view());
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return std::sqrt(num / den);
}

// Sequence lengths off the 32-row tiles, several heads and sequences, Dk != Dv, and the
// hidden-2048 config's heads (seq_len 512, Dk 192, Dv 128). The GEMM path batches over heads
// where H >= B and over sequences otherwise (B=4 H=2, B=2 H=1); head dims past the flash kernels'
// 256 only on it.
const AttnCase kAttnCases[] = {{3, 37, 3, 40, 24}, {2, 70, 2, 96, 64},   {1, 33, 1, 256, 200}, {4, 1, 2, 8, 8},
                               {2, 64, 1, 17, 129}, {2, 512, 2, 192, 128}, {2, 45, 2, 300, 40}};

// Attention on one CUDA path against the CPU op in one compute (f32 or bf16): the forward's out
// and lse, and the backward (given the CPU's out and lse, so checked on its own) dq, dk, dv;
// device outputs poisoned. `cap` is the GEMM path's workspace cap.
class CudaAttention : public CudaModelOps {
 protected:
  struct Want {
    Tensor q, k, v, out, lse, dout, dq, dk, dv;
    DType compute;
  };
  struct Got {
    Tensor out, lse, dq, dk, dv;
  };

  // The CPU op on the inputs of `in` (q, k, v, dout) in `compute`.
  Want cpu_outputs(const AttnCase& c, const Want& in, DType compute) {
    const int64_t T = c.B * c.S;
    Want w{in.q, in.k, in.v, nan_host(DType::f32, {T, c.H, c.Dv}), nan_host(DType::f32, {c.H, T}), in.dout,
           nan_host(DType::f32, {T, c.H, c.Dk}), nan_host(DType::f32, {T, c.H, c.Dk}),
           nan_host(DType::f32, {T, c.H, c.Dv}), compute};
    cpu_->attention_forward(w.q, w.k, w.v, w.out, w.lse, c.S, scale(c), compute);
    cpu_->attention_backward(w.q, w.k, w.v, w.out, w.lse, w.dout, w.dq, w.dk, w.dv, c.S, scale(c), compute);
    return w;
  }

  // Fresh random inputs and the CPU op's outputs in `compute`.
  Want reference(const AttnCase& c, DType compute) {
    const int64_t T = c.B * c.S;
    Want in{randn({T, c.H, c.Dk}), randn({T, c.H, c.Dk}), randn({T, c.H, c.Dv}), {}, {}, randn({T, c.H, c.Dv}),
            {},                    {},                    {},                    compute};
    return cpu_outputs(c, in, compute);
  }

  // The CUDA op on w's inputs in w's compute.
  Got run(const AttnCase& c, const Want& w, AttentionPath path, size_t cap = kAttentionWorkspaceCap) {
    const int64_t T = c.B * c.S;
    Got g{poisoned(DType::f32, {T, c.H, c.Dv}), poisoned(DType::f32, {c.H, T}), poisoned(DType::f32, {T, c.H, c.Dk}),
          poisoned(DType::f32, {T, c.H, c.Dk}), poisoned(DType::f32, {T, c.H, c.Dv})};
    const Tensor qd = dev(w.q), kd = dev(w.k), vd = dev(w.v);
    cuda_attention_forward(qd, kd, vd, g.out, g.lse, c.S, scale(c), w.compute, nullptr, path, cap);
    cuda_attention_backward(qd, kd, vd, dev(w.out), dev(w.lse), dev(w.dout), g.dq, g.dk, g.dv, c.S, scale(c),
                            w.compute, nullptr, path, cap);
    return {host(g.out), host(g.lse), host(g.dq), host(g.dk), host(g.dv)};
  }

  // NOTES: bf16 tolerances. The CUDA paths differ from the CPU op only in the order of their FP32
  // sums (the CPU sums exactly in FP64), which moves the FP32 values of P and dS by ~1e-7
  // relative; where one sits that close to the midpoint of two BF16 values, its BF16 rounding
  // flips, a change of one BF16 step (2^-8 to 2^-7 relative) in one term of a GEMM. Some 1e-4 of
  // them flip: simulated on these cases (FP32 sums against FP64 ones, four seeds), the worst
  // element is off by 3e-4 of the tensor's largest and the worst tensor by 7e-5 in relative
  // norm. A rounding of
  // the CPU op left out (or one added) moves every term by up to 2^-9 relative: 1.4e-3 to 4e-3 in
  // relative norm per affected tensor, and the exact op is 2.6e-3 or more away from the bf16 one
  // (checked below on the GPU's results). Hence: out, dq, dk, dv within 5e-4 relative norm and
  // elementwise within 1e-3 of the value plus 1e-3 of the tensor's largest; lse, which no BF16
  // rounding follows, within the FP32 tolerance.
  // With S = 1 (P = 1), dq and dk are bf(dS) bf(k) with dS = (bf(dout) . bf(v) - dout . bf(v)) *
  // scale, a difference of roundings (~5e-3) that FP32 gets to ~2e-7 absolute: one flip in some
  // 100 rows moves a row by a whole BF16 step (at most 2^-7 = 7.8e-3 relative), so those compare
  // elementwise within 1e-2 relative, plus 1e-5 absolute for the rows where dS nearly cancels.
  static constexpr double kBf16RelNorm = 5e-4;

  void expect_matches(const AttnCase& c, const Got& g, const Want& w, const std::string& what) {
    expect_close(g.lse, w.lse, 1e-4, "attention_forward lse" + what);
    if (w.compute == DType::bf16) {
      const std::pair<const Tensor*, const Tensor*> pairs[] = {{&g.out, &w.out}, {&g.dq, &w.dq}, {&g.dk, &w.dk},
                                                               {&g.dv, &w.dv}};
      const char* names[] = {"attention_forward out", "attention_backward dq", "attention_backward dk",
                             "attention_backward dv"};
      for (int i = 0; i < 4; ++i) {
        if (c.S == 1 && (i == 1 || i == 2)) {
          expect_close(*pairs[i].first, *pairs[i].second, 1e-2, names[i] + what, 0, 1e-5);
          continue;
        }
        expect_close(*pairs[i].first, *pairs[i].second, 1e-3, names[i] + what, 1e-3);
        EXPECT_LT(rel_norm(*pairs[i].first, *pairs[i].second), kBf16RelNorm) << names[i] << what;
      }
      return;
    }
    expect_close(g.out, w.out, 1e-4, "attention_forward out" + what);
    // NOTES: with S = 1 the exact dq, dk are 0 (p = 1, out = v, so dout.v - rowsum(dout*out) = 0),
    // which FP32 gives as ~1e-8 roundoff of two O(1) sums: an absolute floor of 1e-6 covers it.
    expect_close(g.dq, w.dq, 1e-4, "attention_backward dq" + what, 1e-4, 1e-6);
    expect_close(g.dk, w.dk, 1e-4, "attention_backward dk" + what, 1e-4, 1e-6);
    expect_close(g.dv, w.dv, 1e-4, "attention_backward dv" + what, 1e-4, 1e-6);
  }

  void expect_same_bits(const Got& a, const Got& b, const std::string& what) {
    expect_bits(a.out, b.out, "attention_forward out" + what);
    expect_bits(a.lse, b.lse, "attention_forward lse" + what);
    expect_bits(a.dq, b.dq, "attention_backward dq" + what);
    expect_bits(a.dk, b.dk, "attention_backward dk" + what);
    expect_bits(a.dv, b.dv, "attention_backward dv" + what);
  }

  static double scale(const AttnCase& c) { return 1.0 / std::sqrt(double(c.Dk)); }
};

TEST_F(CudaAttention, EveryPathMatchesCpu) {
  for (const AttnCase& c : kAttnCases) {
    const Want w = reference(c, DType::f32);
    for (AttentionPath path : {AttentionPath::flash, AttentionPath::gemm_batched, AttentionPath::gemm_looped}) {
      if (path == AttentionPath::flash && std::max(c.Dk, c.Dv) > 256) continue;
      expect_matches(c, run(c, w, path), w, c.str() + path_name(path));
    }
  }
}

// BF16 GEMM operands (the bf16 and FP8 recipes) on every path against the CPU op's bf16; the
// same results are out of that tolerance against the exact CPU op, so the check tells the two
// computes apart (with S = 1 the exact dq, dk are 0: not compared).
TEST_F(CudaAttention, Bf16EveryPathMatchesCpu) {
  for (const AttnCase& c : kAttnCases) {
    const Want w = reference(c, DType::bf16), exact = cpu_outputs(c, w, DType::f32);
    for (AttentionPath path : {AttentionPath::flash, AttentionPath::gemm_batched, AttentionPath::gemm_looped}) {
      if (path == AttentionPath::flash && std::max(c.Dk, c.Dv) > 256) continue;
      const std::string what = c.str() + path_name(path) + " bf16";
      const Got g = run(c, w, path);
      expect_matches(c, g, w, what);
      EXPECT_GT(rel_norm(g.out, exact.out), 2 * kBf16RelNorm) << "out vs the exact op" << what;
      EXPECT_GT(rel_norm(g.dv, exact.dv), 2 * kBf16RelNorm) << "dv vs the exact op" << what;
      if (c.S > 1) {
        EXPECT_GT(rel_norm(g.dq, exact.dq), 2 * kBf16RelNorm) << "dq vs the exact op" << what;
        EXPECT_GT(rel_norm(g.dk, exact.dk), 2 * kBf16RelNorm) << "dk vs the exact op" << what;
      }
    }
  }
}

// In both computes: the GEMM path over several chunks, run to run bit-identical; the automatic
// choice (the GEMM path under the default cap, the flash kernels when one sequence is over the
// cap) gives the forced path's bits; a forced GEMM path over the cap is an error.
TEST_F(CudaAttention, GemmPathChunksAndDispatch) {
  const AttnCase c{5, 37, 2, 40, 24};
  for (DType compute : {DType::f32, DType::bf16}) {
    const Want w = reference(c, compute);
    const std::string what = c.str() + " " + std::string(dtype_name(compute));
    const size_t fwd = cuda_attention_workspace_bytes(c.S, c.H, c.Dk, c.Dv, compute, false),
                 bwd = cuda_attention_workspace_bytes(c.S, c.H, c.Dk, c.Dv, compute, true);
    // In f32 the backward's workspace is twice the forward's (two score buffers). A cap of 3
    // backward sequences: the forward in one chunk of 5 sequences (batched over sequences), the
    // backward in chunks of 3 (over sequences) and 2 (over heads); a cap of 1: forward chunks of
    // 2, 2, 1, backward of 1. In bf16 (BF16 copies of the scores and of the operands besides)
    // the forward's chunks differ.
    for (int64_t n : {3, 1}) {
      const Got g = run(c, w, AttentionPath::gemm, size_t(n) * bwd);
      expect_matches(c, g, w, what + " gemm, cap of " + std::to_string(n) + " backward sequences");
    }
    const Got g1 = run(c, w, AttentionPath::gemm), g2 = run(c, w, AttentionPath::gemm);
    expect_same_bits(g1, g2, what + " gemm, run to run");
    expect_same_bits(run(c, w, AttentionPath::automatic), g1, what + " automatic vs gemm");
    ASSERT_LT(fwd, bwd);
    expect_same_bits(run(c, w, AttentionPath::automatic, fwd - 1), run(c, w, AttentionPath::flash),
                     what + " automatic over the cap vs flash");
    expect_error([&] { run(c, w, AttentionPath::gemm, fwd - 1); }, "over the cap");
  }
}

// The GEMM path's one GEMM per product over a chunk's sequences and heads runs the algorithm the
// looped GEMMs' heuristic chose: bitwise equal to them (and so is `gemm`, whichever it takes) in
// both computes, over the cases above,
// one more of more sequences than heads, and the medium config's attention (B = 8 x 256, H = 8,
// Dk 96, Dv 64), whose looped GEMMs keep most SMs idle. (GemmPathChunksAndDispatch runs the
// batched GEMMs over several chunks.)
TEST_F(CudaAttention, BatchedGemmsAreTheLoopedOnesBitForBit) {
  std::vector<AttnCase> cases(std::begin(kAttnCases), std::end(kAttnCases));
  cases.push_back({8, 256, 8, 96, 64});
  cases.push_back({6, 40, 2, 24, 16});
  for (DType compute : {DType::f32, DType::bf16}) {
    for (const AttnCase& c : cases) {
      const Want w = reference(c, compute);
      const std::string what = c.str() + " " + std::string(dtype_name(compute));
      const Got looped = run(c, w, AttentionPath::gemm_looped);
      expect_same_bits(run(c, w, AttentionPath::gemm_batched), looped, what + " batched vs looped");
      expect_same_bits(run(c, w, AttentionPath::gemm), looped, what + " gemm vs looped");
    }
  }
}

TEST_F(CudaModelOps, AttentionRejectsBadArguments) {
  Tensor q = poisoned(DType::f32, {10, 2, 8}), v = poisoned(DType::f32, {10, 2, 8});
  Tensor l = poisoned(DType::f32, {2, 10});
  expect_error([&] { cuda_attention_forward(q, q, v, v, l, 3, 1.0, DType::f32, nullptr); }, "seq_len = 3");
  Tensor lbad = poisoned(DType::f32, {10, 2});
  expect_error([&] { cuda_attention_forward(q, q, v, v, lbad, 5, 1.0, DType::f32, nullptr); }, "lse");
  Tensor qbig = poisoned(DType::f32, {10, 2, 300});
  expect_error([&] { cuda_attention_forward(qbig, qbig, v, v, l, 5, 1.0, DType::bf16, nullptr, AttentionPath::flash); },
               "Dk = 300");
  expect_error([&] { cuda_attention_forward(q, q, v, v, l, 5, 1.0, DType::e4m3, nullptr); },
               "attention_forward: compute = e4m3 must be bf16 or the tensors' dtype f32");
}

TEST_F(CudaModelOps, SwigluForwardBackwardMatchCpu) {
  const int64_t T = 37, F = 130;
  Tensor g = randn({T, F}, 3.0f), u = randn({T, F}), dout = randn({T, F});
  Tensor ow = nan_host(DType::f32, {T, F});
  cpu_->swiglu_forward(g, u, ow);
  Tensor o = poisoned(DType::f32, {T, F});
  Tensor gd = dev(g), ud = dev(u);
  cuda_swiglu_forward(gd, ud, o, nullptr);
  expect_close(host(o), ow, 1e-5, "swiglu_forward", 1e-7);
  Tensor dgw = nan_host(DType::f32, {T, F}), duw = nan_host(DType::f32, {T, F});
  cpu_->swiglu_backward(g, u, dout, dgw, duw);
  Tensor dg = poisoned(DType::f32, {T, F}), du = poisoned(DType::f32, {T, F});
  cuda_swiglu_backward(gd, ud, dev(dout), dg, du, nullptr);
  expect_close(host(dg), dgw, 1e-5, "swiglu_backward dgate", 1e-7);
  expect_close(host(du), duw, 1e-5, "swiglu_backward dup", 1e-7);
}

// ---- MoE ----

struct RouteCase {
  int64_t N, E, n_group, topk_group, k;
  bool norm;
  double scaling;
};

TEST_F(CudaModelOps, MoeRouteAndBackwardMatchCpu) {
  for (const RouteCase c : {RouteCase{101, 64, 8, 3, 6, true, 2.5}, RouteCase{37, 16, 1, 1, 4, false, 1.0},
                            RouteCase{70, 8, 8, 4, 3, true, 1.0}, RouteCase{5, 256, 8, 4, 8, true, 2.5}}) {
    const std::string what = " N=" + std::to_string(c.N) + " E=" + std::to_string(c.E) + " groups=" +
                             std::to_string(c.n_group) + "/" + std::to_string(c.topk_group) + " k=" +
                             std::to_string(c.k) + (c.norm ? " norm" : "");
    Tensor logits = randn({c.N, c.E}, 2.0f), bias = randn({c.E}, 0.1f);
    Tensor sw = nan_host(DType::f32, {c.N, c.E}), iw = nan_host(DType::i32, {c.N, c.k}),
           ww = nan_host(DType::f32, {c.N, c.k});
    cpu_->moe_route(logits, bias, sw, iw, ww, c.n_group, c.topk_group, c.norm, c.scaling);
    Tensor s = poisoned(DType::f32, {c.N, c.E}), id = poisoned(DType::i32, {c.N, c.k}),
           w = poisoned(DType::f32, {c.N, c.k});
    cuda_moe_route(dev(logits), dev(bias), s, id, w, c.n_group, c.topk_group, c.norm, c.scaling, nullptr);
    expect_close(host(s), sw, 1e-6, "moe_route scores" + what);
    expect_bits(host(id), iw, "moe_route idx" + what);
    expect_close(host(w), ww, 1e-5, "moe_route weights" + what);

    Tensor dweights = randn({c.N, c.k});
    for (bool with_ds : {false, true}) {
      Tensor ds = randn({c.N, c.E});
      Tensor dlw = nan_host(DType::f32, {c.N, c.E});
      cpu_->moe_route_backward(sw, iw, dweights, with_ds ? ds.view() : TensorView{}, dlw, c.norm, c.scaling);
      Tensor dl = poisoned(DType::f32, {c.N, c.E});
      cuda_moe_route_backward(dev(sw), dev(iw), dev(dweights), with_ds ? dev(ds).view() : TensorView{}, dl, c.norm,
                              c.scaling, nullptr);
      expect_close(host(dl), dlw, 1e-5, "moe_route_backward" + what + (with_ds ? " dscores" : ""));
    }
  }
}

TEST_F(CudaModelOps, GatherScatterRowsDotMatchCpu) {
  const int64_t T = 41, D = 70, N = 97, Np = 103;
  Tensor src = randn({T, D});
  Tensor idx = ids_host(rng_, N, 0, int32_t(T));
  Tensor w = randn({N});
  for (bool weighted : {false, true}) {
    Tensor want = nan_host(DType::f32, {Np, D});
    cpu_->gather_rows(src, idx, weighted ? w.view() : TensorView{}, want);
    Tensor dst = poisoned(DType::f32, {Np, D});
    cuda_gather_rows(dev(src), dev(idx), weighted ? dev(w).view() : TensorView{}, dst, nullptr);
    expect_bits(host(dst), want, std::string("gather_rows") + (weighted ? " weighted" : ""));  // rows >= N stay NaN
  }
  {
    Tensor s16 = as_dtype(src, DType::bf16);
    Tensor want = nan_host(DType::bf16, {Np, D});
    cpu_->gather_rows(s16, idx, TensorView{}, want);
    Tensor dst = poisoned(DType::bf16, {Np, D});
    cuda_gather_rows(dev(s16), dev(idx), TensorView{}, dst, nullptr);
    expect_bits(host(dst), want, "gather_rows bf16");
  }
  Tensor rows = randn({Np, D});
  for (bool weighted : {false, true}) {
    Tensor d0 = randn({T, D});
    Tensor want = clone(d0);
    cpu_->scatter_add_rows(rows, idx, weighted ? w.view() : TensorView{}, want);
    Tensor dst = dev(d0);
    cuda_scatter_add_rows(dev(rows), dev(idx), weighted ? dev(w).view() : TensorView{}, dst, nullptr);
    expect_bits(host(dst), want, std::string("scatter_add_rows") + (weighted ? " weighted" : ""));
  }
  Tensor b = randn({Np + 2, D});
  Tensor want = nan_host(DType::f32, {N});
  cpu_->rows_dot(rows, b, want);
  Tensor out = poisoned(DType::f32, {N});
  cuda_rows_dot(dev(rows), dev(b), out, nullptr);
  expect_close(host(out), want, 1e-6, "rows_dot");

  idx.ptr<int32_t>()[9] = -2;
  Tensor dst = poisoned(DType::f32, {Np, D});
  expect_error([&] { cuda_gather_rows(dev(src), dev(idx), TensorView{}, dst, nullptr); }, "idx[9] = -2");
  Tensor dd = dev(randn({T, D}));
  expect_error([&] { cuda_scatter_add_rows(dev(rows), dev(idx), TensorView{}, dd, nullptr); }, "idx[9] = -2");
}

// scatter_rows (the latent cache's writes): byte for byte the CPU's, for rows of 1 to 16-byte
// multiples (each element width of the kernel) at distinct random rows of a larger table, the
// other rows untouched; entries out of range are skipped on the device.
TEST_F(CudaModelOps, ScatterRowsBitExact) {
  const int64_t R = 300, N = 77;
  std::vector<int32_t> perm(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) perm[size_t(i)] = int32_t(i);
  std::shuffle(perm.begin(), perm.end(), rng_);
  Tensor idx = Tensor::host(DType::i32, {N});
  std::copy_n(perm.begin(), N, idx.ptr<int32_t>());
  const std::pair<DType, int64_t> cases[] = {{DType::u8, 7},   {DType::u8, 64},    {DType::bf16, 3},
                                             {DType::bf16, 32}, {DType::f32, 5},   {DType::f32, 576},
                                             {DType::bf16, 64}, {DType::u8, 512},  {DType::f32, 2}};
  for (const auto& [dt, C] : cases) {
    Tensor src = Tensor::host(dt, {N + 3, C}), d0 = Tensor::host(dt, {R, C});
    std::uniform_int_distribution<int> byte(0, 255);
    for (Tensor* t : {&src, &d0})
      for (size_t i = 0; i < t->view().nbytes(); ++i) static_cast<uint8_t*>(t->view().data)[i] = uint8_t(byte(rng_));
    Tensor want = clone(d0);
    cpu_->scatter_rows(src, idx, want);
    Tensor dst = dev(d0);
    gpu_->scatter_rows(dev(src), dev(idx), dst);
    const std::string what = "scatter_rows " + std::string(dtype_name(dt)) + " C=" + std::to_string(C);
    expect_bits(host(dst), want, what);
    Tensor bad = clone(idx);
    bad.ptr<int32_t>()[4] = -1;
    bad.ptr<int32_t>()[10] = int32_t(R);
    Tensor want_bad = clone(d0);
    for (int64_t i = 0; i < N; ++i) {
      const int32_t r = bad.ptr<int32_t>()[i];
      if (r < 0 || r >= R) continue;
      const size_t row = want_bad.view().nbytes() / size_t(R);
      std::memcpy(static_cast<char*>(want_bad.view().data) + size_t(r) * row,
                  static_cast<const char*>(src.view().data) + size_t(i) * row, row);
    }
    Tensor dst_bad = dev(d0);
    gpu_->scatter_rows(dev(src), dev(bad), dst_bad);
    expect_bits(host(dst_bad), want_bad, what + " with entries out of range");
  }
}

// ---- optimizer ----

// The gradient norm's sum of squares in its fixed order (src/cuda/ops/reduce.cu: 264 blocks of 256
// threads per tensor, each thread's grid-stride FMAs in FP64, a tree per block, then one block
// adding the partials thread-strided and by a tree), emulated on the host bit for bit, over
// tensors that leave most blocks empty (the blocks past a tensor's end write their +0 at once),
// and ones past a whole grid's slice.
TEST_F(CudaModelOps, SumSquaresIsItsFixedOrderBitForBit) {
  // src/cuda/ops/reduce.cu's order: a tensor of n elements in min(ceil(n / (256 * 32)), 264)
  // grid-stride slices of 256 threads, the slices' tree sums in tensor and slice order.
  constexpr int kThreads = 256, kMaxBlocks = 264, kPerThread = 32;
  const auto tree = [](std::vector<double> part) {
    for (int s = kThreads / 2; s > 0; s >>= 1)
      for (int t = 0; t < s; ++t) part[size_t(t)] += part[size_t(t + s)];
    return part[0];
  };
  // Sizes: one slice, a few, the most (264) with 34 elements to some threads and 35 to others.
  std::vector<Tensor> hosts{randn({5}), randn({1000}, 0.01f), randn({70001}, 3.0f), randn({300, 1001}),
                            randn({264 * 256 * 34 + 777}, 0.5f)};
  std::vector<Tensor> devs;
  std::vector<TensorView> views;
  std::vector<double> partials;
  for (const Tensor& h : hosts) {
    devs.push_back(dev(h));
    views.push_back(devs.back().view());
    const int64_t n = h.numel();
    if (n == 0) continue;
    const int64_t blocks = std::clamp<int64_t>(ceil_div(n, int64_t(kThreads) * kPerThread), 1, kMaxBlocks);
    for (int64_t b = 0; b < blocks; ++b) {
      std::vector<double> part(kThreads);
      for (int t = 0; t < kThreads; ++t) {
        double acc = 0;
        for (int64_t i = b * kThreads + t; i < n; i += blocks * kThreads) {
          const double v = h.ptr<float>()[i];
          acc = std::fma(v, v, acc);
        }
        part[size_t(t)] = acc;
      }
      partials.push_back(tree(part));
    }
  }
  std::vector<double> part(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    double acc = 0;
    for (size_t i = size_t(t); i < partials.size(); i += kThreads) acc += partials[i];
    part[size_t(t)] = acc;
  }
  const double want = tree(part), got = cuda_sum_squares(views, nullptr);
  EXPECT_EQ(std::memcmp(&want, &got, sizeof want), 0) << "got " << got << ", want " << want;
}

TEST_F(CudaModelOps, AdamWMatchesCpuBitExact) {
  for (MomentPrecision mp : {MomentPrecision::bf16, MomentPrecision::f32}) {
    AdamWConfig cfg;
    cfg.moments = mp;
    // w3 spans two of adamw_steps' chunks of 64K elements and ends off a multiple of four.
    Tensor w1 = randn({37, 29}), w2 = randn({1001}, 0.02f), w3 = randn({70001}, 0.5f);
    Tensor g1 = Tensor::host(DType::f32, {37, 29}), g2 = Tensor::host(DType::f32, {1001}),
           g3 = Tensor::host(DType::f32, {70001});
    std::vector<ParamRef> params{{"w1", w1.view(), g1.view(), true},
                                 {"w2", w2.view(), g2.view(), false},
                                 {"w3", w3.view(), g3.view(), true}};
    Tensor dw1 = dev(w1), dw2 = dev(w2), dw3 = dev(w3);
    Tensor dg1 = dev(g1), dg2 = dev(g2), dg3 = dev(g3);
    std::vector<ParamRef> dparams{{"w1", dw1.view(), dg1.view(), true},
                                  {"w2", dw2.view(), dg2.view(), false},
                                  {"w3", dw3.view(), dg3.view(), true}};
    auto cpu = make_backend("cpu");
    AdamW opt(*cpu, params, cfg), gopt(*gpu_, dparams, cfg);
    for (int step = 0; step < 4; ++step) {
      Tensor ng1 = randn({37, 29}, 0.1f), ng2 = randn({1001}, 1e-3f), ng3 = randn({70001}, 0.01f);
      std::memcpy(g1.view().data, ng1.view().data, ng1.view().nbytes());
      std::memcpy(g2.view().data, ng2.view().data, ng2.view().nbytes());
      std::memcpy(g3.view().data, ng3.view().data, ng3.view().nbytes());
      gpu_->copy(dg1.view(), g1.view());
      gpu_->copy(dg2.view(), g2.view());
      gpu_->copy(dg3.view(), g3.view());
      const float lr = 3e-4f * float(step + 1), gs = step == 2 ? 0.5f : 1.0f;
      opt.step(lr, gs);
      gopt.step(lr, gs);
    }
    const std::string what = std::string(" moments ") + (mp == MomentPrecision::bf16 ? "bf16" : "f32");
    expect_bits(host(dw1), w1, "adamw w1" + what);
    expect_bits(host(dw2), w2, "adamw w2" + what);
    expect_bits(host(dw3), w3, "adamw w3" + what);
    for (size_t i = 0; i < 3; ++i) {
      expect_bits(host(gopt.first_moments()[i]), opt.first_moments()[i], "adamw m" + std::to_string(i + 1) + what);
      expect_bits(host(gopt.second_moments()[i]), opt.second_moments()[i], "adamw v" + std::to_string(i + 1) + what);
    }
    // The gradient norm: the same FP64 sum of squares on both devices (to rounding of the order).
    EXPECT_NEAR(global_grad_norm(*gpu_, dparams), global_grad_norm(*cpu, params), 1e-12 * global_grad_norm(*cpu, params));
  }
}

// ---- dtype policy ----

TEST_F(CudaModelOps, F64IsRejectedByName) {
  Tensor x = poisoned(DType::f64, {4, 8}), w = poisoned(DType::f64, {8}), r = poisoned(DType::f64, {4});
  expect_error([&] { cuda_rmsnorm_forward(x, w, x, r, 1e-6, nullptr); }, "f64 unsupported on cuda");
  expect_error([&] { cuda_gemm(x, x, x, false, true, false, nullptr); }, "f64 unsupported on cuda");
  expect_error([&] { cuda_swiglu_forward(x, x, x, nullptr); }, "f64 unsupported on cuda");
  Tensor h = Tensor::host(DType::f32, {4, 8});
  expect_error([&] { cuda_swiglu_forward(h, h, h, nullptr); }, "device tensor");
}

// Deferred checks (Backend::set_checks): a bad index or a NaN reaching a quantizer does not raise
// in the op, which touches nothing out of bounds, but at the next synchronize, naming the op; the
// check after that is clean again.
TEST(CudaChecks, DeferredChecksRaiseAtSynchronize) {
  FP8MOE_REQUIRE_GPU();
  auto be = make_backend("cuda");
  be->set_checks(Backend::Checks::deferred);
  Tensor src = be->zeros(DType::f32, {4, 8}), dst = be->zeros(DType::f32, {3, 8});
  Tensor idx_h = Tensor::host(DType::i32, {3});
  idx_h.ptr<int32_t>()[0] = 1;
  idx_h.ptr<int32_t>()[1] = 7;  // outside [0, 4)
  idx_h.ptr<int32_t>()[2] = 2;
  Tensor idx = be->zeros(DType::i32, {3});
  be->copy(idx.view(), idx_h.view());
  EXPECT_NO_THROW(be->gather_rows(src.view(), idx.view(), TensorView(), dst.view()));
  expect_error([&] { be->synchronize(); }, "gather_rows: idx[1] outside [0, 4)");
  EXPECT_NO_THROW(be->synchronize());

  Tensor xh = Tensor::host(DType::f32, {4, 128});
  for (int64_t i = 0; i < xh.numel(); ++i) xh.ptr<float>()[i] = 1.0f;
  xh.ptr<float>()[5] = std::numeric_limits<float>::quiet_NaN();
  Tensor x = be->zeros(DType::f32, {4, 128});
  be->copy(x.view(), xh.view());
  QuantizedTensor q = be->empty_quantized(4, 128, DType::e4m3, ScaleKind::tile_1x128);
  EXPECT_NO_THROW(be->quantize_1x128(x.view(), q, ScaleMode::fp32));
  expect_error([&] { be->synchronize(); }, "non-finite");
  EXPECT_NO_THROW(be->synchronize());

  be->set_checks(Backend::Checks::immediate);
  expect_error([&] { be->quantize_1x128(x.view(), q, ScaleMode::fp32); }, "non-finite");
}

// The EMA with its averages on the device (Backend::ema_fold): the averages are the host fold's
// bit for bit (the CPU backend's ParameterEma over the same weights), for a parameter of many
// float4s and for one that starts off 16-byte alignment in its allocation (the kernel's scalar
// path and tails).
TEST(CudaEma, DeviceFoldIsTheHostFoldBitForBit) {
  FP8MOE_REQUIRE_GPU();
  auto be = make_backend("cuda");
  auto cpu = make_backend("cpu");
  ASSERT_TRUE(be->folds_ema());
  auto rng = make_rng();
  const int64_t n = (1 << 20) + 3, m = 1001;
  Tensor all = be->zeros(DType::f32, {n + 1 + m});  // b starts at an odd float: not 16-byte aligned
  const TensorView a(all.ptr<float>(), DType::f32, {n}, Device::cuda);
  const TensorView b(all.ptr<float>() + n + 1, DType::f32, {m}, Device::cuda);
  Tensor ah = random_normal(rng, DType::f32, {n}), bh = random_normal(rng, DType::f32, {m});
  Tensor ga = Tensor::host_like(ah.view()), gb = Tensor::host_like(bh.view());
  be->copy(a, ah.view());
  be->copy(b, bh.view());
  Tensor gd = be->zeros(DType::f32, {n + 1 + m});
  ParameterEma dev({{"a", a, gd.view(), true}, {"b", b, gd.view(), true}}, 0.9f, *be, 1,
                   ParameterEma::Placement::device);
  ParameterEma host({{"a", ah.view(), ga.view(), true}, {"b", bh.view(), gb.view(), true}}, 0.9f, *cpu, 2);
  ASSERT_EQ(dev.averages()[0].device(), Device::cuda);
  std::normal_distribution<float> dist;
  for (int step = 0; step < 10; ++step) {
    for (Tensor* t : {&ah, &bh})
      for (int64_t i = 0; i < t->numel(); ++i) t->ptr<float>()[i] += dist(rng);
    host.wait();
    be->copy(a, ah.view());
    be->copy(b, bh.view());
    dev.update_async();
    host.update_async();
  }
  dev.wait();
  host.wait();
  EXPECT_EQ(dev.updates(), 10);
  for (size_t p = 0; p < 2; ++p) {
    const Tensor got = be->to_host(dev.averages()[p]);
    EXPECT_EQ(std::memcmp(got.ptr<float>(), host.averages()[p].ptr<float>(), size_t(got.numel()) * sizeof(float)), 0)
        << "parameter " << p;
  }
  // Other tensors on the same backend: the launch's table is built again for them.
  ParameterEma dev_b({{"b", b, gd.view(), true}}, 0.5f, *be, 1, ParameterEma::Placement::device);
  ParameterEma host_b({{"b", bh.view(), gb.view(), true}}, 0.5f, *cpu);
  for (int64_t i = 0; i < m; ++i) bh.ptr<float>()[i] += dist(rng);
  be->copy(b, bh.view());
  dev_b.update_async();
  host_b.update_async();
  host_b.wait();
  const Tensor got_b = be->to_host(dev_b.averages()[0]);
  EXPECT_EQ(std::memcmp(got_b.ptr<float>(), host_b.averages()[0].ptr<float>(), size_t(m) * sizeof(float)), 0);
  // Averages in host memory: refused by name.
  Tensor h = Tensor::host(DType::f32, {m});
  expect_error([&] { be->ema_fold({h.view()}, {b}, 0.9f); }, "must be on the device");
  expect_error([&] { be->ema_fold({b}, {b, a}, 0.9f); }, "1 averages for 2 values");
  expect_error([&] { ParameterEma({{"b", bh.view(), gb.view(), true}}, 0.9f, *cpu, 1, ParameterEma::Placement::device); },
               "does not");
}

}  // namespace
}  // namespace fp8moe::testing
