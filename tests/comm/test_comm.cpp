// The communicator against serial references, run by mpirun at 1, 2, 3 and 4 ranks (ctest
// comm_np1..4; `mpirun -np 3 --oversubscribe build/bin/test_comm`), and alone (comm_singleton).
// Every rank fills its tensors from (seed, rank, element), so each rank computes any other
// rank's data and the exact expected result itself. Sums are compared bit for bit with a serial
// loop over ranks, on inputs whose magnitudes span 2^±20 so that another order of the adds gives
// other bits. (Tried: with all_reduce replaced by MPI_Allreduce(MPI_SUM), AllReduce.RankOrderBits
// fails at 4 ranks; at 3, Open MPI 4.1 happens to add in rank order for these sizes, and at 1 and
// 2 ranks every order gives the same bits.)
// The started collectives (ireduce_scatter, iall_gather) give the blocking calls' bits, several
// in flight at once (tried: with the parts summed over one rank fewer, Async.* fails at 2 ranks).
// Tests that expect an error check its message on every rank. Device tests (CUDA build) run the
// MPI engine on device tensors and NCCL; they skip without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <iostream>
#include <numeric>
#include <random>

#include "fp8moe/codecs.hpp"
#include "fp8moe/comm.hpp"
#include "fp8moe/error.hpp"
#include "testing.hpp"

#if FP8MOE_COMM_CUDA
#include <cuda_runtime.h>
#endif

namespace fp8moe {
namespace {

using testing::expect_error;

Comm* g_world = nullptr;
uint64_t g_seed = 0;

Comm& world() { return *g_world; }

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The bits of element i of rank r's tensor number `salt`, any dtype: floats of magnitude 2^-20..2^20
// of either sign (sums whose order shows), small integers, any byte.
uint64_t bits_of(int r, int64_t i, int salt) { return mix(g_seed ^ mix(uint64_t(r) * 1000003u + uint64_t(salt)) ^ mix(uint64_t(i))); }

double float_value(uint64_t h) {
  const double mant = 1.0 + double(h & 0xFFFFFF) / double(1 << 24);
  const int e = int((h >> 24) % 41) - 20;
  return ((h >> 40) & 1 ? -1.0 : 1.0) * std::ldexp(mant, e);
}

void store(DType dt, void* p, int64_t i, uint64_t h) {
  switch (dt) {
    case DType::f32: static_cast<float*>(p)[i] = float(float_value(h)); break;
    case DType::f64: static_cast<double*>(p)[i] = float_value(h) * (1.0 + double(h >> 44) / double(1ull << 20)); break;
    case DType::bf16: static_cast<uint16_t*>(p)[i] = bf16_encode(float(float_value(h))); break;
    case DType::i32: static_cast<int32_t*>(p)[i] = int32_t(h % 2001) - 1000; break;
    case DType::i64: static_cast<int64_t*>(p)[i] = int64_t(h % 2000001) - 1000000; break;
    default: static_cast<uint8_t*>(p)[i] = uint8_t(h); break;
  }
}

// Host tensor [rows, row_shape...] (1-D when row_shape is empty).
Tensor make(DType dt, int64_t rows, const std::vector<int64_t>& row) {
  switch (row.size()) {
    case 0: return Tensor::host(dt, {rows});
    case 1: return Tensor::host(dt, {rows, row[0]});
    default: return Tensor::host(dt, {rows, row[0], row[1]});
  }
}

int64_t row_elems(const std::vector<int64_t>& row) { return std::accumulate(row.begin(), row.end(), int64_t(1), std::multiplies<>()); }

// Elements [first, first + n) of a tensor of rank r filled with elements numbered from `from`.
void fill(const TensorView& t, int r, int salt, int64_t from = 0, int64_t first = 0, int64_t n = -1) {
  if (n < 0) n = t.numel() - first;
  for (int64_t k = 0; k < n; ++k) store(t.dtype, t.data, first + k, bits_of(r, from + k, salt));
}

// The first element where two tensors' bytes differ, or -1.
int64_t first_difference(const TensorView& a, const TensorView& b) {
  if (a.nbytes() != b.nbytes()) return 0;
  const size_t es = dtype_size(a.dtype);
  for (int64_t i = 0; i < a.numel(); ++i) {
    if (std::memcmp(static_cast<const uint8_t*>(a.data) + i * es, static_cast<const uint8_t*>(b.data) + i * es, es)) return i;
  }
  return -1;
}

#define EXPECT_SAME_BITS(got, want, what)                                                                 \
  do {                                                                                                    \
    const int64_t d_ = first_difference(got, want);                                                       \
    EXPECT_EQ(d_, -1) << what << " on rank " << world().rank() << ": element " << d_ << " differs ("        \
                      << (d_ >= 0 ? testing::to_doubles(got)[size_t(d_)] : 0.0) << " vs "                 \
                      << (d_ >= 0 ? testing::to_doubles(want)[size_t(d_)] : 0.0) << "), FP8MOE_SEED=" << g_seed; \
  } while (0)

// The serial sum over ranks r = 0..P-1 of element i of each rank's tensor (a loop in rank order,
// as a single process would add them): written at element k of out.
void serial_sum(DType dt, const std::vector<int>& ranks, int salt, int64_t i, void* out, int64_t k) {
  auto value = [&](int r, auto tag) {
    decltype(tag) v;
    store(dt, &v, 0, bits_of(r, i, salt));
    return v;
  };
  switch (dt) {
    case DType::f32: {
      float acc = value(ranks[0], float{});
      for (size_t j = 1; j < ranks.size(); ++j) acc = acc + value(ranks[j], float{});
      static_cast<float*>(out)[k] = acc;
      break;
    }
    case DType::f64: {
      double acc = value(ranks[0], double{});
      for (size_t j = 1; j < ranks.size(); ++j) acc = acc + value(ranks[j], double{});
      static_cast<double*>(out)[k] = acc;
      break;
    }
    case DType::bf16: {
      float acc = bf16_decode(value(ranks[0], uint16_t{}));
      for (size_t j = 1; j < ranks.size(); ++j) acc = acc + bf16_decode(value(ranks[j], uint16_t{}));
      static_cast<uint16_t*>(out)[k] = bf16_encode(acc);
      break;
    }
    case DType::i32: {
      int32_t acc = 0;
      for (int r : ranks) acc += value(r, int32_t{});
      static_cast<int32_t*>(out)[k] = acc;
      break;
    }
    case DType::i64: {
      int64_t acc = 0;
      for (int r : ranks) acc += value(r, int64_t{});
      static_cast<int64_t*>(out)[k] = acc;
      break;
    }
    default: FAIL() << "no sum for " << dtype_name(dt);
  }
}

std::vector<int> all_ranks(int P) {
  std::vector<int> r(static_cast<size_t>(P));
  std::iota(r.begin(), r.end(), 0);
  return r;
}

// Packed E5M6 is exchanged as the bytes of whole even rows, as u8 is; its codes are not elements here.
const std::vector<DType> kAllDTypes = {DType::f32, DType::f64, DType::bf16, DType::i32, DType::u8, DType::e4m3};
const std::vector<DType> kSumDTypes = {DType::f32, DType::f64, DType::bf16, DType::i32, DType::i64};
const std::vector<std::vector<int64_t>> kRowShapes = {{}, {3}, {2, 5}};

// Rows rank i sends rank j in pattern p: irregular with zeros, all zero, all to rank 0.
int64_t count(int p, int i, int j) {
  switch (p) {
    case 0: return int64_t(mix(g_seed + uint64_t(i) * 31 + uint64_t(j)) % 7) * ((i + 2 * j) % 3 != 1);
    case 1: return 0;
    default: return j == 0 ? 5 + i : 0;
  }
}

// all_to_all_v on `c`, whose ranks are the world ranks `members`: each rank's rows for rank j
// carry (source, row) numbering, checked row by row.
void check_all_to_all_v(Comm& c, const std::vector<int>& members, DType dt, const std::vector<int64_t>& row, int p,
                        int salt) {
  const int P = c.size(), me = c.rank();
  std::vector<int64_t> sc(static_cast<size_t>(P)), rc(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    sc[j] = count(p, me, j);
    rc[j] = count(p, j, me);
  }
  const int64_t re = row_elems(row);
  Tensor send = make(dt, std::accumulate(sc.begin(), sc.end(), int64_t(0)), row);
  Tensor recv = make(dt, std::accumulate(rc.begin(), rc.end(), int64_t(0)), row);
  Tensor want = make(dt, recv.size(0), row);
  // Rank i's send holds, for each j, its rows [offset of j ...): element numbers run on.
  fill(send, members[me], salt);
  int64_t at = 0;
  for (int i = 0; i < P; ++i) {
    int64_t from = 0;  // where rank i's rows for `me` start in its send
    for (int j = 0; j < me; ++j) from += count(p, i, j);
    fill(want, members[i], salt, from * re, at * re, rc[i] * re);
    at += rc[i];
  }
  c.all_to_all_v(send, sc, recv, rc, Stream{});
  EXPECT_SAME_BITS(recv.view(), want.view(), "all_to_all_v " << dtype_name(dt) << " pattern " << p << " rows " << recv.size(0));
}

TEST(Launch, InfoMatchesTheWorld) {
  const LaunchInfo li = launch_info();
  EXPECT_EQ(li.size, world().size());
  EXPECT_EQ(li.rank, world().rank());
  EXPECT_LT(li.local_rank, li.local_size);
  EXPECT_EQ(world().name(), "mpi");
}

TEST(Launch, RequireWorldNamesTheLaunch) {
  require_world(world(), world().size(), "test");
  expect_error([] { require_world(world(), world().size() + 1, "pipeline x2"); }, "pipeline x2 runs on " + std::to_string(world().size() + 1));
  LaunchInfo li;
  li.size = 4;
  li.under_mpirun = true;
  expect_error([&] { require_world(li, 1, "fp8moe train"); }, "fp8moe train runs on 1 rank, this launch has 4 (mpirun -np 4)");
}

TEST(Launch, UnknownKind) { expect_error([] { make_comm("gloo"); }, "kind = 'gloo', expected mpi | nccl | auto"); }

TEST(Launch, NcclWithoutGpuIsAClearError) {
#if FP8MOE_COMM_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) GTEST_SKIP() << "this host has a GPU (the Nccl tests cover it)";
  cudaGetLastError();
  expect_error([] { make_comm("nccl"); }, "nccl init: rank 0 has no GPU");
#else
  expect_error([] { make_comm("nccl"); }, "\"nccl\" needs fp8moe built with CUDA and NCCL");
#endif
}

TEST(Launch, AutoTakesNcclOnlyWithAGpuPerRank) {
  const LaunchInfo li = launch_info();
  int gpus = 0;
#if FP8MOE_COMM_CUDA
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  cudaGetLastError();
#endif
  select_local_gpu(li);
  EXPECT_EQ(make_comm("auto")->name(), gpus > 0 && li.local_size <= gpus ? "nccl" : "mpi")
      << li.local_size << " ranks on this host, " << gpus << " GPUs";
}

TEST(Exchange, DifferentLengthsInRankOrder) {
  for (int round = 0; round < 3; ++round) {
    auto text = [&](int r) { return std::string(size_t((r * 37 + round * 11) % 101 * (r != 1)), char('a' + r)); };
    const auto got = world().exchange(text(world().rank()));
    ASSERT_EQ(int(got.size()), world().size());
    for (int r = 0; r < world().size(); ++r) EXPECT_EQ(got[r], text(r)) << "from rank " << r << " round " << round;
  }
}

TEST(AllToAllV, EveryDTypeRowShapeAndPattern) {
  int salt = 100;
  for (DType dt : kAllDTypes) {
    for (const auto& row : kRowShapes) {
      for (int p = 0; p < 3; ++p) check_all_to_all_v(world(), all_ranks(world().size()), dt, row, p, salt++);
    }
  }
}

TEST(AllGather, EveryDTypeAndSize) {
  const int P = world().size();
  int salt = 200;
  for (DType dt : kAllDTypes) {
    for (const auto& row : kRowShapes) {
      for (int64_t n : {0, 1, 5}) {
        Tensor send = make(dt, n, row), recv = make(dt, P * n, row), want = make(dt, P * n, row);
        fill(send, world().rank(), salt);
        for (int r = 0; r < P; ++r) fill(want, r, salt, 0, r * send.numel(), send.numel());
        world().all_gather(send, recv, Stream{});
        EXPECT_SAME_BITS(recv.view(), want.view(), "all_gather " << dtype_name(dt) << " n " << n);
        ++salt;
      }
    }
  }
}

TEST(ReduceScatter, RankOrderBits) {
  const int P = world().size();
  int salt = 300;
  for (DType dt : kSumDTypes) {
    for (const auto& row : {std::vector<int64_t>{}, std::vector<int64_t>{3}}) {
      for (int64_t n : {0, 1, 7, 129}) {
        Tensor send = make(dt, P * n, row), recv = make(dt, n, row), want = make(dt, n, row);
        fill(send, world().rank(), salt);
        const int64_t chunk = recv.numel();
        for (int64_t k = 0; k < chunk; ++k) serial_sum(dt, all_ranks(P), salt, world().rank() * chunk + k, want.view().data, k);
        world().reduce_scatter(send, recv, Stream{});
        EXPECT_SAME_BITS(recv.view(), want.view(), "reduce_scatter " << dtype_name(dt) << " n " << n);
        ++salt;
      }
    }
  }
}

// Several started at once, a blocking collective and a second communicator's between the starts
// and the waits, waited for out of order: each the blocking call's bits.
TEST(Async, ReduceScatterAndAllGatherAsBlocking) {
  const int P = world().size(), me = world().rank();
  auto half = world().split(me % 2, me);
  int salt = 350;
  for (DType dt : kSumDTypes) {
    for (int64_t n : {0, 1, 129, 100003}) {
      Tensor rs_in = Tensor::host(dt, {P * n}), rs_out = Tensor::host(dt, {n}), rs_want = Tensor::host(dt, {n});
      Tensor ag_in = Tensor::host(dt, {n}), ag_out = Tensor::host(dt, {P * n}), ag_want = Tensor::host(dt, {P * n});
      Tensor sub_in = Tensor::host(dt, {half->size() * n}), sub_out = Tensor::host(dt, {n}), sub_want = Tensor::host(dt, {n});
      Tensor ar = Tensor::host(dt, {n}), ar_want = Tensor::host(dt, {n});
      fill(rs_in, me, salt);
      fill(ag_in, me, salt + 1);
      fill(sub_in, me, salt + 2);
      fill(ar, me, salt + 3);
      std::memcpy(ar_want.view().data, ar.view().data, ar.view().nbytes());
      world().reduce_scatter(rs_in, rs_want, Stream{});
      world().all_gather(ag_in, ag_want, Stream{});
      half->reduce_scatter(sub_in, sub_want, Stream{});
      world().all_reduce(ar_want, Stream{});
      CommRequest rs = world().ireduce_scatter(rs_in, rs_out, Stream{});
      CommRequest sub = half->ireduce_scatter(sub_in, sub_out, Stream{});
      CommRequest ag = world().iall_gather(ag_in, ag_out, Stream{});
      world().all_reduce(ar, Stream{});
      ag.wait();
      sub.wait();
      while (!rs.test()) {
      }
      rs.wait();  // again: nothing more
      const std::string what = std::string(dtype_name(dt)) + " n " + std::to_string(n);
      EXPECT_SAME_BITS(rs_out.view(), rs_want.view(), "ireduce_scatter " << what);
      EXPECT_SAME_BITS(ag_out.view(), ag_want.view(), "iall_gather " << what);
      EXPECT_SAME_BITS(sub_out.view(), sub_want.view(), "ireduce_scatter on a split " << what);
      EXPECT_SAME_BITS(ar.view(), ar_want.view(), "all_reduce between them " << what);
      salt += 4;
    }
  }
}

TEST(Async, MismatchIsAnErrorOnEveryRank) {
  const int P = world().size(), me = world().rank();
  Tensor send = Tensor::host(DType::f32, {P * (me == 0 ? 3 : 2)}), recv = Tensor::host(DType::f32, {me == 0 ? 3 : 2});
  if (P == 1) GTEST_SKIP() << "one rank agrees with itself";
  expect_error([&] { world().ireduce_scatter(send, recv, Stream{}).wait(); },
               "mpi reduce_scatter: rank 0 passes [3] f32 but rank 1 passes [2] f32");
  world().barrier();  // the communicator is still in step
}

TEST(AllReduce, RankOrderBits) {
  const int P = world().size();
  int salt = 400;
  for (DType dt : kSumDTypes) {
    // 100003 elements: large enough for MPI libraries' ring and segmented algorithms.
    for (int64_t n : {0, 1, 13, 1001, 100003}) {
      Tensor t = Tensor::host(dt, {n}), want = Tensor::host(dt, {n});
      fill(t, world().rank(), salt);
      for (int64_t k = 0; k < n; ++k) serial_sum(dt, all_ranks(P), salt, k, want.view().data, k);
      world().all_reduce(t, Stream{});
      EXPECT_SAME_BITS(t.view(), want.view(), "all_reduce " << dtype_name(dt) << " n " << n);
      ++salt;
    }
  }
  // A 2-D tensor: rows are not the unit of a sum.
  Tensor t = Tensor::host(DType::f32, {7, 11}), want = Tensor::host(DType::f32, {7, 11});
  fill(t, world().rank(), salt);
  for (int64_t k = 0; k < 77; ++k) serial_sum(DType::f32, all_ranks(P), salt, k, want.view().data, k);
  world().all_reduce(t, Stream{});
  EXPECT_SAME_BITS(t.view(), want.view(), "all_reduce [7, 11] f32");
}

TEST(Broadcast, EveryRoot) {
  int salt = 500;
  for (int root = 0; root < world().size(); ++root) {
    for (DType dt : {DType::f32, DType::bf16, DType::u8}) {
      for (int64_t n : {0, 3, 1000}) {
        Tensor t = make(dt, n, {3}), want = make(dt, n, {3});
        if (world().rank() == root) fill(t, root, salt);
        fill(want, root, salt);
        world().broadcast(t, root, Stream{});
        EXPECT_SAME_BITS(t.view(), want.view(), "broadcast from " << root);
        ++salt;
      }
    }
  }
}

TEST(Barrier, Repeated) {
  for (int i = 0; i < 20; ++i) world().barrier();
}

TEST(PointToPoint, BlockingPairs) {
  const int P = world().size(), me = world().rank();
  if (P == 1) GTEST_SKIP() << "a blocking send to oneself waits for a receive that follows it";
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  Tensor out = Tensor::host(DType::f32, {100000}), in = Tensor::host(DType::f32, {100000}), want = Tensor::host(DType::f32, {100000});
  fill(out, me, 600);
  fill(want, prev, 600);
  // Even ranks send first, odd ranks receive first: no cycle of waits (rendezvous-sized messages).
  if (me % 2 == 0) {
    world().send(out, next, Stream{});
    world().recv(in, prev, Stream{});
  } else {
    world().recv(in, prev, Stream{});
    world().send(out, next, Stream{});
  }
  EXPECT_SAME_BITS(in.view(), want.view(), "send/recv from rank " << prev);
}

TEST(PointToPoint, IsendIrecvRingsBothWays) {
  const int P = world().size(), me = world().rank();
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  // Three messages each way, in flight together, arriving in the order sent.
  std::vector<Tensor> to_next, to_prev, from_prev, from_next;
  std::vector<CommRequest> reqs;
  const int64_t sizes[3] = {1, 0, 70001};
  for (int k = 0; k < 3; ++k) {
    to_next.push_back(Tensor::host(DType::bf16, {sizes[k]}));
    to_prev.push_back(Tensor::host(DType::i32, {sizes[k] + 3}));
    from_prev.push_back(Tensor::host(DType::bf16, {sizes[k]}));
    from_next.push_back(Tensor::host(DType::i32, {sizes[k] + 3}));
    fill(to_next[k], me, 700 + k);
    fill(to_prev[k], me, 710 + k);
  }
  for (int k = 0; k < 3; ++k) {
    reqs.push_back(world().irecv(from_prev[k], prev, Stream{}));
    reqs.push_back(world().irecv(from_next[k], next, Stream{}));
  }
  for (int k = 0; k < 3; ++k) {
    reqs.push_back(world().isend(to_next[k], next, Stream{}));
    reqs.push_back(world().isend(to_prev[k], prev, Stream{}));
  }
  while (!reqs.front().test()) {
  }
  for (auto& r : reqs) r.wait();
  for (int k = 0; k < 3; ++k) {
    Tensor a = Tensor::host(DType::bf16, {sizes[k]}), b = Tensor::host(DType::i32, {sizes[k] + 3});
    fill(a, prev, 700 + k);
    fill(b, next, 710 + k);
    EXPECT_SAME_BITS(from_prev[k].view(), a.view(), "irecv " << k << " from rank " << prev);
    EXPECT_SAME_BITS(from_next[k].view(), b.view(), "irecv " << k << " from rank " << next);
  }
}

TEST(PointToPoint, ReceiverNamesAWrongSize) {
  const int P = world().size(), me = world().rank();
  if (P == 1) GTEST_SKIP() << "needs two ranks";
  if (me == 0) {
    Tensor t = Tensor::host(DType::f32, {4});
    world().send(t, 1, Stream{});
  } else if (me == 1) {
    Tensor t = Tensor::host(DType::f32, {5});
    expect_error([&] { world().recv(t, 0, Stream{}); }, "mpi recv from rank 0: rank 0 sent 16 bytes of f32, this receive expects 20 bytes ([5] f32 cpu)");
  }
  expect_error([&] { world().send(Tensor::host(DType::f32, {1}), P, Stream{}); }, "mpi send: peer = " + std::to_string(P) + ", expected 0..");
  world().barrier();
}

// Checks `c` against the world ranks `members` (in c's rank order): all_to_all_v, all_reduce,
// all_gather of each member's world rank.
void check_group(Comm& c, const std::vector<int>& members, int salt) {
  ASSERT_EQ(c.size(), int(members.size()));
  EXPECT_EQ(members[c.rank()], world().rank());
  check_all_to_all_v(c, members, DType::f32, {3}, 0, salt);
  Tensor t = Tensor::host(DType::f32, {31}), want = Tensor::host(DType::f32, {31});
  fill(t, world().rank(), salt + 1);
  for (int64_t k = 0; k < 31; ++k) serial_sum(DType::f32, members, salt + 1, k, want.view().data, k);
  c.all_reduce(t, Stream{});
  EXPECT_SAME_BITS(t.view(), want.view(), "all_reduce in a group");
  int32_t mine = world().rank();
  std::vector<int32_t> got(members.size());
  c.all_gather(TensorView(&mine, DType::i32, {1}), TensorView(got.data(), DType::i32, {int64_t(got.size())}), Stream{});
  EXPECT_EQ(got, std::vector<int32_t>(members.begin(), members.end()));
}

TEST(Split, EvenAndOdd) {
  const int P = world().size(), me = world().rank();
  auto sub = world().split(me % 2, me);
  std::vector<int> members;
  for (int r = me % 2; r < P; r += 2) members.push_back(r);
  check_group(*sub, members, 800);
}

TEST(Split, KeyOrdersTheGroup) {
  const int P = world().size();
  auto sub = world().split(0, -world().rank());
  std::vector<int> members(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) members[r] = P - 1 - r;
  EXPECT_EQ(sub->rank(), P - 1 - world().rank());
  check_group(*sub, members, 810);
}

TEST(Split, PipelineByDataParallel) {
  // Ranks as a [PP, DP] grid (DP = 2 when the size is even): a pipeline group runs along PP,
  // a data-parallel group along DP, both split from the world, then each split again.
  const int P = world().size(), me = world().rank();
  const int dp = P % 2 == 0 ? 2 : 1, pp = P / dp;
  auto pp_group = world().split(me % dp, me / dp);
  auto dp_group = world().split(me / dp, me % dp);
  std::vector<int> pp_members, dp_members;
  for (int s = 0; s < pp; ++s) pp_members.push_back(s * dp + me % dp);
  for (int d = 0; d < dp; ++d) dp_members.push_back((me / dp) * dp + d);
  check_group(*pp_group, pp_members, 820);
  check_group(*dp_group, dp_members, 830);
  auto again = pp_group->split(0, 0);
  check_group(*again, pp_members, 840);
}

TEST(Mismatch, CountsNameBothRanksOnEveryRank) {
  const int P = world().size(), me = world().rank();
  if (P == 1) GTEST_SKIP() << "needs two ranks";
  std::vector<int64_t> sc(size_t(P), 2), rc(size_t(P), 2);
  if (me == 0) sc[1] = 3;  // rank 1 expects 2 rows from rank 0
  Tensor send = Tensor::host(DType::f32, {std::accumulate(sc.begin(), sc.end(), int64_t(0)), 4});
  Tensor recv = Tensor::host(DType::f32, {2 * P, 4});
  expect_error([&] { world().all_to_all_v(send, sc, recv, rc, Stream{}); },
               "mpi all_to_all_v: send_counts[1] = 3 on rank 0 but recv_counts[0] = 2 on rank 1");
  world().barrier();  // the communicator is still in step
}

TEST(Mismatch, DTypeOnEveryRank) {
  const int P = world().size(), me = world().rank();
  if (P == 1) GTEST_SKIP() << "needs two ranks";
  Tensor t = Tensor::host(me == 1 ? DType::f64 : DType::f32, {5});
  expect_error([&] { world().all_reduce(t, Stream{}); }, "mpi all_reduce: rank 0 passes [5] f32 but rank 1 passes [5] f64");
  Tensor s = Tensor::host(DType::f32, {me == 1 ? 3 : 2, 4}), r = Tensor::host(DType::f32, {P * (me == 1 ? 3 : 2), 4});
  expect_error([&] { world().all_gather(s, r, Stream{}); }, "mpi all_gather: rank 0 passes [2, 4] f32 but rank 1 passes [3, 4] f32");
}

TEST(Mismatch, CollectiveOnEveryRank) {
  const int P = world().size(), me = world().rank();
  if (P == 1) GTEST_SKIP() << "needs two ranks";
  Tensor t = Tensor::host(DType::f32, {P});
  const std::string want = "rank 0 is in broadcast but rank 1 is in all_reduce";
  if (me == 1) expect_error([&] { world().all_reduce(t, Stream{}); }, want);
  else expect_error([&] { world().broadcast(t, 0, Stream{}); }, want);
}

TEST(OutOfRange, EveryRankHearsOfIt) {
  const int P = world().size(), me = world().rank(), last = P - 1;
  std::vector<int64_t> sc(size_t(P), 1), rc(size_t(P), 1);
  Tensor send = Tensor::host(DType::u8, {me == last ? P - 1 : P}), recv = Tensor::host(DType::u8, {P});
  expect_error([&] { world().all_to_all_v(send, sc, recv, rc, Stream{}); },
               "rank " + std::to_string(last) + ": send_counts sum to " + std::to_string(P) + " rows but send has " +
                   std::to_string(P - 1) + " rows");
  std::vector<int64_t> bad = rc;
  if (me == 0) bad[0] = -1;
  expect_error([&] { world().all_to_all_v(recv, sc, recv, bad, Stream{}); }, "rank 0: recv_counts[0] = -1 is negative");
  std::vector<int64_t> short_counts(size_t(P + (me == 0)), 1);
  expect_error([&] { world().all_to_all_v(recv, sc, recv, short_counts, Stream{}); },
               "rank 0: recv_counts has " + std::to_string(P + 1) + " entries, expected " + std::to_string(P));
  Tensor t = Tensor::host(DType::f32, {3});
  expect_error([&] { world().broadcast(t, P, Stream{}); }, "rank 0: root = " + std::to_string(P));
  Tensor part = Tensor::host(DType::f32, {2}), stacked = Tensor::host(DType::f32, {2 * P + (me == last)});
  expect_error([&] { world().all_gather(part, stacked, Stream{}); },
               "rank " + std::to_string(last) + ": recv [" + std::to_string(2 * P + 1) + "] f32 cpu needs " +
                   std::to_string(2 * P) + " rows (" + std::to_string(P) + " ranks x send's 2)");
  Tensor q = Tensor::host(DType::e4m3, {3});
  expect_error([&] { world().all_reduce(q, Stream{}); }, "sums are f32 | f64 | bf16 | i32 | i64");
  expect_error([&] { world().split(-1 - (me == 0), 0); }, "split: rank 0: color = -2, expected >= 0");
  // Still in step: a sum right after the errors.
  Tensor one = Tensor::host(DType::i32, {1});
  one.ptr<int32_t>()[0] = 1;
  world().all_reduce(one, Stream{});
  EXPECT_EQ(one.ptr<int32_t>()[0], P);
}

#if FP8MOE_COMM_CUDA
// A CUDA stream behind a Stream handle, as the CUDA backend hands out.
class TestCudaStream final : public Stream::Impl {
 public:
  TestCudaStream() { cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking); }
  ~TestCudaStream() override { cudaStreamDestroy(s_); }
  Device device() const override { return Device::cuda; }
  void* native() const override { return s_; }
  void synchronize() const override { cudaStreamSynchronize(s_); }
  bool query() const override { return cudaStreamQuery(s_) == cudaSuccess; }

 private:
  cudaStream_t s_ = nullptr;
};

bool have_gpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  cudaGetLastError();
  return ok;
}

// A device copy of a host tensor, and back.
struct DeviceTensor {
  std::shared_ptr<void> mem;
  TensorView view;
  explicit DeviceTensor(const Tensor& host) : view(host.view()) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(host.view().nbytes(), 1)), cudaSuccess);
    mem.reset(p, [](void* q) { cudaFree(q); });
    view.data = p;
    view.device = Device::cuda;
    cudaMemcpy(p, host.view().data, host.view().nbytes(), cudaMemcpyHostToDevice);
    // NOTES: from pageable memory cudaMemcpy returns once the source is staged, before the DMA
    // lands; the collectives read on a non-blocking stream, which the legacy stream does not order.
    cudaDeviceSynchronize();
  }
  Tensor to_host() const {
    TensorView hv = view;
    hv.device = Device::cpu;
    Tensor t = Tensor::host_like(hv);
    cudaMemcpy(t.view().data, view.data, view.nbytes(), cudaMemcpyDeviceToHost);
    return t;
  }
};

// The collectives on device tensors through `c`, each against `host` (the MPI engine over the
// same ranks) on host tensors; `exact_sums` where the sums are in rank order (MPI; NCCL at one rank).
void check_device_collectives(Comm& c, Comm& host, bool exact_sums) {
  const int P = c.size(), me = c.rank();
  Stream s(std::make_shared<TestCudaStream>());
  // all_to_all_v, [rows, 3] f32: the host result is the reference.
  std::vector<int64_t> sc(static_cast<size_t>(P)), rc(static_cast<size_t>(P));
  for (int j = 0; j < P; ++j) {
    sc[j] = count(0, me, j);
    rc[j] = count(0, j, me);
  }
  Tensor send = make(DType::f32, std::accumulate(sc.begin(), sc.end(), int64_t(0)), {3});
  Tensor recv = make(DType::f32, std::accumulate(rc.begin(), rc.end(), int64_t(0)), {3});
  fill(send, me, 900);
  DeviceTensor dsend(send), drecv(recv);
  c.all_to_all_v(dsend.view, sc, drecv.view, rc, s);
  host.all_to_all_v(send, sc, recv, rc, Stream{});
  s.synchronize();
  EXPECT_SAME_BITS(drecv.to_host().view(), recv.view(), c.name() << " all_to_all_v on the GPU");

  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor t = Tensor::host(dt, {1001});
    fill(t, me, 901);
    DeviceTensor dt_(t);
    c.all_reduce(dt_.view, s);
    host.all_reduce(t, Stream{});
    s.synchronize();
    if (exact_sums) {
      EXPECT_SAME_BITS(dt_.to_host().view(), t.view(), c.name() << " all_reduce " << dtype_name(dt) << " on the GPU");
    } else {
      EXPECT_LT(testing::calc_diff(testing::to_doubles(dt_.to_host()), testing::to_doubles(t)), 1e-6) << c.name() << " all_reduce " << dtype_name(dt);
    }
    Tensor rs_in = Tensor::host(dt, {P * 37}), rs_out = Tensor::host(dt, {37});
    fill(rs_in, me, 902);
    DeviceTensor din(rs_in), dout(rs_out);
    c.reduce_scatter(din.view, dout.view, s);
    host.reduce_scatter(rs_in, rs_out, Stream{});
    s.synchronize();
    if (exact_sums) EXPECT_SAME_BITS(dout.to_host().view(), rs_out.view(), c.name() << " reduce_scatter on the GPU");
    else EXPECT_LT(testing::calc_diff(testing::to_doubles(dout.to_host()), testing::to_doubles(rs_out)), 1e-6);
    // Started on the communication stream, waited for on `s`: the blocking call's bits.
    Tensor poison = Tensor::host(dt, {37});
    fill(poison, me, 906);
    DeviceTensor dasync(poison);
    CommRequest q = c.ireduce_scatter(din.view, dasync.view, s);
    q.wait();
    s.synchronize();
    EXPECT_SAME_BITS(dasync.to_host().view(), dout.to_host().view(), c.name() << " ireduce_scatter on the GPU");
  }
  Tensor g_in = Tensor::host(DType::u8, {5, 7}), g_out = Tensor::host(DType::u8, {5 * P, 7});
  fill(g_in, me, 903);
  DeviceTensor dg_in(g_in), dg_out(g_out);
  c.all_gather(dg_in.view, dg_out.view, s);
  host.all_gather(g_in, g_out, Stream{});
  s.synchronize();
  EXPECT_SAME_BITS(dg_out.to_host().view(), g_out.view(), c.name() << " all_gather on the GPU");
  Tensor g_poison = Tensor::host(DType::u8, {5 * P, 7});
  fill(g_poison, me, 907);
  DeviceTensor dg_async(g_poison);
  CommRequest ag = c.iall_gather(dg_in.view, dg_async.view, s);
  ag.wait();
  s.synchronize();
  EXPECT_SAME_BITS(dg_async.to_host().view(), g_out.view(), c.name() << " iall_gather on the GPU");

  Tensor b = Tensor::host(DType::f64, {333});
  fill(b, 0, 904);
  if (me != 0) std::memset(b.view().data, 0, b.view().nbytes());
  DeviceTensor db(b);
  c.broadcast(db.view, 0, s);
  fill(b, 0, 904);
  s.synchronize();
  EXPECT_SAME_BITS(db.to_host().view(), b.view(), c.name() << " broadcast on the GPU");

  if (c.name() == "nccl" && P == 1) {
    Tensor one = Tensor::host(DType::f32, {1});
    DeviceTensor d(one);
    expect_error([&] { c.send(d.view, 0, s); }, "nccl send: peer = 0 is this rank");
    return;
  }
  // A ring on device tensors: receive from the previous rank, send to the next.
  Tensor out = Tensor::host(DType::bf16, {4099}), in = Tensor::host(DType::bf16, {4099}), want = Tensor::host(DType::bf16, {4099});
  fill(out, me, 905);
  fill(want, (me + P - 1) % P, 905);
  DeviceTensor dout_ring(out), din_ring(in);
  Stream recv_stream(std::make_shared<TestCudaStream>());  // NCCL: send and receive on their own streams
  CommRequest r = c.irecv(din_ring.view, (me + P - 1) % P, recv_stream);
  CommRequest q = c.isend(dout_ring.view, (me + 1) % P, s);
  r.wait();
  q.wait();
  recv_stream.synchronize();
  EXPECT_SAME_BITS(din_ring.to_host().view(), want.view(), c.name() << " isend/irecv ring on the GPU");
}

TEST(Device, MpiStagesDeviceTensorsThroughPinnedMemory) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU on this host (device tensors need one)";
  select_local_gpu(launch_info());
  check_device_collectives(world(), world(), true);
  // Twice: the pinned buffers are reused.
  check_device_collectives(world(), world(), true);
}

TEST(Nccl, MatchesTheMpiEngine) {
  if (!have_gpu()) GTEST_SKIP() << "no GPU on this host";
  select_local_gpu(launch_info());
  std::unique_ptr<Comm> nccl;
  try {
    nccl = make_comm("nccl");
  } catch (const Error& e) {
    // Every rank has the same error: ranks sharing a GPU are refused before NCCL 2.30.
    if (std::string(e.what()).find("share the GPU") != std::string::npos) GTEST_SKIP() << e.what();
    throw;
  }
  EXPECT_EQ(nccl->name(), "nccl");
  check_device_collectives(*nccl, world(), nccl->size() == 1);
  auto sub = nccl->split(nccl->rank() % 2, nccl->rank());
  auto host_sub = world().split(world().rank() % 2, world().rank());
  check_device_collectives(*sub, *host_sub, sub->size() == 1);
}
#else
TEST(Device, MpiStagesDeviceTensorsThroughPinnedMemory) { GTEST_SKIP() << "built without CUDA"; }
TEST(Nccl, MatchesTheMpiEngine) { GTEST_SKIP() << "built without CUDA"; }
#endif

}  // namespace
}  // namespace fp8moe

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<fp8moe::Comm> world = fp8moe::make_comm("mpi");
  fp8moe::g_world = world.get();
  // One seed for all ranks: rank 0's (FP8MOE_SEED or fresh), printed so a failure can be replayed.
  uint64_t seed = 0;
  if (const char* s = std::getenv("FP8MOE_SEED")) seed = std::strtoull(s, nullptr, 10);
  else seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  const auto seeds = world->exchange(std::string(reinterpret_cast<const char*>(&seed), sizeof seed));
  std::memcpy(&fp8moe::g_seed, seeds[0].data(), sizeof seed);
  if (world->rank() == 0) std::cout << "[ seed     ] FP8MOE_SEED=" << fp8moe::g_seed << " on " << world->size() << " ranks\n";
  else GTEST_FLAG_SET(brief, true);  // rank 0 prints the run; the others only their failures
  const int rc = RUN_ALL_TESTS();
  fp8moe::g_world = nullptr;
  world.reset();
  return rc;
}
