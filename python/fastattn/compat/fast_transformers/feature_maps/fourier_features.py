"""fast_transformers.feature_maps.fourier_features: random feature maps."""

from ._maps import (  # noqa: F401
    RandomFourierFeatures, SmoothedRandomFourierFeatures, Favor, GeneralizedRandomFeatures)

__all__ = ['RandomFourierFeatures', 'SmoothedRandomFourierFeatures', 'Favor',
           'GeneralizedRandomFeatures']
