"""SparseLinear / SparseConv2d: a pruned nn.Linear / nn.Conv2d with its weight compressed (dropin.ops.sparsify),
run by sparse_linear / sparse_conv2d; SparsifiedLinear / SparsifiedConv2d: the drop-ins that inject_ puts in
place of such modules."""
from typing import Optional

import torch
from torch.nn.utils import prune

from .. import _runtime
from ..ops import SparseWeight, sparse_conv2d, sparse_linear, sparsify
from ..ops._common import versions
from .module import DropinModule

NO_WEIGHT_GRAD = "sparse kernels have no weight gradient"


def _prune_hook(module: torch.nn.Module) -> Optional[prune.BasePruningMethod]:
    """The torch.nn.utils.prune forward pre-hook that computes module.weight, or None."""
    return next((h for h in module._forward_pre_hooks.values()
                 if isinstance(h, prune.BasePruningMethod) and h._tensor_name == "weight"), None)


def pruned(module: torch.nn.Module) -> bool:
    """Whether torch.nn.utils.prune masks module.weight (weight_orig * weight_mask, computed by a forward pre-hook)."""
    return _prune_hook(module) is not None


def weight_sources(module: torch.nn.Module) -> tuple:
    """The tensors module's weight comes from: (weight,), or (weight_orig, weight_mask) where pruned."""
    return (module.weight_orig, module.weight_mask) if pruned(module) else (module.weight,)


def masked_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight that module's forward uses now (a pruned module's mask applied to weight_orig afresh)."""
    hook = _prune_hook(module)
    return module.weight if hook is None else hook.apply_mask(module)


def weight_sparsity(module: torch.nn.Module) -> float:
    """The fraction of zeros in masked_weight(module)."""
    weight = masked_weight(module)
    return 1.0 - int(torch.count_nonzero(weight)) / max(1, weight.numel())


def trains_weight(module: torch.nn.Module) -> bool:
    """Whether module is in training mode with a weight tensor that requires grad (which sparse kernels cannot
    give a gradient)."""
    return module.training and any(t.requires_grad for t in weight_sources(module))


class _Sparse(torch.nn.Module):
    """A frozen weight kept in dropin's chunked CSR, as buffers (`.to()`, `.half()` and state_dict carry them),
    and the original's bias Parameter (which trains); `nbytes` counts the forward format, `sparsity` is the
    fraction of zeros."""

    def __init__(self, weight: SparseWeight, bias: Optional[torch.nn.Parameter]):
        super().__init__()
        self.shape, self.block_k, self.kernel = weight.shape, weight.block_k, weight.kernel
        self.register_buffer("values", weight.values)
        self.register_buffer("offsets", weight.offsets)
        self.register_buffer("chunk_ptr", weight.chunk_ptr)
        t = weight.transposed
        for name, tensor in (("t_values", t and t.values), ("t_offsets", t and t.offsets),
                             ("t_chunk_ptr", t and t.chunk_ptr)):
            self.register_buffer(name, tensor)
        self.bias = bias

    @property
    def weight(self) -> SparseWeight:
        """The compressed weight (a view of the buffers)."""
        weight = SparseWeight(self.values, self.offsets, self.chunk_ptr, self.shape, self.block_k,
                              kernel=self.kernel)
        if self.t_values is not None:
            weight.transposed = SparseWeight(self.t_values, self.t_offsets, self.t_chunk_ptr,
                                             weight._transposed_shape(), self.block_k, kernel=self.kernel)
        return weight

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    @property
    def sparsity(self) -> float:
        return 1.0 - self.weight.density


class SparseLinear(_Sparse):
    """y = x @ W^T + bias with W [out_features, in_features] in dropin's chunked CSR (see _Sparse)."""

    def __init__(self, weight: SparseWeight, bias: Optional[torch.nn.Parameter] = None):
        super().__init__(weight, bias)
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, block_k: int = 256, transpose: bool = True) -> "SparseLinear":
        """From an nn.Linear whose weight has zeros where pruned (plain zeros, or a torch.nn.utils.prune'd
        module, whose mask is applied to weight_orig afresh); shares its bias Parameter. transpose=False: inference
        only (half the compressed bytes, no gradient of x)."""
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"SparseLinear.from_linear: argument 'linear' must be a torch.nn.Linear, "
                             f"got {type(linear).__name__}")
        return cls(sparsify(masked_weight(linear), block_k=block_k, transpose=transpose), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"sparsity={self.sparsity:.3f}, nbytes={self.nbytes}")


class SparseConv2d(_Sparse):
    """F.conv2d with the weight [out_channels, in_channels / groups, kH, kW] in dropin's chunked CSR (see
    _Sparse); stride, padding, dilation and groups as nn.Conv2d's (zero padding)."""

    def __init__(self, weight: SparseWeight, bias: Optional[torch.nn.Parameter] = None, stride=1, padding=0,
                 dilation=1, groups: int = 1):
        super().__init__(weight, bias)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups

    @classmethod
    def from_conv(cls, conv: torch.nn.Conv2d, block_k: int = 256, transpose: bool = True) -> "SparseConv2d":
        """From an nn.Conv2d (zero padding) whose weight has zeros where pruned, as SparseLinear.from_linear."""
        if not isinstance(conv, torch.nn.Conv2d) or conv.padding_mode != "zeros":
            raise ValueError(f"SparseConv2d.from_conv: argument 'conv' must be a torch.nn.Conv2d with zero padding, "
                             f"got {conv!r}")
        weight = sparsify(masked_weight(conv), block_k=block_k, transpose=transpose, groups=conv.groups)
        return cls(weight, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (f"{self.weight.conv_shape}, stride={self.stride}, padding={self.padding}, dilation={self.dilation}, "
                f"groups={self.groups}, bias={self.bias is not None}, sparsity={self.sparsity:.3f}, "
                f"nbytes={self.nbytes}")


class _Sparsified(DropinModule):
    """Drop-in for a module whose weight is mostly zeros (plain zeros, or masked by torch.nn.utils.prune): a
    sparse module (`impl`, a plain attribute, built by `build`) on a compressed copy of the weight that the
    original's forward uses. state_dict keeps the original's keys and values (weight or weight_orig and
    weight_mask, bias): the copy is not in it, and it is compressed again when a tensor it comes from changes
    (load_state_dict, .to(), .half(), an in-place update). The weight is frozen (the bias trains): a forward
    that would need its gradient (training mode, grad enabled, a weight tensor requiring grad) raises."""

    build = None  # original -> the sparse module
    op = ""

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        self._key = None
        self.refresh_()
        self.kernel = (f"{self.op} ({self.impl.sparsity:.1%} zeros, "
                       f"{self.impl.nbytes / max(1, self.impl.weight.dense_nbytes):.2f}x weight bytes)")

    def refresh_(self) -> None:
        """Compresses the weight again if a tensor it comes from changed."""
        key = versions(*weight_sources(self.original), self.original.bias)
        if key is None or key != self._key:
            object.__setattr__(self, "impl", type(self).build(self.original))  # not a submodule
            self._key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and trains_weight(self.original):
            raise RuntimeError(f"{type(self).__name__}: {NO_WEIGHT_GRAD}; freeze the weight (requires_grad_(False)), "
                               f"call eval() or run under torch.no_grad()")
        if not (torch.compiler.is_compiling() or _runtime.capturing()):  # (compressing syncs with the host)
            self.refresh_()
        return self.impl(x)


class SparsifiedLinear(_Sparsified):
    """inject_'s drop-in for a mostly-zero nn.Linear (see _Sparsified)."""
    build, op = SparseLinear.from_linear, "sparse_linear"


class SparsifiedConv2d(_Sparsified):
    """inject_'s drop-in for a mostly-zero nn.Conv2d (see _Sparsified)."""
    build, op = SparseConv2d.from_conv, "sparse_conv2d"
