// The NVLink transport of the expert-parallel layer (ep_nvlink.hpp) over src/cuda/ep/'s kernels.
#include "ep_nvlink.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "comm/comm_checks.hpp"
#include "ep_exchange.hpp"
#include "fp8moe/error.hpp"

#ifdef FP8MOE_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/ep/ep_api.hpp"
#include "cuda/runtime/cuda_check.hpp"
#endif

namespace fp8moe::ep {

namespace {

// Why this process cannot be a rank of the NVLink transport ("" when it can).
std::string why_not_here(Backend& be) {
#ifdef FP8MOE_HAVE_CUDA
  if (be.device() != Device::cuda) return "the backend is " + be.name() + ", not cuda";
  const cudaDeviceProp& p = cuda::device_props();
  if (p.major != 9 || p.minor != 0)
    return std::string(p.name) + " is sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", not sm_90";
  return "";
#else
  (void)be;
  return "this build has no CUDA";
#endif
}

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// Why the group of `l` cannot use the transport, from every rank's (host, why_not_here); "" if it can.
std::string why_not(const ParallelLayout& l, DType act, const std::vector<std::string>& ranks) {
  std::ostringstream o;
  for (size_t q = 0; q < ranks.size(); ++q) {
    const size_t cut = ranks[q].find('\n');
    const std::string host = ranks[q].substr(0, cut), why = ranks[q].substr(cut + 1);
    if (!why.empty()) return (o << "expert-parallel rank " << q << ": " << why, o.str());
    const std::string host0 = ranks[0].substr(0, ranks[0].find('\n'));
    if (host != host0)
      return (o << "expert-parallel rank " << q << " is on host '" << host << "', rank 0 on '" << host0
                << "': peer memory reaches the GPUs of one host",
              o.str());
  }
  if (l.ep > 8) return (o << "--ep " << l.ep << ": the kernels serve at most 8 ranks of one host", o.str());
  if (act != DType::f32)
    return (o << "activations in " << dtype_name(act) << ": the kernels combine into f32 with f32 weights", o.str());
  return "";
}

}  // namespace

bool use_nvlink(Backend& be, Comm& ep, const ParallelLayout& l, DType act) {
  if (l.ep_transport == "comm") return false;
  FP8MOE_CHECK(l.ep_transport == "nvlink" || l.ep_transport == "auto",
               "--ep-transport must be comm, nvlink or auto, got '" << l.ep_transport << "'");
  const std::string why = why_not(l, act, ep.exchange(host_name() + "\n" + why_not_here(be)));
  FP8MOE_CHECK(why.empty() || l.ep_transport == "auto", "--ep-transport nvlink: " << why);
  return why.empty();
}

#ifdef FP8MOE_HAVE_CUDA

namespace {

using cuda::ep::EpConfig;
using cuda::ep::EpGroup;
using cuda::ep::EpRank;

class CudaNvlink final : public NvlinkTransport {
 public:
  CudaNvlink(Comm& ep, const ParallelLayout& l, int64_t hidden, int64_t topk) : ep_(ep) {
    cfg_.ranks = int(l.ep);
    cfg_.hidden = hidden;
    cfg_.topk = topk;
    cfg_.experts = l.experts;
    // --ranks-per-node: the group's nodes are runs of ranks of this host, and the dispatch takes
    // two hops (one across to the same in-node index of each node holding a row's experts, then
    // inside that node), as it would over several nodes.
    cfg_.ranks_per_node = l.nodes > 1 ? int(l.ranks_per_node) : 0;
    if (l.comm_sms > 0) cfg_.num_sms = int(l.comm_sms);  // --comm-sms; else the kernels' default
    // A peer late by a checkpoint write or a slow first step is not a dead one: the kernels wait
    // as long as the communicator's blocking calls do.
    cfg_.timeout_s = comm_detail::timeout_s();
    FP8MOE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaNvlink() override { cudaEventDestroy(event_); }

  Dispatched dispatch(Backend& be, const Tensor& x, const Tensor& w, const Tensor& idx, ScaleMode mode) override {
    const int64_t T = x.size(0), D = x.size(1), K = idx.size(1);
    FP8MOE_CHECK(D == cfg_.hidden && K == cfg_.topk && w.dtype() == DType::f32 && w.size(0) == T && idx.size(0) == T,
                 "nvlink dispatch: x " << x.view().str() << ", w " << w.view().str() << ", idx " << idx.view().str()
                                       << " for hidden " << cfg_.hidden << ", top-" << cfg_.topk << ", f32 weights");
    reserve(be, T);
    EpRank& r = group_->rank(0);
    QuantizedTensor q = be.empty_quantized(T, D, DType::e4m3, ScaleKind::tile_1x128);  // scales [G, ld(T)]
    be.quantize_1x128(x.view(), q, mode);
    slot_row_ = rows_tensor(be, DType::i32, T, K);
    follow(be.stream().native(), r.stream());
    r.notify(idx.view());
    const cuda::ep::EpCounts& counts = r.counts();
    r.dispatch(q.view(), w.view(), idx.view(), slot_row_.view());
    follow(r.stream(), be.stream().native());
    // Copied out before the next step: the peers overwrite the buffer once this rank starts it.
    const EpRank::Received got = r.received();
    Dispatched d;
    d.x = rows_tensor(be, DType::f32, got.rows, D);
    d.weights = rows_tensor(be, DType::f32, got.rows, K);
    d.ids = rows_tensor(be, DType::i32, got.rows, K);
    if (got.rows > 0) {
      be.dequantize(got.x, d.x.view());
      be.copy(d.weights.view(), got.weights);
      be.copy(d.ids.view(), got.ids);
    }
    d.recv_counts = counts.recv_counts(r.rank());
    const int me = r.rank(), R = cfg_.ranks_per_node > 0 ? cfg_.ranks_per_node : cfg_.ranks;
    for (int q = 0; q < cfg_.ranks; ++q) {
      if (q == me || q / R != me / R) continue;
      for (int p = me % R; p < cfg_.ranks; p += R) d.in_node_rows += counts.tokens_to(p, q);
    }
    return d;
  }

  void combine(Backend& be, const Tensor& rows, const Tensor& w, const Tensor& out) override {
    FP8MOE_CHECK(group_ && slot_row_.defined(), "nvlink combine: no dispatch before it");
    EpRank& r = group_->rank(0);
    Tensor send = rows;
    if (rows.dtype() != DType::bf16) {  // the Comm path's rounding of the rows it sends
      send = rows_tensor(be, DType::bf16, rows.size(0), rows.size(1));
      if (rows.size(0) > 0) be.convert(rows.view(), send.view());
    }
    follow(be.stream().native(), r.stream());
    r.combine(send.view(), slot_row_.view(), w.defined() ? w.view() : TensorView(), out.view(), true);
    // A timed-out wait surfaces here, before the sums are used, on every rank.
    r.check();
  }

 private:
  // Work queued on `to` from now on starts after the work queued on `from` so far.
  void follow(void* from, void* to) {
    if (from == to) return;
    FP8MOE_CUDA_CHECK(cudaEventRecord(event_, static_cast<cudaStream_t>(from)));
    FP8MOE_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(to), event_, 0));
  }

  // Buffers for T tokens on every rank: sized by the largest T of the ranks, regrown (together)
  // when a micro-batch outgrows them.
  void reserve(Backend& be, int64_t T) {
    const std::vector<std::string> all = ep_.exchange(std::string(reinterpret_cast<const char*>(&T), sizeof T));
    int64_t most = 1;
    for (const std::string& m : all) {
      int64_t t = 0;
      FP8MOE_CHECK(m.size() == sizeof t, "nvlink dispatch: a rank sent " << m.size() << " bytes for its token count");
      std::memcpy(&t, m.data(), sizeof t);
      most = std::max(most, t);
    }
    if (group_ && most <= cfg_.max_tokens) return;
    if (group_) {  // every rank's last step is over before any buffer goes
      FP8MOE_CUDA_CHECK(cudaStreamSynchronize(group_->rank(0).stream()));
      ep_.barrier();
      group_.reset();
    }
    cfg_.max_tokens = most;
    group_ = EpGroup::ipc(cfg_, ep_, static_cast<cudaStream_t>(be.stream().native()));
  }

  Comm& ep_;
  EpConfig cfg_;
  std::unique_ptr<EpGroup> group_;
  Tensor slot_row_;  // [T, k] of the last dispatch: the combine's map
  cudaEvent_t event_ = nullptr;
};

}  // namespace

std::unique_ptr<NvlinkTransport> make_nvlink_transport(Comm& ep, const ParallelLayout& l, int64_t hidden,
                                                       int64_t topk) {
  return std::make_unique<CudaNvlink>(ep, l, hidden, topk);
}

#else

std::unique_ptr<NvlinkTransport> make_nvlink_transport(Comm&, const ParallelLayout&, int64_t, int64_t) {
  FP8MOE_CHECK(false, "--ep-transport nvlink: this build has no CUDA");
  return nullptr;
}

#endif

}  // namespace fp8moe::ep
