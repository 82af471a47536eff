"""Suite "flce": a language model's head and loss, forward + backward (the mean loss over the tokens not ignored,
and the gradients of the hidden states and of the weight): dropin.ops.linear_cross_entropy (logits a chunk of
tokens at a time, the gradients made in the same pass) vs torch eager (F.linear, then F.cross_entropy: the whole
logits in memory), torch.compile of that, and Liger-Kernel's fused linear cross-entropy where it is installed.

Full cases (GPU, bf16): hidden 4096, tokens 4 x 1024 and 8 x 4096, vocabularies 32000 (Llama 2) and 128256
(Llama 3); one target in 16 is HF's ignore_index. The MiB column is the peak memory a call allocates beyond its
inputs: the point of the fused op. Quick cases (interpreter, or --quick): tiny shapes.
"""
import math

import torch

from dropin import _runtime
from dropin.ops import linear_cross_entropy
from dropin.ops.linear_cross_entropy import linear_cross_entropy_ref

from .harness import TORCH_DTYPES, Case, allow_tf32, compiled, optional_provider, randn, with_backward

IGNORE_INDEX = -100


def _liger():
    def loss(flce):
        def provider(hidden, weight, target):  # (Liger's takes [tokens, hidden] and [tokens])
            out = flce(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1), ignore_index=IGNORE_INDEX)
            return out[0] if isinstance(out, tuple) else out  # (versions that also return the z-loss)
        return provider
    return optional_provider("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy", loss)


def flce_case(tokens: tuple, hidden: int, vocab: int, dtype: str, label: str) -> Case:
    """hidden states [*tokens, hidden], a head [vocab, hidden] at nn.Linear's scale, random targets."""
    m = math.prod(tokens)

    def make_inputs():
        target = torch.randint(0, vocab, tokens, device=_runtime.KERNEL_DEVICE)
        target[torch.rand(tokens, device=target.device) < 1 / 16] = IGNORE_INDEX
        return (randn(*tokens, hidden, dtype=dtype), randn(vocab, hidden, dtype=dtype) * hidden**-0.5, target,
                randn(1, dtype=dtype)[0])  # the upstream gradient of the scalar loss

    forward = {"dropin": linear_cross_entropy, "torch": linear_cross_entropy_ref,
               "torch_compile": compiled(linear_cross_entropy_ref), "liger": _liger()}
    providers = {name: with_backward(fn, 3, 2) for name, fn in forward.items()}
    size = TORCH_DTYPES[dtype].itemsize
    return Case(
        name=f"{label} {dtype} {'x'.join(map(str, tokens))}x{hidden}->{vocab} fwd+bwd",
        dtype=dtype, make_inputs=make_inputs, providers=providers,
        reference=with_backward(linear_cross_entropy_ref, 3, 2), backward=True,
        flops=3 * 2 * m * hidden * vocab, bytes=size * 2 * (2 * m * hidden + 2 * vocab * hidden),
        context=lambda: allow_tf32(False))


def flce_cases(quick: bool) -> list[Case]:
    """Suite "flce"."""
    if quick:
        shapes = [((2, 8), 32, 100, "fp32", "tiny"), ((24,), 64, 130, "fp16", "tiny")]
    else:
        shapes = [((4, 1024), 4096, 32000, "bf16", "llama2"), ((4, 1024), 4096, 128256, "bf16", "llama3"),
                  ((8, 4096), 4096, 32000, "bf16", "llama2"), ((8, 4096), 4096, 128256, "bf16", "llama3")]
    return [flce_case(*shape) for shape in shapes]
