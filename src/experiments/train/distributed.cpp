// Data-parallel training over c10d (include/fastattn/experiments/distributed.h): TCPStore
// rendezvous, a Gloo process group (NCCL when built for CUDA), bucketed
// gradient all-reduce launched from autograd hooks, and the small collectives
// the Trainer needs (loss mean, stop flag, generator states for checkpoints).
//
// Cost per step: one all-reduce of the parameters' gradients (in buckets of
// bucket_mb, ring algorithm: about 2·(W-1)/W of the gradient bytes sent per
// rank), plus two all-reduces of a few bytes (stop flag, loss).
// Tests: tests/cli/test_distributed.sh (ctest -R distributed_tests).
//
// LibTorch versions: 1.13 derives ProcessGroupGloo from c10d::ProcessGroup;
// 2.x splits ProcessGroup (a dispatcher front) from c10d::Backend, which
// ProcessGroupGloo/NCCL derive from. The calls used here (constructor,
// Options::create(timeout), allreduce/broadcast/allgather/barrier returning
// c10d::Work) are the same on both; only the base class name differs.
#include "fastattn/experiments/distributed.h"

#include <torch/version.h>

#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <sstream>

#ifdef FASTATTN_WITH_GLOO
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif
#ifdef FASTATTN_WITH_NCCL
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace fastattn::train {

bool distributed_available(const std::string& backend) {
#ifdef FASTATTN_WITH_GLOO
  if (backend == "gloo") return true;
#endif
#ifdef FASTATTN_WITH_NCCL
  if (backend == "nccl") return true;
#endif
  return false;
}

namespace {

int64_t env_int(const char* name, int64_t lo, int64_t hi, const char* what) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v != nullptr && *v != '\0', "distributed: WORLD_SIZE is set but ", name,
              " is not; set ", name, " (", what, ") on every process (torchrun sets it)");
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v, &end, 10);
  TORCH_CHECK(end != v && *end == '\0' && errno == 0 && x >= lo && x <= hi, "distributed: ", name,
              " must be an integer in [", lo, ", ", hi, "] (", what, "), got '", v, "'");
  return x;
}

// c10::Error::what() carries a backtrace; the first part is the message.
std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

bool dist_options_from_env(DistOptions& o) {
  const char* ws = std::getenv("WORLD_SIZE");
  if (ws == nullptr || *ws == '\0') return false;
  o.world_size = env_int("WORLD_SIZE", 1, 1 << 20, "number of processes");
  o.rank = env_int("RANK", 0, o.world_size - 1, "this process's rank, 0..WORLD_SIZE-1");
  o.local_rank =
      std::getenv("LOCAL_RANK") ? env_int("LOCAL_RANK", 0, 1 << 20, "rank on this node") : o.rank;
  if (o.world_size > 1) {
    const char* addr = std::getenv("MASTER_ADDR");
    TORCH_CHECK(addr != nullptr && *addr != '\0',
                "distributed: WORLD_SIZE is set but MASTER_ADDR is not; set MASTER_ADDR (the "
                "address of rank 0) on every process (torchrun sets it)");
    o.master_addr = addr;
    o.master_port = env_int("MASTER_PORT", 1, 65535, "rank 0's TCP port for the rendezvous");
  }
  return true;
}

// ---- implementation ---------------------------------------------------------------

#if defined(FASTATTN_WITH_GLOO) || defined(FASTATTN_WITH_NCCL)
#if TORCH_VERSION_MAJOR >= 2
using GroupBase = c10d::Backend;
#else
using GroupBase = c10d::ProcessGroup;
#endif
#define FASTATTN_HAVE_C10D 1
#endif

struct DataParallel::Impl {
  DistOptions opt;
  std::chrono::milliseconds timeout{60000};
#ifdef FASTATTN_HAVE_C10D
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<GroupBase> group;
  struct Bucket {
    torch::Tensor flat;           // (numel of the members,) one dtype
    std::vector<size_t> members;  // parameter indices
    size_t ready = 0;             // members whose gradient is in `flat`
    c10::intrusive_ptr<c10d::Work> work;
  };
#endif
  std::mutex mutex;
  std::vector<torch::Tensor> params;
  std::vector<size_t> bucket_of;
  std::vector<int64_t> offset_of;
  std::vector<char> got;  // gradient of parameter i copied this backward
#ifdef FASTATTN_HAVE_C10D
  std::vector<Bucket> buckets;
#endif
  size_t next = 0;  // buckets launch strictly in index order, the same on every rank
  bool armed = false;
  bool attached = false;
  bool broken = false;  // a collective failed: the group cannot be used (or shut down) cleanly
  std::vector<std::pair<size_t, unsigned>> hooks;

  std::string who() const {
    std::ostringstream os;
    os << "distributed: rank " << opt.rank << " of " << opt.world_size;
    return os.str();
  }

#ifdef FASTATTN_HAVE_C10D
  // Waits for `work`, turning a failure (a peer died, hung or never answered)
  // into an error that says what happened and what to check.
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what) {
    try {
      // Gloo enforces the group's timeout itself; the extra margin only
      // guards against a backend that does not.
      work->wait(timeout + std::chrono::milliseconds(5000));
    } catch (const std::exception& e) {
      broken = true;
      TORCH_CHECK(false, who(), ": ", what,
                  " failed; another process of the group has probably died, hung or become "
                  "unreachable (timeout ",
                  opt.timeout_s, " s, --dist-timeout): ", message_of(e));
    }
  }

  void launch(Bucket& b) {
    std::vector<torch::Tensor> v{b.flat};
    b.work = group->allreduce(v);
  }

  void launch_ready() {
    while (next < buckets.size() && buckets[next].ready == buckets[next].members.size()) {
      launch(buckets[next]);
      ++next;
    }
  }

  void on_grad(size_t i, const torch::Tensor& grad) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!armed || got[i]) return;
    auto& b = buckets[bucket_of[i]];
    torch::NoGradGuard no_grad;
    b.flat.narrow(0, offset_of[i], params[i].numel()).copy_(grad.reshape({-1}));
    got[i] = 1;
    ++b.ready;
    launch_ready();
  }
#endif
};

DataParallel::DataParallel(DistOptions o) : impl_(std::make_shared<Impl>()) {
  auto& d = *impl_;
  d.opt = o;
  TORCH_CHECK(o.world_size >= 1, "distributed: world_size must be >= 1, got ", o.world_size);
  TORCH_CHECK(o.rank >= 0 && o.rank < o.world_size, "distributed: rank must be in [0, ",
              o.world_size, "), got ", o.rank);
  TORCH_CHECK(o.master_port >= 1 && o.master_port <= 65535,
              "distributed: master_port must be in [1, 65535], got ", o.master_port);
  TORCH_CHECK(o.timeout_s > 0 && o.timeout_s <= 86400,
              "distributed: timeout must be in (0, 86400] seconds, got ", o.timeout_s);
  TORCH_CHECK(o.bucket_mb > 0 && o.bucket_mb <= 1024,
              "distributed: bucket size must be in (0, 1024] MiB, got ", o.bucket_mb);
  TORCH_CHECK(o.backend == "gloo" || o.backend == "nccl",
              "distributed: backend must be gloo or nccl, got '", o.backend, "'");
  TORCH_CHECK(distributed_available(o.backend), "distributed: this build of fastattn has no c10d ",
              o.backend,
              " process group (gloo needs Gloo's headers at configure time: Debian's "
              "libgloo-dev; nccl needs a CUDA LibTorch and nccl.h); rebuild with them or train "
              "in one process");
  d.timeout = std::chrono::milliseconds(static_cast<int64_t>(o.timeout_s * 1000));
#ifdef FASTATTN_HAVE_C10D
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(o.master_port);
    so.isServer = o.rank == 0;
    so.numWorkers = static_cast<std::size_t>(o.world_size);
    so.waitWorkers = true;
    so.timeout = d.timeout;
    d.store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, d.who(), ": rendezvous at ", o.master_addr, ":", o.master_port,
                " failed within ", o.timeout_s,
                " s (is every rank started, with the same MASTER_ADDR, MASTER_PORT and "
                "WORLD_SIZE, and is rank 0 reachable?): ",
                message_of(e));
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fastattn/" + o.backend, d.store);
  try {
    if (o.backend == "gloo") {
#ifdef FASTATTN_WITH_GLOO
      auto go = c10d::ProcessGroupGloo::Options::create(d.timeout);
      // The address Gloo binds to: an interface named by GLOO_SOCKET_IFNAME (as
      // in PyTorch), loopback when rank 0 is on loopback, else this host's name.
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      const bool loopback = o.master_addr == "localhost" || o.master_addr.rfind("127.", 0) == 0;
      if (ifname != nullptr && *ifname != '\0') {
        go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (loopback) {
        go->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        go->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      d.group = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(o.rank),
                                                            static_cast<int>(o.world_size), go);
#endif
    } else {
#ifdef FASTATTN_WITH_NCCL
      auto no = c10d::ProcessGroupNCCL::Options::create();
      no->timeout = d.timeout;
      d.group = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, static_cast<int>(o.rank),
                                                            static_cast<int>(o.world_size), no);
#endif
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, d.who(), ": connecting the ", o.backend, " process group failed within ",
                o.timeout_s,
                " s (a rank died during start-up, or the ranks cannot reach each "
                "other's addresses; GLOO_SOCKET_IFNAME picks the interface): ",
                message_of(e));
  }
#endif
}

DataParallel::~DataParallel() {
  // Hooks hold only a weak reference to impl_; removing them keeps a model
  // that outlives this object free of dead hooks.
  for (auto& [i, h] : impl_->hooks) {
    try {
      impl_->params[i].remove_hook(h);
    } catch (...) {
    }
  }
#ifdef FASTATTN_HAVE_C10D
  // After a failure the group's destructor would wait for the collectives
  // still queued behind the failed one (each up to the timeout) before the
  // error reaches the user; the process is about to exit, so let it go.
  if (impl_->broken) {
    (void)impl_->group.release();
    (void)impl_->store.release();
  }
#endif
}

std::shared_ptr<DataParallel> DataParallel::from_env(DistOptions options) {
  if (!dist_options_from_env(options) || options.world_size == 1) return nullptr;
  return std::make_shared<DataParallel>(options);
}

int64_t DataParallel::rank() const { return impl_->opt.rank; }
int64_t DataParallel::world_size() const { return impl_->opt.world_size; }
const DistOptions& DataParallel::options() const { return impl_->opt; }

std::map<std::string, torch::Tensor> DataParallel::shard(
    const std::map<std::string, torch::Tensor>& batch) {
  const int64_t w = world_size(), r = rank();
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, t] : batch) {
    TORCH_CHECK(t.dim() >= 1 && t.size(0) % w == 0, impl_->who(), ": batch tensor '", name,
                "' must have a batch dimension divisible by the world size ", w, ", got shape ",
                t.sizes());
    const int64_t n = t.size(0) / w;
    out[name] = t.narrow(0, r * n, n);
  }
  return out;
}

#ifdef FASTATTN_HAVE_C10D

void DataParallel::broadcast_module(torch::nn::Module& module) {
  auto& d = *impl_;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> tensors = module.parameters();
  for (const auto& b : module.buffers()) tensors.push_back(b);
  for (auto& t : tensors) {
    auto c = t.is_contiguous() ? t : t.contiguous();
    std::vector<torch::Tensor> v{c};
    c10d::BroadcastOptions bo;
    bo.rootRank = 0;
    d.wait(d.group->broadcast(v, bo), "broadcast of the initial parameters from rank 0");
    if (!c.is_same(t)) t.copy_(c);
  }
}

void DataParallel::attach(torch::nn::Module& module) {
  auto& d = *impl_;
  TORCH_CHECK(!d.attached, d.who(), ": attach() called twice");
  d.attached = true;
  for (const auto& p : module.parameters()) {
    if (p.requires_grad()) d.params.push_back(p);
  }
  const int64_t cap = static_cast<int64_t>(d.opt.bucket_mb * 1024 * 1024);
  d.bucket_of.assign(d.params.size(), 0);
  d.offset_of.assign(d.params.size(), 0);
  d.got.assign(d.params.size(), 0);
  // Gradients arrive roughly in reverse registration order (the head first),
  // so buckets are filled from the last parameter back.
  std::vector<std::vector<size_t>> groups;
  int64_t bytes = 0;
  for (size_t k = d.params.size(); k-- > 0;) {
    const auto& p = d.params[k];
    const int64_t nb = p.numel() * static_cast<int64_t>(p.element_size());
    const bool fits = !groups.empty() && bytes + nb <= cap &&
                      d.params[groups.back().front()].scalar_type() == p.scalar_type() &&
                      d.params[groups.back().front()].device() == p.device();
    if (!fits) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(k);
    bytes += nb;
  }
  for (auto& members : groups) {
    Impl::Bucket b;
    int64_t off = 0;
    for (size_t k : members) {
      d.bucket_of[k] = d.buckets.size();
      d.offset_of[k] = off;
      off += d.params[k].numel();
    }
    b.flat = torch::zeros({off}, d.params[members.front()].options().requires_grad(false));
    b.members = std::move(members);
    d.buckets.push_back(std::move(b));
  }
  if (d.opt.overlap) {
    std::weak_ptr<Impl> weak = impl_;
    for (size_t k = 0; k < d.params.size(); ++k) {
      const unsigned h = d.params[k].register_hook([weak, k](const torch::Tensor& grad) {
        if (auto s = weak.lock()) s->on_grad(k, grad);
      });
      d.hooks.emplace_back(k, h);
    }
  }
}

void DataParallel::begin_backward() {
  auto& d = *impl_;
  std::lock_guard<std::mutex> lock(d.mutex);
  TORCH_CHECK(d.attached, d.who(), ": begin_backward() before attach()");
  std::fill(d.got.begin(), d.got.end(), 0);
  for (auto& b : d.buckets) {
    b.ready = 0;
    b.work.reset();
  }
  d.next = 0;
  d.armed = d.opt.overlap;
}

void DataParallel::finish_backward() {
  auto& d = *impl_;
  std::lock_guard<std::mutex> lock(d.mutex);
  d.armed = false;
  torch::NoGradGuard no_grad;
  // Buckets not launched by the hooks: copy what the hooks did not deliver
  // (everything without overlap; zeros for a parameter without a gradient).
  for (size_t bi = d.next; bi < d.buckets.size(); ++bi) {
    auto& b = d.buckets[bi];
    for (size_t k : b.members) {
      if (d.got[k]) continue;
      auto slice = b.flat.narrow(0, d.offset_of[k], d.params[k].numel());
      const auto& g = d.params[k].grad();
      if (g.defined()) {
        slice.copy_(g.reshape({-1}));
      } else {
        slice.zero_();
      }
    }
    d.launch(b);
  }
  d.next = d.buckets.size();
  const double scale = 1.0 / static_cast<double>(d.opt.world_size);
  for (size_t bi = 0; bi < d.buckets.size(); ++bi) {
    auto& b = d.buckets[bi];
    d.wait(b.work, "all-reduce of gradient bucket " + std::to_string(bi + 1) + "/" +
                       std::to_string(d.buckets.size()));
    b.work.reset();
    b.flat.mul_(scale);
    for (size_t k : b.members) {
      auto& p = d.params[k];
      auto avg = b.flat.narrow(0, d.offset_of[k], p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(avg);
      } else {
        p.mutable_grad() = avg.clone();
      }
    }
  }
}

torch::Tensor DataParallel::allreduce_mean(const torch::Tensor& t) {
  auto& d = *impl_;
  auto c = t.detach().clone().contiguous();
  std::vector<torch::Tensor> v{c};
  d.wait(d.group->allreduce(v), "all-reduce of the loss");
  return c / static_cast<double>(d.opt.world_size);
}

bool DataParallel::any(bool flag) {
  auto& d = *impl_;
  std::vector<torch::Tensor> v{torch::tensor({flag ? int64_t{1} : int64_t{0}})};
  d.wait(d.group->allreduce(v), "all-reduce of the stop flag");
  return v[0].item<int64_t>() > 0;
}

std::vector<torch::Tensor> DataParallel::allgather(const torch::Tensor& t) {
  auto& d = *impl_;
  auto c = t.detach().contiguous();
  std::vector<torch::Tensor> in{c};
  std::vector<std::vector<torch::Tensor>> out(1);
  for (int64_t r = 0; r < d.opt.world_size; ++r) out[0].push_back(torch::empty_like(c));
  d.wait(d.group->allgather(out, in), "all-gather");
  return out[0];
}

void DataParallel::barrier() {
  auto& d = *impl_;
  d.wait(d.group->barrier(), "barrier");
}

#else  // no c10d backend: the constructor already threw

void DataParallel::broadcast_module(torch::nn::Module&) {}
void DataParallel::attach(torch::nn::Module&) {}
void DataParallel::begin_backward() {}
void DataParallel::finish_backward() {}
torch::Tensor DataParallel::allreduce_mean(const torch::Tensor& t) { return t; }
bool DataParallel::any(bool flag) { return flag; }
std::vector<torch::Tensor> DataParallel::allgather(const torch::Tensor& t) { return {t}; }
void DataParallel::barrier() {}

#endif

}  // namespace fastattn::train
