// Byte-level text corpus, validation split and resumable window sampler (include/fp8moe/data.hpp).
#include "fp8moe/data.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "fp8moe/error.hpp"
#include "fp8moe/paths.hpp"

namespace fp8moe {

namespace fs = std::filesystem;

namespace {
constexpr size_t kChunk = 4096;
constexpr size_t kValidationEvery = 20;

// Appends the file to `out` when it is text; otherwise returns why not. UTF-16 (with or without a
// byte order mark) and binary files (e.g. fortune's .dat indexes) hold NUL bytes or start with a
// UTF-16 byte order mark; as bytes they would train the model on noise.
std::string read_text_file(const fs::path& p, std::string& out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return "cannot be read";
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (s.size() >= 2 && ((uint8_t(s[0]) == 0xFF && uint8_t(s[1]) == 0xFE) || (uint8_t(s[0]) == 0xFE && uint8_t(s[1]) == 0xFF)))
    return "is UTF-16 text (byte order mark); convert it to UTF-8, e.g. iconv -f UTF-16 -t UTF-8";
  if (const size_t nul = s.find('\0'); nul != std::string::npos)
    return "holds a NUL byte at offset " + std::to_string(nul) + ": binary, or UTF-16 without a byte order mark";
  out += s;
  if (!s.empty() && s.back() != '\n') out += '\n';
  return "";
}
}  // namespace

std::string TextCorpus::default_corpus_path() {
  const fs::path share = share_dir();
  std::error_code ec;
  if (!share.empty() && fs::is_directory(share / "data" / "fortunes", ec)) return (share / "data" / "fortunes").string();
  return "/usr/share/games/fortunes";
}

TextCorpus::TextCorpus(const std::string& path) : source_(path.empty() ? default_corpus_path() : path) {
  std::string text;
  const fs::path root(source_);
  FP8MOE_CHECK(fs::exists(root), "data: '" << source_ << "' does not exist"
                                           << (path.empty() ? " (the default corpus: run scripts/setup.sh, "
                                                              "which installs Debian's fortunes package)"
                                                            : ""));
  if (fs::is_directory(root)) {
    std::vector<fs::path> paths;
    for (auto& e : fs::recursive_directory_iterator(root))
      if (e.is_regular_file() && !e.is_symlink()) paths.push_back(e.path());
    std::sort(paths.begin(), paths.end());
    for (auto& p : paths) {
      if (read_text_file(p, text).empty()) {
        ++files_;
      } else {
        skipped_.push_back(p.string());
      }
    }
  } else {
    const std::string why = read_text_file(root, text);
    FP8MOE_CHECK(why.empty(), "data: '" << source_ << "' " << why << "; fp8moe trains on UTF-8 text");
    files_ = 1;
  }
  FP8MOE_CHECK(text.size() >= 2 * kChunk * kValidationEvery,
               "data: '" << source_ << "' holds " << text.size() << " bytes of text in " << files_ << " files"
                         << (skipped_.empty() ? "" : " (" + std::to_string(skipped_.size()) + " more are not text)")
                         << "; at least " << 2 * kChunk * kValidationEvery << " are needed");
  for (size_t c = 0; c * kChunk < text.size(); ++c) {
    auto& dst = (c % kValidationEvery == kValidationEvery - 1) ? val_ : train_;
    size_t end = std::min(text.size(), (c + 1) * kChunk);
    dst.insert(dst.end(), text.begin() + long(c * kChunk), text.begin() + long(end));
  }
}

WindowSampler::WindowSampler(const std::vector<uint8_t>& tokens, int window, uint64_t seed)
    : tokens_(tokens), window_(window), seed_(seed) {
  FP8MOE_CHECK(window >= 2, "sampler: window must be >= 2, got " << window);
  FP8MOE_CHECK(tokens.size() >= size_t(window), "sampler: " << tokens.size() << " tokens, fewer than one window of " << window);
  shuffle();
}

void WindowSampler::shuffle() {
  const size_t n = (tokens_.size() - size_t(window_)) / size_t(window_) + 1;
  order_.resize(n);
  for (size_t i = 0; i < n; ++i) order_[i] = i * size_t(window_);
  // NOTES: a self-contained Fisher-Yates over splitmix64, so the stream is the same on every
  // platform and standard library (std::shuffle's algorithm is unspecified).
  uint64_t x = seed_ * 0x9E3779B97F4A7C15ull + state_.epoch + 1;
  auto next = [&x] {
    uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (size_t i = n - 1; i > 0; --i) std::swap(order_[i], order_[next() % (i + 1)]);
}

void WindowSampler::next(int batch, std::vector<int32_t>& out) {
  out.resize(size_t(batch) * size_t(window_));
  for (int b = 0; b < batch; ++b) {
    if (state_.index == order_.size()) {
      ++state_.epoch;
      state_.index = 0;
      shuffle();
    }
    const uint64_t start = order_[state_.index++];
    for (int t = 0; t < window_; ++t) out[size_t(b) * size_t(window_) + size_t(t)] = tokens_[start + size_t(t)];
  }
}

void WindowSampler::set_state(State s) {
  const uint64_t epoch = state_.epoch;
  state_ = s;
  if (s.epoch != epoch) shuffle();
  FP8MOE_CHECK(s.index <= order_.size(), "sampler: state index " << s.index << " beyond the epoch's " << order_.size() << " windows");
}

void evaluation_windows(const std::vector<uint8_t>& tokens, int window, int batch, int batches, std::vector<int32_t>& out) {
  const size_t n = size_t(batch) * size_t(batches);
  FP8MOE_CHECK(tokens.size() >= size_t(window), "evaluation: " << tokens.size() << " tokens, fewer than one window");
  const size_t span = tokens.size() - size_t(window);
  out.resize(n * size_t(window));
  for (size_t i = 0; i < n; ++i) {
    const size_t start = n == 1 ? 0 : span * i / (n - 1);
    for (int t = 0; t < window; ++t) out[i * size_t(window) + size_t(t)] = tokens[start + size_t(t)];
  }
}

}  // namespace fp8moe
