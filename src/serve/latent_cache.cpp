// The paged latent cache (latent_cache.hpp): a step's rows scattered to their slots by one
// Backend::scatter_rows per stored part; a sequence's blocks read and handed over by copies.
#include "serve/latent_cache.hpp"

#include <algorithm>

#include "fp8moe/error.hpp"
#include "serve/views.hpp"

namespace fp8moe::serve {

CacheDType cache_dtype_from_name(const std::string& name) {
  if (name == "f32") return CacheDType::f32;
  if (name == "bf16") return CacheDType::bf16;
  if (name == "fp8") return CacheDType::fp8;
  FP8MOE_CHECK(false, "cache dtype: unknown '" << name << "' (expected f32, bf16 or fp8)");
}

std::string cache_dtype_name(CacheDType d) {
  return d == CacheDType::f32 ? "f32" : d == CacheDType::bf16 ? "bf16" : "fp8";
}

BlockAllocator::BlockAllocator(int64_t blocks) : total_(blocks) {
  FP8MOE_CHECK(blocks > 0, "BlockAllocator: blocks must be > 0, got " << blocks);
  for (int64_t b = blocks; b-- > 0;) free_.push_back(int32_t(b));
}

bool BlockAllocator::allocate(int64_t n, std::vector<int32_t>& table) {
  if (n > free_blocks()) return false;
  for (int64_t i = 0; i < n; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  return true;
}

void BlockAllocator::release(std::vector<int32_t>& table) {
  for (int32_t b : table) free_.push_back(b);
  // Lowest index on top again, so placement does not depend on the order of releases.
  std::sort(free_.begin(), free_.end(), std::greater<>());
  table.clear();
}

LatentCache::LatentCache(Backend& be, int64_t layers, int64_t blocks, int64_t kv_lora_rank, int64_t rope_dim,
                         CacheDType dtype)
    : be_(be), layers_(layers), blocks_(blocks), rkv_(kv_lora_rank), dr_(rope_dim), dtype_(dtype) {
  FP8MOE_CHECK(blocks > 0, "LatentCache: blocks must be > 0, got " << blocks);
  FP8MOE_CHECK(dtype != CacheDType::fp8 || kv_lora_rank % kQuantGroup == 0,
               "LatentCache: the fp8 cache needs kv_lora_rank % 128 == 0, got " << kv_lora_rank);
  const int64_t slots = blocks * kBlockTokens;
  // Zero-filled: the rows past a sequence's end in its last block are read (never used), and must
  // be finite for the dequantization.
  for (int64_t l = 0; l < layers; ++l) {
    Layer L;
    if (dtype == CacheDType::fp8) {
      L.latent = be.zeros(DType::e4m3, {slots, rkv_});
      L.scale = be.zeros(DType::f32, {slots, rkv_ / kQuantGroup});
      L.rope = be.zeros(DType::bf16, {slots, dr_});
    } else {
      L.rows = be.zeros(dtype == CacheDType::f32 ? DType::f32 : DType::bf16, {slots, rkv_ + dr_});
    }
    layer_.push_back(std::move(L));
  }
}

int64_t LatentCache::bytes_per_token() const {
  const int64_t per_layer = dtype_ == CacheDType::fp8 ? rkv_ + 4 * (rkv_ / kQuantGroup) + 2 * dr_
                                                      : (rkv_ + dr_) * (dtype_ == CacheDType::f32 ? 4 : 2);
  return per_layer * layers_;
}

void LatentCache::check_slots(const std::vector<int64_t>& slots) const {
  for (int64_t s : slots)
    FP8MOE_CHECK(s >= 0 && s < blocks_ * kBlockTokens, "LatentCache::write: slot " << s << " outside the cache");
}

void LatentCache::write(int64_t layer, const TensorView& src, const std::vector<int64_t>& slots) {
  const int64_t T = src.size(0);
  FP8MOE_CHECK(src.ndim == 2 && src.dtype == DType::f32 && src.size(1) == rkv_ + dr_,
               "LatentCache::write: rows must be [T, " << rkv_ + dr_ << "] f32, got " << src.str());
  Tensor lat = be_.empty(DType::f32, {T, rkv_}), rope = be_.empty(DType::f32, {T, dr_});
  be_.copy_cols(src, 0, lat.view(), 0, rkv_, false);
  be_.copy_cols(src, rkv_, rope.view(), 0, dr_, false);
  write(layer, lat.view(), rope.view(), slots, TensorView());
}

void LatentCache::write(int64_t layer, const TensorView& latent, const TensorView& rope,
                        const std::vector<int64_t>& slots, const TensorView& slot_index) {
  const int64_t T = latent.size(0);
  FP8MOE_CHECK(latent.ndim == 2 && latent.dtype == DType::f32 && latent.size(1) == rkv_ && rope.ndim == 2 &&
                   rope.dtype == DType::f32 && rope.size(0) == T && rope.size(1) == dr_,
               "LatentCache::write: latent and RoPE key must be [T, " << rkv_ << "] and [T, " << dr_ << "] f32, got "
                                                                      << latent.str() << " and " << rope.str());
  FP8MOE_CHECK(int64_t(slots.size()) == T, "LatentCache::write: " << slots.size() << " slots for " << T << " rows");
  check_slots(slots);
  if (T == 0) return;
  Tensor uploaded;
  TensorView idx = slot_index;
  if (!idx.defined()) {
    Tensor h = Tensor::host(DType::i32, {T});
    std::copy(slots.begin(), slots.end(), h.ptr<int32_t>());
    uploaded = be_.empty(DType::i32, {T});
    be_.copy(uploaded.view(), h.view());
    idx = uploaded.view();
  }
  FP8MOE_CHECK(idx.dtype == DType::i32 && idx.ndim == 1 && idx.size(0) == T,
               "LatentCache::write: slot_index must be [" << T << "] i32, got " << idx.str());
  Layer& L = layer_[size_t(layer)];
  if (dtype_ != CacheDType::fp8) {  // rows [T, rkv + dr]
    Tensor r = be_.empty(DType::f32, {T, rkv_ + dr_});
    be_.copy_cols(latent, 0, r.view(), 0, rkv_, false);
    be_.copy_cols(rope, 0, r.view(), rkv_, dr_, false);
    if (dtype_ == CacheDType::bf16) {
      Tensor b = be_.empty(DType::bf16, {T, rkv_ + dr_});
      be_.convert(r.view(), b.view());
      r = b;
    }
    be_.scatter_rows(r.view(), idx, L.rows.view());
    return;
  }
  const int64_t G = rkv_ / kQuantGroup;
  QuantizedTensor q = be_.empty_quantized(T, rkv_, DType::e4m3, ScaleKind::tile_1x128);  // scales [G, ld(T)]
  be_.quantize_1x128(latent, q, ScaleMode::fp32);
  Tensor st = be_.empty(DType::f32, {scale_ld(T), G});  // [ld(T), G]: token-major as the cache keeps them
  be_.transpose(q.scales.view(), st.view());
  Tensor rope_b = be_.empty(DType::bf16, {T, dr_});
  be_.convert(rope, rope_b.view());
  be_.scatter_rows(q.values.view(), idx, L.latent.view());
  be_.scatter_rows(rows(st.view(), 0, T), idx, L.scale.view());
  be_.scatter_rows(rope_b.view(), idx, L.rope.view());
}

Tensor LatentCache::read(int64_t layer, const std::vector<int32_t>& table, int64_t tokens) {
  const int64_t nb = blocks_for(tokens), R = nb * kBlockTokens, W = rkv_ + dr_;
  FP8MOE_CHECK(nb <= int64_t(table.size()), "LatentCache::read: " << tokens << " tokens need " << nb
                                                                  << " blocks, the table has " << table.size());
  Layer& L = layer_[size_t(layer)];
  const auto gather = [&](const Tensor& from, const Tensor& to) {
    for (int64_t j = 0; j < nb; ++j)
      be_.copy(rows(to.view(), j * kBlockTokens, kBlockTokens),
               rows(from.view(), int64_t(table[size_t(j)]) * kBlockTokens, kBlockTokens));
  };
  Tensor out = be_.empty(DType::f32, {R, W});  // [R, rkv + dr] f32
  if (dtype_ == CacheDType::f32) {
    gather(L.rows, out);
    return out;
  }
  if (dtype_ == CacheDType::bf16) {
    Tensor b = be_.empty(DType::bf16, {R, W});
    gather(L.rows, b);
    be_.convert(b.view(), out.view());
    return out;
  }
  const int64_t G = rkv_ / kQuantGroup;
  QuantizedTensor q = be_.empty_quantized(R, rkv_, DType::e4m3, ScaleKind::tile_1x128);  // scales [G, R]
  Tensor st = be_.empty(DType::f32, {R, G}), rope_b = be_.empty(DType::bf16, {R, dr_});
  gather(L.latent, q.values);
  gather(L.scale, st);
  gather(L.rope, rope_b);
  be_.transpose(st.view(), q.scales.view());  // R is a multiple of 64: scale_ld(R) == R
  Tensor lat = be_.empty(DType::f32, {R, rkv_}), rope = be_.empty(DType::f32, {R, dr_});
  be_.dequantize(q, lat.view());
  be_.convert(rope_b.view(), rope.view());
  be_.copy_cols(lat.view(), 0, out.view(), 0, rkv_, false);
  be_.copy_cols(rope.view(), 0, out.view(), rkv_, dr_, false);
  return out;
}

MlaCacheView LatentCache::view(int64_t layer) const {
  FP8MOE_CHECK(layer >= 0 && layer < layers_, "LatentCache::view: layer " << layer << " of " << layers_);
  const Layer& L = layer_[size_t(layer)];
  MlaCacheView v;
  if (dtype_ == CacheDType::fp8) {
    v.latent = L.latent.view();
    v.scale = L.scale.view();
    v.rope = L.rope.view();
  } else {
    v.rows = L.rows.view();
  }
  return v;
}

std::vector<Tensor*> LatentCache::parts_of(Layer& L) {
  if (dtype_ == CacheDType::fp8) return {&L.latent, &L.scale, &L.rope};
  return {&L.rows};
}

std::vector<Tensor> LatentCache::export_blocks(const std::vector<int32_t>& table) {
  std::vector<Tensor> out = empty_export(int64_t(table.size()));
  size_t i = 0;
  for (Layer& L : layer_)
    for (Tensor* part : parts_of(L)) {
      for (size_t j = 0; j < table.size(); ++j)
        be_.copy(rows(out[i].view(), int64_t(j) * kBlockTokens, kBlockTokens),
                 rows(part->view(), int64_t(table[j]) * kBlockTokens, kBlockTokens));
      ++i;
    }
  return out;
}

std::vector<Tensor> LatentCache::empty_export(int64_t blocks) {
  std::vector<Tensor> out;
  for (Layer& L : layer_)
    for (Tensor* part : parts_of(L)) out.push_back(be_.empty(part->dtype(), {blocks * kBlockTokens, part->size(1)}));
  return out;
}

void LatentCache::import_blocks(const std::vector<int32_t>& table, const std::vector<Tensor>& parts) {
  FP8MOE_CHECK(!parts.empty() && parts[0].view().ndim == 2, "LatentCache::import_blocks: no parts");
  const int64_t nb = parts[0].size(0) / kBlockTokens;
  FP8MOE_CHECK(int64_t(table.size()) >= nb, "LatentCache::import_blocks: " << nb << " blocks for a table of "
                                                                            << table.size());
  const std::vector<Tensor> want = empty_export(nb);
  FP8MOE_CHECK(parts.size() == want.size(), "LatentCache::import_blocks: " << parts.size() << " parts, this cache has "
                                                                           << want.size());
  for (size_t i = 0; i < parts.size(); ++i)
    FP8MOE_CHECK(parts[i].dtype() == want[i].dtype() && parts[i].view().ndim == 2 && parts[i].size(0) == want[i].size(0) &&
                     parts[i].size(1) == want[i].size(1),
                 "LatentCache::import_blocks: part " << i << " is " << parts[i].view().str() << ", expected "
                                                     << want[i].view().str());
  size_t i = 0;
  for (Layer& L : layer_)
    for (Tensor* part : parts_of(L)) {
      for (int64_t j = 0; j < nb; ++j)
        be_.copy(rows(part->view(), int64_t(table[size_t(j)]) * kBlockTokens, kBlockTokens),
                 rows(parts[i].view(), j * kBlockTokens, kBlockTokens));
      ++i;
    }
}

}  // namespace fp8moe::serve
