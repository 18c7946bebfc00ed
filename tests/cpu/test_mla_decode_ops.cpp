// The CPU MLA decode attention (src/cpu/ops_mla_decode.cpp, the specification the CUDA kernels
// are held to): a case computed by hand; against the backend's causal attention op over the
// sequence's rows gathered through its table (the engine's expanded form of the same product:
// keys the whole row in every head, values the latent, the query on the last row), for every
// cache form, lengths around the 64-token blocks, non-contiguous tables; lengths of 0 and block
// indices outside the cache; argument errors.
#include <cmath>

#include "fp8moe/backend.hpp"
#include "mla_decode_testing.hpp"
#include "testing.hpp"

namespace fp8moe::testing {
namespace {

// o of the op for the case's inputs.
Tensor run_op(Backend& cpu, const MlaCase& c, const MlaInputs& in) {
  Tensor o = Tensor::host(DType::f32, {c.B() * c.H, c.rkv});
  cpu.mla_decode_attention(in.q.view(), in.view(), in.table.view(), in.lengths.view(), c.scale(), o.view());
  return o;
}

// The cached row of `slot` decoded to f32.
std::vector<float> decoded_row(const MlaCase& c, const MlaInputs& in, int64_t slot) {
  const int64_t W = c.rkv + c.dr, G = c.rkv / kQuantGroup;
  std::vector<float> r(static_cast<size_t>(W));
  for (int64_t i = 0; i < W; ++i) {
    if (c.cache == DType::f32) r[size_t(i)] = in.rows.ptr<float>()[slot * W + i];
    else if (c.cache == DType::bf16) r[size_t(i)] = bf16_decode(in.rows.ptr<uint16_t>()[slot * W + i]);
    else if (i < c.rkv)
      r[size_t(i)] = e4m3_decode(in.latent.ptr<uint8_t>()[slot * c.rkv + i]) * in.scale.ptr<float>()[slot * G + i / 128];
    else
      r[size_t(i)] = bf16_decode(in.rope.ptr<uint16_t>()[slot * c.dr + i - c.rkv]);
  }
  return r;
}

TEST(MlaDecodeOps, HandComputedCase) {
  auto cpu = make_backend("cpu");
  // rkv = 2, dr = 1, one head, two tokens in block 1 of a 2-block pool: q . k = (ln 3, 0), so
  // the weights are (3/4, 1/4) and o = 3/4 v0 + 1/4 v1.
  Tensor q = Tensor::host(DType::f32, {1, 3}), rows = Tensor::host(DType::f32, {128, 3});
  q.ptr<float>()[0] = 1.0f;
  const float k0[3] = {1.0f, 2.0f, 0.0f}, k1[3] = {0.0f, -4.0f, 0.0f};  // q . k = 1 and 0
  for (int i = 0; i < 3; ++i) {
    rows.ptr<float>()[(64 + 0) * 3 + i] = k0[i];
    rows.ptr<float>()[(64 + 1) * 3 + i] = k1[i];
    rows.ptr<float>()[0 * 3 + i] = 100.0f;  // block 0: not the sequence's
  }
  Tensor table = Tensor::host(DType::i32, {1, 1}), len = Tensor::host(DType::i32, {1});
  table.ptr<int32_t>()[0] = 1;
  len.ptr<int32_t>()[0] = 2;
  Tensor o = Tensor::host(DType::f32, {1, 2});
  MlaCacheView cv;
  cv.rows = rows.view();
  cpu->mla_decode_attention(q.view(), cv, table.view(), len.view(), std::log(3.0), o.view());
  EXPECT_NEAR(o.ptr<float>()[0], 0.75f * 1.0f + 0.25f * 0.0f, 1e-7);
  EXPECT_NEAR(o.ptr<float>()[1], 0.75f * 2.0f + 0.25f * -4.0f, 1e-7);
}

TEST(MlaDecodeOps, EqualsCausalAttentionOverGatheredRows) {
  auto cpu = make_backend("cpu");
  auto rng = make_rng();
  const std::vector<int64_t> lengths = {1, 63, 64, 65, 130};
  for (DType cache : {DType::f32, DType::bf16, DType::e4m3})
    for (int64_t H : {1, 3}) {
      const MlaCase c{H, 128, 32, lengths, cache};
      const MlaInputs in = make_mla_inputs(rng, c);
      const Tensor o = run_op(*cpu, c, in);
      const int64_t W = c.rkv + c.dr, mb = in.table.size(1);
      double worst = 0;  // max |got - ref| / max |ref| of a sequence, the worst sequence
      for (int64_t b = 0; b < c.B(); ++b) {
        const int64_t L = lengths[size_t(b)];
        Tensor Q = Tensor::host(DType::f32, {L, H, W}), K = Tensor::host(DType::f32, {L, H, W}),
               V = Tensor::host(DType::f32, {L, H, c.rkv}), out = Tensor::host(DType::f32, {L, H, c.rkv}),
               lse = Tensor::host(DType::f32, {H, L});
        for (int64_t p = 0; p < L; ++p) {
          const int64_t slot = int64_t(in.table.ptr<int32_t>()[b * mb + p / 64]) * 64 + p % 64;
          const std::vector<float> r = decoded_row(c, in, slot);
          for (int64_t h = 0; h < H; ++h) {
            std::copy(r.begin(), r.end(), K.ptr<float>() + (p * H + h) * W);
            std::copy(r.begin(), r.begin() + c.rkv, V.ptr<float>() + (p * H + h) * c.rkv);
          }
        }
        std::copy(in.q.ptr<float>() + b * H * W, in.q.ptr<float>() + (b + 1) * H * W, Q.ptr<float>() + (L - 1) * H * W);
        cpu->attention_forward(Q.view(), K.view(), V.view(), out.view(), lse.view(), L, c.scale(), DType::f32);
        double diff = 0, peak = 0;
        for (int64_t i = 0; i < H * c.rkv; ++i) {
          const double ref = out.ptr<float>()[(L - 1) * H * c.rkv + i], got = o.ptr<float>()[b * H * c.rkv + i];
          diff = std::max(diff, std::fabs(got - ref));
          peak = std::max(peak, std::fabs(ref));
        }
        worst = std::max(worst, diff / peak);
      }
      // FP32 attention against FP64 sums: FP32 rounding over <= 130 keys, measured up to 1.4e-7
      // over 40 seeds (the element-wise relative error spikes where an output is near zero).
      EXPECT_LT(worst, 4e-7) << c.str();
    }
}

TEST(MlaDecodeOps, EmptySequencesAndBlocksOutsideTheCache) {
  auto cpu = make_backend("cpu");
  auto rng = make_rng();
  MlaCase c{2, 128, 32, {0, 70, 70}, DType::bf16};
  MlaInputs in = make_mla_inputs(rng, c);
  const Tensor full = run_op(*cpu, c, in);
  // Sequence 2's second block outside the pool: its tokens 64..69 are absent, as if it had 64.
  const int64_t mb = in.table.size(1);
  in.table.ptr<int32_t>()[2 * mb + 1] = int32_t(in.rows.size(0) / 64);
  const Tensor cut = run_op(*cpu, c, in);
  in.lengths.ptr<int32_t>()[2] = 64;
  const Tensor short64 = run_op(*cpu, c, in);
  for (int64_t i = 0; i < c.H * c.rkv; ++i) {
    EXPECT_EQ(full.ptr<float>()[i], 0.0f);  // length 0: zeros
    EXPECT_EQ(cut.ptr<float>()[2 * c.H * c.rkv + i], short64.ptr<float>()[2 * c.H * c.rkv + i]);
    EXPECT_EQ(cut.ptr<float>()[c.H * c.rkv + i], full.ptr<float>()[c.H * c.rkv + i]);  // sequence 1 untouched
  }
}

TEST(MlaDecodeOps, ArgumentErrors) {
  auto cpu = make_backend("cpu");
  auto rng = make_rng();
  const MlaCase c{2, 128, 32, {5, 9}, DType::e4m3};
  const MlaInputs in = make_mla_inputs(rng, c);
  Tensor o = Tensor::host(DType::f32, {4, 128});
  auto call = [&](const TensorView& q, const MlaCacheView& cv, const TensorView& t, const TensorView& l,
                  const TensorView& out) { cpu->mla_decode_attention(q, cv, t, l, 0.1, out); };
  call(in.q.view(), in.view(), in.table.view(), in.lengths.view(), o.view());  // the good call
  Tensor q_bad = Tensor::host(DType::f32, {4, 150});
  expect_error([&] { call(q_bad.view(), in.view(), in.table.view(), in.lengths.view(), o.view()); }, "q must be [B * H, 160]");
  Tensor o_bad = Tensor::host(DType::f32, {4, 96});
  expect_error([&] { call(in.q.view(), in.view(), in.table.view(), in.lengths.view(), o_bad.view()); }, "o must be [4, 128]");
  Tensor t_bad = Tensor::host(DType::i32, {3, 1});
  expect_error([&] { call(in.q.view(), in.view(), t_bad.view(), in.lengths.view(), o.view()); }, "table must be [2, max_blocks]");
  MlaCacheView no_scale = in.view();
  no_scale.scale = TensorView();
  expect_error([&] { call(in.q.view(), no_scale, in.table.view(), in.lengths.view(), o.view()); }, "cache scale");
  Tensor q3 = Tensor::host(DType::f32, {3, 160});
  expect_error([&] { call(q3.view(), in.view(), in.table.view(), in.lengths.view(), o.view()); }, "multiple of B = 2");
}

}  // namespace
}  // namespace fp8moe::testing
