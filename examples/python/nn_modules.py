"""fastattn.nn in one page: an encoder with improved-clustered attention over
padded sequences, a causal-linear decoder trained for a step, and its
recurrent twin generating token by token from the same weights.

Run (from the repository root, after `make build`):
  PYTHONPATH=python /usr/bin/python3 examples/python/nn_modules.py
or with the pip package installed: python examples/python/nn_modules.py
"""

import torch

import fastattn.nn as fnn

torch.manual_seed(0)
N, L, D = 2, 128, 64
x = torch.randn(N, L, D)
lengths = fnn.LengthMask(torch.tensor([128, 90]), max_len=L)

# An encoder from keyword arguments (or a dict / JSON file: build_encoder(config)).
encoder = fnn.build_encoder(n_layers=2, n_heads=4, query_dimensions=16,
                            attention_type="improved-clustered",
                            attention_params={"clusters": 16, "topk": 16}).eval()
memory = encoder(x, key_lengths=lengths)
print("encoder:", tuple(memory.shape))

# A decoder: causal-linear self-attention, full cross-attention to the memory.
config = dict(n_layers=2, n_heads=4, query_dimensions=16, dropout=0.0,
              self_attention_type="causal-linear", cross_attention_type="full")
decoder = fnn.build_decoder(config)
optim = torch.optim.Adam(decoder.parameters(), lr=1e-3)
target = torch.randn(N, 32, D)
loss = (decoder(target, memory, memory_lengths=lengths) - target).pow(2).mean()
loss.backward()
optim.step()
print("decoder loss: %.4f" % loss.item())

# Its recurrent twin: same weights, one token per call, a constant-size state.
generator = fnn.build_decoder(config, recurrent=True)
generator.load_state_dict(decoder.state_dict())
decoder.eval()
generator.eval()
with torch.no_grad():
    batch = decoder(target, memory, memory_lengths=lengths)
    state, steps = None, []
    for t in range(target.shape[1]):
        y, state = generator(target[:, t], memory, memory_lengths=lengths.lengths, state=state)
        steps.append(y)
    diff = (torch.stack(steps, 1) - batch).abs().max().item()
print("recurrent twin vs batch decoder: max |diff| = %.2e" % diff)
assert diff < 1e-4
