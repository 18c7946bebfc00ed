// CPU backend: forwards each op to the reference implementations in src/numerics, after checking
// that every tensor is in host memory.
#include "cpu_backend.hpp"

#include "cpu_ops.hpp"

#include <atomic>
#include <cstring>
#include <memory>

namespace fp8moe {

namespace {

void require_host(const TensorView& t, const char* arg) {
  FP8MOE_CHECK(t.device == Device::cpu, arg << ": the cpu backend needs host memory, got " << t.str());
}

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::cpu; }
  bool supports(Op) const override { return true; }

  // The backend's tensors are counted while they live, so that device_memory_peak() measures what
  // a recipe allocates the way the CUDA pool's high-water mark does on a GPU.
  Tensor zeros(DType dtype, std::initializer_list<int64_t> shape) override { return allocate(dtype, shape, false); }
  Tensor empty(DType dtype, std::initializer_list<int64_t> shape) override {
    return allocate(dtype, shape, true);
  }
  // Bytes of this backend's live tensors (host memory), and their high-water mark.
  int64_t device_memory_in_use() const override { return bytes_->in_use.load(); }
  int64_t device_memory_peak() const override { return bytes_->peak.load(); }

  void copy(const TensorView& dst, const TensorView& src) override {
    require_host(dst, "dst");
    require_host(src, "src");
    FP8MOE_CHECK(dst.nbytes() == src.nbytes() && dst.dtype == src.dtype,
                 "copy: dst " << dst.str() << " and src " << src.str() << " differ in dtype or size");
    std::memcpy(dst.data, src.data, src.nbytes());
  }
  void zero(const TensorView& dst) override {
    require_host(dst, "dst");
    FP8MOE_CHECK(dst.is_contiguous(), "zero: " << dst.str() << " is not contiguous");
    std::memset(dst.data, 0, dst.nbytes());
  }

  void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode mode) override {
    fp8moe::quantize_1x128(x, out, mode);
  }
  void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode mode) override {
    fp8moe::quantize_128x128(w, out, mode);
  }
  void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode mode) override {
    fp8moe::quantize_128x1(x, out, mode);
  }
  void requantize_128x1(const QuantizedView& in, const QuantizedView& out, ScaleMode mode) override {
    fp8moe::requantize_128x1(in, out, mode);
  }
  void transpose_128x128(const QuantizedView& in, const QuantizedView& out, int64_t groups) override {
    fp8moe::transpose_128x128(in, out, groups);
  }
  void dequantize(const QuantizedView& in, const TensorView& out) override {
    require_host(out, "out");
    fp8moe::dequantize(in, out);
  }
  void gemm_fp8(const QuantizedView& a, const QuantizedView& b, const TensorView& d,
                const GemmOptions& opt) override {
    gemm_fp8_ref(a, b, d, opt);
  }
  void gemm_bf16(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate) override {
    check_tensor(a, "a", DType::bf16, 2);
    check_tensor(b, "b", DType::bf16, 2);
    require_host(a, "a");
    require_host(b, "b");
    require_host(d, "d");
    // NOTES: BF16 x BF16 products are exact in FP32, so the blocked float GEMM on the widened
    // operands is a BF16 GEMM with FP32 accumulation, many times faster than gemm_ref.
    check_tensor(d, "d", {DType::f32, DType::bf16}, 2);
    FP8MOE_CHECK(b.size(1) == a.size(1), "b: expected K = " << a.size(1) << " columns (b is [N, K]), got " << b.str());
    check_shape(d, "d", {a.size(0), b.size(0)});
    Tensor a32 = Tensor::host(DType::f32, {a.size(0), a.size(1)}), b32 = Tensor::host(DType::f32, {b.size(0), b.size(1)});
    cpu::convert(a, a32.view());
    cpu::convert(b, b32.view());
    if (d.dtype == DType::f32) {
      cpu::gemm(a32.view(), b32.view(), d, false, true, accumulate);
    } else {
      Tensor d32 = Tensor::host(DType::f32, {d.size(0), d.size(1)});
      if (accumulate) cpu::convert(d, d32.view());
      cpu::gemm(a32.view(), b32.view(), d32.view(), false, true, accumulate);
      cpu::convert(d32.view(), d);
    }
  }

  // Model ops: src/cpu/ops_*.cpp (cpu_ops.hpp).
  void gemm(const TensorView& a, const TensorView& b, const TensorView& d, bool ta, bool tb, bool acc) override {
    cpu::gemm(a, b, d, ta, tb, acc);
  }
  void gemm_strided_batched(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_b,
                            bool accumulate) override {
    cpu::gemm_strided_batched(a, b, d, trans_b, accumulate);
  }
  void convert(const TensorView& src, const TensorView& dst) override { cpu::convert(src, dst); }
  void axpy(double alpha, const TensorView& x, double beta, const TensorView& y) override { cpu::axpy(alpha, x, beta, y); }
  void copy_cols(const TensorView& src, int64_t sc, const TensorView& dst, int64_t dc, int64_t n, bool acc) override {
    cpu::copy_cols(src, sc, dst, dc, n, acc);
  }
  void transpose(const TensorView& src, const TensorView& dst) override { cpu::transpose(src, dst); }
  void embedding_forward(const TensorView& ids, const TensorView& table, const TensorView& out) override {
    cpu::embedding_forward(ids, table, out);
  }
  void embedding_backward(const TensorView& ids, const TensorView& dout, const TensorView& dtable) override {
    cpu::embedding_backward(ids, dout, dtable);
  }
  void rmsnorm_forward(const TensorView& x, const TensorView& w, const TensorView& y, const TensorView& rstd,
                       double eps) override {
    cpu::rmsnorm_forward(x, w, y, rstd, eps);
  }
  void rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                        const TensorView& dx, const TensorView& dw, bool acc) override {
    cpu::rmsnorm_backward(x, w, rstd, dy, dx, dw, acc);
  }
  void rope(const TensorView& x, int64_t col0, int64_t rot, const TensorView& pos, double theta, bool inv) override {
    cpu::rope(x, col0, rot, pos, theta, inv);
  }
  void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                         const TensorView& lse, int64_t seq_len, double scale, DType compute) override {
    cpu::attention_forward(q, k, v, out, lse, seq_len, scale, compute);
  }
  void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                          const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                          const TensorView& dv, int64_t seq_len, double scale, DType compute) override {
    cpu::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, seq_len, scale, compute);
  }
  // One FP64 sum per sequence and head: the same bits under either split rule.
  void mla_decode_attention(const TensorView& q, const MlaCacheView& cache, const TensorView& table,
                            const TensorView& lengths, double scale, const TensorView& o,
                            MlaDecodeSplits) override {
    cpu::mla_decode_attention(q, cache, table, lengths, scale, o);
  }
  void swiglu_forward(const TensorView& g, const TensorView& u, const TensorView& out) override {
    cpu::swiglu_forward(g, u, out);
  }
  void swiglu_backward(const TensorView& g, const TensorView& u, const TensorView& dout, const TensorView& dg,
                       const TensorView& du) override {
    cpu::swiglu_backward(g, u, dout, dg, du);
  }
  void swiglu_backward_fp8(const QuantizedView& g, const QuantizedView& u, const TensorView& dout,
                           const TensorView& out, const TensorView& dg, const TensorView& du) override {
    cpu::swiglu_backward_fp8(g, u, dout, out, dg, du);
  }
  void cross_entropy(const TensorView& logits, const TensorView& targets, const TensorView& losses,
                     const TensorView& dlogits, double grad_scale) override {
    cpu::cross_entropy(logits, targets, losses, dlogits, grad_scale);
  }
  void moe_route(const TensorView& logits, const TensorView& bias, const TensorView& scores, const TensorView& idx,
                 const TensorView& weights, int64_t n_group, int64_t topk_group, bool norm, double scaling) override {
    cpu::moe_route(logits, bias, scores, idx, weights, n_group, topk_group, norm, scaling);
  }
  void moe_route_backward(const TensorView& scores, const TensorView& idx, const TensorView& dweights,
                          const TensorView& dscores, const TensorView& dlogits, bool norm, double scaling) override {
    cpu::moe_route_backward(scores, idx, dweights, dscores, dlogits, norm, scaling);
  }
  void gather_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst) override {
    cpu::gather_rows(src, idx, w, dst);
  }
  void scatter_add_rows(const TensorView& src, const TensorView& idx, const TensorView& w,
                        const TensorView& dst) override {
    cpu::scatter_add_rows(src, idx, w, dst);
  }
  void scatter_rows(const TensorView& src, const TensorView& idx, const TensorView& dst) override {
    cpu::scatter_rows(src, idx, dst);
  }
  void rows_dot(const TensorView& a, const TensorView& b, const TensorView& out) override { cpu::rows_dot(a, b, out); }
  void moe_layout(const TensorView& expert_ids, int64_t align, const TensorView& row_slot, const TensorView& row_group,
                  const TensorView& slot_row, const TensorView& offsets) override {
    cpu::moe_layout(expert_ids, align, row_slot, row_group, slot_row, offsets);
  }
  void moe_masked_layout(const TensorView& expert_ids, int64_t groups, int64_t every_token_group,
                         const TensorView& row_slot, const TensorView& slot_row, const TensorView& counts,
                         const TensorView& loads) override {
    cpu::moe_masked_layout(expert_ids, groups, every_token_group, row_slot, slot_row, counts, loads);
  }
  void moe_permute(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                   const TensorView& out) override {
    cpu::moe_permute(x, row_slot, topk, w, out);
  }
  void moe_permute_quantize(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                            const QuantizedView& out, ScaleMode mode) override {
    cpu::moe_permute_quantize(x, row_slot, topk, w, out, mode);
  }
  void moe_combine(const TensorView& y, const TensorView& slot_row, const TensorView& w, const TensorView& out,
                   bool accumulate) override {
    cpu::moe_combine(y, slot_row, w, out, accumulate);
  }
  void moe_combine_weight_grad(const TensorView& v, const TensorView& slot_row, const TensorView& w,
                               const TensorView& dw) override {
    cpu::moe_combine_weight_grad(v, slot_row, w, dw);
  }
  void grouped_gemm_fp8_contiguous(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                   int64_t groups, const TensorView& d, const GemmOptions& opt) override {
    cpu::grouped_gemm_fp8_contiguous(a, b, row_group, groups, d, opt);
  }
  void grouped_gemm_fp8_masked(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                               int64_t groups, const TensorView& d, const GemmOptions& opt) override {
    cpu::grouped_gemm_fp8_masked(a, b, counts, groups, d, opt);
  }
  void grouped_wgrad_fp8(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                         const TensorView& d, const GemmOptions& opt) override {
    cpu::grouped_wgrad_fp8(dy_t, x_t, offsets, d, opt);
  }
  void moe_expert_loads(const TensorView& expert_ids, const TensorView& loads) override {
    cpu::moe_expert_loads(expert_ids, loads);
  }
  void moe_balance_loss(const TensorView& scores, const TensorView& idx, int64_t seq_len, double alpha,
                        double grad_scale, const TensorView& loss, const TensorView& dscores) override {
    cpu::moe_balance_loss(scores, idx, seq_len, alpha, grad_scale, loss, dscores);
  }
  void sum_in_order(const TensorView& x, const TensorView& out) override { cpu::sum_in_order(x, out); }
  void adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                  const AdamWStep& p) override {
    cpu::adamw_step(w, g, m, v, p);
  }
  double sum_squares(const TensorView& x) override { return cpu::sum_squares(x); }

 private:
  // A counted host tensor: zero-filled, or filled with 0xFF bytes (NaN in every float format) for
  // empty(), so that an op reading what nobody wrote yields NaN in the tests.
  Tensor allocate(DType dtype, std::initializer_list<int64_t> shape, bool poison) {
    struct Counted {
      Tensor t;
      std::shared_ptr<Bytes> bytes;
      int64_t n = 0;
      ~Counted() {
        if (bytes) bytes->in_use -= n;
      }
    };
    auto keep = std::make_shared<Counted>();
    keep->t = Tensor::host(dtype, shape);
    keep->n = int64_t(keep->t.view().nbytes());
    keep->bytes = bytes_;
    if (poison) std::memset(keep->t.view().data, 0xFF, size_t(keep->n));
    const int64_t now = bytes_->in_use += keep->n;
    int64_t peak = bytes_->peak.load();
    while (now > peak && !bytes_->peak.compare_exchange_weak(peak, now)) {
    }
    const TensorView v = keep->t.view();
    return Tensor(std::shared_ptr<void>(keep, v.data), v);
  }

  struct Bytes {
    std::atomic<int64_t> in_use{0}, peak{0};
  };
  std::shared_ptr<Bytes> bytes_ = std::make_shared<Bytes>();  // outlives the backend with its tensors
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace fp8moe
