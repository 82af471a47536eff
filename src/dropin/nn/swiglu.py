"""SwiGLUMLP: HF Llama's MLP (LlamaMLP) on dropin's fused SwiGLU kernels."""
import torch
import torch.nn.functional as F
from torch import nn

from ..ops.swiglu import swiglu_mlp


def _is_silu(act) -> bool:
    """True for a module computing SiLU: nn.SiLU, or transformers' own class (its name and home change
    between releases, so it is recognized by what it computes on a few numbers)."""
    if isinstance(act, nn.SiLU):
        return True
    if not isinstance(act, nn.Module):
        return False
    probe = torch.linspace(-8, 8, 33, dtype=torch.float64)
    try:
        return torch.allclose(act(probe), F.silu(probe), rtol=1e-12, atol=0)
    except Exception:  # noqa: BLE001  (an activation that cannot run on a CPU float64 vector is not SiLU here)
        return False


class SwiGLUMLP(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` with bias-free projections, as LlamaMLP computes it.

    The submodules carry LlamaMLP's names (gate_proj, up_proj, down_proj), so state dicts load either way.
    recompute: see dropin.ops.swiglu_mlp (False, the default: the gate and up projections are kept from the
    forward; True: the backward recomputes them, slower and lighter between forward and backward)."""

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None, recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        factory = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.recompute)

    @classmethod
    def from_llama(cls, mlp: nn.Module, recompute: bool = False) -> "SwiGLUMLP":
        """A SwiGLUMLP sharing (not copying) the projections of a HF LlamaMLP (or any module with
        gate_proj / up_proj / down_proj linears and a SiLU act_fn): training either trains both."""
        act = getattr(mlp, "act_fn", None)
        if not _is_silu(act):
            raise ValueError(f"SwiGLUMLP.from_llama: argument 'mlp' must use SiLU as act_fn, got "
                             f"{type(act).__name__}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(mlp, name, None)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"SwiGLUMLP.from_llama: argument 'mlp' needs an nn.Linear '{name}', "
                                 f"got {type(linear).__name__}")
            if linear.bias is not None:
                raise ValueError(f"SwiGLUMLP.from_llama: argument 'mlp' has a bias in '{name}' "
                                 f"(mlp_bias=True), which dropin's swiglu_mlp does not take")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.recompute = recompute
        module.gate_proj, module.up_proj, module.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        return module

    def extra_repr(self) -> str:
        return (f"hidden_size={self.gate_proj.in_features}, intermediate_size={self.gate_proj.out_features}, "
                f"recompute={self.recompute}")
