"""The fuzz checker's `ambiguous` mask (`_fuzz.kink_mask`): a fused activation's derivative taken at a
pre-activation rounded onto the other side of a kink fails the 2x rule without the mask and passes with it; a wrong
derivative away from the kinks fails with the mask too. Torch ops alone (no kernels): every machine runs them."""
import pytest
import torch
import torch.nn.functional as F

import _check
from _fuzz import kink_mask, with_derivative
from _tol import DEVICE

GRID = 2.0 ** -6  # the pre-activation's rounding in the stand-in op: coarser than fp16's at 3 (2^-9)


def stand_in(slope_inside=1 / 6):
    """hardsigmoid whose backward reads its input rounded to GRID (as a kernel reading a rounded pre-activation),
    with `slope_inside` as its derivative inside (-3, 3) (1/6 is torch's)."""
    def derivative(x):
        z = torch.round(x / GRID) * GRID
        return ((z > -3) & (z < 3)) * slope_inside
    return with_derivative(F.hardsigmoid, derivative)


def leaves():
    """fp16 values around 0, a few of them 2^-9 inside a kink (the stand-in rounds those onto it)."""
    x = torch.randn(4096, device=DEVICE) * 2
    x[::512] = torch.tensor([3 - 2.0 ** -9, -3 + 2.0 ** -9], device=DEVICE).repeat(4)
    return {"x": x.half()}


kinks = kink_mask("hardsigmoid", lambda t, f: f(t["x"]), torch.float16)


def test_a_rounding_onto_a_kink_fails_without_the_mask_and_passes_with_it():
    t = leaves()
    with pytest.raises(AssertionError, match="gradient of 'x'"):
        _check.check(stand_in(), F.hardsigmoid, t)
    assert kinks({"x": t["x"].double()}).sum() >= 8
    _check.check(stand_in(), F.hardsigmoid, t, ambiguous=kinks)


def test_a_wrong_derivative_fails_with_the_mask():
    with pytest.raises(AssertionError, match="gradient of 'x'"):
        _check.check(stand_in(slope_inside=1 / 5), F.hardsigmoid, leaves(), ambiguous=kinks)
