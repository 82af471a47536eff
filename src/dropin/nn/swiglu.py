"""SwiGLUMLP: HF Llama's MLP (LlamaMLP) on dropin's fused SwiGLU kernels, and the gated MLPs of the same shape with
another activation (Gemma's GELU-tanh)."""
import torch
from torch import nn

from ..ops.activations import ACTIVATIONS, activation_ref
from ..ops.swiglu import swiglu_mlp


def activation_of(act) -> str:
    """The dropin activation that the module `act` computes, or None: transformers' activation classes change names
    and homes between releases, so they are recognized by what they compute on a few numbers (float64, CPU)."""
    if not isinstance(act, nn.Module):
        return None
    probe = torch.linspace(-8, 8, 65, dtype=torch.float64)
    try:
        out = act(probe)
    except Exception:  # noqa: BLE001  (an activation that cannot run on a CPU float64 vector is not one of ours)
        return None
    return next((name for name in ACTIVATIONS if isinstance(out, torch.Tensor) and out.shape == probe.shape
                 and torch.allclose(out, activation_ref(probe, name), rtol=1e-9, atol=1e-12)), None)


class SwiGLUMLP(nn.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` with bias-free projections, as LlamaMLP computes it; with another
    `activation` in place of silu, the gated MLP of that activation (GemmaMLP: "gelu_tanh").

    The submodules carry LlamaMLP's names (gate_proj, up_proj, down_proj), so state dicts load either way.
    recompute: see dropin.ops.swiglu_mlp (False, the default: the gate and up projections are kept from the
    forward; True: the backward recomputes them, slower and lighter between forward and backward)."""

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None, recompute: bool = False,
                 activation: str = "silu"):
        super().__init__()
        self.recompute = recompute
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, self.recompute,
                          self.activation)

    @classmethod
    def from_llama(cls, mlp: nn.Module, recompute: bool = False) -> "SwiGLUMLP":
        """A SwiGLUMLP sharing (not copying) the projections of a HF LlamaMLP (or any module with
        gate_proj / up_proj / down_proj linears and a SiLU act_fn): training either trains both."""
        return cls._sharing(mlp, recompute, ("silu",), "from_llama")

    @classmethod
    def from_gated(cls, mlp: nn.Module, recompute: bool = False) -> "SwiGLUMLP":
        """As from_llama, for a gated MLP whose act_fn is any of dropin's activations (GemmaMLP: GELU-tanh)."""
        return cls._sharing(mlp, recompute, ACTIVATIONS, "from_gated")

    @classmethod
    def _sharing(cls, mlp: nn.Module, recompute: bool, activations: tuple, constructor: str) -> "SwiGLUMLP":
        act = getattr(mlp, "act_fn", None)
        activation = activation_of(act)
        if activation not in activations:
            raise ValueError(f"SwiGLUMLP.{constructor}: argument 'mlp' must use {' or '.join(activations)} as act_fn, "
                             f"got {type(act).__name__}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(mlp, name, None)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"SwiGLUMLP.{constructor}: argument 'mlp' needs an nn.Linear '{name}', "
                                 f"got {type(linear).__name__}")
            if linear.bias is not None:
                raise ValueError(f"SwiGLUMLP.{constructor}: argument 'mlp' has a bias in '{name}' "
                                 f"(mlp_bias=True), which dropin's swiglu_mlp does not take")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.recompute = recompute
        module.activation = activation
        module.gate_proj, module.up_proj, module.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        return module

    def extra_repr(self) -> str:
        return (f"hidden_size={self.gate_proj.in_features}, intermediate_size={self.gate_proj.out_features}, "
                f"activation={self.activation}, recompute={self.recompute}")
