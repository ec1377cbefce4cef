"""fast_transformers.feature_maps: feature maps of linear attention.

As in fast-transformers, a linear attention takes a *factory*
(``elu_feature_map``, ``Favor.factory(n_dims=128)``, ...) and calls it with
the query dimensions. Here a map stands for fastattn's ``feature_map``
parameters (fastattn's kernels compute it); arbitrary Python activation
functions are not supported: ``ActivationFunctionFeatureMap`` takes
``elu(x) + 1`` (as ``elu_feature_map``) and ``relu`` only.
"""

import torch
import torch.nn.functional as F

__all__ = ["FeatureMap", "ActivationFunctionFeatureMap", "elu_feature_map", "Favor",
           "RandomFourierFeatures", "SmoothedRandomFourierFeatures", "GeneralizedRandomFeatures"]


class FeatureMap:
    """A feature map for ``query_dimensions``; ``fastattn_params()`` gives the
    type parameters fastattn computes it with."""

    def __init__(self, query_dims):
        self.query_dims = query_dims

    def fastattn_params(self):
        raise NotImplementedError()

    def new_feature_map(self, device=None):
        """fast-transformers redraws random features here; fastattn draws them
        from the map's seed at each call (the same features every call)."""

    @classmethod
    def factory(cls, *args, **kwargs):
        def make(query_dims):
            return cls(query_dims, *args, **kwargs)

        return make


def _elu_plus_one(x):
    return F.elu(x) + 1


class ActivationFunctionFeatureMap(FeatureMap):
    """phi(x) = activation_function(x): ``elu(x) + 1`` or ``relu`` (fastattn's
    kernels have no other)."""

    def __init__(self, query_dims, activation_function):
        super().__init__(query_dims)
        if activation_function is _elu_plus_one:
            self._name = "elu"
        elif activation_function in (torch.relu, F.relu):
            self._name = "relu"
        else:
            raise ValueError(
                "ActivationFunctionFeatureMap: fastattn computes elu(x) + 1 (elu_feature_map) "
                "and relu (torch.relu) only, got %r" % (activation_function,))

    def fastattn_params(self):
        return dict(feature_map=self._name)


elu_feature_map = ActivationFunctionFeatureMap.factory(_elu_plus_one)


class _RandomMap(FeatureMap):
    _name = None

    def __init__(self, query_dimensions, n_dims=None, softmax_temp=None, orthogonal=False,
                 redraw=1, deterministic_eval=False, **extra):
        super().__init__(query_dimensions)
        self._params = dict(feature_map=self._name, orthogonal=bool(orthogonal), redraw=int(redraw),
                            **extra)
        if n_dims is not None:
            self._params["n_features"] = int(n_dims)
        if softmax_temp is not None:
            self._params["softmax_temp"] = float(softmax_temp)

    def fastattn_params(self):
        return dict(self._params)


class Favor(_RandomMap):
    """Performer's positive random features (FAVOR+)."""

    _name = "favor"

    def __init__(self, query_dimensions, n_dims=None, softmax_temp=None, orthogonal=False,
                 redraw=1, deterministic_eval=False, stabilize=False):
        # fastattn always stabilises (exp(u - max)); ``stabilize`` is accepted.
        super().__init__(query_dimensions, n_dims, softmax_temp, orthogonal, redraw)


class RandomFourierFeatures(_RandomMap):
    """Random Fourier features of the Gaussian kernel."""

    _name = "rff"


class SmoothedRandomFourierFeatures(_RandomMap):
    """Random Fourier features plus a constant ``smoothing``."""

    _name = "smoothed-rff"

    def __init__(self, query_dimensions, n_dims=None, softmax_temp=None, orthogonal=False,
                 smoothing=1.0, redraw=1, deterministic_eval=False):
        super().__init__(query_dimensions, n_dims, softmax_temp, orthogonal, redraw,
                         smoothing=float(smoothing))


_KERNEL_FNS = {torch.relu: "relu", F.relu: "relu", torch.exp: "exp", torch.abs: "abs",
               F.softplus: "softplus", F.elu: "elu"}


class GeneralizedRandomFeatures(_RandomMap):
    """Performer's generalized random features f(W x), ``kernel_fn`` one of
    torch.relu, torch.exp, torch.abs, F.softplus, F.elu."""

    _name = "generalized"

    def __init__(self, query_dimensions, n_dims=None, softmax_temp=1.0, orthogonal=False,
                 kernel_fn=torch.relu, redraw=1, deterministic_eval=False):
        if kernel_fn not in _KERNEL_FNS:
            raise ValueError("GeneralizedRandomFeatures: kernel_fn must be one of torch.relu, "
                             "torch.exp, torch.abs, F.softplus, F.elu, got %r" % (kernel_fn,))
        super().__init__(query_dimensions, n_dims, softmax_temp, orthogonal, redraw,
                         kernel_fn=_KERNEL_FNS[kernel_fn])
