"""fastattn's attention types inside Hugging Face transformers models.

`import fastattn.hf` registers every type as attn_implementation
"fastattn-<type>". Tiny randomly initialised models here (nothing is
downloaded); a pretrained one works the same way:
BertModel.from_pretrained(path, attn_implementation="fastattn-improved-clustered").

Run (needs transformers >= 5.0: pip install 'fastattn[hf]'):
  python examples/python/hf_backend.py
or from the source tree with the build's library:
  PYTHONPATH=python python examples/python/hf_backend.py
"""

import torch
import transformers

import fastattn.hf  # noqa: F401  registers fastattn-full, fastattn-improved-clustered, ...

torch.manual_seed(0)
print("registered:", ", ".join(fastattn.hf.registered()))

# An encoder (BERT) on a right-padded batch: fastattn receives key lengths.
config = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=128)
# Type parameters per model, on the config: flat entries for any type, a
# section per type for that type only.
config.fastattn_params = {"seed": 0, "improved-clustered": {"clusters": 8, "topk": 16}}
bert = transformers.BertModel(config).eval()
ids = torch.randint(1, 1000, (2, 64))
mask = torch.ones(2, 64, dtype=torch.long)
mask[1, 40:] = 0

out = {}
for impl in ("eager", "fastattn-full", "fastattn-improved-clustered"):
    bert.set_attn_implementation(impl)
    with torch.no_grad():
        out[impl] = bert(input_ids=ids, attention_mask=mask).last_hidden_state
valid = mask.bool()
for impl in ("fastattn-full", "fastattn-improved-clustered"):
    err = (out[impl] - out["eager"])[valid].abs().max().item()
    print("bert %-28s max |diff| to eager on real tokens: %.2e" % (impl, err))

# A decoder (Llama, grouped-query attention) generating with its KV cache.
llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128)).eval()
prompt = torch.randint(1, 1000, (1, 8))
kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
llama.set_attn_implementation("eager")
want = llama.generate(prompt, **kw)
llama.set_attn_implementation("fastattn-full")
got = llama.generate(prompt, **kw)
print("llama fastattn-full generates eager's tokens:", torch.equal(got, want))

# A type without an incremental form cannot decode from the cache...
llama.set_attn_implementation("fastattn-causal-linear")
try:
    llama.generate(prompt, **kw)
except ValueError as e:
    print("causal-linear with the cache:", str(e).split(". ")[0])
# ...but recomputing the sequence every step works.
tokens = llama.generate(prompt, use_cache=False, **kw)
print("causal-linear, use_cache=False:", tokens[0, 8:].tolist())
