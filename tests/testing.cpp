// Shared test helpers (see testing.hpp).
#include "testing.hpp"

#include <unistd.h>

#include <fstream>
#include <iterator>

#include "fp8moe/error.hpp"
#include "fp8moe/quantize.hpp"

namespace fp8moe::testing {

Tensor random_normal(std::mt19937_64& rng, DType dtype, std::initializer_list<int64_t> shape, float stddev) {
  Tensor t = Tensor::host(dtype, shape);
  std::normal_distribution<float> dist(0.0f, stddev);
  for (int64_t i = 0; i < t.numel(); ++i) store_float(t.view(), i, dist(rng));
  return t;
}

void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error, expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

std::vector<double> to_doubles(const TensorView& t) {
  std::vector<double> out(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) out[size_t(i)] = load_float(t, i);
  return out;
}

std::filesystem::path test_dir(const std::string& prefix) {
  const std::filesystem::path d = std::filesystem::temp_directory_path() /
                                  (prefix + "_" + std::to_string(::getpid()) + "_" +
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace fp8moe::testing
