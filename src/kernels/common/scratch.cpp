// The kernels' scratch allocation hooks (see scratch.h). Compiled once, at
// the default level, with cpu_isa.cpp.
#include "kernels/common/scratch.h"

#include <new>

namespace fastattn::kernels {
namespace {
ScratchHooks g_hooks;  // constant-initialised: safe before any static constructor runs
}  // namespace

void set_scratch_hooks(ScratchHooks hooks) { g_hooks = hooks; }

void* take_scratch(std::size_t bytes) {
  return g_hooks.take ? g_hooks.take(bytes) : ::operator new(bytes);
}

void give_scratch(void* p, std::size_t bytes) {
  if (g_hooks.give) {
    g_hooks.give(p, bytes);
  } else {
    ::operator delete(p);
  }
}

}  // namespace fastattn::kernels
