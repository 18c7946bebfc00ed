// The model ops of the CPU backend (contracts: include/fp8moe/backend.hpp, "Model ops"), as free
// functions so that each op family lives in its own file (ops_*.cpp) and the CpuBackend class only
// forwards. "float" ops are templates over f32 and f64: f64 runs the finite-difference checks.
#pragma once
#include "fp8moe/backend.hpp"

namespace fp8moe::cpu {

// Calls f(float{}) or f(double{}) after the dtype of `t`; throws naming `op` and `arg` otherwise.
template <class F>
void dispatch_float(const TensorView& t, const char* op, const char* arg, F&& f) {
  FP8MOE_CHECK(t.device == Device::cpu, op << ": " << arg << " must be a host tensor, got " << t.str());
  if (t.dtype == DType::f32) {
    f(float{});
  } else if (t.dtype == DType::f64) {
    f(double{});
  } else {
    FP8MOE_CHECK(false, op << ": " << arg << " must be f32 or f64, got " << t.str());
  }
}
// NOTES: below this many element-operations an op runs on one thread: fork/join costs more than it
// saves, and with more threads than free cores (a busy CI machine) OpenMP's spinning barriers make
// many small parallel regions very slow.
constexpr int64_t kParallelWork = 1 << 15;

// Checks that `t` is a contiguous host tensor of `dtype` with ndim dims.
void check_op_tensor(const TensorView& t, const char* op, const char* arg, DType dtype, int ndim);

void gemm(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_a, bool trans_b, bool accumulate);
void gemm_strided_batched(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_b, bool accumulate);
void convert(const TensorView& src, const TensorView& dst);
void axpy(double alpha, const TensorView& x, double beta, const TensorView& y);
void copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col, int64_t ncols,
               bool accumulate);
void transpose(const TensorView& src, const TensorView& dst);

void embedding_forward(const TensorView& ids, const TensorView& table, const TensorView& out);
void embedding_backward(const TensorView& ids, const TensorView& dout, const TensorView& dtable);
void cross_entropy(const TensorView& logits, const TensorView& targets, const TensorView& losses,
                   const TensorView& dlogits, double grad_scale);

void rmsnorm_forward(const TensorView& x, const TensorView& w, const TensorView& y, const TensorView& rstd,
                     double eps);
void rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                      const TensorView& dx, const TensorView& dw, bool accumulate_dx);

void rope(const TensorView& x, int64_t col0, int64_t rot, const TensorView& positions, double theta, bool inverse);
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, int64_t seq_len, double scale, DType compute);
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, int64_t seq_len, double scale, DType compute);

// FP64 accumulation (ops_mla_decode.cpp).
void mla_decode_attention(const TensorView& q, const MlaCacheView& cache, const TensorView& table,
                          const TensorView& lengths, double scale, const TensorView& o);

void swiglu_forward(const TensorView& gate, const TensorView& up, const TensorView& out);
void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dout, const TensorView& dgate,
                     const TensorView& dup);
// The FP8-cached input's recomputation and backward in one pass (f32 only): bit-identical to
// dequantize, swiglu_forward and swiglu_backward.
void swiglu_backward_fp8(const QuantizedView& gate, const QuantizedView& up, const TensorView& dout,
                         const TensorView& out, const TensorView& dgate, const TensorView& dup);

void moe_route(const TensorView& logits, const TensorView& bias, const TensorView& scores, const TensorView& idx,
               const TensorView& weights, int64_t n_group, int64_t topk_group, bool norm, double scaling);
void moe_route_backward(const TensorView& scores, const TensorView& idx, const TensorView& dweights,
                        const TensorView& dscores, const TensorView& dlogits, bool norm, double scaling);
void gather_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst);
void scatter_add_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst);
void scatter_rows(const TensorView& src, const TensorView& idx, const TensorView& dst);
void rows_dot(const TensorView& a, const TensorView& b, const TensorView& out);

// MoE dispatch (ops_moe_dispatch.cpp) and grouped GEMMs (ops_grouped_gemm.cpp).
void moe_layout(const TensorView& expert_ids, int64_t align, const TensorView& row_slot, const TensorView& row_group,
                const TensorView& slot_row, const TensorView& offsets);
void moe_masked_layout(const TensorView& expert_ids, int64_t groups, int64_t every_token_group,
                       const TensorView& row_slot, const TensorView& slot_row, const TensorView& counts,
                       const TensorView& loads);
void moe_permute(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                 const TensorView& out);
void moe_permute_quantize(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                          const QuantizedView& out, ScaleMode mode);
void moe_combine(const TensorView& y, const TensorView& slot_row, const TensorView& w, const TensorView& out,
                 bool accumulate);
void moe_combine_weight_grad(const TensorView& v, const TensorView& slot_row, const TensorView& w,
                             const TensorView& dw);
void grouped_gemm_fp8_contiguous(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                 int64_t groups, const TensorView& d, const GemmOptions& opt);
void grouped_gemm_fp8_masked(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                             int64_t groups, const TensorView& d, const GemmOptions& opt);
void grouped_wgrad_fp8(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                       const TensorView& d, const GemmOptions& opt);

// Step statistics (ops_step_stats.cpp).
void moe_expert_loads(const TensorView& expert_ids, const TensorView& loads);
void moe_balance_loss(const TensorView& scores, const TensorView& idx, int64_t seq_len, double alpha,
                      double grad_scale, const TensorView& loss, const TensorView& dscores);
void sum_in_order(const TensorView& x, const TensorView& out);

void adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                const Backend::AdamWStep& p);
double sum_squares(const TensorView& x);

}  // namespace fp8moe::cpu
