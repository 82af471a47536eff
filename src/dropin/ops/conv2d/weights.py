"""conv2d's weights: a BatchNorm folded into a conv's weight and bias, and the cache of weight copies in the layouts
the kernels read fastest (`derived`)."""
import weakref
from typing import Optional

import torch

from ... import _runtime
from .. import _autotune
from .._common import versions


def fold_batchnorm(conv_weight: torch.Tensor, conv_bias: Optional[torch.Tensor],
                   bn: torch.nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) of one conv equal to conv -> bn with bn's running statistics (inference BatchNorm):
    weight * s per output channel and (bias - running_mean) * s + beta, s = gamma / sqrt(running_var + eps).
    Computed in float32, returned in the weight's dtype and layout; new tensors (bn is not changed), differentiable
    with respect to the conv's and bn's tensors (fine-tuning with a frozen BatchNorm)."""
    if bn.running_mean is None or bn.running_var is None:
        raise RuntimeError("fold_batchnorm: argument 'bn' tracks no running statistics "
                           "(track_running_stats=False); only an inference BatchNorm folds into a conv")
    if bn.num_features != conv_weight.shape[0]:
        raise RuntimeError(f"fold_batchnorm: argument 'bn' has {bn.num_features} features but 'conv_weight' has "
                           f"{conv_weight.shape[0]} output channels")
    scale = torch.rsqrt(bn.running_var.float() + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.float()
    shift = -bn.running_mean.float() if conv_bias is None else conv_bias.float() - bn.running_mean.float()
    shift = shift * scale + (bn.bias.float() if bn.bias is not None else 0.0)
    weight = (conv_weight.float() * scale.view(-1, 1, 1, 1)).to(conv_weight.dtype)
    return weight, shift.to(conv_weight.dtype)


_DERIVED: dict = {}


def frozen(t: torch.Tensor) -> torch.Tensor:
    """Marks t, a tensor dropin made and never writes again (a folded weight), as one whose derived copies may be
    cached (`derived`); returns it."""
    t._dropin_frozen = True
    return t


def keeps_copies(w: torch.Tensor, traced: bool) -> bool:
    """Whether `derived` keeps w's copies (else it makes them anew on every call: see there; nor while launches
    warm up, `_autotune.compile_ahead`: no kernel writes the copy)."""
    return (isinstance(w, torch.nn.Parameter) or getattr(w, "_dropin_frozen", False)) and not traced \
        and not _runtime.capturing() and not w.requires_grad and not _autotune.warming_up()


def derived(w: torch.Tensor, kind: str, make, traced: bool) -> torch.Tensor:
    """make(w): a copy of a weight in the layout a kernel reads fastest, made once per version of the weight's
    data (`_common.versions`; every call for an inference tensor) and kept while the weight lives. Only for
    parameters and `frozen` tensors in eager calls; made anew for any other (compiled code reuses its buffers and
    writes them without bumping their version: torch.compile of an injected CvT read a stale copy of a folded
    weight), traced (the copy is part of the compiled graph) and during a CUDA graph capture (the copy is
    captured, so that each replay reads the weight as it is then: a kept one goes stale, or is freed), and for
    weights that require grad: FSDP2 gathers each step's weights into the same tensor without bumping its version
    (tests/test_distributed.py: the convs then read an earlier step's weights, in training and in no-grad calls
    between steps), so a trainable weight's copy is made anew in every eager call (frozen weights keep theirs)."""
    if not keeps_copies(w, traced):
        return make(w)
    key = (id(w), kind)
    hit = _DERIVED.get(key)
    version = versions(w)
    if hit is not None and hit[0]() is w and version is not None and hit[1] == version:
        return hit[2]
    out = make(w)
    if version is not None:
        _DERIVED[key] = (weakref.ref(w, lambda _, key=key: _DERIVED.pop(key, None)), version, out)
    return out
