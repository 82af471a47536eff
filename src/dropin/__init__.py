"""dropin: fast, correct, drop-in Triton kernels for PyTorch."""
__version__ = "0.1.0"

from . import _runtime  # noqa: F401  (switches the Triton interpreter on when there is no GPU)
from . import ops
from .ops import attention, bmm, conv2d, linear, matmul

__all__ = ["ops", "matmul", "bmm", "linear", "conv2d", "attention", "__version__"]
