// Fine-grained quantizers (1x128, 128x128, 128x1) and dequantization, CPU reference.
// Contracts and layouts: include/fp8moe/quantize.hpp.
#include "fp8moe/quantize.hpp"

#include <cmath>
#include <cstring>
#include <vector>

#include "fp8moe/codecs.hpp"
#include "fp8moe/minifloat_encode.hpp"

namespace fp8moe {

float load_float(const TensorView& x, int64_t i) {
  switch (x.dtype) {
    case DType::f32: return x.ptr<const float>()[i];
    case DType::bf16: return bf16_decode(x.ptr<const uint16_t>()[i]);
    case DType::f64: return float(x.ptr<const double>()[i]);
    default: break;
  }
  FP8MOE_CHECK(false, "load_float: unsupported dtype " << dtype_name(x.dtype));
}

void store_float(const TensorView& x, int64_t i, float v) {
  switch (x.dtype) {
    case DType::f32: x.ptr<float>()[i] = v; return;
    case DType::bf16: x.ptr<uint16_t>()[i] = bf16_encode(v); return;
    case DType::f64: x.ptr<double>()[i] = v; return;
    default: break;
  }
  FP8MOE_CHECK(false, "store_float: unsupported dtype " << dtype_name(x.dtype));
}

float decode_value(DType dtype, const void* data, int64_t i) {
  switch (dtype) {
    case DType::e4m3: return e4m3_decode(static_cast<const uint8_t*>(data)[i]);
    case DType::e5m2: return e5m2_decode(static_cast<const uint8_t*>(data)[i]);
    case DType::e5m6: return e5m6_decode(e5m6_load(static_cast<const uint8_t*>(data), i));
    default: break;
  }
  FP8MOE_CHECK(false, "decode_value: " << dtype_name(dtype) << " is not a quantized dtype");
}

static void encode_value(DType dtype, void* data, int64_t i, float v) {
  switch (dtype) {
    case DType::e4m3: static_cast<uint8_t*>(data)[i] = e4m3_encode(v); return;
    case DType::e5m2: static_cast<uint8_t*>(data)[i] = e5m2_encode(v); return;
    case DType::e5m6: e5m6_store(static_cast<uint8_t*>(data), i, e5m6_encode(v)); return;
    default: break;
  }
}

std::array<int64_t, 2> scale_shape(ScaleKind kind, int64_t rows, int64_t cols) {
  if (kind == ScaleKind::tile_1x128) return {ceil_div(cols, kQuantGroup), scale_ld(rows)};
  return {ceil_div(rows, kQuantGroup), ceil_div(cols, kQuantGroup)};
}

QuantizedTensor make_quantized_host(int64_t rows, int64_t cols, DType dtype, ScaleKind kind) {
  format_of(dtype);  // validates the dtype
  auto ss = scale_shape(kind, rows, cols);
  QuantizedTensor q{Tensor::host(dtype, {rows, cols}), Tensor::host(DType::f32, {ss[0], ss[1]}), kind};
  return q;
}

float QuantizedView::scale_at(int64_t r, int64_t c) const {
  const float* s = scales.ptr<const float>();
  if (kind == ScaleKind::tile_1x128) return s[(c / kQuantGroup) * scales.size(1) + r];
  return s[(r / kQuantGroup) * scales.size(1) + c / kQuantGroup];
}

float compute_scale(float amax, DType dtype, ScaleMode mode) {
  FP8MOE_CHECK(std::isfinite(amax) && amax >= 0, "compute_scale: amax must be finite and >= 0, got " << amax);
  if (amax == 0) return 1.0f;
  float s = amax / float(max_finite(dtype));
  if (mode == ScaleMode::pow2) s = ue8m0_decode(ue8m0_encode(s, /*round_up=*/true));
  // NOTES: amax / max can underflow to 0 or a subnormal for tiny tiles; a scale of at least the
  // smallest normal keeps 1 / s finite, and such tiles quantize to (near) zero anyway.
  return std::max(s, std::numeric_limits<float>::min());
}

void check_covers_rows(const QuantizedView& q, const char* op, const char* arg, int64_t rows, int64_t cols,
                       const std::string& of, bool padded) {
  FP8MOE_CHECK(q.values.ndim == 2 && (padded ? q.rows() >= rows : q.rows() == rows) && q.cols() == cols,
               op << ": " << arg << " " << q.values.str() << " must be [" << (padded ? "R >= " : "") << rows << ", "
                  << cols << "] (" << of << ")");
}

void check_quantized(const QuantizedView& q, const char* arg, ScaleKind kind) {
  FP8MOE_CHECK(q.kind == kind, arg << ": expected " << (kind == ScaleKind::tile_1x128 ? "1x128" : "128x128")
                                   << " scales, got the other kind");
  check_tensor(q.values, arg, {DType::e4m3, DType::e5m2, DType::e5m6}, 2);
  auto ss = scale_shape(kind, q.values.size(0), q.values.size(1));
  std::string scales_arg = std::string(arg) + ".scales";
  check_tensor(q.scales, scales_arg.c_str(), DType::f32, 2);
  check_shape(q.scales, scales_arg.c_str(), {ss[0], ss[1]});
  FP8MOE_CHECK(q.values.device == q.scales.device, arg << ": values and scales on different devices");
}

static void check_input(const TensorView& x, const char* arg) {
  check_tensor(x, arg, {DType::f32, DType::bf16}, 2);
  FP8MOE_CHECK(x.device == Device::cpu, arg << ": the CPU quantizer needs host memory, got " << x.str());
}

// The source as a dense [R, C] float array, read once through `get`; NaN/Inf raise naming the
// first offending element.
// NOTES: the error is raised after the OpenMP loop, since an exception must not leave a parallel
// region.
template <class Get>
static std::vector<float> materialize(Get get, const char* arg, int64_t R, int64_t C) {
  std::vector<float> buf(size_t(R * C));
  std::vector<int64_t> bad_col(size_t(R), -1);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const float v = get(r, c);
      buf[size_t(r * C + c)] = v;
      if (!std::isfinite(v) && bad_col[size_t(r)] < 0) bad_col[size_t(r)] = c;
    }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t c = bad_col[size_t(r)];
    FP8MOE_CHECK(c < 0, arg << ": non-finite value " << buf[size_t(r * C + c)] << " at [" << r << ", " << c
                            << "] (NaN/Inf input is refused by the quantizers)");
  }
  return buf;
}

// Packed E5M6 keeps two values per three bytes: with an odd row length a pair spans two rows (or
// two tiles), and two threads writing its halves would race on the shared byte.
static bool pairs_straddle(DType dtype, int64_t cols) { return dtype == DType::e5m6 && cols % 2 != 0; }

// Quantizes the tile rows [r0, r1) x cols [c0, c1) of `get(r, c)` with one scale; returns it.
template <class Get>
static float quantize_tile(Get get, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                           const TensorView& out, ScaleMode mode) {
  float amax = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(get(r, c)));
  const float s = compute_scale(amax, out.dtype, mode);
  const float inv = 1.0f / s;  // the reciprocal scale, once per tile (quantize.hpp)
  const int64_t ld = out.size(1);
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) encode_value(out.dtype, out.data, r * ld + c, get(r, c) * inv);
  return s;
}

// 1x128 tiles of a logical [R, C] source read through `get`.
template <class Get>
static void quantize_rows_1x128(Get get, const char* arg, const QuantizedView& out, ScaleMode mode) {
  const int64_t R = out.rows(), C = out.cols(), G = ceil_div(C, kQuantGroup), ld = out.scales.size(1);
  const std::vector<float> src = materialize(get, arg, R, C);
  auto at = [&](int64_t r, int64_t c) { return src[size_t(r * C + c)]; };
  float* scales = out.scales.ptr<float>();
#pragma omp parallel for schedule(static) if (!pairs_straddle(out.values.dtype, C))
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      scales[g * ld + r] = quantize_tile(at, r, r + 1, g * kQuantGroup,
                                         std::min(C, (g + 1) * kQuantGroup), out.values, mode);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = R; r < ld; ++r) scales[g * ld + r] = 1.0f;
}

void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode mode) {
  check_input(x, "x");
  check_quantized(out, "out", ScaleKind::tile_1x128);
  check_shape(out.values, "out.values", {x.size(0), x.size(1)});
  const int64_t C = x.size(1);
  quantize_rows_1x128([&](int64_t r, int64_t c) { return load_float(x, r * C + c); }, "x", out, mode);
}

void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode mode) {
  check_input(w, "w");
  check_quantized(out, "out", ScaleKind::block_128x128);
  check_shape(out.values, "out.values", {w.size(0), w.size(1)});
  const int64_t R = w.size(0), C = w.size(1), BR = ceil_div(R, kQuantGroup), BC = ceil_div(C, kQuantGroup);
  const std::vector<float> src = materialize([&](int64_t r, int64_t c) { return load_float(w, r * C + c); }, "w", R, C);
  auto at = [&](int64_t r, int64_t c) { return src[size_t(r * C + c)]; };
  float* scales = out.scales.ptr<float>();
#pragma omp parallel for collapse(2) schedule(static) if (!pairs_straddle(out.values.dtype, C))
  for (int64_t br = 0; br < BR; ++br)
    for (int64_t bc = 0; bc < BC; ++bc)
      scales[br * BC + bc] =
          quantize_tile(at, br * kQuantGroup, std::min(R, (br + 1) * kQuantGroup), bc * kQuantGroup,
                        std::min(C, (bc + 1) * kQuantGroup), out.values, mode);
}

void quantize_per_tensor(const TensorView& x, const QuantizedView& out, ScaleMode mode) {
  check_input(x, "x");
  check_quantized(out, "out", out.kind);
  check_shape(out.values, "out.values", {x.size(0), x.size(1)});
  const int64_t R = x.size(0), C = x.size(1);
  const std::vector<float> src = materialize([&](int64_t r, int64_t c) { return load_float(x, r * C + c); }, "x", R, C);
  const float s = quantize_tile([&](int64_t r, int64_t c) { return src[size_t(r * C + c)]; }, 0, R, 0, C, out.values, mode);
  float* scales = out.scales.ptr<float>();
  for (int64_t i = 0; i < out.scales.numel(); ++i) scales[i] = s;
}

void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode mode) {
  check_input(x, "x");
  check_quantized(out, "out", ScaleKind::tile_1x128);
  check_shape(out.values, "out.values", {x.size(1), x.size(0)});
  const int64_t C = x.size(1);
  // out[c, t] = x[t, c]
  quantize_rows_1x128([&](int64_t c, int64_t t) { return load_float(x, t * C + c); }, "x", out, mode);
}

void check_quantize_1x128_and_128x1(const TensorView& x, const QuantizedView& rows, const QuantizedView& cols) {
  check_tensor(x, "x", {DType::f32, DType::bf16}, 2);
  check_quantized(rows, "rows", ScaleKind::tile_1x128);
  check_shape(rows.values, "rows.values", {x.size(0), x.size(1)});
  check_quantized(cols, "cols", ScaleKind::tile_1x128);
  check_shape(cols.values, "cols.values", {x.size(1), x.size(0)});
}

void requantize_128x1(const QuantizedView& in, const QuantizedView& out, ScaleMode mode) {
  check_quantized(in, "in", ScaleKind::tile_1x128);
  check_quantized(out, "out", ScaleKind::tile_1x128);
  FP8MOE_CHECK(in.values.device == Device::cpu, "in: the CPU quantizer needs host memory");
  check_shape(out.values, "out.values", {in.cols(), in.rows()});
  const int64_t C = in.cols();
  auto get = [&](int64_t c, int64_t t) {
    return decode_value(in.values.dtype, in.values.data, t * C + c) * in.scale_at(t, c);
  };
  quantize_rows_1x128(get, "in", out, mode);
}

void check_transpose_128x128(const QuantizedView& in, const QuantizedView& out, int64_t groups, const char* op) {
  check_quantized(in, "in", ScaleKind::block_128x128);
  check_quantized(out, "out", ScaleKind::block_128x128);
  FP8MOE_CHECK(groups >= 1 && in.rows() % groups == 0,
               op << ": groups = " << groups << " must be >= 1 and divide in's " << in.rows() << " rows");
  const int64_t R = in.rows() / groups, C = in.cols();
  FP8MOE_CHECK(R % kQuantGroup == 0 && C % kQuantGroup == 0,
               op << ": each group's matrix [" << R << ", " << C << "] must have rows and columns that are multiples of 128"
                  << " (pad the weight first)");
  FP8MOE_CHECK(in.values.dtype == out.values.dtype && dtype_size(in.values.dtype) == 1,
               op << ": in and out must share one 8-bit dtype, got " << in.values.str() << " and " << out.values.str());
  check_shape(out.values, "out.values", {groups * C, R});
}

void transpose_128x128(const QuantizedView& in, const QuantizedView& out, int64_t groups) {
  check_transpose_128x128(in, out, groups, "transpose_128x128");
  FP8MOE_CHECK(in.values.device == Device::cpu && out.values.device == Device::cpu,
               "transpose_128x128: the CPU op needs host memory");
  const int64_t R = in.rows() / groups, C = in.cols(), RB = R / kQuantGroup, CB = C / kQuantGroup;
  const auto* x = in.values.ptr<const uint8_t>();
  auto* y = out.values.ptr<uint8_t>();
  const float* si = in.scales.ptr<const float>();
  float* so = out.scales.ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) y[(g * C + c) * R + r] = x[(g * R + r) * C + c];
    for (int64_t rb = 0; rb < RB; ++rb)
      for (int64_t cb = 0; cb < CB; ++cb) so[(g * CB + cb) * RB + rb] = si[(g * RB + rb) * CB + cb];
  }
}

void dequantize(const QuantizedView& in, const TensorView& out) {
  check_quantized(in, "in", in.kind);
  check_tensor(out, "out", {DType::f32, DType::bf16}, 2);
  check_shape(out, "out", {in.rows(), in.cols()});
  const int64_t R = in.rows(), C = in.cols();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c)
      store_float(out, r * C + c, decode_value(in.values.dtype, in.values.data, r * C + c) * in.scale_at(r, c));
}

}  // namespace fp8moe
