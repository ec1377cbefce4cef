"""fast_transformers.recurrent._utils: the recurrent modules' state argument."""

import warnings


def check_state(state=None, memory=None):
    """The state a recurrent module was given: ``state``, or the deprecated
    ``memory`` (with a DeprecationWarning) when only that was passed."""
    if memory is not None:
        warnings.warn("'memory' is deprecated for recurrent transformers; pass 'state'",
                      DeprecationWarning)
        if state is None:
            return memory
    return state
