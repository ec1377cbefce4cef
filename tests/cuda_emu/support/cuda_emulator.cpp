// The CUDA emulator's scheduler (see cuda_emulator.h): fibers on ucontext,
// block and warp barriers, warp exchanges.
#include "cuda_emulator.h"

#include <ucontext.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <memory>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define FA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FA_EMU_ASAN 1
#endif
#endif
#ifdef FA_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

namespace fastattn::cuda::emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

struct Barrier {
  int expected = 0;
  int arrived = 0;
  uint64_t generation = 0;
};

struct Fiber {
  ucontext_t context;
  uint3 tid;
  int linear = 0;
  bool done = false;
  // Where the fiber waits: nullptr when runnable, else the barrier and the
  // generation it waits to end.
  Barrier* waiting_on = nullptr;
  uint64_t wait_generation = 0;
  const char* wait_what = "";
};

struct BlockState {
  dim3 grid, block;
  uint3 bid;
  int num_threads = 0;
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;
  ucontext_t scheduler;
  Fiber* current = nullptr;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<uint64_t> warp_slots;  // 32 per warp
  std::vector<float> wmma_scratch;   // 768 per warp
  std::vector<unsigned char> shared;
  const Body* body = nullptr;
#ifdef FA_EMU_ASAN
  const void* main_stack_bottom = nullptr;
  size_t main_stack_size = 0;
#endif
};

thread_local BlockState* g_block = nullptr;
thread_local dim3 g_block_dim, g_grid_dim;

BlockState& state() {
  if (!g_block) fail("a CUDA device function was called outside an emulated launch");
  return *g_block;
}

std::string where() {
  if (!g_block || !g_block->current) return "";
  const auto& b = *g_block;
  const auto& t = b.current->tid;
  return " (block (" + std::to_string(b.bid.x) + ", " + std::to_string(b.bid.y) + ", " +
         std::to_string(b.bid.z) + "), thread (" + std::to_string(t.x) + ", " +
         std::to_string(t.y) + ", " + std::to_string(t.z) + "))";
}

// Back to the scheduler; returns when this fiber is resumed.
void yield() {
  auto& b = state();
  Fiber* f = b.current;
#ifdef FA_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, b.main_stack_bottom, b.main_stack_size);
#endif
  swapcontext(&f->context, &b.scheduler);
#ifdef FA_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void arrive_and_wait(Barrier& bar, const char* what) {
  auto& b = state();
  Fiber* f = b.current;
  const uint64_t gen = bar.generation;
  if (++bar.arrived == bar.expected) {
    bar.arrived = 0;
    ++bar.generation;
    return;
  }
  f->waiting_on = &bar;
  f->wait_generation = gen;
  f->wait_what = what;
  while (bar.generation == gen) yield();
  f->waiting_on = nullptr;
}

void fiber_entry() {
  auto& b = state();
#ifdef FA_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b.main_stack_bottom, &b.main_stack_size);
#endif
  (*b.body)();
  b.current->done = true;
#ifdef FA_EMU_ASAN
  __sanitizer_start_switch_fiber(nullptr, b.main_stack_bottom, b.main_stack_size);
#endif
  setcontext(&b.scheduler);
}

void run_block(BlockState& b) {
  const int n = b.num_threads;
  const int warps = (n + 31) / 32;
  b.block_barrier = Barrier{n, 0, 0};
  b.warp_barriers.assign(warps, Barrier{});
  for (int w = 0; w < warps; ++w) b.warp_barriers[w].expected = std::min(32, n - 32 * w);
  b.warp_slots.assign(static_cast<size_t>(warps) * 32, 0);
  b.wmma_scratch.assign(static_cast<size_t>(warps) * 768, 0.f);
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.done = false;
    f.waiting_on = nullptr;
    f.linear = i;
    f.tid = uint3{static_cast<unsigned>(i % b.block.x),
                  static_cast<unsigned>((i / b.block.x) % b.block.y),
                  static_cast<unsigned>(i / (b.block.x * b.block.y))};
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = b.stacks[i].get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
  }
  // Alternate the order threads run in between blocks (see the header).
  const bool reverse = ((b.bid.x + b.bid.y + b.bid.z) & 1) != 0;
  int alive = n;
  while (alive > 0) {
    bool progressed = false;
    for (int k = 0; k < n; ++k) {
      Fiber& f = b.fibers[reverse ? n - 1 - k : k];
      if (f.done) continue;
      if (f.waiting_on && f.waiting_on->generation == f.wait_generation) continue;
      b.current = &f;
#ifdef FA_EMU_ASAN
      void* fake = nullptr;
      __sanitizer_start_switch_fiber(&fake, b.stacks[f.linear].get(), kStackBytes);
#endif
      swapcontext(&b.scheduler, &f.context);
#ifdef FA_EMU_ASAN
      __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
      b.current = nullptr;
      progressed = true;
      if (f.done) --alive;
    }
    if (!progressed) {
      // Everyone left waits at a barrier that can no longer open.
      for (auto& f : b.fibers) {
        if (f.done) continue;
        b.current = &f;
        const std::string at = where();
        b.current = nullptr;
        fail(std::string("deadlock: ") + f.wait_what +
             " waits for threads that exited or wait elsewhere" + at);
      }
    }
  }
}

}  // namespace

void fail(const std::string& what) {
  std::fprintf(stderr, "fastattn CUDA emulator: %s%s\n", what.c_str(), where().c_str());
  std::fflush(stderr);
  std::abort();
}

const uint3& thread_idx() { return state().current->tid; }
const uint3& block_idx() { return state().bid; }
const dim3& block_dim() { return g_block_dim; }
const dim3& grid_dim() { return g_grid_dim; }
void* dynamic_shared() { return state().shared.data(); }
int lane_id() { return state().current->linear % 32; }

void sync_threads() { arrive_and_wait(state().block_barrier, "__syncthreads"); }

void sync_warp() {
  auto& b = state();
  arrive_and_wait(b.warp_barriers[b.current->linear / 32], "a warp-wide operation");
}

uint64_t warp_exchange(uint64_t mine, int src) {
  auto& b = state();
  const int warp = b.current->linear / 32;
  const int width = b.warp_barriers[warp].expected;
  uint64_t* slots = b.warp_slots.data() + static_cast<size_t>(warp) * 32;
  slots[lane_id()] = mine;
  sync_warp();
  const uint64_t got = (src >= 0 && src < width) ? slots[src] : mine;
  sync_warp();
  return got;
}

void warp_gather(uint64_t mine, uint64_t out[32]) {
  auto& b = state();
  const int warp = b.current->linear / 32;
  const int width = b.warp_barriers[warp].expected;
  uint64_t* slots = b.warp_slots.data() + static_cast<size_t>(warp) * 32;
  slots[lane_id()] = mine;
  sync_warp();
  for (int l = 0; l < 32; ++l) out[l] = l < width ? slots[l] : 0;
  sync_warp();
}

float* warp_scratch() {
  auto& b = state();
  return b.wmma_scratch.data() + static_cast<size_t>(b.current->linear / 32) * 768;
}

namespace {
std::atomic<int> g_device_arch{90}, g_kernel_arch{90};
}  // namespace

int device_arch() { return g_device_arch.load(); }
int kernel_arch() { return g_kernel_arch.load(); }
void set_architecture(int device, int kernel) {
  g_device_arch.store(device);
  g_kernel_arch.store(kernel);
}

namespace {
constexpr size_t kDefaultDynamicShared = 48 * 1024, kMaxDynamicShared = 227 * 1024;
std::mutex g_attr_mutex;
std::map<const void*, size_t> g_max_dynamic_shared;
}  // namespace

void set_max_dynamic_shared_for(const void* kernel, size_t bytes) {
  if (bytes > kMaxDynamicShared)
    fail("cudaFuncSetAttribute: " + std::to_string(bytes) +
         " bytes of dynamic shared memory (an H100 allows 227 KiB)");
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_max_dynamic_shared[kernel] = bytes;
}

void launch(dim3 grid, dim3 block, size_t shared_bytes, const void* kernel, const Body& body) {
  if (g_block) fail("nested kernel launch");
  if (shared_bytes > kDefaultDynamicShared) {
    std::lock_guard<std::mutex> lock(g_attr_mutex);
    const auto it = g_max_dynamic_shared.find(kernel);
    const size_t allowed = it == g_max_dynamic_shared.end() ? kDefaultDynamicShared : it->second;
    if (shared_bytes > allowed)
      fail("launch with " + std::to_string(shared_bytes) +
           " bytes of dynamic shared memory; the kernel allows " + std::to_string(allowed) +
           " (FA_SET_MAX_DYNAMIC_SHARED first)");
  }
  const uint64_t n = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (n == 0 || n > 1024) fail("block of " + std::to_string(n) + " threads (1 to 1024 allowed)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) fail("empty grid");
  if (grid.y > 65535 || grid.z > 65535) fail("grid.y and grid.z must be <= 65535");
  BlockState b;
  b.grid = grid;
  b.block = block;
  b.num_threads = static_cast<int>(n);
  b.fibers.resize(n);
  b.stacks.resize(n);
  for (auto& s : b.stacks) s.reset(new char[kStackBytes]);
  b.shared.assign(shared_bytes, 0);  // exact: AddressSanitizer sees overruns
  b.body = &body;
  g_block_dim = block;
  g_grid_dim = grid;
  g_block = &b;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.bid = uint3{x, y, z};
        run_block(b);
      }
  g_block = nullptr;
}

}  // namespace fastattn::cuda::emu

unsigned __ballot_sync(unsigned mask, int predicate) {
  namespace e = ::fastattn::cuda::emu;
  e::check_full_mask(mask, "__ballot_sync");
  uint64_t all[32];
  e::warp_gather(static_cast<uint64_t>(predicate != 0), all);
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= static_cast<unsigned>(all[l]) << l;
  return bits;
}
