// error.cpp — the thread-local error text behind flare_last_error().
#include "common/error.hpp"

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

std::string dtype_name(int32_t dtype) {
  switch (dtype) {
    case FLARE_DTYPE_F32: return "F32";
    case FLARE_DTYPE_F16: return "F16";
    case FLARE_DTYPE_BF16: return "BF16";
    case FLARE_DTYPE_F64: return "F64";
    case FLARE_DTYPE_I32: return "I32";
    case FLARE_DTYPE_E4M3: return "E4M3";
    default: return cat("dtype ", dtype);
  }
}

}  // namespace flare::detail
