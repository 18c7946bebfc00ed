// The MPI engine of Comm: Open MPI between processes, host tensors in place and device tensors
// through pinned host buffers (staging.hpp), so that several processes can share one GPU and CI
// runs the parallel code as CPU ranks: `mpirun -np 4 --oversubscribe build/bin/test_comm`.
//
// Every collective first exchanges what each rank passes (comm_checks.hpp), so bad arguments
// fail on every rank with one message; then the data moves as non-blocking point-to-point
// messages on a communicator of its own, and every wait polls (MPI_Testsome) until
// FP8MOE_COMM_TIMEOUT_S, after which the peers not heard from are named. Point-to-point moves
// them too so that the silent peer is known, which MPI's collectives would not tell. Sums add in
// rank order on the rank that owns a chunk and send the result back, bitwise equal to a serial
// loop over ranks, unlike MPI_SUM, whose order is the library's choice.
#include "mpi_comm.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <sstream>
#include <thread>

#include "fp8moe/codecs.hpp"
#include "fp8moe/error.hpp"

namespace fp8moe::comm_detail {

namespace {

// Tags on the collectives' communicator: descriptions and exchange() (variable lengths, probed),
// then the data. Messages between two ranks with one tag arrive in the order sent, and every rank
// runs the collectives in one order, so consecutive collectives cannot mix.
constexpr int kTagDesc = 1, kTagExchange = 2, kTagData = 3;
constexpr int kTagP2P = 0;  // on the caller's communicator: header, then the data
// MPI counts are int: larger transfers go as several messages of at most this many bytes.
constexpr size_t kPiece = size_t(1) << 30;

struct Runtime {
  bool owner = false;                // we called MPI_Init_thread, so we finalize
  std::atomic<bool> lost_peer{false};  // MPI_Finalize would wait for a peer that is gone
};

void finalize_at_exit();

[[noreturn]] void throw_mpi(int rc, const char* call, const std::string& what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = std::snprintf(text, sizeof text, "error %d", rc);
  throw Error(what + ": " + call + " failed: " + std::string(text, size_t(len)));
}

#define MPI_OK(call, what)                            \
  do {                                                \
    const int mpi_rc_ = (call);                       \
    if (mpi_rc_ != MPI_SUCCESS) throw_mpi(mpi_rc_, #call, what); \
  } while (0)

// MPI_THREAD_MULTIPLE, so that a communication thread may drive one Comm while the compute
// thread drives another (Open MPI's ob1 and vader support it); SERIALIZED would forbid that.
Runtime& runtime() {
  static Runtime* rt = [] {
    auto* r = new Runtime;
    int initialized = 0;
    MPI_OK(MPI_Initialized(&initialized), "mpi init");
    if (!initialized) {
      int provided = 0;
      MPI_OK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "mpi init");
      r->owner = true;
      std::atexit(finalize_at_exit);
      FP8MOE_CHECK(provided >= MPI_THREAD_MULTIPLE,
                   "mpi init: MPI_THREAD_MULTIPLE requested, the MPI library provides level " << provided);
    }
    MPI_OK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "mpi init");
    return r;
  }();
  return *rt;
}

// At exit nothing can be thrown: a failure is reported on stderr.
void finalize_at_exit() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized || runtime().lost_peer) return;
  if (MPI_Finalize() != MPI_SUCCESS) std::fprintf(stderr, "fp8moe: MPI_Finalize failed\n");
}

// The deadline of one blocking wait, and the pause between polls: spinning first (a reply is
// often microseconds away), then sleeping so that oversubscribed ranks leave the cores to the
// peers they wait for.
class Deadline {
 public:
  Deadline()
      : limit_s_(timeout_s()),
        end_(std::chrono::steady_clock::now() +
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(limit_s_))) {}
  bool expired() const { return std::chrono::steady_clock::now() > end_; }
  double limit_s() const { return limit_s_; }
  void pause(bool progressed) {
    idle_ = progressed ? 0 : idle_ + 1;
    if (idle_ > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }

 private:
  double limit_s_;
  std::chrono::steady_clock::time_point end_;
  int idle_ = 0;
};

std::string rank_list(const MpiComm& c, std::vector<int> peers) {
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  std::string s;
  for (int p : peers) s += (s.empty() ? "" : ", ") + c.rank_name(p);
  return s;
}

[[noreturn]] void throw_silent(const MpiComm& c, const std::string& what, const std::vector<int>& peers, bool heard,
                               double limit_s) {
  runtime().lost_peer = true;
  std::ostringstream os;
  os << what << ": " << c.rank_name(c.rank()) << " waited FP8MOE_COMM_TIMEOUT_S = " << limit_s << " s "
     << (heard ? "for " : "without hearing from ") << rank_list(c, peers)
     << (heard ? " to take its data" : "") << " (exited, crashed, or in another operation); the job cannot go on";
  throw Error(os.str());
}

}  // namespace

// Non-blocking transfers of one operation, each with its peer, waited for with a deadline.
class Pending {
 public:
  Pending() = default;
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  // On an error path: receives still posted are cancelled, sends left to finish on their own
  // (a destructor does not throw, so the codes are not acted on).
  ~Pending() {
    for (size_t i = 0; i < reqs_.size(); ++i) {
      if (reqs_[i] == MPI_REQUEST_NULL) continue;
      if (recv_[i]) MPI_Cancel(&reqs_[i]);
      MPI_Request_free(&reqs_[i]);
    }
  }

  void send(const void* p, size_t bytes, int peer, int tag, MPI_Comm c, const std::string& what) {
    auto* b = static_cast<const uint8_t*>(p);
    for (size_t at = 0; at < bytes; at += kPiece) {
      MPI_Request r;
      MPI_OK(MPI_Isend(b + at, int(std::min(kPiece, bytes - at)), MPI_BYTE, peer, tag, c, &r), what);
      add(r, peer, false);
    }
  }
  void recv(void* p, size_t bytes, int peer, int tag, MPI_Comm c, const std::string& what) {
    auto* b = static_cast<uint8_t*>(p);
    for (size_t at = 0; at < bytes; at += kPiece) {
      MPI_Request r;
      MPI_OK(MPI_Irecv(b + at, int(std::min(kPiece, bytes - at)), MPI_BYTE, peer, tag, c, &r), what);
      add(r, peer, true);
    }
  }
  void add(MPI_Request r, int peer, bool is_recv) {
    reqs_.push_back(r);
    peer_.push_back(peer);
    recv_.push_back(is_recv);
  }

  // One round of progress; true once every transfer is done.
  bool test(const MpiComm& c, const std::string& what, bool* progressed = nullptr) {
    if (reqs_.empty()) return true;
    int n = 0;
    idx_.resize(reqs_.size());
    st_.resize(reqs_.size());
    const int rc = MPI_Testsome(int(reqs_.size()), reqs_.data(), &n, idx_.data(), st_.data());
    if (rc == MPI_ERR_IN_STATUS) {
      for (int k = 0; k < n; ++k) {
        if (st_[k].MPI_ERROR != MPI_SUCCESS) {
          runtime().lost_peer = true;
          throw_mpi(st_[k].MPI_ERROR, recv_[idx_[k]] ? "receive" : "send", what + " with " + c.rank_name(peer_[idx_[k]]));
        }
      }
    }
    MPI_OK(rc, what);
    if (progressed) *progressed = n > 0;
    return n == MPI_UNDEFINED;
  }

  // Waits for every transfer; past the deadline, names the peers whose messages have not come
  // (or, when all have, the peers that have not taken ours).
  void wait(const MpiComm& c, const std::string& what, Deadline& dl) {
    bool progressed = false;
    while (!test(c, what, &progressed)) {
      if (dl.expired()) {
        std::vector<int> from, to;
        for (size_t i = 0; i < reqs_.size(); ++i) {
          if (reqs_[i] != MPI_REQUEST_NULL) (recv_[i] ? from : to).push_back(peer_[i]);
        }
        throw_silent(c, what, from.empty() ? to : from, from.empty(), dl.limit_s());
      }
      dl.pause(progressed);
    }
  }
  void wait(const MpiComm& c, const std::string& what) {
    Deadline dl;
    wait(c, what, dl);
  }

 private:
  std::vector<MPI_Request> reqs_;
  std::vector<int> peer_;
  std::vector<char> recv_;
  std::vector<int> idx_;
  std::vector<MPI_Status> st_;
};

namespace {

// out[i] = ((x_0[i] + x_1[i]) + x_2[i]) + ... for parts = [P, n]: the order of a serial loop over
// ranks, one rounding per add (Acc = T), or f32 accumulation rounded once for bf16.
template <class T>
void sum_parts(const uint8_t* parts, int P, int64_t n, uint8_t* out) {
  const T* x = reinterpret_cast<const T*>(parts);
  T* y = reinterpret_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i];
  for (int r = 1; r < P; ++r) {
    const T* xr = x + r * n;
    for (int64_t i = 0; i < n; ++i) y[i] = T(y[i] + xr[i]);
  }
}

void sum_parts_bf16(const uint8_t* parts, int P, int64_t n, uint8_t* out) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(parts);
  uint16_t* y = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) {
    float acc = bf16_decode(x[i]);
    for (int r = 1; r < P; ++r) acc += bf16_decode(x[r * n + i]);
    y[i] = bf16_encode(acc);
  }
}

void sum_parts(DType dt, const uint8_t* parts, int P, int64_t n, uint8_t* out) {
  switch (dt) {
    case DType::f32: return sum_parts<float>(parts, P, n, out);
    case DType::f64: return sum_parts<double>(parts, P, n, out);
    case DType::i32: return sum_parts<int32_t>(parts, P, n, out);
    case DType::i64: return sum_parts<int64_t>(parts, P, n, out);
    case DType::bf16: return sum_parts_bf16(parts, P, n, out);
    default: FP8MOE_CHECK(false, "mpi sum: dtype " << dtype_name(dt) << " is not summed");
  }
}

// The p2p header: what the sender sends, checked by the receiver.
struct Header {
  int64_t bytes = 0;
  int64_t dtype = 0;
};

std::string p2p_what(const char* op, int peer, const MpiComm& c) {
  return std::string("mpi ") + op + (std::string_view(op) == "send" ? " to " : " from ") + c.rank_name(peer);
}

void check_peer(const MpiComm& c, const TensorView& t, int peer, const char* op) {
  FP8MOE_CHECK(peer >= 0 && peer < c.size(), "mpi " << op << ": peer = " << peer << ", expected 0.." << c.size() - 1);
  FP8MOE_CHECK(t.is_contiguous() && (t.data || t.numel() == 0), "mpi " << op << ": " << t.str() << " must be contiguous with data");
}

class MpiRequest final : public CommRequest::Impl {
 public:
  MpiRequest(const MpiComm& c, std::string what) : comm_(c), what_(std::move(what)) {}

  // Send side: the header and the bytes (kept alive here until done).
  void post_send(PinnedPool& pool, const TensorView& t, int peer, const Stream& s, MPI_Comm mc) {
    host_ = pool.read(t, s, what_);
    header_ = {int64_t(t.nbytes()), int64_t(t.dtype)};
    data_.send(&header_, sizeof header_, peer, kTagP2P, mc, what_);
    data_.send(host_.data(), host_.size(), peer, kTagP2P, mc, what_);
  }
  // Receive side: the header and the expected bytes; checked and copied back in finish().
  void post_recv(PinnedPool& pool, const TensorView& t, int peer, const Stream& s, MPI_Comm mc) {
    t_ = t;
    s_ = s;
    peer_ = peer;
    host_ = pool.output(t, what_);
    head_.recv(&header_, sizeof header_, peer, kTagP2P, mc, what_);
    data_.recv(host_.data(), host_.size(), peer, kTagP2P, mc, what_);
    is_recv_ = true;
  }

  void wait() override {
    if (done_) return;
    Deadline dl;
    head_.wait(comm_, what_, dl);
    check_header();
    data_.wait(comm_, what_, dl);
    finish();
  }
  bool test() override {
    if (done_) return true;
    if (!head_.test(comm_, what_)) return false;
    check_header();
    if (!data_.test(comm_, what_)) return false;
    finish();
    return true;
  }

 private:
  void check_header() {
    if (!is_recv_) return;
    FP8MOE_CHECK(header_.bytes == int64_t(t_.nbytes()) && header_.dtype == int64_t(t_.dtype),
                 what_ << ": " << comm_.rank_name(peer_) << " sent " << header_.bytes << " bytes of "
                       << dtype_name(DType(header_.dtype)) << ", this receive expects " << t_.nbytes() << " bytes ("
                       << t_.str() << ")");
  }
  void finish() {
    if (is_recv_) host_.write_back(t_, s_);
    done_ = true;
  }

  const MpiComm& comm_;
  std::string what_;
  HostBytes host_;
  Header header_;
  Pending head_, data_;
  TensorView t_;
  Stream s_;
  int peer_ = -1;
  bool is_recv_ = false, done_ = false;
};

// Element offsets of the chunks of an all_reduce of n elements over P ranks: [P + 1].
std::vector<int64_t> chunk_offsets(int64_t n, int P) {
  std::vector<int64_t> off(size_t(P) + 1);
  for (int j = 0; j <= P; ++j) off[j] = n * j / P;
  return off;
}

}  // namespace

MpiComm::MpiComm(MPI_Comm comm) : user_(comm) {
  const std::string what = "mpi communicator";
  MPI_OK(MPI_Comm_set_errhandler(user_, MPI_ERRORS_RETURN), what);
  MPI_OK(MPI_Comm_rank(user_, &rank_), what);
  MPI_OK(MPI_Comm_size(user_, &size_), what);
  MPI_OK(MPI_Comm_dup(user_, &coll_), what);
  MPI_Group group, world;
  MPI_OK(MPI_Comm_group(user_, &group), what);
  MPI_OK(MPI_Comm_group(MPI_COMM_WORLD, &world), what);
  std::vector<int> mine(size_t(size_), 0);
  for (int r = 0; r < size_; ++r) mine[r] = r;
  world_ranks_.resize(size_t(size_));
  MPI_OK(MPI_Group_translate_ranks(group, size_, mine.data(), world, world_ranks_.data()), what);
  MPI_OK(MPI_Group_free(&group), what);
  MPI_OK(MPI_Group_free(&world), what);
  MPI_OK(MPI_Comm_size(MPI_COMM_WORLD, &world_size_), what);
}

// A destructor does not throw: the codes are not acted on (a failed free leaks a handle).
MpiComm::~MpiComm() {
  int finalized = 0;
  if (MPI_Finalized(&finalized) != MPI_SUCCESS || finalized) return;
  if (coll_ != MPI_COMM_NULL) MPI_Comm_free(&coll_);
  if (user_ != MPI_COMM_NULL) MPI_Comm_free(&user_);
}

std::string MpiComm::rank_name(int r) const {
  std::string s = "rank " + std::to_string(r);
  if (world_size_ != size_ || world_ranks_[r] != r) s += " (world rank " + std::to_string(world_ranks_[r]) + ")";
  return s;
}

std::vector<std::string> MpiComm::exchange_for(std::string_view mine, const char* op, std::string_view engine) {
  const std::string what = std::string(engine) + " " + op;
  const int tag = std::string_view(op) == "exchange" ? kTagExchange : kTagDesc;
  FP8MOE_CHECK(mine.size() <= kPiece, what << ": " << mine.size() << " bytes, at most " << kPiece << " (one message)");
  std::vector<std::string> out(static_cast<size_t>(size_));
  out[rank_] = std::string(mine);
  Pending sends, recvs;
  for (int j = 0; j < size_; ++j) {
    if (j != rank_) sends.send(out[rank_].data(), out[rank_].size(), j, tag, coll_, what);
    if (j != rank_ && mine.empty()) {
      // A zero-byte message still has to travel: it says this rank has arrived.
      MPI_Request r;
      MPI_OK(MPI_Isend(nullptr, 0, MPI_BYTE, j, tag, coll_, &r), what);
      sends.add(r, j, false);
    }
  }
  // Lengths differ by rank: probe each peer's message, then receive it.
  std::vector<char> probed(size_t(size_), 0);
  probed[rank_] = 1;
  int left = size_ - 1;
  Deadline dl;
  while (left > 0) {
    bool progressed = false;
    for (int j = 0; j < size_; ++j) {
      if (probed[j]) continue;
      int flag = 0;
      MPI_Message msg;
      MPI_Status st;
      MPI_OK(MPI_Improbe(j, tag, coll_, &flag, &msg, &st), what);
      if (!flag) continue;
      int count = 0;
      MPI_OK(MPI_Get_count(&st, MPI_BYTE, &count), what);
      out[j].resize(size_t(count));
      MPI_Request r;
      MPI_OK(MPI_Imrecv(out[j].data(), count, MPI_BYTE, &msg, &r), what);
      recvs.add(r, j, true);
      probed[j] = 1;
      --left;
      progressed = true;
    }
    if (left > 0 && dl.expired()) {
      std::vector<int> silent;
      for (int j = 0; j < size_; ++j) {
        if (!probed[j]) silent.push_back(j);
      }
      throw_silent(*this, what, silent, false, dl.limit_s());
    }
    dl.pause(progressed);
  }
  recvs.wait(*this, what, dl);
  sends.wait(*this, what, dl);
  return out;
}

void MpiComm::agree(const OpDesc& mine, std::string_view engine) {
  comm_detail::agree(mine, [&](std::string_view b) { return exchange_for(b, op_name(mine.op), engine); }, engine);
}

std::unique_ptr<MpiComm> MpiComm::split_mpi(int color, int key) {
  OpDesc d;
  d.op = Op::split;
  if (color < 0) d.problem = "color = " + std::to_string(color) + ", expected >= 0";
  agree(d);
  MPI_Comm sub;
  MPI_OK(MPI_Comm_split(user_, color, key, &sub), "mpi split");
  return std::make_unique<MpiComm>(sub);
}

std::unique_ptr<Comm> MpiComm::split(int color, int key) { return split_mpi(color, key); }

void MpiComm::send(const TensorView& t, int peer, const Stream& s) { isend(t, peer, s).wait(); }
void MpiComm::recv(const TensorView& t, int peer, const Stream& s) { irecv(t, peer, s).wait(); }

CommRequest MpiComm::isend(const TensorView& t, int peer, const Stream& s) {
  check_peer(*this, t, peer, "send");
  auto req = std::make_unique<MpiRequest>(*this, p2p_what("send", peer, *this));
  req->post_send(pinned_, t, peer, s, user_);
  return CommRequest(std::move(req));
}

CommRequest MpiComm::irecv(const TensorView& t, int peer, const Stream& s) {
  check_peer(*this, t, peer, "recv");
  auto req = std::make_unique<MpiRequest>(*this, p2p_what("recv", peer, *this));
  req->post_recv(pinned_, t, peer, s, user_);
  return CommRequest(std::move(req));
}

void MpiComm::post_blocks(const BlockFn& to, const BlockFn& from, const std::string& what, Pending& p) {
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    const Block in = from(j), out = to(j);
    p.recv(in.data, in.bytes, j, kTagData, coll_, what);
    p.send(out.data, out.bytes, j, kTagData, coll_, what);
  }
  const Block in = from(rank_), out = to(rank_);
  if (out.bytes && in.data != out.data) std::memcpy(in.data, out.data, out.bytes);
}

void MpiComm::swap_blocks(const BlockFn& to, const BlockFn& from, const std::string& what) {
  Pending p;
  post_blocks(to, from, what, p);
  p.wait(*this, what);
}

void MpiComm::all_to_all_v(const TensorView& send, std::span<const int64_t> send_counts, const TensorView& recv,
                           std::span<const int64_t> recv_counts, const Stream& s) {
  agree(describe_all_to_all_v(send, send_counts, recv, recv_counts, size_));
  const std::string what = "mpi all_to_all_v";
  const auto rb = size_t(row_bytes(send));
  HostBytes in = pinned_.read(send, s, what);
  HostBytes out = pinned_.output(recv, what);
  std::vector<size_t> soff(size_t(size_) + 1, 0), roff(size_t(size_) + 1, 0);  // bytes, per peer
  for (int j = 0; j < size_; ++j) {
    soff[j + 1] = soff[j] + size_t(send_counts[j]) * rb;
    roff[j + 1] = roff[j] + size_t(recv_counts[j]) * rb;
  }
  swap_blocks([&](int j) { return Block{in.data() + soff[j], soff[j + 1] - soff[j]}; },
              [&](int j) { return Block{out.data() + roff[j], roff[j + 1] - roff[j]}; }, what);
  out.write_back(recv, s);
}

void MpiComm::all_gather(const TensorView& send, const TensorView& recv, const Stream& s) {
  agree(describe_all_gather(send, recv, size_));
  const std::string what = "mpi all_gather";
  const size_t nb = send.nbytes();
  HostBytes in = pinned_.read(send, s, what);
  HostBytes out = pinned_.output(recv, what);
  swap_blocks([&](int) { return Block{in.data(), nb}; }, [&](int j) { return Block{out.data() + j * nb, nb}; }, what);
  out.write_back(recv, s);
}

void MpiComm::reduce_scatter(const TensorView& send, const TensorView& recv, const Stream& s) {
  agree(describe_reduce_scatter(send, recv, size_));
  const std::string what = "mpi reduce_scatter";
  const size_t nb = recv.nbytes();
  HostBytes in = pinned_.read(send, s, what);
  parts_.resize(size_ * nb);  // [size, n, ...]: rank j's rows for this rank
  swap_blocks([&](int j) { return Block{in.data() + j * nb, nb}; }, [&](int j) { return Block{parts_.data() + j * nb, nb}; },
              what);
  HostBytes out = pinned_.output(recv, what);
  sum_parts(recv.dtype, parts_.data(), size_, recv.numel(), out.data());
  out.write_back(recv, s);
}

namespace {

// A reduce_scatter or all_gather in flight. The caller posts its transfers in program order, so
// that they match the peers' as a blocking collective's would; a thread of its own then waits
// for them (MPI moves large messages only while someone polls) and adds the parts in rank order,
// while the caller computes; wait() joins it and queues the copy back on the stream.
class MpiCollectiveRequest final : public CommRequest::Impl {
 public:
  MpiCollectiveRequest(const MpiComm& c, std::string what, HostBytes in, HostBytes out, const TensorView& recv,
                       const Stream& s)
      : comm_(c), what_(std::move(what)), in_(std::move(in)), out_(std::move(out)), recv_(recv), s_(s) {}
  ~MpiCollectiveRequest() override {
    if (thread_.joinable()) thread_.join();  // a destructor does not throw: an error is dropped
  }
  Pending& pending() { return pending_; }
  std::vector<uint8_t>& parts() { return parts_; }
  uint8_t* in() const { return in_.data(); }
  uint8_t* out() const { return out_.data(); }
  // Waits for the transfers on the request's thread, then runs `then` there (the sum).
  void start(std::function<void()> then) {
    thread_ = std::thread([this, then = std::move(then)] {
      try {
        pending_.wait(comm_, what_);
        if (then) then();
      } catch (...) {
        error_ = std::current_exception();
      }
      done_ = true;
    });
  }
  void wait() override {
    if (!thread_.joinable()) return;
    thread_.join();
    if (error_) std::rethrow_exception(error_);
    out_.write_back(recv_, s_);
  }
  bool test() override {
    if (!done_) return false;
    wait();
    return true;
  }

 private:
  const MpiComm& comm_;
  std::string what_;
  HostBytes in_, out_;
  TensorView recv_;
  Stream s_;
  Pending pending_;
  std::vector<uint8_t> parts_;
  std::thread thread_;
  std::exception_ptr error_;
  std::atomic<bool> done_{false};
};

}  // namespace

CommRequest MpiComm::start_collective(const OpDesc& d, const TensorView& send, const TensorView& recv, const Stream& s) {
  agree(d);
  const std::string what = std::string("mpi i") + op_name(d.op);
  const bool sum = d.op == Op::reduce_scatter;  // else all_gather
  const size_t nb = sum ? recv.nbytes() : send.nbytes();
  auto req = std::make_unique<MpiCollectiveRequest>(*this, what, pinned_.read(send, s, what), pinned_.output(recv, what),
                                                    recv, s);
  MpiCollectiveRequest& r = *req;
  if (sum) r.parts().resize(size_ * nb);  // [size, n, ...]: rank j's rows for this rank
  uint8_t* into = sum ? r.parts().data() : r.out();
  post_blocks([&](int j) { return Block{r.in() + (sum ? j * nb : 0), nb}; }, [&](int j) { return Block{into + j * nb, nb}; },
              what, r.pending());
  std::function<void()> then;
  if (sum) then = [&r, dt = recv.dtype, P = size_, n = recv.numel()] { sum_parts(dt, r.parts().data(), P, n, r.out()); };
  r.start(std::move(then));
  return CommRequest(std::move(req));
}

CommRequest MpiComm::ireduce_scatter(const TensorView& send, const TensorView& recv, const Stream& s) {
  return start_collective(describe_reduce_scatter(send, recv, size_), send, recv, s);
}

CommRequest MpiComm::iall_gather(const TensorView& send, const TensorView& recv, const Stream& s) {
  return start_collective(describe_all_gather(send, recv, size_), send, recv, s);
}

void MpiComm::all_reduce(const TensorView& t, const Stream& s) {
  agree(describe_all_reduce(t));
  const std::string what = "mpi all_reduce";
  // Rank j sums the elements [off[j], off[j+1]) of every rank's t in rank order, then sends the
  // sum to all: every rank ends with the same bits, those of a serial loop over ranks.
  const auto off = chunk_offsets(t.numel(), size_);
  const size_t es = dtype_size(t.dtype);
  auto chunk = [&](uint8_t* base, int j) { return Block{base + off[j] * es, size_t(off[j + 1] - off[j]) * es}; };
  const size_t mine = size_t(off[rank_ + 1] - off[rank_]) * es;
  HostBytes io = pinned_.read(t, s, what);  // the input, then the result (in place)
  parts_.resize(size_ * mine);              // [size, chunk]: every rank's elements of this rank's chunk
  swap_blocks([&](int j) { return chunk(io.data(), j); }, [&](int j) { return Block{parts_.data() + j * mine, mine}; }, what);
  sum_parts(t.dtype, parts_.data(), size_, off[rank_ + 1] - off[rank_], chunk(io.data(), rank_).data);
  swap_blocks([&](int) { return chunk(io.data(), rank_); }, [&](int j) { return chunk(io.data(), j); }, what);
  io.write_back(t, s);
}

void MpiComm::broadcast(const TensorView& t, int root, const Stream& s) {
  agree(describe_broadcast(t, root, size_));
  const std::string what = "mpi broadcast";
  Pending p;
  if (rank_ == root) {
    HostBytes in = pinned_.read(t, s, what);
    for (int j = 0; j < size_; ++j) {
      if (j != root) p.send(in.data(), in.size(), j, kTagData, coll_, what);
    }
    p.wait(*this, what);
  } else {
    HostBytes out = pinned_.output(t, what);
    p.recv(out.data(), out.size(), root, kTagData, coll_, what);
    p.wait(*this, what);
    out.write_back(t, s);
  }
}

void MpiComm::barrier() { agree(OpDesc{}); }

std::unique_ptr<MpiComm> make_mpi_world() {
  runtime();
  MPI_Comm world;
  MPI_OK(MPI_Comm_dup(MPI_COMM_WORLD, &world), "mpi world");
  return std::make_unique<MpiComm>(world);
}

}  // namespace fp8moe::comm_detail
