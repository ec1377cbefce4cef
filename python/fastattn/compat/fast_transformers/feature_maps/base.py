"""fast_transformers.feature_maps.base: the feature map interface and activation maps."""

from ._maps import FeatureMap, ActivationFunctionFeatureMap, elu_feature_map  # noqa: F401

__all__ = ['FeatureMap', 'ActivationFunctionFeatureMap', 'elu_feature_map']
