"""The base of every module that inject_ puts in place of a torch module, the holder of the values a drop-in derives
from the original's tensors, and the stand-in for fused modules."""
import torch


class Derived(torch.nn.Module):
    """Values a drop-in computes from the original's tensors (a BatchNorm folded into a conv's weight), as
    non-persistent buffers: `.to()` moves them, state_dict leaves them out (its keys stay the original's), and
    torch.compile and CUDA graphs see them as the module's own static tensors. `set` writes a value into the
    existing buffer where shape, dtype and device agree (a captured graph keeps reading it), else registers it anew.
    """

    def set(self, name: str, value: torch.Tensor) -> None:
        current = self._buffers.get(name)
        if current is not None and (current.shape, current.dtype, current.device) == (
                value.shape, value.dtype, value.device) and current.stride() == value.stride():
            with torch.no_grad():
                current.copy_(value)
        else:
            self.register_buffer(name, value.detach(), persistent=False)

    def forward(self, *args):
        raise RuntimeError("Derived holds a drop-in's derived tensors; it is not called")


def _refresh_after_load(module, incompatible_keys) -> None:
    """load_state_dict's post-hook of a drop-in (module level: an injected model pickles with torch.save)."""
    module.refresh_()


class DropinModule(torch.nn.Module):
    """A drop-in for one torch module (`original`), which it keeps for `revert_` without registering it.

    The original's parameter and buffer dicts are shared, not copied: the drop-in has the same tensors under the
    same names, so `state_dict()` has the original keys and values, nothing is counted twice, and
    `load_state_dict`, `.to()`, `.half()` and optimizers act on the original's own tensors (after any of them
    the original is current: revert_ copies nothing). `train()` / `eval()` set the original's flag too.
    Subclasses set `kernel` (what runs, for the report) and `absorbs` (names of the following siblings in an
    nn.Sequential that this module computes too; inject_ puts a `Folded` stand-in in their slots). A subclass that
    keeps the original's children as its own and runs them sets `walks_children`: the base adopts those children
    under their names (`_adopt_children`) and inject_ then injects them by their own handlers. A subclass that derives values from the original's tensors keeps them in a
    `Derived` child and recomputes them in `refresh_`, which inject_, load_state_dict and dropin.refresh_ call.
    """

    kernel = "dropin"
    walks_children = False

    def __init__(self, original: torch.nn.Module, absorbs: tuple = ()):
        super().__init__()
        object.__setattr__(self, "original", original)  # a plain attribute: not a submodule
        self._parameters = original._parameters
        self._buffers = original._buffers
        self._non_persistent_buffers_set = original._non_persistent_buffers_set
        self._version = original._version  # state_dict metadata as the original writes it
        self.training = original.training
        self.absorbs = tuple(absorbs)
        self.register_load_state_dict_post_hook(_refresh_after_load)
        if self.walks_children:
            self._adopt_children()

    def _adopt_children(self) -> None:
        """Registers the original's children as this module's, under their names (shared, not copied)."""
        for name, child in self.original.named_children():
            self.add_module(name, child)

    def __getattr__(self, name: str):
        """The original's public attributes that the drop-in lacks (a user's forward may read `norm.eps` or
        `proj.in_features` and call a functional op itself): read from the original. Private names and the
        original's children are not forwarded: torch's and other libraries' probes of a module's own state stay the
        drop-in's, and a drop-in that adopts the original's children registers them under their names."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None or name.startswith("_") or name in original._modules:
                raise
            return getattr(original, name)

    def __bool__(self) -> bool:
        """True, as any module. Spelled out for torch.compile: without it Dynamo (torch 2.11) tests a module's
        truth (HF's `if self.normalization:`) by looking up __bool__ and __len__ through this class's __getattr__,
        and guards each failed lookup on every call."""
        return True

    def _weight_bias(self) -> tuple:
        """(weight, bias) as the original holds them now (None where it has none), read from the parameter dict.
        A drop-in's forward reads its tensors and children from the module's dicts or through the original, not as
        its own attributes: this class's own __getattr__ is traced by torch.compile (nn.Module's is read directly),
        and each lookup through it adds guards that every compiled call checks (about 60 us a decoding step of a
        4-layer Llama). (TransformerEncoderLayer's drop-in runs torch's own blocks on itself: those still do.)"""
        parameters = self._parameters
        return parameters.get("weight"), parameters.get("bias")

    def refresh_(self) -> None:
        """Recomputes the values this module derives from the original's tensors, in place (none here)."""

    def train(self, mode: bool = True):
        self.original.training = mode
        return super().train(mode)

    def _load_from_state_dict(self, *args, **kwargs):
        # the original's rules (its pre-hooks, BatchNorm's old-checkpoint handling) on the shared tensors
        self.original._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__} -> {self.kernel}"


class Folded(DropinModule):
    """Stands in the slot of a module whose work a preceding drop-in does (a BatchNorm folded into a conv, an
    activation fused into its epilogue): the identity, holding the original's tensors for state_dict."""

    kernel = "fused"

    def __init__(self, original: torch.nn.Module, into: str):
        super().__init__(original)
        self.into = into

    def forward(self, x):
        return x

    def extra_repr(self) -> str:
        return f"{type(self.original).__name__} fused into '{self.into}'"


class Adopted(DropinModule):
    """A drop-in for `original` that runs `impl`: a dropin nn module built on the original's own tensors by one of
    its from_* constructors (SwiGLUMLP.from_llama, RMSNorm.from_gemma, ...). The original's children stay children here
    (not `impl`'s), so state_dict keys are the original's."""

    def __init__(self, original: torch.nn.Module, impl: torch.nn.Module, kernel: str):
        super().__init__(original)
        object.__setattr__(self, "impl", impl)  # a plain attribute: its tensors are registered as the original's
        self._adopt_children()
        self.kernel = kernel

    def forward(self, *args, **kwargs):
        return self.impl(*args, **kwargs)
