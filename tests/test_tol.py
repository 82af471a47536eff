"""Self-checks of the shared assert helper: it must reject wrong results, not only accept right ones.

No kernels run here, so every dtype is checked on every machine.
"""
import pytest
import torch

from _tol import ILL_CONDITIONED, MIN_NUMEL_2X, NOISE_ULPS, UNIT_ROUNDOFF, RoundingNoise, assert_close, rel_err, tolerance

ALL_DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.float16, torch.bfloat16)]
KINDS = ["fwd", "bwd"]


def reference():
    return torch.randn(64, 32, dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_accepts_a_correctly_rounded_result(dtype, kind):
    ref = reference()
    assert_close(ref.to(dtype), ref, dtype, kind, torch_out=ref.to(dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rejects_an_error_above_the_tolerance(dtype, kind):
    ref = reference()
    out = (ref * (1 + 3 * tolerance(dtype, kind))).to(dtype)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(out, ref, dtype, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rejects_more_than_twice_torchs_error(dtype, kind):
    """0.8x the tolerance passes the table alone, but not next to a PyTorch result that is simply rounded."""
    ref = reference()
    out = (ref * (1 + 0.8 * tolerance(dtype, kind))).to(dtype)
    assert_close(out, ref, dtype, kind)
    with pytest.raises(AssertionError, match="worse than 2x PyTorch"):
        assert_close(out, ref, dtype, kind, torch_out=ref.to(dtype))


def test_a_failure_by_rounding_is_told_from_a_wrong_result():
    """Over the tolerance where PyTorch's own error is near it (ill-conditioned: at least ILL_CONDITIONED of it),
    or over 2x PyTorch's: RoundingNoise, which the fuzz suite judges over fresh draws; over the tolerance where
    PyTorch's is far under it: a plain AssertionError."""
    ref, dtype = reference(), torch.float32
    tol = tolerance(dtype, "fwd")
    out = (ref * (1 + 3 * tol)).to(dtype)
    with pytest.raises(RoundingNoise, match="PyTorch's own"):
        assert_close(out, ref, dtype, "fwd", torch_out=(ref * (1 + 2 * ILL_CONDITIONED * tol)).to(dtype))
    with pytest.raises(AssertionError, match="relative error") as failure:
        assert_close(out, ref, dtype, "fwd", torch_out=ref.to(dtype))
    assert not isinstance(failure.value, RoundingNoise)
    with pytest.raises(RoundingNoise, match="worse than 2x"):
        assert_close((ref * (1 + 0.8 * tol)).to(dtype), ref, dtype, "fwd", torch_out=ref.to(dtype))


def test_two_x_rule_counts_distinct_reference_values():
    """A product of expanded operands repeats a few sums: under MIN_NUMEL_2X distinct values only the table
    applies (their error ratio is noise), however many elements repeat them; from MIN_NUMEL_2X on the rule holds."""
    dtype, kind = torch.float32, "fwd"
    for distinct, judged in ((MIN_NUMEL_2X - 1, False), (MIN_NUMEL_2X, True)):
        ref = torch.randn(distinct, dtype=torch.float64).repeat(64)
        out = (ref * (1 + 0.8 * tolerance(dtype, kind))).to(dtype)
        if judged:
            with pytest.raises(AssertionError, match="worse than 2x PyTorch"):
                assert_close(out, ref, dtype, kind, torch_out=ref.to(dtype))
        else:
            assert_close(out, ref, dtype, kind, torch_out=ref.to(dtype))


def test_two_x_rule_counts_sources():
    """Results that are all functions of fewer values than MIN_NUMEL_2X (`sources`: an MLP's hidden units) are
    judged by the table alone, however many distinct values they hold."""
    dtype, kind = torch.float32, "fwd"
    ref = reference()
    out = (ref * (1 + 0.8 * tolerance(dtype, kind))).to(dtype)
    assert_close(out, ref, dtype, kind, torch_out=ref.to(dtype), sources=MIN_NUMEL_2X - 1)
    with pytest.raises(AssertionError, match="worse than 2x PyTorch"):
        assert_close(out, ref, dtype, kind, torch_out=ref.to(dtype), sources=MIN_NUMEL_2X)


def test_ill_conditioned_bound_widens_on_few_samples():
    """Where PyTorch's own error is over the tolerance, the bound is 2x it from MIN_NUMEL_2X samples on, and
    2 sqrt(MIN_NUMEL_2X / n) x it on n: one repeated sum at 6x passes, at 12x fails; 64 distinct ones at 3x fail."""
    dtype, kind = torch.float32, "fwd"
    own = 3 * tolerance(dtype, kind)
    for distinct, ratio, passes in ((1, 6, True), (1, 12, False), (64, 3, False), (64, 1.9, True)):
        ref = torch.randn(distinct, dtype=torch.float64).abs().add(1).repeat(5)
        torch_out, out = (ref * (1 + own)).to(dtype), (ref * (1 + ratio * own)).to(dtype)
        if passes:
            assert_close(out, ref, dtype, kind, torch_out=torch_out)
        else:
            with pytest.raises(AssertionError, match="PyTorch's own"):
                assert_close(out, ref, dtype, kind, torch_out=torch_out)


def test_two_x_rule_needs_a_finite_pytorch_result():
    """A PyTorch result with NaN where the reference is finite is no yardstick: only the table applies."""
    ref = reference()
    out = (ref * (1 + 0.8 * tolerance(torch.float16, "fwd"))).to(torch.float16)
    broken = ref.to(torch.float16)
    broken.view(-1)[0] = float("nan")
    assert_close(out, ref, torch.float16, "fwd", torch_out=broken)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close((ref * 1.1).to(torch.float16), ref, torch.float16, "fwd", torch_out=broken)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_two_x_rule_allows_ulp_noise(dtype):
    """One ulp off on a quarter of the entries passes next to a PyTorch result with no error at all."""
    assert NOISE_ULPS >= 1
    exact = reference().to(dtype).double()  # representable: PyTorch's error is 0
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs()))) * torch.finfo(dtype).eps
    out = (exact + ulp * (torch.rand_like(exact) < 0.25)).to(dtype)
    assert 0 < rel_err(out, exact) <= NOISE_ULPS * UNIT_ROUNDOFF[dtype]
    assert_close(out, exact, dtype, "fwd", torch_out=exact.to(dtype))


def test_rejects_off_by_one_k_matmul():
    """The kind of bug a kernel makes (dropping the last K step) fails in every dtype."""
    a, b = torch.randn(33, 65, dtype=torch.float64), torch.randn(65, 17, dtype=torch.float64)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        wrong = (a[:, :-1] @ b[:-1]).to(dtype)
        with pytest.raises(AssertionError):
            assert_close(wrong, a @ b, dtype, "fwd", torch_out=(a @ b).to(dtype))


def test_nan_passes_only_where_the_reference_has_nan():
    ref = reference()
    ref[3, 4] = float("nan")
    out = ref.float()
    assert_close(out, ref, torch.float32, "fwd")  # same place: fine
    moved = ref.float()
    moved[3, 4], moved[5, 6] = 1.0, float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(moved, ref, torch.float32, "fwd")
    extra = ref.float()
    extra[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(extra, ref, torch.float32, "fwd")
    with pytest.raises(AssertionError, match="NaN"):  # a NaN output never matches a finite reference
        assert_close(torch.full_like(ref, float("nan")).float(), reference(), torch.float32, "fwd")


def test_inf_must_match_in_place_and_sign():
    ref = reference()
    ref[1, 2] = float("inf")
    assert_close(ref.float(), ref, torch.float32, "fwd")
    flipped = ref.float()
    flipped[1, 2] = -float("inf")
    with pytest.raises(AssertionError, match="inf"):
        assert_close(flipped, ref, torch.float32, "fwd")


def test_zero_reference_must_be_matched_exactly():
    ref = torch.zeros(4, 5, dtype=torch.float64)
    assert rel_err(torch.zeros(4, 5), ref) == 0.0
    assert_close(torch.zeros(4, 5), ref, torch.float32, "fwd")
    with pytest.raises(AssertionError):
        assert_close(torch.full((4, 5), 1e-30), ref, torch.float32, "fwd")


def test_rejects_wrong_dtype_shape_and_type():
    ref = reference()
    with pytest.raises(AssertionError, match="dtype"):
        assert_close(ref.half(), ref, torch.float32, "fwd")
    with pytest.raises(AssertionError, match="shape"):
        assert_close(ref.float().t(), ref, torch.float32, "fwd")
    with pytest.raises(AssertionError, match="Tensor"):
        assert_close(ref.tolist(), ref, torch.float32, "fwd")
