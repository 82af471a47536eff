"""SparseLinear: a pruned nn.Linear with its weight compressed (dropin.ops.sparsify), run by sparse_linear."""
from typing import Optional

import torch

from ..ops import SparseWeight, sparse_linear, sparsify


class SparseLinear(torch.nn.Module):
    """y = x @ W^T + bias with W [out_features, in_features] kept in dropin's chunked CSR; W is frozen, the
    bias (the original's own Parameter when built by `from_linear`) trains. The compressed tensors are
    buffers (`.to()`, `.half()` and state_dict carry them); `nbytes` counts the forward format, `sparsity`
    is the fraction of zeros."""

    def __init__(self, weight: SparseWeight, bias: Optional[torch.nn.Parameter] = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block_k = weight.block_k
        self.register_buffer("values", weight.values)
        self.register_buffer("offsets", weight.offsets)
        self.register_buffer("chunk_ptr", weight.chunk_ptr)
        t = weight.transposed
        for name, tensor in (("t_values", t and t.values), ("t_offsets", t and t.offsets),
                             ("t_chunk_ptr", t and t.chunk_ptr)):
            self.register_buffer(name, tensor)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, block_k: int = 256, transpose: bool = True) -> "SparseLinear":
        """From an nn.Linear whose weight has zeros where pruned (plain zeros, or a torch.nn.utils.prune'd
        module, whose `weight` is already masked); shares its bias Parameter. transpose=False: inference
        only (half the compressed bytes, no gradient of x)."""
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"SparseLinear.from_linear: argument 'linear' must be a torch.nn.Linear, "
                             f"got {type(linear).__name__}")
        return cls(sparsify(linear.weight, block_k=block_k, transpose=transpose), linear.bias)

    @property
    def weight(self) -> SparseWeight:
        """The compressed weight (a view of the buffers)."""
        shape = (self.out_features, self.in_features)
        t = None if self.t_values is None else SparseWeight(self.t_values, self.t_offsets, self.t_chunk_ptr,
                                                              shape[::-1], self.block_k)
        return SparseWeight(self.values, self.offsets, self.chunk_ptr, shape, self.block_k, t)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def sparsity(self) -> float:
        return 1.0 - self.weight.density

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sparsity={self.sparsity:.3f}, nbytes={self.nbytes}")
