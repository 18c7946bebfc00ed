// Backend registry: builds a backend by name, and the shared helpers of the Backend class.
#include "cpu/cpu_backend.hpp"
#include "fp8moe/backend.hpp"
#include "fp8moe/free_hold.hpp"

#include <utility>
#ifdef FP8MOE_HAVE_CUDA
#include "cuda/cuda_backend.hpp"
#endif

namespace fp8moe {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::quantize_1x128: return "quantize_1x128";
    case Op::quantize_128x128: return "quantize_128x128";
    case Op::quantize_128x1: return "quantize_128x1";
    case Op::quantize_1x128_and_128x1: return "quantize_1x128_and_128x1";
    case Op::requantize_128x1: return "requantize_128x1";
    case Op::transpose_128x128: return "transpose_128x128";
    case Op::dequantize: return "dequantize";
    case Op::gemm_fp8: return "gemm_fp8";
    case Op::gemm_bf16: return "gemm_bf16";
    case Op::gemm: return "gemm";
    case Op::gemm_batch_invariant: return "gemm_batch_invariant";
    case Op::gemm_strided_batched: return "gemm_strided_batched";
    case Op::convert: return "convert";
    case Op::axpy: return "axpy";
    case Op::copy_cols: return "copy_cols";
    case Op::transpose: return "transpose";
    case Op::embedding_forward: return "embedding_forward";
    case Op::embedding_backward: return "embedding_backward";
    case Op::rmsnorm_forward: return "rmsnorm_forward";
    case Op::rmsnorm_forward_fp8: return "rmsnorm_forward_fp8";
    case Op::rmsnorm_backward: return "rmsnorm_backward";
    case Op::rope: return "rope";
    case Op::mla_split_kv: return "mla_split_kv";
    case Op::mla_split_kv_backward: return "mla_split_kv_backward";
    case Op::attention_forward: return "attention_forward";
    case Op::attention_backward: return "attention_backward";
    case Op::mla_decode_attention: return "mla_decode_attention";
    case Op::swiglu_forward: return "swiglu_forward";
    case Op::swiglu_backward: return "swiglu_backward";
    case Op::swiglu_backward_fp8: return "swiglu_backward_fp8";
    case Op::swiglu_forward_fp8: return "swiglu_forward_fp8";
    case Op::cross_entropy: return "cross_entropy";
    case Op::moe_route: return "moe_route";
    case Op::moe_route_backward: return "moe_route_backward";
    case Op::gather_rows: return "gather_rows";
    case Op::scatter_add_rows: return "scatter_add_rows";
    case Op::scatter_rows: return "scatter_rows";
    case Op::rows_dot: return "rows_dot";
    case Op::moe_layout: return "moe_layout";
    case Op::moe_masked_layout: return "moe_masked_layout";
    case Op::moe_permute: return "moe_permute";
    case Op::moe_permute_quantize: return "moe_permute_quantize";
    case Op::moe_combine: return "moe_combine";
    case Op::moe_combine_weight_grad: return "moe_combine_weight_grad";
    case Op::grouped_gemm_fp8_contiguous: return "grouped_gemm_fp8_contiguous";
    case Op::grouped_gemm_fp8_masked: return "grouped_gemm_fp8_masked";
    case Op::grouped_wgrad_fp8: return "grouped_wgrad_fp8";
    case Op::adamw_step: return "adamw_step";
    case Op::sum_squares: return "sum_squares";
    case Op::moe_expert_loads: return "moe_expert_loads";
    case Op::moe_balance_loss: return "moe_balance_loss";
    case Op::sum_in_order: return "sum_in_order";
  }
  return "?";
}

std::shared_ptr<void> hold_frees(const Backend& be) {
#ifdef FP8MOE_HAVE_CUDA
  if (be.device() == Device::cuda) return hold_cuda_frees();
#endif
  (void)be;
  return nullptr;
}

std::shared_ptr<void> set_aside_frees(Backend& be, const std::function<void()>& work) {
#ifdef FP8MOE_HAVE_CUDA
  if (be.device() == Device::cuda) return set_aside_cuda_frees(be.stream().native(), work);
#endif
  work();
  return nullptr;
}

QuantizedTensor Backend::empty_quantized(int64_t rows, int64_t cols, DType dtype, ScaleKind kind) {
  auto ss = scale_shape(kind, rows, cols);
  return {empty(dtype, {rows, cols}), empty(DType::f32, {ss[0], ss[1]}), kind};
}

void Backend::quantize_1x128_and_128x1(const TensorView& x, const QuantizedView& rows, const QuantizedView& cols,
                                       ScaleMode mode) {
  check_quantize_1x128_and_128x1(x, rows, cols);
  quantize_1x128(x, rows, mode);
  quantize_128x1(x, cols, mode);
}

// A copy from a zero-filled tensor: correct on any backend, one pass slower than a memset.
void Backend::zero(const TensorView& dst) {
  FP8MOE_CHECK(dst.is_contiguous(), "zero: " << dst.str() << " is not contiguous");
  const Tensor z = zeros(DType::u8, {int64_t(dst.nbytes())});
  copy(TensorView(dst.data, DType::u8, {int64_t(dst.nbytes())}, dst.device), z.view());
}

void Backend::ema_fold(const std::vector<TensorView>&, const std::vector<TensorView>&, float) {
  FP8MOE_CHECK(false, "ema_fold: unsupported on backend " << name() << " (folds_ema() is false)");
}

void Backend::begin_capture() { FP8MOE_CHECK(false, "begin_capture: backend " << name() << " cannot record graphs"); }
Graph Backend::end_capture() {
  FP8MOE_CHECK(false, "end_capture: backend " << name() << " cannot record graphs");
  return {};
}
Graph Backend::capture(const std::function<void()>& work) {
  begin_capture();
  try {
    work();
  } catch (...) {
    try {
      (void)end_capture();
    } catch (const Error&) {
    }
    throw;
  }
  return end_capture();
}

// Model ops: a backend that does not implement one says so by name.
#define FP8MOE_UNSUPPORTED(op) FP8MOE_CHECK(false, #op ": unsupported on backend " << name())
void Backend::gemm(const TensorView&, const TensorView&, const TensorView&, bool, bool, bool) { FP8MOE_UNSUPPORTED(gemm); }
void Backend::gemm_batch_invariant(const TensorView& a, const TensorView& b, const TensorView& d) {
  if (a.ndim == 3) return gemm_strided_batched(a, b, d, true, false);
  gemm(a, b, d, false, true, false);
}
void Backend::gemm_strided_batched(const TensorView&, const TensorView&, const TensorView&, bool, bool) {
  FP8MOE_UNSUPPORTED(gemm_strided_batched);
}
void Backend::convert(const TensorView&, const TensorView&) { FP8MOE_UNSUPPORTED(convert); }
void Backend::axpy(double, const TensorView&, double, const TensorView&) { FP8MOE_UNSUPPORTED(axpy); }
void Backend::copy_cols(const TensorView&, int64_t, const TensorView&, int64_t, int64_t, bool) {
  FP8MOE_UNSUPPORTED(copy_cols);
}
void Backend::transpose(const TensorView&, const TensorView&) { FP8MOE_UNSUPPORTED(transpose); }
void Backend::embedding_forward(const TensorView&, const TensorView&, const TensorView&) {
  FP8MOE_UNSUPPORTED(embedding_forward);
}
void Backend::embedding_backward(const TensorView&, const TensorView&, const TensorView&) {
  FP8MOE_UNSUPPORTED(embedding_backward);
}
void Backend::rmsnorm_forward(const TensorView&, const TensorView&, const TensorView&, const TensorView&, double) {
  FP8MOE_UNSUPPORTED(rmsnorm_forward);
}
void Backend::rmsnorm_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                               const TensorView&, const TensorView&, bool) {
  FP8MOE_UNSUPPORTED(rmsnorm_backward);
}
void Backend::rope(const TensorView&, int64_t, int64_t, const TensorView&, double, bool) { FP8MOE_UNSUPPORTED(rope); }

// The composition the model ran before the fused kernels: the shared key rotated once, then copied
// into every head.
void Backend::mla_split_kv(const TensorView& kv, const TensorView& ckv, int64_t pe_col, const TensorView& positions,
                           double theta, const TensorView& k, const TensorView& v) {
  const auto [T, H, dn, dr, dv] = check_mla_split_kv("mla_split_kv", kv, ckv, pe_col, k, v);
  Tensor kpe = empty(k.dtype, {T, 1, dr});
  copy_cols(ckv, pe_col, reshape(kpe.view(), {T, dr}), 0, dr, false);
  rope(kpe.view(), 0, dr, positions, theta, false);
  const TensorView kvh = reshape(kv, {T * H, dn + dv}), kh = reshape(k, {T * H, dn + dr});
  copy_cols(kvh, 0, kh, 0, dn, false);
  copy_cols(kvh, dn, reshape(v, {T * H, dv}), 0, dv, false);
  for (int64_t h = 0; h < H; ++h) copy_cols(reshape(kpe.view(), {T, dr}), 0, reshape(k, {T, H * (dn + dr)}), h * (dn + dr) + dn, dr, false);
}
void Backend::mla_split_kv_backward(const TensorView& dk, const TensorView& dv, const TensorView& positions,
                                    double theta, const TensorView& dkv, const TensorView& dckv, int64_t pe_col) {
  const auto [T, H, dn, dr, dvw] = check_mla_split_kv("mla_split_kv_backward", dkv, dckv, pe_col, dk, dv);
  const TensorView dkvh = reshape(dkv, {T * H, dn + dvw});
  copy_cols(reshape(dk, {T * H, dn + dr}), 0, dkvh, 0, dn, false);
  copy_cols(reshape(dv, {T * H, dvw}), 0, dkvh, dn, dvw, false);
  Tensor dkpe = zeros(dk.dtype, {T, 1, dr});
  const TensorView dk2 = reshape(dk, {T, H * (dn + dr)}), dkpe2 = reshape(dkpe.view(), {T, dr});
  for (int64_t h = 0; h < H; ++h) copy_cols(dk2, h * (dn + dr) + dn, dkpe2, 0, dr, true);
  rope(dkpe.view(), 0, dr, positions, theta, true);
  copy_cols(dkpe2, 0, dckv, pe_col, dr, false);
}
void Backend::attention_forward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                const TensorView&, int64_t, double, DType) {
  FP8MOE_UNSUPPORTED(attention_forward);
}
void Backend::attention_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, int64_t, double, DType) {
  FP8MOE_UNSUPPORTED(attention_backward);
}
void Backend::mla_decode_attention(const TensorView&, const MlaCacheView&, const TensorView&, const TensorView&, double,
                                   const TensorView&, MlaDecodeSplits) {
  FP8MOE_UNSUPPORTED(mla_decode_attention);
}
void Backend::swiglu_forward(const TensorView&, const TensorView&, const TensorView&) {
  FP8MOE_UNSUPPORTED(swiglu_forward);
}
void Backend::swiglu_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                              const TensorView&) {
  FP8MOE_UNSUPPORTED(swiglu_backward);
}
// The unfused path: gate and up dequantized to f32 temporaries, then the two float ops.
void Backend::swiglu_backward_fp8(const QuantizedView& gate, const QuantizedView& up, const TensorView& dout,
                                  const TensorView& out, const TensorView& dgate, const TensorView& dup) {
  FP8MOE_CHECK(dout.ndim == 2, "swiglu_backward_fp8: dout must be 2-D, got " << dout.str());
  const int64_t T = dout.size(0), F = dout.size(1);
  for (auto [q, name] : {std::pair{&gate, "gate"}, {&up, "up"}})
    check_covers_rows(*q, "swiglu_backward_fp8", name, T, F, "dout " + dout.str());
  Tensor g = empty(DType::f32, {gate.rows(), F}), u = empty(DType::f32, {up.rows(), F});
  dequantize(gate, g.view());
  dequantize(up, u.view());
  const TensorView gv(g.view().data, DType::f32, {T, F}, device()), uv(u.view().data, DType::f32, {T, F}, device());
  if (out.defined()) swiglu_forward(gv, uv, out);
  swiglu_backward(gv, uv, dout, dgate, dup);
}
// The unfused path: the RMSNorm into a zero-padded temporary, then its quantization.
void Backend::rmsnorm_forward_fp8(const TensorView& x, const TensorView& w, const QuantizedView& out,
                                  const TensorView& rstd, double eps, ScaleMode mode) {
  FP8MOE_CHECK(x.ndim == 2, "rmsnorm_forward_fp8: x must be 2-D, got " << x.str());
  const int64_t T = x.size(0), D = x.size(1);
  check_covers_rows(out, "rmsnorm_forward_fp8", "out", T, D, "x " + x.str());
  Tensor y = out.rows() == T ? empty(x.dtype, {T, D}) : zeros(x.dtype, {out.rows(), D});
  rmsnorm_forward(x, w, TensorView(y.view().data, x.dtype, {T, D}, device()), rstd, eps);
  quantize_1x128(y.view(), out, mode);
}
// The unfused path: the three quantizations and the SwiGLU through a zero-padded f32 temporary.
void Backend::swiglu_forward_fp8(const TensorView& gate, const TensorView& up, const QuantizedView& gq,
                                 const QuantizedView& uq, const QuantizedView& out, ScaleMode mode) {
  FP8MOE_CHECK(gate.ndim == 2 && up.ndim == 2 && up.size(0) == gate.size(0) && up.size(1) == gate.size(1),
               "swiglu_forward_fp8: gate " << gate.str() << " and up " << up.str() << " must be the same [T, F]");
  const int64_t T = gate.size(0), F = gate.size(1);
  check_covers_rows(out, "swiglu_forward_fp8", "out", T, F, "gate " + gate.str());
  quantize_1x128(gate, gq, mode);
  quantize_1x128(up, uq, mode);
  Tensor a = out.rows() == T ? empty(gate.dtype, {T, F}) : zeros(gate.dtype, {out.rows(), F});
  swiglu_forward(gate, up, TensorView(a.view().data, gate.dtype, {T, F}, device()));
  quantize_1x128(a.view(), out, mode);
}
void Backend::cross_entropy(const TensorView&, const TensorView&, const TensorView&, const TensorView&, double) {
  FP8MOE_UNSUPPORTED(cross_entropy);
}
void Backend::moe_route(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                        const TensorView&, int64_t, int64_t, bool, double) {
  FP8MOE_UNSUPPORTED(moe_route);
}
void Backend::moe_route_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, bool, double) {
  FP8MOE_UNSUPPORTED(moe_route_backward);
}
void Backend::gather_rows(const TensorView&, const TensorView&, const TensorView&, const TensorView&) { FP8MOE_UNSUPPORTED(gather_rows); }
void Backend::scatter_add_rows(const TensorView&, const TensorView&, const TensorView&, const TensorView&) {
  FP8MOE_UNSUPPORTED(scatter_add_rows);
}
void Backend::scatter_rows(const TensorView&, const TensorView&, const TensorView&) { FP8MOE_UNSUPPORTED(scatter_rows); }
void Backend::rows_dot(const TensorView&, const TensorView&, const TensorView&) { FP8MOE_UNSUPPORTED(rows_dot); }
void Backend::moe_layout(const TensorView&, int64_t, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&) {
  FP8MOE_UNSUPPORTED(moe_layout);
}
void Backend::moe_masked_layout(const TensorView&, int64_t, int64_t, const TensorView&, const TensorView&,
                                const TensorView&, const TensorView&) {
  FP8MOE_UNSUPPORTED(moe_masked_layout);
}
void Backend::moe_permute(const TensorView&, const TensorView&, int64_t, const TensorView&, const TensorView&) {
  FP8MOE_UNSUPPORTED(moe_permute);
}
void Backend::moe_permute_quantize(const TensorView&, const TensorView&, int64_t, const TensorView&,
                                   const QuantizedView&, ScaleMode) {
  FP8MOE_UNSUPPORTED(moe_permute_quantize);
}
void Backend::moe_combine(const TensorView&, const TensorView&, const TensorView&, const TensorView&, bool) {
  FP8MOE_UNSUPPORTED(moe_combine);
}
void Backend::moe_combine_weight_grad(const TensorView&, const TensorView&, const TensorView&, const TensorView&) {
  FP8MOE_UNSUPPORTED(moe_combine_weight_grad);
}
void Backend::grouped_gemm_fp8_contiguous(const QuantizedView&, const QuantizedView&, const TensorView&, int64_t,
                                          const TensorView&, const GemmOptions&) {
  FP8MOE_UNSUPPORTED(grouped_gemm_fp8_contiguous);
}
void Backend::grouped_gemm_fp8_masked(const QuantizedView&, const QuantizedView&, const TensorView&, int64_t,
                                      const TensorView&, const GemmOptions&) {
  FP8MOE_UNSUPPORTED(grouped_gemm_fp8_masked);
}
void Backend::grouped_wgrad_fp8(const QuantizedView&, const QuantizedView&, const TensorView&, const TensorView&,
                                const GemmOptions&) {
  FP8MOE_UNSUPPORTED(grouped_wgrad_fp8);
}
void Backend::adamw_step(const TensorView&, const TensorView&, const TensorView&, const TensorView&, const AdamWStep&) {
  FP8MOE_UNSUPPORTED(adamw_step);
}
void Backend::adamw_steps(const std::vector<AdamWTensors>& ts, const AdamWStep& p) {
  for (const AdamWTensors& t : ts) {
    AdamWStep q = p;
    q.weight_decay = t.weight_decay;
    adamw_step(t.w, t.g, t.m, t.v, q);
  }
}
void Backend::moe_expert_loads(const TensorView&, const TensorView&) { FP8MOE_UNSUPPORTED(moe_expert_loads); }
void Backend::moe_balance_loss(const TensorView&, const TensorView&, int64_t, double, double, const TensorView&,
                               const TensorView&) {
  FP8MOE_UNSUPPORTED(moe_balance_loss);
}
void Backend::sum_in_order(const TensorView&, const TensorView&) { FP8MOE_UNSUPPORTED(sum_in_order); }
double Backend::sum_squares(const TensorView&) {
  FP8MOE_UNSUPPORTED(sum_squares);
  return 0;
}
#undef FP8MOE_UNSUPPORTED

double Backend::sum_squares_all(const std::vector<TensorView>& xs) {
  double s = 0;
  for (const TensorView& x : xs) s += sum_squares(x);
  return s;
}

BatchedGemmDims check_gemm_strided_batched(Device device, const TensorView& a, const TensorView& b,
                                           const TensorView& d, bool trans_b) {
  for (const auto& [t, arg] : {std::pair<const TensorView&, const char*>{a, "a"}, {b, "b"}, {d, "d"}}) {
    FP8MOE_CHECK(t.defined() && t.device == device && t.dtype == DType::f32 && t.ndim == 3 && t.strides[2] == 1,
                 "gemm_strided_batched: " << arg << " must be a 3-D f32 view on the backend's device with unit column "
                                                    "stride, got "
                                          << t.str());
  }
  BatchedGemmDims g{d.size(0), d.size(1), d.size(2), a.size(2)};
  FP8MOE_CHECK(a.size(0) == g.G && b.size(0) == g.G && a.size(1) == g.M,
               "gemm_strided_batched: a " << a.str() << " and b " << b.str() << " do not match d " << d.str());
  FP8MOE_CHECK((trans_b ? b.size(2) : b.size(1)) == g.K && (trans_b ? b.size(1) : b.size(2)) == g.N,
               "gemm_strided_batched: b " << b.str() << " does not match K = " << g.K << ", N = " << g.N
                                          << (trans_b ? " (transposed)" : ""));
  return g;
}

Tensor Backend::to_host(const Tensor& t) {
  ++host_reads_;
  if (t.device() == Device::cpu) return t;
  // copy() into host memory waits for the current stream only: no device-wide synchronization.
  Tensor h = Tensor::host_like(t.view());
  copy(h.view(), t.view());
  return h;
}

std::unique_ptr<Backend> make_backend(std::string_view name) {
  if (name == "cpu") return make_cpu_backend();
#ifdef FP8MOE_HAVE_CUDA
  if (name == "cuda") {
    FP8MOE_CHECK(cuda_device_available(), "backend 'cuda': no usable CUDA device");
    return make_cuda_backend();
  }
  if (name == "cublaslt") {
    FP8MOE_CHECK(cuda_device_available(), "backend 'cublaslt': no usable CUDA device");
    return make_cublaslt_backend();
  }
#endif
  FP8MOE_CHECK(false, "unknown or unavailable backend '" << name << "' (available: "
                          << [] {
                               std::string s;
                               for (auto& b : available_backends()) s += (s.empty() ? "" : ", ") + b;
                               return s;
                             }() << ")");
}

std::vector<std::string> available_backends() {
  std::vector<std::string> names{"cpu"};
#ifdef FP8MOE_HAVE_CUDA
  if (cuda_device_available()) {
    names.push_back("cuda");
    names.push_back("cublaslt");  // the CUDA backend with gemm_fp8 through cuBLASLt: the baseline
  }
#endif
  return names;
}

std::string default_backend_name() { return available_backends().size() > 1 ? "cuda" : "cpu"; }

}  // namespace fp8moe
