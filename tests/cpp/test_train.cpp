// Tests of training: safetensors I/O and validation, load_state, RAdam
// against its formula (float64), optimiser state round trips, schedules, the
// copy and transduction tasks, and the Trainer (learning, seeds, exact
// resume, interrupted checkpoints, auxiliary losses).
//   ./build/fastattn_tests
//   --gtest_filter='Safetensors*:LoadState*:RAdam*:Optim*:Schedule*:CopyTask*:Transduction*:Trainer*'
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "expect_error.h"
#include "temp_files.h"
#include "fastattn/registry.h"
#include "fastattn/safetensors.h"
#include "fastattn/experiments/train.h"

using namespace fastattn;
using namespace fastattn::train;

namespace {

using fastattn::testing::read_bytes;
using fastattn::testing::TempDir;
using fastattn::testing::write_bytes;

// A file made by hand: 8-byte length, the header text as given, the data.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

bool same_tensors(torch::nn::Module& a, torch::nn::Module& b) {
  auto ta = state_tensors(a), tb = state_tensors(b);
  if (ta.size() != tb.size()) return false;
  for (const auto& [name, t] : ta) {
    if (!tb.count(name) || !torch::equal(t, tb.at(name))) return false;
  }
  return true;
}

// Trains a Linear with optimiser c for `steps` steps, then hands its state
// through checkpoint tensors ("opt." prefix) to an optimiser over a copy
// (restore = false: a fresh optimiser instead) and takes three more steps
// with each: the state, and whether both end at the same parameters.
struct ResumeRun {
  std::map<std::string, torch::Tensor> state;
  bool same = false;
};
ResumeRun resume_run(const OptimizerConfig& c, int steps, bool restore) {
  torch::manual_seed(5);
  auto a = torch::nn::Linear(4, 3), b = torch::nn::Linear(4, 3);
  auto oa = make_optimizer(c, a->parameters());
  auto x = torch::randn({6, 4});
  auto step = [&](torch::nn::Linear& m, torch::optim::Optimizer& o) {
    o.zero_grad();
    m(x).pow(2).sum().backward();
    o.step();
  };
  for (int i = 0; i < steps; ++i) step(a, *oa);
  ResumeRun r;
  r.state = optimizer_state_tensors(*oa, "opt.");
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < 2; ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  auto ob = make_optimizer(c, b->parameters());
  if (restore) load_optimizer_state_tensors(*ob, r.state, "opt.");
  for (int i = 0; i < 3; ++i) {
    step(a, *oa);
    step(b, *ob);
  }
  r.same = same_tensors(*a, *b);
  return r;
}

}  // namespace

// ---- safetensors ------------------------------------------------------------------

TEST(SafetensorsTest, RoundTripEveryDtype) {
  TempDir dir;
  torch::manual_seed(0);
  std::map<std::string, torch::Tensor> tensors = {
      {"f64", torch::randn({3, 5}, torch::kDouble)},
      {"f32", torch::randn({2, 3, 4}).transpose(0, 2)},  // non-contiguous input
      {"f16", torch::randn({7}).to(torch::kHalf)},
      {"bf16", torch::randn({2, 2}).to(torch::kBFloat16)},
      {"i64", torch::randint(-1000000, 1000000, {4}, torch::kLong)},
      {"i32", torch::randint(-1000, 1000, {3, 1}, torch::kInt)},
      {"i16", torch::randint(-100, 100, {5}, torch::kShort)},
      {"i8", torch::randint(-100, 100, {5}, torch::kChar)},
      {"u8", torch::randint(0, 256, {9}, torch::kByte)},
      {"bool", torch::rand({4, 3}) > 0.5},
      {"scalar", torch::tensor(3.5)},
      {"empty", torch::zeros({0, 4})},
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"note", "héllo"}};
  const std::string path = dir.path + "/t.safetensors";
  save_safetensors(path, tensors, meta);
  const auto file = load_safetensors(path);
  EXPECT_EQ(file.metadata, meta);
  ASSERT_EQ(file.tensors.size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const auto& u = file.tensors.at(name);
    EXPECT_EQ(u.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(u.sizes(), t.sizes()) << name;
    EXPECT_TRUE(torch::equal(u, t)) << name;
  }
  // The data section starts 8-byte aligned and nothing is left in temp files.
  const auto bytes = read_bytes(path);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  EXPECT_EQ(hlen % 8, 0u);
  EXPECT_EQ(std::system(("test -z \"$(ls '" + dir.path + "' | grep tmp)\"").c_str()), 0);
}

TEST(SafetensorsTest, ReadsAHandWrittenFile) {
  // 1.0f, 2.0f as little-endian bytes, then an int32 7.
  const std::string data("\x00\x00\x80\x3f\x00\x00\x00\x40\x07\x00\x00\x00", 12);
  const std::string header =
      R"({"b":{"dtype":"I32","shape":[],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},"__metadata__":{"k":"v"}}  )";
  const auto file = parse_safetensors(raw_file(header, data), "hand");
  EXPECT_TRUE(torch::equal(file.tensors.at("a"), torch::tensor({{1.0f, 2.0f}})));
  EXPECT_EQ(file.tensors.at("b").dim(), 0);
  EXPECT_EQ(file.tensors.at("b").item<int>(), 7);
  EXPECT_EQ(file.metadata.at("k"), "v");
  // The writer produces the same bytes for the data.
  const auto ours = safetensors_bytes({{"a", torch::tensor({{1.0f, 2.0f}})}});
  EXPECT_EQ(ours.substr(ours.size() - 8), data.substr(0, 8));
}

TEST(SafetensorsTest, RejectsCorruptFiles) {
  TempDir dir;
  const std::string good_data(24, '\0');
  auto t = [](const std::string& body) { return "{" + body + "}"; };
  const std::string a24 = R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]})";
  struct Case {
    std::string name, bytes;
    std::vector<const char*> parts;
  };
  std::string huge(8, '\0');
  huge[7] = 0x7f;
  std::vector<Case> cases = {
      {"short", std::string("\x05\x00\x00", 3), {"truncated", "too short"}},
      {"huge_header", huge + "{}", {"header length", "out of bounds"}},
      {"header_past_end", raw_file(t(a24), "").substr(0, 30), {"truncated", "the header needs"}},
      {"bad_json", raw_file("{\"a\": [1, 2", ""), {"not valid JSON"}},
      {"not_object", raw_file("[1, 2]", ""), {"must be a JSON object"}},
      {"bad_dtype",
       raw_file(t(R"("a":{"dtype":"F8","shape":[2],"data_offsets":[0,2]})"), "ab"),
       {"tensor 'a'", "unknown dtype 'F8'"}},
      {"shape_mismatch",
       raw_file(t(R"("a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,24]})"), good_data),
       {"tensor 'a'", "needs 16 bytes", "hold 24"}},
      {"negative_dim",
       raw_file(t(R"("a":{"dtype":"F32","shape":[-1,6],"data_offsets":[0,24]})"), good_data),
       {"non-negative"}},
      {"offset_past_end",
       raw_file(t(R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[8,32]})"), good_data),
       {"tensor 'a'", "past the end"}},
      {"truncated_data", raw_file(t(a24), good_data.substr(0, 20)), {"past the end", "truncated"}},
      {"begin_after_end",
       raw_file(t(R"("a":{"dtype":"U8","shape":[0],"data_offsets":[4,2]})"), good_data),
       {"begin after end"}},
      {"overlap",
       raw_file(t(R"("a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]},)"
                  R"("b":{"dtype":"U8","shape":[16],"data_offsets":[8,24]})"),
                good_data),
       {"overlaps"}},
      {"gap",
       raw_file(t(R"("a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"U8","shape":[8],"data_offsets":[16,24]})"),
                good_data),
       {"gap of 8 bytes", "'b'"}},
      {"trailing", raw_file(t(a24), good_data + "xx"), {"trailing"}},
      {"duplicate", raw_file(t(a24 + "," + a24), good_data), {"names 'a' twice"}},
      {"bad_bool",
       raw_file(t(R"("a":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]})"),
                std::string("\x01\x02", 2)),
       {"BOOL", "other than 0 or 1"}},
      {"bad_metadata", raw_file(R"({"__metadata__":{"k":3}})", ""), {"__metadata__", "'k'"}},
      {"missing_offsets",
       raw_file(t(R"("a":{"dtype":"F32","shape":[2,3]})"), good_data),
       {"data_offsets"}},
      {"unknown_key",
       raw_file(t(R"("a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24],"x":1})"), good_data),
       {"unknown key 'x'"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir.path + "/" + c.name + ".safetensors";
    write_bytes(path, c.bytes);
    bool thrown = false;
    try {
      load_safetensors(path);
    } catch (const c10::Error& e) {
      thrown = true;
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;  // names the file
      for (const char* p : c.parts) EXPECT_NE(msg.find(p), std::string::npos) << msg;
    }
    EXPECT_TRUE(thrown);
  }
  EXPECT_ERROR_CONTAINS(load_safetensors(dir.path + "/nope.safetensors"), "nope.safetensors",
                        "cannot open");
  EXPECT_ERROR_CONTAINS(
      save_safetensors(dir.path + "/x", {{"c", torch::zeros({2}, torch::kComplexFloat)}}),
      "not supported");
}

TEST(LoadStateTest, ByNameWithShapeChecks) {
  TempDir dir;
  torch::manual_seed(1);
  auto a = torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4));
  auto b = torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4));
  a->train();
  a->forward(torch::randn({5, 3}));  // moves the running statistics (buffers)
  EXPECT_FALSE(same_tensors(*a, *b));
  save_state(*a, dir.path + "/a.safetensors");
  const auto report = load_state(*b, dir.path + "/a.safetensors");
  EXPECT_TRUE(report.missing.empty() && report.unexpected.empty());
  EXPECT_TRUE(same_tensors(*a, *b));

  // Prefixes (a wrapped model's names) and non-strict loading.
  std::map<std::string, torch::Tensor> prefixed;
  for (const auto& [n, t] : state_tensors(*a)) prefixed["bert." + n] = t * 2;
  prefixed["bert.extra"] = torch::zeros({1});
  EXPECT_ERROR_CONTAINS(load_state(*b, prefixed, true, "bert."), "bert.extra", "not in the module");
  const auto r = load_state(*b, prefixed, false, "bert.");
  EXPECT_EQ(r.unexpected, std::vector<std::string>{"bert.extra"});
  EXPECT_TRUE(torch::equal(state_tensors(*b).at("0.weight"), state_tensors(*a).at("0.weight") * 2));

  auto c = torch::nn::Sequential(torch::nn::Linear(3, 5));
  EXPECT_ERROR_CONTAINS(load_state(*c, dir.path + "/a.safetensors", false), "a.safetensors",
                        "'0.bias'", "shape [4] in the file but [5]");
  auto d = torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4),
                                 torch::nn::Linear(4, 2));
  EXPECT_ERROR_CONTAINS(load_state(*d, dir.path + "/a.safetensors"), "missing", "2.weight");
  // Dtype conversion between floating types.
  std::map<std::string, torch::Tensor> f64;
  for (const auto& [n, t] : state_tensors(*a))
    f64[n] = t.is_floating_point() ? t.to(torch::kDouble) : t;
  load_state(*b, f64);
  EXPECT_TRUE(same_tensors(*a, *b));
}

// ---- RAdam ------------------------------------------------------------------------

namespace {

// The formula of train.h, elementwise in plain doubles.
struct RAdamRef {
  double lr, b1, b2, eps, wd;
  bool decoupled;
  std::vector<double> m, v;
  int t = 0;
  void step(std::vector<double>& theta, const std::vector<double>& grad) {
    if (m.empty()) m.assign(theta.size(), 0), v.assign(theta.size(), 0);
    ++t;
    const double rho_inf = 2 / (1 - b2) - 1;
    const double rho = rho_inf - 2 * t * std::pow(b2, t) / (1 - std::pow(b2, t));
    for (size_t i = 0; i < theta.size(); ++i) {
      double g = grad[i];
      if (decoupled) {
        theta[i] *= 1 - lr * wd;
      } else {
        g += wd * theta[i];
      }
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      const double mhat = m[i] / (1 - std::pow(b1, t));
      if (rho > 5) {
        const double r =
            std::sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho));
        const double l = std::sqrt(1 - std::pow(b2, t)) / (std::sqrt(v[i]) + eps);
        theta[i] -= lr * mhat * r * l;
      } else {
        theta[i] -= lr * mhat;
      }
    }
  }
};

std::vector<double> to_vec(const torch::Tensor& t) {
  auto c = t.detach().contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

}  // namespace

TEST(RAdamTest, MatchesItsFormulaInFloat64) {
  for (const bool decoupled : {false, true}) {
    for (const double wd : {0.0, 0.05}) {
      SCOPED_TRACE("decoupled=" + std::to_string(decoupled) + " wd=" + std::to_string(wd));
      torch::manual_seed(3);
      auto w = torch::randn({3, 5}, torch::kDouble).requires_grad_(true);
      auto target = torch::randn({3, 5}, torch::kDouble);
      RAdam opt({w}, RAdamOptions(0.01)
                         .betas({0.8, 0.95})
                         .eps(1e-8)
                         .weight_decay(wd)
                         .decoupled_weight_decay(decoupled));
      RAdamRef ref{0.01, 0.8, 0.95, 1e-8, wd, decoupled, {}, {}};
      auto theta = to_vec(w);
      // rho_t <= 5 for the first steps with beta2 = 0.95, > 5 later: both branches run.
      for (int s = 0; s < 15; ++s) {
        opt.zero_grad();
        auto loss = ((w - target).pow(3).abs()).sum();
        loss.backward();
        const auto grad = to_vec(w.grad());
        opt.step();
        ref.step(theta, grad);
        const auto got = to_vec(w);
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_NEAR(got[i], theta[i], 1e-12) << "step " << s + 1 << " element " << i;
        }
      }
    }
  }
}

TEST(RAdamTest, ArchiveSaveLoadContinuesIdentically) {
  torch::manual_seed(4);
  auto make = [] { return torch::nn::Linear(4, 3); };
  auto a = make();
  auto b = make();
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < a->parameters().size(); ++i)
      b->parameters()[i].copy_(a->parameters()[i]);
  }
  RAdam oa(a->parameters(), RAdamOptions(0.01));
  // LibTorch restores the state only (not the options), as for its own optimisers.
  RAdam ob(b->parameters(), RAdamOptions(0.01));
  auto x = torch::randn({6, 4});
  auto step = [&](torch::nn::Linear& m, RAdam& o) {
    o.zero_grad();
    m(x).pow(2).sum().backward();
    o.step();
  };
  for (int i = 0; i < 7; ++i) step(a, oa);
  std::stringstream ss;
  torch::save(oa, ss);
  torch::load(ob, ss);
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < a->parameters().size(); ++i)
      b->parameters()[i].copy_(a->parameters()[i]);
  }
  EXPECT_FALSE(ob.state().empty());
  for (int i = 0; i < 3; ++i) {
    step(a, oa);
    step(b, ob);
  }
  EXPECT_TRUE(same_tensors(*a, *b));
}

TEST(OptimizerStateTest, TensorRoundTripForEveryOptimizer) {
  for (const std::string name : {"adam", "adamw", "radam"}) {
    SCOPED_TRACE(name);
    OptimizerConfig c;
    c.name = name;
    c.lr = 0.01;
    c.weight_decay = 0.01;
    auto r = resume_run(c, 4, /*restore=*/true);
    EXPECT_TRUE(r.state.count("opt.0.exp_avg") && r.state.count("opt.1.step"));
    EXPECT_EQ(r.state.at("opt.0.step").item<int64_t>(), 4);
    EXPECT_TRUE(r.same);
    EXPECT_FALSE(resume_run(c, 4, /*restore=*/false).same);
    auto m = torch::nn::Linear(4, 3);
    auto o = make_optimizer(c, m->parameters());
    r.state["opt.7.step"] = torch::tensor(1L);
    EXPECT_ERROR_CONTAINS(load_optimizer_state_tensors(*o, r.state, "opt."), "match no parameter");
  }
  OptimizerConfig bad;
  bad.name = "sgd";
  EXPECT_ERROR_CONTAINS(make_optimizer(bad, {}), "adam, adamw, radam", "'sgd'");
}

TEST(ScheduleTest, WarmupThenDecay) {
  ScheduleConfig s;
  s.warmup = 4;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 0, 14), 0.25);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 3, 14), 1.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 10, 14), 1.0);
  s.decay = "linear";
  s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(scheduled_lr(s, 1.0, 4, 14), 1.0);
  EXPECT_NEAR(scheduled_lr(s, 1.0, 9, 14), 0.55, 1e-15);
  EXPECT_NEAR(scheduled_lr(s, 1.0, 14, 14), 0.1, 1e-15);
  s.decay = "cosine";
  EXPECT_NEAR(scheduled_lr(s, 2.0, 9, 14), 0.2 + 1.8 * 0.5, 1e-15);
  EXPECT_NEAR(scheduled_lr(s, 2.0, 14, 14), 0.2, 1e-15);
  s.decay = "step";
  EXPECT_ERROR_CONTAINS(scheduled_lr(s, 1.0, 5, 14), "constant, linear, cosine", "'step'");
}

// ---- tasks --------------------------------------------------------------------------

TEST(CopyTaskTest, SamplesMaskedCopies) {
  CopyTask task({/*length=*/20, /*vocab=*/6, /*mask_fraction=*/0.25});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto b = task.sample(16, gen);
  const auto& in = b.at("input");
  const auto& tg = b.at("target");
  const auto& mk = b.at("masked");
  ASSERT_EQ(in.sizes(), (std::vector<int64_t>{16, 42}));
  using torch::indexing::Slice;
  // target = [0, x, 0, x], symbols in 1..6
  EXPECT_TRUE(torch::equal(tg.index({Slice(), Slice(1, 21)}), tg.index({Slice(), Slice(22, 42)})));
  EXPECT_TRUE((tg.select(1, 0) == 0).all().item<bool>());
  EXPECT_TRUE((tg.select(1, 21) == 0).all().item<bool>());
  EXPECT_TRUE((tg.index({Slice(), Slice(1, 21)}) >= 1).all().item<bool>());
  EXPECT_TRUE((tg.index({Slice(), Slice(1, 21)}) <= 6).all().item<bool>());
  // 5 masked per half, never the same position in both halves.
  auto m1 = mk.index({Slice(), Slice(1, 21)}), m2 = mk.index({Slice(), Slice(22, 42)});
  EXPECT_TRUE((m1.sum(1) == 5).all().item<bool>());
  EXPECT_TRUE((m2.sum(1) == 5).all().item<bool>());
  EXPECT_FALSE((m1 & m2).any().item<bool>());
  EXPECT_TRUE(torch::equal(in, tg.masked_fill(mk, 7)));
  // Same generator state, same batch; the next batch differs.
  auto gen2 = at::make_generator<at::CPUGeneratorImpl>(7);
  EXPECT_TRUE(torch::equal(task.sample(16, gen2).at("input"), in));
  EXPECT_FALSE(torch::equal(task.sample(16, gen2).at("input"), in));
  EXPECT_ERROR_CONTAINS(make_task({{"name", "copy"}, {"lenght", 3}}), "unknown key 'lenght'",
                        "length");
  EXPECT_ERROR_CONTAINS(make_task({{"name", "copy"}, {"mask_fraction", 0.7}}), "mask_fraction");
  EXPECT_ERROR_CONTAINS(make_task({{"name", "nope"}}), "copy, transduction");
}

TEST(TaskTypesTest, BuiltinsFirstAndRegisteredOnesByName) {
  EXPECT_EQ(task_type_names().rfind("copy, transduction, digits", 0), 0u) << task_type_names();
  ASSERT_NE(find_task_type("transduction"), nullptr);
  EXPECT_TRUE(find_task_type("transduction")->encoder_decoder);
  EXPECT_FALSE(find_task_type("copy")->encoder_decoder);
  EXPECT_EQ(find_task_type("short-copy"), nullptr);
  // A new task type, named in the JSON like a built-in one.
  register_task_type(TaskType{"short-copy",
                              "the copy task over 3 symbols",
                              false,
                              {{"vocab", "vocab", TaskSetting::Kind::Integer, "V", "symbols", "4"}},
                              [](const nlohmann::json& j) {
                                CopyTaskOptions o;
                                o.length = 3;
                                o.vocab = j.value("vocab", int64_t{4});
                                return std::unique_ptr<Task>(std::make_unique<CopyTask>(o));
                              }});
  auto task = make_task({{"name", "short-copy"}, {"vocab", 6}});
  EXPECT_EQ(task->config().at("length"), 3);
  EXPECT_EQ(task->config().at("vocab"), 6);
  EXPECT_NE(task_type_names().find("short-copy"), std::string::npos);
  EXPECT_ERROR_CONTAINS(
      register_task_type(
          TaskType{"short-copy", "", false, {}, [](auto&) { return std::unique_ptr<Task>(); }}),
      "task type 'short-copy' is already registered");
  EXPECT_ERROR_CONTAINS(register_task_type(TaskType{"no-factory", "", false, {}, nullptr}),
                        "needs a factory");
  // Generate flags need a generator; a generator needs a default count.
  auto copy_factory = find_task_type("copy")->make;
  TaskGenerator flags_only;
  flags_only.flags = {{"x", "x", TaskSetting::Kind::Integer, "X", "x", ""}};
  EXPECT_ERROR_CONTAINS(
      register_task_type(TaskType{"flags-only", "", false, {}, copy_factory, flags_only}),
      "has generate flags but no generator.run");
  TaskGenerator no_count = find_task_type("charlm")->generator;
  no_count.default_count = 0;
  EXPECT_ERROR_CONTAINS(
      register_task_type(TaskType{"no-count", "", false, {}, copy_factory, no_count}),
      "default_count must be >= 1, got 0");
  EXPECT_EQ(find_task_type("flags-only"), nullptr);
  EXPECT_FALSE(find_task_type("copy")->generator.run);
  EXPECT_TRUE(find_task_type("digits")->generator.run);
  EXPECT_ERROR_CONTAINS(make_task({{"name", "nope"}}), "short-copy, got 'nope'");
  EXPECT_ERROR_CONTAINS(make_task({{"length", 3}}), "TYPE one of copy, transduction, digits");
}

// (Names registered by other tests of this process come after the built-ins.)
TEST(OptimizerNamesTest, EveryNameBuildsAndOthersAreRefused) {
  EXPECT_EQ(optimizer_names().rfind("adam, adamw", 0), 0u) << optimizer_names();
  auto w = torch::zeros({2}, torch::requires_grad());
  for (const std::string name : {"adam", "adamw", "radam"}) {
    EXPECT_TRUE(is_optimizer_name(name));
    OptimizerConfig c;
    c.name = name;
    EXPECT_NE(make_optimizer(c, {w}), nullptr);
  }
  EXPECT_FALSE(is_optimizer_name("dam"));
  OptimizerConfig c;
  c.name = "sgd";
  EXPECT_ERROR_CONTAINS(make_optimizer(c, {w}), "one of adam, adamw, radam", "got 'sgd'");
}

// A registered optimiser: built by name, its state through checkpoint
// tensors and back (training continues identically), refused registrations.
TEST(OptimizerNamesTest, RegisteredTypeBuildsAndKeepsItsState) {
  OptimizerType t;
  t.name = "sgd-momentum";
  t.make = [](const OptimizerConfig& c, std::vector<torch::Tensor> params) {
    return std::unique_ptr<torch::optim::Optimizer>(
        std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(c.lr).momentum(0.9)));
  };
  t.state_fields = [](torch::optim::OptimizerParamState& state, const OptimizerStateFields& f) {
    auto* s = dynamic_cast<torch::optim::SGDParamState*>(&state);
    if (s == nullptr) return false;
    int64_t step = 0;
    torch::Tensor m = s->momentum_buffer();
    f(step, {{"momentum_buffer", &m}});
    s->momentum_buffer(m);
    return true;
  };
  t.fresh_state = [](const torch::optim::Optimizer& opt) {
    return dynamic_cast<const torch::optim::SGD*>(&opt)
               ? std::unique_ptr<torch::optim::OptimizerParamState>(
                     std::make_unique<torch::optim::SGDParamState>())
               : nullptr;
  };
  if (!is_optimizer_name(t.name)) register_optimizer_type(t);
  EXPECT_ERROR_CONTAINS(register_optimizer_type(t), "'sgd-momentum' is taken");
  OptimizerType unnamed = t;
  unnamed.name = "";
  EXPECT_ERROR_CONTAINS(register_optimizer_type(unnamed), "the name is empty");
  OptimizerType incomplete = t;
  incomplete.name = "sgd-without-state";
  incomplete.fresh_state = nullptr;
  EXPECT_ERROR_CONTAINS(register_optimizer_type(incomplete), "needs make, state_fields");
  EXPECT_FALSE(is_optimizer_name("sgd-without-state"));
  EXPECT_EQ(optimizer_names(), "adam, adamw, radam or sgd-momentum");

  OptimizerConfig c;
  c.name = "sgd-momentum";
  c.lr = 0.05;
  auto w = torch::zeros({2}, torch::requires_grad());
  EXPECT_NE(dynamic_cast<torch::optim::SGD*>(make_optimizer(c, {w}).get()), nullptr);
  auto r = resume_run(c, 3, /*restore=*/true);
  EXPECT_TRUE(r.state.count("opt.0.momentum_buffer") && r.state.count("opt.1.momentum_buffer"));
  EXPECT_TRUE(r.same);
  // Without the momentum restored, the same steps end elsewhere.
  EXPECT_FALSE(resume_run(c, 3, /*restore=*/false).same);
}

TEST(TransductionTaskTest, SamplesReverseAndSort) {
  for (const std::string mode : {"reverse", "sort"}) {
    TransductionTask task({mode, /*vocab=*/5, /*min_length=*/3, /*max_length=*/9});
    auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
    auto b = task.sample(12, gen);
    for (int64_t i = 0; i < 12; ++i) {
      const int64_t n = b.at("source_lengths")[i].item<int64_t>();
      ASSERT_GE(n, 3);
      ASSERT_LE(n, 9);
      auto src = b.at("source")[i];
      auto x = src.slice(0, 0, n);
      EXPECT_TRUE((src.slice(0, n) == 0).all().item<bool>());
      auto expect = mode == "reverse" ? x.flip(0) : std::get<0>(x.sort());
      auto out = b.at("target_out")[i];
      EXPECT_TRUE(torch::equal(out.slice(0, 0, n), expect));
      EXPECT_EQ(out[n].item<int64_t>(), 2);  // end
      EXPECT_TRUE((out.slice(0, n + 1) == 0).all().item<bool>());
      auto tin = b.at("target_in")[i];
      EXPECT_EQ(tin[0].item<int64_t>(), 1);  // begin
      EXPECT_TRUE(torch::equal(tin.slice(0, 1, n + 1), expect));
    }
  }
}

// ---- trainer ------------------------------------------------------------------------

namespace {

TrainConfig tiny_copy_config() {
  TrainConfig c;
  c.task = {{"name", "copy"}, {"length", 8}, {"vocab", 4}, {"mask_fraction", 0.25}};
  c.model = {{"layers", 2},    {"heads", 2},
             {"d_model", 32},  {"feed_forward_dimensions", 64},
             {"dropout", 0.0}, {"attention", "full"}};
  c.optimizer.name = "radam";
  c.optimizer.lr = 3e-3;
  c.batch_size = 32;
  c.steps = 600;
  c.eval_batches = 4;
  c.seed = 1;
  return c;
}

// An attention type whose auxiliary loss is weight·mean(q²).
class AuxFullAttention : public FullAttention {
 public:
  explicit AuxFullAttention(double weight) : weight_(weight) {}
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const Mask& mask) override {
    aux_ = q.pow(2).mean() * weight_;
    return FullAttention::forward(q, k, v, mask);
  }
  torch::Tensor take_auxiliary_loss() override { return std::exchange(aux_, torch::Tensor()); }
  std::string type_name() const override { return "test-aux-full"; }

 private:
  double weight_;
  torch::Tensor aux_;
};

void register_aux_type() {
  auto& r = AttentionRegistry::global();
  if (r.contains("test-aux-full")) return;
  r.add({"test-aux-full",
         "full attention with an auxiliary loss weight*mean(q^2) (tests only)",
         {ParamSpec::real("weight", 1.0, "loss weight", 0.0)},
         [](const Params& p, const AttentionDims&) -> AttentionPtr {
           return std::make_shared<AuxFullAttention>(p.get_float("weight"));
         }});
}

}  // namespace

TEST(TrainerTest, LearnsTheCopyTask) {
  Trainer trainer(tiny_copy_config());
  const double before = trainer.evaluate()["accuracy"].get<double>();
  trainer.run();
  const auto m = trainer.evaluate();
  EXPECT_LT(before, 0.5);
  EXPECT_GT(m["accuracy"].get<double>(), 0.95) << m.dump();
  EXPECT_EQ(trainer.step(), 600);
}

TEST(TrainerTest, SameSeedSameRunOtherSeedOtherRun) {
  auto c = tiny_copy_config();
  c.steps = 8;
  c.model["dropout"] = 0.1;  // dropout draws from the global generator
  Trainer a(c), b(c);
  std::vector<double> la, lb;
  // Interleaved, with global generator use in between: the trainers keep their own streams.
  for (int i = 0; i < 8; ++i) {
    la.push_back(a.train_step().loss);
    torch::randn({100});
    lb.push_back(b.train_step().loss);
  }
  EXPECT_EQ(la, lb);
  EXPECT_TRUE(same_tensors(a.model(), b.model()));
  c.seed = 2;
  Trainer d(c);
  d.run();
  EXPECT_FALSE(same_tensors(a.model(), d.model()));
}

TEST(TrainerTest, ResumeEqualsUninterrupted) {
  TempDir dir;
  auto c = tiny_copy_config();
  c.steps = 12;
  c.model["dropout"] = 0.1;
  c.schedule.warmup = 3;
  c.schedule.decay = "cosine";
  c.clip = 0.5;
  c.eval_every = 4;
  for (const std::string opt : {"radam", "adamw"}) {
    SCOPED_TRACE(opt);
    c.optimizer.name = opt;
    Trainer full(c);
    std::vector<double> losses_full;
    full.run("", [&](const StepRecord& r) { losses_full.push_back(r.loss); });

    Trainer first(c);
    std::vector<double> losses;
    int64_t n = 0;
    first.run(
        dir.path, [&](const StepRecord& r) { losses.push_back(r.loss); },
        [&] { return n++ == 5; });  // stops after 5 steps, checkpointing
    EXPECT_EQ(first.step(), 5);
    Trainer resumed(c);
    resumed.load_checkpoint(dir.path);
    EXPECT_EQ(resumed.step(), 5);
    resumed.run("", [&](const StepRecord& r) { losses.push_back(r.loss); });
    EXPECT_EQ(losses, losses_full);  // bitwise
    EXPECT_TRUE(same_tensors(full.model(), resumed.model()));
    const auto sa = optimizer_state_tensors(full.optimizer(), "");
    const auto sb = optimizer_state_tensors(resumed.optimizer(), "");
    ASSERT_EQ(sa.size(), sb.size());
    for (const auto& [k, t] : sa) EXPECT_TRUE(torch::equal(t, sb.at(k))) << k;
    EXPECT_EQ(full.evaluate(), resumed.evaluate());
    // model.safetensors holds the weights of the checkpoint's step.
    auto weights = load_safetensors(dir.path + "/" + kModelFile);
    EXPECT_EQ(weights.metadata.at("step"), "5");
  }
}

TEST(TrainerTest, InterruptedOrCorruptCheckpointsAreNeverLoaded) {
  TempDir dir;
  auto c = tiny_copy_config();
  c.steps = 6;
  Trainer t(c);
  t.run(dir.path);
  const std::string path = dir.path + "/" + kCheckpointFile;
  const auto good = read_bytes(path);

  // A temp file left by a run killed mid-write is ignored.
  write_bytes(path + ".tmp-123-456", good.substr(0, good.size() / 2));
  {
    Trainer u(c);
    u.load_checkpoint(dir.path);
    EXPECT_EQ(u.step(), 6);
    EXPECT_TRUE(same_tensors(t.model(), u.model()));
  }
  // A truncated checkpoint (as a non-atomic writer would leave) is rejected.
  Trainer fresh(c);
  write_bytes(path, good.substr(0, good.size() - 100));
  EXPECT_ERROR_CONTAINS(fresh.load_checkpoint(dir.path), "checkpoint.safetensors", "truncated");
  write_bytes(path, good.substr(0, 6));
  EXPECT_ERROR_CONTAINS(fresh.load_checkpoint(dir.path), "checkpoint.safetensors", "too short");
  // A flipped byte in the data is caught by the checksum.
  auto flipped = good;
  flipped[flipped.size() - 3000] ^= 0x10;
  write_bytes(path, flipped);
  EXPECT_ERROR_CONTAINS(fresh.load_checkpoint(dir.path), "corrupt", "checksum");
  EXPECT_EQ(fresh.step(), 0);  // nothing was loaded
  // A valid safetensors file that is not a checkpoint.
  save_safetensors(path, {{"x", torch::zeros({1})}});
  EXPECT_ERROR_CONTAINS(fresh.load_checkpoint(dir.path), "incomplete", "format");
  EXPECT_ERROR_CONTAINS(fresh.load_checkpoint(dir.path + "/none"), "no checkpoint");

  // A different config is refused, naming the difference; steps may change.
  write_bytes(path, good);
  auto other = c;
  other.optimizer.lr = 0.1;
  Trainer v(other);
  EXPECT_ERROR_CONTAINS(v.load_checkpoint(dir.path), "different config", "optimizer");
  auto longer = c;
  longer.steps = 10;
  Trainer w(longer);
  w.load_checkpoint(dir.path);
  EXPECT_EQ(Trainer::checkpoint_config(dir.path).to_json(), Trainer(c).config().to_json());
}

TEST(TrainerTest, AddsAuxiliaryLosses) {
  register_aux_type();
  auto c = tiny_copy_config();
  c.steps = 1;
  c.model["attention"] = {{"type", "test-aux-full"}, {"weight", 0.0}};
  Trainer zero(c);
  c.model["attention"] = {{"type", "test-aux-full"}, {"weight", 5.0}};
  Trainer five(c);
  const auto rz = zero.train_step(), rf = five.train_step();
  EXPECT_EQ(rz.aux_loss, 0.0);
  EXPECT_GT(rf.aux_loss, 0.0);
  EXPECT_EQ(rz.loss, rf.loss);            // same model and batch
  EXPECT_NE(rz.grad_norm, rf.grad_norm);  // the auxiliary loss reached the gradients
}

namespace {

// Reversal of min..max symbols over `vocab`, encoder and decoder of `layers`
// layers (2 heads, d_model 32, no dropout), Adam at 3e-3.
TrainConfig reverse_config(int64_t vocab, int64_t min_length, int64_t max_length, int64_t layers) {
  TrainConfig c;
  c.task = {{"name", "transduction"},
            {"mode", "reverse"},
            {"vocab", vocab},
            {"min_length", min_length},
            {"max_length", max_length}};
  nlohmann::json layer = {{"layers", layers},
                          {"heads", 2},
                          {"d_model", 32},
                          {"feed_forward_dimensions", 64},
                          {"dropout", 0.0}};
  c.model = {{"encoder", layer}, {"decoder", layer}};
  c.optimizer.name = "adam";
  c.optimizer.lr = 3e-3;
  return c;
}

}  // namespace

TEST(TrainerTest, LearnsToReverseWithGreedyDecoding) {
  auto c = reverse_config(/*vocab=*/4, /*min_length=*/2, /*max_length=*/6, /*layers=*/1);
  c.batch_size = 32;
  // Past the learning curve's step: at 600 steps this run sat on it, and
  // rounding alone (2 threads instead of 1, another CPU level, a changed
  // summation order in a kernel) moved the exact match between 0.60 and
  // 1.0. At 1200 every seed tried (3, 5, 7, 8, 9, 11) and every thread
  // count and level reaches 1.0; at 900 seed 7 on 2 threads reached 0.77.
  c.steps = 1200;
  c.seed = 3;
  Trainer t(c);
  const auto before = t.evaluate();
  t.run();
  const auto after = t.evaluate();
  EXPECT_LT(before["exact_match"].get<double>(), 0.05);
  EXPECT_GT(after["exact_match"].get<double>(), 0.8) << after.dump();
  EXPECT_GT(after["token_accuracy"].get<double>(), 0.9) << after.dump();
}

// Token-by-token decoding (the decoder's recurrent twin) decodes exactly what
// re-running the batch decoder over the prefix decodes, for soft and hard
// decoders; trained weights load under other attention types (hard retrieval
// has no parameters of its own), and a type that needs learned parameters the
// checkpoint lacks is refused by name.
TEST(TrainerTest, StepDecodingEqualsRerunAndWeightsLoadUnderOtherTypes) {
  TempDir dir;
  auto c = reverse_config(/*vocab=*/5, /*min_length=*/3, /*max_length=*/9, /*layers=*/2);
  c.batch_size = 16;
  c.steps = 120;
  c.eval_batches = 2;
  c.seed = 5;
  Trainer soft(c);
  soft.run(dir.path);

  auto hard_config = c;
  hard_config.model["decoder"]["self_attention"] = {{"type", "hard-retrieval"}};
  hard_config.model["decoder"]["cross_attention"] = {{"type", "hard-retrieval"}};
  Trainer hard(hard_config);
  const auto report = hard.load_weights(dir.path);
  EXPECT_TRUE(report.missing.empty());
  EXPECT_TRUE(report.unexpected.empty());
  EXPECT_TRUE(same_tensors(soft.model(), hard.model()));

  torch::NoGradGuard no_grad;
  for (Trainer* t : {&soft, &hard}) {
    const auto& task = dynamic_cast<const TransductionTask&>(t->task());
    auto& m = dynamic_cast<Seq2SeqImpl&>(t->model());
    ASSERT_TRUE(m.has_step_decoder());
    m.eval();
    for (const auto& b : t->eval_set()) {
      const int64_t T = b.at("target_out").size(1);
      auto step = task.greedy_decode(m, b.at("source"), b.at("source_lengths"), T, "step");
      auto rerun = task.greedy_decode(m, b.at("source"), b.at("source_lengths"), T, "rerun");
      EXPECT_TRUE(torch::equal(step, rerun)) << step << rerun;
      EXPECT_GT((step > 2).sum().item<int64_t>(), 0);  // it decoded symbols
    }
  }
  // The soft model decodes differently with hard attention (what train soft /
  // decode hard costs); the hard twin is not the soft model in disguise.
  const auto& b = soft.eval_set().front();
  const auto& task = dynamic_cast<const TransductionTask&>(soft.task());
  auto soft_tokens = task.greedy_decode(dynamic_cast<Seq2SeqImpl&>(soft.model()), b.at("source"),
                                        b.at("source_lengths"), b.at("target_out").size(1));
  auto hard_tokens = task.greedy_decode(dynamic_cast<Seq2SeqImpl&>(hard.model()), b.at("source"),
                                        b.at("source_lengths"), b.at("target_out").size(1));
  EXPECT_FALSE(torch::equal(soft_tokens, hard_tokens));

  auto cf_config = c;
  cf_config.model["encoder"]["attention"] = {{"type", "clusterformer"}};
  Trainer cf(cf_config);
  EXPECT_ERROR_CONTAINS(cf.load_weights(dir.path), "lacks parameters",
                        "encoder.layers.0.attention.inner_attention");
}
