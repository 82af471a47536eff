"""RMSNorm: HF Llama's RMSNorm (LlamaRMSNorm) on dropin's kernels, with the optional fused residual add."""
from typing import Optional

import torch
from torch import nn

from ..ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` over the last dim, as LlamaRMSNorm computes it
    (same attribute names: weight, variance_epsilon). forward(x, residual) returns (normed, x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return rms_norm(x, self.weight, self.variance_epsilon, residual=residual)

    @classmethod
    def from_llama(cls, norm: nn.Module) -> "RMSNorm":
        """An RMSNorm sharing (not copying) the weight of a HF LlamaRMSNorm: its parameter dict, so that the weight
        read at each call is the one the norm holds then (FSDP2 swaps in the unsharded parameter for each step)."""
        weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
            raise ValueError(f"RMSNorm.from_llama: argument 'norm' must have a 1-D 'weight' parameter and a "
                             f"'variance_epsilon' (a LlamaRMSNorm), got {type(norm).__name__}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._parameters = norm._parameters
        module.variance_epsilon = eps
        return module

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
