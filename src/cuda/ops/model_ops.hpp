// The model ops of the CUDA backend (contracts: include/fp8moe/backend.hpp, "Model ops"; the CPU
// ops in src/cpu/ops_*.cpp are the specification) and the device AdamW update, as free functions
// with the parameter lists of the Backend virtuals. CudaBackend's overrides (cuda_backend.cu)
// forward to them. All tensors are device views; work is queued on `stream`, the last parameter
// (before an attention call's path and cap).
// Dtypes: "float" ops take f32 (f64 raises "f64 unsupported on cuda"); convert, copy_cols,
// transpose and gather_rows without weights also move bf16 (and f64), as the CPU ops do; gemm
// also takes bf16 a and b (d f32 or bf16), which the CPU op does not.
// Index arguments (ids, targets, idx) are range-checked as on the CPU: that check reads one word
// back, so those ops synchronize with the host.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::cuda {

// ---- launch tables (model_ops_util.cu) ----
// A launch's table of arguments (one entry per block: pointers into the tensors it works on) kept
// on the device and copied again only when its bytes change: ops that run over the same tensors
// every step (the EMA's fold, AdamW) would otherwise copy it from pageable memory per launch, which
// makes the host wait for the stream. Not for use while a stream is being captured.
class DeviceTable {
 public:
  DeviceTable() = default;
  ~DeviceTable();
  DeviceTable(const DeviceTable&) = delete;
  DeviceTable& operator=(const DeviceTable&) = delete;
  // The device copy of `host`'s entries (nullptr when it is empty). The entries are compared byte
  // for byte, so they must have no padding (uninitialized bytes would copy the table every call):
  // each entry type asserts its size.
  template <class T>
  const T* get(const std::vector<T>& host) {
    static_assert(std::is_trivially_copyable_v<T>, "a launch table's entries are copied as bytes");
    return static_cast<const T*>(get_bytes(host.data(), host.size() * sizeof(T)));
  }

 private:
  const void* get_bytes(const void* host, size_t bytes);
  std::vector<unsigned char> last_;
  void* dev_ = nullptr;
};

// ---- step statistics (step_stats.cu): bit-identical to the CPU ops ----
void cuda_moe_expert_loads(const TensorView& expert_ids, const TensorView& loads, cudaStream_t stream);
void cuda_moe_balance_loss(const TensorView& scores, const TensorView& idx, int64_t seq_len, double alpha,
                           double grad_scale, const TensorView& loss, const TensorView& dscores, cudaStream_t stream);
void cuda_sum_in_order(const TensorView& x, const TensorView& out, cudaStream_t stream);

// ---- dense (model_ops_gemm.cu, model_ops_elementwise.cu) ----
void cuda_gemm(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_a, bool trans_b,
               bool accumulate, cudaStream_t stream);
// Backend::gemm_strided_batched: one strided batched cuBLASLt matmul.
void cuda_gemm_strided_batched(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_b,
                               bool accumulate, cudaStream_t stream);
// Backend::gemm_batch_invariant (gemm_batch_invariant.cu).
void cuda_gemm_batch_invariant(const TensorView& a, const TensorView& b, const TensorView& d, cudaStream_t stream);
void cuda_convert(const TensorView& src, const TensorView& dst, cudaStream_t stream);
void cuda_axpy(double alpha, const TensorView& x, double beta, const TensorView& y, cudaStream_t stream);
void cuda_copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col, int64_t ncols,
                    bool accumulate, cudaStream_t stream);
void cuda_transpose(const TensorView& src, const TensorView& dst, cudaStream_t stream);

// ---- embedding and loss (model_ops_elementwise.cu, model_ops_loss.cu) ----
void cuda_embedding_forward(const TensorView& ids, const TensorView& table, const TensorView& out, cudaStream_t stream);
void cuda_embedding_backward(const TensorView& ids, const TensorView& dout, const TensorView& dtable, cudaStream_t stream);
void cuda_cross_entropy(const TensorView& logits, const TensorView& targets, const TensorView& losses,
                        const TensorView& dlogits, double grad_scale, cudaStream_t stream);

// ---- normalization, position, attention, MLP (model_ops_norm.cu, model_ops_attention.cu,
// model_ops_elementwise.cu) ----
void cuda_rmsnorm_forward(const TensorView& x, const TensorView& w, const TensorView& y, const TensorView& rstd,
                          double eps, cudaStream_t stream);
// Bit-identical to cuda_rmsnorm_forward into a zero-padded temporary and quantize_1x128 of it.
void cuda_rmsnorm_forward_fp8(const TensorView& x, const TensorView& w, const QuantizedView& out,
                              const TensorView& rstd, double eps, ScaleMode mode, cudaStream_t stream);
void cuda_rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd, const TensorView& dy,
                           const TensorView& dx, const TensorView& dw, bool accumulate_dx, cudaStream_t stream);
void cuda_rope(const TensorView& x, int64_t col0, int64_t rot, const TensorView& positions, double theta,
               bool inverse, cudaStream_t stream);
// Backend::mla_split_kv and its backward in one kernel each, with the composition's bits.
void cuda_mla_split_kv(const TensorView& kv, const TensorView& ckv, int64_t pe_col, const TensorView& positions,
                       double theta, const TensorView& k, const TensorView& v, cudaStream_t stream);
void cuda_mla_split_kv_backward(const TensorView& dk, const TensorView& dv, const TensorView& positions, double theta,
                                const TensorView& dkv, const TensorView& dckv, int64_t pe_col, cudaStream_t stream);
// Attention computes in FP32 or with BF16 GEMM operands (compute f32 | bf16, as the CPU op) on
// one of two paths (model_ops_attention.cu): `gemm` materializes the scores of a chunk of
// sequences in a stream-ordered workspace ([chunk, H, seq_len, seq_len] f32 per score buffer, one
// forward, two backward; in bf16 also their BF16 copies and BF16 copies of the chunk's operands)
// and does the matrix work as cuBLASLt GEMMs with FP32 accumulation, in one of two bitwise equal
// forms: `gemm_looped` a GEMM per sequence or per head on the tensors as they lie,
// `gemm_batched` one per product over all the chunk's sequences and heads (operands and results
// copied head-major in the workspace); `gemm` takes the batched form where the looped GEMMs would
// give the device fewer 128 x 128 tiles than it has SMs (few heads, short sequences), the looped
// one otherwise. `flash` is the FlashAttention-2-style kernels (no workspace; head dims up to
// 256). `automatic` takes `gemm` when one sequence's workspace fits in `workspace_cap` bytes,
// `flash` otherwise. The Backend uses the defaults; tests and the benchmark force a path or a
// smaller cap (more chunks).
enum class AttentionPath { automatic, gemm, gemm_looped, gemm_batched, flash };
// Whether `gemm` (and `automatic`, on the GEMM path) runs batched for B sequences of S tokens
// and H heads on the current device.
bool cuda_attention_batched(int64_t B, int64_t S, int64_t H);
constexpr size_t kAttentionWorkspaceCap = size_t(512) << 20;
// Bytes of the GEMM path's workspace per sequence, forward or backward, batched (`gemm`) or
// looped (a chunk of n sequences takes at most n times this).
size_t cuda_attention_workspace_bytes(int64_t seq_len, int64_t H, int64_t Dk, int64_t Dv, DType compute,
                                      bool backward, bool batched = true);
void cuda_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, int64_t seq_len, double scale, DType compute,
                            cudaStream_t stream, AttentionPath path = AttentionPath::automatic,
                            size_t workspace_cap = kAttentionWorkspaceCap);
void cuda_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& lse, const TensorView& dout, const TensorView& dq,
                             const TensorView& dk, const TensorView& dv, int64_t seq_len, double scale,
                             DType compute, cudaStream_t stream, AttentionPath path = AttentionPath::automatic,
                             size_t workspace_cap = kAttentionWorkspaceCap);
void cuda_swiglu_forward(const TensorView& gate, const TensorView& up, const TensorView& out, cudaStream_t stream);
void cuda_swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dout,
                          const TensorView& dgate, const TensorView& dup, cudaStream_t stream);
// Bit-identical to cuda dequantize + cuda_swiglu_forward + cuda_swiglu_backward (shared device math).
void cuda_swiglu_backward_fp8(const QuantizedView& gate, const QuantizedView& up, const TensorView& dout,
                              const TensorView& out, const TensorView& dgate, const TensorView& dup, cudaStream_t stream);
// Bit-identical to cuda quantize_1x128 (gate, up), cuda_swiglu_forward and quantize_1x128 (out).
void cuda_swiglu_forward_fp8(const TensorView& gate, const TensorView& up, const QuantizedView& gq,
                             const QuantizedView& uq, const QuantizedView& out, ScaleMode mode, cudaStream_t stream);

// ---- MoE routing and row movement (model_ops_moe.cu) ----
void cuda_moe_route(const TensorView& logits, const TensorView& bias, const TensorView& scores, const TensorView& idx,
                    const TensorView& weights, int64_t n_group, int64_t topk_group, bool norm, double scaling, cudaStream_t stream);
void cuda_moe_route_backward(const TensorView& scores, const TensorView& idx, const TensorView& dweights,
                             const TensorView& dscores, const TensorView& dlogits, bool norm, double scaling, cudaStream_t stream);
void cuda_gather_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst, cudaStream_t stream);
void cuda_scatter_add_rows(const TensorView& src, const TensorView& idx, const TensorView& w,
                           const TensorView& dst, cudaStream_t stream);
void cuda_scatter_rows(const TensorView& src, const TensorView& idx, const TensorView& dst, cudaStream_t stream);
void cuda_rows_dot(const TensorView& a, const TensorView& b, const TensorView& out, cudaStream_t stream);

// ---- optimizer (adamw.cu, reduce.cu) ----
// Backend::adamw_step: bit-identical to the CPU op (src/cpu/ops_optim.cpp).
void cuda_adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                     const Backend::AdamWStep& p, cudaStream_t stream);
// Backend::adamw_steps: cuda_adamw_step over every entry in one launch over `table`'s chunks.
void cuda_adamw_steps(const std::vector<Backend::AdamWTensors>& ts, const Backend::AdamWStep& p, DeviceTable& table,
                      cudaStream_t stream);
// Backend::sum_squares of an f32 tensor, FP64 accumulation in a fixed order (deterministic).
// Over all of xs in order; one kernel pass per 65535 tensors and one read back.
double cuda_sum_squares(const std::vector<TensorView>& xs, cudaStream_t stream);

// Backend::ema_fold (ema_fold.cu): every average = decay * average + (1 - decay) * value (all f32
// on the device), with the host fold's roundings, in one launch on `stream` over `table`'s chunks.
void cuda_ema_fold(const std::vector<TensorView>& averages, const std::vector<TensorView>& values, float decay,
                   DeviceTable& table, cudaStream_t stream);

}  // namespace fp8moe::cuda
