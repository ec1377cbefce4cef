// Tests of the data-parallel pieces that fit in one process: the rendezvous
// variables, a group of one rank (the bucket and hook machinery must give a
// plain Trainer's results bit for bit, with and without overlap, in one
// bucket or many), parameters without gradients, and a rendezvous that times
// out. Several processes: tests/cli/test_distributed.sh.
//   ./build/fastattn_tests --gtest_filter='Dist*'
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <string>

#include "expect_error.h"
#include "fastattn/experiments/distributed.h"
#include "fastattn/safetensors.h"
#include "fastattn/experiments/train.h"

using namespace fastattn;
using namespace fastattn::train;

namespace {

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

// Sets the rendezvous variables for the test's lifetime, then clears them.
struct Env {
  explicit Env(const std::map<std::string, std::string>& vars) {
    for (const char* v : kNames) ::unsetenv(v);
    for (const auto& [k, v] : vars) ::setenv(k.c_str(), v.c_str(), 1);
  }
  ~Env() {
    for (const char* v : kNames) ::unsetenv(v);
  }
  static constexpr const char* kNames[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                           "MASTER_PORT"};
};

DistOptions one_rank(double bucket_mb, bool overlap) {
  DistOptions o;
  o.master_port = free_port();
  o.timeout_s = 20;
  o.bucket_mb = bucket_mb;
  o.overlap = overlap;
  return o;
}

TrainConfig small_config() {
  TrainConfig c;
  c.task = {{"name", "copy"}, {"length", 6}, {"vocab", 5}};
  c.model = {{"layers", 2}, {"heads", 2}, {"d_model", 16}, {"dropout", 0.1}};
  c.batch_size = 6;
  c.steps = 4;
  c.clip = 0.3;
  c.seed = 5;
  return c;
}

}  // namespace

TEST(DistEnvTest, ReadsTorchrunVariablesAndNamesBadOnes) {
  DistOptions o;
  {
    Env env({});
    EXPECT_FALSE(dist_options_from_env(o));
  }
  {
    Env env({{"WORLD_SIZE", "4"},
             {"RANK", "3"},
             {"LOCAL_RANK", "1"},
             {"MASTER_ADDR", "10.1.2.3"},
             {"MASTER_PORT", "29511"}});
    ASSERT_TRUE(dist_options_from_env(o));
    EXPECT_EQ(o.world_size, 4);
    EXPECT_EQ(o.rank, 3);
    EXPECT_EQ(o.local_rank, 1);
    EXPECT_EQ(o.master_addr, "10.1.2.3");
    EXPECT_EQ(o.master_port, 29511);
  }
  {
    Env env({{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}});
    EXPECT_ERROR_CONTAINS(dist_options_from_env(o), "RANK is not");
  }
  {
    Env env({{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}});
    EXPECT_ERROR_CONTAINS(dist_options_from_env(o), "RANK must be an integer in [0, 1]", "'2'");
  }
  {
    Env env({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_PORT", "1"}});
    EXPECT_ERROR_CONTAINS(dist_options_from_env(o), "MASTER_ADDR is not");
  }
  {
    Env env({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "x"}});
    EXPECT_ERROR_CONTAINS(dist_options_from_env(o), "MASTER_PORT must be an integer", "'x'");
  }
  {
    Env env({{"WORLD_SIZE", "1"}, {"RANK", "0"}});
    EXPECT_EQ(DataParallel::from_env(DistOptions()), nullptr);  // one process: no group
  }
}

TEST(DistDataParallelTest, OneRankGroupGivesThePlainTrainersRunExactly) {
  if (!distributed_available()) GTEST_SKIP() << "built without c10d Gloo";
  const auto c = small_config();
  Trainer plain(c);
  plain.run();
  const auto want = state_tensors(plain.model());
  // one bucket / a bucket per few parameters; hooks / after backward
  for (double mb : {4.0, 0.002}) {
    for (bool overlap : {true, false}) {
      SCOPED_TRACE("bucket_mb " + std::to_string(mb) + (overlap ? " overlap" : " no overlap"));
      auto dp = std::make_shared<DataParallel>(one_rank(mb, overlap));
      Trainer t(c, dp);
      t.run();
      const auto got = state_tensors(t.model());
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, w] : want) {
        EXPECT_TRUE(torch::equal(got.at(name), w)) << name;
      }
    }
  }
}

TEST(DistDataParallelTest, ParametersWithoutGradientGetZerosAndNothingHangs) {
  if (!distributed_available()) GTEST_SKIP() << "built without c10d Gloo";
  torch::manual_seed(0);
  torch::nn::Sequential used(torch::nn::Linear(3, 4), torch::nn::Linear(4, 2));
  torch::nn::Linear unused(5, 5);
  auto all = std::make_shared<torch::nn::Module>();
  all->register_module("used", used);
  all->register_module("unused", unused);
  // Tiny buckets: the unused parameters sit between and after used ones.
  DataParallel dp(one_rank(0.00005, true));
  dp.attach(*all);
  for (int round = 0; round < 2; ++round) {
    for (auto& p : all->parameters()) p.mutable_grad() = torch::Tensor();
    auto x = torch::randn({7, 3});
    auto loss = used->forward(x).pow(2).sum();
    auto expected = torch::autograd::grad({loss}, used->parameters(), {}, /*retain_graph=*/true);
    dp.begin_backward();
    loss.backward();
    dp.finish_backward();
    auto ps = used->parameters();
    for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(torch::allclose(ps[i].grad(), expected[i]));
    for (auto& p : unused->parameters()) {
      ASSERT_TRUE(p.grad().defined());
      EXPECT_EQ(p.grad().abs().max().item<float>(), 0.0f);
    }
  }
}

TEST(DistDataParallelTest, CheckpointsRecordTheWorldSize) {
  if (!distributed_available()) GTEST_SKIP() << "built without c10d Gloo";
  char buf[] = "/tmp/fastattn_dist_XXXXXX";
  const std::string dir = ::mkdtemp(buf);
  auto c = small_config();
  c.steps = 2;
  {
    Trainer t(c, std::make_shared<DataParallel>(one_rank(4, true)));
    t.run(dir);
  }
  auto file = load_safetensors(dir + "/" + kCheckpointFile);
  EXPECT_EQ(file.metadata.at("world_size"), "1");
  // A world of one is one process: the plain trainer resumes it.
  c.steps = 3;
  Trainer resumed(c);
  resumed.load_checkpoint(dir);
  EXPECT_EQ(resumed.step(), 2);
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(DistDataParallelTest, RendezvousWithoutRankZeroTimesOut) {
  if (!distributed_available()) GTEST_SKIP() << "built without c10d Gloo";
  DistOptions o;
  o.rank = 1;
  o.world_size = 2;
  o.master_port = free_port();  // nobody listens
  o.timeout_s = 1;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_ERROR_CONTAINS(DataParallel{o},
                        "distributed: rank 1 of 2: rendezvous at 127.0.0.1:", "failed within 1 s");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 30.0);  // bounded by the timeout (generous: a loaded machine)
}

TEST(DistDataParallelTest, RejectsBadOptions) {
  DistOptions o;
  o.rank = 2;
  o.world_size = 2;
  EXPECT_ERROR_CONTAINS(DataParallel{o}, "rank must be in [0, 2), got 2");
  o.rank = 0;
  o.timeout_s = 0;
  EXPECT_ERROR_CONTAINS(DataParallel{o}, "timeout must be in (0, 86400] seconds");
  o.timeout_s = 5;
  o.backend = "mpi";
  EXPECT_ERROR_CONTAINS(DataParallel{o}, "backend must be gloo or nccl, got 'mpi'");
}
