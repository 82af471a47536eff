"""SparseLinear: a pruned nn.Linear with its weight compressed (dropin.ops.sparsify), run by sparse_linear;
SparsifiedLinear: the drop-in that inject_ puts in place of such an nn.Linear."""
from typing import Optional

import torch
from torch.nn.utils import prune

from ..ops import SparseWeight, sparse_linear, sparsify
from .module import DropinModule

NO_WEIGHT_GRAD = "sparse kernels have no weight gradient"


def _prune_hook(linear: torch.nn.Module) -> Optional[prune.BasePruningMethod]:
    """The torch.nn.utils.prune forward pre-hook that computes linear.weight, or None."""
    return next((h for h in linear._forward_pre_hooks.values()
                 if isinstance(h, prune.BasePruningMethod) and h._tensor_name == "weight"), None)


def pruned(linear: torch.nn.Module) -> bool:
    """Whether torch.nn.utils.prune masks linear.weight (weight_orig * weight_mask, computed by a forward pre-hook)."""
    return _prune_hook(linear) is not None


def weight_sources(linear: torch.nn.Module) -> tuple:
    """The tensors linear's weight comes from: (weight,), or (weight_orig, weight_mask) where pruned."""
    return (linear.weight_orig, linear.weight_mask) if pruned(linear) else (linear.weight,)


def masked_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The weight that linear's forward uses now (a pruned module's mask applied to weight_orig afresh)."""
    hook = _prune_hook(linear)
    return linear.weight if hook is None else hook.apply_mask(linear)


def weight_sparsity(linear: torch.nn.Module) -> float:
    """The fraction of zeros in masked_weight(linear)."""
    weight = masked_weight(linear)
    return 1.0 - int(torch.count_nonzero(weight)) / max(1, weight.numel())


def trains_weight(linear: torch.nn.Module) -> bool:
    """Whether linear is in training mode with a weight tensor that requires grad (which sparse kernels cannot
    give a gradient)."""
    return linear.training and any(t.requires_grad for t in weight_sources(linear))


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
        module, whose mask is applied to weight_orig afresh); shares its bias Parameter. transpose=False: inference
        only (half the compressed bytes, no gradient of x)."""
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"SparseLinear.from_linear: argument 'linear' must be a torch.nn.Linear, "
                             f"got {type(linear).__name__}")
        return cls(sparsify(masked_weight(linear), block_k=block_k, transpose=transpose), linear.bias)

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


class SparsifiedLinear(DropinModule):
    """Drop-in for an nn.Linear whose weight is mostly zeros (plain zeros, or masked by torch.nn.utils.prune):
    a SparseLinear (`impl`, a plain attribute) on a compressed copy of the weight that the original's forward
    uses. state_dict keeps the original's keys and values (weight or weight_orig and weight_mask, bias): the
    copy is not in it, and it is compressed again when a tensor it comes from changes (load_state_dict, .to(),
    .half(), an in-place update). The weight is frozen (the bias trains): a forward that would need its
    gradient (training mode, grad enabled, a weight tensor requiring grad) raises."""

    def __init__(self, original: torch.nn.Linear):
        super().__init__(original)
        self._key = None
        self._refresh()
        self.kernel = (f"sparse_linear ({self.impl.sparsity:.1%} zeros, "
                       f"{self.impl.nbytes / max(1, self.impl.weight.dense_nbytes):.2f}x weight bytes)")

    def _refresh(self) -> None:
        tensors = (*weight_sources(self.original), self.original.bias)
        key = tuple(t if t is None else (id(t), t.data_ptr(), t._version, t.dtype, t.device) for t in tensors)
        if key != self._key:
            object.__setattr__(self, "impl", SparseLinear.from_linear(self.original))  # not a submodule
            self._key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and trains_weight(self.original):
            raise RuntimeError(f"SparsifiedLinear: {NO_WEIGHT_GRAD}; freeze the weight (requires_grad_(False)), "
                               f"call eval() or run under torch.no_grad()")
        self._refresh()
        return self.impl(x)
