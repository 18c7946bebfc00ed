// Where the fp8moe command finds what ships with it (model configs, the default corpus) from any
// working folder: <prefix>/share/fp8moe beside <prefix>/bin/fp8moe. `cmake --install` lays out the
// prefix so; the build tree has the same shape (build/bin/fp8moe, build/share/fp8moe linking to
// the sources' configs/), so one rule serves both.
//   fp8moe::share_dir() / "configs" / "tiny.json"
#pragma once
#include <filesystem>

namespace fp8moe {

// The running executable (/proc/self/exe); empty when it cannot be read.
std::filesystem::path executable_path();
// <executable's folder>/../share/fp8moe when that folder exists, else empty.
std::filesystem::path share_dir();

}  // namespace fp8moe
