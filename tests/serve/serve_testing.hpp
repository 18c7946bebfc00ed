// The backend the serve tests run on: FP8MOE_SERVE_BACKEND (cpu, cuda, cublaslt), cpu by default.
#pragma once
#include <cstdlib>
#include <string>

namespace fp8moe::serve::testing_env {

inline std::string backend_name() {
  const char* b = std::getenv("FP8MOE_SERVE_BACKEND");
  return b ? b : "cpu";
}

}  // namespace fp8moe::serve::testing_env
