"""A program written for fast-transformers 0.4 (the papers' reference
implementation), run on fastattn by changing its imports -- or none at all
with install().

Run (from the repository root, after `make build`):
  PYTHONPATH=python /usr/bin/python3 examples/python/fast_transformers_program.py
"""

import torch

import fastattn.compat.fast_transformers as compat

compat.install()  # from here on, `import fast_transformers` is fastattn's

from fast_transformers.builders import RecurrentEncoderBuilder, TransformerEncoderBuilder  # noqa: E402
from fast_transformers.masking import LengthMask, TriangularCausalMask  # noqa: E402

# The quick start of fast-transformers' README: softmax against linear.
builder = TransformerEncoderBuilder.from_kwargs(
    n_layers=4, n_heads=8, query_dimensions=32, value_dimensions=32,
    feed_forward_dimensions=512)
builder.attention_type = "full"
softmax_model = builder.get().eval()
builder.attention_type = "linear"
linear_model = builder.get().eval()
x = torch.rand(4, 500, 8 * 32)
lengths = LengthMask(torch.tensor([500, 400, 300, 200]))
with torch.no_grad():
    print("softmax:", tuple(softmax_model(x, length_mask=lengths).shape))
    print("linear: ", tuple(linear_model(x, length_mask=lengths).shape))

# An autoregressive model and its recurrent twin for generation.
kwargs = dict(n_layers=2, n_heads=4, query_dimensions=16, value_dimensions=16,
              feed_forward_dimensions=128, attention_type="causal-linear")
model = TransformerEncoderBuilder.from_kwargs(**kwargs).get().eval()
generator = RecurrentEncoderBuilder.from_kwargs(**kwargs).get().eval()
generator.load_state_dict(model.state_dict())
seq = torch.rand(1, 64, 64)
with torch.no_grad():
    batch = model(seq, attn_mask=TriangularCausalMask(64))
    state = None
    for i in range(64):
        y, state = generator(seq[:, i], state)
print("recurrent vs batch, last position: max |diff| = %.1e" % (y - batch[:, -1]).abs().max())
