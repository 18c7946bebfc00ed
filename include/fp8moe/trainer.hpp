// The fp8moe trainer: DeepSeek-V3-mini on byte-level text with the report's recipe. AdamW with FP32
// master weights and BF16 moments, gradient accumulation over micro-batches, warm-up + cosine
// schedule, clipping, auxiliary-loss-free bias updates, a CPU-memory EMA, validation, metrics as
// JSON lines, atomic checkpoints that resume bit-identically, and a clean stop on Ctrl-C.
//   fp8moe::TrainOptions opt;  opt.model_config = "configs/tiny.json";  opt.recipe = "fp8";
//   fp8moe::Trainer(opt).run();
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "fp8moe/config.hpp"
#include "fp8moe/optimizer.hpp"
#include "fp8moe/parallel.hpp"

namespace fp8moe {

struct TrainOptions {
  std::string model_config = "configs/tiny.json";
  std::string recipe = "fp8";
  std::string attention = "exact";  // attention GEMM operands: exact (activation dtype) | bf16
  std::string backend = "auto";     // auto = cuda when a GPU is present, else cpu
  std::string data;                 // text file or folder; empty = the default corpus
  std::string out_dir = "runs/default";
  int64_t steps = 200;
  int64_t batch_size = 0;           // sequences per micro-batch; 0 = the model config's
  int64_t seq_len = 0;              // 0 = the model config's
  int64_t grad_accum = 1;           // micro-batches per step
  float lr = 1e-3f, min_lr_ratio = 0.1f, warmup_frac = 0.05f, weight_decay = 0.1f, clip = 1.0f;
  float beta1 = 0.9f, beta2 = 0.95f;
  std::string moments = "bf16";     // bf16 | f32
  float ema_decay = 0.999f;         // per step
  int64_t ema_every = 1;            // steps between EMA snapshots (each folds in with decay^ema_every)
  // MTP loss weight schedule (report §4.2: 0.3 for the first 10T of 14.8T tokens, then 0.1): from
  // step mtp_switch * steps on, the weight is mtp_weight_after; < 0 keeps the config's throughout.
  double mtp_weight_after = -1, mtp_switch = 10.0 / 14.8;
  double peak_tflops = 0;           // MFU denominator; 0 = the backend's dense BF16 peak (none on CPU)
  bool eval_ema = false;            // validation on the EMA weights instead of the live ones
  int64_t eval_every = 50, eval_batches = 8, log_every = 10, ckpt_every = 100;
  uint64_t seed = 1234;
  bool resume = false;              // continue from out_dir/checkpoint.safetensors
  int64_t stop_at = 0;              // > 0: checkpoint and return after this many steps (the
                                    // schedule still spans `steps`): long runs in pieces
  bool quiet = false;
  // Several ranks under mpirun (--dp, --ep, --ranks-per-node, --max-nodes, --comm): the global
  // batch is dp x batch_size x grad_accum sequences; rank 0 writes the output.
  ParallelOptions parallel;
};

struct TrainSummary {
  int64_t steps = 0;
  double final_loss = 0;       // mean training loss of the last log_every steps
  double final_val_loss = 0;   // validation loss at the end
  double tokens_per_s = 0;
  bool interrupted = false;
  bool writer = true;          // this process writes the output (rank 0 of several)
};

class Trainer {
 public:
  explicit Trainer(TrainOptions opt);
  ~Trainer();
  TrainSummary run();
  // Set from a signal handler: the loop finishes its step, writes a checkpoint and returns.
  static std::atomic<bool>& stop_flag();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Training FLOPs of one token (forward + backward) for the activated parameters and causal
// attention over `seq_len`, as used for TFLOPS/MFU.
double train_flops_per_token(const ModelConfig& cfg, int64_t seq_len);

}  // namespace fp8moe
