"""Shared test helpers: the device, the dtype list, DESIGN.md's tolerance table and `assert_close`.

Every check is a relative error ||out - ref|| / ||ref|| against a float64 reference, and (when PyTorch's
own output in the same dtype is given) at most 2x PyTorch's own error against that same reference.
conftest.py has already switched the Triton interpreter on when there is no CUDA device.
"""
import itertools
import math
import os

import pytest

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false")
# Kernels run on CUDA tensors, or on CPU tensors under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
ON_GPU = DEVICE == "cuda"

gpu = pytest.mark.gpu
# A sweep that `make test-gpu` leaves to `make test-gpu-slow`: a faster test covers the same code path (on the CPU
# every test runs).
slow = pytest.mark.slow


def sweep(*axes, default):
    """The full product of `axes` (each a list of pytest.param: one value and an id), as stacked parametrize
    decorators would make it (ids joined with '-', the first axis first; each value's own marks kept), with the
    combinations for which `default(*indices)` is false marked `slow`: a pairwise cover runs in `make test-gpu`,
    every combination in `make test-gpu` plus `make test-gpu-slow` (and on the CPU)."""
    params = []
    for idx in itertools.product(*(range(len(axis)) for axis in axes)):
        ps = [axis[i] for axis, i in zip(axes, idx)]
        marks = [m for p in ps for m in p.marks] + ([] if default(*idx) else [slow])
        params.append(pytest.param(*(v for p in ps for v in p.values), id="-".join(p.id for p in ps), marks=marks))
    return params

# The activations the products' and convolutions' epilogue tests run (None: none), against
# dropin.ops.activations.activation_ref (torch's functions).
EPILOGUE_ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu", "tanh", "mish", "elu", "selu", "celu", "softplus")

# Under the interpreter tl.dot on bfloat16 is garbage (numpy sees uint16), so bf16 runs on the GPU only.
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=gpu),
]

# DESIGN.md's table (forward, backward), unit roundoffs and the relative error, shared with inject_'s verification.
from dropin._tolerance import NOISE_ULPS, TOLERANCES, UNIT_ROUNDOFF, rel_err  # noqa: E402,F401

# The 2x rule applies from MIN_NUMEL_2X distinct reference values on: on a handful of numbers the ratio of two
# rounding errors is noise (PyTorch may round a lone number exactly, and a lone sum that cancels magnifies both
# errors alike). Distinct, not elements: a product of expanded (stride-0) operands repeats one sum many times.
MIN_NUMEL_2X = 32


def tf32_enabled() -> bool:
    return ON_GPU and torch.backends.cuda.matmul.allow_tf32


def tolerance_key(dtype):
    """The row of the table: float32 reads as tf32 while torch.backends.cuda.matmul.allow_tf32 is on."""
    return "tf32" if dtype == torch.float32 and tf32_enabled() else dtype


def tolerance(dtype, kind: str) -> float:
    """kind: 'fwd' or 'bwd'."""
    return TOLERANCES[tolerance_key(dtype)][{"fwd": 0, "bwd": 1}[kind]]


def _same_non_finite(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    out, ref = out.detach().double(), ref.detach().double()
    bad_nan = torch.isnan(out) != torch.isnan(ref)
    assert not bad_nan.any(), (
        f"{what}: NaN pattern differs from the reference at {bad_nan.sum().item()} place(s), "
        f"first at index {tuple(bad_nan.nonzero()[0].tolist())}")
    inf_out = torch.where(torch.isinf(out), out, 0.0)
    inf_ref = torch.where(torch.isinf(ref), ref, 0.0)
    bad_inf = inf_out != inf_ref
    assert not bad_inf.any(), f"{what}: +-inf pattern differs from the reference at {bad_inf.sum().item()} place(s)"


def samples_2x(ref: torch.Tensor, sources=None) -> int:
    """How many independent samples of rounding the 2x rule compares: ref's distinct values, or `sources` where
    fewer (the values an output is a function of: an MLP's few hidden units, an attention row's few
    probabilities, each of whose rounding every output shares)."""
    distinct = torch.unique(ref.detach()).numel() if ref.numel() else 0
    return distinct if sources is None else min(distinct, sources)


class RoundingNoise(AssertionError):
    """A failure one draw of rounding can make: the 2x rule's (two kernels' rounding errors compared), or the
    tolerance's where PyTorch's own error in the same draw is at least ILL_CONDITIONED of it (a reference
    ill-conditioned in the dtype, whose error each kernel draws by the order of its sums). The fuzz suite judges
    such a case over fresh draws (`_fuzz.compare`)."""


ILL_CONDITIONED = 1 / 8


def assert_close(out, ref, dtype, kind: str, torch_out=None, what: str = "output", sources=None) -> None:
    """Asserts that `out` matches the float64 `ref` to DESIGN.md's tolerance for `dtype` and `kind`.

    - out must be a tensor of ref's shape and device; its dtype must be torch_out's dtype when torch_out
      is given (autocast), else `dtype`.
    - NaN and +-inf must sit exactly where the reference has them.
    - rel_err(out, ref) <= tolerance(dtype, kind), the tf32 row when TF32 is allowed on the GPU; where PyTorch's own
      error is over it (an ill-conditioned reference), at most 2x PyTorch's own error + NOISE_ULPS unit roundoffs,
      widened by sqrt(MIN_NUMEL_2X / n) for n < MIN_NUMEL_2X samples (`samples_2x`): one cancelling sum's
      rounding is one sample, which the order of its terms sets (a [5, 33] expanded weight's five equal sums:
      torch 1.1e-5, dropin 6.3e-5).
    - With torch_out (PyTorch's own result in the same dtype) and at least MIN_NUMEL_2X samples (`samples_2x`,
      `sources`): rel_err(out, ref) must also be at most 2 * rel_err(torch_out, ref) + NOISE_ULPS * unit
      roundoff, unless PyTorch's own result is not finite where the reference is (its error is NaN: no yardstick).
    """
    assert isinstance(out, torch.Tensor), f"{what}: expected a Tensor, got {type(out).__name__}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert out.device == ref.device, f"{what}: device {out.device} != reference {ref.device}"
    want_dtype = torch_out.dtype if torch_out is not None else dtype
    assert out.dtype == want_dtype, f"{what}: dtype {out.dtype} != {want_dtype}"
    _same_non_finite(out, ref, what)
    key = tolerance_key(dtype)
    tol = tolerance(dtype, kind)
    err = rel_err(out, ref)
    noise = NOISE_ULPS * UNIT_ROUNDOFF[key]
    own = rel_err(torch_out, ref) if torch_out is not None else math.nan
    samples = samples_2x(ref, sources) if torch_out is not None else 0  # (no yardstick without torch's result)
    if tol < own < math.inf:  # (not where torch's result is not finite: no yardstick)
        # PyTorch's own result misses the tolerance: the reference is ill-conditioned in the dtype, a result far
        # below the terms it cancels from (softmax's fp16 gradient of a near one-hot row: 7e-6 left of terms of
        # 0.25, whose one rounding is 1e-4; torch's error 11.6), which no kernel reading the dtype's rounded
        # values resolves. The bound is then 2x PyTorch's error, as inject_'s (`dropin._tolerance.limit`).
        factor = 2 * math.sqrt(max(1.0, MIN_NUMEL_2X / max(samples, 1)))
        if not err <= factor * own + noise:
            raise RoundingNoise(
                f"{what}: relative error {err:.3e} > {tol:.0e} ({key}, {kind}) and worse than {factor:.1f}x "
                f"PyTorch's own {own:.3e}, itself over the tolerance ({samples} samples; + noise allowance "
                f"{noise:.1e})")
        return
    if not err <= tol:
        failure = RoundingNoise if ILL_CONDITIONED * tol <= own < math.inf else AssertionError
        raise failure(f"{what}: relative error {err:.3e} > {tol:.0e} ({key}, {kind}); PyTorch's own {own:.3e}")
    torch_err = own if samples >= MIN_NUMEL_2X else math.nan
    if not math.isnan(torch_err) and not err <= 2 * torch_err + noise:
        raise RoundingNoise(f"{what}: relative error {err:.3e} is worse than 2x PyTorch's own {torch_err:.3e} "
                            f"(+ noise allowance {noise:.1e}) in {key}")
