// fp8moe errors: every bad argument raises fp8moe::Error with a message that names the argument
// and what was expected. Use FP8MOE_CHECK(cond, "what" << value) in library code. Two kinds are
// told apart because the command reports them with their own exit codes: IoError, a file or
// folder that cannot be created, written or renamed (the input was fine, the system refused), and
// Interrupted, a run stopped by Ctrl-C after saving its state.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace fp8moe {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class IoError : public Error {
 public:
  using Error::Error;
};

class Interrupted : public Error {
 public:
  using Error::Error;
};

}  // namespace fp8moe

#define FP8MOE_CHECK(cond, msg)                                                         \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::ostringstream fp8moe_check_os_;                                              \
      fp8moe_check_os_ << msg;                                                          \
      throw ::fp8moe::Error(fp8moe_check_os_.str());                                    \
    }                                                                                   \
  } while (0)
