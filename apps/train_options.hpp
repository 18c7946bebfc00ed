// Command-line options shared by `fp8moe train` and `fp8moe compare`.
#pragma once
#include <CLI/CLI.hpp>

#include "fp8moe/trainer.hpp"

namespace fp8moe::cli {

inline void add_train_options(CLI::App* cmd, TrainOptions& o) {
  cmd->add_option("-c,--config", o.model_config,
                  "model config: a JSON file, or the name of a shipped one (tiny, small, medium, wide, gemm, 1b)")
      ->capture_default_str();
  cmd->add_option("--data", o.data, "text file or folder (default: the fortunes corpus)");
  cmd->add_option("-o,--out", o.out_dir,
                  "output folder (metrics.jsonl, checkpoint.safetensors); one that holds a run is refused without "
                  "--resume or --overwrite")
      ->capture_default_str();
  cmd->add_flag("--overwrite", o.overwrite, "replace the run already in --out (its files are replaced as new ones are written)");
  cmd->add_option("--backend", o.backend, "auto | cpu | cuda")->capture_default_str();
  cmd->add_option("--steps", o.steps, "optimizer steps")->capture_default_str();
  cmd->add_option("--batch-size", o.batch_size, "sequences per micro-batch (0: the config's, or the checkpoint's with --resume)");
  cmd->add_option("--seq-len", o.seq_len, "tokens per sequence (0: the config's, or the checkpoint's with --resume)");
  cmd->add_option("--grad-accum", o.grad_accum, "micro-batches per step")->capture_default_str();
  cmd->add_option("--lr", o.lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--min-lr-ratio", o.min_lr_ratio, "final learning rate / peak")->capture_default_str();
  cmd->add_option("--warmup", o.warmup_frac, "warm-up fraction of the steps")->capture_default_str();
  cmd->add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->capture_default_str();
  cmd->add_option("--clip", o.clip, "gradient norm clip (0: off)")->capture_default_str();
  cmd->add_option("--attention", o.attention,
                  "attention GEMM operands: exact (the activations' dtype) | bf16 (BF16, FP32 accumulation)")
      ->capture_default_str();
  cmd->add_option("--moments", o.moments, "AdamW moment precision: bf16 | f32")->capture_default_str();
  cmd->add_option("--graphs", o.graphs,
                  "training steps as CUDA graphs, recorded once and replayed while the batch shape stays: auto (one "
                  "process on a GPU) | on | off")
      ->capture_default_str();
  cmd->add_option("--wgrad-stream", o.wgrad_stream,
                  "each sublayer's weight gradients on a second stream, beside the next sublayer's input gradient "
                  "(the same bits): on | off")
      ->capture_default_str();
  cmd->add_option("--ema-decay", o.ema_decay, "decay per step of the parameter EMA")->capture_default_str();
  cmd->add_option("--ema-on", o.ema_on,
                  "where the EMA's averages live: host (the report's; the snapshot crosses the bus) | device | auto "
                  "(the device where they take at most an eighth of its free memory)")
      ->capture_default_str();
  cmd->add_option("--ema-every", o.ema_every,
                  "steps between EMA snapshots, each weighted as that many steps (large models with the EMA on "
                  "the host: the snapshot moves every weight over the bus)")
      ->capture_default_str();
  cmd->add_option("--mtp-weight-after", o.mtp_weight_after,
                  "MTP loss weight from --mtp-switch on (the report: 0.3, then 0.1); < 0: the config's throughout")
      ->capture_default_str();
  cmd->add_option("--mtp-switch", o.mtp_switch, "fraction of the steps after which --mtp-weight-after applies")
      ->capture_default_str();
  cmd->add_option("--peak-tflops", o.peak_tflops,
                  "peak TFLOPS for the MFU (default: the GPU's dense BF16 Tensor Core peak; the CPU has none)");
  cmd->add_flag("--eval-ema", o.eval_ema, "validate on the EMA weights");
  cmd->add_option("--eval-every", o.eval_every, "steps between validations")->capture_default_str();
  cmd->add_option("--eval-batches", o.eval_batches, "validation micro-batches")->capture_default_str();
  cmd->add_option("--log-every", o.log_every, "steps between progress lines")->capture_default_str();
  cmd->add_option("--ckpt-every", o.ckpt_every, "steps between checkpoints (also one at the end and on Ctrl-C); 0 writes none, for timing runs")->capture_default_str();
  cmd->add_option("--seed", o.seed, "seed of the initialization and the data order")->capture_default_str();
  cmd->add_option("--stop-at", o.stop_at, "checkpoint and stop after this step (the schedule still spans --steps)");
  cmd->add_flag("-q,--quiet", o.quiet, "no progress lines");
  // Several ranks: mpirun -np N fp8moe train --pp P --dp D --ep E (include/fp8moe/parallel.hpp).
  cmd->add_option("--pp", o.parallel.pp,
                  "pipeline ranks: the trunk's layers split into stages, run by --schedule (world = pp x dp)")
      ->capture_default_str();
  cmd->add_option("--schedule", o.parallel.schedule,
                  "pipeline schedule with --pp: 1f1b | zb1p | dualpipe | dualpipev (2 x pp stages, two per rank; "
                  "also at --pp 1); --grad-accum gives its micro-batches")
      ->capture_default_str();
  cmd->add_option("--pp-split", o.parallel.pp_split,
                  "trunk sublayers (attention, MLP/MoE) per stage, e.g. 3,2,3 (default: balanced by a cost model)");
  cmd->add_option("--trace", o.trace,
                  "with --pp: the last step's timeline, per rank, as Chrome/Perfetto traces FILE.rankN.json, and its "
                  "busy, communication wait and bubble printed");
  cmd->add_option("--dp", o.parallel.dp, "data-parallel ranks (0: the world size under mpirun)");
  cmd->add_option("--ep", o.parallel.ep,
                  "expert-parallel ranks inside --dp: the routed experts sharded, tokens dispatched in FP8 and "
                  "combined in BF16 (0: the experts in each process)");
  cmd->add_option("--ep-transport", o.parallel.ep_transport,
                  "how --ep moves its rows: comm (the communicator's all-to-all) | nvlink (peer-memory kernels: "
                  "CUDA sm_90 ranks of one host) | auto (nvlink where every rank can, else comm)")
      ->capture_default_str();
  cmd->add_option("--ranks-per-node", o.parallel.ranks_per_node,
                  "consecutive ranks forming a node, for node-limited routing (0: one node)");
  cmd->add_option("--max-nodes", o.parallel.max_nodes, "nodes a token may be routed to (0: min(4, nodes))");
  cmd->add_option("--comm", o.parallel.comm, "communicator: mpi | nccl | auto")->capture_default_str();
  cmd->add_option("--fb", o.parallel.fb,
                  "DualPipe's paired F&B chunks: overlap (forward and backward halves on two streams) | serial (one "
                  "stream, the same order and bits) | compare (with --trace: steps in turn serial with each half timed, serial, "
                  "overlapped, and the chunk times printed)")
      ->capture_default_str();
  cmd->add_option("--comm-sms", o.parallel.comm_sms,
                  "SMs given to communication kernels: NCCL's CTAs and the NVLink expert-parallel kernels' num_sms "
                  "(even; 0: the transport's default; not with the mpi engine)")
      ->capture_default_str();
}

}  // namespace fp8moe::cli
