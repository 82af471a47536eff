"""Functional ops: one file per op, each with its PyTorch reference beside the kernels."""
from .attention import attention
from .conv2d import conv2d, fold_batchnorm
from .matmul import bmm, linear, matmul
from .rms_norm import rms_norm
from .rope import rope
from .swiglu import swiglu_mlp

__all__ = ["matmul", "bmm", "linear", "conv2d", "fold_batchnorm", "attention", "rms_norm", "rope", "swiglu_mlp"]
