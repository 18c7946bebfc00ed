// A Backend that runs every op on the CPU backend and records what the model asked of the
// quantizers and the FP8 GEMMs: output dtype, scale mode and a host copy of every quantized output,
// and for each FP8 GEMM its shape, accumulation and error against the FP64 product of its
// dequantized operands. The recipe guards (test_recipe_guards.cpp) read the records to observe the
// recipe's choices themselves (tile and block scales, power-of-two exponents, the E5M6 cache,
// promotion) rather than their effect on a loss. Results are bit-identical to the CPU backend's.
#pragma once
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/minifloat_encode.hpp"

namespace fp8moe::testing {

class SpyBackend final : public Backend {
 public:
  struct Quantized {
    std::string op;  // the Backend op that wrote it ("quantize_1x128", "moe_permute_quantize", ...)
    std::string out;  // which output of the op ("out", "rows", "cols", "gq", ...)
    ScaleMode mode = ScaleMode::fp32;
    QuantizedTensor q;  // host copy
  };
  struct Gemm {
    std::string op;
    int64_t m = 0, n = 0, k = 0;
    AccumConfig accum;
    double rel_error = 0;  // max |d - ref| / max |ref|, ref = FP64 product of the dequantized operands
  };
  std::vector<Quantized> quantized;
  std::vector<Gemm> gemms;
  // The FP64 check of the FP8 GEMMs costs M*N*K per call: off unless asked.
  bool check_gemms = false;

  SpyBackend() : in_(make_backend("cpu")) {}

  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::cpu; }
  bool supports(Op op) const override { return in_->supports(op); }
  Tensor zeros(DType t, std::initializer_list<int64_t> s) override { return in_->zeros(t, s); }
  Tensor empty(DType t, std::initializer_list<int64_t> s) override { return in_->empty(t, s); }
  void copy(const TensorView& d, const TensorView& s) override { in_->copy(d, s); }
  void zero(const TensorView& d) override { in_->zero(d); }
  int64_t device_memory_in_use() const override { return in_->device_memory_in_use(); }
  int64_t device_memory_peak() const override { return in_->device_memory_peak(); }

  void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode m) override {
    in_->quantize_1x128(x, out, m);
    record("quantize_1x128", "out", m, out);
  }
  void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode m) override {
    in_->quantize_128x128(w, out, m);
    record("quantize_128x128", "out", m, out);
  }
  void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode m) override {
    in_->quantize_128x1(x, out, m);
    record("quantize_128x1", "out", m, out);
  }
  void quantize_1x128_and_128x1(const TensorView& x, const QuantizedView& r, const QuantizedView& c,
                                ScaleMode m) override {
    in_->quantize_1x128_and_128x1(x, r, c, m);
    record("quantize_1x128_and_128x1", "rows", m, r);
    record("quantize_1x128_and_128x1", "cols", m, c);
  }
  void requantize_128x1(const QuantizedView& i, const QuantizedView& out, ScaleMode m) override {
    in_->requantize_128x1(i, out, m);
    record("requantize_128x1", "out", m, out);
  }
  void transpose_128x128(const QuantizedView& i, const QuantizedView& o, int64_t g) override { in_->transpose_128x128(i, o, g); }
  void dequantize(const QuantizedView& i, const TensorView& o) override { in_->dequantize(i, o); }
  void gemm_fp8(const QuantizedView& a, const QuantizedView& b, const TensorView& d, const GemmOptions& o) override {
    const std::vector<double> before = check_gemms && o.accumulate ? doubles(d) : std::vector<double>();
    in_->gemm_fp8(a, b, d, o);
    Gemm g{"gemm_fp8", a.rows(), b.rows(), a.cols(), o.accum, 0};
    if (check_gemms) g.rel_error = fp64_error(a, b, d, before);
    gemms.push_back(g);
  }
  void gemm_bf16(const TensorView& a, const TensorView& b, const TensorView& d, bool acc) override { in_->gemm_bf16(a, b, d, acc); }

  void gemm(const TensorView& a, const TensorView& b, const TensorView& d, bool ta, bool tb, bool acc) override {
    in_->gemm(a, b, d, ta, tb, acc);
  }
  void convert(const TensorView& s, const TensorView& d) override { in_->convert(s, d); }
  void axpy(double al, const TensorView& x, double be, const TensorView& y) override { in_->axpy(al, x, be, y); }
  void copy_cols(const TensorView& s, int64_t sc, const TensorView& d, int64_t dc, int64_t n, bool acc) override {
    in_->copy_cols(s, sc, d, dc, n, acc);
  }
  void transpose(const TensorView& s, const TensorView& d) override { in_->transpose(s, d); }
  void embedding_forward(const TensorView& i, const TensorView& t, const TensorView& o) override { in_->embedding_forward(i, t, o); }
  void embedding_backward(const TensorView& i, const TensorView& d, const TensorView& t) override { in_->embedding_backward(i, d, t); }
  void rmsnorm_forward(const TensorView& x, const TensorView& w, const TensorView& y, const TensorView& r, double e) override {
    in_->rmsnorm_forward(x, w, y, r, e);
  }
  void rmsnorm_forward_fp8(const TensorView& x, const TensorView& w, const QuantizedView& out, const TensorView& r,
                           double e, ScaleMode m) override {
    in_->rmsnorm_forward_fp8(x, w, out, r, e, m);
    record("rmsnorm_forward_fp8", "out", m, out);
  }
  void rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& r, const TensorView& dy,
                        const TensorView& dx, const TensorView& dw, bool acc) override {
    in_->rmsnorm_backward(x, w, r, dy, dx, dw, acc);
  }
  void rope(const TensorView& x, int64_t c0, int64_t rot, const TensorView& p, double th, bool inv) override {
    in_->rope(x, c0, rot, p, th, inv);
  }
  void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                         const TensorView& l, int64_t s, double sc, DType c) override {
    in_->attention_forward(q, k, v, o, l, s, sc, c);
  }
  void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                          const TensorView& l, const TensorView& d, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv, int64_t s, double sc, DType c) override {
    in_->attention_backward(q, k, v, o, l, d, dq, dk, dv, s, sc, c);
  }
  void swiglu_forward(const TensorView& g, const TensorView& u, const TensorView& o) override { in_->swiglu_forward(g, u, o); }
  void swiglu_backward(const TensorView& g, const TensorView& u, const TensorView& d, const TensorView& dg,
                       const TensorView& du) override {
    in_->swiglu_backward(g, u, d, dg, du);
  }
  void swiglu_backward_fp8(const QuantizedView& g, const QuantizedView& u, const TensorView& d, const TensorView& o,
                           const TensorView& dg, const TensorView& du) override {
    in_->swiglu_backward_fp8(g, u, d, o, dg, du);
  }
  void swiglu_forward_fp8(const TensorView& g, const TensorView& u, const QuantizedView& gq, const QuantizedView& uq,
                          const QuantizedView& out, ScaleMode m) override {
    in_->swiglu_forward_fp8(g, u, gq, uq, out, m);
    record("swiglu_forward_fp8", "gq", m, gq);
    record("swiglu_forward_fp8", "uq", m, uq);
    record("swiglu_forward_fp8", "out", m, out);
  }
  void cross_entropy(const TensorView& lg, const TensorView& t, const TensorView& l, const TensorView& d, double s) override {
    in_->cross_entropy(lg, t, l, d, s);
  }
  void moe_route(const TensorView& lg, const TensorView& b, const TensorView& s, const TensorView& i, const TensorView& w,
                 int64_t ng, int64_t tg, bool n, double sc) override {
    in_->moe_route(lg, b, s, i, w, ng, tg, n, sc);
  }
  void moe_route_backward(const TensorView& s, const TensorView& i, const TensorView& dw, const TensorView& ds,
                          const TensorView& dl, bool n, double sc) override {
    in_->moe_route_backward(s, i, dw, ds, dl, n, sc);
  }
  void gather_rows(const TensorView& s, const TensorView& i, const TensorView& w, const TensorView& d) override {
    in_->gather_rows(s, i, w, d);
  }
  void scatter_add_rows(const TensorView& s, const TensorView& i, const TensorView& w, const TensorView& d) override {
    in_->scatter_add_rows(s, i, w, d);
  }
  void rows_dot(const TensorView& a, const TensorView& b, const TensorView& o) override { in_->rows_dot(a, b, o); }
  void moe_layout(const TensorView& e, int64_t al, const TensorView& rs, const TensorView& rg, const TensorView& sr,
                  const TensorView& of) override {
    in_->moe_layout(e, al, rs, rg, sr, of);
  }
  void moe_permute(const TensorView& x, const TensorView& rs, int64_t k, const TensorView& w, const TensorView& o) override {
    in_->moe_permute(x, rs, k, w, o);
  }
  void moe_permute_quantize(const TensorView& x, const TensorView& rs, int64_t k, const TensorView& w,
                            const QuantizedView& out, ScaleMode m) override {
    in_->moe_permute_quantize(x, rs, k, w, out, m);
    record("moe_permute_quantize", "out", m, out);
  }
  void moe_combine(const TensorView& y, const TensorView& sr, const TensorView& w, const TensorView& o, bool acc) override {
    in_->moe_combine(y, sr, w, o, acc);
  }
  void moe_combine_weight_grad(const TensorView& v, const TensorView& sr, const TensorView& w, const TensorView& dw) override {
    in_->moe_combine_weight_grad(v, sr, w, dw);
  }
  void grouped_gemm_fp8_contiguous(const QuantizedView& a, const QuantizedView& b, const TensorView& rg, int64_t g,
                                   const TensorView& d, const GemmOptions& o) override {
    in_->grouped_gemm_fp8_contiguous(a, b, rg, g, d, o);
    gemms.push_back({"grouped_gemm_fp8_contiguous", a.rows(), b.rows() / g, a.cols(), o.accum, 0});
  }
  void grouped_gemm_fp8_masked(const QuantizedView& a, const QuantizedView& b, const TensorView& c, int64_t g,
                               const TensorView& d, const GemmOptions& o) override {
    in_->grouped_gemm_fp8_masked(a, b, c, g, d, o);
    gemms.push_back({"grouped_gemm_fp8_masked", a.rows(), b.rows() / g, a.cols(), o.accum, 0});
  }
  void grouped_wgrad_fp8(const QuantizedView& dy, const QuantizedView& x, const TensorView& of, const TensorView& d,
                         const GemmOptions& o) override {
    in_->grouped_wgrad_fp8(dy, x, of, d, o);
    gemms.push_back({"grouped_wgrad_fp8", dy.rows(), x.rows(), dy.cols(), o.accum, 0});
  }
  void adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                  const AdamWStep& p) override {
    in_->adamw_step(w, g, m, v, p);
  }
  double sum_squares(const TensorView& x) override { return in_->sum_squares(x); }
  void moe_expert_loads(const TensorView& ids, const TensorView& loads) override { in_->moe_expert_loads(ids, loads); }
  void moe_balance_loss(const TensorView& s, const TensorView& idx, int64_t seq, double alpha, double gs,
                        const TensorView& loss, const TensorView& ds) override {
    in_->moe_balance_loss(s, idx, seq, alpha, gs, loss, ds);
  }
  void sum_in_order(const TensorView& x, const TensorView& out) override { in_->sum_in_order(x, out); }

  // Records of one op's output.
  std::vector<const Quantized*> of(const std::string& op, const std::string& out = "") const {
    std::vector<const Quantized*> r;
    for (const auto& q : quantized)
      if (q.op == op && (out.empty() || q.out == out)) r.push_back(&q);
    return r;
  }

 private:
  static Tensor host_copy(const TensorView& t) {
    Tensor h = Tensor::host_like(t);
    std::memcpy(h.view().data, t.data, t.nbytes());
    return h;
  }
  void record(const char* op, const char* out, ScaleMode m, const QuantizedView& q) {
    quantized.push_back({op, out, m, QuantizedTensor{host_copy(q.values), host_copy(q.scales), q.kind}});
  }
  static std::vector<double> doubles(const TensorView& d) {
    std::vector<double> v(size_t(d.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = load_float(d, int64_t(i));
    return v;
  }
  // d [M, N] (minus what it held before an accumulating call) against sum_k a[m, k] b[n, k] in
  // FP64 over the decoded operands times their scales.
  static double fp64_error(const QuantizedView& a, const QuantizedView& b, const TensorView& d,
                           const std::vector<double>& before) {
    const int64_t M = a.rows(), N = b.rows(), K = a.cols();
    const auto deq = [](const QuantizedView& q) {
      std::vector<double> v(size_t(q.rows() * q.cols()));
      for (int64_t r = 0; r < q.rows(); ++r)
        for (int64_t c = 0; c < q.cols(); ++c)
          v[size_t(r * q.cols() + c)] =
              double(decode_value(q.values.dtype, q.values.data, r * q.cols() + c)) * q.scale_at(r, c);
      return v;
    };
    const std::vector<double> A = deq(a), B = deq(b);
    double err = 0, ref_max = 0;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += A[size_t(m * K + k)] * B[size_t(n * K + k)];
        const double got = load_float(d, m * N + n) - (before.empty() ? 0.0 : before[size_t(m * N + n)]);
        err = std::max(err, std::fabs(got - s));
        ref_max = std::max(ref_max, std::fabs(s));
      }
    return ref_max > 0 ? err / ref_max : err;
  }

  std::unique_ptr<Backend> in_;
};

}  // namespace fp8moe::testing
