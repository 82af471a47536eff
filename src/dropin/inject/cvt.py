"""Handlers for HF CvT (transformers.models.cvt): the depthwise conv projection (conv -> BatchNorm2d) and the MLP's
Linear -> GELU declared chains, so the generic handlers fuse them (the BatchNorm folded into the conv in eval
mode; the GELU into the linear's epilogue). The other Linear and Conv2d layers go through the generic handlers."""
from .registry import chain, passive, when_imported


@when_imported("transformers.models.cvt.modeling_cvt")
def _register():
    from transformers.models.cvt.modeling_cvt import (CvtDropPath, CvtIntermediate, CvtSelfAttentionConvProjection,
                                                      CvtSelfAttentionLinearProjection)

    chain(CvtSelfAttentionConvProjection, "convolution", "normalization")
    chain(CvtIntermediate, "dense", "activation")
    passive(CvtSelfAttentionLinearProjection)  # a view and a permute
    passive(CvtDropPath, when=lambda m: not m.training or m.drop_prob == 0)
