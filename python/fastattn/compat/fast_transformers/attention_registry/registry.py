"""fast_transformers.attention_registry.registry: the attention registries.

``AttentionRegistry`` (the batch attentions, built by ``AttentionBuilder``
and the transformer builders), ``RecurrentAttentionRegistry`` (recurrent
self attention) and ``RecurrentCrossAttentionRegistry`` (recurrent cross
attention). Registering a module class under a key, with the (name, spec)
pairs of the keyword arguments its constructor takes, makes the builders
build it by that key; a parameter name means one spec across a registry.
"""

__all__ = ["Registry", "AttentionRegistry", "RecurrentAttentionRegistry",
           "RecurrentCrossAttentionRegistry"]


class Registry:
    """Attention classes by key, and the specs of their parameters."""

    def __init__(self, name="Registry"):
        self._name = name
        self._classes = {}
        self._class_params = {}
        self._specs = {}

    def register(self, key, class_object, parameter_tuples):
        if not isinstance(key, str) or not key:
            raise ValueError("%s.register: key must be a non-empty string, got %r"
                             % (self._name, key))
        if key in self._classes:
            raise ValueError("%s is already registered" % key)
        pairs = list(parameter_tuples)
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                    and hasattr(pair[1], "get")):
                raise ValueError("%s.register(%r): parameters must be (name, spec) pairs, got %r"
                                 % (self._name, key, pair))
        for name, spec in pairs:
            known = self._specs.get(name)
            if known is not None and known != spec:
                raise ValueError("%s is already registered with spec %r instead of %r"
                                 % (name, known, spec))
        for name, spec in pairs:
            self._specs.setdefault(name, spec)
        self._classes[key] = class_object
        self._class_params[key] = [name for name, _ in pairs]

    def __contains__(self, key):
        return key in self._classes

    def __getitem__(self, key):
        """(class, the names of its parameters)."""
        return self._classes[key], self._class_params[key]

    @property
    def keys(self):
        return list(self._classes)

    def contains_parameter(self, key):
        return key in self._specs

    def validate_parameter(self, key, value):
        """``value`` in the canonical form of parameter ``key``'s spec;
        ValueError naming the parameter if the spec refuses it."""
        try:
            return self._specs[key].get(value)
        except ValueError as e:
            raise ValueError("attention parameter %r: %s" % (key, e)) from None

    def __repr__(self):
        return "%s(%s)" % (self._name, ", ".join(self._classes))


AttentionRegistry = Registry("AttentionRegistry")
RecurrentAttentionRegistry = Registry("RecurrentAttentionRegistry")
RecurrentCrossAttentionRegistry = Registry("RecurrentCrossAttentionRegistry")
