// `fp8moe bench gemm`, `quant`, `grouped`, `permute`, `attention`, `ep` and `tbo`: our CUDA kernels against
// cuBLASLt and the copy bandwidth, and the attention's two paths, side by side (bench/bench.hpp).
// Example:  fp8moe bench gemm --iters 30 --set m4096
#include <memory>

#include "commands.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/error.hpp"
#ifdef FP8MOE_HAVE_CUDA
#include "bench/bench.hpp"
#include "cuda/cuda_backend.hpp"
#include "cuda/ep/ep_api.hpp"
#endif

namespace fp8moe::cli {
void add_bench_decode(CLI::App& bench);  // cmd_bench_decode.cpp
}  // namespace fp8moe::cli

namespace {

#ifdef FP8MOE_HAVE_CUDA
void require_gpu() {
  FP8MOE_CHECK(fp8moe::cuda_device_available(), "bench: no usable CUDA device");
}
#endif

void add_bench(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "Benchmark the CUDA kernels against cuBLASLt");
  bench->require_subcommand(1);
  fp8moe::cli::add_bench_decode(*bench);
#ifdef FP8MOE_HAVE_CUDA
  auto g = std::make_shared<fp8moe::cuda::GemmBenchOptions>();
  auto* gemm = bench->add_subcommand("gemm", "FP8 block-scaled GEMM: ours vs cuBLASLt FP8 and BF16");
  gemm->add_option("--iters", g->iters, "timed runs per case (median)");
  gemm->add_option("--warmup", g->warmup, "untimed runs per case");
  gemm->add_option("--set", g->set, "all | fprop | wgrad | m4096 | small | tails | emulated (the Tensor Core accumulation emulation)");
  gemm->add_option("--shapes", g->shapes,
                   "kind:MxNxK,... instead of --set; kind: fprop (bf16 D), fprop32 (f32 D), fprop32+ (f32 D += ), "
                   "wgrad (B 1x128, f32 D += ); e.g. fprop32:8192x4096x2048");
  gemm->add_option("--check-rows", g->check_rows, "rows of D checked against the FP64 reference");
  auto no_check = std::make_shared<bool>(false);
  gemm->add_flag("--no-check", *no_check, "skip the correctness columns");
  gemm->add_option("--seed", g->seed, "random seed (0: fresh)");
  gemm->add_flag("--clocks", g->clocks,
                 "probe the SM clock around each timed launch of ours and cuBLASLt FP8, and print their ratio per "
                 "clock cycle (under the power cap each kernel sets its own clock)");
  gemm->add_flag("--ceiling", g->ceiling,
                 "time beside each shape its FLOPs as bare FP8 WGMMAs on operands in shared memory (and with our tile's "
                 "promotion): the Tensor Cores' ceiling at the clock the power cap allows");
  gemm->callback([g, no_check] {
    require_gpu();
    g->check = !*no_check;
    if (fp8moe::cuda::run_gemm_bench(*g) != 0) throw CLI::RuntimeError("bench gemm: correctness check failed", 2);
  });
  auto q = std::make_shared<fp8moe::cuda::QuantBenchOptions>();
  auto* quant = bench->add_subcommand("quant", "Quantization kernels: GB/s against the device copy bandwidth");
  quant->add_option("--iters", q->iters, "timed runs per case (median)");
  quant->add_option("--tokens", q->tokens, "rows T of x [T, C]");
  quant->add_option("--channels", q->channels, "columns C of x [T, C]");
  quant->callback([q] {
    require_gpu();
    if (fp8moe::cuda::run_quant_bench(*q) != 0) throw CLI::RuntimeError("bench quant: bit-exactness check failed", 2);
  });
  auto gr = std::make_shared<fp8moe::cuda::GroupedBenchOptions>();
  auto* grouped = bench->add_subcommand("grouped", "Grouped FP8 GEMMs of the MoE experts: ours vs a cuBLASLt loop");
  grouped->add_option("--iters", gr->iters, "timed runs per case (median)");
  grouped->add_option("--warmup", gr->warmup, "untimed runs per case");
  grouped->add_option("--set", gr->set, "all | contiguous | masked | wgrad | decode (masked, 8 or 32 experts of 32..128 tokens; not in all)");
  grouped->add_option("--check-rows", gr->check_rows, "rows of D checked against the FP64 reference");
  auto grouped_no_check = std::make_shared<bool>(false);
  grouped->add_flag("--no-check", *grouped_no_check, "skip the correctness columns");
  grouped->add_option("--seed", gr->seed, "random seed (0: fresh)");
  grouped->add_flag("--ceiling", gr->ceiling,
                    "time beside each case its FLOPs as bare FP8 WGMMAs on operands in shared memory (and with our "
                    "tile's promotion): the Tensor Cores' ceiling at the clock the power cap allows");
  grouped->callback([gr, grouped_no_check] {
    require_gpu();
    gr->check = !*grouped_no_check;
    if (fp8moe::cuda::run_grouped_bench(*gr) != 0) throw CLI::RuntimeError("bench grouped: correctness check failed", 2);
  });
  auto p = std::make_shared<fp8moe::cuda::PermuteBenchOptions>();
  auto* permute = bench->add_subcommand("permute", "MoE dispatch ops (layout, permute, permute + quantize, combine): "
                                                   "GB/s against the device copy bandwidth");
  permute->add_option("--iters", p->iters, "timed runs per op (median)");
  permute->add_option("--tokens", p->tokens, "tokens T");
  permute->add_option("--topk", p->topk, "experts per token k");
  permute->add_option("--experts", p->experts, "routed experts G");
  permute->add_option("--hidden", p->hidden, "hidden size D (a multiple of 128)");
  permute->add_option("--align", p->align, "segment padding of the layout");
  permute->add_option("--seed", p->seed, "random seed (0: fresh)");
  auto permute_no_check = std::make_shared<bool>(false);
  permute->add_flag("--no-check", *permute_no_check, "skip the comparison with the CPU backend");
  permute->callback([p, permute_no_check] {
    require_gpu();
    p->check = !*permute_no_check;
    if (fp8moe::cuda::run_permute_bench(*p) != 0)
      throw CLI::RuntimeError("bench permute: bit-exactness check failed", 2);
  });
  auto at = std::make_shared<fp8moe::cuda::AttentionBenchOptions>();
  auto* attention = bench->add_subcommand("attention", "Causal attention: the cuBLASLt GEMM path vs the "
                                                       "FlashAttention-style kernels, forward and backward");
  attention->add_option("--iters", at->iters, "timed runs per case (median)");
  attention->add_option("--warmup", at->warmup, "untimed runs per case");
  attention->add_option("--batch", at->batch, "sequences B");
  attention->add_option("--seq-len", at->seq_len, "tokens per sequence");
  attention->add_option("--heads", at->heads, "heads H");
  attention->add_option("--dk", at->dk, "query/key head dim");
  attention->add_option("--dv", at->dv, "value head dim");
  attention->add_option("--compute", at->compute, "GEMM operands: f32, or bf16 (FP32 accumulation)")
      ->check(CLI::IsMember({"f32", "bf16"}));
  attention->add_option("--seed", at->seed, "random seed (0: fresh)");
  attention->callback([at] {
    require_gpu();
    if (fp8moe::cuda::run_attention_bench(*at) != 0)
      throw CLI::RuntimeError("bench attention: the two paths disagree", 2);
  });
  auto sm = std::make_shared<fp8moe::cuda::SmallMBenchOptions>();
  auto* small_m = bench->add_subcommand("small-m", "FP8 GEMM at decode sizes (M = 1..64): B's bytes per second "
                                                   "against the copy bandwidth, beside the WGMMA kernel and cuBLASLt");
  small_m->add_option("--iters", sm->iters, "timed runs per case (median)");
  small_m->add_option("--warmup", sm->warmup, "untimed runs per case");
  small_m->add_option("--m", sm->rows, "token counts M, 1..64")->delimiter(',');
  small_m->callback([sm] {
    require_gpu();
    if (fp8moe::cuda::run_small_m_bench(*sm) != 0)
      throw CLI::RuntimeError("bench small-m: the few-rows kernel disagrees with the WGMMA kernel", 2);
  });
  auto md = std::make_shared<fp8moe::cuda::MlaDecodeBenchOptions>();
  auto* mla = bench->add_subcommand("mla-decode", "MLA decode attention over the paged latent cache: cache bytes per "
                                                  "second against the copy bandwidth, and TFLOP/s");
  mla->add_option("--iters", md->iters, "timed runs per case (median)");
  mla->add_option("--warmup", md->warmup, "untimed runs per case");
  mla->add_option("--heads", md->heads, "heads H");
  mla->add_option("--rkv", md->rkv, "kv_lora_rank (a multiple of 128)");
  mla->add_option("--dr", md->dr, "qk_rope_head_dim");
  mla->add_option("--batch", md->batch, "sequences B, e.g. 1,32,128")->delimiter(',');
  mla->add_option("--context", md->context, "tokens per sequence, e.g. 4096,32768")->delimiter(',');
  mla->add_option("--cache", md->caches, "cache forms: bf16, fp8")->delimiter(',');
  mla->add_option("--seed", md->seed, "random seed (0: fresh)");
  mla->add_flag("--by-length", md->by_length,
                "split each sequence by its own length (batch invariance, speculative decoding) instead of by the batch");
  mla->add_option("--splits", md->splits, "split counts to sweep, e.g. 0,4,8 (0: the plan's own choice)")
      ->delimiter(',');
  auto md_no_check = std::make_shared<bool>(false);
  mla->add_flag("--no-check", *md_no_check, "skip the comparison with the CUDA-core path");
  mla->callback([md, md_no_check] {
    require_gpu();
    md->check = !*md_no_check;
    if (fp8moe::cuda::run_mla_decode_bench(*md) != 0)
      throw CLI::RuntimeError("bench mla-decode: the tensor-core path disagrees with the CUDA-core path", 2);
  });
  auto ep = std::make_shared<fp8moe::cuda::EpBenchOptions>();
  auto* epc = bench->add_subcommand("ep", "Expert-parallel dispatch and combine over peer memory, P ranks on this GPU "
                                          "(or, under mpirun, a process per rank): GB/s of the bytes that leave a "
                                          "rank against the device copy bandwidth (and the all-to-all, the peer copy)");
  epc->add_option("--iters", ep->iters, "timed runs per step (median)");
  epc->add_option("--warmup", ep->warmup, "untimed runs per step");
  epc->add_option("--ranks", ep->ranks, "rank counts, e.g. 2,4,8");
  epc->add_option("--tokens", ep->tokens, "tokens per rank T");
  epc->add_option("--topk", ep->topk, "experts per token k");
  epc->add_option("--experts", ep->experts, "routed experts E");
  epc->add_option("--hidden", ep->hidden, "hidden size D (a multiple of 128)");
  epc->add_option("--num-sms", ep->num_sms, "SMs per rank (even; channels = num_sms / 2)");
  epc->add_option("--seed", ep->seed, "random seed (0: fresh)");
  auto ep_no_check = std::make_shared<bool>(false);
  epc->add_flag("--no-check", *ep_no_check, "skip the comparison with the host reference");
  epc->add_flag("--gemm", ep->gemm, "time an FP8 GEMM alone and beside the kernels");
  epc->add_option("--ranks-per-node", ep->ranks_per_node,
                  "ranks per (virtual) node: below the rank count, the dispatch goes in two hops and the bytes "
                  "crossing nodes are printed beside the single-hop layout's");
  epc->add_flag("--pull", ep->pull, "combine by the sources' reads of the expert ranks' rows (one pass over them)");
  epc->add_flag("--low-latency", ep->low_latency,
                "the low-latency mode (decode): no notify, no host read, CUDA-graph capturable; 128 tokens per rank "
                "unless --tokens");
  epc->callback([ep, ep_no_check, epc] {
    // Under mpirun a process per rank, on the GPU of its local rank (before any CUDA call).
    const fp8moe::LaunchInfo launch = fp8moe::launch_info();
    if (launch.under_mpirun && launch.size > 1) {
      FP8MOE_CHECK(epc->count("--ranks") == 0, "bench ep under mpirun: the ranks are the " << launch.size
                                                   << " processes; --ranks counts ranks as buffers on one GPU, "
                                                      "without mpirun");
      fp8moe::select_local_gpu(launch);
    }
    fp8moe::cuda::ep::prepare_local_ranks();  // before require_gpu's first CUDA call
    require_gpu();
    ep->check = !*ep_no_check;
    if (ep->low_latency && epc->count("--tokens") == 0) ep->tokens = 128;
    if (fp8moe::cuda::run_ep_bench(*ep) != 0) throw CLI::RuntimeError("bench ep: bit-exactness check failed", 2);
  });
  auto tbo = std::make_shared<fp8moe::cuda::TboBenchOptions>();
  auto* tboc = bench->add_subcommand("tbo", "Two-micro-batch overlap of decode and prefill MoE layer steps, P expert-parallel ranks "
                                            "on this GPU: step time overlapped, sequential, compute and communication alone");
  tboc->add_option("--iters", tbo->iters, "timed runs per mode (median)");
  tboc->add_option("--warmup", tbo->warmup, "untimed runs per mode");
  tboc->add_option("--phases", tbo->phases, "decode, prefill or both, e.g. decode,prefill");
  tboc->add_option("--ranks", tbo->ranks, "rank counts, e.g. 2,4");
  tboc->add_option("--shapes", tbo->shapes, "layer shapes: v3 (DeepSeek-V3), small, or both, e.g. v3,small");
  tboc->add_option("--tokens", tbo->tokens, "tokens per rank, split into two micro-batches (0: the shape's)");
  tboc->add_option("--context", tbo->context, "decode: cached tokens per sequence, a multiple of 64 (0: the shape's)");
  tboc->add_option("--seq-len", tbo->seq_len, "prefill: tokens per sequence (0: the shape's)");
  tboc->add_option("--layers", tbo->layers, "layer steps per timed run");
  tboc->add_option("--num-sms", tbo->num_sms, "blocks per communication kernel per rank (even)");
  tboc->add_option("--seed", tbo->seed, "seed of the weights, cache, inputs and routing");
  tboc->callback([tbo] {
    fp8moe::cuda::ep::prepare_local_ranks();
    require_gpu();
    if (fp8moe::cuda::run_tbo_bench(*tbo) != 0)
      throw CLI::RuntimeError("bench tbo: overlapped and sequential results differ", 2);
  });
#else
  for (const char* name : {"gemm", "quant", "grouped", "permute", "attention", "small-m", "mla-decode", "ep", "tbo"})
    bench->add_subcommand(name, "needs the CUDA backend")->callback([] {
      throw fp8moe::Error("bench: this build has no CUDA backend");
    });
#endif
}

const bool registered = fp8moe::cli::register_command(&add_bench);

}  // namespace
