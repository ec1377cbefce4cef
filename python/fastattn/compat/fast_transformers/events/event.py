"""fast_transformers.events.event: what the modules dispatch.

``Event(source)``; ``AttentionEvent(source, attention_matrix)`` (full
attention's weights, (N, H, L, S), after dropout); ``QKVEvent(source,
queries, keys, values)`` (an attention layer's projections, (N, L, H, E),
(N, S, H, E), (N, S, H, D)); ``IntermediateOutput(source, x)`` (an encoder
or decoder stack's output after each layer).
"""

__all__ = ["Event", "AttentionEvent", "QKVEvent", "IntermediateOutput"]


class Event:
    """Something a module (``source``) reports."""

    def __init__(self, source):
        self.source = source


class AttentionEvent(Event):
    """An attention matrix. fastattn's kernels never materialise it: the
    modules pass a function that computes it, called the first time a
    handler reads ``attention_matrix`` (a tensor can be passed as well)."""

    def __init__(self, source, attention_matrix):
        super().__init__(source)
        self._matrix = attention_matrix

    @property
    def attention_matrix(self):
        if callable(self._matrix):
            self._matrix = self._matrix()
        return self._matrix


class QKVEvent(Event):
    """An attention layer's queries, keys and values after projection."""

    def __init__(self, source, queries, keys, values):
        super().__init__(source)
        self.queries = queries
        self.keys = keys
        self.values = values


class IntermediateOutput(Event):
    """A transformer stack's output after one of its layers."""

    def __init__(self, source, x):
        super().__init__(source)
        self.x = x
