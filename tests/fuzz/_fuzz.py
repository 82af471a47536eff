"""What the fuzz tests share: the example budget, hypothesis's settings, the per-op case counter, the test
dtypes, sizes and tensor layouts.

DROPIN_FUZZ_EXAMPLES is the number of cases per op, split over the op's dtype tests (fp32 and fp16 on the CPU,
bf16 too on the GPU) and, on the GPU, 3 parts of each (`PARTS`); default 4 on the CPU (the interpreter), 600 on
the GPU (18 ops of 3 dtypes, attention at half: ~10,500 cases; 700 ran past 10 minutes on the H200). Each case
draws its own torch seed, so hypothesis's falsifying example (and its blob, print_blob) replays the case with its
tensors.
"""
import collections
import math
import os

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

import _check
from _tol import DEVICE, ON_GPU, UNIT_ROUNDOFF, RoundingNoise, tolerance_key

EXAMPLES = int(os.environ.get("DROPIN_FUZZ_EXAMPLES", 600 if ON_GPU else 4))
# Each test runs one dtype: an op's cases split over its dtype tests (bf16's is skipped on the CPU), and over
# PARTS items a test (DROPIN_FUZZ_PARTS; the `fuzz_part` parameter, conftest.py), each of fresh draws: xdist
# balances whole items, and a test of 234 draws took up to 335 s on the H200 (sparse_conv2d; swiglu_mlp 308, rope
# 259), longer than the rest of the run's share of a worker.
PARTS = int(os.environ.get("DROPIN_FUZZ_PARTS", 3 if ON_GPU else 1))
PER_TEST = max(1, math.ceil(EXAMPLES / ((3 if ON_GPU else 2) * PARTS)))

# The GPU target explores (fresh draws each run, DROPIN_FUZZ_EXAMPLES to widen it); on the CPU (`make test`, CI) the
# few cases are a fixed smoke run (derandomized), so that a new draw's finding never turns an unrelated change red;
# DROPIN_FUZZ_RANDOM=1 draws afresh there too (a CPU bug hunt: with DROPIN_FUZZ_EXAMPLES=30 and more).
# On the GPU a failing case is reported as drawn, unshrunk (its seed replays it): shrinking took minutes a failing
# test and cut the 10-minute run short. DROPIN_FUZZ_SHRINK=1 shrinks as hypothesis does by default.
SHRINK = not ON_GPU or os.environ.get("DROPIN_FUZZ_SHRINK") == "1"
PHASES = tuple(Phase) if SHRINK else (Phase.explicit, Phase.reuse, Phase.generate, Phase.target)
RANDOM = ON_GPU or os.environ.get("DROPIN_FUZZ_RANDOM") == "1"
FUZZ = settings(max_examples=PER_TEST, deadline=None, derandomize=not RANDOM, database=None, print_blob=True,
                phases=PHASES,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
# Attention draws half an op's cases: most of its cases compile kernels anew (its head dim, mask kind, causal flag and
# tile edges are constants of its four kernels), 2 s a case on the H200 against 0.1-1 s elsewhere; its whole share
# made the run exceed 10 minutes.
FUZZ_HALF = settings(FUZZ, max_examples=max(1, PER_TEST // 2))

# Cases run, by the public function they called (tests/fuzz/conftest.py reports them).
CASES: collections.Counter = collections.Counter()

SEEDS = st.integers(0, 2**31 - 1)

# Sizes grow on the GPU, where a case costs milliseconds; the interpreter keeps them small.
GROW = 3 if ON_GPU else 1
_SPECIAL = (1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 32, 33, 64, 65, 127, 128)


# Where the activations' derivatives jump (torch's): relu's and leaky_relu's 0, relu6's 0 and 6, hardswish's and
# hardsigmoid's -3 and 3, selu's 0 (elu's and celu's alpha is 1: no jump; the others are smooth).
KINKS = {"relu": (0.0,), "leaky_relu": (0.0,), "relu6": (0.0, 6.0), "hardswish": (-3.0, 3.0),
         "hardsigmoid": (-3.0, 3.0), "selu": (0.0,)}


def with_derivative(forward, derivative):
    """An op of one tensor: forward(x), whose backward is dy * derivative(x) (in fp32, then dy's dtype): a stand-in
    kernel whose derivative the checks' own tests choose."""
    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return forward(x)

        @staticmethod
        def backward(ctx, dy):
            return (dy.float() * derivative(ctx.saved_tensors[0].float())).to(dy.dtype)
    return Op.apply


def kink_mask(activation, preact, dtype):
    """A check's `ambiguous` argument for a fused activation (None where the activation has no kink): the elements
    whose float64 pre-activation, preact(leaves, lambda v: v), lies within 16 unit roundoffs of the dtype of one of
    its kinks, relative to preact(leaves, torch.abs), the sum of the absolute terms it adds up (its rounding error is
    relative to those). A pre-activation rounded to the dtype (fp16 rounds 3 - 2^-12 to 3.0, where hardsigmoid's
    derivative is 0 and not 1/6) lands on either side by chance, torch's (rounded after the product, then after the
    residual's add) as dropin's (once)."""
    if activation not in KINKS:
        return None

    def mask(leaves):
        z, slack = preact(leaves, lambda v: v), 16 * UNIT_ROUNDOFF[tolerance_key(dtype)] * preact(leaves, torch.abs)
        near = torch.zeros(z.shape, dtype=torch.bool, device=z.device)
        for kink in KINKS[activation]:
            near |= (z - kink).abs() <= slack
        return near
    return mask


# The first failing case's message in this process: hypothesis replays a failing case to report it, and after a CUDA
# error (sticky: every later CUDA call raises it) the replay fails at its first CUDA call, the seeding in `start`.
_first_failure: list = []


def start(op: str, seed: int) -> None:
    """Counts one case of `op` and seeds torch for its tensors."""
    CASES[op] += 1
    try:
        torch.manual_seed(seed)
    except RuntimeError as e:  # (torch.AcceleratorError is one)
        first = _first_failure[0] if _first_failure else "none recorded"
        raise RuntimeError(f"{e}\n[this process's first failing case raised: {first}]") from e


def sizes(lo: int = 1, hi: int = 8) -> st.SearchStrategy:
    """A dim size in [lo, hi * GROW]: 1, primes, powers of two and their neighbours more often than others."""
    hi *= GROW
    return st.one_of(st.sampled_from([v for v in _SPECIAL if lo <= v <= hi] or [lo]), st.integers(lo, hi))


class Layout:
    """How a test tensor lies in memory: "contiguous"; "transposed" (its dims stored in the order `perm`: (0, 2,
    3, 1) is channels_last); "sliced" (every other element of dim `dim`, from an odd offset: no dense layout, an
    unaligned start); "expanded" (stride 0 along `dims`)."""

    def __init__(self, kind: str, perm=(), dim=0, dims=()):
        self.kind, self.perm, self.dim, self.dims = kind, tuple(perm), dim, tuple(dims)

    def __repr__(self):
        detail = {"transposed": f"perm={self.perm}", "sliced": f"dim={self.dim}", "expanded": f"dims={self.dims}"}
        return f"Layout({self.kind}{', ' + detail[self.kind] if self.kind in detail else ''})"

    def tensor(self, shape, dtype, scale: float = 1.0, offset: float = 0.0) -> torch.Tensor:
        """A random normal tensor of `shape` (times scale, plus offset) in this layout; its `fuzz_redraw()` makes
        another of the same kind (`compare`'s fresh draws)."""
        t = self._draw(tuple(shape), dtype, scale, offset)
        t.fuzz_redraw = lambda: self.tensor(shape, dtype, scale, offset)
        return t

    def _draw(self, shape, dtype, scale, offset):
        def randn(*size):
            if dtype == torch.bool:  # (a mask: mostly True)
                return torch.rand(size, device=DEVICE) > 0.25
            return (torch.randn(size, device=DEVICE) * scale + offset).to(dtype)
        if self.kind == "transposed":
            base = randn(*(shape[p] for p in self.perm))
            return base.permute(*sorted(range(len(shape)), key=lambda d: self.perm[d]))
        if self.kind == "sliced":
            index = [slice(None)] * len(shape)
            index[self.dim] = slice(1, None, 2)
            return randn(*(2 * s + 1 if d == self.dim else s for d, s in enumerate(shape)))[tuple(index)]
        if self.kind == "expanded":
            return randn(*(1 if d in self.dims else s for d, s in enumerate(shape))).expand(shape)
        return randn(*shape)


CONTIGUOUS = Layout("contiguous")
CHANNELS_LAST = Layout("transposed", perm=(0, 2, 3, 1))


@st.composite
def layouts(draw, rank: int, expanded: bool = True, channels_last: bool = False) -> Layout:
    """A layout of a rank-`rank` tensor; expanded=False where the op writes the tensor (or torch rejects stride
    0 there); channels_last: 4-D, channels_last drawn as often as the others."""
    if rank == 0:
        return CONTIGUOUS
    kinds = ["contiguous", "transposed", "sliced"] + ["expanded"] * expanded + ["channels_last"] * (
        channels_last and rank == 4)
    kind = draw(st.sampled_from(kinds))
    if kind == "channels_last":
        return CHANNELS_LAST
    if kind == "transposed":
        return Layout(kind, perm=draw(st.permutations(range(rank))))
    if kind == "sliced":
        return Layout(kind, dim=draw(st.integers(0, rank - 1)))
    if kind == "expanded":
        return Layout(kind, dims=draw(st.sets(st.integers(0, rank - 1), min_size=1)))
    return CONTIGUOUS



# Fresh draws of a case whose check fails by a draw of rounding (`_tol.RoundingNoise`: the 2x rule, or the
# tolerance on a reference so ill-conditioned that PyTorch's own error is near it) once. The 2x rule compares two
# rounding errors, and on a case of few independent roundings (a few keys, an expanded operand's repeated sums, one
# derivative every element shares) their ratio is noise around its median, over 2 in some draws of cases whose
# median is well under it (benchmarks/probes/fuzz_repro.py's SPREAD cases: medians 0.76-1.72, maxima up to 7.9 over
# 24 seeds). A kernel less accurate than PyTorch's moves the median: the case fails where its check fails in most
# of its 1 + REDRAWS draws. Every other failure (a well-conditioned result over the tolerance, NaN, a layout) fails
# at once.
REDRAWS = 8


def compare(op, ref_op, leaves: dict, **kwargs) -> None:
    """`_check.check`, with positive numbers where an output or a leaf holds fewer than `_check.FEW` (a lone sum
    of random signs can cancel to ~0; as `_check.holds_few_numbers`, for several outputs too); forward alone where
    every leaf is constant. A case that fails by a draw of rounding (`_tol.RoundingNoise`) runs again on REDRAWS
    fresh draws of its leaves (those made by `Layout.tensor`; fresh upstream gradients for all) and fails where most
    of its draws do."""
    build = kwargs.get("build") or (lambda **t: tuple(t.values()))
    outs = ref_op(*build(**{k: torch.empty_like(v, device="meta") for k, v in leaves.items()}))
    numels = [o.numel() for o in (outs if isinstance(outs, tuple) else (outs,))]
    kwargs.setdefault("positive", min(*numels, *(v.numel() for v in leaves.values())) < _check.FEW)
    if all(name in kwargs.get("constant", ()) for name in leaves):  # no leaf with a gradient: forward alone
        kwargs["backward"] = False
    try:
        try:
            _check.check(op, ref_op, leaves, **kwargs)
        except RoundingNoise as e:
            failed = 1 + sum(_fails_again(op, ref_op, leaves, kwargs) for _ in range(REDRAWS))
            if 2 * failed > 1 + REDRAWS:
                raise AssertionError(f"{e}\n[the check failed in {failed} of {1 + REDRAWS} draws of the case]") from e
    except Exception as e:
        if not _first_failure:
            _first_failure.append(f"{type(e).__name__}: {str(e)[:1500]}")
        raise


def _fails_again(op, ref_op, leaves: dict, kwargs: dict) -> bool:
    """Whether the case fails by a draw of rounding on fresh leaves; any other failure is raised."""
    fresh = {k: v.fuzz_redraw() if hasattr(v, "fuzz_redraw") else v for k, v in leaves.items()}
    try:
        _check.check(op, ref_op, fresh, **kwargs)
    except RoundingNoise:
        return True
    return False
