// Training data: UTF-8 text as byte-level tokens (vocabulary 256), a deterministic held-out
// validation split, and a deterministic, resumable sampler of training windows.
//
// A path may be a file or a folder (all regular files below it, sorted by path; symbolic links and
// files that are not UTF-8 text, those holding NUL bytes or starting with a UTF-16 byte order
// mark, are skipped and listed by skipped()); a single file that is not text is refused. With no
// path the default corpus is used: the English fortunes of Debian's `fortunes` package
// (scripts/setup.sh installs it; `cmake --install` copies it beside the command).
// Split: the text is cut into 4 KiB chunks and every 20th chunk is held out for validation, so both
// splits cover the whole corpus.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace fp8moe {

constexpr int kByteVocab = 256;

class TextCorpus {
 public:
  // Loads `path` (file or folder); empty = default_corpus_path(). Raises fp8moe::Error naming
  // the path if nothing usable is found.
  explicit TextCorpus(const std::string& path = "");
  // The copy installed beside the command (share_dir()/data/fortunes) if there is one, else
  // Debian's /usr/share/games/fortunes.
  static std::string default_corpus_path();

  const std::vector<uint8_t>& train() const { return train_; }
  const std::vector<uint8_t>& validation() const { return val_; }
  const std::string& source() const { return source_; }
  size_t files() const { return files_; }
  const std::vector<std::string>& skipped() const { return skipped_; }  // files of a folder that are not text

 private:
  std::vector<uint8_t> train_, val_;
  std::string source_;
  size_t files_ = 0;
  std::vector<std::string> skipped_;
};

// Samples windows of `window` consecutive tokens (sequence length + the extra tokens that
// next-token and multi-token prediction targets need). One epoch visits every non-overlapping
// window start once, in an order shuffled by (seed, epoch); the state is two integers, so a
// checkpoint resumes the exact same stream.
class WindowSampler {
 public:
  struct State {
    uint64_t epoch = 0;
    uint64_t index = 0;  // windows already taken in this epoch
  };

  WindowSampler(const std::vector<uint8_t>& tokens, int window, uint64_t seed);
  // Fills out [batch, window] int32 token ids.
  void next(int batch, std::vector<int32_t>& out);
  State state() const { return state_; }
  void set_state(State s);
  size_t windows_per_epoch() const { return order_.size(); }

 private:
  void shuffle();
  const std::vector<uint8_t>& tokens_;
  int window_;
  uint64_t seed_;
  State state_;
  std::vector<uint64_t> order_;  // window start offsets, shuffled for state_.epoch
};

// Deterministic evaluation batches: the first `batches` x `batch` windows of `tokens`, evenly
// spaced. Fills out [batches * batch, window].
void evaluation_windows(const std::vector<uint8_t>& tokens, int window, int batch, int batches, std::vector<int32_t>& out);

}  // namespace fp8moe
