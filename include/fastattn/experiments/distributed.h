// Data-parallel training over LibTorch's c10d: rendezvous from the torchrun
// environment variables, a Gloo process group over TCP (CPU tensors), and
// gradient averaging in buckets launched from autograd hooks while the
// backward pass is still running. The Trainer takes a DataParallel and calls
// it at a few fixed points; docs/distributed.md describes launching, random
// streams per rank and checkpoint rules.
//
//   auto dp = fastattn::train::DataParallel::from_env({});  // nullptr: one process
//   fastattn::train::Trainer trainer(config, dp);             // broadcast from rank 0
//   trainer.run(dir);                                         // rank 0 writes dir
//
// Every collective has a timeout (DistOptions::timeout_s): a rank that dies,
// hangs or never joins makes the others throw a c10::Error naming what failed
// instead of waiting forever.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fastattn::train {

struct DistOptions {
  int64_t rank = 0;        // RANK
  int64_t world_size = 1;  // WORLD_SIZE
  int64_t local_rank = 0;  // LOCAL_RANK (informational on CPU)
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  double timeout_s = 60;         // rendezvous and every collective
  double bucket_mb = 4;          // gradient bucket size (MiB)
  bool overlap = true;           // all-reduce buckets from autograd hooks during backward
  std::string backend = "gloo";  // "gloo" (CPU) or "nccl" (CUDA, when built with it)
};

// True when this build has the c10d Gloo process group (libgloo-dev headers
// were found at configure time); "nccl" likewise.
bool distributed_available(const std::string& backend = "gloo");

// The rendezvous variables torchrun sets: RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT, LOCAL_RANK. Returns false when WORLD_SIZE is unset; throws
// naming the variable when one is missing or malformed. Timeouts, bucket
// size and backend are kept from `options`.
bool dist_options_from_env(DistOptions& options);

class DataParallel {
 public:
  // Joins the group: rank 0 serves a TCPStore at master_addr:master_port, every
  // rank connects to it, then the process group connects all pairs. Throws
  // after timeout_s when a rank does not arrive.
  explicit DataParallel(DistOptions options);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // A DataParallel from the environment, or nullptr when WORLD_SIZE is unset
  // or 1 (a single process needs no group).
  static std::shared_ptr<DataParallel> from_env(DistOptions options);

  int64_t rank() const;
  int64_t world_size() const;
  const DistOptions& options() const;

  // Copies rank 0's parameters and buffers to every rank.
  void broadcast_module(torch::nn::Module& module);
  // Buckets the module's parameters (reverse registration order, one dtype per
  // bucket, about bucket_mb each) and, with overlap, registers gradient hooks.
  // Call once, before the first backward.
  void attach(torch::nn::Module& module);
  // Arms the hooks for one backward pass (call right before backward()).
  void begin_backward();
  // After backward(): launches the buckets not yet launched (a parameter
  // without a gradient contributes zeros), waits for all of them and writes
  // the average over ranks into every parameter's .grad.
  void finish_backward();

  // Mean over ranks of a small tensor (same shape and dtype on every rank).
  torch::Tensor allreduce_mean(const torch::Tensor& t);
  // True on every rank when `flag` is true on any rank.
  bool any(bool flag);
  // Every rank's `t` (same shape and dtype everywhere), in rank order.
  std::vector<torch::Tensor> allgather(const torch::Tensor& t);
  void barrier();

  // This rank's rows of a batch drawn for all ranks: rows
  // [rank·n/world, (rank+1)·n/world) of every tensor (dim 0 is the batch).
  std::map<std::string, torch::Tensor> shard(const std::map<std::string, torch::Tensor>& batch);

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace fastattn::train
