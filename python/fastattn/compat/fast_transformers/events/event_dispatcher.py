"""fast_transformers.events.event_dispatcher: EventDispatcher.

Every module of the drop-in takes ``event_dispatcher`` (an EventDispatcher
or a string key; ``""``, the default, is one process-wide dispatcher) and
dispatches its events there. A listener is a filter (an Event subclass or
any filter of ``events.filters``) and a handler called with each event the
filter accepts, in the order the listeners were added. With no listener a
module builds no event and computes nothing for one (an attention matrix is
computed only when a handler reads it).
"""

from collections import OrderedDict

from .event import Event
from .filters import event_class

__all__ = ["EventDispatcher"]


class EventDispatcher:
    """Delivers events to listeners."""

    _dispatchers = {}

    def __init__(self):
        self._listeners = OrderedDict()
        self._key = None

    def __deepcopy__(self, memo):
        # A copied model reports to the same listeners.
        return self

    def __reduce__(self):
        # Pickled (torch.save of a model): a named dispatcher is the one of
        # that name where it is loaded; an unnamed one arrives empty (its
        # handlers are functions of this process).
        if self._key is not None:
            return (EventDispatcher.get, (self._key,))
        return (EventDispatcher, ())

    def listen(self, event_filter, event_handler):
        """Calls ``event_handler(event)`` for each event ``event_filter``
        accepts (listening again with the same handler replaces its filter)."""
        if isinstance(event_filter, type) and issubclass(event_filter, Event):
            event_filter = event_class(event_filter)
        if not callable(event_filter):
            raise TypeError("EventDispatcher.listen: event_filter must be an Event subclass or a "
                            "callable filter, got %r" % (event_filter,))
        if not callable(event_handler):
            raise TypeError("EventDispatcher.listen: event_handler must be callable, got %r"
                            % (event_handler,))
        self._listeners[event_handler] = event_filter

    def remove(self, event_handler):
        """Stops calling ``event_handler`` (nothing if it was not listening)."""
        self._listeners.pop(event_handler, None)

    def clear(self):
        """Removes every listener."""
        self._listeners.clear()

    @property
    def listening(self):
        """Whether any listener is registered (modules skip building events
        otherwise)."""
        return bool(self._listeners)

    def dispatch(self, event):
        """Delivers ``event`` to each listener whose filter accepts it."""
        for handler, event_filter in list(self._listeners.items()):
            if event_filter(event):
                handler(event)

    @classmethod
    def get(cls, key=""):
        """``key`` itself if it is an EventDispatcher, otherwise the
        process-wide dispatcher named ``key`` (made on first use)."""
        if isinstance(key, EventDispatcher):
            return key
        if not isinstance(key, str):
            raise TypeError("event_dispatcher must be an EventDispatcher or a string key, got %r"
                            % (key,))
        if key not in cls._dispatchers:
            dispatcher = cls()
            dispatcher._key = key
            cls._dispatchers[key] = dispatcher
        return cls._dispatchers[key]
