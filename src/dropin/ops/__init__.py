"""Functional ops: one file per op, each with its PyTorch reference beside the kernels."""
from .matmul import bmm, linear, matmul

__all__ = ["matmul", "bmm", "linear"]
