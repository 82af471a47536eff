"""nn.Module drop-ins built on dropin.ops; each can adopt a HF module's parameters without copying them."""
from . import sdpa_attention, timm_attention  # noqa: F401  (HF's attention on its sdpa interface, timm's attention)
from .attention import CvtSelfAttention, RotaryAttention
from .causal_lm import CausalLMForward
from .conv import Conv2d, ConvBNAct
from .convnext import ConvNeXtBlock
from .conv1d import Conv1d
from .functional import Op, Routed
from .group_norm import GroupNorm
from .linear import Linear, TransposedLinear
from .module import Adopted, Derived, DropinModule, Folded
from .resnet import ResidualBlock
from .rms_norm import RMSNorm
from .sparse import SparseConv2d, SparseLinear, SparsifiedConv2d, SparsifiedLinear
from .swiglu import SwiGLUMLP
from .swin import MaxVitAttention, WindowAttention
from .traced import TracedBlock
from .transformer import MultiheadAttention, TransformerEncoder, TransformerEncoderLayer

__all__ = ["Adopted", "CausalLMForward", "Conv1d", "Conv2d", "ConvBNAct", "ConvNeXtBlock", "CvtSelfAttention",
           "MaxVitAttention",
           "Derived", "DropinModule", "Folded", "GroupNorm", "Linear", "MultiheadAttention", "Op", "ResidualBlock",
           "RMSNorm", "RotaryAttention", "Routed", "SparseConv2d", "SparseLinear", "SparsifiedConv2d",
           "SparsifiedLinear", "SwiGLUMLP", "TracedBlock", "TransformerEncoder", "TransformerEncoderLayer",
           "TransposedLinear", "WindowAttention"]
