// The NCCL engine of Comm: device tensors between GPUs, every transfer enqueued on the caller's
// stream (Stream::native()) and the host returning at once. Bootstrapped over the MPI engine (the
// unique id travels by exchange()), which also carries the argument checks (comm_checks.hpp), so
// bad arguments fail on every rank as with MPI. all_to_all_v is grouped ncclSend/ncclRecv; the
// collectives are NCCL's own, so sums are in NCCL's order (comm.hpp says what that guarantees).
// NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless the caller set it). Run on a GPU host:
// `mpirun -np 1 build-cuda/bin/test_comm --gtest_filter='Nccl*'`.
#include "nccl_comm.hpp"

#include <cuda_runtime.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "fp8moe/error.hpp"

namespace fp8moe::comm_detail {

namespace {

#define NCCL_OK(call, comm, what)                                                                      \
  do {                                                                                                 \
    const ncclResult_t nccl_rc_ = (call);                                                              \
    if (nccl_rc_ != ncclSuccess) {                                                                     \
      const char* last_ = ncclGetLastError(comm);                                                      \
      throw Error(std::string(what) + ": " #call " failed: " + ncclGetErrorString(nccl_rc_) +            \
                  (last_ && *last_ ? std::string(" (") + last_ + ")" : std::string()));                \
    }                                                                                                  \
  } while (0)

#define CUDA_OK(call, what)                                                                              \
  do {                                                                                                   \
    const cudaError_t cuda_rc_ = (call);                                                                 \
    FP8MOE_CHECK(cuda_rc_ == cudaSuccess, what << ": " #call " failed: " << cudaGetErrorString(cuda_rc_)); \
  } while (0)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    default: return ncclUint8;
  }
}

cudaStream_t stream_of(const Stream& s) { return static_cast<cudaStream_t>(s.native()); }

void check_device(const TensorView& t, const char* arg, const std::string& what) {
  FP8MOE_CHECK(t.device == Device::cuda || t.numel() == 0,
               what << ": " << arg << " " << t.str() << " is a host tensor; the nccl engine moves device tensors "
                    << "(--comm mpi moves host tensors)");
}

void check_devices(const TensorView& send, const TensorView& recv, const std::string& what) {
  check_device(send, "send", what);
  check_device(recv, "recv", what);
}

// Done once the work enqueued before it on `recorded_on` has run. wait(): the host waits for
// that (a transfer), or, given `waiter`, that stream does and the host does not (a collective
// started on the communicator's own stream).
class NcclRequest final : public CommRequest::Impl {
 public:
  NcclRequest(cudaStream_t recorded_on, const std::string& what, const Stream* waiter = nullptr) : what_(what) {
    if (waiter) waiter_ = *waiter;
    CUDA_OK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), what_);
    CUDA_OK(cudaEventRecord(ev_, recorded_on), what_);
  }
  ~NcclRequest() override { cudaEventDestroy(ev_); }
  void wait() override {
    if (waiter_.device() == Device::cuda) CUDA_OK(cudaStreamWaitEvent(stream_of(waiter_), ev_, 0), what_);
    else CUDA_OK(cudaEventSynchronize(ev_), what_);
  }
  bool test() override {
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaErrorNotReady) return false;
    CUDA_OK(e, what_);
    return true;
  }

 private:
  cudaEvent_t ev_ = nullptr;
  Stream waiter_;
  std::string what_;
};

class NcclComm final : public Comm {
 public:
  NcclComm(std::unique_ptr<MpiComm> host, ncclComm_t nc) : host_(std::move(host)), nc_(nc) {}
  ~NcclComm() override {
    ncclCommDestroy(nc_);
    if (async_done_) cudaEventDestroy(async_done_);
  }

  std::string name() const override { return "nccl"; }
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }

  std::unique_ptr<Comm> split(int color, int key) override {
    auto sub_host = host_->split_mpi(color, key);  // checks color on every rank first
    ncclComm_t sub;
    NCCL_OK(ncclCommSplit(nc_, color, key, &sub, nullptr), nc_, "nccl split");
    return std::make_unique<NcclComm>(std::move(sub_host), sub);
  }

  void send(const TensorView& t, int peer, const Stream& s) override { p2p(t, peer, s, true); }
  void recv(const TensorView& t, int peer, const Stream& s) override { p2p(t, peer, s, false); }
  CommRequest isend(const TensorView& t, int peer, const Stream& s) override {
    p2p(t, peer, s, true);
    return CommRequest(std::make_unique<NcclRequest>(stream_of(s), "nccl send"));
  }
  CommRequest irecv(const TensorView& t, int peer, const Stream& s) override {
    p2p(t, peer, s, false);
    return CommRequest(std::make_unique<NcclRequest>(stream_of(s), "nccl recv"));
  }

  void all_to_all_v(const TensorView& send, std::span<const int64_t> send_counts, const TensorView& recv,
                    std::span<const int64_t> recv_counts, const Stream& s) override {
    const std::string what = "nccl all_to_all_v";
    check_devices(send, recv, what);
    host_->agree(describe_all_to_all_v(send, send_counts, recv, recv_counts, size()), "nccl");
    after_async(s, what);
    const auto rb = size_t(row_bytes(send));
    auto* in = static_cast<const uint8_t*>(send.data);
    auto* out = static_cast<uint8_t*>(recv.data);
    NCCL_OK(ncclGroupStart(), nc_, what);
    size_t soff = 0, roff = 0;
    for (int j = 0; j < size(); ++j) {
      const size_t sb = size_t(send_counts[j]) * rb, rbytes = size_t(recv_counts[j]) * rb;
      if (sb) NCCL_OK(ncclSend(in + soff, sb, ncclUint8, j, nc_, stream_of(s)), nc_, what);
      if (rbytes) NCCL_OK(ncclRecv(out + roff, rbytes, ncclUint8, j, nc_, stream_of(s)), nc_, what);
      soff += sb;
      roff += rbytes;
    }
    NCCL_OK(ncclGroupEnd(), nc_, what);
  }

  void all_gather(const TensorView& send, const TensorView& recv, const Stream& s) override {
    const std::string what = "nccl all_gather";
    check_devices(send, recv, what);
    host_->agree(describe_all_gather(send, recv, size()), "nccl");
    after_async(s, what);
    if (send.nbytes()) NCCL_OK(ncclAllGather(send.data, recv.data, send.nbytes(), ncclUint8, nc_, stream_of(s)), nc_, what);
  }

  void reduce_scatter(const TensorView& send, const TensorView& recv, const Stream& s) override {
    const std::string what = "nccl reduce_scatter";
    check_devices(send, recv, what);
    host_->agree(describe_reduce_scatter(send, recv, size()), "nccl");
    after_async(s, what);
    if (recv.numel()) {
      NCCL_OK(ncclReduceScatter(send.data, recv.data, size_t(recv.numel()), nccl_type(recv.dtype), ncclSum, nc_, stream_of(s)),
              nc_, what);
    }
  }

  CommRequest ireduce_scatter(const TensorView& send, const TensorView& recv, const Stream& s) override {
    const std::string what = "nccl ireduce_scatter";
    check_devices(send, recv, what);
    host_->agree(describe_reduce_scatter(send, recv, size()), "nccl");
    cudaStream_t cs = async_stream(s, what);
    if (recv.numel()) {
      NCCL_OK(ncclReduceScatter(send.data, recv.data, size_t(recv.numel()), nccl_type(recv.dtype), ncclSum, nc_, cs), nc_,
              what);
    }
    return posted(cs, s, what);
  }

  CommRequest iall_gather(const TensorView& send, const TensorView& recv, const Stream& s) override {
    const std::string what = "nccl iall_gather";
    check_devices(send, recv, what);
    host_->agree(describe_all_gather(send, recv, size()), "nccl");
    cudaStream_t cs = async_stream(s, what);
    if (send.nbytes()) NCCL_OK(ncclAllGather(send.data, recv.data, send.nbytes(), ncclUint8, nc_, cs), nc_, what);
    return posted(cs, s, what);
  }

  void all_reduce(const TensorView& t, const Stream& s) override {
    const std::string what = "nccl all_reduce";
    check_device(t, "t", what);
    host_->agree(describe_all_reduce(t), "nccl");
    after_async(s, what);
    if (t.numel()) {
      NCCL_OK(ncclAllReduce(t.data, t.data, size_t(t.numel()), nccl_type(t.dtype), ncclSum, nc_, stream_of(s)), nc_, what);
    }
  }

  void broadcast(const TensorView& t, int root, const Stream& s) override {
    const std::string what = "nccl broadcast";
    check_device(t, "t", what);
    host_->agree(describe_broadcast(t, root, size()), "nccl");
    after_async(s, what);
    if (t.nbytes()) NCCL_OK(ncclBroadcast(t.data, t.data, t.nbytes(), ncclUint8, root, nc_, stream_of(s)), nc_, what);
  }

  void barrier() override { host_->barrier(); }
  std::vector<std::string> exchange(std::string_view mine) override { return host_->exchange(mine); }

 private:
  void p2p(const TensorView& t, int peer, const Stream& s, bool is_send) {
    const std::string what = is_send ? "nccl send" : "nccl recv";
    check_device(t, "t", what);
    FP8MOE_CHECK(peer >= 0 && peer < size(), what << ": peer = " << peer << ", expected 0.." << size() - 1);
    // Each call is its own NCCL group, and NCCL pairs a send to oneself with its receive only
    // inside one group.
    FP8MOE_CHECK(peer != rank(), what << ": peer = " << peer << " is this rank; the nccl engine does not send to "
                                      << "itself (copy the tensor instead)");
    FP8MOE_CHECK(t.is_contiguous(), what << ": " << t.str() << " must be contiguous");
    if (t.nbytes() == 0) return;
    after_async(s, what);
    if (is_send) NCCL_OK(ncclSend(t.data, t.nbytes(), ncclUint8, peer, nc_, stream_of(s)), nc_, what);
    else NCCL_OK(ncclRecv(t.data, t.nbytes(), ncclUint8, peer, nc_, stream_of(s)), nc_, what);
  }

  // The process's communication stream, after the work queued on `s` so far. One for every
  // communicator: started collectives of two communicators (dp and edp) run one after the other
  // in the order every rank starts them, never side by side on a GPU, where NCCL kernels of
  // different communicators waiting for each other's peers can deadlock.
  cudaStream_t async_stream(const Stream& s, const std::string& what) {
    static cudaStream_t shared = [&] {
      cudaStream_t cs = nullptr;
      CUDA_OK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking), what);
      return cs;  // lives as long as the process: communicators of any lifetime use it
    }();
    if (!async_done_) CUDA_OK(cudaEventCreateWithFlags(&async_done_, cudaEventDisableTiming), what);
    cudaEvent_t ready;
    CUDA_OK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), what);
    CUDA_OK(cudaEventRecord(ready, stream_of(s)), what);
    CUDA_OK(cudaStreamWaitEvent(shared, ready, 0), what);
    CUDA_OK(cudaEventDestroy(ready), what);  // the wait above keeps what it needs
    return shared;
  }
  CommRequest posted(cudaStream_t cs, const Stream& s, const std::string& what) {
    CUDA_OK(cudaEventRecord(async_done_, cs), what);
    return CommRequest(std::make_unique<NcclRequest>(cs, what, &s));
  }
  // NCCL runs one communicator's operations one after the other only in the order their
  // streams see them: an operation on the caller's stream waits for those started on the
  // communication stream before it, as it would on every rank.
  void after_async(const Stream& s, const std::string& what) {
    if (async_done_) CUDA_OK(cudaStreamWaitEvent(stream_of(s), async_done_, 0), what);
  }

  std::unique_ptr<MpiComm> host_;
  ncclComm_t nc_;
  cudaEvent_t async_done_ = nullptr;  // recorded after the last ireduce_scatter or iall_gather
};

// "<host> <PCI bus id>" of this rank's current GPU, or "none: <why>".
std::string gpu_identity() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    return std::string("none: ") + (e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device");
  }
  int dev = 0;
  char bus[64] = {};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetPCIBusId(bus, sizeof bus, dev) != cudaSuccess) {
    cudaGetLastError();
    return "none: cannot read the current device";
  }
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return std::string(host) + " " + bus;
}

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<MpiComm> host) {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  const int P = host->size(), me = host->rank();

  // Every rank learns every rank's GPU first, so that a missing or shared GPU is the same error
  // on every rank instead of a hang inside ncclCommInitRank.
  const auto gpus = host->exchange_for(gpu_identity(), "init", "nccl");
  for (int r = 0; r < P; ++r) {
    FP8MOE_CHECK(gpus[r].rfind("none", 0) != 0, "nccl init: " << host->rank_name(r) << " has no GPU (" << gpus[r].substr(6)
                                                   << "); --comm nccl needs a GPU per rank, --comm mpi runs without");
  }
  int version = 0;
  NCCL_OK(ncclGetVersion(&version), nullptr, "nccl init");
  const char* multi = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
  const bool shared_ok = version >= 23000 && multi && std::string_view(multi) == "1";
  for (int r = 0; r < P && !shared_ok; ++r) {
    for (int q = r + 1; q < P; ++q) {
      FP8MOE_CHECK(gpus[r] != gpus[q], "nccl init: " << host->rank_name(r) << " and " << host->rank_name(q) << " share the GPU "
                                                     << gpus[r] << "; NCCL " << version / 10000 << "." << version / 100 % 100 << "."
                                                     << version % 100 << " needs a GPU per rank (NCCL 2.30+ allows sharing with "
                                                     << "NCCL_MULTI_RANK_GPU_ENABLE=1); --comm mpi lets ranks share a GPU");
    }
  }

  // Rank 0's unique id (or its error) to all.
  std::string id_bytes;
  if (me == 0) {
    ncclUniqueId id;
    const ncclResult_t rc = ncclGetUniqueId(&id);
    id_bytes = rc == ncclSuccess ? std::string(id.internal, sizeof id.internal)
                                 : std::string("error: ncclGetUniqueId failed: ") + ncclGetErrorString(rc);
  }
  const auto ids = host->exchange_for(id_bytes, "init", "nccl");
  FP8MOE_CHECK(ids[0].size() == sizeof(ncclUniqueId::internal), "nccl init: rank 0: " << ids[0]);
  ncclUniqueId id;
  std::memcpy(id.internal, ids[0].data(), sizeof id.internal);
  ncclComm_t nc;
  NCCL_OK(ncclCommInitRank(&nc, P, id, me), nullptr, "nccl init on " + host->rank_name(me));
  return std::make_unique<NcclComm>(std::move(host), nc);
}

}  // namespace fp8moe::comm_detail
