// The absorbed MLA decode attention over a paged latent cache (Backend::mla_decode_attention):
// the cache layout one layer of it is passed in, and the argument checks every backend runs.
//
// One layer of the cache, in blocks of kMlaBlockTokens slots (src/serve/latent_cache.hpp):
//   rows            [slots, rkv + dr] f32 | bf16: the latent, then the rotated RoPE key;
//   or the FP8 form latent [slots, rkv] e4m3, scale [slots, rkv / 128] f32 (one per token per 128
//                   channels: latent = e4m3 x scale), rope [slots, dr] bf16.
// Token p of sequence b lives in slot table[b, p / 64] * 64 + p % 64.
#pragma once
#include <cstdint>

#include "fp8moe/error.hpp"
#include "fp8moe/quantize.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe {

constexpr int64_t kMlaBlockTokens = 64;

// How a backend that splits a sequence's context over parallel workers (the GPU's flash-decoding
// CTAs) picks the splits. fit_batch: the count that fills the device for the whole call, so a
// sequence's splits, and the rounding of its merged output, depend on the other sequences.
// by_length: each sequence's splits from its own length alone (those it would get as the only
// sequence of a call), so its output is the same bits in any batch and beside any other rows of
// its own sequence (batch invariance: the verification of speculative drafts). The CPU op sums in
// FP64 per sequence and gives the same bits either way.
enum class MlaDecodeSplits { fit_batch, by_length };

struct MlaCacheView {
  TensorView rows;                // f32 | bf16 form
  TensorView latent, scale, rope; // fp8 form
  bool fp8() const { return latent.defined(); }
};

// The sizes of one call, from its checked arguments.
struct MlaDecodeShape {
  int64_t B = 0, H = 0, rkv = 0, dr = 0, slots = 0, max_blocks = 0;
  DType cache = DType::f32;  // f32, bf16, or e4m3 (the FP8 form)
};

// q [B * H, rkv + dr] f32, o [B * H, rkv] f32, table [B, max_blocks] i32, lengths [B] i32, all
// contiguous on `dev`; the cache in one of its two forms, slots a multiple of 64. The values of
// table and lengths stay on the device: an out-of-range block index or length is not an error
// there (it would need a host synchronization); the ops read no slot outside the cache and
// treat such tokens as absent.
inline MlaDecodeShape check_mla_decode(const TensorView& q, const MlaCacheView& c, const TensorView& table,
                                       const TensorView& lengths, const TensorView& o, Device dev) {
  const char* op = "mla_decode_attention";
  auto is = [&](const TensorView& t, DType d, int nd) {
    return t.defined() && t.device == dev && t.dtype == d && t.ndim == nd && t.is_contiguous();
  };
  FP8MOE_CHECK(is(lengths, DType::i32, 1), op << ": lengths must be [B] i32 on the op's device, got " << lengths.str());
  MlaDecodeShape s;
  s.B = lengths.size(0);
  FP8MOE_CHECK(is(table, DType::i32, 2) && table.size(0) == s.B,
               op << ": table must be [" << s.B << ", max_blocks] i32, got " << table.str());
  s.max_blocks = table.size(1);
  if (c.fp8()) {
    FP8MOE_CHECK(!c.rows.defined(), op << ": the cache has both rows and an fp8 latent");
    FP8MOE_CHECK(is(c.latent, DType::e4m3, 2), op << ": cache latent must be [slots, rkv] e4m3, got " << c.latent.str());
    s.slots = c.latent.size(0);
    s.rkv = c.latent.size(1);
    FP8MOE_CHECK(s.rkv % kQuantGroup == 0, op << ": the fp8 cache needs rkv % 128 == 0, got " << s.rkv);
    FP8MOE_CHECK(is(c.scale, DType::f32, 2) && c.scale.size(0) == s.slots && c.scale.size(1) == s.rkv / kQuantGroup,
                 op << ": cache scale must be [" << s.slots << ", " << s.rkv / kQuantGroup << "] f32, got "
                    << c.scale.str());
    FP8MOE_CHECK(is(c.rope, DType::bf16, 2) && c.rope.size(0) == s.slots,
                 op << ": cache rope must be [" << s.slots << ", dr] bf16, got " << c.rope.str());
    s.dr = c.rope.size(1);
    s.cache = DType::e4m3;
  } else {
    FP8MOE_CHECK(c.rows.defined() && (is(c.rows, DType::f32, 2) || is(c.rows, DType::bf16, 2)),
                 op << ": cache rows must be [slots, rkv + dr] f32 or bf16, got " << c.rows.str());
    s.slots = c.rows.size(0);
    s.cache = c.rows.dtype;
    s.rkv = o.ndim == 2 ? o.size(1) : 0;  // the rows do not say where the latent ends: o does
    s.dr = c.rows.size(1) - s.rkv;
  }
  FP8MOE_CHECK(s.slots % kMlaBlockTokens == 0, op << ": cache slots " << s.slots << " is not a multiple of 64");
  FP8MOE_CHECK(is(q, DType::f32, 2) && q.size(1) == s.rkv + s.dr,
               op << ": q must be [B * H, " << s.rkv + s.dr << "] f32, got " << q.str());
  FP8MOE_CHECK(s.B > 0 && q.size(0) % s.B == 0 && q.size(0) > 0,
               op << ": q's rows " << q.size(0) << " are not a positive multiple of B = " << s.B);
  s.H = q.size(0) / s.B;
  FP8MOE_CHECK(is(o, DType::f32, 2) && o.size(0) == s.B * s.H && o.size(1) == s.rkv,
               op << ": o must be [" << s.B * s.H << ", " << s.rkv << "] f32, got " << o.str());
  FP8MOE_CHECK(s.rkv > 0 && s.dr > 0, op << ": rkv " << s.rkv << " and dr " << s.dr << " must be > 0");
  return s;
}

}  // namespace fp8moe
