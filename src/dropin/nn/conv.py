"""Drop-ins for torch.nn.Conv2d: dropin.ops.conv2d, alone or with a BatchNorm2d folded in (ConvBNAct)."""
import sys
from typing import Optional

import torch

from .. import _runtime
from ..ops import conv2d, fold_batchnorm
from ..ops._common import versions
from ..ops.conv2d import frozen
from ..ops.activations import activation_ref
from .module import Derived, DropinModule


def _is_dtensor(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (without importing torch.distributed.tensor: none exists before it is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


class Conv2d(DropinModule):
    """`activation(conv(x) + residual)` for an nn.Conv2d (zeros padding; its own weight and bias), one kernel."""

    def __init__(self, original: torch.nn.Conv2d, activation: Optional[str] = None, absorbs: tuple = ()):
        super().__init__(original, absorbs)
        self.activation = activation
        self.kernel = "conv2d" + (f"+{activation}" if activation else "")

    def _conv(self, x, weight, bias, activation, residual, out=None):
        c = self.original
        return conv2d(x, weight, bias, c.stride, c.padding, c.dilation, c.groups, activation, residual, out=out)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """out: see dropin.ops.conv2d (inference only)."""
        return self._conv(x, *self._weight_bias(), self.activation, residual, out)


class ConvBNAct(Conv2d):
    """`activation(bn(conv(x)) + residual)` for an nn.Conv2d and the BatchNorm2d after it.

    While `bn` is in eval mode: one conv kernel with the BatchNorm folded into its weight and bias, kept in
    `derived` (buffers made at inject time). In eager mode a change of a source tensor (an in-place update,
    load_state_dict, .to()) folds again into the same buffers before the call; under torch.compile and inside a
    CUDA graph the buffers are read as they are: `refresh_` (load_state_dict and dropin.refresh_ call it) folds
    again. Where autograd needs the fold (a source requires grad), it is computed in the call, and so it is where
    the modules hold other parameters than those of the last refresh_ (FSDP2 swaps in the unsharded parameters
    for each step, gathered into the same memory with their version counters kept: no sign of the change that a
    kept fold could be checked against). In training mode BatchNorm uses batch statistics, which cannot fold: the
    dropin conv, then `bn` itself (torch), then the residual add and activation (torch). `bn` is a plain
    attribute: it stays registered where it was (a sibling, or the block around both).
    """

    def __init__(self, original: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d, activation: Optional[str] = None,
                 absorbs: tuple = ()):
        super().__init__(original, activation, absorbs)
        object.__setattr__(self, "bn", bn)
        self.kernel = "conv2d+bn" + (f"+{activation}" if activation else "")
        self.derived = Derived()
        self.refresh_()

    def _sources(self) -> tuple:
        bn = self.bn  # (the modules' dicts read directly: see DropinModule._weight_bias)
        return (*self._weight_bias(), bn._parameters.get("weight"), bn._parameters.get("bias"),
                bn._buffers.get("running_mean"), bn._buffers.get("running_var"))

    def refresh_(self) -> None:
        """Folds the BatchNorm's current statistics and affine parameters into the conv's weight and bias again, for
        the parameters the modules hold now (the kept fold serves these alone). Sharded parameters (DTensors, an
        FSDP2 model's between its steps) are not folded: the calls fold the unsharded ones."""
        sources = self._sources()
        object.__setattr__(self, "_own", sources[:4])
        if _is_dtensor(sources[0]):
            return
        with torch.no_grad():
            weight, bias = fold_batchnorm(*sources[:2], self.bn)
        derived = self._modules["derived"]
        derived.set("weight", weight)
        derived.set("bias", bias)
        frozen(derived.weight)
        # the source tensors stay referenced with their versions, so a new tensor cannot reuse their address
        object.__setattr__(self, "_folded_from", ([t for t in sources if t is not None], versions(*sources),
                                                  self.bn.eps))

    def _folded(self):
        sources, own = self._sources(), self._own
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in sources) or not (
                sources[0] is own[0] and sources[1] is own[1] and sources[2] is own[2] and sources[3] is own[3]):
            return fold_batchnorm(*sources[:2], self.bn)
        if not (torch.compiler.is_compiling() or _runtime.capturing()):
            key = versions(*sources)
            if key is None or key != self._folded_from[1] or self.bn.eps != self._folded_from[2]:
                self.refresh_()
        derived = self._modules["derived"]
        return derived.weight, derived.bias

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.bn.training:
            return self._conv(x, *self._folded(), self.activation, residual, out)
        y = self.bn(self._conv(x, *self._weight_bias(), None, None))
        if not torch.compiler.is_compiling():
            # batch statistics moved the running ones, which does not always bump their versions: fold again
            object.__setattr__(self, "_folded_from", (None, None, None))
        y = activation_ref(y if residual is None else y + residual, self.activation)
        return y if out is None else out.copy_(y)
