// ClusterFormer, neural clustering attention (Wang et al. 2022), as the
// attention type `clusterformer`, the centroid hand-off between the layers of
// a stack, and its registration (see include/fastattn/clusterformer.h).
//
// Pipeline per forward: X = queries with the heads concatenated (N, L, H·E);
// clustering (U, C', argmax, sort, losses) in ATen (O(N·L·k·D), the (N, k, L)
// matrix U is linear in L); sort into blocks with the gather_tokens op
// (kernels/token_gather); the block attention is the fused full_attention op
// on an (N·k, H, w, E) × (N·k, H, 2w, E) view with an (N·k, w, 2w) keep mask
// (previous block, padding, causal by original position); unsort with
// gather_tokens. Gradients: q, k, v through the block attention; x (the
// queries), the centroids and W_C through U, C' and the losses.
//
// Tested by tests/cpp/test_clusterformer.cpp; timed by
// bench/bench_clusterformer.cpp.
#include "fastattn/clusterformer.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include "attention/builtin_types.h"
#include "fastattn/ops.h"
#include "fastattn/registry.h"
#include "ops/dense_attention.h"
#include "ops/engine_pieces.h"

namespace fastattn {

using torch::Tensor;

namespace {

// (N, L) bool: tokens before each length (all true without lengths).
Tensor valid_tokens(const std::optional<Tensor>& lengths, int64_t N, int64_t L,
                    const torch::Device& device) {
  auto pos = torch::arange(L, torch::TensorOptions().dtype(torch::kLong).device(device));
  if (!lengths) return torch::ones({N, L}, pos.options().dtype(torch::kBool));
  return pos.view({1, L}).lt(lengths->to(device, torch::kLong).view({N, 1}));
}

}  // namespace

ClusterFormerClustering clusterformer_cluster(const Tensor& x, const Tensor& centroids,
                                              const Tensor& projection,
                                              const std::optional<Tensor>& lengths) {
  TORCH_CHECK(x.defined() && x.dim() == 3 && x.is_floating_point(),
              "clusterformer_cluster: x must be a floating tensor of shape (N, L, D), got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  const int64_t N = x.size(0), L = x.size(1), D = x.size(2);
  TORCH_CHECK(centroids.defined() && (centroids.dim() == 2 || centroids.dim() == 3) &&
                  centroids.size(-1) == D && centroids.size(-2) >= 1 &&
                  (centroids.dim() == 2 || centroids.size(0) == N),
              "clusterformer_cluster: centroids must have shape (k, D) or (N, k, D) with N = ", N,
              ", D = ", D, " and k >= 1, got ",
              centroids.defined() ? centroids.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(projection.defined() && projection.dim() == 2 && projection.size(0) == D &&
                  projection.size(1) == D,
              "clusterformer_cluster: projection must have shape (D, D) = (", D, ", ", D, "), got ",
              projection.defined() ? projection.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(
      centroids.scalar_type() == x.scalar_type() && projection.scalar_type() == x.scalar_type(),
      "clusterformer_cluster: centroids and projection must be ", x.scalar_type(), " like x, got ",
      centroids.scalar_type(), " and ", projection.scalar_type());
  if (lengths) {
    TORCH_CHECK(lengths->dim() == 1 && lengths->size(0) == N && !lengths->is_floating_point(),
                "clusterformer_cluster: lengths must be an integer tensor of shape (N,) = (", N,
                ",), got ", lengths->sizes(), " ", lengths->scalar_type());
  }
  const int64_t k = centroids.size(-2);
  auto z = x.matmul(projection);  // (N, L, D)
  auto c = centroids.dim() == 2 ? centroids.unsqueeze(0).expand({N, k, D}) : centroids;
  auto scores = c.matmul(z.transpose(1, 2));             // (N, k, L)
  auto valid = valid_tokens(lengths, N, L, x.device());  // (N, L)
  Tensor u, log_u;
  if (lengths) {
    auto drop = valid.logical_not().unsqueeze(1);            // (N, 1, L)
    auto dead = valid.logical_not().all(1).view({N, 1, 1});  // no valid token at all
    auto s =
        scores.masked_fill(drop, -std::numeric_limits<double>::infinity()).masked_fill(dead, 0.0);
    log_u = torch::log_softmax(s, -1);
    u = torch::softmax(s, -1).masked_fill(dead, 0.0);
  } else {
    log_u = torch::log_softmax(scores, -1);
    u = torch::softmax(scores, -1);
  }
  ClusterFormerClustering out;
  out.updated_centroids = u.matmul(z);  // (N, k, D)
  {
    torch::NoGradGuard no_grad;
    auto a = log_u.argmax(1);  // (N, L)
    out.assignments = torch::where(valid, a, torch::full({}, k, a.options()));
    auto pos = torch::arange(L, a.options()).view({1, L});
    auto key = out.assignments * L + pos;  // distinct: a stable sort
    out.order = std::get<1>(key.sort(1));
  }
  // L1 = -(1/L_valid) sum_j x_j · C'_{I_j}, mean over the batch.
  auto a_safe = out.assignments.clamp_max(k - 1);
  auto c_tok = out.updated_centroids.gather(1, a_safe.unsqueeze(-1).expand({N, L, D}));
  auto dots = (x * c_tok).sum(-1) * valid.to(x.scalar_type());  // (N, L)
  auto count = valid.sum(1).clamp_min(1).to(x.scalar_type());
  out.clustering_loss = -(dots.sum(1) / count).mean();
  // L2 = -(1/k)(sum_{i>=1} C'_i · C'_{i-1} + C'_0 · C'_{k-1}), mean over the batch.
  auto cp = out.updated_centroids;
  out.sorting_loss = -((cp * cp.roll(1, 1)).sum({1, 2}) / static_cast<double>(k)).mean();
  return out;
}

Tensor clusterformer_block_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& order, int64_t clusters,
                                     const std::optional<Tensor>& key_lengths, bool causal,
                                     std::optional<double> softmax_temp, double dropout_p,
                                     std::optional<int64_t> dropout_seed) {
  check_attention_inputs(q, k, v, Mask().with_causal(causal));
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3), M = v.size(3);
  TORCH_CHECK(k.size(2) == L, "clusterformer: needs as many keys as queries (S == L), got ",
              "queries ", q.sizes(), " and keys ", k.sizes());
  TORCH_CHECK(clusters >= 1, "clusterformer: clusters must be >= 1, got ", clusters);
  TORCH_CHECK(order.defined() && order.dim() == 2 && order.size(0) == N && order.size(1) == L &&
                  order.scalar_type() == torch::kLong,
              "clusterformer: order must be an int64 tensor of shape (N, L) = (", N, ", ", L,
              "), got ", order.defined() ? order.sizes() : torch::IntArrayRef{});
  if (key_lengths) Mask().with_key_lengths(*key_lengths).check(N, H, L, L);
  if (L == 0) return torch::zeros({N, H, 0, M}, q.options());
  const int64_t w = (L + clusters - 1) / clusters;  // tokens per block
  const double temp = softmax_temp.value_or(1.0 / std::sqrt(static_cast<double>(E)));
  // On the dense-attention engine where it runs on PyTorch's fused kernels:
  // the blocks as packed sequences through the sort order
  // (src/ops/engine_pieces.h). Causal (by original position) and padded
  // calls keep the masked block attention below, and so does dropout (the
  // engine's calls take none yet).
  if (!causal && !key_lengths && dropout_p == 0 &&
      ops::types_use_dense_engine(q, v, {}, /*pieces=*/true)) {
    auto slots = order.to(q.device()).unsqueeze(1).expand({N, H, L});
    return ops::sorted_chunks_on_engine(q, k, v, {slots}, w, /*mask_self=*/false, temp);
  }
  // Blocks holding a token: with clusters > L the rest would be all padding
  // (and a huge `clusters` would size the buffers), so only these are built.
  const int64_t blocks = (L + w - 1) / w;
  const auto lopt = order.options();
  // Slots of the query blocks (N, b, w): original positions, -1 for the padding.
  auto slots = torch::cat({order.to(q.device()), torch::full({N, blocks * w - L}, -1, lopt)}, 1)
                   .view({N, blocks, w});
  // Key slots (N, b, 2w): the previous block, then the block itself; block 0
  // has no previous block (slots -1). With one block only the block itself.
  Tensor kslots = slots;
  if (blocks > 1) {
    auto prev = torch::cat({torch::full({N, 1, w}, -1, lopt), slots.narrow(1, 0, blocks - 1)}, 1);
    kslots = torch::cat({prev, slots}, 2);
  }
  const int64_t kw = kslots.size(2);
  // Keep mask (N·b, w, kw): existing, unpadded keys; causal by original position.
  auto keep = kslots.ge(0);
  if (key_lengths) keep = keep & kslots.lt(key_lengths->to(lopt).view({N, 1, 1}));
  keep = keep.unsqueeze(2).expand({N, blocks, w, kw});
  if (causal) keep = keep & kslots.unsqueeze(2).le(slots.unsqueeze(3));
  keep = keep.reshape({N * blocks, w, kw});
  // Blocks as a batch of N·b: (N, H, b·w, E) -> (N·b, H, w, E).
  auto to_blocks = [&](const Tensor& x, const Tensor& idx, int64_t width) {
    const int64_t F = x.size(3);
    return gather_tokens(x, idx.reshape({N, -1}))
        .view({N, H, blocks, width, F})
        .permute({0, 2, 1, 3, 4})
        .reshape({N * blocks, H, width, F});
  };
  auto qb = to_blocks(q, slots, w);
  auto kb = to_blocks(k, kslots, kw);
  auto vb = to_blocks(v, kslots, kw);
  auto ob = full_attention(qb, kb, vb, keep, std::nullopt, false, temp, dropout_p,
                           dropout_seed);  // (N·b, H, w, M)
  auto sorted =
      ob.view({N, blocks, H, w, M}).permute({0, 2, 1, 3, 4}).reshape({N, H, blocks * w, M});
  // Unsort: the slot of every original position.
  auto inverse = torch::empty({N, L}, lopt);
  inverse.scatter_(1, order.to(q.device()), torch::arange(L, lopt).view({1, L}).expand({N, L}));
  return gather_tokens(sorted, inverse);
}

// ---- the attention type ------------------------------------------------------

ClusterFormerAttention::ClusterFormerAttention(ClusterFormerOptions options,
                                               const AttentionDims& dims)
    : options_(std::move(options)), dim_(dims.heads * dims.query_dim) {
  TORCH_CHECK(options_.clusters >= 1 && options_.clusters <= kMaxClusterFormerClusters,
              "clusterformer: clusters must be in [1, ", kMaxClusterFormerClusters, "], got ",
              options_.clusters);
  TORCH_CHECK(
      std::isfinite(options_.clustering_loss_weight) && options_.clustering_loss_weight >= 0,
      "clusterformer: clustering_loss_weight must be a finite number >= 0, got ",
      options_.clustering_loss_weight);
  TORCH_CHECK(std::isfinite(options_.sorting_loss_weight) && options_.sorting_loss_weight >= 0,
              "clusterformer: sorting_loss_weight must be a finite number >= 0, got ",
              options_.sorting_loss_weight);
  TORCH_CHECK(options_.centroid_mode == "handed" || options_.centroid_mode == "per-layer",
              "clusterformer: centroid_mode must be \"handed\" or \"per-layer\", got \"",
              options_.centroid_mode, "\"");
  check_softmax_temp("clusterformer", options_.softmax_temp);
  check_attention_dropout("clusterformer", options_.attention_dropout);
  TORCH_CHECK(dims.heads >= 1 && dims.query_dim >= 1,
              "clusterformer: heads and query_dim must be >= 1, got ", dims.heads, " and ",
              dims.query_dim);
  auto gen = options_.seed
                 ? at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(*options_.seed))
                 : at::detail::getDefaultCPUGenerator();
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim_));
  centroids_ = register_parameter(
      "centroids", torch::randn({options_.clusters, dim_}, gen, torch::kFloat) * scale);
  projection_ = register_parameter("centroid_projection",
                                   torch::randn({dim_, dim_}, gen, torch::kFloat) * scale);
}

void ClusterFormerAttention::follow(const std::shared_ptr<ClusterFormerAttention>& previous) {
  TORCH_CHECK(previous && previous.get() != this,
              "clusterformer: follow needs another ClusterFormer layer");
  TORCH_CHECK(previous->dim_ == dim_ && previous->options_.clusters == options_.clusters,
              "clusterformer: can only follow a layer of the same width and clusters, got D = ",
              previous->dim_, ", k = ", previous->options_.clusters, " for D = ", dim_,
              ", k = ", options_.clusters);
  previous_ = previous;
  previous->hands_on_ = true;
}

Tensor ClusterFormerAttention::take_handed_centroids(int64_t batch) {
  auto prev = previous_.lock();
  if (!prev || !prev->handed_.defined()) return {};
  auto c = std::move(prev->handed_);
  prev->handed_ = Tensor();
  return c.size(0) == batch ? c : Tensor();
}

Tensor ClusterFormerAttention::take_auxiliary_loss() {
  auto loss = std::move(aux_loss_);
  aux_loss_ = Tensor();
  return loss;
}

Tensor ClusterFormerAttention::forward(const Tensor& queries,  // (N, H, L, E)
                                       const Tensor& keys,     // (N, H, S, E)
                                       const Tensor& values,   // (N, H, S, M)
                                       const Mask& mask) {
  check_attention_inputs(type_name(), queries, keys, values, mask);
  const int64_t N = queries.size(0), H = queries.size(1), L = queries.size(2), E = queries.size(3);
  TORCH_CHECK(keys.size(2) == L,
              "clusterformer: is self-attention and needs as many keys as queries (S == L), got "
              "queries ",
              queries.sizes(), " and keys ", keys.sizes());
  TORCH_CHECK(H * E == dim_, "clusterformer: queries must have H·E = ", dim_,
              " (the heads and query_dim it was built for), got H = ", H, ", E = ", E);
  if (N == 0 || L == 0) {  // nothing to cluster: the empty result
    return torch::zeros({N, H, L, values.size(3)}, values.options());
  }
  // Tokens past a key or query length are padding for the clustering.
  std::optional<Tensor> lengths;
  if (mask.key_lengths()) lengths = mask.key_lengths()->to(torch::kLong);
  if (mask.query_lengths()) {
    auto ql = mask.query_lengths()->to(torch::kLong);
    lengths = lengths ? torch::minimum(*lengths, ql) : ql;
  }
  auto x = queries.permute({0, 2, 1, 3}).reshape({N, L, dim_});  // (N, L, H·E)
  Tensor c;
  if (options_.centroid_mode == "handed") c = take_handed_centroids(N);
  if (!c.defined()) c = centroids_;
  auto cl =
      clusterformer_cluster(x, c.to(x.scalar_type()), projection_.to(x.scalar_type()), lengths);
  auto out = clusterformer_block_attention(
      queries, keys, values, cl.order, options_.clusters, mask.key_lengths(), mask.is_causal(),
      options_.softmax_temp, is_training() ? options_.attention_dropout : 0.0);
  aux_loss_ = options_.clustering_loss_weight * cl.clustering_loss +
              options_.sorting_loss_weight * cl.sorting_loss;
  if (hands_on_) handed_ = cl.updated_centroids;
  last_ = {cl.assignments, cl.order, cl.updated_centroids.detach(), cl.clustering_loss.detach(),
           cl.sorting_loss.detach()};
  return out;
}

// ---- the hand-off between layers ------------------------------------------------

void link_clusterformer_centroids(torch::nn::Module& model) {
  // "layers.<i>.<path>" -> (<path>, i); other names are not part of a stack.
  std::map<std::string, std::vector<std::pair<int64_t, std::shared_ptr<ClusterFormerAttention>>>>
      groups;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    auto cf = std::dynamic_pointer_cast<ClusterFormerAttention>(item.value());
    if (!cf || cf->options().centroid_mode != "handed") continue;
    const std::string& name = item.key();
    const std::string prefix = "layers.";
    if (name.rfind(prefix, 0) != 0) continue;
    const auto dot = name.find('.', prefix.size());
    if (dot == std::string::npos) continue;
    const std::string index = name.substr(prefix.size(), dot - prefix.size());
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) continue;
    groups[name.substr(dot + 1)].emplace_back(std::stoll(index), cf);
  }
  for (auto& [path, layers] : groups) {
    std::sort(layers.begin(), layers.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 1; i < layers.size(); ++i) {
      const auto& prev = layers[i - 1].second;
      const auto& cur = layers[i].second;
      if (prev->centroids().size(1) == cur->centroids().size(1) &&
          prev->options().clusters == cur->options().clusters) {
        cur->follow(prev);
      }
    }
  }
}

// ---- registration -------------------------------------------------------------

void register_clusterformer_attention_types(AttentionRegistry& registry) {
  registry.add(
      {"clusterformer",
       "neural clustering attention (Wang et al. 2022): tokens clustered by learned centroids, "
       "sorted, each block of w = ceil(L/k) attends to itself and the previous block; returns "
       "clustering and sorting losses for training: O(L·k·D + L·w·E)",
       {ParamSpec::integer("clusters", 8,
                           "number of clusters k (learned centroids; blocks of w = ceil(L/k))", 1,
                           double(kMaxClusterFormerClusters)),
        ParamSpec::real("clustering_loss_weight", 0.01, "weight of the clustering loss L1", 0.0),
        ParamSpec::real("sorting_loss_weight", 0.01, "weight of the sorting loss L2", 0.0),
        ParamSpec::choice("centroid_mode", "handed", {"handed", "per-layer"},
                          "handed: a layer of a stack clusters with the previous layer's updated "
                          "centroids; per-layer: each layer its own learned centroids"),
        softmax_temp_spec(), seed_spec("the initialisation of the centroids and W_C"),
        attention_dropout_spec()},
       [](const Params& p, const AttentionDims& dims) -> AttentionPtr {
         ClusterFormerOptions o;
         o.clusters = p.get_int("clusters");
         o.clustering_loss_weight = p.get_float("clustering_loss_weight");
         o.sorting_loss_weight = p.get_float("sorting_loss_weight");
         o.centroid_mode = p.get_string("centroid_mode");
         o.softmax_temp = p.get_optional_float("softmax_temp");
         o.seed = p.get_optional_int("seed");
         o.attention_dropout = p.get_float("attention_dropout");
         return std::make_shared<ClusterFormerAttention>(o, dims);
       },
       Capabilities().with_learned_parameters().selecting(),
       /*recurrent=*/nullptr});
}

}  // namespace fastattn
