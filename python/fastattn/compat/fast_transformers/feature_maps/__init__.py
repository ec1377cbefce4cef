"""fast_transformers.feature_maps: feature maps of linear attention.

Module for module as in fast-transformers (``base``, ``fourier_features``);
the implementations are in ``_maps.py``.
"""

from . import base, fourier_features  # noqa: F401
from ._maps import (ActivationFunctionFeatureMap, Favor, FeatureMap,  # noqa: F401
                    GeneralizedRandomFeatures, RandomFourierFeatures,
                    SmoothedRandomFourierFeatures, elu_feature_map)

__all__ = ["FeatureMap", "ActivationFunctionFeatureMap", "elu_feature_map", "Favor",
           "RandomFourierFeatures", "SmoothedRandomFourierFeatures", "GeneralizedRandomFeatures"]
