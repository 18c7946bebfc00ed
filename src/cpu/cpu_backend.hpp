// The CPU backend: every op in plain C++ + OpenMP; the executable specification of fp8moe.
#pragma once
#include <memory>

#include "fp8moe/backend.hpp"

namespace fp8moe {

std::unique_ptr<Backend> make_cpu_backend();

}  // namespace fp8moe
