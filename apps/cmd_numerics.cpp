// `fp8moe numerics`: reproduces the FP8 numerics of the report (§3.3) on the CPU reference.
//   accum  the Tensor Core accumulation error of a K=4096 FP8 GEMM without promotion vs with
//          promotion every N_c = 128, and a sweep over K and N_c; --hardware: the same on the GPU's
//          Tensor Cores beside the emulation, and the emulated width that reproduces them.
//   quant  per-tensor vs 1x128 vs 128x128 quantization error on activations with outliers, and
//          the two 128x1 paths (direct, and the report's dequantize-transpose-requantize).
// Output: a readable table, or JSON with --json.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "fp8moe/codecs.hpp"
#include "fp8moe/gemm_ref.hpp"
#include "fp8moe/quantize.hpp"
#ifdef FP8MOE_HAVE_CUDA
#include "cuda/cuda_backend.hpp"
#include "cuda/kernel_api.hpp"
#endif

namespace fp8moe {
namespace {

struct AccumArgs {
  int64_t m = 256, n = 256;
  std::vector<int64_t> ks{4096};
  std::vector<int> ncs{0, 128};
  int bits = 14;
  uint64_t seed = 0;
  bool sweep = false;
  bool hardware = false;
  bool json = false;
};

struct ErrorStats {
  double max_rel = 0;   // max over elements of |d - ref| / |ref|, elements with |ref| >= rms(ref)
  double mean_rel = 0;  // mean of the same
  double norm_rel = 0;  // ||d - ref|| / ||ref||
};

ErrorStats compare(const std::vector<float>& d, const std::vector<double>& ref) {
  double ss = 0;
  for (double r : ref) ss += r * r;
  const double rms = std::sqrt(ss / double(ref.size()));
  ErrorStats e;
  double num = 0;
  int64_t count = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    const double err = std::fabs(double(d[i]) - ref[i]);
    num += err * err;
    // NOTES: relative error is only meaningful where the exact result is not near zero; elements
    // below the RMS of the output are left out of max/mean (they are in norm_rel).
    if (std::fabs(ref[i]) >= rms) {
      e.max_rel = std::max(e.max_rel, err / std::fabs(ref[i]));
      e.mean_rel += err / std::fabs(ref[i]);
      ++count;
    }
  }
  e.mean_rel /= double(std::max<int64_t>(count, 1));
  e.norm_rel = std::sqrt(num / ss);
  return e;
}

// A [M, K] and B [N, K] drawn from N(0, 1), quantized 1x128 / 128x128 (e4m3).
struct GemmProblem {
  QuantizedTensor a, b;
  std::vector<double> exact;  // FP64 product of the dequantized operands: accumulation error only
};

GemmProblem make_problem(int64_t M, int64_t N, int64_t K, std::mt19937_64& rng) {
  Tensor x = Tensor::host(DType::f32, {M, K}), w = Tensor::host(DType::f32, {N, K});
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (int64_t i = 0; i < M * K; ++i) x.ptr<float>()[i] = dist(rng);
  for (int64_t i = 0; i < N * K; ++i) w.ptr<float>()[i] = dist(rng);
  GemmProblem p{make_quantized_host(M, K, DType::e4m3, ScaleKind::tile_1x128),
                make_quantized_host(N, K, DType::e4m3, ScaleKind::block_128x128), {}};
  quantize_1x128(x, p.a);
  quantize_128x128(w, p.b);
  p.exact = dequantized_product(p.a, p.b);
  return p;
}

ErrorStats run_accum(const GemmProblem& p, int nc, int bits) {
  const int64_t M = p.a.values.size(0), N = p.b.values.size(0);
  Tensor d = Tensor::host(DType::f32, {M, N});
  GemmOptions opt;
  opt.accum = {AccumMode::tensor_core, bits, nc};
  gemm_fp8_ref(p.a, p.b, d, opt);
  return compare(std::vector<float>(d.ptr<float>(), d.ptr<float>() + M * N), p.exact);
}

std::string nc_name(int nc) { return nc == 0 ? "never" : std::to_string(nc); }

// The K and N_c of a run: --k and --nc, or the sweep's.
std::pair<std::vector<int64_t>, std::vector<int>> accum_grid(const AccumArgs& args) {
  if (args.sweep) return {{512, 1024, 2048, 4096, 8192, 16384}, {0, 32, 64, 128, 256, 512, 1024}};
  return {args.ks, args.ncs};
}

void accum_command(const AccumArgs& args) {
  std::mt19937_64 rng(args.seed ? args.seed : std::random_device{}());
  const auto [ks, ncs] = accum_grid(args);
  nlohmann::json rows = nlohmann::json::array();
  if (!args.json) {
    std::printf("FP8 GEMM accumulation error: Tensor Core sum truncated to %d bits, M=%lld N=%lld, e4m3 inputs N(0,1)\n",
                args.bits, (long long)args.m, (long long)args.n);
    std::printf("errors vs the FP64 product of the same quantized inputs (accumulation error only)\n\n");
    std::printf("%7s %7s %14s %14s %14s\n", "K", "N_c", "max rel err", "mean rel err", "norm rel err");
  }
  for (int64_t k : ks) {
    GemmProblem p = make_problem(args.m, args.n, k, rng);
    for (int nc : ncs) {
      if (nc > k) continue;
      ErrorStats e = run_accum(p, nc, args.bits);
      rows.push_back({{"k", k}, {"n_c", nc}, {"bits", args.bits}, {"max_rel", e.max_rel},
                      {"mean_rel", e.mean_rel}, {"norm_rel", e.norm_rel}});
      if (!args.json)
        std::printf("%7lld %7s %13.4f%% %13.4f%% %13.4f%%\n", (long long)k, nc_name(nc).c_str(), 100 * e.max_rel,
                    100 * e.mean_rel, 100 * e.norm_rel);
    }
  }
  if (args.json) std::printf("%s\n", rows.dump(2).c_str());
  else
    std::printf("\nmax/mean rel err: over outputs with |exact| >= RMS(exact); N_c = never: no promotion.\n");
}

#ifdef FP8MOE_HAVE_CUDA
// --hardware: raw e4m3 operands (N(0,1) values, unit scales) through the GPU's own WGMMAs, their sum
// promoted to FP32 every N_c (cuda::wgmma_accumulate), beside the emulation at --bits of the same
// operands (cuda::gemm_fp8_emulated, gemm_fp8_ref's arithmetic bit for bit), and the mantissa width
// in 8..24 whose emulation is bit-identical to the hardware on the most outputs.
void accum_hardware_command(const AccumArgs& args) {
  FP8MOE_CHECK(cuda_device_available() && cuda::sm90_available(), "numerics accum --hardware: needs an sm_90a GPU");
  FP8MOE_CHECK(args.m > 0 && args.m % 64 == 0 && args.n > 0 && args.n % 128 == 0,
               "numerics accum --hardware: --m must be a positive multiple of 64 and --n of 128, got "
                   << args.m << " and " << args.n);
  std::mt19937_64 rng(args.seed ? args.seed : std::random_device{}());
  const auto [ks, ncs] = accum_grid(args);
  auto be = make_cuda_backend();
  auto device_copy = [&](const Tensor& h) {
    Tensor t = be->zeros(h.dtype(), {h.size(0), h.size(1)});
    be->copy(t.view(), h.view());
    return t;
  };
  const int64_t M = args.m, N = args.n;
  nlohmann::json rows = nlohmann::json::array();
  if (!args.json) {
    std::printf("FP8 WGMMA accumulation on this GPU against its emulation, M=%lld N=%lld, e4m3 inputs N(0,1), unit "
                "scales\nerrors vs the FP64 product of the same e4m3 inputs (accumulation error only)\n\n",
                (long long)M, (long long)N);
    std::printf("%7s %7s | %-36s | %-36s | %s\n", "", "", "hardware (relative error)",
                ("emulation, " + std::to_string(args.bits) + " bits").c_str(), "emulation = hardware");
    std::printf("%7s %7s | %11s %11s %12s | %11s %11s %12s | %4s %11s\n", "K", "N_c", "max", "mean", "norm", "max",
                "mean", "norm", "bits", "identical");
  }
  for (int64_t K : ks) {
    FP8MOE_CHECK(K > 0 && K % 128 == 0, "numerics accum --hardware: K must be a positive multiple of 128, got " << K);
    const auto [a, b] = cuda::wgmma_accumulate_operands(M, N, K, rng);
    const std::vector<double> exact = dequantized_product(a, b);
    const QuantizedTensor ad{device_copy(a.values), device_copy(a.scales), a.kind};
    const QuantizedTensor bd{device_copy(b.values), device_copy(b.scales), b.kind};
    Tensor d = be->zeros(DType::f32, {M, N});
    auto host_floats = [&] {
      Tensor h = be->to_host(d);
      return std::vector<float>(h.ptr<float>(), h.ptr<float>() + M * N);
    };
    auto emulate = [&](int nc, int bits) {
      GemmOptions opt;
      opt.accum = {AccumMode::tensor_core, bits, nc};
      cuda::gemm_fp8_emulated(ad.view(), bd.view(), d.view(), opt, nullptr);
      return host_floats();
    };
    for (int nc : ncs) {
      if (nc > K) continue;
      cuda::wgmma_accumulate(ad.values.view(), bd.values.view(), d.view(), nc, nullptr);
      const std::vector<float> hw = host_floats();
      const ErrorStats e_hw = compare(hw, exact), e_emu = compare(emulate(nc, args.bits), exact);
      int best_bits = 0;
      int64_t best_same = -1;
      for (int bits = 8; bits <= 24; ++bits) {
        const std::vector<float> emu = emulate(nc, bits);
        int64_t same = 0;
        for (size_t i = 0; i < hw.size(); ++i) same += std::memcmp(&hw[i], &emu[i], sizeof(float)) == 0;
        if (same > best_same) best_same = same, best_bits = bits;
      }
      const double identical = double(best_same) / double(M * N);
      rows.push_back({{"k", K}, {"n_c", nc}, {"hardware", {{"max_rel", e_hw.max_rel}, {"mean_rel", e_hw.mean_rel},
                                                           {"norm_rel", e_hw.norm_rel}}},
                      {"emulation", {{"bits", args.bits}, {"max_rel", e_emu.max_rel}, {"mean_rel", e_emu.mean_rel},
                                     {"norm_rel", e_emu.norm_rel}}},
                      {"best_bits", best_bits}, {"identical", identical}});
      if (!args.json)
        std::printf("%7lld %7s | %10.4f%% %10.4f%% %11.4f%% | %10.4f%% %10.4f%% %11.4f%% | %4d %10.2f%%\n",
                    (long long)K, nc_name(nc).c_str(), 100 * e_hw.max_rel, 100 * e_hw.mean_rel, 100 * e_hw.norm_rel,
                    100 * e_emu.max_rel, 100 * e_emu.mean_rel, 100 * e_emu.norm_rel, best_bits, 100 * identical);
    }
  }
  if (args.json) std::printf("%s\n", rows.dump(2).c_str());
  else
    std::printf("\nmax/mean rel err: over outputs with |exact| >= RMS(exact); N_c = never: no promotion. bits: the "
                "emulated mantissa width in 8..24 bit-identical to the hardware on the most outputs.\n");
}
#endif

struct QuantArgs {
  int64_t tokens = 512, channels = 1024;
  float outlier_scale = 10000.0f;
  uint64_t seed = 0;
  bool json = false;
};

// Activations: N(0, 1) with a few outlier channels (x outlier_scale, as LLM activations have) and a
// handful of single-element spikes.
Tensor make_activations(const QuantArgs& args, std::mt19937_64& rng, std::vector<bool>& is_outlier) {
  const int64_t T = args.tokens, C = args.channels;
  Tensor x = Tensor::host(DType::f32, {T, C});
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<bool> outlier_channel(size_t(C), false);
  for (int i = 0; i < 4; ++i) outlier_channel[size_t(rng() % uint64_t(C))] = true;
  is_outlier.assign(size_t(T * C), false);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      float v = dist(rng);
      if (outlier_channel[size_t(c)]) {
        v *= args.outlier_scale;
        is_outlier[size_t(t * C + c)] = true;
      }
      x.ptr<float>()[t * C + c] = v;
    }
  for (int i = 0; i < 8; ++i) {
    int64_t j = int64_t(rng() % uint64_t(T * C));
    x.ptr<float>()[j] = args.outlier_scale * 10 * (i % 2 ? 1.0f : -1.0f);
    is_outlier[size_t(j)] = true;
  }
  return x;
}

struct QuantError {
  double rel = 0;          // ||deq - x|| / ||x|| over all elements
  double rel_normal = 0;   // the same over the non-outlier elements
  double zero_frac = 0;    // non-zero inputs that quantized to zero
};

QuantError quant_error(const TensorView& x, const QuantizedView& q, const std::vector<bool>& is_outlier,
                       bool transposed) {
  const int64_t R = q.rows(), C = q.cols();
  Tensor deq = Tensor::host(DType::f32, {R, C});
  dequantize(q, deq);
  double num = 0, den = 0, num_n = 0, den_n = 0;
  int64_t zeros = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t src = transposed ? c * R + r : r * C + c;  // q is x^T when transposed
      double v = x.ptr<float>()[src], d = deq.ptr<float>()[r * C + c] - v;
      num += d * d;
      den += v * v;
      if (!is_outlier[size_t(src)]) {
        num_n += d * d;
        den_n += v * v;
      }
      zeros += (v != 0 && deq.ptr<float>()[r * C + c] == 0);
    }
  return {std::sqrt(num / den), std::sqrt(num_n / den_n), double(zeros) / double(R * C)};
}

void quant_command(const QuantArgs& args) {
  std::mt19937_64 rng(args.seed ? args.seed : std::random_device{}());
  const int64_t T = args.tokens, C = args.channels;
  std::vector<bool> is_outlier;
  Tensor x = make_activations(args, rng, is_outlier);
  nlohmann::json rows = nlohmann::json::array();
  auto row = [&](const char* name, const QuantError& e) {
    rows.push_back({{"method", name}, {"rel", e.rel}, {"rel_non_outlier", e.rel_normal}, {"zero_frac", e.zero_frac}});
    if (!args.json)
      std::printf("%-34s %12.4f%% %14.4f%% %12.4f%%\n", name, 100 * e.rel, 100 * e.rel_normal, 100 * e.zero_frac);
  };
  if (!args.json) {
    std::printf("Quantization error, e4m3, activations [%lld, %lld] N(0,1) with 4 outlier channels x%g and 8 spikes\n\n",
                (long long)T, (long long)C, double(args.outlier_scale));
    std::printf("%-34s %13s %15s %13s\n", "method", "rel err", "non-outlier", "to zero");
  }
  auto tile = make_quantized_host(T, C, DType::e4m3, ScaleKind::tile_1x128);
  auto block = make_quantized_host(T, C, DType::e4m3, ScaleKind::block_128x128);
  quantize_per_tensor(x, tile);
  row("per-tensor", quant_error(x, tile, is_outlier, false));
  quantize_128x128(x, block);
  row("128x128 blocks", quant_error(x, block, is_outlier, false));
  quantize_1x128(x, tile);
  row("1x128 tiles", quant_error(x, tile, is_outlier, false));
  quantize_1x128(x, tile, ScaleMode::pow2);
  row("1x128 tiles, power-of-two scales", quant_error(x, tile, is_outlier, false));

  // Wgrad operand: x^T grouped along tokens, directly and through the cached 1x128 FP8 tensor.
  auto direct = make_quantized_host(C, T, DType::e4m3, ScaleKind::tile_1x128);
  auto requant = make_quantized_host(C, T, DType::e4m3, ScaleKind::tile_1x128);
  quantize_1x128(x, tile);
  quantize_128x1(x, direct);
  requantize_128x1(tile, requant);
  row("128x1 direct from FP32", quant_error(x, direct, is_outlier, true));
  row("128x1 from cached 1x128 FP8", quant_error(x, requant, is_outlier, true));
  if (args.json) std::printf("%s\n", rows.dump(2).c_str());
}

void add_numerics(CLI::App& app) {
  auto* cmd = app.add_subcommand("numerics", "Reproduce the report's FP8 numerics (accumulation, quantization)");
  cmd->require_subcommand(1);

  static AccumArgs accum;
  auto* a = cmd->add_subcommand("accum", "Tensor Core accumulation error with and without promotion");
  a->add_option("--k", accum.ks, "reduction sizes")->capture_default_str();
  a->add_option("--nc", accum.ncs, "promotion intervals N_c (0 = never)")->capture_default_str();
  a->add_option("--m", accum.m, "rows of A")->capture_default_str();
  a->add_option("--n", accum.n, "rows of B")->capture_default_str();
  a->add_option("--bits", accum.bits, "bits kept by the Tensor Core accumulator")->capture_default_str();
  a->add_option("--seed", accum.seed, "random seed (0: fresh)");
  a->add_flag("--sweep", accum.sweep, "sweep K in 512..16384 and N_c in never,32..1024");
  a->add_flag("--hardware", accum.hardware,
              "measure the GPU's own WGMMA accumulation (sm_90a) beside the emulation; --m a multiple of 64, --n of 128");
  a->add_flag("--json", accum.json, "print JSON");
  a->callback([] {
    if (!accum.hardware) return accum_command(accum);
#ifdef FP8MOE_HAVE_CUDA
    accum_hardware_command(accum);
#else
    throw Error("numerics accum --hardware: this build has no CUDA backend");
#endif
  });

  static QuantArgs quant;
  auto* q = cmd->add_subcommand("quant", "Per-tensor vs 1x128 vs 128x128 quantization error with outliers");
  q->add_option("--tokens", quant.tokens, "rows of the activation")->capture_default_str();
  q->add_option("--channels", quant.channels, "columns of the activation")->capture_default_str();
  q->add_option("--outlier-scale", quant.outlier_scale, "magnitude of the outlier channels")->capture_default_str();
  q->add_option("--seed", quant.seed, "random seed (0: fresh)");
  q->add_flag("--json", quant.json, "print JSON");
  q->callback([] { quant_command(quant); });
}

const bool registered = cli::register_command(&add_numerics);

}  // namespace
}  // namespace fp8moe
