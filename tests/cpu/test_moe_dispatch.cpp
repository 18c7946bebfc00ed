// The CPU MoE dispatch ops (backend.hpp: moe_layout, moe_permute, moe_permute_quantize,
// moe_combine, moe_combine_weight_grad): hand-worked small cases, agreement with the references of
// moe_grouped.hpp (build_moe_layout, moe_permute_quantize, moe_unpermute_combine) bit for bit on
// random routing with skewed loads, empty experts and dropped slots, align 1 / 64 / 128, f32 and
// bf16, and the errors for bad arguments and out-of-range indices.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "fp8moe/backend.hpp"
#include "fp8moe/moe_grouped.hpp"
#include "moe_routing.hpp"
#include "testing.hpp"

namespace fp8moe::testing {
namespace {

Tensor i32_tensor(std::initializer_list<int64_t> shape, const std::vector<int32_t>& v) {
  Tensor t = Tensor::host(DType::i32, shape);
  EXPECT_EQ(t.numel(), int64_t(v.size()));
  std::copy(v.begin(), v.end(), t.ptr<int32_t>());
  return t;
}

Tensor f32_tensor(std::initializer_list<int64_t> shape, const std::vector<float>& v) {
  Tensor t = Tensor::host(DType::f32, shape);
  EXPECT_EQ(t.numel(), int64_t(v.size()));
  std::copy(v.begin(), v.end(), t.ptr<float>());
  return t;
}

std::vector<int32_t> ints(const Tensor& t) { return {t.ptr<const int32_t>(), t.ptr<const int32_t>() + t.numel()}; }

// Host tensor of `dtype` with the values of x.
Tensor as_dtype(const Tensor& x, DType dtype) {
  Tensor y = Tensor::host(dtype, {x.size(0), x.size(1)});
  for (int64_t i = 0; i < x.numel(); ++i) store_float(y.view(), i, load_float(x.view(), i));
  return y;
}

bool same_bytes(const TensorView& a, const TensorView& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

// The row range [0, rows) of a 1-D or 2-D tensor.
TensorView head_rows(const TensorView& t, int64_t rows) {
  TensorView v = t;
  v.shape[0] = rows;
  return v;
}

struct Layout {
  Tensor row_slot, row_group, slot_row, offsets;
};

class MoeDispatchCpu : public ::testing::Test {
 protected:
  void SetUp() override { rng_ = make_rng(); }

  // moe_layout into tables of R rows (default: the moe_layout_rows bound).
  Layout layout(const Tensor& ids, int64_t groups, int64_t align, int64_t rows = -1) {
    if (rows < 0) rows = moe_layout_rows(ids.numel(), groups, align);
    Layout L{Tensor::host(DType::i32, {rows}), Tensor::host(DType::i32, {rows}),
             Tensor::host(DType::i32, {ids.size(0), ids.size(1)}), Tensor::host(DType::i32, {groups + 1})};
    cpu_->moe_layout(ids, align, L.row_slot, L.row_group, L.slot_row, L.offsets);
    return L;
  }

  std::unique_ptr<Backend> cpu_ = make_backend("cpu");
  std::mt19937_64 rng_;
};

// ---- moe_layout ----

// T = 4, k = 2, G = 4 (expert 3 empty), ids [[2, 0], [0, -1], [1, 2], [-1, 0]]:
// expert 0 takes slots 1, 2, 7; expert 1 slot 4; expert 2 slots 0, 5.
TEST_F(MoeDispatchCpu, LayoutHandWorked) {
  const Tensor ids = i32_tensor({4, 2}, {2, 0, 0, -1, 1, 2, -1, 0});
  {
    const Layout L = layout(ids, 4, 2);  // segments 4, 2, 2, 0 rows; R = moe_layout_rows(8, 4, 2) = 12
    EXPECT_EQ(ints(L.offsets), (std::vector<int32_t>{0, 4, 6, 8, 8}));
    EXPECT_EQ(ints(L.row_slot), (std::vector<int32_t>{1, 2, 7, -1, 4, -1, 0, 5, -1, -1, -1, -1}));
    EXPECT_EQ(ints(L.row_group), (std::vector<int32_t>{0, 0, 0, -1, 1, -1, 2, 2, -1, -1, -1, -1}));
    EXPECT_EQ(ints(L.slot_row), (std::vector<int32_t>{6, 0, 1, -1, 4, 7, -1, 2}));
  }
  {
    const Layout L = layout(ids, 4, 1, 9);  // unpadded, one spare row
    EXPECT_EQ(ints(L.offsets), (std::vector<int32_t>{0, 3, 4, 6, 6}));
    EXPECT_EQ(ints(L.row_slot), (std::vector<int32_t>{1, 2, 7, 4, 0, 5, -1, -1, -1}));
    EXPECT_EQ(ints(L.row_group), (std::vector<int32_t>{0, 0, 0, 1, 2, 2, -1, -1, -1}));
    EXPECT_EQ(ints(L.slot_row), (std::vector<int32_t>{4, 0, 1, -1, 3, 5, -1, 2}));
  }
}

// The same tables as build_moe_layout (row_token = row_slot / k), rows past offsets[G] = -1.
TEST_F(MoeDispatchCpu, LayoutMatchesBuildMoeLayout) {
  const RoutingSpec specs[] = {{300, 3, 6, 0, 0, {4}},         {1000, 8, 32, 1.5, 0.05, {0, 7, 31}},
                               {77, 2, 5, 0, 0.5, {}},          {129, 6, 64, 0.8, 0, {1, 2, 3}},
                               {1, 1, 1, 0, 0, {}},             {50, 4, 300, 0, 0.1, {}}};
  for (const RoutingSpec& s : specs)
    for (int64_t align : {1, 64, 128}) {
      const std::string what = "T=" + std::to_string(s.tokens) + " k=" + std::to_string(s.topk) +
                               " G=" + std::to_string(s.groups) + " align=" + std::to_string(align);
      const Tensor ids = random_routing(rng_, s);
      const MoeLayout ref = build_moe_layout(ids, s.groups, align);
      const int64_t R = moe_layout_rows(ids.numel(), s.groups, align) + 3;
      const Layout L = layout(ids, s.groups, align, R);
      for (int64_t g = 0; g <= s.groups; ++g)
        ASSERT_EQ(L.offsets.ptr<int32_t>()[g], ref.offsets[size_t(g)]) << what << " offsets[" << g << "]";
      ASSERT_EQ(ints(L.slot_row), ref.slot_row) << what;
      for (int64_t r = 0; r < R; ++r) {
        const int32_t slot = L.row_slot.ptr<int32_t>()[r], grp = L.row_group.ptr<int32_t>()[r];
        const int32_t want_token = r < ref.rows() ? ref.row_token[size_t(r)] : -1;
        const int32_t want_group = r < ref.rows() ? ref.row_group[size_t(r)] : -1;
        ASSERT_EQ(slot < 0 ? -1 : slot / int32_t(s.topk), want_token) << what << " row " << r;
        ASSERT_EQ(grp, want_group) << what << " row " << r;
        if (slot >= 0) {
          ASSERT_EQ(L.slot_row.ptr<int32_t>()[slot], r) << what << " row " << r;
        }
      }
    }
}

TEST_F(MoeDispatchCpu, LayoutRejectsBadArguments) {
  const Tensor ids = i32_tensor({2, 2}, {0, 1, 2, -1});
  const int64_t R = moe_layout_rows(4, 3, 4);
  Tensor rs = Tensor::host(DType::i32, {R}), rg = Tensor::host(DType::i32, {R}), sr = Tensor::host(DType::i32, {2, 2}),
         off = Tensor::host(DType::i32, {4});
  auto run = [&](const Tensor& e, int64_t align, const TensorView& row_slot, const TensorView& slot_row,
                 const TensorView& offsets) { cpu_->moe_layout(e, align, row_slot, rg, slot_row, offsets); };
  run(ids, 4, rs, sr, off);  // valid
  expect_error([&] { run(i32_tensor({2, 2}, {0, 3, 2, -1}), 4, rs, sr, off); }, "value 3 at [0, 1] outside [-1, 3)");
  expect_error([&] { run(i32_tensor({2, 2}, {0, 1, -2, -1}), 4, rs, sr, off); }, "value -2 at [1, 0]");
  expect_error([&] { cpu_->moe_layout(ids, 4, head_rows(rs, R - 1), head_rows(rg, R - 1), sr, off); },
               "moe_layout: row_slot has 15 rows, fewer than moe_layout_rows(T * k = 4, G = 3, align = 4) = 16");
  expect_error([&] { run(ids, 0, rs, sr, off); }, "moe_layout: align must be in [1, 2^31)");
  expect_error([&] { run(ids, 4, rs, sr, head_rows(off, 1)); }, "moe_layout: offsets must hold G + 1 >= 2");
  expect_error([&] { run(ids, 4, rs, Tensor::host(DType::i32, {2, 3}), off); }, "moe_layout: slot_row");
  expect_error([&] { run(ids, 4, Tensor::host(DType::f32, {R}), sr, off); }, "moe_layout: row_slot");
  expect_error([&] { cpu_->moe_layout(ids, 4, rs, Tensor::host(DType::i32, {R + 1}), sr, off); }, "row_group");
  TensorView on_gpu = rs.view();
  on_gpu.device = Device::cuda;
  expect_error([&] { run(ids, 4, on_gpu, sr, off); }, "moe_layout: row_slot must be a cpu tensor");
}

// ---- moe_masked_layout ----

// The ids of LayoutHandWorked with M_max = 4: group g's slots in slot order at rows 4g + i;
// with every_token_group = 3 each token's third slot goes to group 3. The loads add the counts.
TEST_F(MoeDispatchCpu, MaskedLayoutHandWorked) {
  const Tensor ids = i32_tensor({4, 2}, {2, 0, 0, -1, 1, 2, -1, 0});
  const auto run = [&](int64_t every, int64_t K) {
    Tensor rs = Tensor::host(DType::i32, {16}), sr = Tensor::host(DType::i32, {4, K}),
           counts = Tensor::host(DType::i32, {4}), loads = Tensor::host(DType::i64, {4});
    for (int64_t g = 0; g < 4; ++g) loads.ptr<int64_t>()[g] = 10 * (g + 1);
    cpu_->moe_masked_layout(ids, 4, every, rs, sr, counts, loads);
    return std::make_tuple(ints(rs), ints(sr), ints(counts),
                           std::vector<int64_t>(loads.ptr<int64_t>(), loads.ptr<int64_t>() + 4));
  };
  const auto [rs2, sr2, counts2, loads2] = run(-1, 2);
  EXPECT_EQ(rs2, (std::vector<int32_t>{1, 2, 7, -1, 4, -1, -1, -1, 0, 5, -1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(sr2, (std::vector<int32_t>{8, 0, 1, -1, 4, 9, -1, 2}));
  EXPECT_EQ(counts2, (std::vector<int32_t>{3, 1, 2, 0}));
  EXPECT_EQ(loads2, (std::vector<int64_t>{13, 21, 32, 40}));
  const auto [rs3, sr3, counts3, loads3] = run(3, 3);
  EXPECT_EQ(rs3, (std::vector<int32_t>{1, 3, 10, -1, 6, -1, -1, -1, 0, 7, -1, -1, 2, 5, 8, 11}));
  EXPECT_EQ(sr3, (std::vector<int32_t>{8, 0, 12, 1, -1, 13, 4, 9, 14, -1, 2, 15}));
  EXPECT_EQ(counts3, (std::vector<int32_t>{3, 1, 2, 4}));
  EXPECT_EQ(loads3, (std::vector<int64_t>{13, 21, 32, 44}));
  Tensor rs = Tensor::host(DType::i32, {8}), sr = Tensor::host(DType::i32, {4, 2}), c = Tensor::host(DType::i32, {4});
  expect_error([&] { cpu_->moe_masked_layout(ids, 4, -1, rs, sr, c, TensorView()); },
               "moe_masked_layout: group 0 has more than M_max = 2 slots");
  expect_error([&] { cpu_->moe_masked_layout(ids, 2, -1, rs, sr, head_rows(c, 2), TensorView()); },
               "expert_ids[0] = 2 outside [-1, G = 2)");
  expect_error([&] { cpu_->moe_masked_layout(ids, 4, 4, rs, sr, c, TensorView()); }, "every_token_group 4");
  expect_error([&] { cpu_->moe_masked_layout(ids, 3, -1, rs, sr, c, TensorView()); }, "G * M_max");
}

// ---- moe_permute, moe_permute_quantize ----

// x [3, 2], k = 2; row_slot [5, -1, 0, 2] -> rows x[2] * w[5], 0, x[0] * w[0], x[1] * w[2].
TEST_F(MoeDispatchCpu, PermuteHandWorked) {
  const Tensor x = f32_tensor({3, 2}, {1, 2, 3, 4, 5, 6});
  const Tensor rs = i32_tensor({4}, {5, -1, 0, 2});
  const Tensor w = f32_tensor({3, 2}, {0.5f, 2, 1, 1, 3, 0.25f});
  for (DType in : {DType::f32, DType::bf16})
    for (DType out_dt : {DType::f32, DType::bf16}) {
      Tensor out = Tensor::host(out_dt, {4, 2});
      cpu_->moe_permute(as_dtype(x, in), rs, 2, w, out);
      EXPECT_EQ(to_doubles(out), (std::vector<double>{1.25, 1.5, 0, 0, 0.5, 1, 3, 4}));
      cpu_->moe_permute(as_dtype(x, in), rs, 2, TensorView{}, out);
      EXPECT_EQ(to_doubles(out), (std::vector<double>{5, 6, 0, 0, 1, 2, 3, 4}));
    }
}

// Without weights: bit for bit the reference fused gather + quantize of moe_grouped.hpp.
TEST_F(MoeDispatchCpu, PermuteQuantizeMatchesReference) {
  for (DType in : {DType::f32, DType::bf16})
    for (int64_t align : {1, 64, 128})
      for (ScaleMode mode : {ScaleMode::fp32, ScaleMode::pow2}) {
        const RoutingSpec s{133, 3, 7, 1.0, 0.1, {5}};
        const Tensor ids = random_routing(rng_, s);
        const Tensor x = random_normal(rng_, in, {s.tokens, 384}, 3.0f);
        const MoeLayout ref_layout = build_moe_layout(ids, s.groups, align);
        QuantizedTensor want = make_quantized_host(ref_layout.rows(), 384, DType::e4m3, ScaleKind::tile_1x128);
        moe_permute_quantize(x, ref_layout, want, mode);
        const Layout L = layout(ids, s.groups, align);
        QuantizedTensor got = make_quantized_host(ref_layout.rows(), 384, DType::e4m3, ScaleKind::tile_1x128);
        cpu_->moe_permute_quantize(x, head_rows(L.row_slot, ref_layout.rows()), s.topk, TensorView{}, got, mode);
        const std::string what = std::string(dtype_name(in)) + " align=" + std::to_string(align) +
                                 (mode == ScaleMode::pow2 ? " pow2" : " fp32");
        EXPECT_TRUE(same_bytes(got.values, want.values)) << what;
        EXPECT_TRUE(same_bytes(got.scales, want.scales)) << what;
      }
}

// With weights and every row of the bound (rows past offsets[G] zero, scale 1): moe_permute into
// f32 followed by quantize_1x128, in e4m3 and e5m2.
TEST_F(MoeDispatchCpu, PermuteQuantizeIsPermuteThenQuantize) {
  const RoutingSpec s{70, 4, 9, 0.5, 0.2, {2}};
  const Tensor ids = random_routing(rng_, s);
  const Layout L = layout(ids, s.groups, 16);
  const int64_t R = L.row_slot.size(0), D = 256;
  const Tensor w = random_normal(rng_, DType::f32, {s.tokens, s.topk}, 1.0f);
  const Tensor x = random_normal(rng_, DType::bf16, {s.tokens, D}, 1.0f);
  Tensor rows = Tensor::host(DType::f32, {R, D});
  cpu_->moe_permute(x, L.row_slot, s.topk, w, rows);
  for (DType q : {DType::e4m3, DType::e5m2}) {
    QuantizedTensor want = make_quantized_host(R, D, q, ScaleKind::tile_1x128);
    quantize_1x128(rows, want, ScaleMode::pow2);
    QuantizedTensor got = make_quantized_host(R, D, q, ScaleKind::tile_1x128);
    cpu_->moe_permute_quantize(x, L.row_slot, s.topk, w, got, ScaleMode::pow2);
    EXPECT_TRUE(same_bytes(got.values, want.values)) << dtype_name(q);
    EXPECT_TRUE(same_bytes(got.scales, want.scales)) << dtype_name(q);
    const int64_t used = L.offsets.ptr<int32_t>()[s.groups];
    for (int64_t r = used; r < R; ++r) EXPECT_EQ(got.view().scale_at(r, 128), 1.0f) << "row " << r;
  }
}

TEST_F(MoeDispatchCpu, PermuteRejectsBadArguments) {
  const Tensor x = random_normal(rng_, DType::bf16, {3, 128}, 1.0f);
  const Tensor rs = i32_tensor({4}, {5, -1, 0, 2});
  const Tensor w = Tensor::host(DType::f32, {3, 2});
  Tensor out = Tensor::host(DType::bf16, {4, 128});
  QuantizedTensor q = make_quantized_host(4, 128, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { cpu_->moe_permute(x, i32_tensor({4}, {6, -1, 0, 2}), 2, w, out); },
               "moe_permute: row_slot[0] = 6 outside [-1, T * topk = 6)");
  expect_error([&] { cpu_->moe_permute(x, i32_tensor({4}, {5, -2, 0, 2}), 2, w, out); }, "row_slot[1] = -2");
  expect_error([&] { cpu_->moe_permute(x, rs, 0, TensorView{}, out); }, "moe_permute: topk must be >= 1");
  expect_error([&] { cpu_->moe_permute(x, rs, 2, Tensor::host(DType::f32, {3, 3}), out); }, "moe_permute: w");
  expect_error([&] { cpu_->moe_permute(x, rs, 2, Tensor::host(DType::bf16, {3, 2}), out); }, "moe_permute: w");
  expect_error([&] { cpu_->moe_permute(x, rs, 2, w, Tensor::host(DType::bf16, {5, 128})); }, "moe_permute: out");
  expect_error([&] { cpu_->moe_permute(x, rs, 2, w, Tensor::host(DType::e4m3, {4, 128})); }, "moe_permute: out");
  expect_error([&] { cpu_->moe_permute(Tensor::host(DType::i32, {3, 128}), rs, 2, w, out); }, "moe_permute: x");
  expect_error([&] { cpu_->moe_permute_quantize(x, i32_tensor({4}, {5, -1, 0, 7}), 2, w, q, ScaleMode::pow2); },
               "moe_permute_quantize: row_slot[3] = 7");
  QuantizedTensor q_e5m6 = make_quantized_host(4, 128, DType::e5m6, ScaleKind::tile_1x128);
  expect_error([&] { cpu_->moe_permute_quantize(x, rs, 2, w, q_e5m6, ScaleMode::pow2); },
               "moe_permute_quantize: out.values");
  const Tensor x100 = random_normal(rng_, DType::bf16, {3, 100}, 1.0f);
  QuantizedTensor q100 = make_quantized_host(4, 100, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { cpu_->moe_permute_quantize(x100, rs, 2, w, q100, ScaleMode::pow2); },
               "D = 100 columns must be a multiple of 128");
  QuantizedTensor q_rows = make_quantized_host(5, 128, DType::e4m3, ScaleKind::tile_1x128);
  expect_error([&] { cpu_->moe_permute_quantize(x, rs, 2, w, q_rows, ScaleMode::pow2); }, "out.values");
}

// ---- f64 (the finite-difference checks) ----

std::vector<double> f64s(const Tensor& t) { return {t.ptr<const double>(), t.ptr<const double>() + t.numel()}; }

// Any f64 tensor makes an op compute in FP64: 1 + 2^-40 survives (FP32 would round it to 1).
TEST_F(MoeDispatchCpu, F64ComputesInDouble) {
  const double v = 1.0 + std::ldexp(1.0, -40);
  Tensor x = Tensor::host(DType::f64, {2, 1}), w = Tensor::host(DType::f64, {2, 1});
  x.ptr<double>()[0] = 3.0;
  x.ptr<double>()[1] = v;
  w.ptr<double>()[0] = 0.5;
  w.ptr<double>()[1] = 1.0;
  const Tensor rs = i32_tensor({3}, {1, -1, 0});
  Tensor out = Tensor::host(DType::f64, {3, 1});
  cpu_->moe_permute(x, rs, 1, w, out);
  EXPECT_EQ(f64s(out), (std::vector<double>{v, 0, 1.5}));
  Tensor out32 = Tensor::host(DType::f32, {3, 1});
  cpu_->moe_permute(x, rs, 1, TensorView{}, out32);
  EXPECT_EQ(to_doubles(out32), (std::vector<double>{1, 0, 3}));

  const Tensor sr = i32_tensor({2, 1}, {2, 0});
  Tensor y = Tensor::host(DType::f64, {3, 1});
  y.ptr<double>()[0] = v;
  y.ptr<double>()[2] = 4.0;
  Tensor comb = Tensor::host(DType::f64, {2, 1});
  comb.ptr<double>()[0] = 1.0;
  cpu_->moe_combine(y, sr, w, comb, true);
  EXPECT_EQ(f64s(comb), (std::vector<double>{3.0, v}));

  TensorView v1 = y.view();  // y as v [R = 3]
  v1.ndim = 1;
  Tensor dw = Tensor::host(DType::f64, {2, 1});
  cpu_->moe_combine_weight_grad(v1, sr, w, dw);
  EXPECT_EQ(f64s(dw), (std::vector<double>{8.0, v}));
}

// ---- moe_combine, moe_combine_weight_grad ----

// y rows [1, 2], [3, 4], [5, 6]; slot_row [[2, 0], [-1, 1]], w [[0.5, 2], [7, 0.25]].
TEST_F(MoeDispatchCpu, CombineHandWorked) {
  const Tensor y = f32_tensor({3, 2}, {1, 2, 3, 4, 5, 6});
  const Tensor sr = i32_tensor({2, 2}, {2, 0, -1, 1});
  const Tensor w = f32_tensor({2, 2}, {0.5f, 2, 7, 0.25f});
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor out = f32_tensor({2, 2}, {100, 200, 300, 400});
    cpu_->moe_combine(as_dtype(y, dt), sr, w, out, false);
    EXPECT_EQ(to_doubles(out), (std::vector<double>{4.5, 7, 0.75, 1}));
    cpu_->moe_combine(as_dtype(y, dt), sr, w, out, true);
    EXPECT_EQ(to_doubles(out), (std::vector<double>{9, 14, 1.5, 2}));
    cpu_->moe_combine(as_dtype(y, dt), sr, TensorView{}, out, false);
    EXPECT_EQ(to_doubles(out), (std::vector<double>{6, 8, 3, 4}));
  }
}

// Bit for bit moe_unpermute_combine (FP32, slot order); accumulate adds onto out in slot order.
TEST_F(MoeDispatchCpu, CombineMatchesReference) {
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t align : {1, 128}) {
      const RoutingSpec s{211, 6, 11, 1.2, 0.1, {3}};
      const Tensor ids = random_routing(rng_, s);
      const MoeLayout ref_layout = build_moe_layout(ids, s.groups, align);
      const Layout L = layout(ids, s.groups, align);
      const int64_t N = 300;
      const Tensor y = random_normal(rng_, dt, {L.row_slot.size(0), N}, 1.0f);
      const Tensor w = random_normal(rng_, DType::f32, {s.tokens, s.topk}, 1.0f);
      Tensor want = Tensor::host(DType::f32, {s.tokens, N});
      moe_unpermute_combine(head_rows(y, ref_layout.rows()), w, ref_layout, want);
      Tensor got = Tensor::host(DType::f32, {s.tokens, N});
      cpu_->moe_combine(y, L.slot_row, w, got, false);
      EXPECT_TRUE(same_bytes(got, want)) << dtype_name(dt) << " align=" << align;

      const Tensor base = random_normal(rng_, DType::f32, {s.tokens, N}, 1.0f);
      Tensor acc = as_dtype(base, DType::f32);
      cpu_->moe_combine(y, L.slot_row, w, acc, true);
      for (int64_t t = 0; t < s.tokens; ++t)
        for (int64_t n = 0; n < N; ++n) {
          float e = base.ptr<float>()[t * N + n];
          for (int64_t j = 0; j < s.topk; ++j) {
            const int32_t r = L.slot_row.ptr<int32_t>()[t * s.topk + j];
            if (r >= 0) e += w.ptr<float>()[t * s.topk + j] * load_float(y, r * N + n);
          }
          ASSERT_EQ(acc.ptr<float>()[t * N + n], e) << "accumulate t=" << t << " n=" << n;
        }
    }
}

// dw = v / w with v = rows_dot(w * dy gathered to the rows, y): dy[t] . y[slot_row[t, j]].
TEST_F(MoeDispatchCpu, CombineWeightGradIsTheCombineGradient) {
  const RoutingSpec s{90, 4, 8, 0.7, 0.1, {6}};
  const Tensor ids = random_routing(rng_, s);
  const Layout L = layout(ids, s.groups, 8);
  const int64_t R = L.row_slot.size(0), N = 64;
  const Tensor y = random_normal(rng_, DType::f32, {R, N}, 1.0f);
  const Tensor dy = random_normal(rng_, DType::f32, {s.tokens, N}, 1.0f);
  Tensor w = random_normal(rng_, DType::f32, {s.tokens, s.topk}, 1.0f);
  for (int64_t i = 0; i < w.numel(); ++i) w.ptr<float>()[i] = 0.1f + std::fabs(w.ptr<float>()[i]);
  Tensor g = Tensor::host(DType::f32, {R, N}), v = Tensor::host(DType::f32, {R});
  cpu_->moe_permute(dy, L.row_slot, s.topk, w, g);
  cpu_->rows_dot(g, y, v);
  Tensor dw = Tensor::host(DType::f32, {s.tokens, s.topk});
  cpu_->moe_combine_weight_grad(v, L.slot_row, w, dw);
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t j = 0; j < s.topk; ++j) {
      const int32_t r = L.slot_row.ptr<int32_t>()[t * s.topk + j];
      double want = 0;
      for (int64_t n = 0; r >= 0 && n < N; ++n) want += double(dy.ptr<float>()[t * N + n]) * y.ptr<float>()[r * N + n];
      EXPECT_NEAR(dw.ptr<float>()[t * s.topk + j], want, 1e-4 * (1 + std::fabs(want))) << "t=" << t << " j=" << j;
    }
}

TEST_F(MoeDispatchCpu, CombineWeightGradHandWorked) {
  const Tensor v = f32_tensor({3}, {1, -3, 6});
  const Tensor sr = i32_tensor({2, 2}, {2, 0, -1, 1});
  const Tensor w = f32_tensor({2, 2}, {0.5f, 2, 7, 0.25f});
  Tensor dw = f32_tensor({2, 2}, {9, 9, 9, 9});
  cpu_->moe_combine_weight_grad(v, sr, w, dw);
  EXPECT_EQ(to_doubles(dw), (std::vector<double>{12, 0.5, 0, -12}));
}

TEST_F(MoeDispatchCpu, CombineRejectsBadArguments) {
  const Tensor y = Tensor::host(DType::bf16, {3, 8});
  const Tensor sr = i32_tensor({2, 2}, {2, 0, -1, 1});
  const Tensor w = Tensor::host(DType::f32, {2, 2});
  Tensor out = Tensor::host(DType::f32, {2, 8});
  expect_error([&] { cpu_->moe_combine(y, i32_tensor({2, 2}, {2, 3, -1, 1}), w, out, false); },
               "moe_combine: slot_row[1] = 3 outside [-1, R = 3)");
  expect_error([&] { cpu_->moe_combine(y, sr, w, Tensor::host(DType::bf16, {2, 8}), false); }, "moe_combine: out");
  expect_error([&] { cpu_->moe_combine(y, sr, w, Tensor::host(DType::f32, {3, 8}), false); }, "moe_combine: out");
  expect_error([&] { cpu_->moe_combine(y, sr, Tensor::host(DType::f32, {2, 3}), out, false); }, "moe_combine: w");
  expect_error([&] { cpu_->moe_combine(Tensor::host(DType::i32, {3, 8}), sr, w, out, false); }, "moe_combine: y");
  const Tensor v = Tensor::host(DType::f32, {3});
  Tensor dw = Tensor::host(DType::f32, {2, 2});
  expect_error([&] { cpu_->moe_combine_weight_grad(v, sr, TensorView{}, dw); }, "moe_combine_weight_grad: w is undefined");
  expect_error([&] { cpu_->moe_combine_weight_grad(v, i32_tensor({2, 2}, {2, 0, -5, 1}), w, dw); },
               "moe_combine_weight_grad: slot_row[2] = -5");
  expect_error([&] { cpu_->moe_combine_weight_grad(v, sr, w, Tensor::host(DType::f32, {2, 3})); },
               "moe_combine_weight_grad: dw");
}

}  // namespace
}  // namespace fp8moe::testing
