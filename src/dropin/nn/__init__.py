"""nn.Module drop-ins built on dropin.ops; each can adopt a HF module's parameters without copying them."""
from .rms_norm import RMSNorm
from .swiglu import SwiGLUMLP

__all__ = ["RMSNorm", "SwiGLUMLP"]
