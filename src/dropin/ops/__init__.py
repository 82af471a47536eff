"""Functional ops: one file per op, each with its PyTorch reference beside the kernels."""
from .conv2d import conv2d, fold_batchnorm
from .matmul import bmm, linear, matmul

__all__ = ["matmul", "bmm", "linear", "conv2d", "fold_batchnorm"]
from .pooling import adaptive_avg_pool2d, avg_pool2d, max_pool2d  # noqa: E402
__all__ += ["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"]
from .layer_norm import layer_norm  # noqa: E402
__all__ += ["layer_norm"]
from .batch_norm import batch_norm  # noqa: E402
__all__ += ["batch_norm"]
from .softmax import log_softmax, softmax  # noqa: E402
__all__ += ["softmax", "log_softmax"]
from .activations import activation, gelu, relu, silu  # noqa: E402
__all__ += ["activation", "relu", "gelu", "silu"]
