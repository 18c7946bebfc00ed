// The absorbed MLA decode attention over the paged latent cache on the GPU (mla_decode.cu), the
// CUDA backend's Backend::mla_decode_attention (contract: include/fp8moe/mla_decode.hpp).
// Flash-decoding: each sequence's context is split over CTAs (split-KV), each CTA reads its cache
// rows once for a tile of heads, and a second kernel merges the splits' partial outputs by their
// log-sum-exp in a fixed order (deterministic). Two paths:
//   tensor_core  bf16 and fp8 caches, (rkv, dr) in {(512, 64), (256, 32), (128, 32)}: q, the
//                rows and the probabilities as operands of mma.sync m16n8k16 with FP32
//                accumulation, up to 64 heads per CTA: BF16 for a bf16 cache, FP16 for an fp8 one
//                (the e4m3 codes widened in registers from the tile as stored; the K scales
//                applied to FP32 partial scores per 128 dims, the V codes scaled in FP16; q, the
//                RoPE keys and the scaled V values must stay within FP16's range, 65504);
//   cuda_core    every cache dtype and shape (rkv + dr <= 1024), FP32 throughout: the f32 cache
//                (the exact oracle the serve tests compare the absorbed form with) and the rest.
#pragma once
#include <cuda_runtime.h>

#include "fp8moe/mla_decode.hpp"

namespace fp8moe::cuda {

enum class MlaDecodePath { automatic, tensor_core, cuda_core };

// The launch a call takes: its path, the number of context splits per sequence (the grid's) and
// the cache blocks each covers, and the head tiles (CTAs per split and sequence). With
// MlaDecodeSplits::by_length, blocks_per_split is 0 and each CTA derives its sequence's split
// size on the device from the sequence's length and length_target (the split count a sequence
// alone in a call gets, before the cap by its blocks); `splits` is then the most any sequence of
// the table can have, and the splits a sequence does not use are empty.
struct MlaDecodePlan {
  MlaDecodePath path = MlaDecodePath::cuda_core;
  int64_t splits = 1, blocks_per_split = 1, head_tiles = 1, heads_per_cta = 1;
  int64_t length_target = 0;
};
// `splits` > 0 forces that many splits (capped by the table's blocks; fit_batch only), for the tests.
MlaDecodePlan mla_decode_plan(const MlaDecodeShape& s, const TensorView& q, const MlaCacheView& cache, MlaDecodePath path,
                              int64_t splits, MlaDecodeSplits rule = MlaDecodeSplits::fit_batch);

void mla_decode_attention_cuda(const TensorView& q, const MlaCacheView& cache, const TensorView& table,
                               const TensorView& lengths, double scale, const TensorView& o, cudaStream_t stream,
                               MlaDecodePath path = MlaDecodePath::automatic, int64_t splits = 0,
                               MlaDecodeSplits rule = MlaDecodeSplits::fit_batch);

}  // namespace fp8moe::cuda
