// The executable's share folder (include/fp8moe/paths.hpp).
#include "fp8moe/paths.hpp"

#include <system_error>

namespace fp8moe {

namespace fs = std::filesystem;

fs::path executable_path() {
  std::error_code ec;
  fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : p;
}

fs::path share_dir() {
  const fs::path exe = executable_path();
  if (exe.empty()) return {};
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(exe.parent_path() / ".." / "share" / "fp8moe", ec);
  return !ec && fs::is_directory(dir, ec) ? dir : fs::path();
}

}  // namespace fp8moe
