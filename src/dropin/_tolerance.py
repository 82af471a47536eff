"""DESIGN.md's tolerance table, the relative error it is measured in and the float64 copies (and runs) it is measured
against.

The one copy: inject_'s verification and the CLI read it here, the benchmark harness by the short dtype names of
its cases (ROWS), the tests through tests/_tol.py.
"""
import contextlib

import torch

from . import _runtime

# Relative error against float64, (forward, backward).
TOLERANCES = {
    torch.float32: (1e-5, 1e-4),
    "tf32": (5e-3, 5e-3),
    torch.float16: (5e-3, 1e-2),
    torch.bfloat16: (2e-2, 3e-2),
}
# The rows by the short dtype names of benchmark cases ("tf32": float32 tensors with TF32 allowed).
ROWS = {"fp32": torch.float32, "tf32": "tf32", "fp16": torch.float16, "bf16": torch.bfloat16}
# "Never worse than 2x PyTorch's error" compares two rounding errors, so it allows NOISE_ULPS unit roundoffs
# on top (an fp32 activation derivative 2 ulps off is not a defect).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, "tf32": 2.0**-11, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
NOISE_ULPS = 2


def to_float64(x):
    """float64 copy of a floating tensor; anything else unchanged."""
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype set to `dtype` inside (a float64 reference run: tensors its forward creates match),
    the caller's restored after."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 over the finite entries of ref.

    A zero reference must be matched exactly: 0.0 if out is zero there too, else inf.
    """
    out, ref = out.detach().double(), ref.detach().double()
    finite = torch.isfinite(ref)
    diff = torch.linalg.vector_norm(out[finite] - ref[finite]).item()
    scale = torch.linalg.vector_norm(ref[finite]).item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def limit(dtype: torch.dtype, torch_err: float, backward: bool = False) -> float:
    """The bound for an error against float64: the dtype's tolerance (forward or backward), or 2x PyTorch's own
    error there (+ NOISE_ULPS unit roundoffs) where that is larger (a model's error compounds with depth, so a
    deep model may exceed the per-op tolerance in PyTorch too). float32 counts as tf32 where torch's TF32
    switches are on (on the GPU)."""
    key = dtype
    if key == torch.float32 and not _runtime.INTERPRET and (
            _runtime.tf32_allowed("conv") or _runtime.tf32_allowed("matmul")):
        key = "tf32"
    key = key if key in TOLERANCES else torch.float32
    return max(TOLERANCES[key][backward], 2 * torch_err + NOISE_ULPS * UNIT_ROUNDOFF[key])
