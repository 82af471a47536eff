"""Suite "sparse": dropin.ops.sparse_linear / sparse_conv2d on unstructured-pruned weights vs the dense
product of the same weight through torch (F.linear, cuBLAS; F.conv2d, cuDNN) and dropin (ops.linear,
ops.conv2d).

Full cases (GPU): Llama-7B's linears, 4096 -> 4096 and 4096 -> 11008 (in -> out), with 1, 16, 128 and 4096
tokens, fp16 and bf16, at 50 / 70 / 80 / 90 / 95 / 99% sparsity (a random mask; the weight's bytes in
dropin's format against dense are in the case name, expected for that mask); ResNet-50's stride-1 3x3 convs
(64 channels at 56x56, 128 at 28, 256 at 14, 512 at 7), fp16 channels_last (sparse_conv2d reads NCHW: its
copies in and out are timed), batch 1 at 50 / 80 / 90 / 95 / 99% and batch 64 at 90 / 99%. Quick cases (interpreter, or
--quick): tiny shapes. The weight is compressed once per case, outside the timing.

FLOPs are counted as the dense product's, 2 * tokens * in * out, whatever the sparsity: the TFLOP/s column
is effective (dense-equivalent), so rates compare across providers as speed-ups do. Bytes are what the sparse
product must move: x, the compressed weight (values, uint8 offsets, chunk pointers) and y; for the dense
providers the memory floor is therefore below what they move.
"""
import torch
import torch.nn.functional as F
import triton

from dropin import ops
from dropin.ops.sparse import MAX_BLOCK_K, sparse_linear_ref

from .harness import TORCH_DTYPES, Case, allow_tf32, randn


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


def _conv_dropin(x, weight, sparse):
    return ops.sparse_conv2d(x, sparse, padding=1)


def _conv_torch(x, weight, sparse):
    return F.conv2d(x, weight, padding=1)


def _conv_dropin_dense(x, weight, sparse):
    return ops.conv2d(x, weight, padding=1)


def _conv_reference(x, weight, sparse):
    return F.conv2d(x, sparse.to_dense().to(x.dtype), padding=1)


def sparse_conv_case(batch: int, channels: int, size: int, dtype: str, sparsity: float) -> Case:
    """A 3x3 conv, stride 1, padding 1, channels -> channels at size x size, on a channels_last batch."""
    itemsize = TORCH_DTYPES[dtype].itemsize
    k = channels * 9
    weight_bytes = _format_bytes(channels, k, sparsity, itemsize)

    def make_inputs():
        weight = randn(channels, channels, 3, 3, dtype=dtype) * k**-0.5
        weight *= randn(channels, channels, 3, 3, dtype="fp32").uniform_() >= sparsity
        x = randn(batch, channels, size, size, dtype=dtype).contiguous(memory_format=torch.channels_last)
        return x, weight, ops.sparsify(weight, transpose=False)

    return Case(
        name=f"{dtype} conv3x3 {batch}x{channels}x{size}x{size} {round(100 * sparsity)}% "
             f"(w {weight_bytes / (itemsize * channels * k):.3f}x dense)",
        dtype=dtype, make_inputs=make_inputs, reference=_conv_reference,
        providers={"dropin": _conv_dropin, "torch": _conv_torch, "dropin_dense": _conv_dropin_dense},
        flops=2 * batch * size * size * channels * k, bytes=2 * itemsize * batch * channels * size * size + weight_bytes,
        context=lambda: allow_tf32(False, torch.backends.cudnn))  # fp32 is true fp32 (cuDNN's default is TF32)


def sparse_cases(quick: bool) -> list[Case]:
    """Suite "sparse"."""
    if quick:
        return [sparse_case(tokens, 48, 300, dtype, sparsity)
                for tokens, dtype in ((1, "fp16"), (16, "fp32")) for sparsity in (0.5, 0.9)] + [
            sparse_conv_case(2, 8, 6, "fp32", 0.9)]
    return [sparse_case(tokens, n, 4096, dtype, sparsity)
            for dtype in ("bf16", "fp16") for n in (4096, 11008) for tokens in (1, 16, 128, 4096)
            for sparsity in (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)] + [
        sparse_conv_case(batch, channels, size, "fp16", sparsity)
        for batch, sparsities in ((1, (0.5, 0.8, 0.9, 0.95, 0.99)), (64, (0.9, 0.99)))
        for channels, size in ((64, 56), (128, 28), (256, 14), (512, 7)) for sparsity in sparsities]
