"""Functional ops: one file per op, each with its PyTorch reference beside the kernels."""
from .activations import activation, gelu, relu, silu
from .attention import attention
from .batch_norm import batch_norm
from .conv1d import conv1d
from .conv2d import conv2d, fold_batchnorm
from .group_norm import group_norm
from .layer_norm import layer_norm
from .linear_cross_entropy import linear_cross_entropy
from .matmul import bmm, linear, matmul
from .pooling import adaptive_avg_pool2d, avg_pool2d, max_pool2d
from .rms_norm import rms_norm
from .rope import rope
from .softmax import log_softmax, softmax
from .sparse import SparseWeight, sparse_linear, sparsify
from .sparse_conv2d import sparse_conv2d
from .swiglu import swiglu_mlp

__all__ = ["matmul", "bmm", "linear", "conv1d", "conv2d", "fold_batchnorm", "attention", "rms_norm", "rope",
           "swiglu_mlp", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "layer_norm", "group_norm", "batch_norm",
           "softmax", "log_softmax", "linear_cross_entropy",
           "activation", "relu", "gelu", "silu",
           "sparse_linear", "sparse_conv2d", "sparsify", "SparseWeight"]
