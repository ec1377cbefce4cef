"""fast_transformers.events: read what a running model computes.

    from fast_transformers.events import EventDispatcher, AttentionEvent
    matrices = []
    EventDispatcher.get("").listen(AttentionEvent, lambda ev: matrices.append(ev.attention_matrix))

What is dispatched (as in fast-transformers): ``QKVEvent`` by every
``AttentionLayer`` (its projected queries, keys and values);
``AttentionEvent`` by ``FullAttention`` (N, H, L, S), ``RecurrentFullAttention``
(N, H, S) and ``RecurrentCrossFullAttention`` (N, S, H); ``IntermediateOutput``
by the encoder and decoder stacks (batch and recurrent) after each layer.
"""

from . import event, event_dispatcher, filters  # noqa: F401
from .event import AttentionEvent, Event, IntermediateOutput, QKVEvent  # noqa: F401
from .event_dispatcher import EventDispatcher  # noqa: F401

__all__ = ["Event", "AttentionEvent", "QKVEvent", "IntermediateOutput", "EventDispatcher"]
