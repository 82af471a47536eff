"""The fuzz checker's verdicts on noise: a case that fails the 2x rule in one draw and passes in the others passes
(`_fuzz.compare`'s fresh draws), one that fails it in every draw fails; a gradient whose float64 reference rounds
to 0 everywhere holds the zero rule's bound (`_check.check`). Torch ops alone (no kernels): every machine runs them."""
import pytest
import torch

import _check
from _fuzz import CONTIGUOUS, REDRAWS, Layout, compare, with_derivative
from _tol import DEVICE

SHAPE = (8, 16)


def exp_with_error(bad_calls):
    """torch.exp, off by 1e-6 relative (8 fp32 ulps: above 2x torch's rounding, within the tolerance) in the
    calls whose index is in `bad_calls`."""
    calls = []

    def op(x):
        calls.append(None)
        return torch.exp(x) * (1 + 1e-6) if len(calls) - 1 in bad_calls else torch.exp(x)
    return op


@pytest.mark.parametrize("layout", [CONTIGUOUS, Layout("sliced", dim=1)])
def test_one_bad_draw_of_a_case_passes(layout):
    x = layout.tensor(SHAPE, torch.float32)
    with pytest.raises(AssertionError, match="PyTorch's own"):
        _check.check(exp_with_error({0}), torch.exp, {"x": x}, backward=False)
    compare(exp_with_error({0}), torch.exp, {"x": x}, backward=False)


def test_a_case_bad_in_most_draws_fails():
    x = CONTIGUOUS.tensor(SHAPE, torch.float32)
    most = set(range(0, 2 + REDRAWS, 2)) | {1}  # (the first draw and more than half of the others)
    with pytest.raises(AssertionError, match=f"failed in {len(most)} of {1 + REDRAWS} draws"):
        compare(exp_with_error(most), torch.exp, {"x": x}, backward=False)


def test_redraws_are_fresh_and_keep_the_layout():
    layout = Layout("expanded", dims=(0,))
    x = layout.tensor(SHAPE, torch.float32, scale=0.5)
    y = x.fuzz_redraw()
    assert y.shape == x.shape and y.stride() == x.stride() and not torch.equal(x, y)


def saturated_tanh(derivative_far_out):
    """tanh whose derivative is `derivative_far_out` where |x| > 20 (float64's 1 - tanh^2 rounds to 0 there)."""
    return with_derivative(torch.tanh, lambda x: torch.where(x.abs() > 20, derivative_far_out, 1 - torch.tanh(x) ** 2))


def test_gradient_of_a_zero_reference_holds_the_zero_bound():
    x = 30 + torch.rand(SHAPE, device=DEVICE)  # (float64's derivative rounds to 0: so does torch's)
    _check.check(saturated_tanh(1e-28), torch.tanh, {"x": x})  # (the true derivative's size: passes)
    with pytest.raises(AssertionError, match="not ~0"):
        _check.check(saturated_tanh(1e-2), torch.tanh, {"x": x})
