// error.hpp — the thread-local error text behind flare_last_error().
#pragma once

#include <string>

#include "flare/flare.h"

namespace flare::detail {

// Stores message as this thread's last error and returns status, so callers can `return fail(...)`.
flare_status fail(flare_status status, std::string message);
// Clears the last error (called at the start of every entry point).
void clear_error();
const char* last_error();

}  // namespace flare::detail
