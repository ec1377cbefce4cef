// Large scratch arrays of the CPU kernels (packed key and value panels,
// ordered copies, Reformer's normalised keys, partial gradients), each as
// large as an operand: 32 MiB at L = 16384, H = 8, E = 64. They come from
// hooks the op layer installs (src/ops/op_util.cpp: its output cache, so
// that a loop does not fault in and clear fresh pages at every call), else
// from operator new. Kernels stay free of LibTorch.
#pragma once

#include <cstddef>
#include <utility>

namespace fastattn::kernels {

struct ScratchHooks {
  void* (*take)(std::size_t bytes) = nullptr;  // throws when out of memory
  void (*give)(void* p, std::size_t bytes) = nullptr;
};
// Installed once, at load, by the op layer; null members: operator new / delete.
void set_scratch_hooks(ScratchHooks hooks);
void* take_scratch(std::size_t bytes);
void give_scratch(void* p, std::size_t bytes);

// An owning array of n uninitialised T (float, double, int64_t), as
// std::unique_ptr<T[]> with new T[n].
template <typename T>
class ScratchArray {
 public:
  ScratchArray() = default;
  explicit ScratchArray(std::size_t n) { reset(n); }
  ScratchArray(ScratchArray&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  ScratchArray& operator=(ScratchArray&& o) noexcept {
    if (this != &o) {
      release();
      p_ = std::exchange(o.p_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ScratchArray(const ScratchArray&) = delete;
  ScratchArray& operator=(const ScratchArray&) = delete;
  ~ScratchArray() { release(); }

  void reset(std::size_t n) {
    release();
    bytes_ = (n > 0 ? n : 1) * sizeof(T);
    p_ = static_cast<T*>(take_scratch(bytes_));
  }
  T* get() const { return p_; }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  void release() {
    if (p_) give_scratch(p_, bytes_);
    p_ = nullptr;
    bytes_ = 0;
  }
  T* p_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace fastattn::kernels
