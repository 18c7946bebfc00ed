// Every op x every available backend against references written apart from the CPU backend (so
// that the CPU backend's own cases test something): the quantizers against an oracle that spells
// out the scale rule of quantize.hpp and picks each code as the nearest decoded value of the format
// (not the codecs' integer encoder), dequantization against the decoded codes times the scales,
// the GEMMs against the FP64 product of their operands; fused ops against the unfused path and the
// CPU's. Shapes are not multiples of the tiles, outputs poisoned before the run. Quantizers must
// match bit for bit; GEMMs within FP32 accumulation-order rounding. A backend that does not support
// an op reports it and is skipped for that op. Filter with --gtest_filter=*cuda*, *gemm_fp8*, ...
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "fp8moe/backend.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/minifloat_encode.hpp"
#include "testing.hpp"

using namespace fp8moe;
using namespace fp8moe::testing;

namespace {

struct Case {
  std::string backend;
  Op op;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.backend << "/" << op_name(c.op); }

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const std::string& b : available_backends())
    for (Op op : {Op::quantize_1x128, Op::quantize_128x128, Op::quantize_128x1, Op::quantize_1x128_and_128x1,
                  Op::requantize_128x1, Op::transpose_128x128, Op::dequantize, Op::gemm_fp8, Op::gemm_bf16,
                  Op::swiglu_backward_fp8, Op::swiglu_forward_fp8,
                  Op::rmsnorm_forward_fp8})  // the other model ops: tests/model and tests/cuda/test_cuda_model_ops.cpp
      cases.push_back({b, op});
  return cases;
}

// Host tensor -> a tensor on `be` (same bytes).
Tensor upload(Backend& be, const Tensor& host) {
  if (be.device() == Device::cpu) return host;
  const TensorView& v = host.view();
  Tensor t = v.ndim == 2 ? be.zeros(v.dtype, {v.shape[0], v.shape[1]}) : be.zeros(v.dtype, {v.shape[0]});
  be.copy(t.view(), v);
  return t;
}

QuantizedTensor upload(Backend& be, const QuantizedTensor& q) { return {upload(be, q.values), upload(be, q.scales), q.kind}; }

// Fills device memory of `t` with NaN-like bytes so unwritten elements are caught.
void poison(Backend& be, const Tensor& t) {
  Tensor h = Tensor::host_like(t.view());
  std::memset(h.view().data, 0xFF, h.view().nbytes());
  be.copy(t.view(), h.view());
}

void expect_same_bytes(Backend& be, const Tensor& got, const Tensor& want, const char* what) {
  Tensor h = be.to_host(got);
  ASSERT_EQ(h.view().nbytes(), want.view().nbytes());
  const auto* g = static_cast<const uint8_t*>(h.view().data);
  const auto* w = static_cast<const uint8_t*>(want.view().data);
  int64_t bad = 0;
  for (size_t i = 0; i < want.view().nbytes(); ++i)
    if (g[i] != w[i] && ++bad < 5) ADD_FAILURE() << what << ": byte " << i << " got " << int(g[i]) << " want " << int(w[i]);
  EXPECT_EQ(bad, 0) << what;
}

// A quantized output on `be` with its values and scales poisoned.
QuantizedTensor poisoned_quantized(Backend& be, int64_t rows, int64_t cols, DType dt, ScaleKind kind) {
  QuantizedTensor q = be.empty_quantized(rows, cols, dt, kind);
  poison(be, q.values);
  poison(be, q.scales);
  return q;
}

// ---- The independent quantizer (the oracle). A tile's scale: amax / max in float, rounded up to
// a power of two with frexp in pow2 mode, at least FLT_MIN, 1 for an all-zero tile; the reciprocal
// 1 / s once per tile and v = x * (1 / s) in float, as quantize.hpp specifies; the code: the
// nearest finite value of the format by binary search over its decoded values, ties to the even
// code, saturating at the largest, the sign copied.
class NearestCode {
 public:
  explicit NearestCode(DType dt) : dt_(dt), f_(format_of(dt)) {
    const uint32_t sign = 1u << (f_.exp_bits + f_.man_bits);
    for (uint32_t c = 0; c < sign; ++c) {
      const double v = minifloat_decode(f_, c);
      if (std::isfinite(v)) vals_.push_back({v, c});
    }
    std::sort(vals_.begin(), vals_.end());
    sign_ = sign;
  }
  uint32_t operator()(float v) const {
    const double a = std::fabs(double(v));
    auto hi = std::lower_bound(vals_.begin(), vals_.end(), std::pair{a, 0u});
    uint32_t code;
    if (hi == vals_.end()) {
      code = vals_.back().second;  // beyond the largest: saturate
    } else if (hi == vals_.begin() || hi->first == a) {
      code = hi->second;
    } else {
      const auto lo = hi - 1;
      const double dl = a - lo->first, dh = hi->first - a;
      code = dl < dh ? lo->second : dh < dl ? hi->second : (lo->second % 2 == 0 ? lo->second : hi->second);
    }
    return std::signbit(v) ? code | sign_ : code;
  }
  DType dtype() const { return dt_; }

 private:
  DType dt_;
  MiniFloatFormat f_;
  uint32_t sign_ = 0;
  std::vector<std::pair<double, uint32_t>> vals_;
};

float oracle_scale(float amax, DType dt, ScaleMode mode) {
  if (amax == 0) return 1.0f;
  float s = amax / float(max_finite(dt));
  if (mode == ScaleMode::pow2) {
    int e;
    const float m = std::frexp(s, &e);
    if (m != 0.5f) s = std::ldexp(1.0f, e);
  }
  return std::max(s, std::numeric_limits<float>::min());
}

void put_code(const QuantizedView& q, int64_t i, uint32_t code) {
  if (q.values.dtype == DType::e5m6) e5m6_store(q.values.ptr<uint8_t>(), i, uint16_t(code));
  else q.values.ptr<uint8_t>()[i] = uint8_t(code);
}

// out [R, C] host (1x128 or 128x128, out.kind) from get(r, c).
template <class Get>
void oracle_quantize(Get get, const QuantizedView& out, ScaleMode mode) {
  const NearestCode nearest(out.values.dtype);
  const int64_t R = out.rows(), C = out.cols(), br = out.kind == ScaleKind::tile_1x128 ? 1 : kQuantGroup;
  float* sc = out.scales.ptr<float>();
  for (int64_t r0 = 0; r0 < R; r0 += br)
    for (int64_t c0 = 0; c0 < C; c0 += kQuantGroup) {
      const int64_t r1 = std::min(R, r0 + br), c1 = std::min(C, c0 + kQuantGroup);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(get(r, c)));
      const float s = oracle_scale(amax, out.values.dtype, mode), inv = 1.0f / s;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) put_code(out, r * C + c, nearest(get(r, c) * inv));
      if (out.kind == ScaleKind::tile_1x128) sc[(c0 / kQuantGroup) * out.scales.size(1) + r0] = s;
      else sc[(r0 / kQuantGroup) * out.scales.size(1) + c0 / kQuantGroup] = s;
    }
  if (out.kind == ScaleKind::tile_1x128)  // scale padding rows
    for (int64_t g = 0; g < out.scales.size(0); ++g)
      for (int64_t r = R; r < out.scales.size(1); ++r) sc[g * out.scales.size(1) + r] = 1.0f;
}
void oracle_1x128(const Tensor& x, const QuantizedView& out, ScaleMode mode) {
  const int64_t C = x.size(1);
  oracle_quantize([&](int64_t r, int64_t c) { return load_float(x.view(), r * C + c); }, out, mode);
}
void oracle_128x1(const Tensor& x, const QuantizedView& out, ScaleMode mode) {  // out [C, T] = x^T tiles
  const int64_t C = x.size(1);
  oracle_quantize([&](int64_t c, int64_t t) { return load_float(x.view(), t * C + c); }, out, mode);
}
void oracle_128x128(const Tensor& w, const QuantizedView& out, ScaleMode mode) { oracle_1x128(w, out, mode); }
// The decoded code times its scale (an FP32 product), from the format's definition.
float oracle_value(const QuantizedView& q, int64_t r, int64_t c) {
  const int64_t i = r * q.cols() + c;
  const uint32_t code = q.values.dtype == DType::e5m6 ? e5m6_load(q.values.ptr<const uint8_t>(), i)
                                                      : q.values.ptr<const uint8_t>()[i];
  return float(minifloat_decode(format_of(q.values.dtype), code)) * q.scale_at(r, c);
}
void oracle_dequantize(const QuantizedView& q, const Tensor& out) {
  for (int64_t r = 0; r < q.rows(); ++r)
    for (int64_t c = 0; c < q.cols(); ++c) store_float(out.view(), r * q.cols() + c, oracle_value(q, r, c));
}
// D [M, N] = A B^T in FP64 from element accessors.
template <class A, class B>
std::vector<double> fp64_product(A a, B b, int64_t M, int64_t N, int64_t K) {
  std::vector<double> d(size_t(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += double(a(m, k)) * double(b(n, k));
      d[size_t(m * N + n)] = s;
    }
  return d;
}

// got's values and scales (on `be`) equal want's byte for byte (want on the host or on `be`).
void expect_same_quantized(Backend& be, const QuantizedTensor& got, const QuantizedTensor& want, const std::string& what) {
  const bool host = want.values.view().device == Device::cpu;
  const std::string pre = what.empty() ? "" : what + " ";
  expect_same_bytes(be, got.values, host ? want.values : be.to_host(want.values), (pre + "values").c_str());
  expect_same_bytes(be, got.scales, host ? want.scales : be.to_host(want.scales), (pre + "scales").c_str());
}

// dequantize of q (a host tensor) into `out` values on `be`, against the oracle byte for byte.
void check_dequantize(Backend& be, const QuantizedTensor& q, DType out, const char* what) {
  const int64_t R = q.values.size(0), C = q.values.size(1);
  Tensor want = Tensor::host(out, {R, C});
  Tensor got = be.zeros(out, {R, C});
  poison(be, got);
  oracle_dequantize(q, want);
  be.dequantize(upload(be, q), got);
  expect_same_bytes(be, got, want, what);
}

// Elementwise |got - want| <= rtol * |want| + atol * max |want|, finite (poison shows as NaN).
void expect_close(Backend& be, const Tensor& got, const Tensor& want, double rtol, double atol, const char* what) {
  const std::vector<double> g = to_doubles(be.to_host(got).view()), w = to_doubles(want.view());
  ASSERT_EQ(g.size(), w.size()) << what;
  double wmax = 0;
  for (double v : w) wmax = std::max(wmax, std::fabs(v));
  int64_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i)
    if (!(std::isfinite(g[i]) && std::fabs(g[i] - w[i]) <= rtol * std::fabs(w[i]) + atol * wmax) && ++bad < 5)
      ADD_FAILURE() << what << ": element " << i << " got " << g[i] << " want " << w[i];
  EXPECT_EQ(bad, 0) << what;
}

// swiglu_backward_fp8 on caches gate, up [R, F] for dout [T, F] (T <= R: a row-padded cache), with
// zero tiles (scale 1) in both inputs. The specification is dequantize followed by swiglu_forward
// and swiglu_backward: the op must equal that path on the same backend bit for bit (the Backend
// default runs it), and the CPU's exactly, up to expf's last bits on a GPU.
void check_swiglu_backward_fp8(Backend& cpu, Backend& be, std::mt19937_64& rng, int64_t R, int64_t T, int64_t F,
                               DType qt, ScaleMode mode) {
  SCOPED_TRACE(::testing::Message() << "R " << R << " T " << T << " F " << F << " " << dtype_name(qt)
                                    << (mode == ScaleMode::pow2 ? " pow2" : " fp32"));
  Tensor g = random_normal(rng, DType::f32, {R, F}, 3.0f), u = random_normal(rng, DType::f32, {R, F});
  Tensor dout = random_normal(rng, DType::f32, {T, F});
  const int64_t last = (F - 1) / kQuantGroup * kQuantGroup;  // first column of the last (partial) tile
  float* gp = g.view().ptr<float>();
  float* up = u.view().ptr<float>();
  for (int64_t c = 0; c < kQuantGroup; ++c) gp[1 * F + c] = 0;  // row 1, first tile of gate
  for (int64_t c = last; c < F; ++c) up[2 * F + c] = 0;         // row 2, last tile of up
  for (int64_t c = 0; c < F; ++c) gp[3 * F + c] = up[3 * F + c] = 0;
  auto gq = make_quantized_host(R, F, qt, ScaleKind::tile_1x128), uq = make_quantized_host(R, F, qt, ScaleKind::tile_1x128);
  cpu.quantize_1x128(g, gq, mode);
  cpu.quantize_1x128(u, uq, mode);
  ASSERT_EQ(gq.scales.view().ptr<float>()[1], 1.0f);  // tile (row 1, group 0): zero, scale 1

  // The specification on the CPU.
  Tensor gd = Tensor::host(DType::f32, {R, F}), ud = Tensor::host(DType::f32, {R, F});
  cpu.dequantize(gq, gd);
  cpu.dequantize(uq, ud);
  const TensorView gv(gd.view().data, DType::f32, {T, F}), uv(ud.view().data, DType::f32, {T, F});
  Tensor a_want = Tensor::host(DType::f32, {T, F}), dg_want = Tensor::host(DType::f32, {T, F}),
         du_want = Tensor::host(DType::f32, {T, F});
  cpu.swiglu_forward(gv, uv, a_want);
  cpu.swiglu_backward(gv, uv, dout, dg_want, du_want);

  const QuantizedTensor gqb = upload(be, gq), uqb = upload(be, uq);
  const Tensor db = upload(be, dout);
  auto fresh = [&] {
    Tensor t = be.zeros(DType::f32, {T, F});
    poison(be, t);
    return t;
  };
  Tensor a = fresh(), dg = fresh(), du = fresh();
  be.swiglu_backward_fp8(gqb, uqb, db, a, dg, du);
  // The unfused path on the same backend (the Backend default): bit for bit.
  Tensor a2 = fresh(), dg2 = fresh(), du2 = fresh();
  be.Backend::swiglu_backward_fp8(gqb, uqb, db, a2, dg2, du2);
  const Tensor a2h = be.to_host(a2), dg2h = be.to_host(dg2), du2h = be.to_host(du2);
  expect_same_bytes(be, a, a2h, "out vs unfused");
  expect_same_bytes(be, dg, dg2h, "dgate vs unfused");
  expect_same_bytes(be, du, du2h, "dup vs unfused");
  // Against the CPU's specification.
  if (be.device() == Device::cpu) {
    expect_same_bytes(be, a, a_want, "out");
    expect_same_bytes(be, dg, dg_want, "dgate");
    expect_same_bytes(be, du, du_want, "dup");
  } else {
    expect_close(be, a, a_want, 1e-5, 1e-7, "out");
    expect_close(be, dg, dg_want, 1e-5, 1e-7, "dgate");
    expect_close(be, du, du_want, 1e-5, 1e-7, "dup");
  }
  // Without out: the same gradients.
  Tensor dg3 = fresh(), du3 = fresh();
  be.swiglu_backward_fp8(gqb, uqb, db, TensorView(), dg3, du3);
  expect_same_bytes(be, dg3, dg2h, "dgate without out");
  expect_same_bytes(be, du3, du2h, "dup without out");
}

// swiglu_forward_fp8 of gate, up [T, F] into out [R, F] (R >= T: a row-padded Linear input), with
// zero tiles in both inputs. The specification is quantize_1x128 of gate and up, swiglu_forward into
// a zero-padded [R, F] temporary and quantize_1x128 of it: bit for bit against that path on the same
// backend (the Backend default runs it), against the CPU's exactly for the two cached inputs and,
// on a GPU, within one e4m3 step for the output (its SwiGLU values differ from the CPU's in expf's
// last bits).
void check_swiglu_forward_fp8(Backend& cpu, Backend& be, std::mt19937_64& rng, int64_t T, int64_t R, int64_t F,
                              ScaleMode mode) {
  SCOPED_TRACE(::testing::Message() << "T " << T << " R " << R << " F " << F
                                    << (mode == ScaleMode::pow2 ? " pow2" : " fp32"));
  Tensor g = random_normal(rng, DType::f32, {T, F}, 3.0f), u = random_normal(rng, DType::f32, {T, F});
  const int64_t last = (F - 1) / kQuantGroup * kQuantGroup;
  for (int64_t c = 0; c < kQuantGroup; ++c) g.view().ptr<float>()[1 * F + c] = 0;  // row 1, first tile of gate
  for (int64_t c = last; c < F; ++c) u.view().ptr<float>()[2 * F + c] = 0;         // row 2, last tile of up
  auto q = [](int64_t rows, int64_t cols) { return make_quantized_host(rows, cols, DType::e4m3, ScaleKind::tile_1x128); };
  QuantizedTensor gq_want = q(T, F), uq_want = q(T, F), out_want = q(R, F);
  oracle_1x128(g, gq_want, mode);
  oracle_1x128(u, uq_want, mode);
  Tensor a = cpu.zeros(DType::f32, {R, F});
  cpu.swiglu_forward(g, u, TensorView(a.view().data, DType::f32, {T, F}));
  oracle_1x128(a, out_want, mode);

  const Tensor gb = upload(be, g), ub = upload(be, u);
  auto fresh = [&](int64_t rows) { return poisoned_quantized(be, rows, F, DType::e4m3, ScaleKind::tile_1x128); };
  QuantizedTensor gq = fresh(T), uq = fresh(T), out = fresh(R);
  be.swiglu_forward_fp8(gb, ub, gq, uq, out, mode);
  QuantizedTensor gq2 = fresh(T), uq2 = fresh(T), out2 = fresh(R);
  be.Backend::swiglu_forward_fp8(gb, ub, gq2, uq2, out2, mode);
  expect_same_quantized(be, gq, gq2, "gate vs unfused");
  expect_same_quantized(be, uq, uq2, "up vs unfused");
  expect_same_quantized(be, out, out2, "out vs unfused");
  expect_same_quantized(be, gq, gq_want, "gate");
  expect_same_quantized(be, uq, uq_want, "up");
  if (be.device() == Device::cpu) {
    expect_same_quantized(be, out, out_want, "out");
  } else {
    Tensor got_d = be.zeros(DType::f32, {R, F}), want_d = Tensor::host(DType::f32, {R, F});
    be.dequantize(out, got_d);
    oracle_dequantize(out_want, want_d);
    expect_close(be, got_d, want_d, 0.13, 1e-5, "out (dequantized)");
  }
}

// rmsnorm_forward_fp8 of x [T, D] into out [R, D] (R >= T), a zero row included: bit for bit against
// the unfused path on the same backend (the Backend default), against the CPU's within rounding
// (its sums run in another order on a GPU): rstd to 1e-6, the output within one e4m3 step.
void check_rmsnorm_forward_fp8(Backend& cpu, Backend& be, std::mt19937_64& rng, int64_t T, int64_t R, int64_t D,
                               ScaleMode mode) {
  SCOPED_TRACE(::testing::Message() << "T " << T << " R " << R << " D " << D
                                    << (mode == ScaleMode::pow2 ? " pow2" : " fp32"));
  constexpr double kEps = 1e-6;
  Tensor x = random_normal(rng, DType::f32, {T, D}, 2.0f), w = random_normal(rng, DType::f32, {D}, 1.0f);
  for (int64_t c = 0; c < D; ++c) x.view().ptr<float>()[1 * D + c] = 0;  // row 1: zero, a zero tile per group
  QuantizedTensor want = make_quantized_host(R, D, DType::e4m3, ScaleKind::tile_1x128);
  Tensor rstd_want = Tensor::host(DType::f32, {T});
  cpu.rmsnorm_forward_fp8(x, w, want, rstd_want, kEps, mode);
  {  // the CPU's own op is its unfused path
    Tensor y = Tensor::host(DType::f32, {R, D}), r2 = Tensor::host(DType::f32, {T});
    std::memset(y.view().data, 0, y.view().nbytes());
    cpu.rmsnorm_forward(x, w, TensorView(y.view().data, DType::f32, {T, D}), r2, kEps);
    QuantizedTensor q2 = make_quantized_host(R, D, DType::e4m3, ScaleKind::tile_1x128);
    oracle_1x128(y, q2, mode);
    expect_same_quantized(cpu, want, q2, "cpu vs the oracle on its norm");
  }
  const Tensor xb = upload(be, x), wb = upload(be, w);
  auto fresh = [&] {
    Tensor r = be.zeros(DType::f32, {T});
    poison(be, r);
    return std::pair{poisoned_quantized(be, R, D, DType::e4m3, ScaleKind::tile_1x128), r};
  };
  auto [got, rstd] = fresh();
  be.rmsnorm_forward_fp8(xb, wb, got, rstd, kEps, mode);
  auto [got2, rstd2] = fresh();
  be.Backend::rmsnorm_forward_fp8(xb, wb, got2, rstd2, kEps, mode);
  expect_same_quantized(be, got, got2, "vs unfused");
  expect_same_bytes(be, rstd, be.to_host(rstd2), "rstd vs unfused");
  expect_close(be, rstd, rstd_want, 1e-6, 0, "rstd");
  Tensor got_d = be.zeros(DType::f32, {R, D}), want_d = Tensor::host(DType::f32, {R, D});
  be.dequantize(got, got_d);
  oracle_dequantize(want, want_d);
  expect_close(be, got_d, want_d, 0.13, 1e-5, "out (dequantized)");
}

// quantize_1x128_and_128x1 of x [T, C] against the oracle's 1x128 and 128x1 quantizations, bit for
// bit (values, scales, scale padding), outputs poisoned; through the op and through the Backend
// default (the two ops) on the same backend.
void check_1x128_and_128x1(Backend& be, const Tensor& x, DType rows_dt, DType cols_dt, ScaleMode mode) {
  const int64_t T = x.size(0), C = x.size(1);
  SCOPED_TRACE(::testing::Message() << "x " << x.view().str() << " rows " << dtype_name(rows_dt) << " cols "
                                    << dtype_name(cols_dt) << (mode == ScaleMode::pow2 ? " pow2" : " fp32"));
  auto want_rows = make_quantized_host(T, C, rows_dt, ScaleKind::tile_1x128);
  auto want_cols = make_quantized_host(C, T, cols_dt, ScaleKind::tile_1x128);
  oracle_1x128(x, want_rows, mode);
  oracle_128x1(x, want_cols, mode);
  const Tensor dx = upload(be, x);
  for (bool fallback : {false, true}) {
    SCOPED_TRACE(fallback ? "Backend default" : "op");
    auto rows = be.empty_quantized(T, C, rows_dt, ScaleKind::tile_1x128);
    auto cols = be.empty_quantized(C, T, cols_dt, ScaleKind::tile_1x128);
    for (const Tensor* t : {&rows.values, &rows.scales, &cols.values, &cols.scales}) poison(be, *t);
    if (fallback) be.Backend::quantize_1x128_and_128x1(dx, rows, cols, mode);
    else be.quantize_1x128_and_128x1(dx, rows, cols, mode);
    expect_same_bytes(be, rows.values, want_rows.values, "rows.values");
    expect_same_bytes(be, rows.scales, want_rows.scales, "rows.scales");
    expect_same_bytes(be, cols.values, want_cols.values, "cols.values");
    expect_same_bytes(be, cols.scales, want_cols.scales, "cols.scales");
  }
}

class BackendOps : public ::testing::TestWithParam<Case> {};

TEST_P(BackendOps, MatchesCpu) {
  const Case& c = GetParam();
  auto be = make_backend(c.backend);
  auto cpu = make_backend("cpu");
  if (!be->supports(c.op)) GTEST_SKIP() << c.backend << " does not support " << op_name(c.op);
  auto rng = make_rng();
  const int64_t M = 200, N = 136, K = 384;
  Tensor x = random_normal(rng, DType::bf16, {M, K}, 2.0f);
  Tensor w = random_normal(rng, DType::bf16, {N, K}, 0.05f);
  for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2}) {
    switch (c.op) {
      case Op::quantize_1x128:
      case Op::quantize_128x1: {
        const bool t = c.op == Op::quantize_128x1;
        // E5M6 (the attention-out cache, power-of-two scales) through the 1x128 quantizer.
        const DType qt = !t && mode == ScaleMode::pow2 ? DType::e5m6 : DType::e4m3;
        auto want = make_quantized_host(t ? K : M, t ? M : K, qt, ScaleKind::tile_1x128);
        auto got = poisoned_quantized(*be, t ? K : M, t ? M : K, qt, ScaleKind::tile_1x128);
        Tensor dx = upload(*be, x);
        if (t) {
          oracle_128x1(x, want, mode);
          be->quantize_128x1(dx, got, mode);
        } else {
          oracle_1x128(x, want, mode);
          be->quantize_1x128(dx, got, mode);
        }
        expect_same_quantized(*be, got, want, "");
        break;
      }
      case Op::rmsnorm_forward_fp8: {
        check_rmsnorm_forward_fp8(*cpu, *be, rng, 200, 256, 384, mode);  // padded rows
        check_rmsnorm_forward_fp8(*cpu, *be, rng, 37, 128, 130, mode);   // D % 4 != 0, a partial tile
        check_rmsnorm_forward_fp8(*cpu, *be, rng, 128, 128, 4096, mode); // a model row
        break;
      }
      case Op::swiglu_forward_fp8: {
        check_swiglu_forward_fp8(*cpu, *be, rng, 200, 256, 136, mode);  // padded rows, a partial tile
        check_swiglu_forward_fp8(*cpu, *be, rng, 128, 128, 384, mode);  // whole tiles, no padding
        check_swiglu_forward_fp8(*cpu, *be, rng, 37, 128, 130, mode);   // F % 4 != 0
        break;
      }
      case Op::quantize_1x128_and_128x1: {
        // x [200, 384] bf16 and [200, 136] f32: T off 128 (and 16), C off 128 in the second; one
        // output dtype, two, and E5M6 rows (which only the 1x128 quantizer writes).
        const Tensor xf = random_normal(rng, DType::f32, {M, N}, 2.0f);
        check_1x128_and_128x1(*be, x, DType::e4m3, DType::e4m3, mode);
        check_1x128_and_128x1(*be, xf, DType::e5m2, DType::e5m2, mode);
        check_1x128_and_128x1(*be, xf, DType::e5m2, DType::e4m3, mode);
        check_1x128_and_128x1(*be, x, DType::e5m6, DType::e4m3, mode);
        break;
      }
      case Op::quantize_128x128: {
        auto want = make_quantized_host(N, K, DType::e4m3, ScaleKind::block_128x128);
        auto got = poisoned_quantized(*be, N, K, DType::e4m3, ScaleKind::block_128x128);
        oracle_128x128(w, want, mode);
        be->quantize_128x128(upload(*be, w), got, mode);
        expect_same_quantized(*be, got, want, "");
        break;
      }
      case Op::requantize_128x1: {
        auto cached = make_quantized_host(M, K, DType::e4m3, ScaleKind::tile_1x128);
        cpu->quantize_1x128(x, cached, mode);
        auto want = make_quantized_host(K, M, DType::e4m3, ScaleKind::tile_1x128);
        auto got = poisoned_quantized(*be, K, M, DType::e4m3, ScaleKind::tile_1x128);
        oracle_quantize([&](int64_t k, int64_t t) { return oracle_value(cached, t, k); }, want, mode);
        be->requantize_128x1(upload(*be, cached), got, mode);
        expect_same_quantized(*be, got, want, "");
        break;
      }
      case Op::transpose_128x128: {  // two stacked [256, 384] matrices
        const int64_t G = 2, R = 256, C = 384;
        Tensor ws = random_normal(rng, DType::bf16, {G * R, C}, 0.05f);
        auto q = make_quantized_host(G * R, C, DType::e4m3, ScaleKind::block_128x128);
        cpu->quantize_128x128(ws, q, mode);
        auto want = make_quantized_host(G * C, R, DType::e4m3, ScaleKind::block_128x128);
        auto got = poisoned_quantized(*be, G * C, R, DType::e4m3, ScaleKind::block_128x128);
        // Bit-identical to quantizing each group's transpose (the op's contract).
        oracle_quantize([&](int64_t r, int64_t c) {
          const int64_t g = r / C;
          return load_float(ws.view(), (g * R + c) * C + r % C);
        }, want, mode);
        be->transpose_128x128(upload(*be, q), got, G);
        expect_same_quantized(*be, got, want, "");
        break;
      }
      case Op::dequantize: {
        auto q = make_quantized_host(M, K, mode == ScaleMode::pow2 ? DType::e5m6 : DType::e4m3, ScaleKind::tile_1x128);
        cpu->quantize_1x128(x, q, mode);
        check_dequantize(*be, q, DType::f32, "dequantized");
        if (mode == ScaleMode::pow2) {
          // E5M6 off the kernels' vector paths: f32 in, 130 columns (C % 8 != 0, a partial group), bf16 out.
          const int64_t C = 130;
          const Tensor xo = random_normal(rng, DType::f32, {M, C}, 2.0f);
          auto q2 = make_quantized_host(M, C, DType::e5m6, ScaleKind::tile_1x128);
          auto g2 = poisoned_quantized(*be, M, C, DType::e5m6, ScaleKind::tile_1x128);
          cpu->quantize_1x128(xo, q2, mode);
          be->quantize_1x128(upload(*be, xo), g2, mode);
          expect_same_quantized(*be, g2, q2, "e5m6, 130 columns,");
          check_dequantize(*be, q2, DType::bf16, "e5m6 dequantized to bf16, 130 columns");
        }
        break;
      }
      case Op::gemm_fp8: {
        auto qa = make_quantized_host(M, K, DType::e4m3, ScaleKind::tile_1x128);
        auto qb = make_quantized_host(N, K, DType::e4m3, ScaleKind::block_128x128);
        cpu->quantize_1x128(x, qa, mode);
        cpu->quantize_128x128(w, qb, mode);
        for (DType out : {DType::f32, DType::bf16}) {
          Tensor got = be->zeros(out, {M, N});
          poison(*be, got);
          be->gemm_fp8(upload(*be, qa), upload(*be, qb), got, {});
          Tensor ad = Tensor::host(DType::f32, {M, K}), bd = Tensor::host(DType::f32, {N, K});
          oracle_dequantize(qa, ad);
          oracle_dequantize(qb, bd);
          const std::vector<double> wv = fp64_product([&](int64_t m, int64_t k) { return ad.ptr<float>()[m * K + k]; },
                                                      [&](int64_t n, int64_t k) { return bd.ptr<float>()[n * K + k]; }, M, N, K);
          std::vector<double> g = to_doubles(be->to_host(got));
          for (double v : g) ASSERT_TRUE(std::isfinite(v)) << "unwritten or non-finite output";
          // The CPU sums each 128-wide K block in FP32 (FP32 rounding of the FP64 product); Tensor
          // Cores keep fewer bits inside a block (about 1e-4 relative on random data), so a GPU is
          // held to that.
          const double tol = be->device() == Device::cpu ? 1e-5 : 5e-4;
          EXPECT_LT(rel_error(g, wv), out == DType::f32 ? tol : 8e-3) << dtype_name(out);
        }
        break;
      }
      case Op::swiglu_backward_fp8: {
        // F = 304: a partial last tile, 16-byte vectors on a GPU; F = 300: its element-wise
        // fallback; R = 48 > T: a row-padded cache; 130 rows: two 128-row blocks of scales.
        check_swiglu_backward_fp8(*cpu, *be, rng, 37, 37, 304, DType::e4m3, mode);
        check_swiglu_backward_fp8(*cpu, *be, rng, 48, 37, 300, DType::e4m3, mode);
        check_swiglu_backward_fp8(*cpu, *be, rng, 130, 130, 256, DType::e5m2, mode);
        break;
      }
      case Op::gemm_bf16: {
        Tensor got = be->zeros(DType::f32, {M, N});
        poison(*be, got);
        be->gemm_bf16(upload(*be, x), upload(*be, w), got, false);
        const std::vector<double> wv = fp64_product([&](int64_t m, int64_t k) { return load_float(x.view(), m * K + k); },
                                                    [&](int64_t n, int64_t k) { return load_float(w.view(), n * K + k); }, M, N, K);
        std::vector<double> g = to_doubles(be->to_host(got));
        for (double v : g) ASSERT_TRUE(std::isfinite(v));
        EXPECT_LT(rel_error(g, wv), 1e-5);
        return;  // no scale mode
      }
      default:
        GTEST_SKIP() << op_name(c.op) << " is covered by the model-op tests";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, BackendOps, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.backend + "_" + std::string(op_name(info.param.op));
                         });

// zero: every byte of the tensor, in place, on every backend; the Backend default (a copy from a
// zero-filled tensor) does the same.
TEST(Backends, ZeroClearsInPlace) {
  for (const std::string& name : available_backends()) {
    SCOPED_TRACE(name);
    auto be = make_backend(name);
    for (bool fallback : {false, true}) {
      Tensor t = be->zeros(DType::f32, {37, 129});
      poison(*be, t);
      const TensorView rows = t.view();
      if (fallback) be->Backend::zero(rows);
      else be->zero(rows);
      for (double v : to_doubles(be->to_host(t))) ASSERT_EQ(v, 0.0);
    }
    Tensor e = be->zeros(DType::bf16, {0, 8});
    EXPECT_NO_THROW(be->zero(e.view()));
  }
}

// gemm_strided_batched on the CPU is its specification: every matrix the bits of gemm on a
// contiguous copy of its operands (the heads of the absorbed decode side by side in the columns),
// and gemm_batch_invariant of 3-D views the same with b [G, N, K].
TEST(Backends, CpuStridedBatchedGemmEqualsGemmPerMatrix) {
  auto cpu = make_backend("cpu");
  std::mt19937_64 rng = make_rng();
  const int64_t G = 3, M = 5, K = 19, N = 23, wa = K + 4, wd = N + 3;
  const Tensor a = random_normal(rng, DType::f32, {M, G * wa}), b = random_normal(rng, DType::f32, {G * (K + 1), N});
  const Tensor bt = random_normal(rng, DType::f32, {G * N, K});
  const auto view3 = [](const Tensor& t, int64_t off, int64_t R, int64_t C, int64_t bs, int64_t rs) {
    TensorView v(t.ptr<float>() + off, DType::f32, {G, R, C}, Device::cpu);
    v.strides = {bs, rs, 1, 0};
    return v;
  };
  for (const bool tb : {false, true})
    for (const bool acc : {false, true}) {
      SCOPED_TRACE(std::string("trans_b ") + (tb ? "1" : "0") + " accumulate " + (acc ? "1" : "0"));
      Tensor d = random_normal(rng, DType::f32, {M, G * wd});
      const Tensor d0 = cpu->to_host(d);
      std::vector<float> before(d0.ptr<float>(), d0.ptr<float>() + d0.numel());
      const TensorView bv = tb ? view3(bt, 0, N, K, N * K, K) : view3(b, N, K, N, (K + 1) * N, N);
      if (tb && !acc) cpu->gemm_batch_invariant(view3(a, 0, M, K, wa, G * wa), bv, view3(d, 0, M, N, wd, G * wd));
      else cpu->gemm_strided_batched(view3(a, 0, M, K, wa, G * wa), bv, view3(d, 0, M, N, wd, G * wd), tb, acc);
      for (int64_t g = 0; g < G; ++g) {
        Tensor ag = Tensor::host(DType::f32, {M, K}), dg = Tensor::host(DType::f32, {M, N});
        Tensor bg = tb ? Tensor::host(DType::f32, {N, K}) : Tensor::host(DType::f32, {K, N});
        for (int64_t r = 0; r < M; ++r) {
          std::copy_n(a.ptr<float>() + r * G * wa + g * wa, K, ag.ptr<float>() + r * K);
          std::copy_n(before.data() + r * G * wd + g * wd, N, dg.ptr<float>() + r * N);
        }
        if (tb) std::copy_n(bt.ptr<float>() + g * N * K, N * K, bg.ptr<float>());
        else std::copy_n(b.ptr<float>() + g * (K + 1) * N + N, K * N, bg.ptr<float>());
        cpu->gemm(ag, bg, dg, false, tb, acc);
        for (int64_t r = 0; r < M; ++r)
          for (int64_t n = 0; n < N; ++n)
            ASSERT_EQ(d.ptr<float>()[r * G * wd + g * wd + n], dg.ptr<float>()[r * N + n]) << g << " " << r << " " << n;
      }
      for (int64_t r = 0; r < M; ++r)  // the columns between the matrices untouched
        for (int64_t c = 0; c < G * wd; ++c)
          if (c % wd >= N) ASSERT_EQ(d.ptr<float>()[r * G * wd + c], before[size_t(r * G * wd + c)]);
    }
}

// quantize_1x128_and_128x1 checks both outputs (the checks of the two quantizers) before it writes
// either, on every backend and in the Backend default.
TEST(Backends, Quantize1x128And128x1RefusesBadArguments) {
  for (const std::string& name : available_backends()) {
    SCOPED_TRACE(name);
    auto be = make_backend(name);
    const int64_t T = 200, C = 136;
    const Tensor x = be->zeros(DType::f32, {T, C});
    const auto rows = be->empty_quantized(T, C, DType::e4m3, ScaleKind::tile_1x128);
    const auto cols = be->empty_quantized(C, T, DType::e4m3, ScaleKind::tile_1x128);
    const auto square = be->empty_quantized(T, T, DType::e4m3, ScaleKind::tile_1x128);
    const auto blocks = be->empty_quantized(C, T, DType::e4m3, ScaleKind::block_128x128);
    const Tensor x_i32 = be->zeros(DType::i32, {T, C}), bad_scales = be->zeros(DType::f32, {2, T});
    for (bool fallback : {false, true}) {
      auto run = [&](const TensorView& xv, const QuantizedView& r, const QuantizedView& c) {
        if (fallback) be->Backend::quantize_1x128_and_128x1(xv, r, c, ScaleMode::fp32);
        else be->quantize_1x128_and_128x1(xv, r, c, ScaleMode::fp32);
      };
      poison(*be, rows.values);
      expect_error([&] { run(x, rows, rows); }, "cols.values: expected shape [136, 200]");
      expect_error([&] { run(x, square, cols); }, "rows.values: expected shape [200, 136]");
      expect_error([&] { run(x, rows, blocks); }, "cols: expected 1x128 scales");
      expect_error([&] { run(x, rows, {cols.values.view(), bad_scales.view(), ScaleKind::tile_1x128}); },
                   "cols.scales: expected shape");
      expect_error([&] { run(x_i32, rows, cols); }, "x: expected dtype f32|bf16");
      // Refused before anything was written: rows still holds the poison.
      const Tensor h = be->to_host(rows.values);
      const auto* b = static_cast<const uint8_t*>(h.view().data);
      EXPECT_TRUE(std::all_of(b, b + h.view().nbytes(), [](uint8_t v) { return v == 0xFF; }));
    }
  }
}

TEST(Backends, RegistryAndErrors) {
  auto names = available_backends();
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.front(), "cpu");
  EXPECT_EQ(make_backend("cpu")->name(), "cpu");
  try {
    make_backend("tpu");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown or unavailable backend 'tpu'"), std::string::npos) << e.what();
  }
}

}  // namespace
