"""RMSNorm: HF Llama's RMSNorm (LlamaRMSNorm) or Gemma's (GemmaRMSNorm, `1 + weight` in fp32) on dropin's kernels,
with the optional fused residual add."""
from typing import Optional

import torch
from torch import nn

from ..ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)` over the last dim, as LlamaRMSNorm computes it
    (same attribute names: weight, variance_epsilon); form "gemma": `(x_normed * (1 + weight)).to(x.dtype)` in fp32,
    as GemmaRMSNorm computes it (dropin.ops.rms_norm). forward(x, residual) returns (normed, x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None, form: str = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.form = form

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return rms_norm(x, self.weight, self.variance_epsilon, residual=residual, form=self.form)

    @classmethod
    def from_llama(cls, norm: nn.Module) -> "RMSNorm":
        """An RMSNorm sharing (not copying) the weight of a HF LlamaRMSNorm: its parameter dict, so that the weight
        read at each call is the one the norm holds then (FSDP2 swaps in the unsharded parameter for each step)."""
        return cls._sharing(norm, "variance_epsilon", "llama", "from_llama", "a LlamaRMSNorm")

    @classmethod
    def from_gemma(cls, norm: nn.Module) -> "RMSNorm":
        """As from_llama, for a HF GemmaRMSNorm (its `eps`, the weight an offset from 1)."""
        return cls._sharing(norm, "eps", "gemma", "from_gemma", "a GemmaRMSNorm")

    @classmethod
    def _sharing(cls, norm: nn.Module, eps_name: str, form: str, constructor: str, expected: str) -> "RMSNorm":
        weight, eps = getattr(norm, "weight", None), getattr(norm, eps_name, None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, (int, float)):
            raise ValueError(f"RMSNorm.{constructor}: argument 'norm' must have a 1-D 'weight' parameter and a "
                             f"'{eps_name}' ({expected}), got {type(norm).__name__}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._parameters = norm._parameters
        module.variance_epsilon = eps
        module.form = form
        return module

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, form={self.form}"
