// arena.hpp — carves a pass's scratch out of one block (the caller's workspace or one allocation).
// The same layout code runs twice: once with a null base to measure the size, once to hand out pointers.
// The measuring run is checked: a layout whose size does not fit in size_t reports kOverflow, and the
// backend refuses the call (dispatch.cpp) before the second run could hand out wrapped-around pointers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flare::cpu::FLARE_ISA {

class Arena {
 public:
  static constexpr size_t kOverflow = SIZE_MAX;  // what used() reports for a size past size_t

  // base is rounded up to 64 bytes; used() includes that slack.
  explicit Arena(void* base = nullptr)
      : base_(base ? reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + 63) / 64 * 64) : nullptr) {}

  // n elements of T, 64-byte aligned (a cache line; also the widest vector).
  template <class T>
  T* take(int64_t n) {
    size_t bytes = 0, start = 0;
    if (n < 0 || __builtin_mul_overflow(static_cast<size_t>(n), sizeof(T), &bytes) ||
        __builtin_add_overflow(used_, size_t{63}, &start)) {
      used_ = kOverflow;
      return nullptr;
    }
    start = start / 64 * 64;
    if (__builtin_add_overflow(start, bytes, &used_)) used_ = kOverflow;
    return base_ && used_ != kOverflow ? reinterpret_cast<T*>(base_ + start) : nullptr;
  }
  // Bytes taken, + alignment slack for an unaligned base; kOverflow when that does not fit in size_t.
  size_t used() const { return used_ > kOverflow - 64 ? kOverflow : used_ + 64; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace flare::cpu::FLARE_ISA
