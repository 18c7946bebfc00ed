// CPU rotary position embedding and causal softmax attention (forward with the log-sum-exp kept,
// backward recomputing the probabilities from it, as FlashAttention does). The report keeps
// attention out of FP8, in BF16 or FP32; `compute` picks the precision of its GEMM operands:
//   the tensors' dtype  the exact path (fp32, fp64 recipes): every product and sum in FP64.
//   bf16                the bf16 and FP8 recipes: BF16 GEMM operands, FP32 accumulation. With
//                       bf(x) = x rounded to nearest even BF16 (codecs.hpp bf16_round):
//     forward   s = scale * bf(Q) bf(K)^T; causal softmax of s -> P (FP32) and lse = max +
//               log(sum) of s, as on the exact path; out = bf(P) bf(V).
//     backward  P = exp(s - lse) from bf(Q), bf(K) as the forward's scores; Di = rowsum(dout *
//               out) from the unrounded dout and out; dv = bf(P)^T bf(dout); dP = bf(dout) bf(V)^T;
//               dS = P * (dP - Di) * scale (FP32); dq = bf(dS) bf(K); dk = bf(dS)^T bf(Q).
//   Sums run in FP64 here (the exact sums that FP32 accumulation approximates); P and dS are
//   rounded to FP32 before their BF16 rounding, the values the CUDA kernels hold.
#include <cmath>
#include <vector>

#include "cpu_ops.hpp"
#include "fp8moe/codecs.hpp"

namespace fp8moe::cpu {

void rope(const TensorView& x, int64_t col0, int64_t rot, const TensorView& positions, double theta, bool inverse) {
  check_op_tensor(positions, "rope", "positions", DType::i32, 1);
  dispatch_float(x, "rope", "x", [&](auto tag) {
    using T = decltype(tag);
    check_op_tensor(x, "rope", "x", x.dtype, 3);
    const int64_t N = x.size(0), H = x.size(1), C = x.size(2);
    check_shape(positions, "rope: positions", {N});
    FP8MOE_CHECK(rot % 2 == 0 && rot > 0, "rope: rot = " << rot << " must be even and positive");
    FP8MOE_CHECK(col0 >= 0 && col0 + rot <= C, "rope: columns [" << col0 << ", " << col0 + rot
                                                                 << ") outside x " << x.str());
    const int32_t* pos = positions.ptr<const int32_t>();
    const double sign = inverse ? -1.0 : 1.0;
#pragma omp parallel for schedule(static) if (N * H * rot > kParallelWork)
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t i = 0; i < rot / 2; ++i) {
        const double freq = std::pow(theta, -2.0 * double(i) / double(rot));
        const double ang = double(pos[t]) * freq;
        const double c = std::cos(ang), s = sign * std::sin(ang);
        for (int64_t h = 0; h < H; ++h) {
          T* p = x.ptr<T>() + (t * H + h) * C + col0 + 2 * i;
          const double a = p[0], b = p[1];
          p[0] = T(a * c - b * s);
          p[1] = T(a * s + b * c);
        }
      }
    }
  });
}

namespace {

// Checks the arguments; true when `compute` rounds the GEMM operands to BF16.
bool check_attention(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                     const TensorView& lse, int64_t seq_len, DType compute, const char* op) {
  const DType dt = q.dtype;
  check_op_tensor(q, op, "q", dt, 3);
  check_op_tensor(k, op, "k", dt, 3);
  check_op_tensor(v, op, "v", dt, 3);
  check_op_tensor(out, op, "out", dt, 3);
  check_op_tensor(lse, op, "lse", dt, 2);
  const int64_t N = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2);
  check_shape(k, (std::string(op) + ": k").c_str(), {N, H, Dk});
  check_shape(v, (std::string(op) + ": v").c_str(), {N, H, Dv});
  check_shape(out, (std::string(op) + ": out").c_str(), {N, H, Dv});
  check_shape(lse, (std::string(op) + ": lse").c_str(), {H, N});
  FP8MOE_CHECK(seq_len > 0 && N % seq_len == 0, op << ": seq_len = " << seq_len << " must divide T = " << N);
  FP8MOE_CHECK(compute == DType::bf16 || compute == dt, op << ": compute = " << dtype_name(compute)
                                                           << " must be bf16 or the tensors' dtype "
                                                           << dtype_name(dt));
  return compute == DType::bf16;
}

// The values of x as a GEMM reads them: x itself, or (bf16) a copy rounded to BF16 in `copy`.
template <class T>
const T* gemm_operand(const TensorView& x, bool bf16, std::vector<T>& copy) {
  const T* p = x.ptr<const T>();
  if (!bf16) return p;
  copy.resize(size_t(x.numel()));
  for (size_t i = 0; i < copy.size(); ++i) copy[i] = T(bf16_round(float(p[i])));
  return copy.data();
}

// A probability or score gradient as the next GEMM reads it: FP32, then BF16 (bf16), or exact.
double gemm_weight(double x, bool bf16) { return bf16 ? double(bf16_round(float(x))) : x; }

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, int64_t seq_len, double scale, DType compute) {
  dispatch_float(q, "attention_forward", "q", [&](auto tag) {
    using T = decltype(tag);
    const bool bf = check_attention(q, k, v, out, lse, seq_len, compute, "attention_forward");
    const int64_t N = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2), S = seq_len, B = N / S;
    std::vector<T> qc, kc, vc;
    const T* Q = gemm_operand(q, bf, qc);
    const T* K = gemm_operand(k, bf, kc);
    const T* V = gemm_operand(v, bf, vc);
#pragma omp parallel if (N * S * H * (Dk + Dv) > 4 * kParallelWork)
    {
      std::vector<double> p(static_cast<size_t>(S)), acc(static_cast<size_t>(Dv));
#pragma omp for collapse(3) schedule(dynamic, 4)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < S; ++i) {
            const int64_t ti = b * S + i;
            const T* qi = Q + (ti * H + h) * Dk;
            double mx = -INFINITY;
            for (int64_t j = 0; j <= i; ++j) {
              const T* kj = K + ((b * S + j) * H + h) * Dk;
              double s = 0;
              for (int64_t d = 0; d < Dk; ++d) s += double(qi[d]) * double(kj[d]);
              p[size_t(j)] = s * scale;
              mx = std::max(mx, p[size_t(j)]);
            }
            double sum = 0;
            for (int64_t j = 0; j <= i; ++j) sum += (p[size_t(j)] = std::exp(p[size_t(j)] - mx));
            std::fill(acc.begin(), acc.end(), 0.0);
            for (int64_t j = 0; j <= i; ++j) {
              const T* vj = V + ((b * S + j) * H + h) * Dv;
              const double w = gemm_weight(p[size_t(j)] / sum, bf);
              for (int64_t d = 0; d < Dv; ++d) acc[size_t(d)] += w * double(vj[d]);
            }
            T* o = out.ptr<T>() + (ti * H + h) * Dv;
            for (int64_t d = 0; d < Dv; ++d) o[d] = T(acc[size_t(d)]);
            lse.ptr<T>()[h * N + ti] = T(mx + std::log(sum));
          }
    }
  });
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& lse, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, int64_t seq_len, double scale, DType compute) {
  dispatch_float(q, "attention_backward", "q", [&](auto tag) {
    using T = decltype(tag);
    const bool bf = check_attention(q, k, v, out, lse, seq_len, compute, "attention_backward");
    const int64_t N = q.size(0), H = q.size(1), Dk = q.size(2), Dv = v.size(2), S = seq_len, B = N / S;
    check_op_tensor(dout, "attention_backward", "dout", q.dtype, 3);
    check_shape(dout, "attention_backward: dout", {N, H, Dv});
    check_op_tensor(dq, "attention_backward", "dq", q.dtype, 3);
    check_shape(dq, "attention_backward: dq", {N, H, Dk});
    check_op_tensor(dk, "attention_backward", "dk", q.dtype, 3);
    check_shape(dk, "attention_backward: dk", {N, H, Dk});
    check_op_tensor(dv, "attention_backward", "dv", q.dtype, 3);
    check_shape(dv, "attention_backward: dv", {N, H, Dv});
    std::vector<T> qc, kc, vc, gc;
    const T* Q = gemm_operand(q, bf, qc);
    const T* K = gemm_operand(k, bf, kc);
    const T* V = gemm_operand(v, bf, vc);
    const T* O = out.ptr<const T>();
    const T* G = dout.ptr<const T>();  // Di's dout, unrounded
    const T* Gr = gemm_operand(dout, bf, gc);  // the GEMMs' dout
    // One (sequence, head) per task: dk and dv of a head only receive from queries of that head.
#pragma omp parallel if (N * S * H * (Dk + Dv) > 2 * kParallelWork)
    {
      std::vector<double> dkb(static_cast<size_t>(S * Dk)), dvb(static_cast<size_t>(S * Dv)), p(static_cast<size_t>(S)),
          dqa(static_cast<size_t>(Dk));
#pragma omp for collapse(2) schedule(dynamic, 1)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h) {
          std::fill(dkb.begin(), dkb.end(), 0.0);
          std::fill(dvb.begin(), dvb.end(), 0.0);
          for (int64_t i = 0; i < S; ++i) {
            const int64_t ti = b * S + i;
            const T* qi = Q + (ti * H + h) * Dk;
            const T* gi = G + (ti * H + h) * Dv;
            const T* gri = Gr + (ti * H + h) * Dv;
            const T* oi = O + (ti * H + h) * Dv;
            const double l = lse.ptr<const T>()[h * N + ti];
            double Di = 0;  // rowsum(dout * out)
            for (int64_t d = 0; d < Dv; ++d) Di += double(gi[d]) * double(oi[d]);
            std::fill(dqa.begin(), dqa.end(), 0.0);
            for (int64_t j = 0; j <= i; ++j) {
              const T* kj = K + ((b * S + j) * H + h) * Dk;
              const T* vj = V + ((b * S + j) * H + h) * Dv;
              double s = 0;
              for (int64_t d = 0; d < Dk; ++d) s += double(qi[d]) * double(kj[d]);
              const double pj = std::exp(s * scale - l), pw = gemm_weight(pj, bf);
              double dp = 0;
              for (int64_t d = 0; d < Dv; ++d) {
                dp += double(gri[d]) * double(vj[d]);
                dvb[size_t(j * Dv + d)] += pw * double(gri[d]);
              }
              const double ds = gemm_weight(pj * (dp - Di) * scale, bf);
              for (int64_t d = 0; d < Dk; ++d) {
                dqa[size_t(d)] += ds * double(kj[d]);
                dkb[size_t(j * Dk + d)] += ds * double(qi[d]);
              }
            }
            T* dqi = dq.ptr<T>() + (ti * H + h) * Dk;
            for (int64_t d = 0; d < Dk; ++d) dqi[d] = T(dqa[size_t(d)]);
          }
          for (int64_t j = 0; j < S; ++j) {
            T* dkj = dk.ptr<T>() + ((b * S + j) * H + h) * Dk;
            T* dvj = dv.ptr<T>() + ((b * S + j) * H + h) * Dv;
            for (int64_t d = 0; d < Dk; ++d) dkj[d] = T(dkb[size_t(j * Dk + d)]);
            for (int64_t d = 0; d < Dv; ++d) dvj[d] = T(dvb[size_t(j * Dv + d)]);
          }
        }
    }
  });
}

}  // namespace fp8moe::cpu
