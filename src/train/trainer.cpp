// The training loop (include/fp8moe/trainer.hpp).
// NOTES: exact resume rests on three things: every piece of state is in the checkpoint (weights,
// routing biases, moments, optimizer and EMA step counts, sampler position), the data order is a
// function of (seed, epoch), and the CPU ops use static OpenMP schedules, so the same thread
// count gives the same sums.
#include "fp8moe/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <unistd.h>

#include "fp8moe/data.hpp"
#include "fp8moe/ema.hpp"
#include "fp8moe/model.hpp"
#include "fp8moe/safetensors.hpp"
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

}  // namespace

struct Trainer::Impl {
  TrainOptions opt;
  ModelConfig cfg;
  Recipe recipe;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<TextCorpus> corpus;
  std::unique_ptr<WindowSampler> sampler;
  std::vector<ParamRef> refs;        // trainable parameters, host views
  std::vector<Parameter*> all;       // every parameter (EMA and checkpoints)
  std::unique_ptr<AdamW> adamw;       // one process; with `par`, par->zero instead
  std::unique_ptr<TrainerParallel> par;  // several ranks (--dp/--ep): trainer_parallel.hpp
  std::unique_ptr<ParameterEma> ema;
  LrSchedule schedule;
  int64_t step = 0;
  std::string ckpt_path;

  explicit Impl(TrainOptions o) : opt(std::move(o)) {
    cfg = load_config(opt.model_config);
    if (opt.batch_size > 0) cfg.batch_size = opt.batch_size;
    if (opt.seq_len > 0) cfg.seq_len = opt.seq_len;
    FP8MOE_CHECK(cfg.vocab_size >= kByteVocab, "model config '" << opt.model_config << "': vocab_size " << cfg.vocab_size
                                                                 << " is smaller than the byte vocabulary (256)");
    FP8MOE_CHECK(opt.steps > 0 && opt.grad_accum > 0, "train: steps and grad_accum must be positive");
    FP8MOE_CHECK(opt.moments == "bf16" || opt.moments == "f32", "train: moments must be bf16 or f32, got '" << opt.moments << "'");
    FP8MOE_CHECK(opt.mtp_switch >= 0 && opt.mtp_switch <= 1, "train: mtp_switch must be in [0, 1], got " << opt.mtp_switch);
    FP8MOE_CHECK(opt.ckpt_every >= 0, "train: ckpt_every must be >= 0 (0: no checkpoints), got " << opt.ckpt_every);
    par = TrainerParallel::make(opt.parallel, cfg);
    if (par && !par->rank0()) opt.quiet = true;  // output, metrics and checkpoints: rank 0
    if (par && !opt.quiet) std::printf("parallel layout: %s\n", par->layout.str().c_str());
    recipe = Recipe::from_name(opt.recipe);
    recipe.set_attention(opt.attention);
    validate_config(cfg, recipe);
    backend = make_backend(opt.backend == "auto" ? pick_backend(opt.quiet) : opt.backend);
    // Device-side checks are raised once per micro-batch (the synchronize below), not per op.
    backend->set_checks(Backend::Checks::deferred);
    model = std::make_unique<Model>(cfg, recipe, *backend, opt.seed);
    corpus = std::make_unique<TextCorpus>(opt.data);
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
    else adamw = std::make_unique<AdamW>(*backend, refs, ac);
    std::vector<ParamRef> ema_refs;
    for (Parameter* p : all) ema_refs.push_back({p->name, p->weight.view(), p->grad.view(), false});
    // The EMA lives in host memory whatever the device: one asynchronous device-to-host copy every
    // ema_every steps, folded in with decay^ema_every. With the model on the CPU its cores train,
    // so the fold takes one thread; beside a GPU it takes several, leaving two to the training loop.
    FP8MOE_CHECK(opt.ema_every >= 1, "--ema-every must be >= 1, got " << opt.ema_every);
    const int ema_threads =
        backend->device() == Device::cpu ? 1 : std::clamp(int(std::thread::hardware_concurrency()) - 2, 1, 8);
    ema = std::make_unique<ParameterEma>(ema_refs, float(std::pow(double(opt.ema_decay), double(opt.ema_every))),
                                         *backend, ema_threads);
    schedule = {opt.lr, opt.lr * opt.min_lr_ratio, std::max<int64_t>(1, int64_t(opt.warmup_frac * float(opt.steps))), opt.steps};
    fs::create_directories(opt.out_dir);
    ckpt_path = (fs::path(opt.out_dir) / "checkpoint.safetensors").string();
    if (opt.resume) load_checkpoint();
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
      tensors["ema." + all[i]->name] = ema->averages()[i].view();
    }
    std::vector<Tensor> m, v;  // the whole moments, gathered from the shards with ZeRO-1
    if (par) par->zero->gather_moments(m, v);
    for (size_t i = 0; i < refs.size(); ++i) {
      add("optimizer.exp_avg." + refs[i].name, par ? m[i] : adamw->first_moments()[i]);
      add("optimizer.exp_avg_sq." + refs[i].name, par ? v[i] : adamw->second_moments()[i]);
    }
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
                      {"model_config", config_to_json(cfg)}});
  }

  void load_checkpoint() {
    SafetensorsFile f = load_safetensors(ckpt_path);
    auto meta = [&](const char* key) {
      auto it = f.metadata.find(key);
      FP8MOE_CHECK(it != f.metadata.end(), ckpt_path << ": checkpoint metadata lacks '" << key << "'");
      return it->second;
    };
    FP8MOE_CHECK(meta("format") == "fp8moe-checkpoint-1", ckpt_path << ": not an fp8moe checkpoint");
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
      par->zero->set_steps(std::stoll(meta("optimizer_steps")));
    } else {
      for (size_t i = 0; i < refs.size(); ++i) {
        take("optimizer.exp_avg." + refs[i].name, adamw->first_moments()[i].view());
        take("optimizer.exp_avg_sq." + refs[i].name, adamw->second_moments()[i].view());
      }
      adamw->set_steps(std::stoll(meta("optimizer_steps")));
    }
    step = std::stoll(meta("step"));
    ema->set_updates(std::stoll(meta("ema_updates")));
    sampler->set_state({std::stoull(meta("sampler_epoch")), std::stoull(meta("sampler_index"))});
    FP8MOE_CHECK(meta("recipe") == recipe.name, ckpt_path << ": checkpoint was trained with recipe '" << meta("recipe")
                                                          << "', this run asks for '" << recipe.name << "'");
    const auto att = f.metadata.find("attention");  // absent before the option: exact
    const std::string attention = att == f.metadata.end() ? "exact" : att->second;
    FP8MOE_CHECK(attention == recipe.attention(), ckpt_path << ": checkpoint was trained with --attention " << attention
                                                            << ", this run asks for " << recipe.attention());
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
      sum += model->forward(tok, tgt).main_loss;
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
    const int64_t acts = model->saved_memory().total_bytes(), dev = backend->device_memory_in_use(),
                  peak = backend->device_memory_peak();
    j["memory"] = {{"master_weights", params}, {"gradients", params}, {"adam_moments", moments},
                   {"activations_kept", acts}, {"ema_host", params}, {"device_in_use", dev}, {"device_peak", peak}};
    if (par) par->report_memory(j["memory"], !opt.quiet);
    if (opt.quiet) return;
    const double mib = 1048576.0;
    std::printf("memory (%s, %s): master weights %.1f MiB, gradients %.1f MiB, AdamW moments %.1f MiB (%s), "
                "activations kept for backward %.1f MiB per micro-batch, EMA %.1f MiB in host memory%s\n",
                backend->name().c_str(), recipe.name.c_str(), double(params) / mib, double(params) / mib,
                double(moments) / mib, opt.moments.c_str(), double(acts) / mib, double(params) / mib,
                dev >= 0 ? (", device in use " + std::to_string(dev / 1048576) + " MiB, tensors at peak " +
                            std::to_string(peak / 1048576) + " MiB")
                               .c_str()
                         : "");
  }

  TrainSummary run() {
    const int64_t B = cfg.batch_size, S = cfg.seq_len;
    const int64_t start_step = step;
    const double flops_tok = train_flops_per_token(cfg, S);
    // MFU: model FLOPs (fwd + bwd) per second over the dense BF16 peak, for every recipe (so the
    // recipes compare on one scale).
    const double peak_tflops = opt.peak_tflops > 0 ? opt.peak_tflops : backend->peak_bf16_tflops();
    std::ofstream metrics;  // rank 0's
    if (!par || par->rank0())
      metrics.open(fs::path(opt.out_dir) / "metrics.jsonl", opt.resume ? std::ios::app : std::ios::trunc);
    if (!opt.quiet)
      std::printf("fp8moe train: %s (%.1fM params, %.1fM active), recipe %s%s, backend %s, data %s (%zu train / %zu val bytes)\n",
                  cfg.name.c_str(), double(count_parameters(cfg).total) / 1e6, double(count_parameters(cfg).activated) / 1e6,
                  recipe.name.c_str(), recipe.attention() == "bf16" ? " (attention bf16)" : "", backend->name().c_str(), corpus->source().c_str(), corpus->train().size(),
                  corpus->validation().size());
    TrainSummary sum;
    std::vector<int32_t> windows;
    Tensor tok = Tensor::host(DType::i32, {B, S}), tgt = Tensor::host(DType::i32, {B, S});
    double loss_acc = 0;
    int64_t loss_n = 0;
    auto t_start = std::chrono::steady_clock::now();
    int64_t tokens_done = 0;
    for (; step < opt.steps; ++step) {
      bool stop = stop_flag().load();
      if (par) {  // every rank stops at the same step
        std::vector<double> any{stop ? 1.0 : 0.0};
        par->sum(*backend, any);
        stop = any[0] > 0;
      }
      if (stop) {
        sum.interrupted = true;
        break;
      }
      if (opt.stop_at > 0 && step >= opt.stop_at) break;
      const auto t0 = std::chrono::steady_clock::now();
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
      for (int64_t m = 0; m < micro; ++m) {
        sampler->next(int(B), windows);
        if (par && m % dp != par->dp_rank()) continue;
        fill_batch(windows.data(), tok, tgt);
        StepStats st;
        try {
          st = model->forward_backward(tok, tgt, 1.0 / double(micro));
          backend->synchronize();
        } catch (const Error& e) {
          // A NaN/Inf reaching a quantizer is reported as what it is: a diverged step.
          FP8MOE_CHECK(false, "step " << step << ": forward/backward failed: " << e.what() << "; first non-finite tensor: "
                                      << first_non_finite() << ". Nothing was saved over the last checkpoint.");
        }
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
      if (par) {  // every rank's losses and loads, summed in rank order
        std::vector<double> l{agg.loss, agg.main_loss, agg.mtp_loss, agg.balance_loss};
        par->sum(*backend, l);
        agg.loss = l[0], agg.main_loss = l[1], agg.mtp_loss = l[2], agg.balance_loss = l[3];
        par->sum(*backend, loads);
        par->zero->reduce_gradients();
      }
      const double norm = par ? par->zero->grad_norm() : global_grad_norm(*backend, refs);
      FP8MOE_CHECK(std::isfinite(agg.loss) && std::isfinite(norm),
                   "step " << step << ": non-finite " << (std::isfinite(agg.loss) ? "gradient norm" : "loss") << " (loss "
                           << agg.loss << ", grad norm " << norm << "); first non-finite tensor: " << first_non_finite()
                           << ". Nothing was saved over the last checkpoint.");
      const float lr = schedule.at(step);
      ema->fence();  // the last snapshot's copies finish before the weights change
      if (par) par->zero->step(lr, clip_scale(norm, opt.clip));
      else adamw->step(lr, clip_scale(norm, opt.clip));
      if (!loads.empty()) model->update_routing_bias(loads, cfg.bias_update_speed);
      if ((step + 1) % opt.ema_every == 0) ema->update_async();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double tok_s = double(B * S * micro) / dt;  // the global batch's
      tokens_done += B * S * micro;
      loss_acc += agg.main_loss;
      ++loss_n;

      nlohmann::json j{{"step", step},       {"loss", agg.main_loss},          {"total_loss", agg.loss},
                       {"mtp_loss", agg.mtp_loss}, {"mtp_weight", mtp_weight}, {"balance_loss", agg.balance_loss}, {"lr", lr},
                       {"grad_norm", norm},  {"tokens_per_s", tok_s},          {"tflops", flops_tok * tok_s / 1e12},
                       {"rss_bytes", resident_bytes()}};
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
      }
      if (step == start_step) report_memory(j);
      metrics << j.dump() << "\n";
      metrics.flush();
      if (!opt.quiet && ((step + 1) % opt.log_every == 0 || last || step == 0))
        std::printf("step %6lld | loss %.4f | val %s | lr %.2e | norm %.3f | %.0f tok/s | %.3f TFLOPS%s | rss %.0f MiB%s\n",
                    (long long)step, agg.main_loss,
                    j.contains("val_loss") ? std::to_string(j["val_loss"].get<double>()).substr(0, 6).c_str() : "  -   ",
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
      }
    }
    if (sum.interrupted && opt.ckpt_every > 0) {
      save_checkpoint();
      if (!opt.quiet) std::printf("interrupted: checkpoint written at step %lld to %s\n", (long long)step, ckpt_path.c_str());
    }
    ema->wait();
    if (loss_n > 0) sum.final_loss = loss_acc / double(loss_n);
    sum.steps = step;
    sum.writer = !par || par->rank0();
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    sum.tokens_per_s = double(tokens_done) / std::max(wall, 1e-9);
    return sum;
  }
};

Trainer::Trainer(TrainOptions opt) : impl_(std::make_unique<Impl>(std::move(opt))) {}
Trainer::~Trainer() = default;
TrainSummary Trainer::run() { return impl_->run(); }

}  // namespace fp8moe
