// arena.hpp — carves a pass's scratch out of one block (the caller's workspace or one allocation).
// The same layout code runs twice: once with a null base to measure the size, once to hand out pointers.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flare::cpu::FLARE_ISA {

class Arena {
 public:
  // base is rounded up to 64 bytes; used() includes that slack.
  explicit Arena(void* base = nullptr)
      : base_(base ? reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + 63) / 64 * 64) : nullptr) {}

  // n elements of T, 64-byte aligned (a cache line; also the widest vector).
  template <class T>
  T* take(int64_t n) {
    used_ = (used_ + 63) / 64 * 64;
    T* out = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += static_cast<size_t>(n) * sizeof(T);
    return out;
  }
  size_t used() const { return used_ + 64; }  // + alignment slack for an unaligned base

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace flare::cpu::FLARE_ISA
