// The backend interface: every op the model, the trainer and the parallel code run, implemented
// once per device. The CPU backend (src/cpu) is the executable specification; the CUDA backend
// (src/cuda) is tested against it op by op. Tensors passed to a backend live on its device.
// As in ggml, `supports(op)` lets a test or a caller report "unsupported" instead of failing.
// Op contracts (shapes, dtypes, layouts, errors) are those of quantize.hpp and gemm_ref.hpp.
#pragma once
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fp8moe/gemm_ref.hpp"
#include "fp8moe/mla_decode.hpp"
#include "fp8moe/quantize.hpp"
#include "fp8moe/stream.hpp"

namespace fp8moe {

enum class Op : uint8_t {
  quantize_1x128,
  quantize_128x128,
  quantize_128x1,
  quantize_1x128_and_128x1,
  requantize_128x1,
  transpose_128x128,
  dequantize,
  gemm_fp8,
  gemm_bf16,
  // Model ops (include/fp8moe/backend.hpp, "Model ops" below).
  gemm,
  gemm_batch_invariant,
  gemm_strided_batched,
  convert,
  axpy,
  copy_cols,
  transpose,
  embedding_forward,
  embedding_backward,
  rmsnorm_forward,
  rmsnorm_forward_fp8,
  rmsnorm_backward,
  rope,
  mla_split_kv,
  mla_split_kv_backward,
  attention_forward,
  attention_backward,
  mla_decode_attention,
  swiglu_forward,
  swiglu_backward,
  swiglu_backward_fp8,
  swiglu_forward_fp8,
  cross_entropy,
  moe_route,
  moe_route_backward,
  gather_rows,
  scatter_add_rows,
  scatter_rows,
  rows_dot,
  // MoE dispatch and grouped GEMMs (moe_grouped.hpp).
  moe_layout,
  moe_masked_layout,
  moe_permute,
  moe_permute_quantize,
  moe_combine,
  moe_combine_weight_grad,
  grouped_gemm_fp8_contiguous,
  grouped_gemm_fp8_masked,
  grouped_wgrad_fp8,
  // Step statistics (read once per step).
  moe_expert_loads,
  moe_balance_loss,
  sum_in_order,
  // Optimizer ops (the trainer).
  adamw_step,
  sum_squares,
};
std::string_view op_name(Op op);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  virtual bool supports(Op op) const = 0;

  // ---- Streams (stream.hpp). Every op is enqueued on the current stream, which starts as the
  // backend's own compute stream; no op makes the host wait unless its contract says so (host
  // read-backs: to_host, sum_squares, synchronize). Work on two streams is ordered only by events.
  // A tensor allocated on one stream and used on another must stay alive (or the allocating
  // stream must wait for an event recorded after its last use) until that use has run.
  virtual Stream stream() const { return {}; }
  // Another stream on this backend's device (communication, copies), and a fresh event.
  virtual Stream new_stream() { return {}; }
  virtual Event new_event() { return {}; }
  // Ops after this call go to `s` (a stream of this backend's device). StreamScope below restores.
  virtual void set_stream(const Stream&) {}
  // Graph capture (stream.hpp): between begin_capture() and end_capture() the ops queued on the
  // current stream are recorded, not run; the Graph replays them, each replay running them again
  // on the memory they had when recorded. Tensors allocated while capturing come from a pool kept
  // for graphs, so that nothing outside a graph reuses the memory it works in. The recorded work
  // must not wait on the host (no read-back, immediate checks or host synchronization) nor
  // depend on host values that change between replays: the caller keeps those the same (inputs
  // are copied into the tensors the graph reads). Deferred checks recorded while capturing are
  // raised after each replay at synchronize(). A failed capture throws Error and leaves the
  // backend as before begin_capture(). Only where can_capture().
  virtual bool can_capture() const { return false; }
  virtual void begin_capture();
  virtual Graph end_capture();
  // begin_capture(), work(), end_capture(): the Graph of work's ops. When work throws, the
  // capture is ended (its own error dropped) and work's exception goes on.
  Graph capture(const std::function<void()>& work);

  // Memory: names as in torch and numpy: `zeros` is filled with zeros, `empty` is not. Copies
  // between any two devices, ordered on the current stream.
  virtual Tensor zeros(DType dtype, std::initializer_list<int64_t> shape) = 0;
  // A tensor for an op to overwrite whole (a quantizer's output, a conversion's): no zero fill on
  // a GPU (the steady state takes it from a cache, no cudaMalloc). The CPU backend fills it with 0xFF bytes (NaN in every float format, FP8 included), so
  // a read before the write shows in its tests.
  virtual Tensor empty(DType dtype, std::initializer_list<int64_t> shape) { return zeros(dtype, shape); }
  // A copy into host memory returns once the data is there (the host waits for the current
  // stream only); a device-to-device copy is queued.
  virtual void copy(const TensorView& dst, const TensorView& src) = 0;
  // Every byte of a contiguous tensor set to zero, in place (the gradients before a step).
  virtual void zero(const TensorView& dst);
  // Waits for the device's queued work; raises the first failed deferred check (set_checks).
  virtual void synchronize() {}
  // How many times the thread that queues the work has waited for the device so far (copies into
  // host memory, reductions read back, synchronize; immediate checks and wait_copies, which the
  // EMA's own thread calls, excepted), or -1 where the backend cannot tell (the CPU, whose ops run
  // as they are called).
  virtual int64_t host_waits() const { return -1; }
  // Checks whose answer is computed on the device (index ranges, NaN/Inf reaching a quantizer).
  // immediate (the default): the op reads the answer back and raises at once, one host
  // synchronization per op. deferred: the op records a failure on the device and goes on (never
  // touching memory out of bounds); the next synchronize() raises it. The trainer defers and
  // synchronizes once per step. Backends whose checks cost nothing ignore it.
  enum class Checks { immediate, deferred };
  virtual void set_checks(Checks) {}
  virtual Checks checks() const { return Checks::immediate; }
  // Bytes of device memory in use on this backend's device (CUDA: all allocations, not only ours;
  // CPU: the bytes of its live tensors), or -1 where the backend cannot tell.
  virtual int64_t device_memory_in_use() const { return -1; }
  // Bytes of this backend's device memory that nothing holds yet, or -1 where the backend cannot
  // tell (the CPU).
  virtual int64_t device_memory_free() const { return -1; }
  // High-water mark of the bytes of this backend's tensors since it was made, or -1 where the
  // backend cannot tell.
  virtual int64_t device_memory_peak() const { return -1; }
  // The backend's own allocations: bytes in tensors and scratch (and their high-water mark), bytes
  // held from the device for them (in use + cached for reuse), requests served and those that
  // had to go to the device (the rest came from the cache). -1 where the backend cannot tell.
  struct MemoryStats {
    int64_t allocated = -1, peak_allocated = -1, reserved = -1, allocations = -1, device_allocations = -1;
  };
  virtual MemoryStats memory_stats() const { return {device_memory_in_use(), device_memory_peak(), -1, -1, -1}; }
  // Dense BF16 Tensor Core peak of the device in TFLOPS (the denominator of the MFU the trainer
  // reports), or 0 where the backend does not know it.
  virtual double peak_bf16_tflops() const { return 0; }
  QuantizedTensor empty_quantized(int64_t rows, int64_t cols, DType dtype, ScaleKind kind);
  // Asynchronous device-to-host snapshots (the parameter EMA): host memory the device copies into
  // without staging (page-locked on a GPU), a copy ordered after the work queued so far that
  // returns at once, a fence that makes work queued later wait for those copies on the device
  // (before the weights are overwritten), and a host wait for them (any thread). On the CPU they
  // are a plain tensor, a copy, and no-ops.
  virtual Tensor empty_host(DType dtype, std::initializer_list<int64_t> shape) { return Tensor::host(dtype, shape); }
  virtual void copy_to_host_async(const TensorView& dst, const TensorView& src) { copy(dst, src); }
  virtual void fence_copies() {}
  virtual void wait_copies() {}
  // The EMA's fold done by the device, where folds_ema(): each averages[i] = decay * averages[i]
  // + (1 - decay) * values[i] (all f32 on this device), each element as fl(fl(decay a) +
  // fl((1 - decay) v)), the host fold's arithmetic; queued on the current stream like any op.
  virtual bool folds_ema() const { return false; }
  virtual void ema_fold(const std::vector<TensorView>& averages, const std::vector<TensorView>& values, float decay);
  // A host copy of `t` (or `t` itself when it is already on the host).
  Tensor to_host(const Tensor& t);
  // The to_host calls made on this backend so far, host tensors included: each is where a GPU
  // backend makes the host wait for the device, so a caller counts its steps' synchronizations.
  int64_t host_reads() const { return host_reads_; }

  virtual void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode mode) = 0;
  virtual void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode mode) = 0;
  virtual void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode mode) = 0;
  // x [T, C] -> rows [T, C] exactly as quantize_1x128(x, rows) and cols [C, T] exactly as
  // quantize_128x1(x, cols) write them (scales and padding included): the Linear backward's output
  // gradient for its Dgrad and its Wgrad. The default checks both outputs, then runs the two ops
  // (the specification); a backend may read x once for both.
  virtual void quantize_1x128_and_128x1(const TensorView& x, const QuantizedView& rows, const QuantizedView& cols,
                                        ScaleMode mode);
  virtual void requantize_128x1(const QuantizedView& in, const QuantizedView& out, ScaleMode mode) = 0;
  virtual void transpose_128x128(const QuantizedView& in, const QuantizedView& out, int64_t groups) = 0;
  virtual void dequantize(const QuantizedView& in, const TensorView& out) = 0;
  virtual void gemm_fp8(const QuantizedView& a, const QuantizedView& b, const TensorView& d,
                        const GemmOptions& opt) = 0;
  // D [M, N] f32 | bf16 = A [M, K] bf16 * B [N, K]^T bf16 (+ D when accumulate).
  virtual void gemm_bf16(const TensorView& a, const TensorView& b, const TensorView& d, bool accumulate) = 0;

  // ---- Model ops (src/model). "float" below means f32 | f64, one dtype per call; tensors are
  // contiguous row-major; T = tokens. Defaults throw "<op>: unsupported on backend <name>".
  // d [M, N] (+)= op(a) * op(b): op(a) = a [M, K] or, with trans_a, a^T for a [K, M]; op(b) = b
  // [K, N] or, with trans_b, b^T for b [N, K]. Linear: y = x w^T is gemm(x, w, y, false, true).
  // Also a, b bf16 with d f32: FP32 accumulation of the exact products (the bf16 recipe).
  virtual void gemm(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_a, bool trans_b,
                    bool accumulate);
  // The Linear form d [M, N] f32 = a [M, K] b [N, K]^T (a, b both f32 or both bf16, FP32
  // accumulation of the exact products) with every row of d summed in an order set by K alone:
  // the same bits whatever M and the other rows of a (batch invariance: a decode token's Linear
  // does not depend on the tokens that share its step). Also G such GEMMs of f32 3-D strided views
  // as gemm_strided_batched takes them (b [G, N, K]), each matrix with the bits it gets alone. The
  // default is gemm (gemm_strided_batched), whose CPU form sums every element over k in order; a
  // backend whose gemm picks its algorithm by M overrides it.
  virtual void gemm_batch_invariant(const TensorView& a, const TensorView& b, const TensorView& d);
  // G GEMMs in one call: d[g] [M, N] (+)= a[g] [M, K] op(b[g]) for g < G, f32; a, b, d 3-D views
  // [G, rows, cols] with any batch and row strides and unit column strides (e.g. the heads side by
  // side in the columns of one matrix); op(b) = b [G, K, N] or, with trans_b, b^T for b [G, N, K].
  // Every d[g] has the bits gemm gives for the three matrices alone (CPU); CUDA: one strided
  // batched cuBLASLt matmul (FP32, the same accuracy as gemm).
  virtual void gemm_strided_batched(const TensorView& a, const TensorView& b, const TensorView& d, bool trans_b,
                                    bool accumulate);
  // dst = src elementwise between f32, f64 and bf16 (same element count).
  virtual void convert(const TensorView& src, const TensorView& dst);
  // y = alpha * x + beta * y (float, same shape).
  virtual void axpy(double alpha, const TensorView& x, double beta, const TensorView& y);
  // dst[:, dst_col + j] (+)= src[:, src_col + j] for j < ncols; src [R, Cs], dst [R, Cd] float|bf16.
  virtual void copy_cols(const TensorView& src, int64_t src_col, const TensorView& dst, int64_t dst_col,
                         int64_t ncols, bool accumulate);
  // dst [C, R] = src [R, C]^T (float | bf16).
  virtual void transpose(const TensorView& src, const TensorView& dst);
  // out [T, D] = table[ids[t]]; ids [T] i32, table [V, D] float.
  virtual void embedding_forward(const TensorView& ids, const TensorView& table, const TensorView& out);
  // dtable[ids[t]] += dout[t].
  virtual void embedding_backward(const TensorView& ids, const TensorView& dout, const TensorView& dtable);
  // y [T, D] = x * rstd * w, rstd [T] = 1 / sqrt(mean(x^2) + eps); w [D].
  virtual void rmsnorm_forward(const TensorView& x, const TensorView& w, const TensorView& y,
                               const TensorView& rstd, double eps);
  // The FP8 recipes' RMSNorm of a Linear input in one pass: rstd [T] as rmsnorm_forward and out
  // [R, D] (R >= T) = the 1x128 e4m3 quantization (`mode` scales) of y, rows past T zero tiles
  // (codes 0, scale 1: a row-padded Linear input). Bit-identical to rmsnorm_forward into a
  // zero-padded [R, D] temporary and quantize_1x128 of it on the same backend (the default).
  virtual void rmsnorm_forward_fp8(const TensorView& x, const TensorView& w, const QuantizedView& out,
                                   const TensorView& rstd, double eps, ScaleMode mode);
  // dx [T, D] (+= when accumulate_dx) and dw [D] (+=) from dy [T, D]; either output may be undefined
  // (empty view) to skip it: backward-for-input and backward-for-weights.
  virtual void rmsnorm_backward(const TensorView& x, const TensorView& w, const TensorView& rstd,
                                const TensorView& dy, const TensorView& dx, const TensorView& dw,
                                bool accumulate_dx);
  // In place on x [T, H, C]: rotates the interleaved pairs of columns [col0, col0 + rot) of every
  // head by positions[t] * theta^(-2i/rot); inverse rotates back (the backward).
  virtual void rope(const TensorView& x, int64_t col0, int64_t rot, const TensorView& positions, double theta,
                    bool inverse);
  // MLA's per-head keys and values (src/model/attention.cpp): from kv [T, H*(dn+dv)] (each head's
  // k_nope | v) and the shared RoPE key, columns [pe_col, pe_col + dr) of the latent ckv [T, pe_col
  // + dr], k [T, H, dn+dr] = [k_nope | the shared key rotated as rope() does] and v [T, H, dv].
  // The default is that composition of copy_cols and rope; a backend may fuse it, with its bits.
  virtual void mla_split_kv(const TensorView& kv, const TensorView& ckv, int64_t pe_col, const TensorView& positions,
                            double theta, const TensorView& k, const TensorView& v);
  // Its backward: dkv [T, H*(dn+dv)] = each head's dk[:, h, :dn] | dv[:, h], and columns [pe_col,
  // pe_col + dr) of dckv [T, pe_col + dr] = the sum over heads (h = 0, 1, ... in turn, from zero) of
  // dk[:, h, dn:] rotated back (rope's inverse). The other columns of dckv are not touched.
  virtual void mla_split_kv_backward(const TensorView& dk, const TensorView& dv, const TensorView& positions,
                                     double theta, const TensorView& dkv, const TensorView& dckv, int64_t pe_col);
  // Causal attention within sequences of seq_len rows (T = B * seq_len): q, k [T, H, Dk], v [T, H, Dv]
  // -> out [T, H, Dv], lse [H, T] (log-sum-exp of the scaled scores, for the backward). compute is
  // the precision of the GEMM operands: the tensors' dtype (exact) or bf16 (Q, K, V, dout and the
  // probabilities and score gradients rounded to BF16, FP32 accumulation; src/cpu/ops_attention.cpp).
  virtual void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& out, const TensorView& lse, int64_t seq_len, double scale,
                                 DType compute);
  // dq, dk, dv (overwritten) from dout [T, H, Dv], out and lse of the forward (same compute).
  virtual void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse, const TensorView& dout,
                                  const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                  int64_t seq_len, double scale, DType compute);
  // The absorbed MLA decode (include/fp8moe/mla_decode.hpp): B sequences of one query token each,
  // q [B * H, rkv + dr] f32 (row b * H + h: [q_nope_h W_UK_h | q_pe_h]) against the first
  // lengths[b] tokens of sequence b in one layer's paged cache, keys the whole cached row
  // [latent | rope] and values its latent: o [B * H, rkv] f32 = softmax(scale * q k^T) latent
  // (a sequence of length 0 gives zeros). table [B, max_blocks], lengths [B]: i32 on the device.
  // `splits`: fit_batch, or by_length for outputs that do not depend on the batch (mla_decode.hpp).
  virtual void mla_decode_attention(const TensorView& q, const MlaCacheView& cache, const TensorView& table,
                                    const TensorView& lengths, double scale, const TensorView& o,
                                    MlaDecodeSplits splits = MlaDecodeSplits::fit_batch);
  // out [T, F] = silu(gate) * up.
  virtual void swiglu_forward(const TensorView& gate, const TensorView& up, const TensorView& out);
  // dgate, dup [T, F] (overwritten) from dout [T, F].
  virtual void swiglu_backward(const TensorView& gate, const TensorView& up, const TensorView& dout,
                               const TensorView& dgate, const TensorView& dup);
  // The SwiGLU backward from its FP8-cached input in one pass, without f32 copies of gate and up:
  // gate, up [R, F] 1x128-scaled, both e4m3 or both e5m2 (R >= T: rows past T, a row-padded
  // cache's, are not read), g = decode(q) * scale, u likewise (the FP32 product of dequantize);
  // dout [T, F] f32 -> out [T, F] f32 = silu(g) * u (the recomputed forward output; undefined: not
  // written) and dgate, dup [T, F] f32 (overwritten). Bit-identical to dequantize followed by
  // swiglu_forward and swiglu_backward on the same backend, which is what the default runs (through
  // f32 temporaries).
  virtual void swiglu_backward_fp8(const QuantizedView& gate, const QuantizedView& up, const TensorView& dout,
                                   const TensorView& out, const TensorView& dgate, const TensorView& dup);
  // The SwiGLU forward of the FP8 recipes in one pass over gate and up [T, F] f32: gq, uq [T, F] =
  // their 1x128 quantizations (the cached SwiGLU input) and out [R, F] (R >= T) = the quantization
  // of silu(gate) * up (the down projection's input), rows past T zero tiles (codes 0, scale 1: a
  // row-padded Linear input); all e4m3 with `mode` scales. Bit-identical to quantize_1x128(gate),
  // quantize_1x128(up), swiglu_forward into a zero-padded [R, F] temporary and quantize_1x128 of it
  // on the same backend, which is what the default runs.
  virtual void swiglu_forward_fp8(const TensorView& gate, const TensorView& up, const QuantizedView& gq,
                                  const QuantizedView& uq, const QuantizedView& out, ScaleMode mode);
  // losses [T] = -log softmax(logits[t])[targets[t]] (0 where targets[t] < 0); when dlogits is defined,
  // dlogits [T, V] = grad_scale * (softmax - onehot) (0 rows for ignored targets). logits float.
  virtual void cross_entropy(const TensorView& logits, const TensorView& targets, const TensorView& losses,
                             const TensorView& dlogits, double grad_scale);
  // DeepSeek-V3 routing: scores [T, E] = sigmoid(logits); choice = scores + bias [E]; the n_group groups
  // ranked by the sum of their top-2 choices, the best topk_group kept; top-k of choice inside them ->
  // idx [T, k] i32 (descending), weights [T, k] = scores / sum (norm) * scaling.
  virtual void moe_route(const TensorView& logits, const TensorView& bias, const TensorView& scores,
                         const TensorView& idx, const TensorView& weights, int64_t n_group, int64_t topk_group,
                         bool norm, double scaling);
  // dlogits [T, E] (overwritten) = sigmoid' * (dscores + d(weights)/d(scores)^T dweights); dscores [T, E]
  // may be undefined (no direct score gradient, e.g. without a balance loss).
  virtual void moe_route_backward(const TensorView& scores, const TensorView& idx, const TensorView& dweights,
                                  const TensorView& dscores, const TensorView& dlogits, bool norm, double scaling);
  // dst[i] = w[i] * src[idx[i]] for i < N; idx [N] i32, src [T, D], dst [N', D] with N' >= N (rows >= N
  // untouched); w [N] float or undefined (1).
  virtual void gather_rows(const TensorView& src, const TensorView& idx, const TensorView& w, const TensorView& dst);
  // dst[idx[i]] += w[i] * src[i] for i < N; w [N] float or undefined (1); src [N', D], dst [T, D].
  virtual void scatter_add_rows(const TensorView& src, const TensorView& idx, const TensorView& w,
                                const TensorView& dst);
  // dst[idx[i]] = src[i] for i < N, the bytes as they are: idx [N] i32, src [N', C] and dst [R, C]
  // contiguous, one dtype (any). Several i with one idx: one of their rows. Entries outside [0, R):
  // an error on the CPU, skipped on the device.
  virtual void scatter_rows(const TensorView& src, const TensorView& idx, const TensorView& dst);
  // out [N] = sum_j a[i, j] * b[i, j] for i < N (a, b [N', D], N = out size).
  virtual void rows_dot(const TensorView& a, const TensorView& b, const TensorView& out);

  // ---- MoE dispatch and grouped GEMMs, all on the device with no host synchronization (layout
  // and CPU references: moe_grouped.hpp). T tokens, k = topk, G experts, R rows of the expert-sorted
  // layout (R >= moe_layout_rows(T * k, G, align), the bound the caller allocates).
  // expert_ids [T, k] i32 (-1: dropped slot) -> row_slot [R] i32 (t * k + j of each row, -1 for
  // padding and for rows past the end), row_group [R] i32 (expert of each row, -1 likewise),
  // slot_row [T, k] i32 (row of each slot, -1 if dropped), offsets [G + 1] i32 (segment starts,
  // each a multiple of align; offsets[G] = rows used). Tokens ascending inside a segment.
  virtual void moe_layout(const TensorView& expert_ids, int64_t align, const TensorView& row_slot,
                          const TensorView& row_group, const TensorView& slot_row, const TensorView& offsets);
  // The masked layout of grouped_gemm_fp8_masked from the routing, on the device (a decode step
  // reads nothing back): slot s = t * K + j of expert_ids [T, k] i32 (K = k, or k + 1 with
  // every_token_group >= 0: every token's slot j = k in that group, the shared expert run as a
  // routed one) goes to row g * M_max + i, i its rank among group g's slots in slot order, M_max =
  // rows / G. row_slot [G * M_max] i32 (-1 where no slot), slot_row [T, K] i32 (-1: dropped),
  // counts [G] i32; loads [G] i64 (or undefined) += counts. Ids outside [0, G) and slots past M_max
  // in their group are dropped (CPU: an error, as for moe_layout's ids).
  virtual void moe_masked_layout(const TensorView& expert_ids, int64_t groups, int64_t every_token_group,
                                 const TensorView& row_slot, const TensorView& slot_row, const TensorView& counts,
                                 const TensorView& loads);
  // out [R, D] = w[slot] * x[slot / k] for slot = row_slot[r] (zero rows where slot < 0); x [T, D]
  // f32 | bf16, w [T, k] f32 or undefined (1), out f32 | bf16.
  virtual void moe_permute(const TensorView& x, const TensorView& row_slot, int64_t topk, const TensorView& w,
                           const TensorView& out);
  // The same rows quantized to 1x128 E4M3 tiles (out.values [R, D], D % 128 == 0; zero rows get
  // scale 1), one pass: bit-identical to moe_permute followed by quantize_1x128.
  virtual void moe_permute_quantize(const TensorView& x, const TensorView& row_slot, int64_t topk,
                                    const TensorView& w, const QuantizedView& out, ScaleMode mode);
  // out [T, N] f32 (+)= sum_j w[t, j] * y[slot_row[t, j]] (w undefined: 1; dropped slots skipped),
  // each product rounded to f32 and summed in slot order j = 0..k-1 onto 0 (or onto out when
  // accumulate); y [R, N] f32 | bf16.
  virtual void moe_combine(const TensorView& y, const TensorView& slot_row, const TensorView& w,
                           const TensorView& out, bool accumulate);
  // dw [T, k] f32 = v[slot_row[t, j]] / w[t, j] (0 for dropped slots); v [R] f32, w [T, k] f32 > 0.
  // With v = rows_dot(d expert_out, expert_out) of experts fed w * dy this is dy . expert_out.
  virtual void moe_combine_weight_grad(const TensorView& v, const TensorView& slot_row, const TensorView& w,
                                       const TensorView& dw);
  // Contiguous grouped FP8 GEMM: d [R, N] = a [R, K] (1x128) * b[g]^T for g = row_group[r] (zero
  // rows where g < 0); b [G * N, K] 128x128-scaled (the G weights stacked, N % 128 == 0). Rows of
  // one align-block share a group. opt.accumulate adds into d (padding rows untouched then).
  virtual void grouped_gemm_fp8_contiguous(const QuantizedView& a, const QuantizedView& b,
                                           const TensorView& row_group, int64_t groups, const TensorView& d,
                                           const GemmOptions& opt);
  // Masked grouped FP8 GEMM: a [G * M_max, K], counts [G] i32 on the device; d [G * M_max, N]: rows
  // of group g below counts[g] = a * b[g]^T, the rest zero (no accumulate: a decode output).
  virtual void grouped_gemm_fp8_masked(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                                       int64_t groups, const TensorView& d, const GemmOptions& opt);
  // K-grouped Wgrad: d[g] [N, K] f32 (+)= dy_t[:, seg g] * x_t[:, seg g]^T, dy_t [N, R], x_t [K, R]
  // 1x128-scaled along R (tokens); offsets [G + 1] i32 on the device as moe_layout writes them
  // (columns past offsets[G] ignored); d [G * N, K]. An empty segment leaves d[g] (or zeroes it).
  virtual void grouped_wgrad_fp8(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                                 const TensorView& d, const GemmOptions& opt);

  // ---- Step statistics: what a training step reports (losses, expert loads) computed into device
  // tensors, so that the step reads them back once at its end instead of once per layer. Every
  // sum is FP64 in index order (one thread per sum on a GPU, no FMA contraction): the bits of the
  // CPU op, which is the specification.
  // loads [G] f64 = the number of entries of expert_ids [T, k] i32 equal to g, for g < G (ids
  // outside [0, G) are not counted): the expert loads as exact integers.
  virtual void moe_expert_loads(const TensorView& expert_ids, const TensorView& loads);
  // The sequence-wise balance loss over sequences of seq_len tokens (T = B * seq_len): scores
  // [T, E] float (sigmoid affinities), idx [T, k] i32 in [0, E); per sequence b, f_e = sum over
  // its slots routed to e of E / (k S) and P_e = sum_t s_{t,e} / z_t / S (z_t = sum_e s_{t,e});
  // loss [1] f64 = sum_b sum_e alpha f_e P_e / B; dscores [T, E] float = grad_scale * alpha /
  // (B S) * (f_e / z_t - (sum_e' f_e' s_{t,e'}) / z_t^2), the loss's score gradient. Either output
  // may be undefined (not written).
  virtual void moe_balance_loss(const TensorView& scores, const TensorView& idx, int64_t seq_len, double alpha,
                                double grad_scale, const TensorView& loss, const TensorView& dscores);
  // out [1] f64 = the sum of x (float, any shape) in index order from 0, in FP64.
  virtual void sum_in_order(const TensorView& x, const TensorView& out);

  // ---- Optimizer ops (src/train). One AdamW update of one parameter: w [n] f32 master weight,
  // g [n] f32 gradient (times grad_scale), m, v [n] bf16 | f32 moments (updated in place),
  // step = the 1-based update count for the bias corrections; decoupled weight decay.
  struct AdamWStep {
    float lr = 0, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0, grad_scale = 1;
    int64_t step = 1;
  };
  virtual void adamw_step(const TensorView& w, const TensorView& g, const TensorView& m, const TensorView& v,
                          const AdamWStep& p);
  // adamw_step over several parameters, each with its own weight decay (p.weight_decay is not
  // used): on a GPU one launch for all of them. The default calls adamw_step for each.
  struct AdamWTensors {
    TensorView w, g, m, v;
    float weight_decay = 0;
  };
  virtual void adamw_steps(const std::vector<AdamWTensors>& ts, const AdamWStep& p);
  // sum of x^2 over a float tensor (f32 | f64), accumulated in FP64; NaN/Inf propagate.
  virtual double sum_squares(const TensorView& x);
  // The sum over all of xs (in order), with one host synchronization where the backend can.
  virtual double sum_squares_all(const std::vector<TensorView>& xs);

 private:
  int64_t host_reads_ = 0;
};

// Runs the ops of a scope on another stream: { StreamScope on_comm(be, comm); be.copy(...); }
class StreamScope {
 public:
  StreamScope(Backend& be, const Stream& s) : be_(be), prev_(be.stream()) { be_.set_stream(s); }
  ~StreamScope() { be_.set_stream(prev_); }
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  Backend& be_;
  Stream prev_;
};

// Rows of the expert-sorted layout that always suffice: every segment padded to align.
inline int64_t moe_layout_rows(int64_t slots, int64_t groups, int64_t align) {
  return (slots + groups * (align - 1) + align - 1) / align * align;
}

// Backend::gemm_strided_batched's arguments on `device` (f32, 3-D, unit column strides, the
// shapes agreeing): G, M, N, K, or an error naming the argument.
struct BatchedGemmDims {
  int64_t G = 0, M = 0, N = 0, K = 0;
};
BatchedGemmDims check_gemm_strided_batched(Device device, const TensorView& a, const TensorView& b,
                                           const TensorView& d, bool trans_b);

// "cpu", "cuda" (our kernels) or "cublaslt" (the CUDA backend with gemm_fp8 through cuBLASLt); the
// CUDA ones exist when built with CUDA and a GPU is present.
std::unique_ptr<Backend> make_backend(std::string_view name);
std::vector<std::string> available_backends();
// "cuda" when a GPU is usable, else "cpu".
std::string default_backend_name();

}  // namespace fp8moe
