// The trainer end to end on a tiny model: the loss falls, a resumed run reproduces the losses of
// an uninterrupted one bit for bit, a truncated checkpoint is refused with the previous one
// intact, and a non-finite loss stops the run naming the step and saving nothing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fp8moe/safetensors.hpp"
#include "fp8moe/trainer.hpp"
#include "testing.hpp"

using namespace fp8moe;
namespace fs = std::filesystem;

namespace {

fs::path scratch() { return fp8moe::testing::test_dir("fp8moe_trainer"); }
using fp8moe::testing::read_file;

// A small English-like corpus made on the spot (the tests do not rely on the default corpus).
std::string make_corpus(const fs::path& dir) {
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "a", "cat", "sleeps", "in", "sun"};
  std::ofstream out(dir / "corpus.txt");
  uint64_t x = 12345;
  for (int i = 0; i < 60000; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    out << words[(x >> 33) % 14] << ((x >> 20) % 9 == 0 ? ".\n" : " ");
  }
  return (dir / "corpus.txt").string();
}

TrainOptions tiny_options(const fs::path& dir) {
  TrainOptions o;
  o.model_config = std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json";
  o.recipe = "fp8";
  o.backend = "cpu";
  o.data = make_corpus(dir);
  o.out_dir = (dir / "run").string();
  o.steps = 8;
  o.batch_size = 2;
  o.seq_len = 64;
  o.eval_every = 4;
  o.eval_batches = 2;
  o.ckpt_every = 100;
  o.quiet = true;
  o.lr = 3e-3f;
  return o;
}

std::vector<nlohmann::json> read_metrics(const std::string& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(fs::path(dir) / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

}  // namespace

TEST(Trainer, LossFallsAndResumeIsBitIdentical) {
  fs::path dir = scratch();
  TrainOptions a = tiny_options(dir);
  TrainSummary sa = Trainer(a).run();
  auto ma = read_metrics(a.out_dir);
  ASSERT_EQ(ma.size(), 8u);
  EXPECT_LT(ma.back()["loss"].get<double>(), ma.front()["loss"].get<double>() - 0.5) << "loss did not fall";
  EXPECT_EQ(sa.steps, 8);

  TrainOptions b = a;
  b.out_dir = (dir / "resumed").string();
  b.stop_at = 3;
  EXPECT_EQ(Trainer(b).run().steps, 3);
  b.stop_at = 0;
  b.resume = true;
  Trainer(b).run();
  auto mb = read_metrics(b.out_dir);
  ASSERT_EQ(mb.size(), ma.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_EQ(ma[i]["loss"].get<double>(), mb[i]["loss"].get<double>()) << "step " << i;
    EXPECT_EQ(ma[i].contains("val_loss"), mb[i].contains("val_loss"));
    if (ma[i].contains("val_loss")) {
      EXPECT_EQ(ma[i]["val_loss"].get<double>(), mb[i]["val_loss"].get<double>());
    }
  }
  // The checkpoints of the two runs hold the same weights.
  auto ca = load_safetensors((fs::path(a.out_dir) / "checkpoint.safetensors").string());
  auto cb = load_safetensors((fs::path(b.out_dir) / "checkpoint.safetensors").string());
  ASSERT_EQ(ca.tensors.size(), cb.tensors.size());
  for (auto& [name, t] : ca.tensors)
    EXPECT_EQ(std::memcmp(t.view().data, cb.tensors.at(name).view().data, t.view().nbytes()), 0) << name;
  // The attention precision belongs to the run: resuming with another is refused, and it moves the
  // first loss (same weights and batch) by BF16 rounding only.
  TrainOptions c = b;
  c.attention = "bf16";
  try {
    Trainer(c).run();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("trained with --attention exact, this run asks for bf16"), std::string::npos)
        << e.what();
  }
  TrainOptions d = a;
  d.out_dir = (dir / "attention_bf16").string();
  d.attention = "bf16";
  d.steps = 1;
  Trainer(d).run();
  const double l0 = ma[0]["loss"].get<double>(), l0_bf16 = read_metrics(d.out_dir)[0]["loss"].get<double>();
  EXPECT_NE(l0_bf16, l0);
  EXPECT_NEAR(l0_bf16, l0, 1e-3 * l0);
  fs::remove_all(dir);
}

// The report's MTP loss weight schedule: the config's weight (0.3) until the switch, then the
// later one; the total loss the gradients are of uses the weight of its step.
TEST(Trainer, MtpWeightFollowsItsSchedule) {
  fs::path dir = scratch();
  TrainOptions o = tiny_options(dir);
  o.steps = 6;
  o.mtp_weight_after = 0.1;
  o.mtp_switch = 0.5;
  o.ckpt_every = 0;     // and no checkpoint is written
  o.peak_tflops = 0.5;  // and the MFU is reported against this peak
  Trainer(o).run();
  EXPECT_FALSE(fs::exists(fs::path(o.out_dir) / "checkpoint.safetensors"));
  const auto m = read_metrics(o.out_dir);
  for (const auto& j : m) EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), j["tflops"].get<double>() / 0.5) << j["step"];
  ASSERT_EQ(m.size(), 6u);
  for (const auto& j : m) {
    const double w = j["mtp_weight"].get<double>();
    EXPECT_EQ(w, j["step"].get<int64_t>() < 3 ? 0.3 : 0.1) << j["step"];
    const double total = j["loss"].get<double>() + w * j["mtp_loss"].get<double>() + j["balance_loss"].get<double>();
    EXPECT_NEAR(j["total_loss"].get<double>(), total, 1e-9 * std::abs(total)) << j["step"];
  }
  o.mtp_switch = 1.5;
  fp8moe::testing::expect_error([&] { Trainer t(o); }, "mtp_switch");
  o.mtp_switch = 0.5;
  o.ckpt_every = -1;
  fp8moe::testing::expect_error([&] { Trainer t(o); }, "ckpt_every");
  fs::remove_all(dir);
}

// The CPU backend runs ops as they are called: it has no graphs to record, so --graphs on is
// refused by name (auto trains without them).
TEST(Trainer, GraphsOnARefusedBackendNameIt) {
  fs::path dir = scratch();
  TrainOptions o = tiny_options(dir);
  o.graphs = "on";
  fp8moe::testing::expect_error([&] { Trainer t(o); }, "--graphs on: backend 'cpu' cannot record graphs");
  o.graphs = "auto";
  o.steps = 2;
  o.overwrite = true;
  EXPECT_EQ(Trainer(o).run().graph_replays, 0);
  fs::remove_all(dir);
}

// The CPU backend keeps the EMA in host memory: --ema-on device is refused by name.
TEST(Trainer, EmaOnTheDeviceOfTheCpuBackendIsRefused) {
  fs::path dir = scratch();
  TrainOptions o = tiny_options(dir);
  o.ema_on = "device";
  fp8moe::testing::expect_error([&] { Trainer t(o); }, "--ema-on device: backend 'cpu' keeps the EMA in host memory");
  fs::remove_all(dir);
}

TEST(Trainer, TruncatedCheckpointIsRefusedAndKeptIntact) {
  fs::path dir = scratch();
  TrainOptions o = tiny_options(dir);
  o.steps = 4;
  Trainer(o).run();
  const fs::path ckpt = fs::path(o.out_dir) / "checkpoint.safetensors";
  const std::string good = read_file(ckpt);
  // A truncated copy is refused with an error naming the problem.
  fs::path broken_dir = dir / "broken";
  fs::create_directories(broken_dir);
  {
    std::ofstream out(broken_dir / "checkpoint.safetensors", std::ios::binary);
    out << good.substr(0, good.size() / 2);
  }
  TrainOptions r = o;
  r.out_dir = broken_dir.string();
  r.resume = true;
  try {
    Trainer t(r);
    FAIL() << "a truncated checkpoint was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_file(ckpt), good);
  fs::remove_all(dir);
}

TEST(Trainer, NonFiniteLossStopsNamingTheStepAndSavesNothing) {
  fs::path dir = scratch();
  TrainOptions o = tiny_options(dir);
  o.steps = 3;
  Trainer(o).run();
  const fs::path ckpt = fs::path(o.out_dir) / "checkpoint.safetensors";
  // Plant a NaN in one weight of the checkpoint, then resume: the next step must stop.
  SafetensorsFile f = load_safetensors(ckpt.string());
  f.tensors.at("model.norm.weight").ptr<float>()[3] = NAN;
  std::map<std::string, TensorView> views;
  for (auto& [n, t] : f.tensors) views[n] = t.view();
  save_safetensors(ckpt.string(), views, f.metadata);
  const std::string before = read_file(ckpt);
  TrainOptions r = o;
  r.steps = 6;
  r.resume = true;
  try {
    Trainer(r).run();
    FAIL() << "a NaN weight did not stop the run";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("step 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("non-finite"), std::string::npos) << msg;
    EXPECT_NE(msg.find("first non-finite tensor"), std::string::npos) << msg;
  }
  EXPECT_EQ(read_file(ckpt), before);
  fs::remove_all(dir);
}

// The step's statistics (losses, expert loads, the balance loss and its gradient) moved from the
// host to the device ops of the backend; the arithmetic must not change: the losses and gradient
// norms of 12 steps of tiny (2 micro-batches per step, the balance loss and the bias update on,
// one validation every 6 steps, the default corpus and seed) are those the trainer gave when the
// model computed them on the host, bit for bit, for the recipes whose experts run grouped over
// the device's layout (fp8), as segment GEMMs (bf16) and one MLP per expert (fp32).
TEST(Trainer, StepStatisticsOnTheDeviceKeepTheLossesBitIdentical) {
  struct Step {
    double loss, total_loss, balance_loss, grad_norm;
  };
  struct Run {
    const char* recipe;
    std::vector<Step> steps;
    double val5, val11;
  };
  const std::vector<Run> runs = {
      {"fp8",
       {
{0x1.8fd36e8000000p+2, 0x1.04761f2ca7dfap+3, 0x1.b4a5a56f83700p-13, 0x1.00b83f3b759e8p+2},
        {0x1.7a9753a600000p+2, 0x1.f08d1d6e2c722p+2, 0x1.bdf797712997bp-13, 0x1.dd5685fd383e5p+1},
        {0x1.6d35a7f200000p+2, 0x1.de68353a7a010p+2, 0x1.b61dd69a160e0p-13, 0x1.b23c08011f45ap+1},
        {0x1.62e5f98200000p+2, 0x1.d05829181b2b0p+2, 0x1.ba3df2c3cd972p-13, 0x1.9661988784865p+1},
        {0x1.54f06fc000000p+2, 0x1.bca0408d1b80cp+2, 0x1.c011386b065dep-13, 0x1.cb258107b0b2dp+1},
        {0x1.4e745f8800000p+2, 0x1.b389c4e97f600p+2, 0x1.c5a96f3af9e78p-13, 0x1.9b1a9a6362d75p+1},
        {0x1.44e4375c00000p+2, 0x1.a65df7f33551ep+2, 0x1.c6755b44f7d12p-13, 0x1.d0025d69038bfp+1},
        {0x1.4239c45800000p+2, 0x1.a2b656b1cd255p+2, 0x1.c4fa4f6939298p-13, 0x1.cb3093eb61f0dp+1},
        {0x1.3d6e6bd000000p+2, 0x1.9c3042f6dcae9p+2, 0x1.c4ce40046636cp-13, 0x1.bac339f263085p+1},
        {0x1.3a9228bc00000p+2, 0x1.986a26409d9a1p+2, 0x1.c515f7078c194p-13, 0x1.9402f6288e0f2p+1},
        {0x1.42b088bc00000p+2, 0x1.a362289d13c71p+2, 0x1.c5d2ac05a7f91p-13, 0x1.5d22662204108p+1},
        {0x1.2e2bd07400000p+2, 0x1.8884d87266778p+2, 0x1.c4e23f6c7e1e8p-13, 0x1.ae11e339052bfp+1}},
       0x1.4912ed8200000p+2, 0x1.352f1d6500000p+2},
      {"bf16",
       {
{0x1.8fe120ea00000p+2, 0x1.047cb05827d70p+3, 0x1.b45bd761eac9cp-13, 0x1.024cdae11397cp+2},
        {0x1.7aeb661600000p+2, 0x1.f0f5156b950c0p+2, 0x1.be721afb0a45ap-13, 0x1.e2bc04b75198fp+1},
        {0x1.6d595d3e00000p+2, 0x1.de9f4039a7b1ep+2, 0x1.b6a6aa6657f10p-13, 0x1.b0a7453d82280p+1},
        {0x1.6307541400000p+2, 0x1.d086ce7193615p+2, 0x1.bb3ef0b31838bp-13, 0x1.9632669dca860p+1},
        {0x1.553a186600000p+2, 0x1.bd0501ec4a7f9p+2, 0x1.c2c3c1498d044p-13, 0x1.cf2828c4a6167p+1},
        {0x1.4ec0622a00000p+2, 0x1.b3e8b2cb9065bp+2, 0x1.c5dc5cec262c3p-13, 0x1.9b4a4d4dcd88fp+1},
        {0x1.45196f2800000p+2, 0x1.a6ab98766f076p+2, 0x1.c807d38d6ff5ap-13, 0x1.d0295aebb5a6dp+1},
        {0x1.4290c94e00000p+2, 0x1.a32049ae05a8ep+2, 0x1.c55ef1c361276p-13, 0x1.bd87ae15827b4p+1},
        {0x1.3deb04b000000p+2, 0x1.9ccaa01e75c52p+2, 0x1.c43c1b30992a0p-13, 0x1.bdd77d3c27340p+1},
        {0x1.3b0ffde400000p+2, 0x1.98fdef51514aep+2, 0x1.c303ea798e89dp-13, 0x1.947e2ad9b476ap+1},
        {0x1.42d07f5000000p+2, 0x1.a38eb39027b89p+2, 0x1.c12f02cb33bb8p-13, 0x1.5d18e8a205ee2p+1},
        {0x1.2e72161a00000p+2, 0x1.88e1e460c8c78p+2, 0x1.c10ab4d8c4db2p-13, 0x1.aee3ac96afc0dp+1}},
       0x1.4946223d80000p+2, 0x1.3580699180000p+2},
      {"fp32",
       {
{0x1.8fe7292400000p+2, 0x1.047fd031d2ee0p+3, 0x1.b450e3ff1c774p-13, 0x1.023c022d604e0p+2},
        {0x1.7ae2a8d000000p+2, 0x1.f0eb90593c830p+2, 0x1.be200bf854740p-13, 0x1.e22e2e65ba854p+1},
        {0x1.6d51477c00000p+2, 0x1.de963391d0292p+2, 0x1.b66961fc2e998p-13, 0x1.b0dd2925104cfp+1},
        {0x1.6305573e00000p+2, 0x1.d083d6f2f73b1p+2, 0x1.bc11570b423a5p-13, 0x1.967efbc34eae9p+1},
        {0x1.552fdb4000000p+2, 0x1.bcfa323221afcp+2, 0x1.c1747e8ebbfc8p-13, 0x1.ced08b409f35dp+1},
        {0x1.4ea57f1e00000p+2, 0x1.b3cd85dafd91bp+2, 0x1.c6d8b46c306cep-13, 0x1.9b74c2745d06fp+1},
        {0x1.4552e3cc00000p+2, 0x1.a6e6b86259526p+2, 0x1.c8e3dc34267bap-13, 0x1.d0a09b10102b1p+1},
        {0x1.429e168200000p+2, 0x1.a32e9493fd414p+2, 0x1.c7583b94725bap-13, 0x1.b979d046b57d5p+1},
        {0x1.3dc7016e00000p+2, 0x1.9ca68cd55916ep+2, 0x1.c5535e868f006p-13, 0x1.bce525fe7d864p+1},
        {0x1.3ae9d91200000p+2, 0x1.98d47f007dfb8p+2, 0x1.c4080209eeacep-13, 0x1.9400a0057fdb5p+1},
        {0x1.42cb4b8c00000p+2, 0x1.a3867a35e6376p+2, 0x1.c40c1c8e4d036p-13, 0x1.5cf1ae23fe324p+1},
        {0x1.2e89a95a00000p+2, 0x1.88f7865240dd4p+2, 0x1.c35b36600057cp-13, 0x1.b2617b43b8b26p+1}},
       0x1.494cfb7200000p+2, 0x1.35872c9a80000p+2},
  };
  for (const Run& r : runs) {
    const fs::path dir = scratch() / r.recipe;
    fs::create_directories(dir);
    TrainOptions o;
    o.model_config = std::string(FP8MOE_SOURCE_DIR) + "/configs/tiny.json";
    o.recipe = r.recipe;
    o.backend = "cpu";
    o.out_dir = (dir / "run").string();
    o.overwrite = true;
    o.steps = 12;
    o.grad_accum = 2;
    o.eval_every = 6;
    o.ckpt_every = 0;
    o.quiet = true;
    Trainer(o).run();
    const auto m = read_metrics(o.out_dir);
    ASSERT_EQ(m.size(), r.steps.size()) << r.recipe;
    for (size_t i = 0; i < m.size(); ++i) {
      const Step& s = r.steps[i];
      EXPECT_EQ(m[i]["loss"].get<double>(), s.loss) << r.recipe << " step " << i;
      EXPECT_EQ(m[i]["total_loss"].get<double>(), s.total_loss) << r.recipe << " step " << i;
      EXPECT_EQ(m[i]["balance_loss"].get<double>(), s.balance_loss) << r.recipe << " step " << i;
      EXPECT_EQ(m[i]["grad_norm"].get<double>(), s.grad_norm) << r.recipe << " step " << i;
    }
    EXPECT_EQ(m[5]["val_loss"].get<double>(), r.val5) << r.recipe;
    EXPECT_EQ(m[11]["val_loss"].get<double>(), r.val11) << r.recipe;
  }
}
