"""Functional ops: one file per op, each with its PyTorch reference beside the kernels."""
from .attention import attention
from .conv2d import conv2d
from .matmul import bmm, linear, matmul

__all__ = ["matmul", "bmm", "linear", "conv2d", "attention"]
