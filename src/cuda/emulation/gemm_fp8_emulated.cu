// FP8 GEMMs with emulated Tensor Core accumulation on the GPU: the AccumMode::tensor_core
// arithmetic of gemm_fp8_ref (include/fp8moe/gemm_ref.hpp), bit for bit, for the dense GEMM and the
// three grouped GEMMs of the MoE experts. It runs the promotion intervals the sm_90a kernels cannot
// (N_c != 128: never, 32, 256, ...), e.g. for the fp8-no-promotion recipe.
//
// The reference, per output and 32-wide K step (one WGMMA): products p_j = a_j * b_j (exact) or,
// when a promotion interval spans scale groups, (a_j * b_j) * s with s = s_a * s_b, in double;
// emax = the largest exponent among the running Tensor Core sum tc and the p_j; tc and every p_j
// truncated toward zero to a multiple of q = 2^(emax - bits + 1) and summed; at a promotion point
// acc += float(tc) * float(s) (float(tc) when pre-scaled) in FP32, tc = 0. The kernel computes the
// same values by other means, each exact:
//   - products: a * s_a and b * s_b are exact in double (4 + 24 significant bits) and (a*b)*s rounds
//     once from the exact a*b*s_a*s_b, so the tiles are stored pre-scaled and p_j is one DMUL;
//   - emax: rounding is monotonic, so max |p_j| = round(max |a_j * b_j| * s); the exact products of
//     the raw values are maxed in FP32 (8-bit significands), one DMUL per step and output;
//   - truncation: with M = 1.5 * 2^(E + 52), E = emax - bits + 1 and |p| < 2^(E + 51) (bits <= 51),
//     |p| + M rounded toward zero is M + n * q with n = trunc(|p| / q) in the low word;
//   - the sum: for bits <= 18 the signed n are added as FP32 subnormals (n * 2^-149, exact while
//     |sum| < 2^24 units), for bits <= 51 the terms +-n*q are added in double in the reference's
//     order; the reference's own formula (ilogb, division, trunc) runs where neither applies:
//     bits = 52 and every step from one whose operands or scales hold NaN or Inf on.
// The FP32 route's integer sum equals the reference's double sum, which is exact at those bits
// (every partial sum a multiple of q below 2^(bits + 6) q); the double route adds the same terms in
// the same order. Results differ from the reference at most in the sign of a zero tc, which no
// output can see (acc starts at +0 and +0 + -0 = +0), and in NaN payloads.
// Finite inputs keep every exponent in range: |a * s_a * b * s_b| lies in [2^-316, 2^274] and tc
// below 2^305, so q, M and the FP32 rescaling factor are normal doubles.
//
// Tiles: 64 x 64 outputs per block of 256 threads, 4 x 4 per thread; each 32-wide K step goes
// through shared memory as raw FP32 values (for the max) and pre-scaled doubles (for the sum), the
// next step's bytes and scales prefetched into registers while the current one is computed. The
// group of a tile (contiguous, masked, K-grouped) comes from kernels/grouping.cuh's resolve_tile on
// the device, as in the sm_90a kernels: the same rows are written, zeroed or left alone. Like them,
// a contiguous tile takes the expert of its 128-row block's first row (the CPU reference takes
// each row's own; the two agree on every layout moe_layout writes).
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <mutex>

#include "cuda/runtime/cuda_check.hpp"
#include "cuda/gemm/gemm_launch.cuh"
#include "cuda/kernel_api.hpp"

namespace fp8moe::cuda {

namespace {

constexpr int kBM = 64, kBN = 64;  // outputs per block
constexpr int kThreads = 256;      // 16 x 16 threads, 4 x 4 outputs each
constexpr int kStepK = 32;         // K of one emulated WGMMA
constexpr int kSmemBytes = kStepK * (kBM + kBN) * (8 + 4) + (kBM + kBN) * 4;

struct EmuOperand {
  const uint8_t* values = nullptr;  // [rows, K] e4m3 row-major
  const float* scales = nullptr;    // 1x128: [K/128, ld]; 128x128: [ceil(rows/128), ld]
  uint32_t rows = 0, ld = 0;
  bool per_row = false;             // 1x128 scales (else 128x128 blocks)
};

struct EmuArgs {
  EmuOperand a, b;
  void* d = nullptr;                // [d_rows, d_cols] f32 | bf16, row stride ldd
  int64_t ldd = 0;
  uint32_t d_rows = 0, d_cols = 0;
  bool d_f32 = true, accumulate = false;
  uint32_t K = 0;                   // columns of a and b
  uint32_t m_blocks = 0;            // blocks along the scheduler's rows
  int bits = 14, promote_every = 0;
  bool reference_only = false;      // bits = 52: every step through the reference's formula
  Grouping grouping = Grouping::none;
  GroupArgs group;
};

// Position of tile row or column c (< 64) in a row of a double tile: the pairs (4t, 4t+1) of all
// threads first, then (4t+2, 4t+3), so that a thread's two 16-byte loads each cover 256
// consecutive bytes across the 16 threads of a half-warp.
__device__ __forceinline__ int dpos(int c) { return ((((c >> 1) & 1) << 4) + (c >> 2)) * 2 + (c & 1); }

__device__ __forceinline__ float e4m3_value(uint32_t code) {
  const uint32_t sign = (code & 0x80u) << 24, e = (code >> 3) & 15u, m = code & 7u;
  if (e == 15u && m == 7u) return __uint_as_float(sign | 0x7FC00000u);  // NaN
  if (e == 0u) return __uint_as_float(sign | __float_as_uint(float(m) * 0x1p-9f));
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// The reference's bf16_encode (round to nearest even, NaN keeps its sign).
__device__ __forceinline__ uint16_t bf16_bits(float x) {
  const uint32_t u = __float_as_uint(x);
  if (x != x) return uint16_t(((u >> 16) & 0x8000u) | 0x7FFFu);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// FP32 add and FP32 -> FP64 that keep subnormals whatever the compiler's flush-to-zero setting.
__device__ __forceinline__ float add_keep_subnormal(float x, float y) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}
__device__ __forceinline__ double widen_keep_subnormal(float x) {
  double r;
  asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ uint32_t hi_word(double x) { return uint32_t(__double2hiint(x)); }
__device__ __forceinline__ uint32_t lo_word(double x) { return uint32_t(__double2loint(x)); }
__device__ __forceinline__ double from_words(uint32_t hi, uint32_t lo) { return __hiloint2double(int(hi), int(lo)); }

// std::ilogb as glibc defines it, with 0 and NaN (FP_ILOGB0 = FP_ILOGBNAN = INT_MIN) left out of
// the maximum the reference takes.
__device__ __forceinline__ int ref_ilogb(double v) {
  const uint64_t u = uint64_t(__double_as_longlong(v));
  const int field = int((u >> 52) & 0x7FF);
  const uint64_t mant = u & ((uint64_t(1) << 52) - 1);
  if (field == 0x7FF) return mant ? INT_MIN : INT_MAX;
  if (field == 0) return mant ? -1074 + 63 - __clzll(int64_t(mant)) : INT_MIN;
  return field - 1023;
}

// std::ldexp(1.0, e).
__device__ __forceinline__ double ref_pow2(int e) {
  if (e > 1023) return __longlong_as_double(0x7FF0000000000000ll);
  if (e < -1074) return 0.0;
  if (e < -1022) return __longlong_as_double(int64_t(1) << (e + 1074));
  return from_words(uint32_t(e + 1023) << 20, 0u);
}

// trunc(v / q) * q as the reference writes it.
__device__ __forceinline__ double ref_trunc(double v, double q) { return __dmul_rn(trunc(__ddiv_rn(v, q)), q); }

struct Smem {
  double* ad;  // [32][64] pre-scaled A values, columns in dpos order
  double* bd;  // [32][64] pre-scaled B values
  float* af;   // [32][64] raw A values
  float* bf;   // [32][64] raw B values
  float* sa;   // [64] scale of each tile row for the current K block
  float* sb;   // [64] scale of each tile column
};

// One thread's share of a 32-wide K step: 8 bytes of an A row and of a B row, and their scales.
struct StepBytes {
  uint2 a, b;
  float sa, sb;
};

__device__ __forceinline__ StepBytes fetch_step(const EmuArgs& p, const TileWork& w, uint32_t n0, uint32_t step) {
  const int t = int(threadIdx.x), r = t >> 2, kq = (t & 3) * 8;
  const uint32_t kb = w.kb_begin + step / 4, k = kb * 128u + (step % 4) * kStepK + uint32_t(kq);
  StepBytes s{make_uint2(0, 0), make_uint2(0, 0), 1.0f, 1.0f};
  const uint32_t arow = w.a_row + uint32_t(r);
  if (arow < p.a.rows) {
    s.a = __ldg(reinterpret_cast<const uint2*>(p.a.values + size_t(arow) * p.K + k));
    s.sa = __ldg(p.a.scales + size_t(kb) * p.a.ld + arow);
  }
  const uint32_t brow = w.b_row + uint32_t(r);
  if (n0 + uint32_t(r) < p.d_cols) {
    s.b = __ldg(reinterpret_cast<const uint2*>(p.b.values + size_t(brow) * p.K + k));
    s.sb = __ldg(p.b.per_row ? p.b.scales + size_t(kb) * p.b.ld + brow : p.b.scales + size_t(brow / 128) * p.b.ld + kb);
  }
  return s;
}

// Decodes a fetched step into shared memory. Returns true when a value or scale is NaN or Inf.
__device__ __forceinline__ bool store_step(const Smem& sm, const StepBytes& s, bool prescale) {
  const int t = int(threadIdx.x), r = t >> 2, kq = (t & 3) * 8;
  bool bad = !isfinite(s.sa) || !isfinite(s.sb);
  const double sa = prescale ? double(s.sa) : 1.0, sb = prescale ? double(s.sb) : 1.0;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const uint32_t ca = ((e < 4 ? s.a.x : s.a.y) >> (8 * (e & 3))) & 0xFFu;
    const uint32_t cb = ((e < 4 ? s.b.x : s.b.y) >> (8 * (e & 3))) & 0xFFu;
    const float fa = e4m3_value(ca), fb = e4m3_value(cb);
    bad |= isnan(fa) || isnan(fb);
    sm.af[(kq + e) * kBM + r] = fa;
    sm.bf[(kq + e) * kBN + r] = fb;
    sm.ad[(kq + e) * kBM + dpos(r)] = __dmul_rn(double(fa), sa);
    sm.bd[(kq + e) * kBN + dpos(r)] = __dmul_rn(double(fb), sb);
  }
  if (kq == 0) {
    sm.sa[r] = s.sa;
    sm.sb[r] = s.sb;
  }
  return bad;
}

// tc[i][j] <- the Tensor Core sum after one 32-wide step, fast path (finite values, bits <= 51).
// kF32Sum: bits <= 18, the integer terms summed as FP32 subnormals; else +-n*q summed in double.
template <bool kF32Sum>
__device__ __forceinline__ void fast_step(const Smem& sm, double (&tc)[4][4], const float (&sa)[4],
                                          const float (&sb)[4], int bits, bool prescaled) {
  const int tx = int(threadIdx.x) & 15, ty = int(threadIdx.x) >> 4;
  // Largest |a * b| of each output over the step, exact in FP32.
  float xm[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) xm[i][j] = 0.0f;
#pragma unroll 4
  for (int k = 0; k < kStepK; ++k) {
    const float4 a = *reinterpret_cast<const float4*>(sm.af + k * kBM + 4 * ty);
    const float4 b = *reinterpret_cast<const float4*>(sm.bf + k * kBN + 4 * tx);
    const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) xm[i][j] = fmaxf(xm[i][j], fabsf(__fmul_rn(av[i], bv[j])));
  }
  // Per output: emax (as the biased exponent field << 20), the hi word of M, and tc's own term.
  uint32_t mhi[4][4];
  float sum32[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const double x = double(xm[i][j]);
      const double pmax = prescaled ? __dmul_rn(x, __dmul_rn(double(sa[i]), double(sb[j]))) : x;
      const uint32_t key = max(hi_word(tc[i][j]) & 0x7FF00000u, hi_word(pmax) & 0x7FF00000u);
      mhi[i][j] = (key + (uint32_t(53 - bits) << 20)) | 0x80000u;
      const uint32_t tsign = hi_word(tc[i][j]) & 0x80000000u;
      if constexpr (kF32Sum) {
        const double t = __dadd_rz(fabs(tc[i][j]), from_words(mhi[i][j], 0u));
        sum32[i][j] = __uint_as_float(lo_word(t) | tsign);
      } else {
        const double c = from_words(mhi[i][j] | tsign, 0u);
        tc[i][j] = __dsub_rn(__dadd_rz(tc[i][j], c), c);
      }
    }
#pragma unroll 2
  for (int k = 0; k < kStepK; ++k) {
    const double2 a0 = *reinterpret_cast<const double2*>(sm.ad + k * kBM + 2 * ty);
    const double2 a1 = *reinterpret_cast<const double2*>(sm.ad + k * kBM + 32 + 2 * ty);
    const double2 b0 = *reinterpret_cast<const double2*>(sm.bd + k * kBN + 2 * tx);
    const double2 b1 = *reinterpret_cast<const double2*>(sm.bd + k * kBN + 32 + 2 * tx);
    const double av[4] = {a0.x, a0.y, a1.x, a1.y}, bv[4] = {b0.x, b0.y, b1.x, b1.y};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const double p = __dmul_rn(av[i], bv[j]);
        const uint32_t psign = hi_word(p) & 0x80000000u;
        if constexpr (kF32Sum) {
          const double t = __dadd_rz(fabs(p), from_words(mhi[i][j], 0u));
          sum32[i][j] = add_keep_subnormal(sum32[i][j], __uint_as_float(lo_word(t) | psign));
        } else {
          const double c = from_words(mhi[i][j] | psign, 0u);
          tc[i][j] = __dadd_rn(tc[i][j], __dsub_rn(__dadd_rz(p, c), c));
        }
      }
  }
  if constexpr (kF32Sum) {
    // tc = sum * 2^149 * q: the hi word of 2^(E + 149) is M's with the 0x80000 bit cleared and
    // the exponent raised by 149 - 52.
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        tc[i][j] = __dmul_rn(widen_keep_subnormal(sum32[i][j]), from_words((mhi[i][j] ^ 0x80000u) + (97u << 20), 0u));
  }
}

// One output's Tensor Core sum after one step, by tensor_core_accumulate's own formula; ar, br:
// the output's A row and B column in the double tiles.
__device__ __noinline__ double reference_step(const double* ar, const double* br, double tc, int bits) {
  int emax = ref_ilogb(tc);
#pragma unroll 1
  for (int k = 0; k < kStepK; ++k) emax = max(emax, ref_ilogb(__dmul_rn(ar[k * kBM], br[k * kBN])));
  if (emax == INT_MIN) return 0.0;
  const double q = ref_pow2(emax - (bits - 1));
  double sum = ref_trunc(tc, q);
#pragma unroll 1
  for (int k = 0; k < kStepK; ++k) sum = __dadd_rn(sum, ref_trunc(__dmul_rn(ar[k * kBM], br[k * kBN]), q));
  return sum;
}

__device__ __forceinline__ TileWork emu_tile(const EmuArgs& p, uint32_t m_blk, uint32_t n_blk) {
  const uint32_t kbs = p.K / 128;
  switch (p.grouping) {
    case Grouping::contiguous:
      return resolve_tile<Grouping::contiguous, kBM, kBN>(m_blk, n_blk, p.m_blocks, kbs, p.group);
    case Grouping::masked: return resolve_tile<Grouping::masked, kBM, kBN>(m_blk, n_blk, p.m_blocks, kbs, p.group);
    case Grouping::k_grouped:
      return resolve_tile<Grouping::k_grouped, kBM, kBN>(m_blk, n_blk, p.m_blocks, kbs, p.group);
    default: return resolve_tile<Grouping::none, kBM, kBN>(m_blk, n_blk, p.m_blocks, kbs, p.group);
  }
}

template <bool kF32Sum>
__global__ void __launch_bounds__(kThreads, 2) gemm_fp8_emulated_kernel(const EmuArgs p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem sm;
  sm.ad = reinterpret_cast<double*>(smem_raw);
  sm.bd = sm.ad + kStepK * kBM;
  sm.af = reinterpret_cast<float*>(sm.bd + kStepK * kBN);
  sm.bf = sm.af + kStepK * kBM;
  sm.sa = sm.bf + kStepK * kBN;
  sm.sb = sm.sa + kBM;

  const uint32_t m_blk = blockIdx.x, n_blk = blockIdx.y, n0 = n_blk * kBN;
  const TileWork w = emu_tile(p, m_blk, n_blk);
  const int tx = int(threadIdx.x) & 15, ty = int(threadIdx.x) >> 4;

  // The tile's K range is one segment for the reference (the whole K, or a Wgrad group's tokens):
  // promotion points count from its start, and N_c = 0 means the segment's length.
  const uint32_t steps = (w.kb_end - w.kb_begin) * (128 / kStepK), seg_k = steps * kStepK;
  const uint32_t nc = p.promote_every > 0 ? uint32_t(p.promote_every) : seg_k;
  const bool prescaled = seg_k > 0 && (nc > 128 || 128 % nc != 0);

  double tc[4][4];
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) tc[i][j] = 0.0, acc[i][j] = 0.0f;

  bool reference = p.reference_only;
  StepBytes next{};
  if (steps > 0) next = fetch_step(p, w, n0, 0);
  for (uint32_t step = 0; step < steps; ++step) {
    __syncthreads();  // the previous step's readers are done with shared memory
    const bool bad = __syncthreads_or(store_step(sm, next, prescaled));
    if (step + 1 < steps) next = fetch_step(p, w, n0, step + 1);
    // NaN or Inf: the reference's formula from here on (a NaN tc must stay NaN).
    reference |= bad;
    const float4 sa4 = *reinterpret_cast<const float4*>(sm.sa + 4 * ty);
    const float4 sb4 = *reinterpret_cast<const float4*>(sm.sb + 4 * tx);
    const float sa[4] = {sa4.x, sa4.y, sa4.z, sa4.w}, sb[4] = {sb4.x, sb4.y, sb4.z, sb4.w};
    if (reference) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          tc[i][j] = reference_step(sm.ad + dpos(4 * ty + i), sm.bd + dpos(4 * tx + j), tc[i][j], p.bits);
    } else {
      fast_step<kF32Sum>(sm, tc, sa, sb, p.bits, prescaled);
    }
    const uint32_t done = (step + 1) * kStepK;
    if (done % nc == 0 || done == seg_k) {  // promotion to FP32
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float t = __double2float_rn(tc[i][j]);
          const float s = prescaled ? 1.0f : __double2float_rn(__dmul_rn(double(sa[i]), double(sb[j])));
          acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(t, s));
          tc[i][j] = 0.0;
        }
    }
  }

  // Epilogue: rows with a product get it, the group's other rows zeros (or nothing when
  // accumulating), rows of other groups and past D nothing.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t r = uint32_t(4 * ty + i), row = w.d_row + r;
    if (r >= w.write_rows || row >= p.d_rows) continue;
    bool product;
    if (p.grouping == Grouping::contiguous) {
      const int32_t g = __ldg(p.group.table + row);
      product = g >= 0 && uint32_t(g) < p.group.groups;
    } else {
      product = r < w.valid_rows;
    }
    if (p.accumulate && !product) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t col = n0 + uint32_t(4 * tx + j);
      if (col >= p.d_cols) continue;
      const size_t at = size_t(row) * size_t(p.ldd) + col;
      float v = product ? acc[i][j] : 0.0f;
      if (p.d_f32) {
        float* d = static_cast<float*>(p.d) + at;
        *d = p.accumulate ? __fadd_rn(v, *d) : v;
      } else {
        static_cast<uint16_t*>(p.d)[at] = bf16_bits(v);
      }
    }
  }
}

template <bool kF32Sum>
void launch_kernel(const EmuArgs& args, uint32_t n_blocks, cudaStream_t stream) {
  auto kernel = gemm_fp8_emulated_kernel<kF32Sum>;
  static std::once_flag once;
  std::call_once(once, [&] {
    FP8MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  });
  kernel<<<dim3(args.m_blocks, n_blocks), kThreads, kSmemBytes, stream>>>(args);
  FP8MOE_CUDA_CHECK_LAUNCH("gemm_fp8_emulated_kernel");
}

// Fills in the accumulation settings and launches over m_blocks x ceil(d_cols / 64) tiles.
void launch(EmuArgs args, const GemmOptions& opt, cudaStream_t stream, const char* op) {
  const int64_t n_blocks = (int64_t(args.d_cols) + kBN - 1) / kBN;
  FP8MOE_CHECK(n_blocks <= 65535, op << ": " << args.d_cols << " output columns exceed the emulation's grid ("
                                     << 65535 * kBN << " at most)");
  if (args.m_blocks == 0 || n_blocks == 0) return;
  args.bits = opt.accum.mantissa_bits;
  args.promote_every = opt.accum.promote_every;
  args.reference_only = args.bits > 51;
  if (args.bits <= 18) launch_kernel<true>(args, uint32_t(n_blocks), stream);
  else launch_kernel<false>(args, uint32_t(n_blocks), stream);
}

void check_accum(const GemmOptions& opt, const char* op) {
  const AccumConfig& ac = opt.accum;
  FP8MOE_CHECK(ac.mode == AccumMode::tensor_core,
               op << ": the emulation computes AccumMode::tensor_core accumulation (fp32 runs on the sm_90a kernels)");
  FP8MOE_CHECK(ac.mantissa_bits >= 1 && ac.mantissa_bits <= 52,
               "accum.mantissa_bits must be in [1, 52], got " << ac.mantissa_bits);
  FP8MOE_CHECK(ac.promote_every >= 0 && ac.promote_every % kStepK == 0,
               "accum.promote_every (N_c) must be 0 (never) or a positive multiple of 32, got " << ac.promote_every);
}

// The operands: e4m3 values with `kind` scales, both contiguous on the GPU, values 16-byte aligned
// (the 8-byte loads of every row then stay aligned, K being a multiple of 128); the scales are
// read one float at a time, so their alignment is free.
void check_emu_operand(const QuantizedView& q, const char* op, const char* arg, ScaleKind kind) {
  check_operand(q, op, arg, kind, /*scales_aligned=*/false);
}

EmuOperand emu_operand(const QuantizedView& q) {
  EmuOperand o;
  o.values = static_cast<const uint8_t*>(q.values.data);
  o.scales = q.scales.ptr<const float>();
  o.rows = uint32_t(q.rows());
  o.ld = uint32_t(q.scales.size(1));
  o.per_row = q.kind == ScaleKind::tile_1x128;
  return o;
}

// The launch arguments every entry point shares: operands, output, and the K the kernel walks.
EmuArgs emu_args(const QuantizedView& a, const QuantizedView& b, const TensorView& d, bool accumulate, int64_t K) {
  EmuArgs args;
  args.a = emu_operand(a);
  args.b = emu_operand(b);
  args.d = d.data;
  args.ldd = d.strides[0];
  args.d_rows = uint32_t(d.size(0));
  args.d_cols = uint32_t(d.size(1));
  args.d_f32 = d.dtype == DType::f32;
  args.accumulate = accumulate;
  args.K = uint32_t(K);
  return args;
}

// Checks shared by the two m-grouped GEMMs; returns N.
int64_t check_m_grouped_emu(const QuantizedView& a, const QuantizedView& b, int64_t groups, const char* op) {
  check_emu_operand(a, op, "a", ScaleKind::tile_1x128);
  check_emu_operand(b, op, "b", ScaleKind::block_128x128);
  return check_m_grouped_shapes(a, b, groups, op);
}

}  // namespace

void gemm_fp8_emulated(const QuantizedView& a, const QuantizedView& b, const TensorView& d, const GemmOptions& opt,
                       cudaStream_t stream) {
  const char* op = "gemm_fp8";
  check_accum(opt, op);
  check_emu_operand(a, op, "a", ScaleKind::tile_1x128);
  check_emu_operand(b, op, "b", b.kind);
  const int64_t M = a.rows(), K = a.cols(), N = b.rows();
  FP8MOE_CHECK(b.cols() == K, "b: expected K = " << K << " columns (b is [N, K]), got " << b.values.str());
  FP8MOE_CHECK(K % kQuantGroup == 0 && K > 0, "a: K = " << K << " must be a positive multiple of 128 (pad K with zeros)");
  check_output(d, op, M, N, opt.accumulate);
  FP8MOE_CHECK(M < (int64_t(1) << 31) && N < (int64_t(1) << 31) && K < (int64_t(1) << 31),
               op << ": M, N, K must be below 2^31");
  EmuArgs args = emu_args(a, b, d, opt.accumulate, K);
  args.m_blocks = uint32_t((M + kBM - 1) / kBM);
  args.grouping = Grouping::none;
  launch(args, opt, stream, op);
}

void grouped_gemm_fp8_contiguous_emulated(const QuantizedView& a, const QuantizedView& b, const TensorView& row_group,
                                          int64_t groups, const TensorView& d, const GemmOptions& opt,
                                          cudaStream_t stream) {
  const char* op = "grouped_gemm_fp8_contiguous";
  check_accum(opt, op);
  const int64_t N = check_m_grouped_emu(a, b, groups, op);
  check_group_table(row_group, op, "row_group", a.rows());
  check_output(d, op, a.rows(), N, opt.accumulate);
  EmuArgs args = emu_args(a, b, d, opt.accumulate, a.cols());
  args.m_blocks = uint32_t((a.rows() + kBM - 1) / kBM);
  args.grouping = Grouping::contiguous;
  args.group.table = row_group.ptr<const int32_t>();
  args.group.groups = uint32_t(groups);
  args.group.b_rows = uint32_t(N);
  launch(args, opt, stream, op);
}

void grouped_gemm_fp8_masked_emulated(const QuantizedView& a, const QuantizedView& b, const TensorView& counts,
                                      int64_t groups, const TensorView& d, const GemmOptions& opt,
                                      cudaStream_t stream) {
  const char* op = "grouped_gemm_fp8_masked";
  check_accum(opt, op);
  FP8MOE_CHECK(!opt.accumulate, op << ": accumulate is unsupported (the output is overwritten)");
  const int64_t N = check_m_grouped_emu(a, b, groups, op);
  FP8MOE_CHECK(a.rows() % groups == 0,
               "a: " << a.rows() << " rows do not split into " << groups << " groups of M_max (a is [G * M_max, K])");
  check_group_table(counts, op, "counts", groups);
  check_output(d, op, a.rows(), N, false);
  const int64_t m_max = a.rows() / groups;
  EmuArgs args = emu_args(a, b, d, false, a.cols());
  args.m_blocks = uint32_t(groups * ((m_max + kBM - 1) / kBM));
  args.grouping = Grouping::masked;
  args.group.table = counts.ptr<const int32_t>();
  args.group.groups = uint32_t(groups);
  args.group.group_rows = uint32_t(m_max);
  args.group.b_rows = uint32_t(N);
  if (m_max == 0) return;
  launch(args, opt, stream, op);
}

void grouped_wgrad_fp8_emulated(const QuantizedView& dy_t, const QuantizedView& x_t, const TensorView& offsets,
                                const TensorView& d, const GemmOptions& opt, cudaStream_t stream) {
  const char* op = "grouped_wgrad_fp8";
  check_accum(opt, op);
  check_emu_operand(dy_t, op, "dy_t", ScaleKind::tile_1x128);
  check_emu_operand(x_t, op, "x_t", ScaleKind::tile_1x128);
  const int64_t G = check_grouped_wgrad(dy_t, x_t, offsets, d, opt.accumulate, op);
  const int64_t N = dy_t.rows(), K = x_t.rows(), R = dy_t.cols();
  if (G * N == 0 || K == 0) return;
  EmuArgs args = emu_args(dy_t, x_t, d, opt.accumulate, R);
  args.m_blocks = uint32_t(G * ((N + kBM - 1) / kBM));
  args.grouping = Grouping::k_grouped;
  args.group.table = offsets.ptr<const int32_t>();
  args.group.groups = uint32_t(G);
  args.group.group_rows = uint32_t(N);
  launch(args, opt, stream, op);
}

}  // namespace fp8moe::cuda
