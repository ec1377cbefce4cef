// Optimisers for training: RAdam (our own; LibTorch 1.13 has none), the
// optimiser types by name (adam, adamw, radam and registered ones), their
// state as named tensors for checkpoints, and the learning-rate schedule.
// Each step is O(parameters).
#include <cmath>
#include <sstream>
#include <type_traits>

#include "fastattn/experiments/train.h"

namespace fastattn::train {

namespace {

// The key of Optimizer::state(): a string of the TensorImpl pointer in
// LibTorch 1.x, the pointer itself in 2.x.
using StateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;
using StateKey = typename StateMap::key_type;

template <class Key = StateKey>
Key state_key(const torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // as LibTorch 1.x's c10::guts::to_string writes it
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

void write_tensor(torch::serialize::OutputArchive& archive, const char* name,
                  const torch::Tensor& t) {
  if (t.defined()) archive.write(name, t, /*is_buffer=*/true);
}

}  // namespace

// ---- RAdam --------------------------------------------------------------------------

void RAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("lr", c10::IValue(lr()));
  archive.write("beta1", c10::IValue(std::get<0>(betas())));
  archive.write("beta2", c10::IValue(std::get<1>(betas())));
  archive.write("eps", c10::IValue(eps()));
  archive.write("weight_decay", c10::IValue(weight_decay()));
  archive.write("decoupled_weight_decay", c10::IValue(decoupled_weight_decay()));
}

void RAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  c10::IValue v, b1, b2;
  archive.read("lr", v);
  lr(v.toDouble());
  archive.read("beta1", b1);
  archive.read("beta2", b2);
  betas(std::make_tuple(b1.toDouble(), b2.toDouble()));
  archive.read("eps", v);
  eps(v.toDouble());
  archive.read("weight_decay", v);
  weight_decay(v.toDouble());
  archive.read("decoupled_weight_decay", v);
  decoupled_weight_decay(v.toBool());
}

void RAdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  archive.write("step", c10::IValue(step()));
  write_tensor(archive, "exp_avg", exp_avg());
  write_tensor(archive, "exp_avg_sq", exp_avg_sq());
}

void RAdamParamState::serialize(torch::serialize::InputArchive& archive) {
  c10::IValue v;
  archive.read("step", v);
  step(v.toInt());
  torch::Tensor t;
  if (archive.try_read("exp_avg", t, /*is_buffer=*/true)) exp_avg(t);
  torch::Tensor u;
  if (archive.try_read("exp_avg_sq", u, /*is_buffer=*/true)) exp_avg_sq(u);
}

namespace {
void check_radam_options(const RAdamOptions& o) {
  TORCH_CHECK(o.lr() >= 0, "RAdam: lr must be >= 0, got ", o.lr());
  TORCH_CHECK(o.eps() >= 0, "RAdam: eps must be >= 0, got ", o.eps());
  const auto [b1, b2] = o.betas();
  TORCH_CHECK(b1 >= 0 && b1 < 1, "RAdam: beta1 must be in [0, 1), got ", b1);
  TORCH_CHECK(b2 >= 0 && b2 < 1, "RAdam: beta2 must be in [0, 1), got ", b2);
  TORCH_CHECK(o.weight_decay() >= 0, "RAdam: weight_decay must be >= 0, got ", o.weight_decay());
}
}  // namespace

RAdam::RAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups, RAdamOptions defaults)
    : Optimizer(std::move(param_groups), std::make_unique<RAdamOptions>(defaults)) {
  check_radam_options(defaults);
}

RAdam::RAdam(std::vector<torch::Tensor> params, RAdamOptions defaults)
    : RAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

torch::Tensor RAdam::step(LossClosure closure) {
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& o = static_cast<const RAdamOptions&>(group.options());
    const double lr = o.lr(), eps = o.eps(), wd = o.weight_decay();
    const auto [beta1, beta2] = o.betas();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto grad = p.grad();
      TORCH_CHECK(!grad.is_sparse(), "RAdam does not support sparse gradients");
      auto& slot = state_[state_key(p)];
      if (!slot) {
        auto s = std::make_unique<RAdamParamState>();
        s->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        s->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(s);
      }
      auto& s = static_cast<RAdamParamState&>(*slot);
      s.step(s.step() + 1);
      const double t = static_cast<double>(s.step());
      if (wd != 0) {
        if (o.decoupled_weight_decay()) {
          p.mul_(1 - lr * wd);
        } else {
          grad = grad.add(p, wd);
        }
      }
      auto& m = s.exp_avg();
      auto& v = s.exp_avg_sq();
      m.mul_(beta1).add_(grad, 1 - beta1);
      v.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
      const double bc1 = 1 - std::pow(beta1, t);
      const double beta2_t = std::pow(beta2, t);
      const double bc2 = 1 - beta2_t;
      const double rho_inf = 2 / (1 - beta2) - 1;
      const double rho_t = rho_inf - 2 * t * beta2_t / bc2;
      if (rho_t > 5) {
        const double rect = std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf /
                                      ((rho_inf - 4) * (rho_inf - 2) * rho_t));
        // θ -= lr·rect·sqrt(bc2)/bc1 · m / (sqrt(v) + eps)
        auto denom = v.sqrt().add_(eps);
        p.addcdiv_(m, denom, -lr * rect * std::sqrt(bc2) / bc1);
      } else {
        p.add_(m, -lr / bc1);
      }
    }
  }
  return loss;
}

void RAdam::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<RAdamParamState, RAdamOptions>(archive, *this);
}

void RAdam::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<RAdamParamState, RAdamOptions>(archive, *this);
}

// ---- optimiser types ------------------------------------------------------------------

namespace {

// Adam, AdamW and RAdam take the same settings; their states hold a step,
// exp_avg and exp_avg_sq, and (Adam, AdamW) max_exp_avg_sq.
template <class Optimizer, class Options, class State>
OptimizerType adam_family(const char* name) {
  OptimizerType t;
  t.name = name;
  t.make = [](const OptimizerConfig& c, std::vector<torch::Tensor> params) {
    return std::unique_ptr<torch::optim::Optimizer>(std::make_unique<Optimizer>(
        params, Options(c.lr).betas({c.beta1, c.beta2}).eps(c.eps).weight_decay(c.weight_decay)));
  };
  t.state_fields = [](torch::optim::OptimizerParamState& state, const OptimizerStateFields& f) {
    auto* s = dynamic_cast<State*>(&state);
    if (s == nullptr) return false;
    int64_t step = s->step();
    torch::Tensor a = s->exp_avg(), b = s->exp_avg_sq();
    if constexpr (std::is_same_v<State, RAdamParamState>) {
      f(step, {{"exp_avg", &a}, {"exp_avg_sq", &b}});
      s->step(step).exp_avg(a).exp_avg_sq(b);
    } else {
      torch::Tensor c = s->max_exp_avg_sq();
      f(step, {{"exp_avg", &a}, {"exp_avg_sq", &b}, {"max_exp_avg_sq", &c}});
      s->step(step).exp_avg(a).exp_avg_sq(b).max_exp_avg_sq(c);
    }
    return true;
  };
  t.fresh_state = [](const torch::optim::Optimizer& opt) {
    return dynamic_cast<const Optimizer*>(&opt)
               ? std::unique_ptr<torch::optim::OptimizerParamState>(std::make_unique<State>())
               : nullptr;
  };
  return t;
}

std::vector<OptimizerType>& mutable_optimizer_types() {
  static std::vector<OptimizerType> types = {
      adam_family<torch::optim::Adam, torch::optim::AdamOptions, torch::optim::AdamParamState>(
          "adam"),
      adam_family<torch::optim::AdamW, torch::optim::AdamWOptions, torch::optim::AdamWParamState>(
          "adamw"),
      adam_family<RAdam, RAdamOptions, RAdamParamState>("radam"),
  };
  return types;
}

}  // namespace

const std::vector<OptimizerType>& optimizer_types() { return mutable_optimizer_types(); }

void register_optimizer_type(OptimizerType type) {
  TORCH_CHECK(!type.name.empty(), "register_optimizer_type: the name is empty");
  TORCH_CHECK(!is_optimizer_name(type.name), "register_optimizer_type: '", type.name,
              "' is taken (", optimizer_names(", "), ")");
  TORCH_CHECK(type.make && type.state_fields && type.fresh_state, "register_optimizer_type: '",
              type.name, "' needs make, state_fields and fresh_state");
  mutable_optimizer_types().push_back(std::move(type));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerConfig& c,
                                                        std::vector<torch::Tensor> params) {
  TORCH_CHECK(std::isfinite(c.lr) && c.lr > 0, "optimizer: lr must be a number > 0, got ", c.lr);
  TORCH_CHECK(c.beta1 >= 0 && c.beta1 < 1, "optimizer: beta1 must be in [0, 1), got ", c.beta1);
  TORCH_CHECK(c.beta2 >= 0 && c.beta2 < 1, "optimizer: beta2 must be in [0, 1), got ", c.beta2);
  TORCH_CHECK(c.eps >= 0, "optimizer: eps must be >= 0, got ", c.eps);
  TORCH_CHECK(c.weight_decay >= 0, "optimizer: weight_decay must be >= 0, got ", c.weight_decay);
  for (const auto& type : optimizer_types())
    if (type.name == c.name) return type.make(c, std::move(params));
  TORCH_CHECK(false, "optimizer: name must be one of ", optimizer_names(", "), ", got '", c.name,
              "'");
}

std::string optimizer_names(const char* last_separator) {
  const auto& types = optimizer_types();
  std::string out;
  for (size_t i = 0; i < types.size(); ++i)
    out += (i == 0 ? "" : i + 1 == types.size() ? last_separator : ", ") + types[i].name;
  return out;
}

bool is_optimizer_name(const std::string& name) {
  for (const auto& type : optimizer_types())
    if (type.name == name) return true;
  return false;
}

// ---- state as tensors ---------------------------------------------------------------

namespace {

// Shows one parameter's state to f through the type it belongs to.
bool visit_state(torch::optim::OptimizerParamState& state, const OptimizerStateFields& f) {
  for (const auto& type : optimizer_types())
    if (type.state_fields(state, f)) return true;
  return false;
}

std::unique_ptr<torch::optim::OptimizerParamState> fresh_state(const torch::optim::Optimizer& opt) {
  for (const auto& type : optimizer_types())
    if (auto s = type.fresh_state(opt)) return s;
  TORCH_CHECK(false, "optimizer state: the optimiser is none of ", optimizer_names(", "),
              " (register_optimizer_type)");
}

}  // namespace

std::map<std::string, torch::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& opt,
                                                             const std::string& prefix) {
  std::map<std::string, torch::Tensor> out;
  auto& state = const_cast<torch::optim::Optimizer&>(opt).state();
  int64_t index = 0;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      const std::string base = prefix + std::to_string(index++) + ".";
      auto it = state.find(state_key(p));
      if (it == state.end()) continue;
      const bool known = visit_state(*it->second, [&](int64_t& step, const auto& tensors) {
        out[base + "step"] = torch::tensor(step, torch::kLong);
        for (const auto& [name, t] : tensors) {
          if (t->defined()) out[base + name] = *t;
        }
      });
      TORCH_CHECK(known, "optimizer state: a parameter's state belongs to none of ",
                  optimizer_names(", "), " (register_optimizer_type)");
    }
  }
  return out;
}

void load_optimizer_state_tensors(torch::optim::Optimizer& opt,
                                  const std::map<std::string, torch::Tensor>& tensors,
                                  const std::string& prefix) {
  auto& state = opt.state();
  state.clear();
  int64_t index = 0;
  size_t used = 0;
  for (const auto& group : opt.param_groups()) {
    for (const auto& p : group.params()) {
      const std::string base = prefix + std::to_string(index++) + ".";
      auto step_it = tensors.find(base + "step");
      if (step_it == tensors.end()) continue;
      ++used;
      auto s = fresh_state(opt);
      visit_state(*s, [&](int64_t& step, const auto& fields) {
        step = step_it->second.template item<int64_t>();
        for (const auto& [name, t] : fields) {
          auto it = tensors.find(base + name);
          if (it == tensors.end()) continue;
          ++used;
          TORCH_CHECK(it->second.sizes() == p.sizes(), "optimizer state: '", base + name,
                      "' has shape ", it->second.sizes(), " but its parameter has ", p.sizes());
          *t = it->second.to(p.options()).clone();
        }
      });
      state[state_key(p)] = std::move(s);
    }
  }
  size_t expected = 0;
  for (const auto& [name, t] : tensors) expected += name.compare(0, prefix.size(), prefix) == 0;
  TORCH_CHECK(used == expected, "optimizer state: ", expected - used, " tensor(s) under '", prefix,
              "' match no parameter of the optimiser (a different model or optimiser?)");
}

// ---- schedule -----------------------------------------------------------------------

double scheduled_lr(const ScheduleConfig& s, double lr, int64_t step, int64_t total_steps) {
  TORCH_CHECK(s.warmup >= 0, "schedule: warmup must be >= 0, got ", s.warmup);
  TORCH_CHECK(s.min_lr_ratio >= 0 && s.min_lr_ratio <= 1,
              "schedule: min_lr_ratio must be in [0, 1], got ", s.min_lr_ratio);
  TORCH_CHECK(s.decay == "constant" || s.decay == "linear" || s.decay == "cosine",
              "schedule: decay must be one of constant, linear, cosine, got '", s.decay, "'");
  if (step < s.warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup);
  const double floor = lr * s.min_lr_ratio;
  const int64_t span = total_steps - s.warmup;
  const double progress =
      span <= 0 ? 1.0
                : std::min(1.0, static_cast<double>(step - s.warmup) / static_cast<double>(span));
  if (s.decay == "constant") return lr;
  if (s.decay == "linear") return floor + (lr - floor) * (1 - progress);
  if (s.decay == "cosine") return floor + (lr - floor) * 0.5 * (1 + std::cos(M_PI * progress));
  TORCH_CHECK(false, "schedule: decay must be one of constant, linear, cosine, got '", s.decay,
              "'");
}

}  // namespace fastattn::train
