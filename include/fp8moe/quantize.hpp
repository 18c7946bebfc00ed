// Fine-grained FP8 quantization (report §3.3.2; docs/ACCURACY.md), CPU reference.
//
// Online absmax: every tile/block gets scale s = amax / max_finite(dtype) (ScaleMode::fp32) or the
// smallest power of two >= that (ScaleMode::pow2, so nothing overflows), and q = encode(x * r)
// with the reciprocal scale r = 1 / s computed once per tile (IEEE float division, then one IEEE
// float product per element, both round to nearest even; the encoding saturates and rounds to
// nearest even), as DeepSeek's and Transformer Engine's quantizers do. With power-of-two scales r
// is exact, so x * r is the correctly rounded x / s. An all-zero tile gets s = 1 and exact zeros; a
// scale below FLT_MIN (tiny tiles) is raised to FLT_MIN so r stays finite (s <= FLT_MAX / 448 keeps
// r a normal number).
// Power-of-two scales are computed as ue8m0_decode(ue8m0_encode(amax / max, round_up)). NaN or Inf in the input raises fp8moe::Error naming the argument and the element.
//
// Layouts. A quantized 2-D tensor has values [R, C] row-major (e4m3/e5m2 bytes or e5m6 uint16) and
// FP32 scales:
//   ScaleKind::tile_1x128     one scale per row per 128 columns (activations: per token per 128
//                             channels). scales [ceil(C/128), scale_ld(R)] f32, group-major
//                             ("M-major": the rows of one column group are contiguous, the layout
//                             the GEMM's TMA reads). scale_ld(R) = round_up(R, 4) keeps each group
//                             16-byte aligned; padding entries are written as 1.
//   ScaleKind::block_128x128  one scale per 128x128 block (weights [N, K]: 128 output x 128 input
//                             channels). scales [ceil(R/128), ceil(C/128)] f32 row-major.
// Ragged shapes: the last tile/block along a dimension may be partial; its scale covers only the
// valid elements and nothing past the end is read or written.
//
// 128x1 (grouped along tokens, for Wgrad): for x [T, C] the GEMM needs x^T [C, T] quantized 1x128
// along T. quantize_128x1 does that directly from FP32/BF16; requantize_128x1 is the report's path
// from the cached 1x128 FP8 tensor: dequantize, transpose, requantize.
#pragma once
#include "fp8moe/tensor.hpp"

namespace fp8moe {

constexpr int kQuantGroup = 128;

enum class ScaleKind : uint8_t { tile_1x128, block_128x128 };
enum class ScaleMode : uint8_t { fp32, pow2 };

inline int64_t scale_ld(int64_t rows) { return round_up(rows, 4); }

struct QuantizedView {
  TensorView values;  // [R, C] e4m3 | e5m2 | e5m6, row-major
  TensorView scales;  // see the layouts above
  ScaleKind kind = ScaleKind::tile_1x128;

  int64_t rows() const { return values.size(0); }
  int64_t cols() const { return values.size(1); }
  // Scale of element (r, c).
  float scale_at(int64_t r, int64_t c) const;
};

struct QuantizedTensor {
  Tensor values, scales;
  ScaleKind kind = ScaleKind::tile_1x128;
  QuantizedView view() const { return {values.view(), scales.view(), kind}; }
  operator QuantizedView() const { return view(); }
};

// Shape of the scale tensor for values [rows, cols].
std::array<int64_t, 2> scale_shape(ScaleKind kind, int64_t rows, int64_t cols);
// Host storage for a quantized [rows, cols] tensor.
QuantizedTensor make_quantized_host(int64_t rows, int64_t cols, DType dtype, ScaleKind kind);

// Scale of a tile with absolute maximum `amax` (finite, >= 0).
float compute_scale(float amax, DType dtype, ScaleMode mode);

// Validates `q` (dtypes, scale shape, layout) for values [rows, cols]; `arg` names it in errors.
void check_quantized(const QuantizedView& q, const char* arg, ScaleKind kind);
// q covers `rows` rows of `cols` columns: [R >= rows, cols] (a row-padded cache or Linear input
// holds more rows than it is read for), or exactly [rows, cols] when !padded. `op`, `arg` name it in
// errors, `of` the tensor the shape comes from ("dout [..]").
void check_covers_rows(const QuantizedView& q, const char* op, const char* arg, int64_t rows, int64_t cols,
                       const std::string& of, bool padded = true);

// x [R, C] f32 | bf16  ->  out [R, C] 1x128-scaled.
void quantize_1x128(const TensorView& x, const QuantizedView& out, ScaleMode mode = ScaleMode::fp32);
// w [R, C] f32 | bf16  ->  out [R, C] 128x128-scaled.
void quantize_128x128(const TensorView& w, const QuantizedView& out, ScaleMode mode = ScaleMode::fp32);
// x [T, C] f32 | bf16  ->  out [C, T] 1x128-scaled along T (x^T, grouped along tokens).
void quantize_128x1(const TensorView& x, const QuantizedView& out, ScaleMode mode = ScaleMode::fp32);
// Raises unless rows and cols fit quantize_1x128(x, rows) and quantize_128x1(x, cols) (the checks
// of both, before either writes): Backend::quantize_1x128_and_128x1's arguments.
void check_quantize_1x128_and_128x1(const TensorView& x, const QuantizedView& rows, const QuantizedView& cols);
// Per-tensor quantization (the coarse baseline the report improves on), written in either layout
// with every scale equal to the tensor's amax / max_finite, so the GEMMs consume it unchanged.
void quantize_per_tensor(const TensorView& x, const QuantizedView& out, ScaleMode mode = ScaleMode::fp32);
// in [T, C] 1x128-scaled  ->  out [C, T] 1x128-scaled along T: dequantize, transpose, requantize.
void requantize_128x1(const QuantizedView& in, const QuantizedView& out, ScaleMode mode = ScaleMode::fp32);
// in [G * R, C] 128x128-scaled (R, C multiples of 128)  ->  out [G * C, R]: each of the G stacked
// matrices transposed with its block scales. Bit-identical to quantize_128x128 of the transposed
// matrices (a block's scale depends only on its absolute maximum), at a byte transpose's cost: the
// Dgrad GEMM's W^T without a second quantization.
void transpose_128x128(const QuantizedView& in, const QuantizedView& out, int64_t groups = 1);
// Raises unless in and out fit transpose_128x128 (shapes, kinds, dtypes); `op` names the caller.
void check_transpose_128x128(const QuantizedView& in, const QuantizedView& out, int64_t groups, const char* op);
// in [R, C] any kind  ->  out [R, C] f32 | bf16, value = decode(q) * scale (FP32 product).
void dequantize(const QuantizedView& in, const TensorView& out);

// Element accessors for reference code: x as float, whatever its dtype (f32, bf16, f64).
float load_float(const TensorView& x, int64_t i);
void store_float(const TensorView& x, int64_t i, float v);
float decode_value(DType dtype, const void* data, int64_t i);

}  // namespace fp8moe
