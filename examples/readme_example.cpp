// The C++ example of README.md, built and run by `make test` so that it stays
// true: a fused attention call, a type from the registry, and an encoder
// built by name.
#include <torch/torch.h>

#include <fastattn/fastattn.h>

#include <iostream>

int main() {
  at::set_num_threads(2);
  torch::manual_seed(0);

  // 1. The fused operator: q (N,H,L,E), k (N,H,S,E), v (N,H,S,M) -> (N,H,L,M).
  auto q = torch::randn({2, 8, 1000, 64});
  auto k = torch::randn({2, 8, 1000, 64});
  auto v = torch::randn({2, 8, 1000, 64});
  auto lengths = torch::tensor({1000, 700});  // padding: batch 1 has 700 keys
  auto out = fastattn::full_attention(q, k, v, /*attn_mask=*/std::nullopt, lengths,
                                      /*causal=*/true);
  std::cout << "full_attention: " << out.sizes() << "\n";

  // 2. Any attention type by name, with validated parameters.
  auto attn = fastattn::make_attention("full", {{"softmax_temp", 0.125}});
  auto out2 = attn->forward(q, k, v, fastattn::Mask().with_key_lengths(lengths));
  std::cout << "registry 'full': " << out2.sizes() << "\n";

  // 3. A transformer encoder from the builder; inputs are (N, L, D).
  auto encoder =
      fastattn::EncoderBuilder().layers(2).heads(4).d_model(128).attention("full", {}).build();
  auto x = torch::randn({2, 100, 128});
  auto y = encoder->forward(x, fastattn::Mask::causal_mask());
  std::cout << "encoder: " << y.sizes() << "\n";
  return 0;
}
