"""fast_transformers.recurrent: token-by-token forms of the attentions and
transformers (``recurrent.attention``, ``recurrent.transformers``)."""
