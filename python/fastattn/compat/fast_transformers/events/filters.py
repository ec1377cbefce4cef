"""fast_transformers.events.filters: which events a listener receives.

A filter is a callable taking an event and returning whether to deliver it.
``event_class(cls)``, ``from_layer(module)`` and ``layer_name_contains(root,
name)`` make the common ones; filters combine with ``&``, ``|`` and ``~``,
and an Event subclass or a plain function may stand on either side.
"""

import weakref

__all__ = ["EventFilter", "CallableEventFilter", "LayerNameEventFilter", "event_class",
           "from_layer", "layer_name_contains"]


def _as_filter(x):
    from .event import Event

    if isinstance(x, EventFilter):
        return x
    if isinstance(x, type) and issubclass(x, Event):
        return event_class(x)
    if callable(x):
        return CallableEventFilter(x)
    return None


class EventFilter:
    """The base of the filters; subclasses define ``__call__(event)``."""

    def __call__(self, event):
        raise NotImplementedError(type(self).__name__ + " must define __call__(event)")

    def _combine(self, other, op):
        other = _as_filter(other)
        if other is None:
            return NotImplemented
        return CallableEventFilter(lambda ev: op(self(ev), other(ev)))

    def __and__(self, other):
        return self._combine(other, lambda a, b: a and b)

    def __rand__(self, other):
        return self._combine(other, lambda a, b: b and a)

    def __or__(self, other):
        return self._combine(other, lambda a, b: a or b)

    def __ror__(self, other):
        return self._combine(other, lambda a, b: b or a)

    def __invert__(self):
        return CallableEventFilter(lambda ev: not self(ev))


class CallableEventFilter(EventFilter):
    """A function of the event as a filter."""

    def __init__(self, event_filter):
        self._filter = event_filter

    def __call__(self, event):
        return self._filter(event)


class LayerNameEventFilter(EventFilter):
    """Events whose source is a submodule of ``root`` with a name
    ``name_filter`` accepts (the names of ``root.named_modules()`` when the
    filter was made)."""

    def __init__(self, root, name_filter):
        self._names = {}
        for name, module in root.named_modules():
            self._names.setdefault(id(module), (weakref.ref(module), name))
        self._name_filter = name_filter

    def __call__(self, event):
        entry = self._names.get(id(event.source))
        if entry is None or entry[0]() is not event.source:
            return False
        return self._name_filter(entry[1])


def event_class(klass):
    """Events that are instances of ``klass``."""
    return CallableEventFilter(lambda ev: isinstance(ev, klass))


def from_layer(layer):
    """Events dispatched by the module ``layer`` itself."""
    return CallableEventFilter(lambda ev: ev.source is layer)


def layer_name_contains(root, name):
    """Events from submodules of ``root`` whose name contains ``name``."""
    return LayerNameEventFilter(root, lambda n: name in n)
