// The pipeline executor (include/fp8moe/pipeline_executor.hpp): one rank's op list of a schedule
// run on the model's trunk, embedding and head, with the activations and gradients between ranks
// through Comm's isend/irecv.
//
// A message is named by the pass that produced it (schedule.hpp), so every tensor here is keyed
// by (micro-batch, stage): the input activation of F(m, s), the output-gradient of B(m, s), and
// what is waiting to be sent. A compute op first waits for all communication posted before it,
// as the simulator assumes; the rank ends with a wait. Sends and receives are posted on a
// communication stream after an event at the end of the compute so far, and the compute stream
// waits for the communication stream once the receives are in (the copy of a staged message back
// to the device runs there).
#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>

#include "fp8moe/error.hpp"
#include "fp8moe/paired_chunk.hpp"
#include "fp8moe/pipeline_executor.hpp"
#include "model/model_internal.hpp"
#include "parallel/runtime/wgrad_stream.hpp"

namespace fp8moe::pipeline {

namespace {

using Clock = std::chrono::steady_clock;

struct Key {
  int micro_batch = -1, stage = -1;
  friend auto operator<=>(const Key&, const Key&) = default;
};
Key key(const Pass& p) { return {p.micro_batch, p.stage}; }

// A message of one ordered pair of ranks: (gradient?, micro-batch, stage of its producer).
struct Message {
  bool gradient = false;
  Pass pass;
  friend bool operator==(const Message&, const Message&) = default;
};

// Comm has one message stream per pair of ranks: a send must be posted in the order its receive is.
void check_message_order(const Schedule& s) {
  std::map<std::pair<int, int>, std::vector<Message>> sent, received;  // (from, to)
  for (int r = 0; r < s.num_ranks; ++r)
    for (const Op& op : s.rank_ops[size_t(r)]) {
      const bool grad = op.kind == OpKind::SendGradient || op.kind == OpKind::RecvGradient;
      if (op.kind == OpKind::SendActivation || op.kind == OpKind::SendGradient) sent[{r, op.peer}].push_back({grad, op.pass});
      if (op.kind == OpKind::RecvActivation || op.kind == OpKind::RecvGradient) received[{op.peer, r}].push_back({grad, op.pass});
    }
  for (const auto& [pair, msgs] : sent)
    FP8MOE_CHECK(received[pair] == msgs, "pipeline: " << method_name(s.method) << ": rank " << pair.first << " sends to rank "
                                                      << pair.second << " in another order than that rank receives");
}

// The per-micro-batch numbers every rank needs, in one f64 row per micro-batch so that one sum
// over the pipeline ranks gathers them (each is produced on one rank, zeros elsewhere: exact).
}  // namespace

struct Executor::Impl {
  Model& model;
  Schedule schedule;
  StageSplit split;
  Comm* comm;
  int me = 0;
  std::vector<Layer*> trunk;
  std::vector<StageShard> shards;  // what each pipeline rank holds
  std::vector<ExecutedOp> executed;
  int fail_at = -1;
  FbMode fb_mode = FbMode::overlap;
  DeviceTimes device_times = DeviceTimes::off;
  PairedChunk pair;
  Stream comm_stream;
  Event compute_done, comm_done;
  bool in_pair = false;  // issuing an overlapped F&B chunk: no synchronization per component
  bool wgrad_stream = true;  // set_wgrad_stream
  std::unique_ptr<WgradStream> wgrad;  // made at first use

  // One run's state.
  struct Posted {
    CommRequest request;
    Tensor keep;  // the tensor in flight
  };
  std::vector<Batch> batches;
  std::map<Key, std::vector<std::unique_ptr<Saved>>> saved;
  std::map<Key, Tensor> act_in, act_out, grad_in, grad_out, embed_grad;
  std::vector<Posted> pending;
  Tensor table;  // [micro-batch, Model::stats_width()] f64 on the backend: each batch's Batch::stats
  Clock::time_point t0;
  ExecutedOp* current = nullptr;
  // Bytes each pass's forward kept (counted when kept: a backward may shrink Saved::kept).
  std::map<Key, int64_t> pass_bytes;
  int64_t saved_bytes = 0, peak_bytes = 0;

  void keep(const Key& k, const Saved& s) {
    for (const MemoryItem& i : s.kept) pass_bytes[k] += i.bytes, saved_bytes += i.bytes;
    peak_bytes = std::max(peak_bytes, saved_bytes);
  }
  void release(const Key& k) {
    saved_bytes -= pass_bytes[k];
    pass_bytes.erase(k);
  }

  Impl(Model& m, Schedule s, StageSplit sp, Comm* c)
      : model(m), schedule(std::move(s)), split(std::move(sp)), comm(c), pair(m.backend()),
        comm_stream(m.backend().new_stream()), compute_done(m.backend().new_event()), comm_done(m.backend().new_event()) {
    me = comm ? comm->rank() : 0;
    trunk = model.trunk();
    FP8MOE_CHECK((comm ? comm->size() : 1) == schedule.num_ranks,
                 "pipeline: " << method_name(schedule.method) << " runs on " << schedule.num_ranks << " ranks, the pipeline group has "
                              << (comm ? comm->size() : 1));
    FP8MOE_CHECK(split.stages() == schedule.num_stages && split.first.front() == 0 && split.first.back() == int(trunk.size()),
                 "pipeline: the split " << split.str() << " does not cut the " << trunk.size() << " trunk sublayers into the "
                                        << schedule.num_stages << " stages of " << method_name(schedule.method));
    check_message_order(schedule);
    for (int r = 0; r < schedule.num_ranks; ++r) shards.push_back(stage_shard(schedule, split, r));
    const StageShard& held = model.stage_shard();
    FP8MOE_CHECK(held.whole() || (held.sublayers == shards[size_t(me)].sublayers &&
                                  held.embedding == shards[size_t(me)].embedding && held.head == shards[size_t(me)].head),
                 "pipeline: rank " << me << "'s model holds a stage shard other than its stages'");
  }

  double now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }

  // Runs `f` as a component of the current op. With device times the device has run it when
  // its end is taken, except inside an overlapped chunk (a synchronization there would
  // serialize the two streams): there the times are the host's issue of the work.
  template <class F>
  void component(std::string name, F&& f) {
    const double a = now();
    f();
    if (device_times == DeviceTimes::components && !in_pair) model.backend().synchronize();
    current->components.push_back({std::move(name), a, now()});
  }

  void wait_posted() {
    if (pending.empty()) return;
    component("wait", [&] {
      for (Posted& p : pending) p.request.wait();
      comm_done.record(comm_stream);
      comm_done.wait(model.backend().stream());
    });
    current->wait += current->components.back().end - current->components.back().start;
    pending.clear();
  }

  bool last_stage(int s) const { return s == schedule.num_stages - 1; }
  bool here(int micro_batch, int stage) const { return schedule.rank_of({micro_batch, stage}) == me; }

  static Tensor take(std::map<Key, Tensor>& m, const Key& k, const char* what) {
    auto it = m.find(k);
    FP8MOE_CHECK(it != m.end(), "pipeline: no " << what << " for micro-batch " << k.micro_batch << ", stage " << k.stage);
    Tensor t = std::move(it->second);
    m.erase(it);
    return t;
  }

  using Steps = std::vector<std::function<void()>>;

  // F(p) as steps: the input (the embedding on stage 0), each sublayer, then the head on the last
  // stage or the output's way on. Run in a row by F, interleaved with a B's by F&B.
  Steps forward_steps(const Pass& p) {
    const Batch& b = batches[size_t(p.micro_batch)];
    auto x = std::make_shared<Tensor>();
    Steps steps;
    steps.push_back([this, p, x, &b] {
      if (p.stage == 0) component("F embed", [&] { *x = model.embed_forward(b); });
      else *x = take(act_in, key(p), "input activation");
    });
    for (int i = split.first[size_t(p.stage)]; i < split.first[size_t(p.stage) + 1]; ++i)
      steps.push_back([this, p, x, i, &b] {
        Layer& layer = *trunk[size_t(i)];
        auto& kept = saved[key(p)];
        component("F " + layer.name(), [&] {
          Tensor y;
          kept.push_back(layer.forward(b, *x, y));
          *x = y;
        });
        keep(key(p), *kept.back());
      });
    steps.push_back([this, p, x, &b] {
      if (last_stage(p.stage)) {
        // The head's forward and backward end the forward: the B of this stage starts from dh.
        component("F head", [&] {
          grad_in[key(p)] = model.head_forward_backward(b, *x, b.grad_scale, true);
          // The MTP module's kept tensors live only inside the call, on top of the trunk's.
          peak_bytes = std::max(peak_bytes, saved_bytes + model.saved_memory().total_bytes());
        });
      } else if (here(p.micro_batch, p.stage + 1)) {
        act_in[{p.micro_batch, p.stage + 1}] = *x;  // DualPipeV's turn: the next stage is on this rank
      } else {
        act_out[key(p)] = *x;
      }
    });
    return steps;
  }

  void weight(const Pass& p) {
    auto it = saved.find(key(p));
    FP8MOE_CHECK(it != saved.end(), "pipeline: W of micro-batch " << p.micro_batch << ", stage " << p.stage << " before its F");
    const Batch& b = batches[size_t(p.micro_batch)];
    const int first = split.first[size_t(p.stage)];
    for (int i = split.first[size_t(p.stage) + 1]; i-- > first;)
      component("W " + trunk[size_t(i)]->name(), [&] { trunk[size_t(i)]->backward_weight(b, *it->second[size_t(i - first)]); });
    release(key(p));
    saved.erase(it);
    if (p.stage == 0) {
      const Tensor dx0 = take(embed_grad, key(p), "embedding gradient");
      component("W embed", [&] { model.embed_backward(b, dx0); });
    }
  }

  // B(p) as steps, from the last sublayer down. Input-only when `defers`: the weight gradients
  // wait for W(p); otherwise each sublayer's weight gradient follows its input gradient, as in
  // Model's own loop.
  Steps backward_steps(const Pass& p, bool defers) {
    FP8MOE_CHECK(saved.count(key(p)), "pipeline: B of micro-batch " << p.micro_batch << ", stage " << p.stage << " before its F");
    const Batch& b = batches[size_t(p.micro_batch)];
    auto dy = std::make_shared<Tensor>();
    const int first = split.first[size_t(p.stage)];
    Steps steps;
    steps.push_back([this, p, dy] { *dy = take(grad_in, key(p), "output gradient"); });
    for (int i = split.first[size_t(p.stage) + 1]; i-- > first;)
      steps.push_back([this, p, dy, i, first, defers, &b] {
        Layer& layer = *trunk[size_t(i)];
        Saved& s = *saved.at(key(p))[size_t(i - first)];
        component("B " + layer.name(), [&] {
          Tensor dx;
          layer.backward_input(b, s, *dy, dx);
          *dy = dx;
        });
        if (!defers) component("W " + layer.name(), [&] { weight_grad([&] { layer.backward_weight(b, s); }); });
      });
    steps.push_back([this, p, dy, defers, &b] {
      if (wgrad) wgrad->join();  // the gradients complete before they leave the pass
      if (p.stage == 0) {
        if (defers) embed_grad[key(p)] = *dy;
        else component("W embed", [&] { model.embed_backward(b, *dy); });
      } else if (here(p.micro_batch, p.stage - 1)) {
        grad_in[{p.micro_batch, p.stage - 1}] = *dy;
      } else {
        grad_out[key(p)] = *dy;
      }
      if (!defers) {
        release(key(p));
        saved.erase(key(p));
      }
    });
    return steps;
  }

  // A sublayer's W queued beside the next sublayer's B (wgrad_stream.hpp), where that is on and
  // the B runs on the current stream alone: not in an overlapped F&B chunk (whose backward half
  // is already the second stream) nor with device times (each component timed on its own).
  void weight_grad(const std::function<void()>& w) {
    if (!wgrad_stream || in_pair || device_times != DeviceTimes::off) {
      if (wgrad) wgrad->join();
      w();
      return;
    }
    if (!wgrad) wgrad = std::make_unique<WgradStream>(model.backend());
    wgrad->run(w);
  }

  static void run_steps(const Steps& steps) {
    for (const auto& f : steps) f();
  }

  // DualPipe's F&B chunk (report Figure 4): the forward's and the backward's sublayers taken in
  // turn, forward attention first, then the backward's last sublayer (the MLP or MoE, its
  // combine and dispatch inside), on two streams (paired_chunk.hpp), so that the exchanges and
  // host reads of one half meet the computation of the other. Both are of different
  // micro-batches: no activation passes between them. What they may share: a trunk sublayer's
  // parameters and gradients (a pair of one stage) and the embedding (read by stage 0's forward
  // and the MTP module in the head, its gradient added by both and by stage 0's backward).
  void forward_backward(const Pass& f, const Pass& b) {
    const Steps fs = forward_steps(f), bs = backward_steps(b, false);
    std::vector<ChunkStep> fc, bc;
    const int nf = split.size(f.stage), nb = split.size(b.stage);
    for (int k = 0; k < int(fs.size()); ++k) {
      std::vector<int> shared;
      if (k == 0 && f.stage == 0) shared.push_back(kEmbedding);
      if (k > 0 && k <= nf) shared.push_back(split.first[size_t(f.stage)] + k - 1);
      if (k == nf + 1 && last_stage(f.stage)) shared.push_back(kEmbedding);
      fc.push_back({fs[size_t(k)], std::move(shared)});
    }
    for (int k = 0; k < int(bs.size()); ++k) {  // sublayers from the last down
      std::vector<int> shared;
      if (k > 0 && k <= nb) shared.push_back(split.first[size_t(b.stage) + 1] - k);
      if (k == nb + 1 && b.stage == 0) shared.push_back(kEmbedding);
      bc.push_back({bs[size_t(k)], std::move(shared)});
    }
    in_pair = fb_mode == FbMode::overlap;
    struct Done {
      bool& flag;
      ~Done() { flag = false; }
    } done{in_pair};
    pair.run(fc, bc, fb_mode);
  }
  static constexpr int kEmbedding = -1;  // a resource id beside the trunk sublayers' indices

  void post(const Op& op) {
    Backend& be = model.backend();
    const bool send = op.kind == OpKind::SendActivation || op.kind == OpKind::SendGradient;
    const bool activation = op.kind == OpKind::SendActivation || op.kind == OpKind::RecvActivation;
    Posted posted;
    if (send) {
      posted.keep = take(activation ? act_out : grad_out, key(op.pass), activation ? "activation to send" : "gradient to send");
    } else {
      const Batch& b = batches[size_t(op.pass.micro_batch)];
      posted.keep = be.empty(model.recipe().act_dtype, {b.tokens_count(), model.config().hidden_size});
      // The stage that reads it: the next one for an activation, the one before for a gradient.
      (activation ? act_in : grad_in)[{op.pass.micro_batch, op.pass.stage + (activation ? 1 : -1)}] = posted.keep;
    }
    // On the communication stream after the compute so far: a send's producer, and for a
    // receive its buffer's allocation and the earlier users of that memory (the compute
    // stream's, whose kernels may still be queued).
    compute_done.record(be.stream());
    compute_done.wait(comm_stream);
    posted.request = send ? comm->isend(posted.keep.view(), op.peer, comm_stream)
                          : comm->irecv(posted.keep.view(), op.peer, comm_stream);
    pending.push_back(std::move(posted));
  }

  void execute(const Op& op) {
    switch (op.kind) {
      case OpKind::Forward:
        run_steps(forward_steps(op.pass));
        break;
      case OpKind::Backward:
        run_steps(backward_steps(op.pass, op.defers_weights));
        break;
      case OpKind::Weight:
        weight(op.pass);
        break;
      case OpKind::ForwardBackward:
        forward_backward(op.pass, op.backward_pass);
        break;
      default:
        post(op);
        break;
    }
  }

  std::vector<StepStats> run(const std::vector<Tensor>& tokens, const std::vector<Tensor>& targets, double grad_scale) {
    const int M = schedule.num_micro_batches;
    FP8MOE_CHECK(int(tokens.size()) == M && int(targets.size()) == M,
                 "pipeline: " << method_name(schedule.method) << " runs " << M << " micro-batches, given " << tokens.size()
                              << " token and " << targets.size() << " target tensors");
    batches.clear();
    const int64_t W = model.stats_width();
    table = model.backend().zeros(DType::f64, {int64_t(M) * W});
    for (int m = 0; m < M; ++m) {
      batches.push_back(model.make_batch(tokens[size_t(m)].view(), targets[size_t(m)].view(),
                                         model::rows_of(table, m * W, W)));
      batches.back().grad_scale = grad_scale;
    }
    if (graphs && graph_note.empty() && can_graph()) {
      const GraphKey k = graph_key(grad_scale);
      if (recorded.graph.defined() && recorded.key == k) return replay();
      if (last_key == k && record()) return replay();
      last_key = k;
    }
    run_ops();
    return gather();
  }

  // ---- Steps as graphs (set_graphs).
  struct GraphKey {
    std::vector<int64_t> shapes;  // per micro-batch: batch, seq, main_count, mtp_count
    double grad_scale = 0, mtp_weight = 0;
    FbMode fb = FbMode::overlap;
    friend bool operator==(const GraphKey&, const GraphKey&) = default;
  };
  struct Recorded {
    GraphKey key;
    Graph graph;
    std::vector<Batch> batches;  // the tensors the graph reads and writes
    Tensor table;
  };
  bool graphs = false;
  std::string graph_note;
  GraphKey last_key;
  Recorded recorded;
  int64_t replays = 0;

  bool can_graph() const {
    const Backend& be = model.backend();
    return schedule.num_ranks == 1 && (!comm || comm->size() == 1) && device_times == DeviceTimes::off && fail_at < 0 &&
           be.can_capture() && be.checks() == Backend::Checks::deferred;
  }
  // Everything of the step that the recorded work takes from the host.
  GraphKey graph_key(double grad_scale) const {
    GraphKey k;
    for (const Batch& b : batches) k.shapes.insert(k.shapes.end(), {b.batch, b.seq, b.main_count, b.mtp_count});
    k.grad_scale = grad_scale;
    k.mtp_weight = model.config().mtp_loss_weight;
    k.fb = fb_mode;
    return k;
  }
  // Records this step's work (not run yet: replay() runs it). False, with graphs off and the
  // reason in graph_note, when the capture fails: nothing ran, so the step runs as usual.
  bool record() {
    Backend& be = model.backend();
    recorded = Recorded{};  // the graph before goes first: its blocks are the new one's to reuse
    Graph g;
    try {
      g = be.capture([&] { run_ops(); });
    } catch (const Error& e) {
      graph_note = e.what();
      return false;
    }
    recorded = Recorded{graph_key(batches.front().grad_scale), std::move(g), batches, table};
    return true;
  }
  // The step as the recorded graph: this step's inputs copied into the recorded batches'.
  std::vector<StepStats> replay() {
    Backend& be = model.backend();
    for (size_t m = 0; m < batches.size(); ++m) {
      const Batch &from = batches[m], &to = recorded.batches[m];
      for (const auto f : {&Batch::tokens, &Batch::targets, &Batch::positions, &Batch::mtp_ids, &Batch::mtp_targets})
        if ((to.*f).defined() && (to.*f).view().data != (from.*f).view().data) be.copy((to.*f).view(), (from.*f).view());
    }
    if (recorded.table.view().data != table.view().data) be.zero(recorded.table.view());
    batches = recorded.batches;
    table = recorded.table;
    recorded.graph.replay(be.stream());
    ++replays;
    return gather();
  }

  // The schedule's ops of this rank over `batches`.
  void run_ops() {
    // What a step that failed part-way left behind goes with it.
    for (auto* m : {&act_in, &act_out, &grad_in, &grad_out, &embed_grad}) m->clear();
    saved.clear();
    pass_bytes.clear();
    pending.clear();
    executed.clear();
    saved_bytes = peak_bytes = 0;
    executed.reserve(schedule.rank_ops[size_t(me)].size());
    const std::shared_ptr<void> conversions = model.share_weight_conversions();
    t0 = Clock::now();
    const std::vector<Op>& ops = schedule.rank_ops[size_t(me)];
    for (size_t i = 0; i < ops.size(); ++i) {
      FP8MOE_CHECK(int(i) != fail_at, "pipeline rank " << me << ": failing at op " << i << " as FP8MOE_PIPELINE_FAIL_AT asks");
      executed.push_back({ops[i], now(), 0, 0, {}});
      current = &executed.back();
      if (is_compute(ops[i].kind)) {
        wait_posted();
        execute(ops[i]);
        if (device_times != DeviceTimes::off) model.backend().synchronize();
      } else {
        post(ops[i]);
      }
      current->end = now();
    }
    if (!executed.empty()) {  // the rank's last wait, counted in its last op (its busy time stays its own)
      current = &executed.back();
      wait_posted();
      current->end = std::max(current->end, now());
    }
    current = nullptr;
    FP8MOE_CHECK(saved.empty() && act_in.empty() && grad_in.empty() && act_out.empty() && grad_out.empty() && embed_grad.empty(),
                 "pipeline rank " << me << ": " << method_name(schedule.method) << " left work undone ("
                                  << saved.size() << " passes without W, " << act_out.size() + grad_out.size() << " unsent)");
  }

  // Every micro-batch's StepStats from the step's one read-back of the table. With several
  // pipeline ranks each entry is written by the rank that holds its layer (the others' are zeros),
  // so that the all-reduce's sum is exact.
  std::vector<StepStats> gather() {
    Backend& be = model.backend();
    if (comm && comm->size() > 1 && table.numel() > 0) comm->all_reduce(table.view(), be.stream());
    const Tensor h = be.to_host(table);
    std::vector<StepStats> out;
    for (size_t m = 0; m < batches.size(); ++m)
      out.push_back(model.step_stats(batches[m], h.ptr<double>() + int64_t(m) * model.stats_width()));
    return out;
  }

  // Forward only along direction 0's stages: each rank runs the stages it holds there, the
  // activation going on to the next stage's rank; the last stage's rank broadcasts the losses.
  // The operations of Model::forward, in its order: the same bits.
  StepStats forward(const Tensor& tokens, const Tensor& targets) {
    Backend& be = model.backend();
    const Batch b = model.make_batch(tokens.view(), targets.view());
    const std::vector<int>& rank_of = schedule.stage_rank[0];
    Tensor x;
    for (int s = 0; s < schedule.num_stages; ++s) {
      const int r = rank_of[size_t(s)];
      if (r != me) continue;
      if (s == 0) {
        x = model.embed_forward(b);
      } else if (rank_of[size_t(s) - 1] != me) {
        x = be.empty(model.recipe().act_dtype, {b.tokens_count(), model.config().hidden_size});
        comm->recv(x.view(), rank_of[size_t(s) - 1], be.stream());
      }
      for (int i = split.first[size_t(s)]; i < split.first[size_t(s) + 1]; ++i) {
        Tensor y;
        trunk[size_t(i)]->forward(b, x, y);
        x = y;
      }
      if (s + 1 < schedule.num_stages) {
        if (rank_of[size_t(s) + 1] != me) comm->send(x.view(), rank_of[size_t(s) + 1], be.stream());
        continue;
      }
      model.head_forward_backward(b, x, 1.0, false);
    }
    // Every rank's part, exact: one rank writes each entry, the others zeros.
    if (comm && comm->size() > 1) comm->all_reduce(b.stats.view(), be.stream());
    return model.step_stats(b, be.to_host(b.stats).ptr<double>());
  }

  // A model holding only its stages' parameters: each parameter's gradient summed over the ranks
  // holding it, in rank order. The parameters are grouped by the ranks holding them (the same
  // groups, in the same order, on every rank); in each group the lowest rank adds the others'
  // flat gradients to its own one after the other and sends the sum back: the bits of the
  // all-reduce of whole models, whose other ranks add zeros.
  void sum_held_gradients() {
    Backend& be = model.backend();
    const ModelConfig& cfg = model.config();
    std::map<uint64_t, std::vector<Parameter*>> groups;  // by the mask of the ranks holding them
    for (Parameter& p : model.parameters()) {
      if (!p.trainable) continue;
      uint64_t mask = 0;
      for (size_t r = 0; r < shards.size(); ++r)
        if (shards[r].holds(cfg, p.name)) mask |= uint64_t(1) << r;
      if (std::popcount(mask) > 1) groups[mask].push_back(&p);
    }
    for (const auto& [mask, params] : groups) {
      Tensor flat = pack_gradients(params);
      const int root = std::countr_zero(mask);
      if (me == root) {
        Tensor other = be.empty(flat.dtype(), {flat.numel()});
        for (int r = root + 1; r < int(shards.size()); ++r)
          if (mask >> r & 1) {
            comm->recv(other.view(), r, be.stream());
            be.axpy(1.0, other.view(), 1.0, flat.view());
          }
        for (int r = root + 1; r < int(shards.size()); ++r)
          if (mask >> r & 1) comm->send(flat.view(), r, be.stream());
      } else {
        comm->send(flat.view(), root, be.stream());
        comm->recv(flat.view(), root, be.stream());
      }
      unpack_gradients(params, flat);
    }
  }

  // The gradients of `params` one after another in one flat tensor, and back.
  Tensor pack_gradients(const std::vector<Parameter*>& params) {
    Backend& be = model.backend();
    int64_t n = 0;
    for (Parameter* p : params) n += p->grad.numel();
    const DType dt = params.empty() ? DType::f32 : params[0]->grad.dtype();
    Tensor flat = be.empty(dt, {n});
    int64_t at = 0;
    for (Parameter* p : params) {
      const TensorView& g = p->grad.view();
      FP8MOE_CHECK(g.dtype == dt && g.is_contiguous(), "pipeline: gradient of " << p->name << " is " << g.str());
      be.copy(elements(flat.view(), at, g.numel()), elements(g, 0, g.numel()));
      at += g.numel();
    }
    return flat;
  }
  void unpack_gradients(const std::vector<Parameter*>& params, const Tensor& flat) {
    int64_t at = 0;
    for (Parameter* p : params) {
      const TensorView& g = p->grad.view();
      model.backend().copy(elements(g, 0, g.numel()), elements(flat.view(), at, g.numel()));
      at += g.numel();
    }
  }
  // n elements of a contiguous tensor from element `offset`, as 1-D.
  static TensorView elements(const TensorView& v, int64_t offset, int64_t n) {
    return TensorView(static_cast<char*>(v.data) + offset * int64_t(dtype_size(v.dtype)), v.dtype, {n}, v.device);
  }

  // One flat buffer of every trainable gradient, summed once.
  void sum_gradients() {
    if (!comm || comm->size() == 1) return;
    if (!model.stage_shard().whole()) return sum_held_gradients();
    std::vector<Parameter*> params;
    for (Parameter& p : model.parameters())
      if (p.trainable) params.push_back(&p);
    Tensor flat = pack_gradients(params);
    comm->all_reduce(flat.view(), model.backend().stream());
    unpack_gradients(params, flat);
  }
};

Executor::Executor(Model& model, Schedule schedule, StageSplit split, Comm* comm)
    : impl_(std::make_unique<Impl>(model, std::move(schedule), std::move(split), comm)) {}
Executor::~Executor() = default;
const Schedule& Executor::schedule() const { return impl_->schedule; }
const StageSplit& Executor::split() const { return impl_->split; }
int Executor::rank() const { return impl_->me; }
std::vector<StepStats> Executor::run(const std::vector<Tensor>& tokens, const std::vector<Tensor>& targets,
                                     double grad_scale) {
  return impl_->run(tokens, targets, grad_scale);
}
void Executor::sum_gradients() { impl_->sum_gradients(); }
StepStats Executor::forward(const Tensor& tokens, const Tensor& targets) { return impl_->forward(tokens, targets); }
const std::vector<ExecutedOp>& Executor::executed() const { return impl_->executed; }
int64_t Executor::peak_saved_bytes() const { return impl_->peak_bytes; }
void Executor::fail_at(int op_index) { impl_->fail_at = op_index; }
void Executor::set_fb_mode(FbMode mode) { impl_->fb_mode = mode; }
FbMode Executor::fb_mode() const { return impl_->fb_mode; }
void Executor::set_device_times(DeviceTimes times) { impl_->device_times = times; }
void Executor::set_graphs(bool on) { impl_->graphs = on; }
void Executor::set_wgrad_stream(bool on) { impl_->wgrad_stream = on; }
int64_t Executor::graph_replays() const { return impl_->replays; }
const std::string& Executor::graph_note() const { return impl_->graph_note; }

}  // namespace fp8moe::pipeline
