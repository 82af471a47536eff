"""Suites "matmul" and "bmm": dropin vs torch vs torch.compile, checked against float64 references.

Full cases (GPU): the seed BMM and MNIST shapes, bf16/fp16 GEMMs of LLM sizes, fp32 with and without TF32,
and a linear layer with a bias + GELU epilogue. Quick cases (interpreter, or --quick): tiny shapes.
"""
import functools

import torch
import torch.nn.functional as F

from dropin import ops
from dropin.ops.matmul import bmm_ref, linear_ref, matmul_ref

from .harness import TORCH_DTYPES, Case, allow_tf32, compiled, randn


def _torch_matmul(a, b):
    return torch.matmul(a, b)


def _torch_bmm(a, b):
    return torch.bmm(a, b)


def _torch_linear_gelu(x, weight, bias):
    return F.gelu(F.linear(x, weight, bias))


def _precision(dtype):
    """TF32 on for "tf32" cases and off otherwise, for dropin and torch alike."""
    return lambda: allow_tf32(dtype == "tf32")


def matmul_case(m, n, k, dtype, note=""):
    """(m, k) @ (k, n) through dropin.ops.matmul vs torch.matmul."""
    size = TORCH_DTYPES[dtype].itemsize
    return Case(
        name=f"{dtype} {m}x{k} @ {k}x{n}{note}", dtype=dtype,
        make_inputs=lambda: (randn(m, k, dtype=dtype), randn(k, n, dtype=dtype)),
        providers={"dropin": ops.matmul, "torch": torch.matmul, "torch_compile": compiled(_torch_matmul)},
        reference=matmul_ref, flops=2 * m * n * k, bytes=size * (m * k + k * n + m * n),
        context=_precision(dtype))


def bmm_case(batch, m, n, k, dtype):
    """(batch, m, k) @ (batch, k, n) through dropin.ops.bmm vs torch.bmm."""
    size = TORCH_DTYPES[dtype].itemsize
    return Case(
        name=f"{dtype} {batch}x{m}x{k} @ {batch}x{k}x{n}", dtype=dtype,
        make_inputs=lambda: (randn(batch, m, k, dtype=dtype), randn(batch, k, n, dtype=dtype)),
        providers={"dropin": ops.bmm, "torch": torch.bmm, "torch_compile": compiled(_torch_bmm)},
        reference=bmm_ref, flops=2 * batch * m * n * k, bytes=size * batch * (m * k + k * n + m * n),
        context=_precision(dtype))


def linear_gelu_case(m, n, k, dtype):
    """gelu(x @ weight.T + bias), x (m, k), weight (n, k): dropin's fused epilogue vs torch."""
    size = TORCH_DTYPES[dtype].itemsize
    return Case(
        name=f"linear+bias+gelu {dtype} x {m}x{k}, w {n}x{k}", dtype=dtype,
        make_inputs=lambda: (randn(m, k, dtype=dtype), randn(n, k, dtype=dtype), randn(n, dtype=dtype)),
        providers={"dropin": functools.partial(ops.linear, activation="gelu"), "torch": _torch_linear_gelu,
                   "torch_compile": compiled(_torch_linear_gelu)},
        reference=functools.partial(linear_ref, activation="gelu"),
        flops=2 * m * n * k, bytes=size * (m * k + n * k + n + m * n), context=_precision(dtype))


def matmul_cases(quick: bool) -> list[Case]:
    """Suite "matmul"."""
    if quick:
        return [matmul_case(33, 20, 17, "fp32"), matmul_case(64, 48, 32, "fp16"),
                linear_gelu_case(16, 20, 24, "fp32")]
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192), (4096, 11008, 4096), (8192, 1024, 8192), (16, 4096, 4096)]
    return ([matmul_case(50000, 10, 784, "fp32", " (seed 004, MNIST)")]
            + [matmul_case(m, n, k, dtype) for dtype in ("bf16", "fp16") for m, n, k in shapes]
            + [matmul_case(4096, 4096, 4096, "fp32"), matmul_case(4096, 4096, 4096, "tf32"),
               linear_gelu_case(8192, 4096, 4096, "bf16")])


def bmm_cases(quick: bool) -> list[Case]:
    """Suite "bmm": the four seed-000 shapes in fp32 and one large bf16 batch."""
    if quick:
        return [bmm_case(3, 33, 20, 17, "fp32"), bmm_case(2, 1, 10, 64, "fp16")]
    return [bmm_case(32, 512, 512, 512, "fp32"), bmm_case(2, 1, 1000, 512, "fp32"),
            bmm_case(2, 1, 10, 512, "fp32"), bmm_case(2, 512, 16, 32, "fp32"),
            bmm_case(64, 2048, 2048, 128, "bf16")]
