// The paged MLA latent cache: per layer and token, the kv_lora_rank normalized latent c_kv (the
// input of kv_b_proj) and the qk_rope_head_dim rotated shared RoPE key, in blocks of 64 tokens; a
// sequence owns a list of blocks (its block table) handed out by the BlockAllocator, so sequences
// of any length share one pool without fragmentation (vLLM's PagedAttention layout, FlashMLA's
// cache contents).
//   f32   [slots, rkv + dr] f32 (exact: the tests' oracle)
//   bf16  [slots, rkv + dr] bf16
//   fp8   latent [slots, rkv] E4M3 with one f32 scale per token per 128 channels (1x128 tiles,
//         scales [slots, ceil(rkv/128)] token-major) and the RoPE key [slots, dr] BF16: the
//         positional part stays wider, as in DeepSeek's FP8 MLA cache, since a rounding there
//         is a rotation error that grows with the position.
// slots = blocks * 64; token p of a sequence lives in slot table[p / 64] * 64 + p % 64.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fp8moe/backend.hpp"

namespace fp8moe::serve {

constexpr int64_t kBlockTokens = 64;

enum class CacheDType : uint8_t { f32, bf16, fp8 };
CacheDType cache_dtype_from_name(const std::string& name);  // "f32" | "bf16" | "fp8"
std::string cache_dtype_name(CacheDType d);

// Free list of cache blocks, lowest index first (deterministic placement).
class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t blocks);
  int64_t total() const { return total_; }
  int64_t free_blocks() const { return int64_t(free_.size()); }
  int64_t used_blocks() const { return total_ - free_blocks(); }
  // n more blocks appended to `table`; false (nothing taken) when fewer than n are free.
  bool allocate(int64_t n, std::vector<int32_t>& table);
  void release(std::vector<int32_t>& table);  // returns all of table's blocks and clears it

 private:
  int64_t total_;
  std::vector<int32_t> free_;  // a stack, lowest index on top
};

inline int64_t blocks_for(int64_t tokens) { return (tokens + kBlockTokens - 1) / kBlockTokens; }

class LatentCache {
 public:
  LatentCache(Backend& be, int64_t layers, int64_t blocks, int64_t kv_lora_rank, int64_t rope_dim, CacheDType dtype);
  int64_t blocks() const { return blocks_; }
  // Every slot in [0, blocks() * kBlockTokens), or Error naming the first that is not (write's
  // check, for callers that replay a recorded write).
  void check_slots(const std::vector<int64_t>& slots) const;
  int64_t width() const { return rkv_ + dr_; }
  CacheDType dtype() const { return dtype_; }
  // Bytes one token takes over all layers (scales included).
  int64_t bytes_per_token() const;
  // Stores rows [T, rkv + dr] f32 (latent | rotated RoPE key) at slots[T] of `layer`. The second
  // form takes the two parts, latent [T, rkv] and RoPE key [T, dr] f32, as the fp8 cache stores
  // them; slot_index, where defined, holds the slots as [T] i32 on the backend (else uploaded).
  void write(int64_t layer, const TensorView& rows, const std::vector<int64_t>& slots);
  void write(int64_t layer, const TensorView& latent, const TensorView& rope, const std::vector<int64_t>& slots,
             const TensorView& slot_index);
  // The first `tokens` positions of a sequence of `layer` gathered block by block from its table:
  // [blocks_for(tokens) * 64, rkv + dr] f32 (rows past `tokens` are whatever the last block held).
  Tensor read(int64_t layer, const std::vector<int32_t>& table, int64_t tokens);
  // One layer as stored, for Backend::mla_decode_attention (views into this cache).
  MlaCacheView view(int64_t layer) const;
  // A sequence's blocks as they are stored (no conversion), for a handover to another cache of the
  // same shape and dtype (prefill/decode disaggregation): per layer its parts (f32, bf16: the
  // rows; fp8: latent, scales, RoPE key), each [table.size() * 64, width]. empty_export makes
  // buffers of those shapes for `blocks` blocks; import_blocks stores them into the first
  // blocks of `table`.
  std::vector<Tensor> export_blocks(const std::vector<int32_t>& table);
  std::vector<Tensor> empty_export(int64_t blocks);
  void import_blocks(const std::vector<int32_t>& table, const std::vector<Tensor>& parts);

 private:
  Backend& be_;
  int64_t layers_, blocks_, rkv_, dr_;
  CacheDType dtype_;
  struct Layer {
    Tensor rows;          // f32 | bf16: [slots, rkv + dr]
    Tensor latent, scale, rope;  // fp8: [slots, rkv] e4m3, [slots, ceil(rkv/128)] f32, [slots, dr] bf16
  };
  std::vector<Layer> layer_;
  std::vector<Tensor*> parts_of(Layer& L);
};

}  // namespace fp8moe::serve
