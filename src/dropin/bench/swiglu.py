"""Suite "swiglu": HF Llama's MLP, dropin.ops.swiglu_mlp vs HF's LlamaMLP in eager mode, torch.compile and
Liger-Kernel (its LigerSwiGLUMLP computation: two linears, its fused silu * mul kernel, the down linear).

Full cases (GPU): seed 002 (2 x 1024 tokens, 1024 -> 11008, fp32), Llama-7B (4096 tokens, 4096 -> 11008,
bf16), Llama-3-8B (8192 tokens, 4096 -> 14336, bf16), each forward and forward + backward (the output and
the gradients of x and the three weights, for a random upstream gradient; there also dropin_recompute,
which recomputes g and u in its backward instead of keeping them: recompute=True). The MiB column is the peak
memory a call allocates beyond its inputs. Quick cases (interpreter, or --quick): tiny shapes.
Without transformers the eager row runs swiglu_mlp_ref, the same computation (tests check it against HF).
"""
import math

import torch
import torch.nn.functional as F

from dropin.ops import swiglu_mlp
from dropin.ops.swiglu import swiglu_mlp_ref

from .harness import TORCH_DTYPES, Case, allow_tf32, compiled, optional, optional_provider, randn, with_backward


def _hf_mlp(hidden: int, intermediate: int):
    """HF's LlamaMLP.forward on the case's weights (torch.func.functional_call on a weightless module)."""
    mlp_class, config_class = (optional("transformers.models.llama.modeling_llama", "LlamaMLP"),
                               optional("transformers", "LlamaConfig"))
    if mlp_class is None or config_class is None:
        return swiglu_mlp_ref
    config = config_class(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=1,
                          num_key_value_heads=1)
    with torch.device("meta"):
        mlp = mlp_class(config)

    def eager(x, gate_weight, up_weight, down_weight):
        weights = {"gate_proj.weight": gate_weight, "up_proj.weight": up_weight, "down_proj.weight": down_weight}
        return torch.func.functional_call(mlp, weights, (x,))
    return eager


def _liger():
    def mlp(silu_mul):
        return lambda x, gate_weight, up_weight, down_weight: F.linear(
            silu_mul.apply(F.linear(x, gate_weight), F.linear(x, up_weight)), down_weight)
    return optional_provider("liger_kernel.ops.swiglu", "LigerSiLUMulFunction", mlp)


def swiglu_case(tokens: tuple, hidden: int, intermediate: int, dtype: str, backward: bool, label: str) -> Case:
    """x [*tokens, hidden] through the MLP; weights at nn.Linear's scale."""
    m = math.prod(tokens)
    size = TORCH_DTYPES[dtype].itemsize

    def make_inputs():
        x = randn(*tokens, hidden, dtype=dtype)
        weights = (randn(intermediate, hidden, dtype=dtype) * hidden**-0.5,
                   randn(intermediate, hidden, dtype=dtype) * hidden**-0.5,
                   randn(hidden, intermediate, dtype=dtype) * intermediate**-0.5)
        return (x, *weights, randn(*tokens, hidden, dtype=dtype)) if backward else (x, *weights)

    providers = {"dropin": swiglu_mlp, "torch": _hf_mlp(hidden, intermediate),
                 "torch_compile": compiled(swiglu_mlp_ref), "liger": _liger()}
    reference = swiglu_mlp_ref
    if backward:  # and dropin recomputing g and u in its backward instead of keeping them
        providers["dropin_recompute"] = lambda *args: swiglu_mlp(*args, recompute=True)
        providers = {name: with_backward(fn, 4, 4) for name, fn in providers.items()}
        reference = with_backward(reference, 4, 4)
    flops = 2 * m * hidden * intermediate * 3
    bytes_ = size * (2 * m * hidden + 3 * hidden * intermediate)
    shape = f"{'x'.join(map(str, tokens))}x{hidden}->{intermediate}"
    return Case(
        name=f"{label} {dtype} {shape} {'fwd+bwd' if backward else 'fwd'}",
        dtype=dtype, make_inputs=make_inputs, providers=providers, reference=reference, backward=backward,
        flops=flops * (3 if backward else 1), bytes=bytes_ * (2 if backward else 1),
        context=lambda: allow_tf32(False))


def swiglu_cases(quick: bool) -> list[Case]:
    """Suite "swiglu"."""
    if quick:
        shapes = [((2, 8), 32, 48, "fp32", "tiny"), ((16,), 64, 96, "fp16", "tiny")]
    else:
        shapes = [((2, 1024), 1024, 11008, "fp32", "seed002"), ((4096,), 4096, 11008, "bf16", "llama-7b"),
                  ((8192,), 4096, 14336, "bf16", "llama3-8b")]
    return [swiglu_case(tokens, hidden, inter, dtype, backward, label)
            for tokens, hidden, inter, dtype, label in shapes for backward in (False, True)]
