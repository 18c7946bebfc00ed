// The Linear of every recipe: Fprop y = x w^T, Dgrad dx = dy w, Wgrad dW += dy^T x, and the
// cached activation each keeps for backward (the recipes: include/fp8moe/model_recipe.hpp).
//   full  float GEMMs (fp32 oracle, fp64 finite-difference mode); inputs cached as they are.
//   bf16  BF16 operands, FP32 accumulation and output, transposes in the GEMM's flags; inputs
//         cached in BF16.
//   fp8   E4M3 operands: x 1x128 tiles, w 128x128 blocks (Fprop), dy 1x128 and w^T 128x128
//         (Dgrad, w's quantized blocks transposed), dy^T and x^T grouped 1x128 along tokens (Wgrad,
//         x^T from the cached FP8 tiles by dequantize-transpose-requantize as the report does; dy
//         and dy^T quantized together by the Dgrad, dy^T kept for the Wgrad: WgradDy; in the
//         fp8-f32-cache ablation x^T is quantized from an exact copy kept beside the tiles);
//         promotion per the recipe's AccumConfig; FP32 output and FP32 accumulation into the
//         master gradient.
// FP8 GEMMs need K % 128 == 0: Fprop's K (in features) is validated with the config, Dgrad's K (out
// features) is zero-padded here when needed (kv_a_proj_with_mqa: kv_lora_rank + rope dims), and
// Wgrad's K (tokens) is padded by caching x with zero rows up to a multiple of 128.
#include <memory>

#include "model_internal.hpp"

namespace fp8moe::model {

TensorView rows_view(const TensorView& t, int64_t r0, int64_t n) {
  FP8MOE_CHECK(t.ndim >= 1 && r0 >= 0 && r0 + n <= t.size(0), "rows_view: rows [" << r0 << ", " << r0 + n
                                                                                  << ") outside " << t.str());
  TensorView v = t;
  v.data = static_cast<char*>(t.data) + r0 * t.strides[0] * int64_t(dtype_size(t.dtype));
  v.shape[0] = n;
  return v;
}

namespace {

// A tensor of the backend with t's dtype and shape, zero-filled or not.
Tensor alloc_like(Backend& be, const TensorView& t, bool zero, const char* what) {
  const auto make = [&](std::initializer_list<int64_t> shape) {
    return zero ? be.zeros(t.dtype, shape) : be.empty(t.dtype, shape);
  };
  switch (t.ndim) {
    case 1: return make({t.shape[0]});
    case 2: return make({t.shape[0], t.shape[1]});
    case 3: return make({t.shape[0], t.shape[1], t.shape[2]});
    case 4: return make({t.shape[0], t.shape[1], t.shape[2], t.shape[3]});
    default: break;
  }
  FP8MOE_CHECK(false, what << ": unsupported rank of " << t.str());
}

}  // namespace

Tensor zeros_like(Backend& be, const TensorView& t) { return alloc_like(be, t, true, "zeros_like"); }
Tensor empty_like(Backend& be, const TensorView& t) { return alloc_like(be, t, false, "empty_like"); }

Tensor clone(Ctx& c, const TensorView& t) {
  Tensor o = empty_like(c.be, t);
  c.be.copy(o.view(), t);
  return o;
}

Tensor rows_of(const Tensor& t, int64_t r0, int64_t n) {
  if (r0 == 0 && n == t.size(0)) return t;
  const TensorView v = rows_view(t.view(), r0, n);
  auto keep = std::make_shared<Tensor>(t);
  // Aliasing shared_ptr: owns `t`'s storage, points at the rows' data.
  std::shared_ptr<void> alias(keep, v.data);
  return Tensor(alias, v);
}

Tensor prefix_rows(const Tensor& t, int64_t n) { return rows_of(t, 0, n); }

Tensor reshaped(const Tensor& t, std::initializer_list<int64_t> shape) {
  auto keep = std::make_shared<Tensor>(t);
  std::shared_ptr<void> alias(keep, t.view().data);
  return Tensor(alias, reshape(t.view(), shape));
}

MemoryItem account_item(const std::string& layer, const std::string& name, const TensorView& t) {
  return {layer, name, t.dtype, t.numel(), int64_t(t.nbytes())};
}

Tensor to_bf16(Ctx& c, const TensorView& x) {
  Tensor o = c.be.empty(DType::bf16, {x.size(0), x.size(1)});
  c.be.convert(x, o.view());
  return o;
}

namespace {

void require_cpu_for_per_tensor(Ctx& c) {
  FP8MOE_CHECK(c.be.device() == Device::cpu,
               "recipe fp8-per-tensor: per-tensor quantization runs on the cpu backend only (backend "
                   << c.be.name() << ")");
}

// The quantizers of the recipe: fine-grained through the backend, or one scale per tensor.
void quant_act(Ctx& c, const TensorView& x, const QuantizedView& out, ScaleMode m) {  // 1x128
  if (c.recipe.per_tensor) {
    require_cpu_for_per_tensor(c);
    quantize_per_tensor(x, out, m);
  } else {
    c.be.quantize_1x128(x, out, m);
  }
}
void quant_weight(Ctx& c, const TensorView& w, const QuantizedView& out) {  // 128x128
  if (c.recipe.per_tensor) {
    require_cpu_for_per_tensor(c);
    quantize_per_tensor(w, out, c.recipe.scale_mode);
  } else {
    c.be.quantize_128x128(w, out, c.recipe.scale_mode);
  }
}
void quant_tokens(Ctx& c, const TensorView& x, const QuantizedView& out, ScaleMode m) {  // x [T, C] -> [C, T]
  if (c.recipe.per_tensor) {
    require_cpu_for_per_tensor(c);
    Tensor xt = c.be.empty(x.dtype, {x.size(1), x.size(0)});
    c.be.transpose(x, xt.view());
    quantize_per_tensor(xt.view(), out, m);
  } else {
    c.be.quantize_128x1(x, out, m);
  }
}
// The values of a cache wider than the GEMM's E4M3 (the E5M6 attention-out input) for a second
// quantization. NOTES: with power-of-two scales BF16 holds them exactly (6 mantissa bits times
// 2^k; only products below BF16's smallest normal could round, and those quantize to zero in
// any E4M3 tile with a normal amax), at half the bytes of FP32.
Tensor dequantized(Ctx& c, const QuantizedView& in, ScaleMode mode) {
  const bool exact_in_bf16 = in.values.dtype == DType::e5m6 && mode == ScaleMode::pow2;
  Tensor x = c.be.empty(exact_in_bf16 ? DType::bf16 : DType::f32, {in.rows(), in.cols()});
  c.be.dequantize(in, x.view());
  return x;
}

void requant_tokens(Ctx& c, const QuantizedView& in, const QuantizedView& out) {  // [T, C] -> [C, T]
  // Per tensor, or from a cache wider than the GEMM's E4M3 (the E5M6 attention-out input): the
  // same dequantize-transpose-quantize, spelled out.
  if (c.recipe.per_tensor || in.values.dtype != DType::e4m3) {
    if (c.recipe.per_tensor) require_cpu_for_per_tensor(c);
    const Tensor x = dequantized(c, in, c.recipe.per_tensor ? ScaleMode::fp32 : c.recipe.pow2_mode);
    quant_tokens(c, x.view(), out, c.recipe.scale_mode);
  } else {
    c.be.requantize_128x1(in, out, c.recipe.scale_mode);
  }
}

// x [T, C] padded with zero rows to [rows, C] (x itself when it already has them). The padding
// must be zero: the zero fill of `empty` stays.
Tensor pad_rows(Ctx& c, const Tensor& x, int64_t rows) {
  if (x.size(0) == rows) return x;
  Tensor o = c.be.zeros(x.dtype(), {rows, x.size(1)});
  c.be.copy(rows_view(o.view(), 0, x.size(0)), x.view());
  return o;
}

// x [R, C] padded with zero columns to [R, cols] (zero fill kept, as in pad_rows).
Tensor pad_cols(Ctx& c, const Tensor& x, int64_t cols) {
  if (x.size(1) == cols) return x;
  Tensor o = c.be.zeros(x.dtype(), {x.size(0), cols});
  c.be.copy_cols(x.view(), 0, o.view(), 0, x.size(1), false);
  return o;
}

GemmOptions gemm_options(Ctx& c, bool accumulate) {
  GemmOptions o;
  o.accumulate = accumulate;
  o.accum = c.recipe.accum;
  return o;
}

}  // namespace

TensorView stacked(const Tensor& first, int64_t groups) {
  TensorView v = first.view();
  v.shape[0] *= groups;
  return v;
}

Tensor weight_bf16(Ctx& c, const Parameter& w, int64_t groups, bool last_use) {
  return c.weights.get(w, &WeightCache::Entry::bf16, last_use, [&] { return to_bf16(c, stacked(w.weight, groups)); });
}

QuantizedTensor weight_fp8(Ctx& c, const Parameter& w, int64_t groups, bool last_use) {
  return c.weights.get(w, &WeightCache::Entry::fp8, last_use, [&] {
    const TensorView W = stacked(w.weight, groups);
    QuantizedTensor q = c.be.empty_quantized(W.size(0), W.size(1), DType::e4m3, ScaleKind::block_128x128);
    quant_weight(c, W, q);
    return q;
  });
}

Cached cache_activation(Ctx& c, const TensorView& x, DType qdtype, ScaleMode mode, bool pad, LinearPrecision prec) {
  Cached k;
  k.rows = x.size(0);
  switch (prec) {
    case LinearPrecision::full: k.full = clone(c, x); break;
    case LinearPrecision::bf16: k.full = to_bf16(c, x); break;
    case LinearPrecision::fp8: {
      const int64_t rows = pad ? round_up(k.rows, kQuantGroup) : k.rows;
      // Zero-filled: the padding rows must be zero.
      Tensor xp = rows == k.rows ? Tensor() : c.be.zeros(x.dtype, {rows, x.size(1)});
      if (xp.defined()) c.be.copy(rows_view(xp.view(), 0, k.rows), x);
      k.q = c.be.empty_quantized(rows, x.size(1), qdtype, ScaleKind::tile_1x128);
      quant_act(c, xp.defined() ? xp.view() : x, k.q, mode);
      if (c.recipe.f32_cache) k.full = xp.defined() ? xp : clone(c, x);  // with the padding rows
      break;
    }
  }
  return k;
}

Tensor Cached::restore(Ctx& c) const {
  if (full.defined()) {
    if (full.dtype() == c.act()) return prefix_rows(full, rows);
    Tensor o = c.be.empty(c.act(), {full.size(0), full.size(1)});
    c.be.convert(full.view(), o.view());
    return prefix_rows(o, rows);
  }
  FP8MOE_CHECK(q.values.defined(), "Cached::restore: nothing cached");
  Tensor o = c.be.empty(DType::f32, {q.values.size(0), q.values.size(1)});
  c.be.dequantize(q, o.view());
  return prefix_rows(o, rows);
}

void Cached::account(std::vector<MemoryItem>& items, const std::string& layer, const std::string& name) const {
  if (full.defined()) items.push_back(account_item(layer, name, full.view()));
  if (q.values.defined()) {
    items.push_back(account_item(layer, name, q.values.view()));
    items.push_back(account_item(layer, name + ".scales", q.scales.view()));
  }
}

void linear_forward(Ctx& c, const Cached& x, Parameter& w, const Tensor& y, LinearPrecision prec) {
  const TensorView& W = w.weight.view();  // [N, K]
  switch (prec) {
    case LinearPrecision::full: c.be.gemm(x.full.view(), W, y.view(), false, true, false); return;
    case LinearPrecision::bf16: {
      Tensor wb = weight_bf16(c, w, 1, false);
      c.be.gemm(x.full.view(), wb.view(), y.view(), false, true, false);
      return;
    }
    case LinearPrecision::fp8: {
      const int64_t N = W.size(0), K = W.size(1), Tp = x.q.values.size(0);
      FP8MOE_CHECK(K % kQuantGroup == 0, w.name << ": FP8 Fprop needs in features (" << K << ") % 128 == 0");
      const QuantizedTensor wq = weight_fp8(c, w, 1, false);
      // The Tensor Cores read E4M3: an input cached wider (E5M6) is requantized for the GEMM.
      QuantizedTensor xe4;
      if (x.q.values.dtype() != DType::e4m3) {
        const Tensor xf = dequantized(c, x.q, c.recipe.pow2_mode);  // the E5M6 cache's scale mode
        xe4 = c.be.empty_quantized(Tp, K, DType::e4m3, ScaleKind::tile_1x128);
        quant_act(c, xf.view(), xe4, c.recipe.pow2_mode);
      }
      const QuantizedView xa = xe4.values.defined() ? xe4.view() : x.q.view();
      if (Tp == x.rows) {
        c.be.gemm_fp8(xa, wq, y.view(), gemm_options(c, false));
      } else {
        Tensor d = c.be.empty(DType::f32, {Tp, N});
        c.be.gemm_fp8(xa, wq, d.view(), gemm_options(c, false));
        c.be.copy(y.view(), rows_view(d.view(), 0, x.rows));
      }
      return;
    }
  }
}

WgradDy linear_backward_input(Ctx& c, const Tensor& dy, Parameter& w, const Tensor& dx, bool accumulate,
                              LinearPrecision prec, ScaleMode dy_mode) {
  const TensorView& W = w.weight.view();  // [N, K]
  switch (prec) {
    case LinearPrecision::full: c.be.gemm(dy.view(), W, dx.view(), false, false, accumulate); return {dy, {}};
    case LinearPrecision::bf16: {
      Tensor dyb = to_bf16(c, dy.view()), wb = weight_bf16(c, w, 1, true);
      c.be.gemm(dyb.view(), wb.view(), dx.view(), false, false, accumulate);
      return {dyb, {}};  // converted once for the Dgrad and the Wgrad
    }
    case LinearPrecision::fp8: {
      const int64_t N = W.size(0), K = W.size(1), T = dy.size(0), Np = round_up(N, kQuantGroup);
      const int64_t Tp = round_up(T, kQuantGroup);
      QuantizedTensor dyq = c.be.empty_quantized(T, Np, DType::e4m3, ScaleKind::tile_1x128);
      QuantizedTensor dyt = c.be.empty_quantized(N, Tp, DType::e4m3, ScaleKind::tile_1x128);  // dy^T along tokens
      if (Np == N && Tp == T && !c.recipe.per_tensor) {
        c.be.quantize_1x128_and_128x1(dy.view(), dyq, dyt, dy_mode);  // dy read once for both
      } else {
        // NOTES: dy's two quantizations apart where their inputs differ, this GEMM's K (N) padded
        // with zero columns (zero columns of dy meet zero rows of w, adding nothing) or the Wgrad's
        // K (tokens) with zero rows, and in the per-tensor ablation (its own quantizer, CPU only).
        quant_act(c, pad_cols(c, dy, Np).view(), dyq, dy_mode);
        quant_tokens(c, pad_rows(c, dy, Tp).view(), dyt, dy_mode);
      }
      // w^T's 128x128 blocks are w's blocks transposed: quantize w (or take the forward's
      // quantization), then move bytes and scales. Padded rows: quantized here, with zero rows.
      QuantizedTensor wq;
      if (Np == N) {
        wq = weight_fp8(c, w, 1, true);
      } else {
        Tensor wp = pad_rows(c, w.weight, Np);  // [Np, K]
        wq = c.be.empty_quantized(Np, K, DType::e4m3, ScaleKind::block_128x128);
        quant_weight(c, wp.view(), wq);
      }
      QuantizedTensor wtq = c.be.empty_quantized(K, Np, DType::e4m3, ScaleKind::block_128x128);  // [K, Np]
      c.be.transpose_128x128(wq, wtq, 1);
      c.be.gemm_fp8(dyq, wtq, dx.view(), gemm_options(c, accumulate));
      return {Tensor(), dyt};
    }
  }
  return {};
}

void linear_backward_weight(Ctx& c, const Cached& x, const WgradDy& dy, Parameter& w, LinearPrecision prec) {
  if (!w.trainable) return;
  const TensorView& G = w.grad.view();  // [N, K]
  switch (prec) {
    case LinearPrecision::full: c.be.gemm(dy.full.view(), x.full.view(), G, true, false, true); return;
    case LinearPrecision::bf16: {
      c.be.gemm(dy.full.view(), x.full.view(), G, true, false, true);  // dy in BF16 (the Dgrad's)
      return;
    }
    case LinearPrecision::fp8: {
      const int64_t K = G.size(1), Tp = x.q.values.size(0);
      FP8MOE_CHECK(dy.t.values.defined() && dy.t.values.size(1) == Tp,
                   w.name << ": the Wgrad's dy^T (" << (dy.t.values.defined() ? dy.t.values.view().str() : "none")
                          << ") does not cover the cached input's " << Tp << " tokens");
      QuantizedTensor b = c.be.empty_quantized(K, Tp, DType::e4m3, ScaleKind::tile_1x128);  // x^T along tokens
      if (x.full.defined()) quant_tokens(c, x.full.view(), b, c.recipe.scale_mode);  // fp8-f32-cache: from x itself
      else requant_tokens(c, x.q, b);
      c.be.gemm_fp8(dy.t, b, G, gemm_options(c, true));
      return;
    }
  }
}

Tensor to_backend(Ctx& c, const Tensor& host) {
  if (c.be.device() == Device::cpu) return host;
  Tensor o = empty_like(c.be, host.view());
  c.be.copy(o.view(), host.view());
  return o;
}

Tensor keep_residual(Ctx& c, const Tensor& x) {
  return c.recipe.residual_cache == x.dtype() ? x : to_bf16(c, x.view());
}

Tensor norm_input(Ctx& c, const Tensor& kept) {
  if (kept.dtype() == c.act()) return kept;
  Tensor o = c.be.empty(c.act(), {kept.size(0), kept.size(1)});
  c.be.convert(kept.view(), o.view());
  return o;
}

void rmsnorm(Ctx& c, const Tensor& x, Parameter& w, const Tensor& y, const Tensor& rstd) {
  c.be.rmsnorm_forward(x.view(), w.weight.view(), y.view(), rstd.view(), c.cfg.rms_norm_eps);
}

Cached rmsnorm_linear_input(Ctx& c, const Tensor& x, Parameter& w, const Tensor& rstd, ScaleMode mode) {
  const int64_t T = x.size(0), D = x.size(1);
  if (c.recipe.linear == LinearPrecision::fp8 && !c.recipe.per_tensor && !c.recipe.f32_cache &&
      c.act() == DType::f32) {
    Cached k;
    k.rows = T;
    k.q = c.be.empty_quantized(round_up(T, kQuantGroup), D, DType::e4m3, ScaleKind::tile_1x128);
    c.be.rmsnorm_forward_fp8(x.view(), w.weight.view(), k.q, rstd.view(), c.cfg.rms_norm_eps, mode);
    return k;
  }
  Tensor h = c.empty({T, D});  // the norm output: not kept
  rmsnorm(c, x, w, h, rstd);
  return linear_input(c, h.view(), mode);
}

}  // namespace fp8moe::model
