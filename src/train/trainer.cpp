// The training loop (include/fp8moe/trainer.hpp).
// NOTES: exact resume rests on three things: every piece of state is in the checkpoint (weights,
// routing biases, moments, optimizer and EMA step counts, sampler position), the data order is a
// function of (seed, epoch), and the CPU ops use static OpenMP schedules, so the same thread
// count gives the same sums.
#include "fp8moe/trainer.hpp"

#include "fp8moe/comm.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <fcntl.h>
#include <cstring>
#include <sstream>
#include <optional>
#include <thread>
#include <unistd.h>

#include "fp8moe/data.hpp"
#include "fp8moe/ema.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/safetensors.hpp"
#include "fp8moe/pipeline_executor.hpp"
#include "step_phases.hpp"
#include "trainer_parallel.hpp"

namespace fp8moe {

namespace fs = std::filesystem;

std::atomic<bool>& Trainer::stop_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

double train_flops_per_token(const ModelConfig& cfg, int64_t seq_len) {
  const ParameterCount pc = count_parameters(cfg);
  // Matrix parameters touched per token (the embedding is a lookup, not a GEMM).
  const double matmul_params = double(pc.activated - pc.embedding);
  // Causal attention: QK^T and PV, on average over seq_len / 2 keys, per layer (MTP included).
  const double attn = 2.0 * double(seq_len) / 2.0 * double(cfg.num_attention_heads) *
                      double(cfg.qk_head_dim() + cfg.v_head_dim) * double(cfg.num_layers_total());
  return 6.0 * matmul_params + 3.0 * attn;  // forward 2 FLOPs per MAC; backward twice forward
}

namespace {

int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, rss = 0;
  statm >> pages >> rss;
  return rss * int64_t(::sysconf(_SC_PAGESIZE));
}

// The first available backend, GPU first, that runs every op of the model and the host optimizer.
std::string pick_backend(bool quiet) {
  const std::string preferred = default_backend_name();
  if (preferred == "cpu") return preferred;
  auto be = make_backend(preferred);
  bool all = true;
  for (int op = 0; all && op <= int(Op::sum_squares); ++op) all = be->supports(Op(op));
  if (all) return preferred;
  if (!quiet) std::printf("note: backend '%s' does not run the whole training step yet; training on the CPU\n", preferred.c_str());
  return "cpu";
}

// metrics.jsonl, one JSON line per step, each flushed to the file as it is written. A run that
// starts afresh writes its first line to a temporary file and renames it over the old one, so an
// earlier run's metrics (replaced by --overwrite) stay whole until the new ones exist; a resumed
// run appends.
class MetricsFile {
 public:
  MetricsFile(fs::path path, bool append) : path_(std::move(path)) {
    if (append) open(path_);
  }
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;
  ~MetricsFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Returns true when this line replaced an earlier file.
  bool write(const std::string& line) {
    bool replaced = false;
    if (fd_ < 0) {
      const fs::path tmp = path_.parent_path() / std::string(".").append(path_.filename().string()).append(".new");
      open(tmp);
      write_all(tmp, line);
      replaced = fs::exists(path_);
      if (::rename(tmp.c_str(), path_.c_str()) != 0)
        throw IoError("renaming '" + tmp.string() + "' to '" + path_.string() + "' failed: " + std::strerror(errno));
      return replaced;
    }
    write_all(path_, line);
    return replaced;
  }

 private:
  void open(const fs::path& p) {
    fd_ = ::open(p.c_str(), O_WRONLY | O_CREAT | O_APPEND | (p == path_ ? 0 : O_TRUNC), 0644);
    if (fd_ < 0) throw IoError("opening '" + p.string() + "' for writing failed: " + std::strerror(errno));
  }
  void write_all(const fs::path& p, const std::string& line) {
    size_t done = 0;
    while (done < line.size()) {
      const ssize_t w = ::write(fd_, line.data() + done, line.size() - done);
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) throw IoError("writing '" + p.string() + "' failed: " + std::strerror(errno));
      done += size_t(w);
    }
  }
  fs::path path_;
  int fd_ = -1;
};

// The lines of a resumed run's metrics.jsonl for the steps before `step`: a run stopped between
// checkpoints logged steps that the resumed run does again.
std::string metrics_before(const fs::path& path, int64_t step, bool& dropped) {
  std::ifstream in(path);
  std::string kept, line;
  dropped = false;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("step") && j["step"].is_number_integer() && j["step"].get<int64_t>() >= step) {
      dropped = true;
      continue;
    }
    kept += line + "\n";
  }
  return kept;
}

std::string metadata(const SafetensorsFile& f, const std::string& path, const char* key) {
  const auto it = f.metadata.find(key);
  FP8MOE_CHECK(it != f.metadata.end(), path << ": checkpoint metadata lacks '" << key << "'");
  return it->second;
}

int64_t metadata_int(const SafetensorsFile& f, const std::string& path, const char* key) {
  const std::string v = metadata(f, path, key);
  try {
    size_t used = 0;
    const int64_t n = std::stoll(v, &used);
    if (used == v.size() && n >= 0) return n;
  } catch (const std::exception&) {
  }
  FP8MOE_CHECK(false, path << ": checkpoint metadata '" << key << "' = '" << v << "' is not a count");
}

}  // namespace

std::string interrupted_message(const TrainSummary& s) {
  return "interrupted at step " + std::to_string(s.steps) + ": " +
         (s.checkpoint.empty() ? std::string("no checkpoint written (--ckpt-every 0)")
                               : "checkpoint written to " + s.checkpoint + "; --resume continues the run");
}

void validate_train_options(const TrainOptions& o) {
  auto check = [](bool ok, const char* flag, const char* field, auto value, const char* range) {
    FP8MOE_CHECK(ok, "train: " << flag << " (" << field << ") = " << value << " is out of range: must be " << range);
  };
  auto finite = [](double v) { return std::isfinite(v); };
  check(o.steps >= 1, "--steps", "steps", o.steps, ">= 1");
  check(o.batch_size >= 0, "--batch-size", "batch_size", o.batch_size, ">= 1 (or 0: the config's)");
  check(o.seq_len >= 0, "--seq-len", "seq_len", o.seq_len, ">= 1 (or 0: the config's)");
  check(o.grad_accum >= 1, "--grad-accum", "grad_accum", o.grad_accum, ">= 1");
  check(finite(o.lr) && o.lr > 0, "--lr", "lr", o.lr, "finite and > 0");
  check(finite(o.min_lr_ratio) && o.min_lr_ratio >= 0 && o.min_lr_ratio <= 1, "--min-lr-ratio", "min_lr_ratio",
        o.min_lr_ratio, "in [0, 1]");
  check(finite(o.warmup_frac) && o.warmup_frac >= 0 && o.warmup_frac <= 1, "--warmup", "warmup_frac", o.warmup_frac,
        "in [0, 1]");
  check(finite(o.weight_decay) && o.weight_decay >= 0, "--weight-decay", "weight_decay", o.weight_decay, "finite and >= 0");
  check(finite(o.clip) && o.clip >= 0, "--clip", "clip", o.clip, "finite and >= 0 (0: off)");
  check(finite(o.beta1) && o.beta1 >= 0 && o.beta1 < 1, "beta1", "beta1", o.beta1, "in [0, 1)");
  check(finite(o.beta2) && o.beta2 >= 0 && o.beta2 < 1, "beta2", "beta2", o.beta2, "in [0, 1)");
  check(finite(o.ema_decay) && o.ema_decay >= 0 && o.ema_decay <= 1, "--ema-decay", "ema_decay", o.ema_decay, "in [0, 1]");
  check(o.ema_every >= 1, "--ema-every", "ema_every", o.ema_every, ">= 1");
  check(finite(o.mtp_weight_after), "--mtp-weight-after", "mtp_weight_after", o.mtp_weight_after,
        "finite (< 0: the config's weight throughout)");
  check(finite(o.mtp_switch) && o.mtp_switch >= 0 && o.mtp_switch <= 1, "--mtp-switch", "mtp_switch", o.mtp_switch,
        "in [0, 1]");
  check(finite(o.peak_tflops) && o.peak_tflops >= 0, "--peak-tflops", "peak_tflops", o.peak_tflops,
        "finite and >= 0 (0: the GPU's)");
  check(o.eval_every >= 1, "--eval-every", "eval_every", o.eval_every, ">= 1");
  check(o.eval_batches >= 1, "--eval-batches", "eval_batches", o.eval_batches, ">= 1");
  check(o.log_every >= 1, "--log-every", "log_every", o.log_every, ">= 1");
  check(o.ckpt_every >= 0, "--ckpt-every", "ckpt_every", o.ckpt_every, ">= 0 (0: no checkpoints)");
  check(o.stop_at >= 0 && o.stop_at <= o.steps, "--stop-at", "stop_at", o.stop_at, "in [0, --steps] (0: no stop)");
  FP8MOE_CHECK(o.moments == "bf16" || o.moments == "f32",
               "train: --moments (moments) = '" << o.moments << "' is not one of bf16, f32");
  FP8MOE_CHECK(o.ema_on == "auto" || o.ema_on == "host" || o.ema_on == "device",
               "train: --ema-on (ema_on) = '" << o.ema_on << "' is not one of auto, host, device");
  FP8MOE_CHECK(o.graphs == "auto" || o.graphs == "on" || o.graphs == "off",
               "train: --graphs (graphs) = '" << o.graphs << "' is not one of auto, on, off");
  FP8MOE_CHECK(o.wgrad_stream == "on" || o.wgrad_stream == "off",
               "train: --wgrad-stream (wgrad_stream) = '" << o.wgrad_stream << "' is not one of on, off");
  FP8MOE_CHECK(o.backend == "auto" || o.backend == "cpu" || o.backend == "cuda",
               "train: --backend (backend) = '" << o.backend << "' is not one of auto, cpu, cuda");
  FP8MOE_CHECK(!o.out_dir.empty(), "train: --out (out_dir) must not be empty");
  check(o.parallel.pp >= 1, "--pp", "parallel.pp", o.parallel.pp, ">= 1");
  FP8MOE_CHECK(o.parallel.pp_split.empty() || o.parallel.pp > 1,
               "train: --pp-split '" << o.parallel.pp_split << "' splits pipeline stages: it needs --pp >= 2");
  FP8MOE_CHECK(!(o.resume && o.overwrite), "train: --resume continues the run in --out and --overwrite replaces it: give one");
  Recipe::from_name(o.recipe).set_attention(o.attention);
}

void check_run_folder(const std::string& out_dir, bool resume, bool overwrite) {
  std::error_code ec;
  const fs::path out(out_dir), ckpt = out / "checkpoint.safetensors", metrics = out / "metrics.jsonl";
  FP8MOE_CHECK(!fs::exists(out, ec) || fs::is_directory(out, ec),
               "train: --out '" << out_dir << "' is a file, not a folder");
  if (resume) {
    FP8MOE_CHECK(fs::is_regular_file(ckpt, ec), "train: --resume: no checkpoint to continue from ('" << ckpt.string()
                                                                                                  << "' does not exist)");
    return;
  }
  std::vector<std::string> held;
  for (const fs::path& p : {metrics, ckpt})
    if (fs::exists(p, ec)) held.push_back(p.filename().string());
  FP8MOE_CHECK(held.empty() || overwrite,
               "train: --out '" << out_dir << "' already holds a run (" << held[0] << (held.size() > 1 ? ", " + held[1] : "")
                                << "): --resume continues it, --overwrite replaces it, or choose another --out");
}

std::string format_summary(const TrainSummary& s) {
  std::ostringstream o;
  o << (s.interrupted ? "interrupted" : "done") << ": step " << s.steps << " of " << s.total_steps;
  if (s.steps_run != s.steps) o << " (" << s.steps_run << " in this run)";
  char buf[64];
  if (s.steps_run > 0) {
    std::snprintf(buf, sizeof buf, ", train loss %.4f", s.final_loss);
    o << buf;
  }
  if (s.has_val_loss) {
    std::snprintf(buf, sizeof buf, ", validation loss %.4f", s.final_val_loss);
    o << buf;
  }
  if (s.steps_run > 0) {
    std::snprintf(buf, sizeof buf, ", %.0f tokens/s", s.tokens_per_s);
    o << buf;
  }
  if (s.graph_replays > 0) o << ", " << s.graph_replays << " steps as graph replays";
  return o.str();
}

struct Trainer::Impl {
  TrainOptions opt;
  ModelConfig cfg;
  Recipe recipe;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<TextCorpus> corpus;
  std::unique_ptr<WindowSampler> sampler;
  std::vector<ParamRef> refs;        // trainable parameters, host views
  std::vector<Parameter*> all;       // every parameter this rank holds (EMA and checkpoints)
  std::unique_ptr<AdamW> adamw;       // one process; with `par`, par->zero instead
  std::unique_ptr<TrainerParallel> par;  // several ranks (--pp/--dp/--ep): trainer_parallel.hpp
  std::unique_ptr<pipeline::Executor> serial;  // without pipeline stages: 1F1B over one stage
  pipeline::Executor* executor = nullptr;      // par's with --pp, else `serial`
  std::unique_ptr<ParameterEma> ema;
  LrSchedule schedule;
  int64_t step = 0;
  std::string ckpt_path;

  std::optional<SafetensorsFile> resume_from;  // the checkpoint, held from the checks to the load

  explicit Impl(TrainOptions o) : opt(std::move(o)) {
    // Everything the run depends on is checked before anything is created or written.
    validate_train_options(opt);
    recipe = Recipe::from_name(opt.recipe);
    recipe.set_attention(opt.attention);
    // Rank 0 of a launch alone writes the folder, so it alone checks it (another rank's check
    // could see the files rank 0 has begun to write).
    if (launch_info().rank == 0) check_run_folder(opt.out_dir, opt.resume, opt.overwrite);
    ckpt_path = (fs::path(opt.out_dir) / "checkpoint.safetensors").string();
    cfg = load_config(opt.model_config);
    if (opt.resume) check_resume();
    if (opt.batch_size > 0) cfg.batch_size = opt.batch_size;
    if (opt.seq_len > 0) cfg.seq_len = opt.seq_len;
    FP8MOE_CHECK(cfg.vocab_size >= kByteVocab, "model config '" << opt.model_config << "': vocab_size " << cfg.vocab_size
                                                                 << " is smaller than the byte vocabulary (256)");
    par = TrainerParallel::make(opt.parallel, cfg, opt.grad_accum);
    if (par && !par->rank0()) opt.quiet = true;  // output, metrics and checkpoints: rank 0
    if (par && !opt.quiet) std::printf("parallel layout: %s\n", par->layout.str().c_str());
    FP8MOE_CHECK(opt.trace.empty() || (par && par->schedule), "train: --trace '" << opt.trace
                                                                                << "' records pipeline steps: it needs --pp >= 2 "
                                                                                   "(or --schedule dualpipev)");
    FP8MOE_CHECK(opt.parallel.fb != "compare" || !opt.trace.empty(),
                 "train: --fb compare times the F&B chunks for the trace summary: it needs --trace FILE");
    validate_config(cfg, recipe);
    if (resume_from) check_same_model(config_from_json(metadata(*resume_from, ckpt_path, "model_config")));
    corpus = std::make_unique<TextCorpus>(opt.data);
    if (!opt.quiet && !opt.data.empty() && !corpus->skipped().empty())
      std::printf("note: data: skipped %zu file(s) that are not UTF-8 text under '%s' (first: %s)\n", corpus->skipped().size(),
                  opt.data.c_str(), corpus->skipped()[0].c_str());
    backend = make_backend(opt.backend == "auto" ? pick_backend(opt.quiet) : opt.backend);
    // Device-side checks are raised once per micro-batch (the synchronize below), not per op.
    backend->set_checks(Backend::Checks::deferred);
    // The inputs are sound: the folder is made before the model is, so that a place that cannot
    // hold it fails at once.
    std::error_code ec;
    fs::create_directories(opt.out_dir, ec);
    if (ec) throw IoError("train: cannot create the output folder '" + opt.out_dir + "': " + ec.message());
    // With --pp, this pipeline rank's stages only.
    model = std::make_unique<Model>(cfg, recipe, *backend, opt.seed, par ? par->expert_shard() : ExpertShard{},
                                    par ? par->stage_shard() : StageShard{});
    sampler = std::make_unique<WindowSampler>(corpus->train(), int(cfg.seq_len + 1), opt.seed);
    for (Parameter& p : model->parameters()) {
      all.push_back(&p);
      if (p.trainable) refs.push_back({p.name, p.weight.view(), p.grad.view(), p.decay});
    }
    AdamWConfig ac;
    ac.beta1 = opt.beta1;
    ac.beta2 = opt.beta2;
    ac.weight_decay = opt.weight_decay;
    ac.moments = opt.moments == "bf16" ? MomentPrecision::bf16 : MomentPrecision::f32;
    if (par) par->attach(*model, *backend, refs, ac);
    if (par && par->experts && !opt.quiet)
      std::printf("expert-parallel transport: %s\n", expert_parallel_transport(*par->experts).c_str());
    if (!par) adamw = std::make_unique<AdamW>(*backend, refs, ac);
    if (par && par->executor) {
      executor = par->executor.get();
      // The trace's times are the device's: each op (each component outside an overlapped F&B
      // chunk) waits for the device before its end is taken.
      if (!opt.trace.empty()) executor->set_device_times(pipeline::DeviceTimes::components);
    } else {
      serial = std::make_unique<pipeline::Executor>(*model, pipeline::one_f_one_b_schedule(1, int(opt.grad_accum)),
                                                     pipeline::balanced_split(cfg, 1), nullptr);
      executor = serial.get();
    }
    FP8MOE_CHECK(opt.graphs != "on" || backend->can_capture(),
                 "train: --graphs on: backend '" << backend->name() << "' cannot record graphs"
                                                 << (backend->device() == Device::cuda ? " (FP8MOE_PROFILE_OPS times eager steps)" : ""));
    FP8MOE_CHECK(opt.graphs != "on" || !par, "train: --graphs on: steps as graphs run in one process (this run has "
                                                 << par->layout.str() << ")");
    // Under mpirun the step talks to other ranks; one process records it once and replays it.
    executor->set_graphs(opt.graphs != "off" && !par && backend->can_capture());
    executor->set_wgrad_stream(opt.wgrad_stream == "on");
    std::vector<ParamRef> ema_refs;
    for (Parameter* p : all) ema_refs.push_back({p->name, p->weight.view(), p->grad.view(), false});
    // Every ema_every steps a snapshot, folded in with decay^ema_every. In host memory (the
    // report's place, which costs the device nothing) one asynchronous copy to the host per
    // snapshot: the bus and the host's memory bound it, at 8 bytes per weight. On the device one
    // pass beside the step. auto: on the device where it folds them and the averages take at most
    // an eighth of its free memory (the report keeps them on the host to leave the device's memory
    // to the model; where that memory is plentiful the bus is the scarcer thing). With the model on
    // the CPU its cores train, so the host fold takes one thread; beside a GPU it takes several,
    // leaving two to the training loop.
    int64_t ema_bytes = 0;
    for (const ParamRef& r : ema_refs) ema_bytes += int64_t(r.value.nbytes());
    const int64_t dev_free = backend->device_memory_free();
    FP8MOE_CHECK(opt.ema_on != "device" || backend->folds_ema(),
                 "train: --ema-on device: backend '" << backend->name() << "' keeps the EMA in host memory");
    const bool ema_device = opt.ema_on == "device" ||
                            (opt.ema_on == "auto" && backend->folds_ema() && dev_free >= 0 && ema_bytes <= dev_free / 8);
    const int ema_threads =
        backend->device() == Device::cpu ? 1 : std::clamp(int(std::thread::hardware_concurrency()) - 2, 1, 8);
    ema = std::make_unique<ParameterEma>(ema_refs, float(std::pow(double(opt.ema_decay), double(opt.ema_every))),
                                         *backend, ema_threads,
                                         ema_device ? ParameterEma::Placement::device : ParameterEma::Placement::host);
    schedule = {opt.lr, opt.lr * opt.min_lr_ratio, std::max<int64_t>(1, int64_t(opt.warmup_frac * float(opt.steps))), opt.steps};
    if (resume_from) {
      load_checkpoint(*resume_from);
      resume_from.reset();
    }
  }

  // What a resumed run must agree on with the checkpoint, checked before any work: its format, a
  // step still to run, and the batch shape, seed and accumulation that the data order and the
  // losses depend on (the batch and sequence sizes default to the checkpoint's).
  void check_resume() {
    resume_from = load_safetensors(ckpt_path);
    const SafetensorsFile& f = *resume_from;
    FP8MOE_CHECK(metadata(f, ckpt_path, "format") == "fp8moe-checkpoint-1", ckpt_path << ": not an fp8moe checkpoint");
    const std::string saved_recipe = metadata(f, ckpt_path, "recipe");
    FP8MOE_CHECK(saved_recipe == recipe.name, ckpt_path << ": checkpoint was trained with recipe '" << saved_recipe
                                                        << "', this run asks for '" << recipe.name << "'");
    const auto att = f.metadata.find("attention");  // absent before the option: exact
    const std::string attention = att == f.metadata.end() ? "exact" : att->second;
    FP8MOE_CHECK(attention == recipe.attention(), ckpt_path << ": checkpoint was trained with --attention " << attention
                                                            << ", this run asks for " << recipe.attention());
    step = metadata_int(f, ckpt_path, "step");
    FP8MOE_CHECK(step < opt.steps, "train: --resume: the run in '" << opt.out_dir << "' already reached step " << step
                                                                   << " of --steps " << opt.steps
                                                                   << "; give a larger --steps to continue it");
    FP8MOE_CHECK(opt.stop_at == 0 || opt.stop_at > step,
                 "train: --stop-at " << opt.stop_at << " is not after the checkpoint's step " << step);
    const ModelConfig saved = config_from_json(metadata(f, ckpt_path, "model_config"));
    auto same = [&](const char* flag, int64_t& given, int64_t saved_value) {
      FP8MOE_CHECK(given == 0 || given == saved_value, "train: --resume: " << flag << " " << given << " differs from the "
                                                                            << saved_value << " the run was trained with");
      given = saved_value;
    };
    same("--batch-size", opt.batch_size, saved.batch_size);
    same("--seq-len", opt.seq_len, saved.seq_len);
    // Absent from checkpoints written before these were recorded.
    if (f.metadata.count("seed"))
      FP8MOE_CHECK(std::to_string(opt.seed) == f.metadata.at("seed"),
                   "train: --resume: --seed " << opt.seed << " differs from the " << f.metadata.at("seed")
                                              << " the run was trained with (it fixes the data order)");
    // The global batch in micro-batches, grad_accum x data-parallel ranks (the launch's ranks over
    // --pp), is what must agree: a run may resume at another D or P.
    const int64_t dp_ranks = int64_t(launch_info().size) / std::max<int64_t>(opt.parallel.pp, 1);
    const int64_t micro = opt.grad_accum * dp_ranks;
    if (f.metadata.count("micro_batches"))
      FP8MOE_CHECK(std::to_string(micro) == f.metadata.at("micro_batches"),
                   "train: --resume: " << opt.grad_accum << " (--grad-accum) x " << dp_ranks
                                       << " (data-parallel ranks) micro-batches per step differ from the "
                                       << f.metadata.at("micro_batches") << " the run was trained with");
    else if (f.metadata.count("grad_accum"))
      FP8MOE_CHECK(std::to_string(opt.grad_accum) == f.metadata.at("grad_accum"),
                   "train: --resume: --grad-accum " << opt.grad_accum << " differs from the " << f.metadata.at("grad_accum")
                                                    << " the run was trained with");
  }

  void save_checkpoint() {
    ema->wait();
    std::map<std::string, TensorView> tensors;
    std::vector<Tensor> host;  // keeps the host copies of device tensors alive until written
    auto add = [&](const std::string& name, const Tensor& t) {
      host.push_back(backend->to_host(t));
      tensors[name] = host.back().view();
    };
    for (size_t i = 0; i < all.size(); ++i) {
      add(all[i]->name, all[i]->weight);
      add("ema." + all[i]->name, ema->averages()[i]);
    }
    std::vector<Tensor> m, v;  // the whole moments, gathered from the shards with ZeRO-1
    if (par) par->zero->gather_moments(m, v);
    for (size_t i = 0; i < refs.size(); ++i) {
      add("optimizer.exp_avg." + refs[i].name, par ? m[i] : adamw->first_moments()[i]);
      add("optimizer.exp_avg_sq." + refs[i].name, par ? v[i] : adamw->second_moments()[i]);
    }
    if (par) par->gather_experts(*backend, tensors, host);  // the other ranks' routed experts
    if (par) par->gather_stages(tensors, host);             // the other pipeline ranks' stages
    if (par && !par->rank0()) return;
    const auto ss = sampler->state();
    save_safetensors(ckpt_path, tensors,
                     {{"format", "fp8moe-checkpoint-1"},
                      {"step", std::to_string(step)},
                      {"optimizer_steps", std::to_string(optimizer_steps())},
                      {"ema_updates", std::to_string(ema->updates())},
                      {"sampler_epoch", std::to_string(ss.epoch)},
                      {"sampler_index", std::to_string(ss.index)},
                      {"recipe", recipe.name},
                      {"attention", recipe.attention()},
                      {"model_config", config_to_json(cfg)},
                      {"seed", std::to_string(opt.seed)},
                      {"grad_accum", std::to_string(opt.grad_accum)},
                      {"micro_batches", std::to_string(opt.grad_accum * (par ? par->dp() : 1))}});
  }

  // A resumed run trains the model of its checkpoint: every config key but the name must agree.
  void check_same_model(const ModelConfig& saved) const {
    const nlohmann::json a = nlohmann::json::parse(config_to_json(saved)), b = nlohmann::json::parse(config_to_json(cfg));
    for (const auto& [key, value] : a.items())
      FP8MOE_CHECK(key == "name" || b[key] == value, "train: --resume: the config's " << key << " = " << b[key].dump()
                                                                                     << " differs from the " << value.dump()
                                                                                     << " the run was trained with");
  }

  void load_checkpoint(const SafetensorsFile& f) {
    auto take = [&](const std::string& name, const TensorView& dst) {
      auto it = f.tensors.find(name);
      FP8MOE_CHECK(it != f.tensors.end(), ckpt_path << ": checkpoint lacks tensor '" << name << "'");
      const TensorView& src = it->second.view();
      bool same = src.dtype == dst.dtype && src.ndim == dst.ndim;
      for (int d = 0; same && d < src.ndim; ++d) same = src.shape[d] == dst.shape[d];
      FP8MOE_CHECK(same, ckpt_path << ": tensor '" << name << "' is " << it->second.view().str() << ", the model needs " << dst.str());
      backend->copy(dst, it->second.view());
    };
    for (size_t i = 0; i < all.size(); ++i) {
      take(all[i]->name, all[i]->weight.view());
      take("ema." + all[i]->name, ema->averages()[i].view());
    }
    if (par) {  // whole moments in the file, this rank's shard in the optimizer
      std::vector<TensorView> m, v;
      auto find = [&](const std::string& name) {
        auto it = f.tensors.find(name);
        FP8MOE_CHECK(it != f.tensors.end(), ckpt_path << ": checkpoint lacks tensor '" << name << "'");
        return it->second.view();
      };
      for (const ParamRef& r : refs) {
        m.push_back(find("optimizer.exp_avg." + r.name));
        v.push_back(find("optimizer.exp_avg_sq." + r.name));
      }
      par->zero->load_moments(m, v);
      par->zero->reload_master();
      par->zero->set_steps(metadata_int(f, ckpt_path, "optimizer_steps"));
    } else {
      for (size_t i = 0; i < refs.size(); ++i) {
        take("optimizer.exp_avg." + refs[i].name, adamw->first_moments()[i].view());
        take("optimizer.exp_avg_sq." + refs[i].name, adamw->second_moments()[i].view());
      }
      adamw->set_steps(metadata_int(f, ckpt_path, "optimizer_steps"));
    }
    ema->set_updates(metadata_int(f, ckpt_path, "ema_updates"));
    sampler->set_state({uint64_t(metadata_int(f, ckpt_path, "sampler_epoch")), uint64_t(metadata_int(f, ckpt_path, "sampler_index"))});
  }

  int64_t optimizer_steps() const { return par ? par->zero->steps() : adamw->steps(); }

  // First parameter whose weight or gradient holds a NaN/Inf, for the error message.
  std::string first_non_finite() const {
    for (Parameter* p : all) {
      if (!std::isfinite(backend->sum_squares(p->grad.view()))) return p->name + ".grad";
      if (!std::isfinite(backend->sum_squares(p->weight.view()))) return p->name;
    }
    return "(none among the parameters and gradients: the loss itself)";
  }

  double evaluate() {
    std::vector<int32_t> windows;
    const int64_t B = cfg.batch_size, S = cfg.seq_len;
    evaluation_windows(corpus->validation(), int(S + 1), int(B), int(opt.eval_batches), windows);
    std::vector<Tensor> live;
    if (opt.eval_ema) {  // swap the EMA weights in for the evaluation
      ema->wait();
      for (size_t i = 0; i < all.size(); ++i) {
        live.push_back(Tensor::host_like(all[i]->weight.view()));
        backend->copy(live.back().view(), all[i]->weight.view());
        backend->copy(all[i]->weight.view(), ema->averages()[i].view());
      }
    }
    double sum = 0;
    for (int64_t e = 0; e < opt.eval_batches; ++e) {
      Tensor tok = Tensor::host(DType::i32, {B, S}), tgt = Tensor::host(DType::i32, {B, S});
      fill_batch(windows.data() + e * B * (S + 1), tok, tgt);
      // A pipeline rank holds its stages only: the forward goes through them.
      sum += par && par->executor ? par->executor->forward(tok, tgt).main_loss : model->forward(tok, tgt).main_loss;
    }
    for (size_t i = 0; i < live.size(); ++i) backend->copy(all[i]->weight.view(), live[i].view());
    return sum / double(opt.eval_batches);
  }

  void fill_batch(const int32_t* windows, const Tensor& tok, const Tensor& tgt) const {
    const int64_t B = cfg.batch_size, S = cfg.seq_len;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < S; ++t) {
        tok.ptr<int32_t>()[b * S + t] = windows[b * (S + 1) + t];
        tgt.ptr<int32_t>()[b * S + t] = windows[b * (S + 1) + t + 1];
      }
  }

  // What the training state takes, itemized, after the first step (activations as the model
  // measured them for that step's micro-batch): printed once and added to that metrics line.
  void report_memory(nlohmann::json& j) const {
    int64_t params = 0, moments = 0;
    for (Parameter* p : all) params += int64_t(p->weight.view().nbytes());
    if (par) moments = par->zero->memory().moments;
    for (size_t i = 0; !par && i < refs.size(); ++i)
      moments += int64_t(adamw->first_moments()[i].view().nbytes() + adamw->second_moments()[i].view().nbytes());
    // The most this rank held at once: one micro-batch's on one stage, several in flight with stages.
    const int64_t acts = executor->peak_saved_bytes(), dev = backend->device_memory_in_use(),
                  peak = backend->device_memory_peak();
    j["memory"] = {{"master_weights", params}, {"gradients", params}, {"adam_moments", moments},
                   {"activations_kept", acts}, {"ema", params}, {"ema_on", ema_on_device() ? "device" : "host"}, {"device_in_use", dev}, {"device_peak", peak}};
    if (par) par->report_memory(j["memory"], !opt.quiet);
    if (opt.quiet) return;
    const double mib = 1048576.0;
    std::printf("memory (%s, %s): master weights %.1f MiB, gradients %.1f MiB, AdamW moments %.1f MiB (%s), "
                "activations kept for backward %.1f MiB %s, EMA %.1f MiB in %s memory%s\n",
                backend->name().c_str(), recipe.name.c_str(), double(params) / mib, double(params) / mib,
                double(moments) / mib, opt.moments.c_str(), double(acts) / mib,
                par && par->executor ? "at the pipeline's peak" : "per micro-batch", double(params) / mib,
                ema_on_device() ? "device" : "host",
                dev >= 0 ? (", device in use " + std::to_string(dev / 1048576) + " MiB, tensors at peak " +
                            std::to_string(peak / 1048576) + " MiB")
                               .c_str()
                         : "");
  }

  bool ema_on_device() const { return ema->placement() == ParameterEma::Placement::device; }

  TrainSummary run() {
    const int64_t B = cfg.batch_size, S = cfg.seq_len;
    const int64_t start_step = step;
    const double flops_tok = train_flops_per_token(cfg, S);
    // MFU: model FLOPs (fwd + bwd) per second over the dense BF16 peak, for every recipe (so the
    // recipes compare on one scale).
    const double peak_tflops = opt.peak_tflops > 0 ? opt.peak_tflops : backend->peak_bf16_tflops();
    const fs::path metrics_path = fs::path(opt.out_dir) / "metrics.jsonl";
    const bool writer = !par || par->rank0();
    if (writer && opt.resume && fs::exists(metrics_path)) {
      bool dropped = false;
      const std::string kept = metrics_before(metrics_path, start_step, dropped);
      if (dropped) write_file_atomic(metrics_path.string(), kept);
    }
    // Every rank holds one, only rank 0's is written.
    MetricsFile metrics(metrics_path, opt.resume && writer);
    if (!opt.quiet)
      std::printf("fp8moe train: %s (%.1fM params, %.1fM active), recipe %s%s, backend %s, data %s (%zu train / %zu val bytes)\n",
                  cfg.name.c_str(), double(count_parameters(cfg).total) / 1e6, double(count_parameters(cfg).activated) / 1e6,
                  recipe.name.c_str(), recipe.attention() == "bf16" ? " (attention bf16)" : "", backend->name().c_str(), corpus->source().c_str(), corpus->train().size(),
                  corpus->validation().size());
    TrainSummary sum;
    std::vector<int32_t> windows;
    double loss_acc = 0;
    int64_t loss_n = 0;
    auto t_start = std::chrono::steady_clock::now();
    int64_t tokens_done = 0;
    StepPhases phases;
    phases.set_first_step(step);
    for (; step < opt.steps; ++step) {
      bool stop = stop_flag().load();
      if (par) stop = par->any(*backend, stop);  // every rank stops at the same step
      if (stop) {
        sum.interrupted = true;
        break;
      }
      if (opt.stop_at > 0 && step >= opt.stop_at) break;
      const auto t0 = std::chrono::steady_clock::now();
      phases.begin_step(step);
      model->zero_grad();
      const double mtp_weight = opt.mtp_weight_after >= 0 && double(step) >= opt.mtp_switch * double(opt.steps)
                                    ? opt.mtp_weight_after
                                    : cfg.mtp_loss_weight;
      model->set_mtp_loss_weight(mtp_weight);
      StepStats agg;
      std::vector<std::vector<int64_t>> loads;
      // The global batch is dp x grad_accum micro-batches, taken in the order one rank would take
      // them; data-parallel rank r runs micro-batches r, r + dp, ...
      const int64_t dp = par ? par->dp() : 1, micro = opt.grad_accum * dp;
      // This data-parallel rank's micro-batches, through the pipeline's schedule (one rank:
      // 1F1B over one stage, forward and backward of each micro-batch in turn).
      std::vector<Tensor> toks, tgts;
      for (int64_t m = 0; m < micro; ++m) {
        sampler->next(int(B), windows);
        if (par && m % dp != par->dp_rank()) continue;
        toks.push_back(Tensor::host(DType::i32, {B, S}));
        tgts.push_back(Tensor::host(DType::i32, {B, S}));
        fill_batch(windows.data(), toks.back(), tgts.back());
      }
      std::vector<StepStats> sts;
      phases.mark(0);
      try {
        if (par) par->begin_step(step);
        sts = executor->run(toks, tgts, 1.0 / double(micro));
        backend->synchronize();
        if (par) par->end_step();
      } catch (const Error& e) {
        const std::string bad = first_non_finite();
        // A NaN/Inf reaching a quantizer is reported as what it is: a diverged step. With stages,
        // a rank that failed or a peer that went away is not one: the message says which rank.
        if (!par || !par->executor)
          FP8MOE_CHECK(false, "step " << step << ": forward/backward failed: " << e.what() << "; first non-finite tensor: "
                                      << bad << ". Nothing was saved over the last checkpoint.");
        FP8MOE_CHECK(false, "step " << step << ": pipeline rank " << par->layout.pp_rank() << " (world rank "
                                    << par->layout.rank << "): " << e.what()
                                    << (bad.starts_with("(none") ? "" : "; first non-finite tensor: " + bad)
                                    << ". Nothing was saved over the last checkpoint.");
      }
      phases.mark(1);
      for (const StepStats& st : sts) {
        agg.loss += st.loss / double(micro);
        agg.main_loss += st.main_loss / double(micro);
        agg.mtp_loss += st.mtp_loss / double(micro);
        agg.balance_loss += st.balance_loss / double(micro);
        if (loads.empty()) loads.assign(st.expert_loads.size(), std::vector<int64_t>());
        for (size_t l = 0; l < st.expert_loads.size(); ++l) {
          loads[l].resize(st.expert_loads[l].size(), 0);
          for (size_t e = 0; e < st.expert_loads[l].size(); ++e) loads[l][e] += st.expert_loads[l][e];
        }
      }
      executor->sum_gradients();
      if (par) {  // the gradients' sums started, then every rank's losses and loads summed in rank order
        par->zero->reduce_gradients();
        std::vector<double> l{agg.loss, agg.main_loss, agg.mtp_loss, agg.balance_loss};
        par->sum(*backend, l);
        agg.loss = l[0], agg.main_loss = l[1], agg.mtp_loss = l[2], agg.balance_loss = l[3];
        par->sum(*backend, loads);
      }
      const double norm = par ? par->zero->grad_norm() : global_grad_norm(*backend, refs);
      FP8MOE_CHECK(std::isfinite(agg.loss) && std::isfinite(norm),
                   "step " << step << ": non-finite " << (std::isfinite(agg.loss) ? "gradient norm" : "loss") << " (loss "
                           << agg.loss << ", grad norm " << norm << "); first non-finite tensor: " << first_non_finite()
                           << ". Nothing was saved over the last checkpoint.");
      const float lr = schedule.at(step);
      phases.mark(2);
      ema->fence();  // the last snapshot's copies finish before the weights change
      if (par) par->zero->step(lr, clip_scale(norm, opt.clip));
      else adamw->step(lr, clip_scale(norm, opt.clip));
      if (!loads.empty()) model->update_routing_bias(loads, cfg.bias_update_speed);
      phases.mark(3);
      if ((step + 1) % opt.ema_every == 0) ema->update_async();
      phases.mark(4);
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double tok_s = double(B * S * micro) / dt;  // the global batch's
      tokens_done += B * S * micro;
      loss_acc += agg.main_loss;
      ++loss_n;

      nlohmann::json j{{"step", step},       {"loss", agg.main_loss},          {"total_loss", agg.loss},
                       {"mtp_loss", agg.mtp_loss}, {"mtp_weight", mtp_weight}, {"balance_loss", agg.balance_loss}, {"lr", lr},
                       {"grad_norm", norm},  {"tokens_per_s", tok_s},          {"tflops", flops_tok * tok_s / 1e12},
                       {"rss_bytes", resident_bytes()}};
      // The step's tokens per layer and expert (summed over ranks): what `fp8moe eplb --loads` places.
      if (!loads.empty()) j["expert_loads"] = loads;
      // The backend's allocator: bytes in tensors now, their high-water mark, and what is held
      // from the device for them (in use + cached).
      const Backend::MemoryStats ms = backend->memory_stats();
      char mem[96] = "";
      if (ms.reserved >= 0) {
        j["mem_allocated"] = ms.allocated;
        j["mem_peak"] = ms.peak_allocated;
        j["mem_reserved"] = ms.reserved;
        std::snprintf(mem, sizeof mem, " | mem %.0f/%.0f/%.0f MiB", double(ms.allocated) / 1048576.0,
                      double(ms.peak_allocated) / 1048576.0, double(ms.reserved) / 1048576.0);
      }
      char mfu[32] = "";
      if (peak_tflops > 0) {
        j["mfu"] = flops_tok * tok_s / 1e12 / peak_tflops;
        std::snprintf(mfu, sizeof mfu, " (MFU %.1f%%)", 100.0 * j["mfu"].get<double>());
      }
      const bool last = step + 1 == opt.steps;
      if ((step + 1) % opt.eval_every == 0 || last) {
        double v = evaluate();
        j["val_loss"] = v;
        sum.final_val_loss = v;
        sum.has_val_loss = true;
      }
      if (step == start_step) report_memory(j);
      // A run that replaces another and writes no checkpoint of its own leaves none of the old.
      if (writer && metrics.write(j.dump() + "\n") && opt.overwrite && opt.ckpt_every == 0) fs::remove(ckpt_path);
      char val[16] = "  -   ";
      if (j.contains("val_loss")) std::snprintf(val, sizeof val, "%.4f", j["val_loss"].get<double>());
      if (!opt.quiet && ((step + 1) % opt.log_every == 0 || last || step == 0))
        std::printf("step %6lld | loss %.4f | val %s | lr %.2e | norm %.3f | %.0f tok/s | %.3f TFLOPS%s | rss %.0f MiB%s\n",
                    (long long)step, agg.main_loss,
                    val,
                    double(lr), norm, tok_s, flops_tok * tok_s / 1e12, mfu, double(resident_bytes()) / 1048576.0, mem);
      if (!opt.quiet) std::fflush(stdout);  // progress reaches logs and pipes as it happens
      if ((step + 1) % opt.log_every == 0 || last) {
        sum.final_loss = loss_acc / double(loss_n);
        loss_acc = 0;
        loss_n = 0;
      }
      if (opt.ckpt_every > 0 && ((step + 1) % opt.ckpt_every == 0 || last || step + 1 == opt.stop_at)) {
        ++step;  // the checkpoint records the next step to run
        save_checkpoint();
        --step;
        sum.checkpoint = ckpt_path;
      }
      phases.mark(5);
    }
    phases.print();
    if (sum.interrupted && opt.ckpt_every > 0) {
      save_checkpoint();
      sum.checkpoint = ckpt_path;
    }
    if (par && !opt.trace.empty() && step > start_step) par->write_trace(opt.trace, !opt.quiet);
    if (par) par->report_traffic(*backend, cfg.hidden_size, cfg.num_experts_per_tok, !opt.quiet);
    ema->wait();
    if (loss_n > 0) sum.final_loss = loss_acc / double(loss_n);
    sum.steps = step;
    sum.writer = !par || par->rank0();
    sum.total_steps = opt.steps;
    sum.steps_run = step - start_step;
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    sum.tokens_per_s = double(tokens_done) / std::max(wall, 1e-9);
    sum.graph_replays = executor->graph_replays();
    sum.graph_note = executor->graph_note();
    if (!opt.quiet && !sum.graph_note.empty())
      std::printf("note: --graphs: the steps ran without graphs: %s\n", sum.graph_note.c_str());
    return sum;
  }
};

Trainer::Trainer(TrainOptions opt) : impl_(std::make_unique<Impl>(std::move(opt))) {}
Trainer::~Trainer() = default;
TrainSummary Trainer::run() { return impl_->run(); }

}  // namespace fp8moe
