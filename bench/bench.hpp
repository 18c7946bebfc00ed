// Benchmarks of the CUDA kernels (`fp8moe bench gemm`, `quant`, `grouped` against cuBLASLt and the
// copy bandwidth, `fp8moe bench permute` for the MoE dispatch ops, `fp8moe bench attention` for
// the attention's two FP32 paths).
// Each prints one table row per case, measured side by side in one run (warm-up, L2 flushed
// before every timed launch, median of `iters`), and a geometric mean last. Plain C++ header: the
// app includes it without CUDA headers.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fp8moe::cuda {

struct GemmBenchOptions {
  int iters = 30;
  int warmup = 5;
  bool check = true;         // correctness columns (host FP64 reference on sampled rows)
  int check_rows = 16;       // rows of D compared against the FP64 reference
  std::string set = "all";   // all | fprop | wgrad | m4096 | small | tails | emulated
  std::string shapes;        // "kind:MxNxK,..." instead of the set (kinds: GemmCase)
  uint64_t seed = 0;         // 0: fresh random seed (printed)
  bool clocks = false;       // probe the SM clock around each timed launch (ours, cuBLASLt FP8)
  bool ceiling = false;      // time the Tensor Cores' ceiling for each shape beside it (bench_ceiling.cu)
};

// One problem of `bench gemm`.
struct GemmCase {
  // "fprop" (B 128x128, bf16 D) | "fprop32" (f32 D) | "fprop32+" (f32 D += ) | "wgrad" (B 1x128,
  // f32 D +=). The model's Linears run fprop32 and fprop32+ (Fprop, Dgrad) and wgrad.
  std::string kind;
  int64_t M, N, K;
  bool b_1x128() const { return kind == "wgrad"; }
  bool f32() const { return kind != "fprop"; }
  bool accumulate() const { return kind == "wgrad" || kind == "fprop32+"; }
};

// "kind:MxNxK,kind:MxNxK,..." (GemmBenchOptions::shapes); throws naming the bad item.
std::vector<GemmCase> parse_gemm_shapes(const std::string& list);

struct QuantBenchOptions {
  int iters = 30;
  int warmup = 5;
  int64_t tokens = 8192;
  int64_t channels = 7168;
};

// MoE dispatch at DeepSeek-V3 routing: T tokens, top-k of G experts, hidden size D.
struct PermuteBenchOptions {
  int iters = 30;
  int warmup = 5;
  int64_t tokens = 8192;
  int64_t topk = 8;
  int64_t experts = 256;
  int64_t hidden = 7168;
  int64_t align = 128;   // segment padding of the layout (the grouped GEMM's M tile)
  bool check = true;     // byte-exact comparison with the CPU backend
  uint64_t seed = 0;     // 0: fresh random seed (printed)
};

// The grouped FP8 GEMMs of the MoE experts (bench_grouped.cpp) against a loop of cuBLASLt GEMMs.
struct GroupedBenchOptions {
  int iters = 30;
  int warmup = 5;
  bool check = true;         // correctness columns (host FP64 reference on sampled rows)
  int check_rows = 16;       // rows of D compared against the FP64 references (over 4 groups)
  std::string set = "all";   // all | contiguous | masked | wgrad
  uint64_t seed = 0;         // 0: fresh random seed (printed)
  bool ceiling = false;      // time the Tensor Cores' ceiling for each case beside it (bench_ceiling.cu)
};

// Causal attention (bench_attention.cpp): B sequences of seq_len tokens, H heads of Dk / Dv.
struct AttentionBenchOptions {
  int iters = 20;
  int warmup = 3;
  int64_t batch = 8;
  int64_t seq_len = 512;
  int64_t heads = 16;
  int64_t dk = 192;
  int64_t dv = 128;
  std::string compute = "f32";  // f32 | bf16: the GEMM operands (cuda_attention_forward's compute)
  uint64_t seed = 0;     // 0: fresh random seed (printed)
};

// The FP8 GEMM at decode sizes (bench_small_m.cpp): M tokens x the (N, K) weight shapes.
// FP8MOE_SMALL_M_CONFIGS (read by the bench only): launches of the few-rows kernel to time beside
// the chosen one, comma-separated, each "s4/r2/c2/p6" with any fields left out (chosen):
// k_split, row_warps, ctas_per_sm, stages (SmallMConfig).
struct SmallMBenchOptions {
  int iters = 30;
  int warmup = 5;
  std::vector<int64_t> rows{1, 2, 4, 8, 16, 32, 64};
  // DeepSeek-V3's Linears at decode: kv_a+q_a fused (2112 x 7168), q_a (1536 x 7168), kv_a (576 x
  // 7168), q_b (24576 x 1536), kv_b (32768 x 512), o (7168 x 16384), an expert's gate and up (2048
  // x 7168, fused 4096 x 7168) and down (7168 x 2048); configs/gemm.json's as the serving engine
  // runs them: q_a (1536 x 4096), kv_a (576 x 4096), q_b (6144 x 1536), o (4096 x 4096), the dense
  // MLP's gate or up (16384 x 4096) and down (4096 x 16384), the shared expert's gate or up (2048 x
  // 4096) and down (4096 x 2048).
  std::vector<std::pair<int64_t, int64_t>> shapes{
      {2112, 7168}, {1536, 7168}, {576, 7168},   {24576, 1536}, {32768, 512}, {7168, 16384},
      {2048, 7168}, {4096, 7168}, {7168, 2048},  {1536, 4096},  {576, 4096},  {6144, 1536},
      {4096, 4096}, {16384, 4096}, {4096, 16384}, {2048, 4096},  {4096, 2048}};
};

// The MLA decode attention over the paged latent cache (bench_mla_decode.cpp): every batch size x
// context length, for each cache form.
struct MlaDecodeBenchOptions {
  int iters = 20;
  int warmup = 3;
  int64_t heads = 128, rkv = 512, dr = 64;  // DeepSeek-V3
  std::vector<int64_t> batch{1, 8, 32, 64, 128};
  std::vector<int64_t> context{4096, 8192, 16384, 32768};
  std::vector<std::string> caches{"bf16", "fp8"};
  bool by_length = false;  // MlaDecodeSplits::by_length (batch-invariant splits) instead of fit_batch
  std::vector<int64_t> splits{0};  // split counts per case (fit_batch); 0: the plan's own
  bool check = true;   // each cache form's first case (and every forced split count) against the CUDA-core path
  uint64_t seed = 0;   // 0: fresh random seed (printed)
};

// The expert-parallel kernels (bench_ep.cpp): P ranks as P buffers on one GPU.
struct EpBenchOptions {
  int iters = 20;
  int warmup = 3;
  std::string ranks = "2,4,8";  // rank counts, one table block each
  int64_t tokens = 4096;        // per rank
  int64_t topk = 8;
  int64_t experts = 256;
  int64_t hidden = 7168;
  int num_sms = 20;             // per rank
  bool check = true;            // bit-exact comparison with the host reference
  bool gemm = false;            // an FP8 GEMM's slowdown beside the kernels
  bool pull = false;            // the combine's sources read the rows (EpConfig::pull_combine)
  bool low_latency = false;     // the low-latency mode (EpConfig::low_latency)
  int ranks_per_node = 0;       // below a rank count: the two-hop dispatch over nodes of this many ranks
  uint64_t seed = 0;            // 0: fresh random seed (printed)
};

// The two-micro-batch overlap of decode and prefill MoE layer steps (bench_tbo.cpp,
// src/serve/two_batch.hpp, src/serve/two_batch_prefill.hpp).
struct TboBenchOptions {
  int iters = 10;
  int warmup = 2;
  std::string phases = "decode,prefill";
  std::string ranks = "2,4";      // rank counts, one row each
  std::string shapes = "v3,small";  // v3: DeepSeek-V3's layer; small: a smaller one
  int64_t tokens = 0;             // per rank (two micro-batches of half); 0: the shape's
  int64_t context = 0;            // decode: cached tokens per sequence; 0: the shape's
  int64_t seq_len = 0;            // prefill: tokens per sequence; 0: the shape's
  int layers = 4;                 // layer steps per timed run
  int num_sms = 24;               // blocks per communication kernel per rank
  uint64_t seed = 1;
};

// Return 0 when every correctness check passed (calc_diff < 1e-3 and no NaN; bit-exact for the
// quantizers and the dispatch ops), 1 otherwise.
int run_gemm_bench(const GemmBenchOptions& opt);
int run_quant_bench(const QuantBenchOptions& opt);
int run_grouped_bench(const GroupedBenchOptions& opt);
int run_permute_bench(const PermuteBenchOptions& opt);
// 0 when the GEMM path's outputs agree with the flash kernels' (bench_attention.cpp).
int run_attention_bench(const AttentionBenchOptions& opt);
// 0 when the few-rows kernel agrees with the WGMMA kernel (rel error < 1e-3) on every case.
int run_small_m_bench(const SmallMBenchOptions& opt);
// 0 when the kernels' results are the host reference's, byte for byte.
int run_ep_bench(const EpBenchOptions& opt);
// 0 when the overlapped steps' results are the sequential steps', bit for bit.
int run_tbo_bench(const TboBenchOptions& opt);
// 0 when the tensor-core path agrees with the CUDA-core path (rel error < 1e-2).
int run_mla_decode_bench(const MlaDecodeBenchOptions& opt);

}  // namespace fp8moe::cuda
