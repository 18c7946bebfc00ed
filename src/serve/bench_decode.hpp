// `fp8moe bench decode`: whole decode steps of a model with random weights at several batch
// sizes over a cache already `context` tokens deep, against the step's roofline: the bytes a
// step must read (the Linear weights in their format, the experts the batch touches, the head,
// the absorption's W_UK/W_UV, every sequence's cached latents) over the measured device copy
// bandwidth (read + write of a large buffer).
//   fp8moe bench decode --config configs/1b.json --batch 1,32,256 --context 512 --linear fp8 --cache fp8
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "fp8moe/backend.hpp"

namespace fp8moe::serve {

struct DecodeBenchOptions {
  std::string config = "configs/tiny.json";
  std::vector<int64_t> batches{1, 32, 256};
  int64_t context = 512;
  std::string linear = "fp8", cache = "fp8";
  int iters = 5;
  bool shared_as_routed = false;
  bool graphs = true;  // EngineOptions::graphs
};

// Prints one row per batch size; returns 0.
int bench_decode(Backend& be, const DecodeBenchOptions& opt);

}  // namespace fp8moe::serve
