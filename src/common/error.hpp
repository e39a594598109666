// error.hpp — the thread-local error text behind flare_last_error(), and the helpers that compose it.
// Neutral ground: the api layer and every backend include it (backends never include src/api).
#pragma once

#include <cstdint>
#include <sstream>
#include <string>

#include "flare/flare.h"

namespace flare::detail {

// Stores message as this thread's last error and returns status, so callers can `return fail(...)`.
flare_status fail(flare_status status, std::string message);
// Clears the last error (called at the start of every entry point).
void clear_error();
const char* last_error();

// "F32", "BF16", ...; "dtype 17" for a value outside flare_dtype.
std::string dtype_name(int32_t dtype);

// Concatenates anything streamable into one message.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace flare::detail
