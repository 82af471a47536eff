"""Suite "sparse": dropin.ops.sparse_linear on unstructured-pruned weights vs the dense product of the same
weight through torch (F.linear, cuBLAS) and dropin (ops.linear).

Full cases (GPU): Llama-7B's linears, 4096 -> 4096 and 4096 -> 11008 (in -> out), with 1, 16, 128 and 4096
tokens, fp16 and bf16, at 50 / 70 / 80 / 90 / 95 / 99% sparsity (a random mask; the weight's bytes in
dropin's format against dense are in the case name, expected for that mask). Quick cases (interpreter, or
--quick): tiny shapes. The weight is compressed once per case, outside the timing.

FLOPs are counted as the dense product's, 2 * tokens * in * out, whatever the sparsity: the TFLOP/s column
is effective (dense-equivalent), so rates compare across providers as speed-ups do. Bytes are what the sparse
product must move: x, the compressed weight (values, uint8 offsets, chunk pointers) and y; for the dense
providers the memory floor is therefore below what they move.
"""
import torch.nn.functional as F
import triton

from dropin import ops
from dropin.ops.sparse import MAX_BLOCK_K, sparse_linear_ref

from .harness import TORCH_DTYPES, Case, randn


def _reference(x, weight, sparse):
    return sparse_linear_ref(x, weight)


def _dropin(x, weight, sparse):
    return ops.sparse_linear(x, sparse)


def _torch(x, weight, sparse):
    return F.linear(x, weight)


def _dropin_dense(x, weight, sparse):
    return ops.linear(x, weight)


def _format_bytes(n: int, k: int, sparsity: float, itemsize: int) -> float:
    """Expected bytes of the compressed weight [n, k]: values and uint8 offsets of the non-zeros, int32
    chunk pointers."""
    return (1 - sparsity) * n * k * (itemsize + 1) + 4 * (n * triton.cdiv(k, MAX_BLOCK_K) + 1)


def sparse_case(tokens: int, n: int, k: int, dtype: str, sparsity: float) -> Case:
    """x [tokens, k] @ W^T, W [n, k] (nn.Linear layout, nn.Linear's scale) with a random `sparsity` fraction
    of zeros."""
    size = TORCH_DTYPES[dtype].itemsize
    weight_bytes = _format_bytes(n, k, sparsity, size)

    def make_inputs():
        weight = randn(n, k, dtype=dtype) * k**-0.5
        weight *= randn(n, k, dtype="fp32").uniform_() >= sparsity
        return randn(tokens, k, dtype=dtype), weight, ops.sparsify(weight, transpose=False)

    return Case(
        name=f"{dtype} {tokens}x{k}->{n} {round(100 * sparsity)}% (w {weight_bytes / (size * n * k):.3f}x dense)",
        dtype=dtype, make_inputs=make_inputs, reference=_reference,
        providers={"dropin": _dropin, "torch": _torch, "dropin_dense": _dropin_dense},
        flops=2 * tokens * n * k, bytes=size * tokens * (k + n) + weight_bytes)


def sparse_cases(quick: bool) -> list[Case]:
    """Suite "sparse"."""
    if quick:
        return [sparse_case(tokens, 48, 300, dtype, sparsity)
                for tokens, dtype in ((1, "fp16"), (16, "fp32")) for sparsity in (0.5, 0.9)]
    return [sparse_case(tokens, n, 4096, dtype, sparsity)
            for dtype in ("bf16", "fp16") for n in (4096, 11008) for tokens in (1, 16, 128, 4096)
            for sparsity in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)]
