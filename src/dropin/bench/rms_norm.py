"""Suite "rms_norm": dropin.ops.rms_norm vs HF's LlamaRMSNorm in eager mode, torch.compile and Liger-Kernel
(LigerRMSNormFunction, casting mode "llama"), plain and with the residual add fused (HF: `s = residual + x`,
then the norm of s; the outputs are the normed s and s).

Full cases (GPU): the Llama shapes of seed 002 (2 x 1024 tokens, hidden 1024, fp32), Llama-7B (4096 tokens,
hidden 4096, bf16) and Llama-3-8B (8192 tokens, hidden 4096, bf16), forward and forward + backward. Memory
bound: the roofline is the copy bandwidth over the bytes that must move. Quick cases: tiny shapes.
Without transformers the eager row runs rms_norm_ref, the same computation (tests check it against HF).
"""
import math
import types

from dropin.ops import rms_norm
from dropin.ops.rms_norm import rms_norm_ref

from .harness import TORCH_DTYPES, Case, compiled, optional, optional_provider, randn, with_backward

EPS = 1e-6


def _ours(x, weight, residual=None):
    return rms_norm(x, weight, EPS, residual=residual)


def _ref(x, weight, residual=None):
    return rms_norm_ref(x, weight, EPS, residual)


def _residual_first(norm):
    """norm(x, weight) -> fn(x, weight[, residual]) with HF's residual add before it."""
    def fn(x, weight, residual=None):
        if residual is None:
            return norm(x, weight)
        s = residual + x
        return norm(s, weight), s
    return fn


def _hf_norm():
    """LlamaRMSNorm.forward itself, called on the case's weight."""
    norm_class = optional("transformers.models.llama.modeling_llama", "LlamaRMSNorm")
    if norm_class is None:
        return _ref
    return _residual_first(lambda x, weight: norm_class.forward(
        types.SimpleNamespace(weight=weight, variance_epsilon=EPS), x))


def _liger():
    # in_place=False: Liger would otherwise write dx over the upstream gradient, an input shared by providers
    return optional_provider("liger_kernel.ops.rms_norm", "LigerRMSNormFunction", lambda function: _residual_first(
        lambda x, weight: function.apply(x, weight, EPS, 0.0, "llama", False)))


def rms_norm_case(tokens: tuple, hidden: int, dtype: str, residual: bool, backward: bool, label: str) -> Case:
    m = math.prod(tokens)
    size = TORCH_DTYPES[dtype].itemsize
    n_args = 3 if residual else 2

    def make_inputs():
        x = randn(*tokens, hidden, dtype=dtype)
        args = (x, 1 + 0.1 * randn(hidden, dtype=dtype)) + ((randn(*tokens, hidden, dtype=dtype),) if residual else ())
        grads = tuple(randn(*tokens, hidden, dtype=dtype) for _ in range(n_args - 1)) if backward else ()
        return args + grads

    providers = {"dropin": _ours, "torch": _hf_norm(), "torch_compile": compiled(_ref), "liger": _liger()}
    reference = _ref
    if backward:
        providers = {name: with_backward(fn, n_args, n_args) for name, fn in providers.items()}
        reference = with_backward(reference, n_args, n_args)
    # forward: read x (and residual), write y (and s); backward: read dy (and ds), x or s, write dx
    rows = 2 + 2 * residual + (3 + residual if backward else 0)
    return Case(
        name=f"{label} {dtype} {'x'.join(map(str, tokens))}x{hidden}{' +residual' if residual else ''} "
             f"{'fwd+bwd' if backward else 'fwd'}",
        dtype=dtype, make_inputs=make_inputs, providers=providers, reference=reference, backward=backward,
        bytes=size * (rows * m * hidden + hidden))


def rms_norm_cases(quick: bool) -> list[Case]:
    """Suite "rms_norm"."""
    if quick:
        shapes = [((2, 8), 96, "fp32", "tiny"), ((16,), 200, "fp16", "tiny")]
    else:
        shapes = [((2, 1024), 1024, "fp32", "seed002"), ((4096,), 4096, "bf16", "llama-7b"),
                  ((8192,), 4096, "bf16", "llama3-8b")]
    return [rms_norm_case(tokens, hidden, dtype, residual, backward, label)
            for tokens, hidden, dtype, label in shapes for residual in (False, True) for backward in (False, True)]
