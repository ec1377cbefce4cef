"""fast_transformers.attention: the attention layer and the inner attentions.

Module for module as in fast-transformers (``attention_layer``,
``full_attention``, ``linear_attention``, ...); the implementations are in
``_inner.py`` (docs/python.md, "compat").
"""

from . import (aft_attention, attention_layer, causal_linear_attention, clustered_attention,  # noqa: F401
               conditional_full_attention, exact_topk_attention, full_attention,
               improved_clustered_attention, improved_clustered_causal_attention,
               linear_attention, local_attention, reformer_attention)
from ._inner import (AFTFullAttention, AFTSimpleAttention, AttentionLayer, CausalLinearAttention, ClusteredAttention,  # noqa: F401
                     ConditionalFullAttention, ExactTopKAttention, FullAttention,
                     ImprovedClusteredAttention, ImprovedClusteredCausalAttention,
                     LinearAttention, LocalAttention, ReformerAttention, fastattn_masks)

__all__ = ['AttentionLayer', 'FullAttention', 'LinearAttention', 'CausalLinearAttention',
           'ClusteredAttention', 'ImprovedClusteredAttention', 'ImprovedClusteredCausalAttention',
           'ReformerAttention', 'ConditionalFullAttention', 'ExactTopKAttention', 'LocalAttention',
           'AFTFullAttention', 'AFTSimpleAttention']
