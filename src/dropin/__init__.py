"""dropin: fast, correct, drop-in Triton kernels for PyTorch."""
__version__ = "0.1.0"

from . import _runtime  # noqa: F401  (switches the Triton interpreter on when there is no GPU)
from . import ops
from .ops import bmm, conv2d, linear, matmul
from .inject import InjectConfig, inject_, revert_

__all__ = ["ops", "matmul", "bmm", "linear", "conv2d", "inject_", "revert_", "InjectConfig", "__version__"]
