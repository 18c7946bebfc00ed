// The CUDA MoE dispatch ops (moe_layout, moe_masked_layout, moe_permute, moe_permute_quantize, moe_combine,
// moe_combine_weight_grad) against the CPU backend, byte for byte, on random routing with uniform
// and skewed loads, empty experts, dropped slots, T not a multiple of 128, D from 128 to 7168,
// f32 and bf16, e4m3 and e5m2, both scale modes. Every device output lies inside a larger
// allocation poisoned before the run: the comparison shows that every element was written, and
// the guard bytes around it that nothing else was. Index entries out of range (which the CPU ops
// refuse) must be skipped on the device: compared against the CPU on the sanitized tables. All
// five ops are also captured into a CUDA graph on a stream, which fails on any host
// synchronization. Skips without a GPU.
// Run: build/tests/cuda/test_cuda_moe_dispatch (FP8MOE_SEED=<n> replays a seed).
#include <cuda_runtime.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cuda/moe/moe_api.hpp"
#include "cuda_test_util.hpp"
#include "moe_routing.hpp"

namespace fp8moe::testing {
namespace {

constexpr size_t kGuard = 256;  // bytes of poison before and after each output

// A device tensor inside a larger allocation, every byte of which starts as `poison`.
struct Guarded {
  Tensor storage;
  TensorView view;

  Guarded(Backend& gpu, DType dt, std::initializer_list<int64_t> shape, uint8_t poison) {
    const size_t bytes = TensorView(nullptr, dt, shape).nbytes();
    storage = gpu.zeros(DType::u8, {int64_t(bytes + 2 * kGuard)});
    Tensor h = Tensor::host(DType::u8, {int64_t(bytes + 2 * kGuard)});
    std::memset(h.view().data, poison, h.view().nbytes());
    gpu.copy(storage.view(), h.view());
    view = TensorView(storage.ptr<uint8_t>() + kGuard, dt, shape, Device::cuda);
  }
  operator const TensorView&() const { return view; }
  // A host copy of the view.
  Tensor host(Backend& gpu) const {
    Tensor h = Tensor::host_like(view);
    gpu.copy(h.view(), view);
    return h;
  }
  // Index of the first guard byte changed from `poison`, -1 if none.
  int64_t guard_damage(Backend& gpu, uint8_t poison) const {
    const Tensor h = gpu.to_host(storage);
    const auto* p = h.ptr<const uint8_t>();
    const int64_t n = h.numel();
    for (int64_t i = 0; i < n; ++i)
      if ((i < int64_t(kGuard) || i >= n - int64_t(kGuard)) && p[i] != poison) return i;
    return -1;
  }
};

struct GuardedQuantized {
  Guarded values, scales;
  GuardedQuantized(Backend& gpu, int64_t rows, int64_t cols, DType dt)
      : values(gpu, dt, {rows, cols}, 0xFF),
        scales(gpu, DType::f32, {scale_shape(ScaleKind::tile_1x128, rows, cols)[0], scale_ld(rows)}, 0xFF) {}
  QuantizedView view() const { return {values.view, scales.view, ScaleKind::tile_1x128}; }
};

// Byte equality of a device output with the CPU's, and intact guards.
void expect_same(Backend& gpu, const Guarded& got, const Tensor& want, uint8_t poison, const std::string& what) {
  const Tensor h = got.host(gpu);
  ASSERT_EQ(h.view().nbytes(), want.view().nbytes()) << what;
  const int64_t i = first_mismatch(h, want);
  EXPECT_EQ(i, -1) << what << ": first mismatch at element " << i << " of " << want.numel();
  EXPECT_EQ(got.guard_damage(gpu, poison), -1) << what << ": written outside the tensor";
}

std::string dims(const RoutingSpec& s) {
  return "T=" + std::to_string(s.tokens) + " k=" + std::to_string(s.topk) + " G=" + std::to_string(s.groups) +
         " skew=" + std::to_string(s.skew) + " drop=" + std::to_string(s.drop);
}

Tensor clone(const Tensor& h) {
  Tensor c = Tensor::host_like(h.view());
  std::memcpy(c.view().data, h.view().data, h.view().nbytes());
  return c;
}

// i32 table with every entry outside [-1, hi) replaced by -1 (what the device ops assume).
Tensor sanitized(const Tensor& idx, int64_t hi) {
  Tensor c = clone(idx);
  for (int64_t i = 0; i < c.numel(); ++i)
    if (c.ptr<int32_t>()[i] < -1 || c.ptr<int32_t>()[i] >= hi) c.ptr<int32_t>()[i] = -1;
  return c;
}

// Rows of x [T, D] scaled by 2^e, e uniform in [-lo, hi]: exercises the scale clamps and tiny tiles.
void spread_magnitudes(std::mt19937_64& rng, Tensor& x, int lo, int hi) {
  std::uniform_int_distribution<int> e(-lo, hi);
  const int64_t D = x.size(1);
  for (int64_t t = 0; t < x.size(0); ++t) {
    const float f = std::ldexp(1.0f, e(rng));
    for (int64_t c = 0; c < D; ++c) store_float(x.view(), t * D + c, f * load_float(x.view(), t * D + c));
  }
}

struct HostLayout {
  Tensor row_slot, row_group, slot_row, offsets;
};

class CudaMoeDispatch : public ::testing::Test {
 protected:
  void SetUp() override {
    FP8MOE_REQUIRE_GPU();
    gpu_ = make_backend("cuda");
    rng_ = make_rng();
  }
  Tensor dev(const Tensor& h) { return to_device(*gpu_, h); }
  HostLayout cpu_layout(const Tensor& ids, int64_t groups, int64_t align, int64_t rows) {
    HostLayout L{Tensor::host(DType::i32, {rows}), Tensor::host(DType::i32, {rows}),
                 Tensor::host(DType::i32, {ids.size(0), ids.size(1)}), Tensor::host(DType::i32, {groups + 1})};
    cpu_->moe_layout(ids, align, L.row_slot, L.row_group, L.slot_row, L.offsets);
    return L;
  }
  // moe_layout on both backends (the device on `dev_ids`, the CPU on `ids`), compared; the CPU's.
  HostLayout check_layout(const Tensor& ids, const Tensor& dev_ids, int64_t groups, int64_t align, int64_t rows,
                          const std::string& what) {
    const HostLayout want = cpu_layout(ids, groups, align, rows);
    Guarded rs(*gpu_, DType::i32, {rows}, 0x5A), rg(*gpu_, DType::i32, {rows}, 0x5A),
        sr(*gpu_, DType::i32, {ids.size(0), ids.size(1)}, 0x5A), off(*gpu_, DType::i32, {groups + 1}, 0x5A);
    gpu_->moe_layout(dev_ids, align, rs, rg, sr, off);
    expect_same(*gpu_, off, want.offsets, 0x5A, "offsets " + what);
    expect_same(*gpu_, rs, want.row_slot, 0x5A, "row_slot " + what);
    expect_same(*gpu_, rg, want.row_group, 0x5A, "row_group " + what);
    expect_same(*gpu_, sr, want.slot_row, 0x5A, "slot_row " + what);
    return want;
  }
  // The CPU layout with R rows trimmed to the rows in use plus `extra` (R need not hold the
  // moe_layout_rows bound for the row ops).
  HostLayout layout(const RoutingSpec& s, int64_t align, int64_t extra) {
    const Tensor ids = random_routing(rng_, s);
    HostLayout L = cpu_layout(ids, s.groups, align, moe_layout_rows(ids.numel(), s.groups, align));
    const int64_t used = L.offsets.ptr<int32_t>()[s.groups];
    Tensor rs = Tensor::host(DType::i32, {used + extra});
    std::fill_n(rs.ptr<int32_t>(), used + extra, -1);
    std::copy_n(L.row_slot.ptr<int32_t>(), std::min(used + extra, L.row_slot.numel()), rs.ptr<int32_t>());
    L.row_slot = rs;
    return L;
  }
  Tensor weights(int64_t T, int64_t k) {
    Tensor w = random_normal(rng_, DType::f32, {T, k}, 1.0f);
    for (int64_t i = 0; i < w.numel(); ++i) w.ptr<float>()[i] = 0.05f + std::fabs(w.ptr<float>()[i]);
    return w;
  }

  std::unique_ptr<Backend> cpu_ = make_backend("cpu"), gpu_;
  std::mt19937_64 rng_;
};

const RoutingSpec kRoutings[] = {
    {4096, 8, 256, 0, 0, {}},                 // DeepSeek-V3: 256 experts, top-8, uniform
    {1000, 8, 256, 1.5, 0.05, {3, 100, 255}},  // skewed loads, empty experts, drops
    {333, 6, 64, 0.8, 0.3, {0, 63}},
    {129, 1, 2, 0, 0, {}},
    {77, 4, 1500, 0, 0.1, {}},                 // more experts than one scan block
    {5, 3, 7, 0, 1.0, {}},                     // every slot dropped
};

// ---- moe_layout ----

TEST_F(CudaMoeDispatch, LayoutBitExact) {
  for (const RoutingSpec& s : kRoutings)
    for (int64_t align : {1, 64, 128})
      for (int64_t spare : {0, 5}) {
        const Tensor ids = random_routing(rng_, s);
        const int64_t R = moe_layout_rows(ids.numel(), s.groups, align) + spare;
        check_layout(ids, dev(ids), s.groups, align, R,
                     dims(s) + " align=" + std::to_string(align) + " R=" + std::to_string(R));
      }
}

// Ids outside [-1, G) are dropped slots on the device (the CPU refuses them).
TEST_F(CudaMoeDispatch, LayoutDropsOutOfRangeIds) {
  const RoutingSpec s{300, 4, 16, 0.5, 0, {}};
  Tensor ids = random_routing(rng_, s);
  int32_t* p = ids.ptr<int32_t>();
  for (int64_t i = 0; i < ids.numel(); i += 7) p[i] = i % 2 ? int32_t(s.groups) + int32_t(i) : -2 - int32_t(i);
  p[1] = std::numeric_limits<int32_t>::max();
  p[2] = std::numeric_limits<int32_t>::min();
  const int64_t R = moe_layout_rows(ids.numel(), s.groups, 32);
  check_layout(sanitized(ids, s.groups), dev(ids), s.groups, 32, R, "out-of-range ids");
}

// ---- moe_masked_layout ----

// The masked layout on both backends, with and without the every-token group, and the loads
// accumulated onto what they held; ids outside [0, G) are dropped on the device (the CPU refuses
// them: compared on the sanitized ids).
TEST_F(CudaMoeDispatch, MaskedLayoutBitExact) {
  const RoutingSpec specs[] = {{1, 8, 256, 0, 0, {}},      {32, 6, 64, 0, 0, {}},  {256, 4, 16, 0.8, 0, {}},
                               {1000, 8, 256, 1.5, 0.05, {3, 100, 255}}, {77, 4, 1500, 0, 0.1, {}},
                               {5, 3, 7, 0, 1.0, {}}};
  for (const RoutingSpec& s : specs)
    for (const bool every : {false, true})
      for (const bool bad_ids : {false, true}) {
        // Group G - 1 is every token's extra group, so a token may land there twice.
        const int64_t G = s.groups + (every ? 1 : 0), etg = every ? G - 1 : -1, K = s.topk + (every ? 1 : 0);
        const int64_t M = round_up(s.tokens, 64) * (every ? 2 : 1);
        Tensor ids = random_routing(rng_, s);
        if (bad_ids)
          for (int64_t i = 0; i < ids.numel(); i += 5) ids.ptr<int32_t>()[i] = i % 2 ? int32_t(G + i) : int32_t(-3 - i);
        const Tensor cpu_ids = sanitized(ids, G);
        Tensor loads0 = Tensor::host(DType::i64, {G});
        for (int64_t g = 0; g < G; ++g) loads0.ptr<int64_t>()[g] = (g * 7919) % 1000;
        Tensor rs = Tensor::host(DType::i32, {G * M}), sr = Tensor::host(DType::i32, {s.tokens, K}),
               counts = Tensor::host(DType::i32, {G}), loads = clone(loads0);
        cpu_->moe_masked_layout(cpu_ids, G, etg, rs, sr, counts, loads);
        Guarded drs(*gpu_, DType::i32, {G * M}, 0x5A), dsr(*gpu_, DType::i32, {s.tokens, K}, 0x5A),
            dcounts(*gpu_, DType::i32, {G}, 0x5A), dloads(*gpu_, DType::i64, {G}, 0x5A);
        gpu_->copy(dloads.view, loads0.view());
        gpu_->moe_masked_layout(dev(ids), G, etg, drs, dsr, dcounts, dloads);
        const std::string what = dims(s) + (every ? " every-token group" : "") + (bad_ids ? " bad ids" : "");
        expect_same(*gpu_, drs, rs, 0x5A, "row_slot " + what);
        expect_same(*gpu_, dsr, sr, 0x5A, "slot_row " + what);
        expect_same(*gpu_, dcounts, counts, 0x5A, "counts " + what);
        expect_same(*gpu_, dloads, loads, 0x5A, "loads " + what);
      }
}

// A group of more slots than M_max: its first M_max slots in order get its rows, the rest are
// dropped, and nothing is written outside the tables (the CPU refuses such a call).
TEST_F(CudaMoeDispatch, MaskedLayoutDropsSlotsPastMMax) {
  const int64_t T = 200, k = 2, G = 4, M = 64;
  Tensor ids = Tensor::host(DType::i32, {T, k});
  for (int64_t t = 0; t < T; ++t) {
    ids.ptr<int32_t>()[t * k] = 0;                        // group 0: 200 slots
    ids.ptr<int32_t>()[t * k + 1] = int32_t(1 + t % 3);  // groups 1..3: 66-67 slots each
  }
  Guarded drs(*gpu_, DType::i32, {G * M}, 0x5A), dsr(*gpu_, DType::i32, {T, k}, 0x5A),
      dcounts(*gpu_, DType::i32, {G}, 0x5A);
  gpu_->moe_masked_layout(dev(ids), G, -1, drs, dsr, dcounts, TensorView());
  const Tensor rs = drs.host(*gpu_), sr = dsr.host(*gpu_), counts = dcounts.host(*gpu_);
  std::vector<int64_t> seen(size_t(G), 0);
  for (int64_t s = 0; s < T * k; ++s) {
    const int32_t g = ids.ptr<int32_t>()[s], r = sr.ptr<int32_t>()[s];
    const int64_t i = seen[size_t(g)]++;
    ASSERT_EQ(r, i < M ? int32_t(g * M + i) : -1) << "slot " << s;
    if (r >= 0) ASSERT_EQ(rs.ptr<int32_t>()[r], int32_t(s)) << "row " << r;
  }
  for (int64_t g = 0; g < G; ++g) EXPECT_EQ(counts.ptr<int32_t>()[g], M) << "group " << g;
  EXPECT_EQ(drs.guard_damage(*gpu_, 0x5A), -1);
  EXPECT_EQ(dsr.guard_damage(*gpu_, 0x5A), -1);
}

// ---- moe_permute ----

TEST_F(CudaMoeDispatch, PermuteBitExact) {
  const RoutingSpec s{333, 6, 40, 1.0, 0.1, {7}};
  for (int64_t D : {128, 100, 1000, 7168})
    for (DType in : {DType::f32, DType::bf16})
      for (DType out : {DType::f32, DType::bf16})
        for (bool weighted : {false, true}) {
          const HostLayout L = layout(s, 64, 3);
          const int64_t R = L.row_slot.size(0);
          const Tensor x = random_normal(rng_, in, {s.tokens, D}, 2.0f), w = weights(s.tokens, s.topk);
          const TensorView wv = weighted ? w.view() : TensorView{};
          Tensor want = Tensor::host(out, {R, D});
          cpu_->moe_permute(x, L.row_slot, s.topk, wv, want);
          Guarded got(*gpu_, out, {R, D}, 0xFF);
          gpu_->moe_permute(dev(x), dev(L.row_slot), s.topk, weighted ? dev(w).view() : TensorView{}, got);
          expect_same(*gpu_, got, want, 0xFF,
                      std::string("permute ") + std::string(dtype_name(in)) + "->" + std::string(dtype_name(out)) +
                          " D=" + std::to_string(D) + (weighted ? " weighted" : ""));
        }
}

// Unaligned x (the scalar path) and row_slot entries out of range (zero rows on the device).
TEST_F(CudaMoeDispatch, PermuteUnalignedAndOutOfRangeSlots) {
  const RoutingSpec s{100, 4, 8, 0, 0, {}};
  HostLayout L = layout(s, 16, 7);
  const int64_t R = L.row_slot.size(0), D = 256, slots = s.tokens * s.topk;
  int32_t* rs = L.row_slot.ptr<int32_t>();
  rs[0] = int32_t(slots);
  rs[3] = -9;
  rs[R - 1] = std::numeric_limits<int32_t>::max();
  const Tensor x = random_normal(rng_, DType::bf16, {s.tokens, D}, 1.0f), w = weights(s.tokens, s.topk);
  Tensor want = Tensor::host(DType::bf16, {R, D});
  cpu_->moe_permute(x, sanitized(L.row_slot, slots), s.topk, w, want);
  // x one element past a 16-byte boundary.
  Tensor xbuf = gpu_->zeros(DType::bf16, {s.tokens * D + 8});
  TensorView xv(xbuf.ptr<uint16_t>() + 1, DType::bf16, {s.tokens, D}, Device::cuda);
  gpu_->copy(xv, x.view());
  Guarded got(*gpu_, DType::bf16, {R, D}, 0xFF);
  gpu_->moe_permute(xv, dev(L.row_slot), s.topk, dev(w), got);
  expect_same(*gpu_, got, want, 0xFF, "permute unaligned x, out-of-range slots");
}

// ---- moe_permute_quantize ----

TEST_F(CudaMoeDispatch, PermuteQuantizeBitExact) {
  struct Case {
    RoutingSpec s;
    int64_t D, align, extra;
  };
  const Case cases[] = {{{333, 6, 40, 1.0, 0.1, {7}}, 128, 128, 0},
                        {{1000, 8, 64, 0.5, 0.05, {}}, 384, 1, 3},    // R not a multiple of 4
                        {{129, 2, 5, 0, 0, {4}}, 1152, 64, 2},
                        {{1024, 8, 64, 0, 0, {}}, 7168, 128, 1}};      // DeepSeek-V3 width
  for (const Case& c : cases)
    for (DType in : {DType::bf16, DType::f32})
      for (DType q : {DType::e4m3, DType::e5m2})
        for (ScaleMode mode : {ScaleMode::pow2, ScaleMode::fp32})
          for (bool weighted : {false, true}) {
            if (c.D == 7168 && (q == DType::e5m2 || in == DType::f32) && weighted) continue;  // keep the CPU side short
            const HostLayout L = layout(c.s, c.align, c.extra);
            const int64_t R = L.row_slot.size(0), T = c.s.tokens;
            Tensor x = random_normal(rng_, in, {T, c.D}, 1.0f);
            spread_magnitudes(rng_, x, 120, 100);
            for (int64_t col = 0; col < c.D; ++col) store_float(x.view(), 2 * c.D + col, 0.0f);  // a zero token
            const Tensor w = weights(T, c.s.topk);
            const TensorView wv = weighted ? w.view() : TensorView{};
            QuantizedTensor want = make_quantized_host(R, c.D, q, ScaleKind::tile_1x128);
            cpu_->moe_permute_quantize(x, L.row_slot, c.s.topk, wv, want, mode);
            GuardedQuantized got(*gpu_, R, c.D, q);
            gpu_->moe_permute_quantize(dev(x), dev(L.row_slot), c.s.topk, weighted ? dev(w).view() : TensorView{},
                                       got.view(), mode);
            const std::string what = "permute_quantize " + dims(c.s) + " D=" + std::to_string(c.D) + " R=" +
                                     std::to_string(R) + " " + std::string(dtype_name(in)) + "->" +
                                     std::string(dtype_name(q)) + (mode == ScaleMode::pow2 ? " pow2" : " fp32") +
                                     (weighted ? " weighted" : "");
            expect_same(*gpu_, got.values, want.values, 0xFF, what + " values");
            expect_same(*gpu_, got.scales, want.scales, 0xFF, what + " scales");
          }
}

TEST_F(CudaMoeDispatch, PermuteQuantizeOutOfRangeSlots) {
  const RoutingSpec s{200, 4, 8, 0, 0, {}};
  HostLayout L = layout(s, 128, 2);
  const int64_t R = L.row_slot.size(0), D = 256, slots = s.tokens * s.topk;
  L.row_slot.ptr<int32_t>()[1] = int32_t(slots) + 100;
  L.row_slot.ptr<int32_t>()[R - 2] = -3;
  const Tensor x = random_normal(rng_, DType::bf16, {s.tokens, D}, 1.0f);
  QuantizedTensor want = make_quantized_host(R, D, DType::e4m3, ScaleKind::tile_1x128);
  cpu_->moe_permute_quantize(x, sanitized(L.row_slot, slots), s.topk, TensorView{}, want, ScaleMode::pow2);
  GuardedQuantized got(*gpu_, R, D, DType::e4m3);
  gpu_->moe_permute_quantize(dev(x), dev(L.row_slot), s.topk, TensorView{}, got.view(), ScaleMode::pow2);
  expect_same(*gpu_, got.values, want.values, 0xFF, "permute_quantize out-of-range slots, values");
  expect_same(*gpu_, got.scales, want.scales, 0xFF, "permute_quantize out-of-range slots, scales");
}

// ---- moe_combine, moe_combine_weight_grad ----

TEST_F(CudaMoeDispatch, CombineBitExact) {
  const RoutingSpec specs[] = {{333, 6, 40, 1.0, 0.1, {7}}, {1024, 8, 256, 0, 0, {}}, {50, 1, 3, 0, 0.2, {}},
                               {70, 9, 16, 0.3, 0, {}}};  // k not a multiple of the load batch
  for (const RoutingSpec& s : specs)
    for (int64_t N : {8, 300, 1000, 7168})
      for (DType ydt : {DType::bf16, DType::f32}) {
        // align 1: padding rows play no part in the combine, and y stays small at N = 7168.
        const HostLayout L = layout(s, 1, 0);
        const int64_t R = L.row_slot.size(0), T = s.tokens;
        const Tensor y = random_normal(rng_, ydt, {R, N}, 1.0f), w = weights(T, s.topk);
        const Tensor base = random_normal(rng_, DType::f32, {T, N}, 1.0f);
        const Tensor y_d = dev(y), sr_d = dev(L.slot_row), w_d = dev(w);
        for (bool weighted : {false, true})
          for (bool acc : {false, true}) {
            Tensor want = clone(base);
            cpu_->moe_combine(y, L.slot_row, weighted ? w.view() : TensorView{}, want, acc);
            Guarded got(*gpu_, DType::f32, {T, N}, 0xFF);
            if (acc) gpu_->copy(got.view, base.view());
            gpu_->moe_combine(y_d, sr_d, weighted ? w_d.view() : TensorView{}, got, acc);
            expect_same(*gpu_, got, want, 0xFF,
                        "combine " + dims(s) + " N=" + std::to_string(N) + " " + std::string(dtype_name(ydt)) +
                            (weighted ? " weighted" : "") + (acc ? " accumulate" : ""));
          }
      }
}

TEST_F(CudaMoeDispatch, CombineUnalignedAndOutOfRangeRows) {
  const RoutingSpec s{100, 4, 8, 0, 0, {}};
  HostLayout L = layout(s, 16, 0);
  const int64_t R = L.row_slot.size(0), N = 64;
  int32_t* sr = L.slot_row.ptr<int32_t>();
  sr[0] = int32_t(R);
  sr[5] = -4;
  sr[11] = std::numeric_limits<int32_t>::max();
  const Tensor y = random_normal(rng_, DType::f32, {R, N}, 1.0f), w = weights(s.tokens, s.topk);
  Tensor want = Tensor::host(DType::f32, {s.tokens, N});
  cpu_->moe_combine(y, sanitized(L.slot_row, R), w, want, false);
  Tensor ybuf = gpu_->zeros(DType::f32, {R * N + 4});
  TensorView yv(ybuf.ptr<float>() + 1, DType::f32, {R, N}, Device::cuda);
  gpu_->copy(yv, y.view());
  Guarded got(*gpu_, DType::f32, {s.tokens, N}, 0xFF);
  gpu_->moe_combine(yv, dev(L.slot_row), dev(w), got, false);
  expect_same(*gpu_, got, want, 0xFF, "combine unaligned y, out-of-range rows");
}

TEST_F(CudaMoeDispatch, CombineWeightGradBitExact) {
  const RoutingSpec s{1000, 8, 64, 0.7, 0.1, {5}};
  HostLayout L = layout(s, 128, 0);
  const int64_t R = L.row_slot.size(0);
  const Tensor v = random_normal(rng_, DType::f32, {R}, 3.0f), w = weights(s.tokens, s.topk);
  Tensor want = Tensor::host(DType::f32, {s.tokens, s.topk});
  cpu_->moe_combine_weight_grad(v, L.slot_row, w, want);
  Guarded got(*gpu_, DType::f32, {s.tokens, s.topk}, 0xFF);
  gpu_->moe_combine_weight_grad(dev(v), dev(L.slot_row), dev(w), got);
  expect_same(*gpu_, got, want, 0xFF, "combine_weight_grad");

  L.slot_row.ptr<int32_t>()[3] = int32_t(R);
  L.slot_row.ptr<int32_t>()[4] = -2;
  cpu_->moe_combine_weight_grad(v, sanitized(L.slot_row, R), w, want);
  gpu_->moe_combine_weight_grad(dev(v), dev(L.slot_row), dev(w), got);
  expect_same(*gpu_, got, want, 0xFF, "combine_weight_grad out-of-range rows");
}

// ---- streams, graphs, errors ----

// All six ops captured into a graph on a non-blocking stream: capture fails on any synchronizing
// call or any use of the legacy stream, so this shows the ops queue only stream-ordered work.
TEST_F(CudaMoeDispatch, CapturedOnAStreamWithoutHostSync) {
  const RoutingSpec s{500, 8, 32, 0.5, 0.05, {2}};
  const int64_t align = 128, D = 512, G = s.groups, T = s.tokens, k = s.topk;
  const Tensor ids = random_routing(rng_, s);
  const int64_t R = moe_layout_rows(ids.numel(), G, align);
  const Tensor x = random_normal(rng_, DType::bf16, {T, D}, 1.0f), w = weights(T, k);
  const Tensor y = random_normal(rng_, DType::bf16, {R, D}, 1.0f), v = random_normal(rng_, DType::f32, {R}, 1.0f);
  const HostLayout L = cpu_layout(ids, G, align, R);
  Tensor want_p = Tensor::host(DType::bf16, {R, D}), want_c = Tensor::host(DType::f32, {T, D}),
         want_g = Tensor::host(DType::f32, {T, k});
  QuantizedTensor want_q = make_quantized_host(R, D, DType::e4m3, ScaleKind::tile_1x128);
  cpu_->moe_permute(x, L.row_slot, k, w, want_p);
  cpu_->moe_permute_quantize(x, L.row_slot, k, TensorView{}, want_q, ScaleMode::pow2);
  cpu_->moe_combine(y, L.slot_row, w, want_c, false);
  cpu_->moe_combine_weight_grad(v, L.slot_row, w, want_g);
  const int64_t M = round_up(T, 64);
  Tensor want_mrs = Tensor::host(DType::i32, {G * M}), want_msr = Tensor::host(DType::i32, {T, k}),
         want_mc = Tensor::host(DType::i32, {G});
  cpu_->moe_masked_layout(ids, G, -1, want_mrs, want_msr, want_mc, TensorView{});

  const Tensor ids_d = dev(ids), x_d = dev(x), w_d = dev(w), y_d = dev(y), v_d = dev(v);
  Guarded rs(*gpu_, DType::i32, {R}, 0x5A), rg(*gpu_, DType::i32, {R}, 0x5A), sr(*gpu_, DType::i32, {T, k}, 0x5A),
      off(*gpu_, DType::i32, {G + 1}, 0x5A), p(*gpu_, DType::bf16, {R, D}, 0xFF), c(*gpu_, DType::f32, {T, D}, 0xFF),
      g(*gpu_, DType::f32, {T, k}, 0xFF);
  GuardedQuantized q(*gpu_, R, D, DType::e4m3);
  Guarded mrs(*gpu_, DType::i32, {G * M}, 0x5A), msr(*gpu_, DType::i32, {T, k}, 0x5A), mc(*gpu_, DType::i32, {G}, 0x5A);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  std::string error;
  try {
    cuda::moe_layout_cuda(ids_d, align, rs, rg, sr, off, stream);
    cuda::moe_permute_cuda(x_d, rs, k, w_d, p, stream);
    cuda::moe_permute_quantize_cuda(x_d, rs, k, TensorView{}, q.view(), ScaleMode::pow2, stream);
    cuda::moe_combine_cuda(y_d, sr, w_d, c, false, stream);
    cuda::moe_combine_weight_grad_cuda(v_d, sr, w_d, g, stream);
    cuda::moe_masked_layout_cuda(ids_d, G, -1, mrs, msr, mc, TensorView{}, stream);
  } catch (const Error& e) {
    error = e.what();
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  ASSERT_EQ(error, "");
  ASSERT_EQ(end, cudaSuccess) << cudaGetErrorString(end);
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  expect_same(*gpu_, rs, L.row_slot, 0x5A, "graph row_slot");
  expect_same(*gpu_, rg, L.row_group, 0x5A, "graph row_group");
  expect_same(*gpu_, sr, L.slot_row, 0x5A, "graph slot_row");
  expect_same(*gpu_, off, L.offsets, 0x5A, "graph offsets");
  expect_same(*gpu_, p, want_p, 0xFF, "graph permute");
  expect_same(*gpu_, q.values, want_q.values, 0xFF, "graph permute_quantize values");
  expect_same(*gpu_, q.scales, want_q.scales, 0xFF, "graph permute_quantize scales");
  expect_same(*gpu_, c, want_c, 0xFF, "graph combine");
  expect_same(*gpu_, g, want_g, 0xFF, "graph combine_weight_grad");
  expect_same(*gpu_, mrs, want_mrs, 0x5A, "graph masked row_slot");
  expect_same(*gpu_, msr, want_msr, 0x5A, "graph masked slot_row");
  expect_same(*gpu_, mc, want_mc, 0x5A, "graph masked counts");
}

TEST_F(CudaMoeDispatch, RejectsBadArguments) {
  const Tensor ids = random_routing(rng_, {10, 2, 4, 0, 0, {}});
  const int64_t R = moe_layout_rows(20, 4, 8);
  Tensor rs = gpu_->zeros(DType::i32, {R}), rg = gpu_->zeros(DType::i32, {R}), sr = gpu_->zeros(DType::i32, {10, 2}),
         off = gpu_->zeros(DType::i32, {5});
  expect_error([&] { gpu_->moe_layout(ids, 8, rs, rg, sr, off); }, "moe_layout: expert_ids must be a cuda tensor");
  TensorView short_rs = rs.view(), short_rg = rg.view();
  short_rs.shape[0] = short_rg.shape[0] = R - 1;
  expect_error([&] { gpu_->moe_layout(dev(ids), 8, short_rs, short_rg, sr, off); }, "moe_layout_rows");
  const Tensor x = dev(random_normal(rng_, DType::bf16, {10, 256}, 1.0f));
  QuantizedTensor q = gpu_->empty_quantized(R, 256, DType::e4m3, ScaleKind::tile_1x128);
  TensorView x_off = x.view();
  x_off.data = x.ptr<uint16_t>() + 8;  // 16 bytes in: aligned
  x_off.shape[0] = 9;
  gpu_->moe_permute_quantize(x_off, rs, 2, TensorView{}, q, ScaleMode::pow2);
  x_off.data = x.ptr<uint16_t>() + 1;
  expect_error([&] { gpu_->moe_permute_quantize(x_off, rs, 2, TensorView{}, q, ScaleMode::pow2); }, "16-byte aligned");
  Tensor out = gpu_->zeros(DType::f32, {11, 256});
  expect_error([&] { gpu_->moe_combine(x, sr, TensorView{}, out, false); }, "moe_combine: out: expected shape");
  // f64, which the CPU ops accept for the finite-difference checks, is refused on the device.
  const Tensor x64 = dev(Tensor::host(DType::f64, {10, 256}));
  Tensor p64 = gpu_->zeros(DType::f64, {R, 256});
  expect_error([&] { gpu_->moe_permute(x64, rs, 2, TensorView{}, p64); }, "moe_permute: x: expected dtype f32|bf16");
}

}  // namespace
}  // namespace fp8moe::testing
