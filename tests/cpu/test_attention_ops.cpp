// The CPU causal attention (src/cpu/ops_attention.cpp, the specification the CUDA paths are held
// to) against a straightforward reference written here from the formulas: per (sequence, head),
// the score matrix, its softmax and the backward's matrices in FP64, over operands rounded to
// BF16 where compute is bf16 (Q, K, V, dout, and P and dS after their FP32 rounding) or exact.
// The op stores FP32 results of FP64 sums, so they agree to FP32 rounding (1e-6 relative, plus
// 1e-9 of the tensor's largest magnitude for sums that cancel); a BF16 rounding missing or added
// moves results by ~1e-3 and fails. Sequence lengths off the 32-row tiles, several heads and
// sequences, Dk != Dv. And MLA's key and value split (mla_split_kv) from its formulas.
#include <algorithm>
#include <cmath>

#include "fp8moe/backend.hpp"
#include "fp8moe/codecs.hpp"
#include "testing.hpp"

namespace fp8moe::testing {
namespace {

struct Case {
  int64_t B, S, H, Dk, Dv;
  float stddev;  // of q and k: larger values make the softmax peakier
  std::string str() const {
    return "B=" + std::to_string(B) + " S=" + std::to_string(S) + " H=" + std::to_string(H) +
           " Dk=" + std::to_string(Dk) + " Dv=" + std::to_string(Dv);
  }
  double scale() const { return 1.0 / std::sqrt(double(Dk)); }
};

struct Outputs {
  Tensor out, lse, dq, dk, dv;
};

struct Inputs {
  Tensor q, k, v, dout;
};

// The op: forward, then the backward on the forward's out and lse.
Outputs run_op(Backend& cpu, const Case& c, const Inputs& in, DType compute) {
  const int64_t T = c.B * c.S;
  Outputs o{Tensor::host(DType::f32, {T, c.H, c.Dv}), Tensor::host(DType::f32, {c.H, T}),
            Tensor::host(DType::f32, {T, c.H, c.Dk}), Tensor::host(DType::f32, {T, c.H, c.Dk}),
            Tensor::host(DType::f32, {T, c.H, c.Dv})};
  cpu.attention_forward(in.q, in.k, in.v, o.out, o.lse, c.S, c.scale(), compute);
  cpu.attention_backward(in.q, in.k, in.v, o.out, o.lse, in.dout, o.dq, o.dk, o.dv, c.S, c.scale(), compute);
  return o;
}

// The reference's results in the tensors' layouts.
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
};

// The reference forward (out, lse) and backward (dq, dk, dv, given the op's out and lse, which
// the backward reads).
Reference reference(const Case& c, const Inputs& in, const Outputs& op, bool bf16) {
  const int64_t T = c.B * c.S, S = c.S, H = c.H, Dk = c.Dk, Dv = c.Dv;
  const double scale = c.scale();
  const auto gemm_in = [bf16](double x) { return bf16 ? double(bf16_round(float(x))) : x; };
  const std::vector<double> qa = to_doubles(in.q.view()), ka = to_doubles(in.k.view()),
                            va = to_doubles(in.v.view()), ga = to_doubles(in.dout.view()),
                            oa = to_doubles(op.out.view()), la = to_doubles(op.lse.view());
  Reference r{std::vector<double>(size_t(T * H * Dv)), std::vector<double>(size_t(H * T)),
              std::vector<double>(size_t(T * H * Dk)), std::vector<double>(size_t(T * H * Dk)),
              std::vector<double>(size_t(T * H * Dv))};
  using Matrix = std::vector<std::vector<double>>;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      // Row i of head h of sequence b of a [T, H, D] array, column d.
      const auto at = [&](int64_t i, int64_t D, int64_t d) { return size_t(((b * S + i) * H + h) * D + d); };
      const auto rows = [&](const std::vector<double>& x, int64_t D, bool round) {
        Matrix m(static_cast<size_t>(S), std::vector<double>(static_cast<size_t>(D)));
        for (int64_t i = 0; i < S; ++i)
          for (int64_t d = 0; d < D; ++d) m[size_t(i)][size_t(d)] = round ? gemm_in(x[at(i, D, d)]) : x[at(i, D, d)];
        return m;
      };
      const Matrix Q = rows(qa, Dk, true), K = rows(ka, Dk, true), V = rows(va, Dv, true), G = rows(ga, Dv, true),
                   G32 = rows(ga, Dv, false), O32 = rows(oa, Dv, false);
      Matrix s(size_t(S), std::vector<double>(size_t(S), 0.0));  // scaled scores, j <= i
      for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < Dk; ++d) dot += Q[size_t(i)][size_t(d)] * K[size_t(j)][size_t(d)];
          s[size_t(i)][size_t(j)] = scale * dot;
        }
      // Forward: P = softmax(s) per row, lse, out = bf(P) bf(V).
      for (int64_t i = 0; i < S; ++i) {
        const auto& si = s[size_t(i)];
        const double mx = *std::max_element(si.begin(), si.begin() + i + 1);
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(si[size_t(j)] - mx);
        r.lse[size_t(h * T + b * S + i)] = mx + std::log(sum);
        for (int64_t d = 0; d < Dv; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j) acc += gemm_in(std::exp(si[size_t(j)] - mx) / sum) * V[size_t(j)][size_t(d)];
          r.out[at(i, Dv, d)] = acc;
        }
      }
      // Backward: P from the op's lse, dP = bf(dout) bf(V)^T, dS = P (dP - Di) scale.
      Matrix P(size_t(S), std::vector<double>(size_t(S), 0.0)), dS = P;
      for (int64_t i = 0; i < S; ++i) {
        double Di = 0;
        for (int64_t d = 0; d < Dv; ++d) Di += G32[size_t(i)][size_t(d)] * O32[size_t(i)][size_t(d)];
        for (int64_t j = 0; j <= i; ++j) {
          double dp = 0;
          for (int64_t d = 0; d < Dv; ++d) dp += G[size_t(i)][size_t(d)] * V[size_t(j)][size_t(d)];
          const double p = std::exp(s[size_t(i)][size_t(j)] - la[size_t(h * T + b * S + i)]);
          P[size_t(i)][size_t(j)] = gemm_in(p);
          dS[size_t(i)][size_t(j)] = gemm_in(p * (dp - Di) * scale);
        }
      }
      for (int64_t j = 0; j < S; ++j) {
        for (int64_t d = 0; d < Dv; ++d) {  // dv = bf(P)^T bf(dout)
          double acc = 0;
          for (int64_t i = j; i < S; ++i) acc += P[size_t(i)][size_t(j)] * G[size_t(i)][size_t(d)];
          r.dv[at(j, Dv, d)] = acc;
        }
        for (int64_t d = 0; d < Dk; ++d) {  // dk = bf(dS)^T bf(Q), dq = bf(dS) bf(K)
          double acck = 0, accq = 0;
          for (int64_t i = j; i < S; ++i) acck += dS[size_t(i)][size_t(j)] * Q[size_t(i)][size_t(d)];
          for (int64_t i = 0; i <= j; ++i) accq += dS[size_t(j)][size_t(i)] * K[size_t(i)][size_t(d)];
          r.dk[at(j, Dk, d)] = acck;
          r.dq[at(j, Dk, d)] = accq;
        }
      }
    }
  return r;
}

// |got - want| <= 1e-6 |want| + 1e-9 max|want| elementwise.
void expect_matches(const Tensor& got, const std::vector<double>& want, const std::string& what) {
  const std::vector<double> g = to_doubles(got.view());
  ASSERT_EQ(g.size(), want.size()) << what;
  double wmax = 0;
  for (double w : want) wmax = std::max(wmax, std::fabs(w));
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < g.size(); ++i)
    if (!(std::fabs(g[i] - want[i]) <= 1e-6 * std::fabs(want[i]) + 1e-9 * wmax)) {
      if (first < 0) first = int64_t(i);
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << g.size() << " elements off, first at " << first << " (got "
                    << (first >= 0 ? g[size_t(first)] : 0) << ", want " << (first >= 0 ? want[size_t(first)] : 0)
                    << "), max |want| " << wmax;
}

void expect_matches(const Outputs& o, const Reference& r, const std::string& what) {
  expect_matches(o.out, r.out, "out " + what);
  expect_matches(o.lse, r.lse, "lse " + what);
  expect_matches(o.dq, r.dq, "dq " + what);
  expect_matches(o.dk, r.dk, "dk " + what);
  expect_matches(o.dv, r.dv, "dv " + what);
}

// max |a - b| / max |b|.
double rel_max_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = to_doubles(a.view()), y = to_doubles(b.view());
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    num = std::max(num, std::fabs(x[i] - y[i]));
    den = std::max(den, std::fabs(y[i]));
  }
  return num / den;
}

// Both computes against the reference with the matching roundings; the bf16 results are far
// from the exact ones (the tolerance above would catch a rounding left out).
TEST(CpuAttention, Bf16AndExactMatchReference) {
  auto rng = make_rng();
  auto cpu = make_backend("cpu");
  for (const Case c : {Case{2, 37, 3, 40, 24, 1.0f}, Case{1, 70, 2, 17, 33, 3.0f}, Case{3, 1, 2, 8, 8, 1.0f}}) {
    const int64_t T = c.B * c.S;
    const Inputs in{random_normal(rng, DType::f32, {T, c.H, c.Dk}, c.stddev),
                    random_normal(rng, DType::f32, {T, c.H, c.Dk}, c.stddev),
                    random_normal(rng, DType::f32, {T, c.H, c.Dv}), random_normal(rng, DType::f32, {T, c.H, c.Dv})};
    const Outputs bf = run_op(*cpu, c, in, DType::bf16), exact = run_op(*cpu, c, in, DType::f32);
    expect_matches(bf, reference(c, in, bf, true), c.str() + " bf16");
    expect_matches(exact, reference(c, in, exact, false), c.str() + " f32");
    if (c.S > 1) {  // with one key, P = 1 and out = bf(v): only out moves
      EXPECT_GT(rel_max_diff(bf.out, exact.out), 1e-4) << c.str();
      EXPECT_GT(rel_max_diff(bf.dq, exact.dq), 1e-4) << c.str();
      EXPECT_GT(rel_max_diff(bf.dk, exact.dk), 1e-4) << c.str();
      EXPECT_GT(rel_max_diff(bf.dv, exact.dv), 1e-4) << c.str();
    }
  }
}

// FP64 tensors: the exact path in FP64 (compute f64), bf16 rounds their operands; compute must be
// bf16 or the tensors' dtype.
TEST(CpuAttention, ComputeDtypes) {
  auto rng = make_rng();
  auto cpu = make_backend("cpu");
  const Case c{1, 9, 2, 8, 4, 1.0f};
  const Tensor q = random_normal(rng, DType::f32, {9, 2, 8}), k = random_normal(rng, DType::f32, {9, 2, 8}),
               v = random_normal(rng, DType::f32, {9, 2, 4});
  Tensor q64 = Tensor::host(DType::f64, {9, 2, 8}), k64 = Tensor::host(DType::f64, {9, 2, 8}),
         v64 = Tensor::host(DType::f64, {9, 2, 4});
  cpu->convert(q, q64);
  cpu->convert(k, k64);
  cpu->convert(v, v64);
  Tensor out32 = Tensor::host(DType::f32, {9, 2, 4}), lse32 = Tensor::host(DType::f32, {2, 9});
  Tensor out64 = Tensor::host(DType::f64, {9, 2, 4}), lse64 = Tensor::host(DType::f64, {2, 9});
  for (DType compute : {DType::f64, DType::bf16}) {
    cpu->attention_forward(q64, k64, v64, out64, lse64, c.S, c.scale(), compute);
    cpu->attention_forward(q, k, v, out32, lse32, c.S, c.scale(), compute == DType::f64 ? DType::f32 : compute);
    EXPECT_LT(rel_max_diff(out32, out64), 1e-6) << dtype_name(compute);
  }
  expect_error([&] { cpu->attention_forward(q64, k64, v64, out64, lse64, c.S, c.scale(), DType::f32); },
               "attention_forward: compute = f32 must be bf16 or the tensors' dtype f64");
  expect_error([&] { cpu->attention_forward(q, k, v, out32, lse32, c.S, c.scale(), DType::e4m3); },
               "compute = e4m3");
}

// MLA's per-head keys and values (Backend::mla_split_kv) from the formulas: k_nope and v copied
// out of each head's kv, the shared key rotated at each token's position into every head; the
// backward's copies, and the heads' summed key gradient rotated back into dckv's last dr columns.
TEST(CpuAttention, MlaSplitKvFollowsItsFormulas) {
  auto cpu = make_backend("cpu");
  auto rng = make_rng();
  const int64_t T = 13, H = 3, dn = 5, dr = 4, dv = 6, rkv = 7;
  const double theta = 10000.0;
  Tensor pos = Tensor::host(DType::i32, {T});
  for (int64_t t = 0; t < T; ++t) pos.ptr<int32_t>()[t] = int32_t(37 * t % 101);
  const Tensor kv = random_normal(rng, DType::f32, {T, H * (dn + dv)}, 1.0f),
               ckv = random_normal(rng, DType::f32, {T, rkv + dr}, 1.0f);
  Tensor k = Tensor::host(DType::f32, {T, H, dn + dr}), v = Tensor::host(DType::f32, {T, H, dv});
  cpu->mla_split_kv(kv, ckv, rkv, pos, theta, k, v);
  // (x0, x1) rotated by pair i's angle at token t, sign -1 for the inverse.
  auto rotate = [&](int64_t t, int64_t i, double x0, double x1, double sign, int j) {
    const double ang = pos.ptr<int32_t>()[t] * std::pow(theta, -2.0 * double(i) / double(dr));
    const double c = std::cos(ang), s = sign * std::sin(ang);
    return j == 0 ? x0 * c - x1 * s : x0 * s + x1 * c;
  };
  const float* K = k.ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < dn; ++c) ASSERT_EQ(K[(t * H + h) * (dn + dr) + c], kv.ptr<float>()[t * H * (dn + dv) + h * (dn + dv) + c]);
      for (int64_t c = 0; c < dv; ++c)
        ASSERT_EQ(v.ptr<float>()[(t * H + h) * dv + c], kv.ptr<float>()[t * H * (dn + dv) + h * (dn + dv) + dn + c]);
      for (int64_t i = 0; i < dr / 2; ++i)
        for (int j = 0; j < 2; ++j) {
          const float* pe = ckv.ptr<float>() + t * (rkv + dr) + rkv + 2 * i;
          EXPECT_NEAR(K[(t * H + h) * (dn + dr) + dn + 2 * i + j], rotate(t, i, pe[0], pe[1], 1.0, j), 1e-6) << t << " " << h;
        }
    }
  const Tensor dk = random_normal(rng, DType::f32, {T, H, dn + dr}, 1.0f), dvv = random_normal(rng, DType::f32, {T, H, dv}, 1.0f);
  Tensor dkv = Tensor::host(DType::f32, {T, H * (dn + dv)}), dckv = Tensor::host(DType::f32, {T, rkv + dr});
  for (int64_t i = 0; i < dckv.numel(); ++i) dckv.ptr<float>()[i] = 7.0f;
  cpu->mla_split_kv_backward(dk, dvv, pos, theta, dkv, dckv, rkv);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < dn; ++c)
        ASSERT_EQ(dkv.ptr<float>()[t * H * (dn + dv) + h * (dn + dv) + c], dk.ptr<float>()[(t * H + h) * (dn + dr) + c]);
      for (int64_t c = 0; c < dv; ++c)
        ASSERT_EQ(dkv.ptr<float>()[t * H * (dn + dv) + h * (dn + dv) + dn + c], dvv.ptr<float>()[(t * H + h) * dv + c]);
    }
    for (int64_t c = 0; c < rkv; ++c) ASSERT_EQ(dckv.ptr<float>()[t * (rkv + dr) + c], 7.0f) << "the latent's columns stay";
    for (int64_t i = 0; i < dr / 2; ++i) {
      double g[2] = {0, 0};
      for (int64_t h = 0; h < H; ++h)
        for (int j = 0; j < 2; ++j) g[j] += dk.ptr<float>()[(t * H + h) * (dn + dr) + dn + 2 * i + j];
      for (int j = 0; j < 2; ++j)
        EXPECT_NEAR(dckv.ptr<float>()[t * (rkv + dr) + rkv + 2 * i + j], rotate(t, i, g[0], g[1], -1.0, j), 1e-5) << t;
    }
  }
  Tensor narrow = Tensor::host(DType::f32, {T, H, dv + 1});
  expect_error([&] { cpu->mla_split_kv(kv, ckv, rkv, pos, theta, k, narrow); }, "mla_split_kv: k ");
  expect_error([&] { cpu->mla_split_kv(kv, ckv, rkv + 1, pos, theta, k, v); }, "must be an even number of columns");
}

}  // namespace
}  // namespace fp8moe::testing
