"""fastattn's PyTorch modules: attention layers around every registered type,
transformer encoders and decoders, their recurrent twins, masks, feature maps
and builders (docs/python.md, "Modules").

    import fastattn.nn as fnn
    layer = fnn.AttentionLayer("improved-clustered", d_model=512, n_heads=8)
    y = layer(x, key_lengths=lengths)              # x (N, L, 512)
    encoder = fnn.build_encoder(n_layers=6, n_heads=8, attention_type="linear")
"""

from .attention import (
    STEP_TYPES,
    Attention,
    AttentionLayer,
    RecurrentAttentionLayer,
    RecurrentCrossAttentionLayer,
)
from .builders import build_decoder, build_encoder
from .feature_maps import (
    EluFeatureMap,
    Favor,
    FeatureMap,
    GeneralizedRandomFeatures,
    RandomFourierFeatures,
    ReluFeatureMap,
    SmoothedRandomFourierFeatures,
)
from .masking import FullMask, LengthMask, TriangularCausalMask
from .transformers import (
    RecurrentTransformerDecoder,
    RecurrentTransformerDecoderLayer,
    RecurrentTransformerEncoder,
    RecurrentTransformerEncoderLayer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

__all__ = [
    "STEP_TYPES", "Attention", "AttentionLayer", "RecurrentAttentionLayer",
    "RecurrentCrossAttentionLayer", "build_encoder", "build_decoder", "FeatureMap",
    "EluFeatureMap", "ReluFeatureMap", "Favor", "RandomFourierFeatures",
    "SmoothedRandomFourierFeatures", "GeneralizedRandomFeatures", "FullMask", "LengthMask",
    "TriangularCausalMask", "TransformerEncoderLayer", "TransformerEncoder",
    "TransformerDecoderLayer", "TransformerDecoder", "RecurrentTransformerEncoderLayer",
    "RecurrentTransformerEncoder", "RecurrentTransformerDecoderLayer",
    "RecurrentTransformerDecoder",
]
