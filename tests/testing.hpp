// Shared test helpers: seeded random inputs (fresh each run, seed printed, FP8MOE_SEED=<n> to
// replay), the similarity measures (fp8moe/similarity.hpp) and error expectations.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <random>
#include <vector>

#include "fp8moe/similarity.hpp"
#include "fp8moe/tensor.hpp"

namespace fp8moe::testing {

// A generator seeded from FP8MOE_SEED or std::random_device; the seed is printed so a failure
// can be replayed.
inline std::mt19937_64 make_rng() {
  uint64_t seed;
  if (const char* s = std::getenv("FP8MOE_SEED")) {
    seed = std::strtoull(s, nullptr, 10);
  } else {
    seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  }
  std::cout << "[ seed     ] FP8MOE_SEED=" << seed << "  ("
            << ::testing::UnitTest::GetInstance()->current_test_info()->name() << ")\n";
  return std::mt19937_64(seed);
}

// Host tensor filled with N(0, stddev) (f32, or bf16 rounded).
Tensor random_normal(std::mt19937_64& rng, DType dtype, std::initializer_list<int64_t> shape, float stddev = 1.0f);

using fp8moe::calc_diff;  // fp8moe/similarity.hpp
using fp8moe::rel_error;
// Runs fn and expects an fp8moe::Error whose message contains `needle`.
void expect_error(const std::function<void()>& fn, const std::string& needle);

// All elements of a tensor as doubles.
std::vector<double> to_doubles(const TensorView& t);

// An empty folder of its own for the running test: <tmp>/<prefix>_<pid>_<test name>, emptied first.
std::filesystem::path test_dir(const std::string& prefix);
// The bytes of a file.
std::string read_file(const std::filesystem::path& p);

}  // namespace fp8moe::testing
