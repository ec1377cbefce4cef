"""Feature maps of linear attention as objects.

``linear`` and ``causal-linear`` take their feature map phi as parameters of
the type (``feature_map``, ``n_features``, ``softmax_temp``, ...). These
classes name the choices and their arguments; each is a set of those
parameters, given to :class:`fastattn.nn.Attention` as ``feature_map=``::

    Attention("causal-linear", feature_map=Favor(n_features=128))
    # the same as Attention("causal-linear", feature_map="favor", n_features=128)
"""

__all__ = [
    "FeatureMap",
    "EluFeatureMap",
    "ReluFeatureMap",
    "Favor",
    "RandomFourierFeatures",
    "SmoothedRandomFourierFeatures",
    "GeneralizedRandomFeatures",
]


class FeatureMap:
    """A feature map: its registry name and the parameters that go with it."""

    name = None

    def __init__(self, **params):
        self._params = {k: v for k, v in params.items() if v is not None}

    def params(self):
        """The type parameters this map stands for."""
        return dict(feature_map=self.name, **self._params)

    def __repr__(self):
        args = ", ".join("%s=%r" % kv for kv in self._params.items())
        return "%s(%s)" % (type(self).__name__, args)

    def __eq__(self, other):
        return isinstance(other, FeatureMap) and self.params() == other.params()


class EluFeatureMap(FeatureMap):
    """phi(x) = elu(x) + 1 (Katharopoulos et al. 2020); fused kernels."""

    name = "elu"

    def __init__(self):
        super().__init__()


class ReluFeatureMap(FeatureMap):
    """phi(x) = relu(x)."""

    name = "relu"

    def __init__(self):
        super().__init__()


class _RandomMap(FeatureMap):
    def __init__(self, n_features=None, softmax_temp=None, orthogonal=True, seed=0, redraw=1, **extra):
        super().__init__(n_features=n_features, softmax_temp=softmax_temp, orthogonal=orthogonal,
                         seed=seed, redraw=redraw, **extra)


class Favor(_RandomMap):
    """Performer's FAVOR+ positive random features for exp(temp·q·k).

    Args:
        n_features: m (default the query dimension).
        softmax_temp: the kernel's scale (default 1/sqrt(E)).
        orthogonal: orthogonal random blocks.
        seed: the generator seed of the random matrix.
        redraw: redraw every n-th training forward (0: never).
    """

    name = "favor"


class RandomFourierFeatures(_RandomMap):
    """Random Fourier features of the Gaussian kernel exp(-temp·|q-k|²/2) (n_features even)."""

    name = "rff"


class SmoothedRandomFourierFeatures(_RandomMap):
    """Random Fourier features plus a constant ``smoothing`` feature (positive normaliser)."""

    name = "smoothed-rff"

    def __init__(self, n_features=None, softmax_temp=None, orthogonal=True, seed=0, redraw=1,
                 smoothing=1.0):
        super().__init__(n_features, softmax_temp, orthogonal, seed, redraw, smoothing=smoothing)


class GeneralizedRandomFeatures(FeatureMap):
    """Performer's generalized random features f(W x), f = ``kernel_fn``."""

    name = "generalized"

    def __init__(self, n_features=None, kernel_fn="relu", seed=0, redraw=1):
        super().__init__(n_features=n_features, kernel_fn=kernel_fn, seed=seed, redraw=redraw)
