// Text corpus, split and sampler: deterministic, resumable, every window once per epoch.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "fp8moe/data.hpp"
#include "fp8moe/error.hpp"

using namespace fp8moe;
namespace fs = std::filesystem;

namespace {
fs::path make_corpus(size_t bytes) {
  fs::path d = fs::temp_directory_path() / ("fp8moe_data_" + std::to_string(::getpid()));
  fs::create_directories(d / "sub");
  std::ofstream a(d / "a.txt"), b(d / "sub" / "b.txt");
  for (size_t i = 0; i < bytes / 2; ++i) a << char('a' + i % 26);
  for (size_t i = 0; i < bytes / 2; ++i) b << char('A' + i % 26);
  std::ofstream bin(d / "index.dat", std::ios::binary);
  bin << std::string("\0\1\2", 3);
  return d;
}
}  // namespace

TEST(Data, FolderCorpusSplitsDeterministically) {
  fs::path d = make_corpus(400000);
  TextCorpus c(d.string());
  EXPECT_EQ(c.files(), 2u);  // the binary file is skipped
  const size_t total = c.train().size() + c.validation().size();
  EXPECT_EQ(total, 400000u + 2);  // newline appended to each file
  EXPECT_NEAR(double(c.validation().size()) / double(total), 0.05, 0.01);
  TextCorpus again(d.string());
  EXPECT_EQ(again.train(), c.train());
  EXPECT_EQ(again.validation(), c.validation());
  fs::remove_all(d);
}

TEST(Data, SamplerVisitsEveryWindowOncePerEpochAndResumes) {
  std::vector<uint8_t> tokens(10000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint8_t(i * 7);
  WindowSampler s(tokens, 65, 42);
  const size_t n = s.windows_per_epoch();
  EXPECT_EQ(n, (10000 - 65) / 65 + 1);
  std::set<std::vector<int32_t>> seen;
  std::vector<int32_t> batch;
  for (size_t i = 0; i < n; ++i) {
    s.next(1, batch);
    seen.insert(batch);
  }
  EXPECT_EQ(seen.size(), n);
  // Resume: a sampler restored from a state yields the same stream as the original.
  WindowSampler a(tokens, 65, 42), b(tokens, 65, 42);
  std::vector<int32_t> x, y;
  for (int i = 0; i < 200; ++i) a.next(4, x);  // crosses an epoch boundary
  b.set_state(a.state());
  for (int i = 0; i < 50; ++i) {
    a.next(4, x);
    b.next(4, y);
    ASSERT_EQ(x, y) << i;
  }
  // Another seed gives another order.
  WindowSampler c(tokens, 65, 43), d2(tokens, 65, 42);
  c.next(8, x);
  d2.next(8, y);
  EXPECT_NE(x, y);
}

TEST(Data, MissingOrTinyCorpusIsRefused) {
  EXPECT_THROW(TextCorpus("/nonexistent/corpus"), Error);
  fs::path d = make_corpus(1000);
  try {
    TextCorpus c(d.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at least"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}
