"""Handlers keyed by module type: each turns one torch module into a dropin module, or says why it cannot.

A handler is `fn(module, site) -> DropinModule | str` (the str is the reason the module stays torch), registered
for types with `@register(Type, ..., op="conv2d")` in the file of its model family. `op` names the dropin
op the handler uses (InjectConfig.ops can switch it off); op=None marks a handler that only explains why a type
stays torch. A subclass without a handler of its own is handled as its nearest registered base where it computes
as that base (`computes_as`: the same forward, whatever the class's name), else stays torch.
"""
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .. import _runtime

HANDLERS: dict = {}  # type -> (op, fn)
CHAINS: dict = {}  # parent type -> [names of children that its forward runs one after the other, ...]


def register(*types, op: Optional[str]):
    def decorate(fn: Callable):
        for t in types:
            HANDLERS[t] = (op, fn)
        return fn
    return decorate


def chain(parent_type: type, *names: str) -> None:
    """Declares that `parent_type`'s forward runs these children in this order, each on the previous one's
    output alone (so they may fuse, as in an nn.Sequential)."""
    CHAINS.setdefault(parent_type, []).append(names)


def ops() -> set:
    """Names of the ops that the registered handlers use."""
    return {op for op, _ in HANDLERS.values() if op is not None}


@dataclass
class Site:
    """Where a module sits: its parent, its name there, its dotted path in the model, and the config."""
    parent: torch.nn.Module
    name: str
    path: str
    config: "InjectConfig"  # noqa: F821  (api.InjectConfig)

    def following(self) -> list:
        """(name, module) of the siblings that run right after this module, on its output alone: those after it
        in an nn.Sequential (one whose forward is nn.Sequential's) or in a declared chain; [] elsewhere."""
        parent = self.parent
        if isinstance(parent, torch.nn.Sequential) and type(parent).forward is torch.nn.Sequential.forward:
            names = list(parent._modules)
        else:
            names = next((c for c in CHAINS.get(type(parent), ()) if self.name in c), [self.name])
        return [(n, parent._modules[n]) for n in names[names.index(self.name) + 1:]]


def _tensor_reason(module: torch.nn.Module, config) -> Optional[str]:
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if not t.is_floating_point():
            continue
        if t.dtype not in config.dtypes:
            return f"'{name}' is {t.dtype}; the config allows {[str(d) for d in config.dtypes]}"
        if t.device.type != _runtime.KERNEL_DEVICE:
            return f"'{name}' is on {t.device}; dropin kernels run on {_runtime.KERNEL_DEVICE} tensors here"
    return None


_FORWARDS = ("forward", "_conv_forward")  # the methods through which torch.nn's layers compute


def computes_as(module: torch.nn.Module, base: type) -> bool:
    """Whether `module` is a `base` whose class keeps base's forward (and the helper it calls: Conv2d's
    _conv_forward), e.g. nn.MultiheadAttention's NonDynamicallyQuantizableLinear for nn.Linear."""
    kind = type(module)
    return isinstance(module, base) and all(getattr(kind, f, None) is getattr(base, f, None) for f in _FORWARDS)


def handle(module: torch.nn.Module, site: Site) -> Union[torch.nn.Module, str]:
    """The dropin module for `module` at `site`, or the reason it stays torch."""
    kind = type(module)
    base = next((t for t in kind.__mro__ if t in HANDLERS), None)
    if base is None:
        return f"no dropin handler for {kind.__name__}"
    if not computes_as(module, base):
        return f"a subclass of {base.__name__} with a forward of its own: no handler for {kind.__name__} itself"
    op, fn = HANDLERS[base]
    if op is not None:
        if not site.config.uses(op):
            return f"op '{op}' is switched off by the config"
        reason = _tensor_reason(module, site.config)
        if reason:
            return reason
    return fn(module, site)


PASSIVE: dict = {}  # type -> fn(module) -> True while the module computes nothing (such modules are not reported)


def passive(*types, when: Callable = lambda module: True):
    for t in types:
        PASSIVE[t] = when


def is_passive(module: torch.nn.Module) -> bool:
    when = PASSIVE.get(type(module))
    return when is not None and when(module)


DEFERRED: dict = {}  # module name -> [functions that register handlers for that module's classes]


def when_imported(module_name: str):
    """Defers a handler file's registrations for an optional library until inject_ runs after `module_name` was
    imported (a model of its classes has imported it): `import dropin` does not import transformers (seconds)."""
    def decorate(fn: Callable):
        DEFERRED.setdefault(module_name, []).append(fn)
        return fn
    return decorate


def load_deferred() -> None:
    """Runs the deferred registrations whose module has been imported (each once)."""
    for name in [n for n in DEFERRED if n in sys.modules]:
        for fn in DEFERRED.pop(name):
            fn()
