"""Other libraries' versions of a whole model, the peer rows of `dropin inject --bench` (bench.models.PEERS).

`liger`: Liger-Kernel's HF Llama (apply_liger_kernel_to_llama: its RoPE, RMSNorm and SwiGLU kernels, and with a
loss its fused linear + cross-entropy). An optional dependency: `pip install liger-kernel` (dropin's `peers`
extra); without it, and under the interpreter (its kernels need a GPU), the row says why and the others run.
"""
from __future__ import annotations

import copy
import functools

from torch import nn

from .. import _runtime
from . import harness

LIGER_MISSING = "Liger-Kernel is not installed (pip install liger-kernel, or dropin's `peers` extra)"


_ABSENT = object()  # a name the module did not have


def _assign(module, values: dict) -> None:
    """Sets each name of `values` on `module` (a Python module), deleting those whose value is _ABSENT."""
    for name, value in values.items():
        if value is _ABSENT:
            vars(module).pop(name, None)
        else:
            vars(module)[name] = value


def module_patches(module, patch) -> dict:
    """Runs patch() and undoes what it set on `module` (a Python module); returns {name: the value patch() set}."""
    before = dict(vars(module))
    patch()
    patched = {k: v for k, v in vars(module).items() if before.get(k, _ABSENT) is not v}
    _assign(module, {name: before.get(name, _ABSENT) for name in patched})
    return patched


def with_patches(model: nn.Module, module, patched: dict) -> nn.Module:
    """`model`, its forward now running with `patched` set on `module` and restoring the module's own values after:
    the patches of a library that sets them module-wide reach this model only."""
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        saved = {name: vars(module).get(name, _ABSENT) for name in patched}
        _assign(module, patched)
        try:
            return inner(*args, **kwargs)
        finally:
            _assign(module, saved)

    model.forward = forward
    return model


def liger_llama(original: nn.Module, loss: bool) -> nn.Module:
    """A copy of the HF Llama `original` (LlamaModel or LlamaForCausalLM) with Liger-Kernel's kernels: RoPE,
    RMSNorm, SwiGLU and, with `loss` (a LlamaForCausalLM called with labels), its fused linear + cross-entropy.
    Liger replaces functions of transformers' llama module for every model in the process (RoPE's among them):
    here they are set for the copy's calls only, so that the rows of the original run torch's code.
    Raises harness.Skipped where Liger-Kernel cannot run."""
    apply = harness.optional("liger_kernel.transformers", "apply_liger_kernel_to_llama")
    if apply is None:
        raise harness.Skipped(LIGER_MISSING)
    if _runtime.INTERPRET:
        raise harness.Skipped("skipped: interpreter")
    from transformers.models.llama import modeling_llama

    model = copy.deepcopy(original)
    patched = module_patches(modeling_llama, lambda: apply(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                                          fused_linear_cross_entropy=loss, model=model))
    return with_patches(model, modeling_llama, patched)
