"""fast_transformers.weight_mapper: other models' weights in builder-made ones.

A mapper rewrites a state dict's names (and splits or joins tensors where
the layouts differ) so that ``model.load_state_dict(mapper.map(state))``
loads weights trained elsewhere into a model from the builders:

- ``PytorchMapper``: ``torch.nn.TransformerEncoder`` (post-norm layers,
  ``batch_first`` either way) into a ``TransformerEncoderBuilder`` model
  with ``attention_type="full"``, the same sizes and activation, and
  ``final_normalization`` as the source's ``norm`` (None or a LayerNorm);
- ``HugginfaceBertEncoderMapper`` (fast-transformers' spelling):
  Hugging Face ``BertModel.encoder``'s weights into a builder model with
  ``activation="gelu"``, ``feed_forward_dimensions=intermediate_size``,
  ``final_normalization=False`` (BERT's LayerNorms use eps 1e-12 where
  torch's default is 1e-5: set the model's LayerNorm ``eps`` to
  ``config.layer_norm_eps`` for equal outputs);
- ``LongformerMapper``: the BERT names, and Longformer's global
  projections (``query_global`` ...) renamed alike.

``unmap(state)`` (fastattn's addition) is the inverse: a builder model's
weights back in the source's names and layout.

Rules: ``RegexRule(search, replace)`` renames keys ``search`` matches
(``re.sub``); ``PytorchAttentionWeightsRule`` splits
``self_attn.in_proj_weight``/``bias`` into the three projections;
``NotRule(rule)`` passes on what ``rule`` does not match; ``OrRule(*rules)``
matches what any matches; ``IdentityRule`` passes on everything. A mapper
applies to each key the first rule that matches it, and drops keys no rule
matches.
"""

import re

__all__ = ["MappingRule", "IdentityRule", "NotRule", "OrRule", "RegexRule",
           "PytorchAttentionWeightsRule", "SimpleMapper", "PytorchMapper",
           "HugginfaceBertEncoderMapper", "LongformerMapper"]


class MappingRule:
    """Whether a key is this rule's (``matches``) and what it becomes
    (``apply``: a list of (key, value) pairs)."""

    def matches(self, key):
        raise NotImplementedError(type(self).__name__ + ".matches")

    def apply(self, key, value):
        raise NotImplementedError(type(self).__name__ + ".apply")


class IdentityRule(MappingRule):
    def matches(self, key):
        return True

    def apply(self, key, value):
        return [(key, value)]


class NotRule(IdentityRule):
    """Keys ``rule`` does not match, unchanged."""

    def __init__(self, rule):
        self.rule = rule

    def matches(self, key):
        return not self.rule.matches(key)


class OrRule(MappingRule):
    """Keys any of ``rules`` matches, mapped by the first that does."""

    def __init__(self, *rules):
        self.rules = rules

    def matches(self, key):
        return any(r.matches(key) for r in self.rules)

    def apply(self, key, value):
        for rule in self.rules:
            if rule.matches(key):
                return rule.apply(key, value)
        return [(key, value)]


class RegexRule(MappingRule):
    """Keys in which ``search`` occurs, renamed by ``re.sub(search, replace)``."""

    def __init__(self, search, replace):
        self.pattern = re.compile(search)
        self.replace = replace

    def matches(self, key):
        return self.pattern.search(key) is not None

    def apply(self, key, value):
        return [(self.pattern.sub(self.replace, key), value)]


class PytorchAttentionWeightsRule(MappingRule):
    """``nn.MultiheadAttention``'s packed ``in_proj_weight`` / ``in_proj_bias``
    (rows: queries, keys, values) as the three projections."""

    _NAME = re.compile(r"self_attn\.in_proj_(weight|bias)$")

    def matches(self, key):
        return self._NAME.search(key) is not None

    def apply(self, key, value):
        kind = self._NAME.search(key).group(1)
        if value.shape[0] % 3:
            raise ValueError("PytorchAttentionWeightsRule: %s has %d rows, not 3 equal parts"
                             % (key, value.shape[0]))
        parts = value.chunk(3, dim=0)
        return [(self._NAME.sub("attention.%s_projection.%s" % (name, kind), key), part.clone())
                for name, part in zip(("query", "key", "value"), parts)]


class SimpleMapper:
    """Maps a state dict by ``rules`` (the first that matches each key;
    ``add_identity`` appends an IdentityRule, so unmatched keys pass)."""

    def __init__(self, rules=(), add_identity=True):
        self.rules = list(rules) + ([IdentityRule()] if add_identity else [])

    def map(self, state_dict):
        mapped = {}
        for key, value in state_dict.items():
            for rule in self.rules:
                if rule.matches(key):
                    for new_key, new_value in rule.apply(key, value):
                        if new_key in mapped:
                            raise ValueError("%s: two weights map to %r"
                                             % (type(self).__name__, new_key))
                        mapped[new_key] = new_value
                    break
        return mapped

    def unmap(self, state_dict):
        raise NotImplementedError("%s has no inverse" % type(self).__name__)

    @classmethod
    def load_file(cls, filepath, model_root=None, map_location=None, **other_args):
        """``torch.load(filepath)`` (its ``model_root`` entry if given), mapped."""
        import torch

        state = torch.load(filepath, map_location=map_location, **other_args)
        if model_root is not None:
            state = state[model_root]
        return cls().map(state)


class PytorchMapper(SimpleMapper):
    """``torch.nn.TransformerEncoder`` -> a TransformerEncoderBuilder model."""

    def __init__(self):
        super().__init__([
            PytorchAttentionWeightsRule(),
            RegexRule(r"layers\.(\d+)\.self_attn\.out_proj\.",
                      r"layers.\1.attention.out_projection."),
            NotRule(RegexRule(r"\.softmax_temp$", "")),
        ], add_identity=False)

    def unmap(self, state_dict):
        import torch

        out, packed = {}, {}
        pattern = re.compile(r"^(.*layers\.\d+\.)attention\.(query|key|value|out)_projection\."
                             r"(weight|bias)$")
        for key, value in state_dict.items():
            m = pattern.match(key)
            if m is None:
                out[key] = value
            elif m.group(2) == "out":
                out[m.group(1) + "self_attn.out_proj." + m.group(3)] = value
            else:
                packed.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = value
        for (prefix, kind), parts in packed.items():
            if set(parts) != {"query", "key", "value"}:
                raise ValueError("PytorchMapper.unmap: %sattention has %s projections, not all of "
                                 "query, key, value" % (prefix, sorted(parts)))
            out[prefix + "self_attn.in_proj_" + kind] = torch.cat(
                [parts["query"], parts["key"], parts["value"]], dim=0)
        return out


# BERT's names and the builder model's, as templates: {i} a layer, {p} a
# projection; one table gives the regexes both ways.
_BERT_NAMES = [
    ("layer.{i}.attention.self.{p}", "layers.{i}.attention.{p}_projection"),
    ("layer.{i}.attention.output.dense", "layers.{i}.attention.out_projection"),
    ("layer.{i}.attention.output.LayerNorm", "layers.{i}.norm1"),
    ("layer.{i}.intermediate.dense", "layers.{i}.linear1"),
    ("layer.{i}.output.dense", "layers.{i}.linear2"),
    ("layer.{i}.output.LayerNorm", "layers.{i}.norm2"),
]


def _rename_rule(source, target):
    """A RegexRule from source template to target template ({i} and {p}
    appear in that order in both)."""
    search = re.escape(source).replace(r"\{i\}", r"(\d+)").replace(r"\{p\}",
                                                                  "(query|key|value)")
    replace = target.replace("{i}", r"\1").replace("{p}", r"\2")
    return RegexRule(search, replace)


class HugginfaceBertEncoderMapper(SimpleMapper):
    """Hugging Face BERT's encoder -> a TransformerEncoderBuilder model."""

    RULES = [_rename_rule(bert, ours) for bert, ours in _BERT_NAMES]

    def __init__(self):
        super().__init__(self.RULES)

    def unmap(self, state_dict):
        back = [_rename_rule(ours, bert) for bert, ours in _BERT_NAMES]
        return SimpleMapper(back).map(state_dict)


class LongformerMapper(SimpleMapper):
    """Longformer's encoder: BERT's names (its global projections become
    ``query_projection_global`` ...)."""

    def __init__(self):
        super().__init__(HugginfaceBertEncoderMapper.RULES)

    def unmap(self, state_dict):
        return HugginfaceBertEncoderMapper().unmap(state_dict)
