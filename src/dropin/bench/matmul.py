"""Suites "matmul" and "bmm": dropin vs torch (cuBLAS), checked against float64 references.

"matmul" is made of shape classes (bench/classes.py), each in bf16 and fp16, its first shape also in fp32 with TF32
allowed ("tf32") and off (true fp32, "fp32"): LLM-sized GEMMs, the fused linear epilogue (the one class with
torch.compile beside: a lone product compiles to the cuBLAS call), few-row products, very long K, odd and prime
sizes, tall-skinny, short-wide, batched small products and decode-shaped linears. "bmm": the seed-000 shapes
(torch.compile beside). Quick cases (interpreter, or --quick): each class scaled down.
"""
import functools

import torch
import torch.nn.functional as F

from dropin import ops
from dropin.ops.matmul import bmm_ref, linear_ref, matmul_ref

from .classes import ShapeClass, suite_cases
from .harness import TORCH_DTYPES, Case, allow_tf32, compiled, randn


def _torch_bmm(a, b):
    return torch.bmm(a, b)


def _torch_linear(x, weight, bias, activation):
    y = F.linear(x, weight, bias)
    return y if activation is None else getattr(F, activation)(y)


def _precision(dtype):
    """TF32 on for "tf32" cases and off otherwise, for dropin and torch alike."""
    return lambda: allow_tf32(dtype == "tf32")


def _providers(dropin_fn, torch_fn, compile):
    """dropin and torch, and torch.compile of torch_fn where asked."""
    providers = {"dropin": dropin_fn, "torch": torch_fn}
    if compile:
        providers["torch_compile"] = compiled(torch_fn)
    return providers


def matmul_case(m, n, k, dtype, note=""):
    """(m, k) @ (k, n) through dropin.ops.matmul vs torch.matmul."""
    size = TORCH_DTYPES[dtype].itemsize
    return Case(
        name=f"{dtype} {m}x{k} @ {k}x{n}{note}", dtype=dtype,
        make_inputs=lambda: (randn(m, k, dtype=dtype), randn(k, n, dtype=dtype)),
        providers={"dropin": ops.matmul, "torch": torch.matmul},
        reference=matmul_ref, flops=2 * m * n * k, bytes=size * (m * k + k * n + m * n),
        context=_precision(dtype))


def bmm_case(batch, m, n, k, dtype, compile=True):
    """(batch, m, k) @ (batch, k, n) through dropin.ops.bmm vs torch.bmm."""
    size = TORCH_DTYPES[dtype].itemsize
    return Case(
        name=f"{dtype} {batch}x{m}x{k} @ {batch}x{k}x{n}", dtype=dtype,
        make_inputs=lambda: (randn(batch, m, k, dtype=dtype), randn(batch, k, n, dtype=dtype)),
        providers=_providers(ops.bmm, _torch_bmm, compile),
        reference=bmm_ref, flops=2 * batch * m * n * k, bytes=size * batch * (m * k + k * n + m * n),
        context=_precision(dtype))


def linear_case(m, n, k, dtype, bias=True, activation=None, compile=True):
    """activation(x @ weight.T + bias), x (m, k), weight (n, k): dropin.ops.linear (epilogue fused) vs torch."""
    size = TORCH_DTYPES[dtype].itemsize

    def make_inputs():
        return randn(m, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype) if bias else None

    return Case(
        name=f"linear{'+bias' if bias else ''}{'+' + activation if activation else ''} {dtype} x {m}x{k}, "
             f"w {n}x{k}", dtype=dtype, make_inputs=make_inputs,
        providers=_providers(functools.partial(ops.linear, activation=activation),
                             functools.partial(_torch_linear, activation=activation), compile),
        reference=functools.partial(linear_ref, activation=activation),
        flops=2 * m * n * k, bytes=size * (m * k + n * k + (n if bias else 0) + m * n), context=_precision(dtype))


def _matmul(shape, dtype):
    """A class's case: shape (m, n, k[, note])."""
    return matmul_case(*shape[:3], dtype, *shape[3:])


MATMUL_CLASSES = [
    ShapeClass("llm", "LLM-sized GEMMs", _matmul,
               [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 11008, 4096), (8192, 1024, 8192)], [(64, 48, 32)]),
    ShapeClass("epilogue", "linear + bias + GELU in one kernel vs torch's sequence (torch.compile beside)",
               lambda shape, dtype: linear_case(*shape, dtype, activation="gelu"),
               [(8192, 4096, 4096)], [(16, 20, 24)], first_dtypes=()),
    ShapeClass("few-rows", "matrix-vector and few-row products: M or N in 1..16, K up to 2^20", _matmul,
               [(1, 4096, 4096), (16, 4096, 4096), (8192, 1, 8192), (16, 16, 1 << 20)],
               [(1, 40, 64), (37, 3, 50), (5, 7, 2048)]),
    ShapeClass("long-k", "very long K: K >= 64 x max(M, N)", _matmul,
               [(1024, 1024, 65536), (256, 256, 262144), (64, 128, 1 << 20)], [(24, 20, 2048)]),
    ShapeClass("odd", "odd and prime sizes", _matmul,
               [(6007, 3001, 4999), (4093, 4099, 4091), (997, 1009, 1013)], [(37, 29, 53), (3, 61, 7)]),
    ShapeClass("tall-skinny", "M much larger than N (seed 004's MNIST layer)", _matmul,
               [(50000, 10, 784, " (seed 004, MNIST)"), (131072, 64, 1024), (65536, 256, 256)], [(600, 10, 24)]),
    ShapeClass("short-wide", "N much larger than M", _matmul,
               [(64, 131072, 1024), (256, 65536, 256)], [(10, 600, 24)]),
    ShapeClass("batched-small", "many small products (bmm)",
               lambda shape, dtype: bmm_case(*shape, dtype, compile=False),
               [(8192, 16, 16, 16), (1024, 64, 64, 64), (256, 128, 128, 128)], [(6, 5, 7, 9)]),
    ShapeClass("decode", "decode-shaped linears, memory bound: 1 and 16 tokens through Llama-7B's MLP sizes "
               "(% of roofline: of the measured copy bandwidth)",
               lambda shape, dtype: linear_case(*shape, dtype, bias=False, compile=False),
               [(1, 11008, 4096), (16, 11008, 4096), (1, 4096, 11008), (16, 4096, 11008)], [(1, 40, 24), (3, 24, 40)]),
]


def matmul_cases(quick: bool) -> list[Case]:
    """Suite "matmul": every class of MATMUL_CLASSES."""
    return suite_cases(MATMUL_CLASSES, quick)


def bmm_cases(quick: bool) -> list[Case]:
    """Suite "bmm": the four seed-000 shapes in fp32 and one large bf16 batch."""
    if quick:
        return [bmm_case(3, 33, 20, 17, "fp32"), bmm_case(2, 1, 10, 64, "fp16")]
    return [bmm_case(32, 512, 512, 512, "fp32"), bmm_case(2, 1, 1000, 512, "fp32"),
            bmm_case(2, 1, 10, 512, "fp32"), bmm_case(2, 512, 16, 32, "fp32"),
            bmm_case(64, 2048, 2048, 128, "bf16")]
