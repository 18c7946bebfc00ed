// The fp8moe trainer: DeepSeek-V3-mini on byte-level text with the report's recipe. AdamW with FP32
// master weights and BF16 moments, gradient accumulation over micro-batches, warm-up + cosine
// schedule, clipping, auxiliary-loss-free bias updates, a CPU-memory EMA, validation, metrics as
// JSON lines, atomic checkpoints that resume bit-identically, and a clean stop on Ctrl-C.
// Every option is checked before any work and before anything is written; an output folder that
// already holds a run is refused unless the run is resumed or explicitly overwritten.
//   fp8moe::TrainOptions opt;  opt.model_config = "tiny";  opt.recipe = "fp8";
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
  std::string model_config = "tiny";  // a file, or a shipped config's name (load_config)
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
  // Where the EMA's averages live: host (the report's: no device memory, 8 bytes per weight over
  // the bus per snapshot) | device (one pass on the device) | auto (the device where the backend
  // folds there and the averages take at most an eighth of its free memory).
  std::string ema_on = "auto";
  // MTP loss weight schedule (report §4.2: 0.3 for the first 10T of 14.8T tokens, then 0.1): from
  // step mtp_switch * steps on, the weight is mtp_weight_after; < 0 keeps the config's throughout.
  double mtp_weight_after = -1, mtp_switch = 10.0 / 14.8;
  double peak_tflops = 0;           // MFU denominator; 0 = the backend's dense BF16 peak (none on CPU)
  bool eval_ema = false;            // validation on the EMA weights instead of the live ones
  int64_t eval_every = 50, eval_batches = 8, log_every = 10, ckpt_every = 100;
  uint64_t seed = 1234;
  bool resume = false;              // continue from out_dir/checkpoint.safetensors
  bool overwrite = false;           // replace the run already in out_dir (its files are replaced
                                    // as the new run writes its own, not deleted up front)
  int64_t stop_at = 0;              // > 0: checkpoint and return after this many steps (the
                                    // schedule still spans `steps`): long runs in pieces
  bool quiet = false;
  // Several ranks under mpirun (--dp, --ep, --ranks-per-node, --max-nodes, --comm): the global
  // batch is dp x batch_size x grad_accum sequences; rank 0 writes the output.
  ParallelOptions parallel;
  std::string trace;  // with --pp: the last step's timeline, FILE.rankN.json per rank (--trace FILE.json)
  // Steps as CUDA graphs (pipeline::Executor::set_graphs): auto = where the backend records
  // graphs and the run is one process without --trace; on = the same, refused where it cannot.
  std::string graphs = "auto";  // auto | on | off
  // A sublayer's weight gradients on a second stream beside the next one's input gradient
  // (pipeline::Executor::set_wgrad_stream): the same bits.
  std::string wgrad_stream = "on";  // on | off
};

struct TrainSummary {
  int64_t steps = 0;           // the next step to run (= steps done, the resumed ones included)
  int64_t total_steps = 0;     // --steps
  int64_t steps_run = 0;       // by this run
  double final_loss = 0;       // mean training loss of the last log_every steps (steps_run > 0)
  double final_val_loss = 0;   // validation loss of this run's last validation
  bool has_val_loss = false;   // whether this run validated at all
  double tokens_per_s = 0;
  bool interrupted = false;
  bool writer = true;          // this process writes the output (rank 0 of several)
  std::string checkpoint;      // the checkpoint written last by this run; empty: none
  int64_t graph_replays = 0;   // steps run as CUDA graph replays (TrainOptions::graphs)
  std::string graph_note;      // why graphs were turned off (a capture that failed); empty: they were not
};

// One line that states only what the run measured ("done: step 20 of 20, train loss 2.4123,
// validation loss 2.5010, 812 tokens/s"), for the command's output.
std::string format_summary(const TrainSummary& s);
// What an interrupted run left: "interrupted at step 5: checkpoint written to <path>; --resume
// continues the run".
std::string interrupted_message(const TrainSummary& s);

// Every option's range, naming the option (--flag and field) and what it allows: counts >= 1
// (batch and sequence sizes >= 0, 0: the config's), finite rates and decays in their ranges, known
// recipe, attention and moment names, --resume with --overwrite refused. Raises fp8moe::Error.
// The Trainer calls it first; `fp8moe compare` calls it for all its runs before training any.
void validate_train_options(const TrainOptions& opt);

// The output folder against the options, creating nothing: refuses an --out that is a file, a
// folder already holding a run (metrics.jsonl or checkpoint.safetensors) unless `resume` or
// `overwrite`, and `resume` without a checkpoint there.
void check_run_folder(const std::string& out_dir, bool resume, bool overwrite);

class Trainer {
 public:
  explicit Trainer(TrainOptions opt);
  ~Trainer();
  TrainSummary run();
  // Set from a signal handler: the loop finishes its step, writes a checkpoint and returns with
  // TrainSummary::interrupted.
  static std::atomic<bool>& stop_flag();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Training FLOPs of one token (forward + backward) for the activated parameters and causal
// attention over `seq_len`, as used for TFLOPS/MFU.
double train_flops_per_token(const ModelConfig& cfg, int64_t seq_len);

}  // namespace fp8moe
