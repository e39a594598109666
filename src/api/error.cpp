// error.cpp — the thread-local error text behind flare_last_error().
#include "api/error.hpp"

#include <utility>

namespace flare::detail {
namespace {
thread_local std::string t_last_error;
}

flare_status fail(flare_status status, std::string message) {
  t_last_error = std::move(message);
  return status;
}

void clear_error() { t_last_error.clear(); }

const char* last_error() { return t_last_error.c_str(); }

}  // namespace flare::detail
