// The CUDA MLA decode attention (src/cuda/attention/mla_decode.cu) against the CPU op (FP64): f32,
// bf16 and fp8 caches; DeepSeek-V3's (rkv, dr) = (512, 64), (256, 32) and a small config's (128, 32); 1, 16
// and 128 heads; lengths 1, 63, 64, 65, 1000 and 4097 in one batch over non-contiguous tables;
// both paths, with one split, a forced three and the automatic choice; bit-identical reruns; the
// by_length rule's batch invariance.
// Error measure: max |gpu - cpu| / max |cpu| over the call's output.
//   cuda_core    FP32 throughout: < 2e-5.
//   tensor_core  BF16 operands: q is rounded to BF16 here first (so its rounding in the kernel
//                is exact and the CPU sees the same q), leaving the BF16 probabilities; for the
//                bf16 and fp8 caches (the f32 one, the exact oracle, takes the other path): < 1e-2.
// Run: build/tests/cuda/test_cuda_mla_decode  (FP8MOE_SEED=n replays a seed)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "cuda/attention/mla_decode.hpp"
#include "cuda/runtime/cuda_stream.hpp"
#include "cuda_test_util.hpp"
#include "mla_decode_testing.hpp"

namespace fp8moe::testing {
namespace {

// The inputs on the GPU.
MlaInputs upload(Backend& gpu, const MlaInputs& h) {
  MlaInputs d;
  auto up = [&](const Tensor& t) { return t.view().defined() ? to_device(gpu, t) : Tensor(); };
  d.q = up(h.q);
  d.table = up(h.table);
  d.lengths = up(h.lengths);
  d.rows = up(h.rows);
  d.latent = up(h.latent);
  d.scale = up(h.scale);
  d.rope = up(h.rope);
  return d;
}

void round_to_bf16(Tensor& t) {
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = bf16_round(t.ptr<float>()[i]);
}

double rel_max_diff(const Tensor& got, const Tensor& ref) {
  double d = 0, m = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double g = got.ptr<float>()[i], r = ref.ptr<float>()[i];
    if (!std::isfinite(g)) return INFINITY;
    d = std::max(d, std::fabs(g - r));
    m = std::max(m, std::fabs(r));
  }
  return d / std::max(m, 1e-30);
}

class CudaMlaDecode : public ::testing::Test {
 protected:
  void SetUp() override {
    FP8MOE_REQUIRE_GPU();
    cpu_ = make_backend("cpu");
    gpu_ = make_backend("cuda");
  }
  // The GPU result of one path and split count, checked against the CPU reference `ref`.
  Tensor run_gpu(const MlaCase& c, const MlaInputs& d, cuda::MlaDecodePath path, int64_t splits) {
    Tensor o = gpu_->zeros(DType::f32, {c.B() * c.H, c.rkv});
    cuda::mla_decode_attention_cuda(d.q.view(), d.view(), d.table.view(), d.lengths.view(), c.scale(), o.view(),
                                    cuda::native(gpu_->stream()), path, splits);
    return gpu_->to_host(o);
  }
  void check_case(std::mt19937_64& rng, const MlaCase& c) {
    MlaInputs in = make_mla_inputs(rng, c);
    const bool tc = c.cache != DType::f32 && ((c.rkv == 512 && c.dr == 64) || (c.rkv == 256 && c.dr == 32) ||
                                              (c.rkv == 128 && c.dr == 32));
    for (cuda::MlaDecodePath path : {cuda::MlaDecodePath::cuda_core, cuda::MlaDecodePath::tensor_core}) {
      const bool tensor = path == cuda::MlaDecodePath::tensor_core;
      if (tensor && !tc) continue;
      if (tensor) round_to_bf16(in.q);
      Tensor ref = Tensor::host(DType::f32, {c.B() * c.H, c.rkv});
      cpu_->mla_decode_attention(in.q.view(), in.view(), in.table.view(), in.lengths.view(), c.scale(), ref.view());
      const MlaInputs d = upload(*gpu_, in);
      const double bound = tensor ? 1e-2 : 2e-5;
      Tensor first;
      for (int64_t splits : {int64_t(1), int64_t(3), int64_t(0)}) {
        const Tensor o = run_gpu(c, d, path, splits);
        const double e = rel_max_diff(o, ref);
        std::cout << "  " << (tensor ? "tensor_core" : "cuda_core  ") << " splits=" << splits << " " << c.str()
                  << ": rel err " << e << "\n";
        EXPECT_LT(e, bound) << c.str() << " path " << (tensor ? "tensor_core" : "cuda_core") << " splits " << splits;
        if (splits == 0) first = o;
      }
      const Tensor again = run_gpu(c, d, path, 0);
      EXPECT_EQ(0, std::memcmp(first.view().data, again.view().data, first.view().nbytes()))
          << "rerun differs: " << c.str();
    }
  }
  std::unique_ptr<Backend> cpu_, gpu_;
};

const std::vector<int64_t> kLengths = {1, 63, 64, 65, 1000, 4097};

TEST_F(CudaMlaDecode, DeepSeekShapeMatchesCpu) {
  auto rng = make_rng();
  for (DType cache : {DType::bf16, DType::e4m3, DType::f32})
    for (int64_t H : {1, 16, 128}) check_case(rng, MlaCase{H, 512, 64, kLengths, cache});
}

TEST_F(CudaMlaDecode, SmallConfigShapeMatchesCpu) {
  auto rng = make_rng();
  for (DType cache : {DType::bf16, DType::e4m3, DType::f32})
    for (int64_t H : {1, 2, 16, 40}) check_case(rng, MlaCase{H, 128, 32, kLengths, cache});
}

// (256, 32): each warp's half of the output columns is one 128-wide scale group of the fp8 cache.
TEST_F(CudaMlaDecode, MiddleShapeMatchesCpu) {
  auto rng = make_rng();
  for (DType cache : {DType::bf16, DType::e4m3})
    for (int64_t H : {16, 64}) check_case(rng, MlaCase{H, 256, 32, kLengths, cache});
}

TEST_F(CudaMlaDecode, SeveralBatchSizes) {
  auto rng = make_rng();
  for (int64_t B : {1, 2, 7, 33}) {
    std::vector<int64_t> lengths;
    std::uniform_int_distribution<int64_t> len(1, 600);
    for (int64_t b = 0; b < B; ++b) lengths.push_back(len(rng));
    check_case(rng, MlaCase{16, 512, 64, lengths, B % 2 ? DType::e4m3 : DType::bf16});
  }
}

// Sequence b of a case's inputs as a call of its own: its query rows, its table row cut to its
// blocks, its length; the same cache.
MlaInputs one_sequence(const MlaInputs& in, const MlaCase& c, int64_t b) {
  MlaInputs one = in;
  const int64_t W = c.rkv + c.dr, len = c.lengths[size_t(b)], nb = std::max<int64_t>(1, (len + 63) / 64);
  one.q = Tensor::host(DType::f32, {c.H, W});
  std::memcpy(one.q.ptr<float>(), in.q.ptr<float>() + b * c.H * W, one.q.view().nbytes());
  one.table = Tensor::host(DType::i32, {1, nb});
  std::memcpy(one.table.ptr<int32_t>(), in.table.ptr<int32_t>() + b * in.table.size(1), size_t(nb) * 4);
  one.lengths = Tensor::host(DType::i32, {1});
  one.lengths.ptr<int32_t>()[0] = int32_t(len);
  return one;
}

// MlaDecodeSplits::by_length: every sequence of a batch gets the bits it gets alone (the default
// rule's plan for one sequence), on both paths, with contexts long enough that the batch's own
// wave-filling plan would split them differently (fewer splits per sequence at B = 12).
TEST_F(CudaMlaDecode, ByLengthGivesEverySequenceItsBitsAlone) {
  auto rng = make_rng();
  const std::vector<int64_t> lengths = {1, 64, 65, 700, 3000, 8193, 17, 12000, 130, 5000, 4097, 20000};
  for (const MlaCase& c : {MlaCase{16, 512, 64, lengths, DType::bf16}, MlaCase{128, 512, 64, lengths, DType::e4m3},
                           MlaCase{2, 128, 32, lengths, DType::f32}}) {
    MlaInputs in = make_mla_inputs(rng, c);
    round_to_bf16(in.q);
    const MlaInputs d = upload(*gpu_, in);
    const int64_t W = c.rkv;
    Tensor batch = gpu_->zeros(DType::f32, {c.B() * c.H, c.rkv});
    gpu_->mla_decode_attention(d.q.view(), d.view(), d.table.view(), d.lengths.view(), c.scale(), batch.view(),
                               MlaDecodeSplits::by_length);
    const Tensor bh = gpu_->to_host(batch);
    for (int64_t b = 0; b < c.B(); ++b) {
      const MlaInputs one = upload(*gpu_, one_sequence(in, c, b));
      Tensor o = gpu_->zeros(DType::f32, {c.H, c.rkv});
      gpu_->mla_decode_attention(one.q.view(), one.view(), one.table.view(), one.lengths.view(), c.scale(), o.view());
      const Tensor oh = gpu_->to_host(o);
      EXPECT_EQ(0, std::memcmp(oh.ptr<float>(), bh.ptr<float>() + b * c.H * W, oh.view().nbytes()))
          << c.str() << ": sequence " << b << " (length " << c.lengths[size_t(b)] << ") differs from its call alone";
    }
    const cuda::MlaDecodePlan fit = cuda::mla_decode_plan(
        check_mla_decode(d.q.view(), d.view(), d.table.view(), d.lengths.view(), batch.view(), Device::cuda), d.q.view(),
        d.view(), cuda::MlaDecodePath::automatic, 0);
    const cuda::MlaDecodePlan by = cuda::mla_decode_plan(
        check_mla_decode(d.q.view(), d.view(), d.table.view(), d.lengths.view(), batch.view(), Device::cuda), d.q.view(),
        d.view(), cuda::MlaDecodePath::automatic, 0, MlaDecodeSplits::by_length);
    std::cout << "  " << c.str() << ": fit_batch " << fit.splits << " splits of " << fit.blocks_per_split
              << " blocks; by_length up to " << by.splits << " splits (target " << by.length_target << ")\n";
    EXPECT_LT(fit.splits, by.splits) << "the case does not tell the two rules apart";
  }
  expect_error([&] {
    const MlaCase c{2, 128, 32, {100}, DType::f32};
    const MlaInputs d = upload(*gpu_, make_mla_inputs(rng, c));
    Tensor o = gpu_->zeros(DType::f32, {c.H, c.rkv});
    cuda::mla_decode_attention_cuda(d.q.view(), d.view(), d.table.view(), d.lengths.view(), c.scale(), o.view(),
                                    cuda::native(gpu_->stream()), cuda::MlaDecodePath::automatic, 3,
                                    MlaDecodeSplits::by_length);
  }, "needs MlaDecodeSplits::fit_batch");
}

// A shape only the CUDA-core path takes, and the backend's op (automatic path and splits).
TEST_F(CudaMlaDecode, OtherShapesAndTheBackendOp) {
  auto rng = make_rng();
  check_case(rng, MlaCase{3, 96, 16, {1, 64, 200}, DType::bf16});
  const MlaCase c{128, 512, 64, {300, 4097}, DType::e4m3};
  const MlaInputs in = make_mla_inputs(rng, c);
  Tensor ref = Tensor::host(DType::f32, {c.B() * c.H, c.rkv});
  cpu_->mla_decode_attention(in.q.view(), in.view(), in.table.view(), in.lengths.view(), c.scale(), ref.view());
  const MlaInputs d = upload(*gpu_, in);
  Tensor o = gpu_->zeros(DType::f32, {c.B() * c.H, c.rkv});
  gpu_->mla_decode_attention(d.q.view(), d.view(), d.table.view(), d.lengths.view(), c.scale(), o.view());
  const double e = rel_max_diff(gpu_->to_host(o), ref);
  std::cout << "  backend op, f32 q, " << c.str() << ": rel err " << e << "\n";
  EXPECT_LT(e, 2e-2);
  // Shapes are checked on the host, before any launch.
  Tensor o_bad = gpu_->zeros(DType::f32, {c.B() * c.H, 256});
  expect_error([&] { gpu_->mla_decode_attention(d.q.view(), d.view(), d.table.view(), d.lengths.view(), 0.1, o_bad.view()); },
               "o must be");
}

}  // namespace
}  // namespace fp8moe::testing
