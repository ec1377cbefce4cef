"""fast_transformers.attention_registry.spec: parameter specs.

A spec names a parameter's type and turns a value into its canonical form
(``spec.get(value)``) or raises ValueError saying what it expected;
``spec.check(value)`` says whether ``get`` would succeed. ``Int``, ``Float``
and ``Bool`` convert as ``int()``, ``float()`` and ``bool()`` do;
``Optional(spec, default)`` maps None to ``default``; ``Choice(values)``
accepts only those values; ``Callable`` any callable;
``EventDispatcherInstance`` an EventDispatcher or the string key of one.
Two specs are equal when they accept the same values (the registry refuses
one parameter name registered with two different specs).
"""

__all__ = ["Spec", "Choice", "Optional", "Int", "Float", "Bool", "Callable",
           "EventDispatcherInstance"]


class Spec:
    """A parameter type: ``predicate(x)`` returns x's canonical value or
    raises ValueError (TypeError from a conversion is reported as ValueError
    too); ``name`` is what ``repr`` shows."""

    def __init__(self, predicate, name="CustomSpec"):
        self._predicate = predicate
        self._name = name

    def __repr__(self):
        return self._name

    def get(self, x):
        try:
            return self._predicate(x)
        except ValueError:
            raise
        except TypeError as e:
            raise ValueError("%r is not a valid %s (%s)" % (x, self._name, e)) from None

    def check(self, x):
        try:
            self.get(x)
        except ValueError:
            return False
        return True

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


class Choice(Spec):
    """One of ``choices``."""

    def __init__(self, choices):
        super().__init__(None, "Choice(%r)" % (choices,))
        self._choices = choices

    def get(self, x):
        if x not in self._choices:
            raise ValueError("%r is not in %r" % (x, self._choices))
        return x

    def __eq__(self, other):
        return isinstance(other, Choice) and self._choices == other._choices

    def __hash__(self):
        return hash(repr(self))


class Optional(Spec):
    """None (read as ``default``) or a value ``spec`` accepts."""

    def __init__(self, spec, default=None):
        super().__init__(None, "Optional[%r, %r]" % (spec, default))
        self._spec = spec
        self._default = default

    def get(self, x):
        return self._default if x is None else self._spec.get(x)

    def __eq__(self, other):
        return (isinstance(other, Optional) and self._spec == other._spec
                and self._default == other._default)

    def __hash__(self):
        return hash(repr(self))


def _callable(x):
    if not callable(x):
        raise ValueError("%r is not a callable" % (x,))
    return x


def _event_dispatcher(x):
    from ..events import EventDispatcher

    if isinstance(x, (str, EventDispatcher)):
        return x
    raise ValueError("%r is not an event dispatcher (an EventDispatcher or the string key of one)"
                     % (x,))


Int = Spec(int, "Int")
Float = Spec(float, "Float")
Bool = Spec(bool, "Bool")
Callable = Spec(_callable, "Callable")
EventDispatcherInstance = Spec(_event_dispatcher, "EventDispatcherInstance")
