"""dropin: fast, correct, drop-in Triton kernels for PyTorch."""
__version__ = "0.1.0"

from . import _runtime  # noqa: F401  (switches the Triton interpreter on when there is no GPU)
from . import nn, ops
from .inject import InjectConfig, inject_, refresh_, revert_
from .ops import attention, bmm, conv2d, linear, matmul, rms_norm, rope, swiglu_mlp

__all__ = ["ops", "nn", "matmul", "bmm", "linear", "conv2d", "attention", "rms_norm", "rope", "swiglu_mlp",
           "inject_", "revert_", "refresh_", "InjectConfig", "__version__"]
