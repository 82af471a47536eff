"""dropin.ops.matmul / bmm / linear against PyTorch: torch semantics, DESIGN.md tolerances.

Every numerical test goes through `check`: forward and the gradient of every input (for a random upstream
gradient), against PyTorch in float64 (the reference) and against PyTorch's own error in the same dtype.
On the CPU the kernels run under the Triton interpreter, so shapes stay small there; `gpu` tests add
large shapes, bfloat16, torch.compile, autocast and TF32.
"""
import contextlib
import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import triton
import triton.language as tl

import _check
import dropin
from dropin.ops import _dispatch, _gemm, matmul_configs
from dropin.ops.activations import activation_ref

_mm_module = importlib.import_module("dropin.ops.matmul")  # dropin.ops.matmul is also the function
from _tol import DEVICE, DTYPES, EPILOGUE_ACTIVATIONS, ON_GPU, assert_close, gpu, rel_err

ACTIVATIONS = EPILOGUE_ACTIVATIONS


def linear_ref(x, weight, bias=None, activation=None):
    return activation_ref(F.linear(x, weight, bias), activation)


def dropin_linear(activation):
    return lambda x, weight, bias=None: dropin.ops.linear(x, weight, bias, activation=activation)


def torch_linear(activation):
    return lambda x, weight, bias=None: linear_ref(x, weight, bias, activation)


def randn(*shape, dtype=torch.float32, std=1.0):
    return torch.randn(*shape, dtype=dtype, device=DEVICE) * std


def matmul_leaves(a_shape, b_shape, dtype):
    return {"a": randn(*a_shape, dtype=dtype), "b": randn(*b_shape, dtype=dtype)}


def check(op, ref_op, leaves: dict, build=None, backward=True, autocast=None):
    """The shared check (forward and the gradient of every leaf against float64 and PyTorch's own error), every
    number positive where the output or a leaf holds fewer than _check.FEW of them (`holds_few_numbers`)."""
    _check.check(op, ref_op, leaves, build=build, backward=backward, autocast=autocast,
                 positive=_check.holds_few_numbers(ref_op, leaves, build))


def shape_id(shape):
    return "x".join(map(str, shape)) or "scalar"


# ------------------------------------------------------------------------------------------ matmul 2-D
# (M, K, N); 1, 7, 33, 127 and 1000 in every role, non-powers of two, one past the usual block sizes.
SHAPES_2D = [
    pytest.param((1, 1, 1), id="1x1x1"),
    pytest.param((1, 33, 1000), id="row-1x33x1000"),
    pytest.param((1000, 7, 33), id="tall-1000x7x33"),
    pytest.param((7, 1000, 33), id="deep-7x1000x33"),
    pytest.param((127, 33, 7), id="127x33x7"),
    pytest.param((64, 64, 64), id="64x64x64"),
    pytest.param((17, 129, 65), id="weird-17x129x65"),
    pytest.param((512, 1024, 768), id="512x1024x768", marks=gpu),
    pytest.param((4096, 512, 4096), id="4096x512x4096", marks=gpu),
    pytest.param((96, 8192, 80), id="splitk-96x8192x80", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", SHAPES_2D)
def test_matmul_2d(mkn, dtype):
    m, k, n = mkn
    check(dropin.ops.matmul, torch.matmul, matmul_leaves((m, k), (k, n), dtype))


@pytest.mark.skipif(ON_GPU, reason="patches a kernel's global, which the interpreter reads at each run")
@pytest.mark.parametrize("mkn", [(24, 1100, 40), (3, 1100, 64)], ids=["pointer", "few-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_long_reductions_in_shares(monkeypatch, mkn, dtype):
    """A reduction past _gemm.ACC_K (patched to 256 here): each share in its own accumulator, the shares added."""
    monkeypatch.setattr(importlib.import_module("dropin.ops.matmul_kernels"), "ACC_K", tl.constexpr(256))
    monkeypatch.setattr(_gemm, "ACC_K", tl.constexpr(256))
    monkeypatch.setattr(_mm_module, "_plans", {})
    m, k, n = mkn
    check(dropin.ops.matmul, torch.matmul, matmul_leaves((m, k), (k, n), dtype))


@gpu
@pytest.mark.parametrize("m", [64, 16])
def test_long_reduction_without_the_accumulators_bias(m):
    """K = 2^22: in one MMA accumulator the sums shrank by 4.3e-3 (Hopper's truncating adds; fp16's rounding of
    the result is 2.4e-4), in ACC_K-long shares added in fp32 they keep torch's accuracy."""
    a, b = randn(m, 2**22, dtype=torch.float16), randn(2**22, 64, dtype=torch.float16)
    ref = a.double() @ b.double()
    assert_close(dropin.ops.matmul(a, b), ref, torch.float16, "fwd", torch_out=a @ b)


# --------------------------------------------------------------------------- matmul 1-D, batched, broadcast
BATCHED = [
    ((33,), (33,)),
    ((33,), (33, 17)),
    ((7, 33), (33,)),
    ((3, 7, 33), (3, 33, 17)),
    ((3, 7, 33), (33, 17)),
    ((7, 33), (3, 33, 17)),
    ((33,), (3, 33, 17)),
    ((3, 7, 33), (33,)),
    ((2, 1, 7, 33), (3, 33, 17)),
    ((2, 3, 7, 33), (2, 3, 33, 17)),
    ((1, 3, 7, 33), (2, 1, 33, 17)),
    ((2, 1, 1, 33), (1, 4, 33, 1)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_shape,b_shape", BATCHED, ids=[f"{shape_id(a)}@{shape_id(b)}" for a, b in BATCHED])
def test_matmul_batched_broadcast(a_shape, b_shape, dtype):
    check(dropin.ops.matmul, torch.matmul, matmul_leaves(a_shape, b_shape, dtype))


# ------------------------------------------------------------------------------------- strides and views
# layout -> (storage shape for a logical (rows, cols) operand, the view of that storage)
LAYOUTS = {
    "contig": (lambda r, c: (r, c), lambda t, r, c: t),
    "T": (lambda r, c: (c, r), lambda t, r, c: t.mT),
    "slice": (lambda r, c: (r, 2 * c), lambda t, r, c: t[:, ::2]),  # inner stride 2
    "offset": (lambda r, c: (r + 2, c + 3), lambda t, r, c: t[2:, 3:]),  # storage offset, padded rows
    # stride 0; positive, since an expanded a times an expanded b is a multiple of one sum, which must not cancel
    "expand": (lambda r, c: (1, c), lambda t, r, c: t.abs().expand(r, c)),
}


# every layout of a with a contiguous b, of b with a contiguous a, and on both at once
LAYOUT_PAIRS = sorted({(lay, "contig") for lay in LAYOUTS} | {("contig", lay) for lay in LAYOUTS}
                      | {(lay, lay) for lay in LAYOUTS})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_layout,b_layout", LAYOUT_PAIRS, ids=[f"a-{a}-b-{b}" for a, b in LAYOUT_PAIRS])
def test_matmul_strided_views(a_layout, b_layout, dtype):
    m, k, n = 33, 65, 17
    (a_storage, a_view), (b_storage, b_view) = LAYOUTS[a_layout], LAYOUTS[b_layout]
    leaves = {"a": randn(*a_storage(m, k), dtype=dtype), "b": randn(*b_storage(k, n), dtype=dtype)}
    # Both expanded: the gradient of a's one stored row is one sum of random signs, which may cancel.
    check(dropin.ops.matmul, torch.matmul, leaves, build=lambda a, b: (a_view(a, m, k), b_view(b, k, n)),
          backward=not a_layout == b_layout == "expand")


B, M, K, N = 3, 7, 33, 17
# id -> (a storage, a view, b storage, b view), all views (B, M, K) and (B, K, N)
BATCHED_VIEWS = {
    "a-batch-stride0": ((M, K), lambda a: a.expand(B, M, K), (B, K, N), lambda b: b),
    "b-batch-stride0": ((B, M, K), lambda a: a, (1, K, N), lambda b: b.expand(B, K, N)),
    "a-mT": ((B, K, M), lambda a: a.mT, (B, K, N), lambda b: b),
    "b-mT": ((B, M, K), lambda a: a, (B, N, K), lambda b: b.mT),
    "both-mT": ((B, K, M), lambda a: a.mT, (B, N, K), lambda b: b.mT),
    "batch-permuted": ((M, B, K), lambda a: a.transpose(0, 1), (K, N, B), lambda b: b.permute(2, 0, 1)),
    "b-slice": ((B, M, K), lambda a: a, (B, K, 2 * N), lambda b: b[..., ::2]),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BATCHED_VIEWS)
@pytest.mark.parametrize("op", ["matmul", "bmm"])
def test_batched_strided_views(op, case, dtype):
    a_storage, a_view, b_storage, b_view = BATCHED_VIEWS[case]
    leaves = {"a": randn(*a_storage, dtype=dtype), "b": randn(*b_storage, dtype=dtype)}
    check(getattr(dropin.ops, op), getattr(torch, op), leaves, build=lambda a, b: (a_view(a), b_view(b)))


# ------------------------------------------------------------------------------------------------- bmm
BMM_SHAPES = [
    pytest.param((1, 1, 1, 1), id="1x1x1x1"),
    pytest.param((4, 33, 7, 17), id="4x33x7x17"),
    pytest.param((2, 127, 33, 7), id="2x127x33x7"),
    pytest.param((3, 17, 129, 65), id="weird-3x17x129x65"),
    pytest.param((16, 512, 128, 512), id="16x512x128x512", marks=gpu),
    pytest.param((64, 1000, 64, 1000), id="64x1000x64x1000", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bmkn", BMM_SHAPES)
def test_bmm(bmkn, dtype):
    b, m, k, n = bmkn
    check(dropin.ops.bmm, torch.bmm, {"a": randn(b, m, k, dtype=dtype), "b": randn(b, k, n, dtype=dtype)})


# ---------------------------------------------------------------------------------------------- linear
def linear_leaves(x_shape, n, dtype, bias=True):
    """x, weight (std 1/sqrt(K), as nn.Linear initialises it) and bias."""
    k = x_shape[-1]
    leaves = {"x": randn(*x_shape, dtype=dtype), "weight": randn(n, k, dtype=dtype, std=1 / math.sqrt(max(k, 1)))}
    if bias:
        leaves["bias"] = randn(n, dtype=dtype)
    return leaves


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS), ids=str)
def test_linear_activation(activation, bias, dtype):
    check(dropin_linear(activation), torch_linear(activation), linear_leaves((5, 7, 33), 17, dtype, bias))


LINEAR_SHAPES = [  # (x shape, out_features)
    pytest.param((33,), 21, id="x1d-33-n21"),  # (x's gradient sums of 21 terms: of 7, the 2x rule's noise failed)
    pytest.param((1, 1), 1, id="1x1-n1"),
    pytest.param((1000, 7), 33, id="1000x7-n33"),
    pytest.param((2, 3, 127), 1, id="2x3x127-n1"),
    pytest.param((2, 1, 3, 64), 64, id="2x1x3x64-n64"),
    pytest.param((3, 129), 65, id="weird-3x129-n65"),
    pytest.param((4, 256, 1024), 768, id="4x256x1024-n768", marks=gpu),
    pytest.param((8, 512, 4096), 1024, id="8x512x4096-n1024", marks=gpu),
    # few rows (decoding), the skinny kernel's: unsplit K, split K, a ragged N
    pytest.param((13, 1000), 333, id="few-rows-13x1000-n333"),
    pytest.param((5, 1100), 70, id="few-rows-5x1100-n70"),
    pytest.param((8, 1, 4096), 4096, id="decode-8x1x4096-n4096", marks=gpu),
    pytest.param((1, 4096), 4100, id="decode-1x4096-n4100", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape,n", LINEAR_SHAPES)
def test_linear_shapes(x_shape, n, dtype):
    check(dropin_linear("gelu"), torch_linear("gelu"), linear_leaves(x_shape, n, dtype))


LINEAR_VIEWS = {  # id -> {leaf: (storage shape, view)}; x (7, 33) -> weight (17, 33), bias (17,)
    "x-T": {"x": ((33, 7), lambda t: t.t())},
    "x-slice": {"x": ((7, 66), lambda t: t[:, ::2])},
    "x-expand": {"x": ((1, 33), lambda t: t.expand(7, 33))},
    "x-3d-permuted": {"x": ((7, 2, 33), lambda t: t.transpose(0, 1))},
    "weight-T": {"weight": ((33, 17), lambda t: t.t())},
    "weight-offset": {"weight": ((19, 36), lambda t: t[2:, 3:])},
    "bias-slice": {"bias": ((34,), lambda t: t[::2])},
    "bias-expand": {"bias": ((1,), lambda t: t.expand(17))},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LINEAR_VIEWS)
def test_linear_strided_views(case, dtype):
    views = LINEAR_VIEWS[case]
    leaves = linear_leaves((7, 33), 17, dtype)
    std = {"x": 1.0, "weight": 33**-0.5, "bias": 1.0}
    for name, (storage, _) in views.items():
        leaves[name] = randn(*storage, dtype=dtype, std=std[name])

    def build(**t):
        return tuple(views[k][1](v) if k in views else v for k, v in t.items())

    check(dropin_linear("silu"), torch_linear("silu"), leaves, build=build)


def test_repeat_calls_with_autograd_through_the_shortcut(monkeypatch, true_fp32):
    """Repeat calls where autograd records them (2-D, 1-D, folded and batched matmul, transposed operands, bmm,
    linear with bias, activation, a 1-D or transposed weight) take their signature's shortcut, forward and backward,
    and give what the op's own path gives, bit for bit (`_check.assert_grad_calls_repeat_through_shortcuts`)."""
    def r(*shape):
        return torch.randn(*shape, device=DEVICE)
    calls = [(dropin.matmul, (r(6, 5), r(5, 7))), (dropin.matmul, (r(5), r(5, 7))), (dropin.matmul, (r(6, 5), r(5))),
             (dropin.matmul, (r(2, 3, 6, 5), r(5, 7))), (dropin.matmul, (r(3, 6, 5), r(3, 5, 7))),
             (dropin.matmul, (r(5, 6).t(), r(7, 5).t())), (dropin.bmm, (r(3, 6, 5), r(3, 7, 5).mT)),
             (dropin.linear, (r(2, 3, 8), r(5, 8), r(5))), (dropin.linear, (r(4, 8), r(8))),
             (lambda x, w, b: dropin.linear(x, w, b, activation="gelu"), (r(4, 8), r(8, 5).t(), r(5))),
             (lambda x, w: dropin.linear(x, w, activation="silu"), (r(4, 8), r(5, 8)))]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


@pytest.mark.parametrize("activation", ["prelu", "Relu", "none", "gelu_erf"])
def test_linear_unknown_activation(activation):
    x, w = randn(3, 4), randn(5, 4)
    with pytest.raises(ValueError, match="'activation'"):
        dropin.ops.linear(x, w, activation=activation)


# ------------------------------------------------------------------------------------------ empty dims
EMPTY_MATMUL = [
    ((0, 33), (33, 17)),
    ((7, 0), (0, 17)),
    ((7, 33), (33, 0)),
    ((0,), (0,)),
    ((0,), (0, 17)),
    ((3, 7, 0), (0, 17)),
    ((0, 7, 33), (0, 33, 17)),
    ((0, 7, 33), (33, 17)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_shape,b_shape", EMPTY_MATMUL,
                         ids=[f"{shape_id(a)}@{shape_id(b)}" for a, b in EMPTY_MATMUL])
def test_matmul_empty(a_shape, b_shape, dtype):
    check(dropin.ops.matmul, torch.matmul, matmul_leaves(a_shape, b_shape, dtype))


EMPTY_BMM = [(0, 7, 33, 17), (3, 7, 0, 17), (3, 0, 33, 17), (3, 7, 33, 0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bmkn", EMPTY_BMM, ids=shape_id)
def test_bmm_empty(bmkn, dtype):
    b, m, k, n = bmkn
    check(dropin.ops.bmm, torch.bmm, {"a": randn(b, m, k, dtype=dtype), "b": randn(b, k, n, dtype=dtype)})


EMPTY_LINEAR = [  # K = 0: the output is activation(bias) on every row, and only bias gets a nonzero gradient
    pytest.param((7, 0), 17, act, id=f"k0-{act}") for act in ACTIVATIONS
] + [
    pytest.param((0, 33), 17, "gelu", id="m0"),
    pytest.param((7, 33), 0, "gelu", id="n0"),
    pytest.param((2, 0, 33), 17, "gelu", id="batch0"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape,n,activation", EMPTY_LINEAR)
def test_linear_empty(x_shape, n, activation, dtype):
    check(dropin_linear(activation), torch_linear(activation), linear_leaves(x_shape, n, dtype))


# ---------------------------------------------------------------------------------------- NaN and inf
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["matmul", "linear", "linear-relu"])
def test_nan_and_inf_propagate(op, dtype):
    """A NaN in a row of a and an inf in a column of b give torch's NaN row and +-inf column."""
    m, k, n = 9, 40, 11
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype)
    a[4, 5] = float("nan")
    b[17, 3] = float("inf")
    if op == "matmul":
        check(dropin.ops.matmul, torch.matmul, {"a": a, "b": b}, backward=False)
    else:
        act = "relu" if op == "linear-relu" else None
        leaves = {"x": a, "weight": b.t().contiguous(), "bias": randn(n, dtype=dtype)}
        check(dropin_linear(act), torch_linear(act), leaves, backward=False)


# ---------------------------------------------------------------------------------- random configurations
CPU_DTYPES = [torch.float32, torch.float16]


@settings(max_examples=25 if ON_GPU else 15, deadline=None,
          phases=list(Phase) if ON_GPU else [Phase.explicit, Phase.reuse, Phase.generate])  # CPU: no slow shrinking
@given(
    batch=mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3),
    mkn=st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 40)),
    a_form=st.sampled_from(["normal", "transposed", "vector"]),
    b_form=st.sampled_from(["normal", "transposed", "vector"]),
    dtype=st.sampled_from(CPU_DTYPES + ([torch.bfloat16] if ON_GPU else [])),
)
def test_matmul_random_configs(batch, mkn, a_form, b_form, dtype):
    m, k, n = mkn
    (a_batch, b_batch) = batch.input_shapes
    a_storage = {"normal": (*a_batch, m, k), "transposed": (*a_batch, k, m), "vector": (k,)}[a_form]
    b_storage = {"normal": (*b_batch, k, n), "transposed": (*b_batch, n, k), "vector": (k,)}[b_form]

    def build(a, b):
        return (a.mT if a_form == "transposed" else a), (b.mT if b_form == "transposed" else b)

    check(dropin.ops.matmul, torch.matmul, matmul_leaves(a_storage, b_storage, dtype), build=build)


# ------------------------------------------------------------------------------------------- references
def test_reference_functions():
    """dropin.ops.matmul holds matmul_ref, bmm_ref, linear_ref (DESIGN.md): plain torch, float64-exact."""
    module = importlib.import_module("dropin.ops.matmul")  # dropin.ops.matmul is also the function
    a, b = randn(2, 5, 7).double(), randn(2, 7, 3).double()
    torch.testing.assert_close(module.matmul_ref(a, b), torch.matmul(a, b), rtol=1e-12, atol=0)
    torch.testing.assert_close(module.bmm_ref(a, b), torch.bmm(a, b), rtol=1e-12, atol=0)
    x, w, bias = randn(4, 7).double(), randn(3, 7).double(), randn(3).double()
    for activation in ACTIVATIONS:
        torch.testing.assert_close(module.linear_ref(x, w, bias, activation), linear_ref(x, w, bias, activation),
                                   rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- errors
WRONG_DEVICE = "cpu" if ON_GPU else "meta"  # a device the kernels cannot run on here


def T(*shape, dtype=torch.float32, device=None):
    return torch.randn(shape, device=device or DEVICE).to(dtype)


def I(*shape):  # noqa: E743
    return torch.ones(*shape, dtype=torch.int32, device=DEVICE)


fp16 = torch.float16
ERRORS = [  # (id, op, arguments, exception, the argument the message must name)
    ("mm-dtype-mismatch", "matmul", lambda: (T(3, 4), T(4, 5, dtype=fp16)), RuntimeError, "b"),
    ("mm-inner-dim", "matmul", lambda: (T(3, 4), T(5, 6)), RuntimeError, "b"),
    ("mm-batch-mismatch", "matmul", lambda: (T(2, 3, 4), T(3, 4, 5)), RuntimeError, "b"),
    ("mm-int", "matmul", lambda: (I(3, 4), I(4, 5)), RuntimeError, "a"),
    ("mm-0dim-a", "matmul", lambda: (T(), T(4)), RuntimeError, "a"),
    ("mm-0dim-b", "matmul", lambda: (T(4), T()), RuntimeError, "b"),
    ("mm-list-a", "matmul", lambda: ([[1.0]], T(1, 1)), TypeError, "a"),
    ("mm-float-b", "matmul", lambda: (T(1, 1), 2.0), TypeError, "b"),
    ("mm-device-a", "matmul", lambda: (T(3, 4, device=WRONG_DEVICE), T(4, 5)), RuntimeError, "a"),
    ("mm-device-b", "matmul", lambda: (T(3, 4), T(4, 5, device=WRONG_DEVICE)), RuntimeError, "b"),
    ("bmm-2d-a", "bmm", lambda: (T(3, 4), T(2, 4, 5)), RuntimeError, "a"),
    ("bmm-4d-b", "bmm", lambda: (T(2, 3, 4), T(1, 2, 4, 5)), RuntimeError, "b"),
    ("bmm-batch-mismatch", "bmm", lambda: (T(2, 3, 4), T(3, 4, 5)), RuntimeError, "b"),
    ("bmm-no-broadcast", "bmm", lambda: (T(2, 3, 4), T(1, 4, 5)), RuntimeError, "b"),
    ("bmm-inner-dim", "bmm", lambda: (T(2, 3, 4), T(2, 5, 5)), RuntimeError, "b"),
    ("bmm-dtype-mismatch", "bmm", lambda: (T(2, 3, 4), T(2, 4, 5, dtype=fp16)), RuntimeError, "b"),
    ("bmm-int", "bmm", lambda: (I(2, 3, 4), I(2, 4, 5)), RuntimeError, "a"),
    ("bmm-tuple-b", "bmm", lambda: (T(2, 3, 4), (1.0,)), TypeError, "b"),
    ("bmm-device-b", "bmm", lambda: (T(2, 3, 4), T(2, 4, 5, device=WRONG_DEVICE)), RuntimeError, "b"),
    ("linear-in-features", "linear", lambda: (T(3, 4), T(5, 6)), RuntimeError, "weight"),
    ("linear-weight-3d", "linear", lambda: (T(3, 4), T(2, 5, 4)), RuntimeError, "weight"),
    ("linear-weight-dtype", "linear", lambda: (T(3, 4), T(5, 4, dtype=fp16)), RuntimeError, "weight"),
    ("linear-bias-dtype", "linear", lambda: (T(3, 4), T(5, 4), T(5, dtype=fp16)), RuntimeError, "bias"),
    ("linear-bias-shape", "linear", lambda: (T(3, 4), T(5, 4), T(6)), RuntimeError, "bias"),
    ("linear-x-0dim", "linear", lambda: (T(), T(5, 4)), RuntimeError, "x"),
    ("linear-int", "linear", lambda: (I(3, 4), I(5, 4)), RuntimeError, "x"),
    ("linear-x-list", "linear", lambda: ([[1.0]], T(5, 1)), TypeError, "x"),
    ("linear-weight-list", "linear", lambda: (T(3, 4), [[1.0] * 4]), TypeError, "weight"),
    ("linear-bias-float", "linear", lambda: (T(3, 4), T(5, 4), 1.0), TypeError, "bias"),
    ("linear-device-x", "linear", lambda: (T(3, 4, device=WRONG_DEVICE), T(5, 4)), RuntimeError, "x"),
    ("linear-device-weight", "linear", lambda: (T(3, 4), T(5, 4, device=WRONG_DEVICE)), RuntimeError, "weight"),
    ("linear-device-bias", "linear", lambda: (T(3, 4), T(5, 4), T(5, device=WRONG_DEVICE)), RuntimeError, "bias"),
]
TORCH_OPS = {"matmul": torch.matmul, "bmm": torch.bmm, "linear": F.linear}


@pytest.mark.parametrize("op,args,exc,name", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_input_raises(op, args, exc, name):
    args = args()
    with pytest.raises(exc, match=f"'{name}'"):
        getattr(dropin.ops, op)(*args)
    try:  # where PyTorch rejects the input too, it raises the same type
        TORCH_OPS[op](*args)
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, exc), f"torch raises {type(e).__name__}, the test expects {exc.__name__}"


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("op", ["matmul", "bmm", "linear"])
def test_tensors_on_different_gpus(op):
    a, b = T(2, 3, 4, device="cuda:0"), T(2, 4, 5, device="cuda:1")
    if op == "linear":
        a, b = a[0], b[0].t()
    with pytest.raises(RuntimeError, match="'b'" if op != "linear" else "'weight'"):
        getattr(dropin.ops, op)(a, b)


# ------------------------------------------------------------------------- TF32, compile, autocast
@triton.jit
def _tf32_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, _gemm.round_tf32(tl.load(x_ptr + offs)))


def test_tf32_operand_rounding():
    """round_tf32(x) is x rounded half away from zero to a tf32 value (its low 13 bits clear: the MMA's truncation,
    and the interpreter without it, see the same operand); inf, nan and the largest finite values pass unchanged
    (to the MMA's truncation)."""
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 0.0, -0.0, 1e-40])
    x = torch.cat([special, torch.randn(1024 - len(special)) * 10.0 ** torch.randint(-30, 30, (1024 - len(special),))])
    x = x.to(DEVICE)
    y = torch.full_like(x, 7.0)
    _tf32_kernel[(1,)](x, y, N=1024)
    seen = y.view(torch.int32) & ~0x1FFF
    bits = x.view(torch.int32)
    finite = x.abs() < 3.0e38
    expect = torch.where(finite, (bits + 0x1000) & ~0x1FFF, bits & ~0x1FFF)
    assert torch.equal(seen[x == x], expect[x == x])
    assert not (y.view(torch.int32)[finite] & 0x1FFF).any()
    assert torch.isnan(y[~(x == x)]).all()
    rounded = seen.view(torch.float32).double()
    normal = finite & (x.abs() >= torch.finfo(torch.float32).tiny)  # relative bound: normal numbers only
    assert ((rounded - x.double()).abs()[normal] <= x.double().abs()[normal] * 2.0**-11).all()


@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["allow_tf32-off", "allow_tf32-on"])
@pytest.mark.parametrize("op", ["matmul", "linear"])
def test_float32_follows_allow_tf32(op, tf32, allow_tf32):
    """True fp32 (1e-5) unless torch.backends.cuda.matmul.allow_tf32; then the tf32 tolerance."""
    allow_tf32(tf32)
    if op == "matmul":
        check(dropin.ops.matmul, torch.matmul, {"a": randn(256, 2048), "b": randn(2048, 384)})
    else:
        # gelu, not relu: relu's gradient jumps at 0, so a tf32-sized change of z flips it wholesale.
        check(dropin_linear("gelu"), torch_linear("gelu"), linear_leaves((4, 64, 2048), 384, torch.float32))


@pytest.mark.parametrize("copies", [None, "ab", "b"], ids=["in-registers", "copies", "copy-of-b"])
@pytest.mark.parametrize("layout", ["nn", "tt"])
def test_tf32_products_use_rounded_operands(layout, copies, allow_tf32, monkeypatch):
    """With TF32 allowed, the kernels multiply tf32-rounded operands (rounded in registers; rounded copies of both
    where the product is large, of B alone where both do not fit the copy budget: forced; once a call, a repeat's
    look-up for a shortcut copying nothing) and sum in fp32: the float64 product of the rounded operands, to fp32
    accuracy (the MMA's truncation leaves them as they are)."""
    allow_tf32(True)
    if copies:
        monkeypatch.setattr(_mm_module, "tf32_copies_pay", lambda M, N: True)
        monkeypatch.setattr(_mm_module, "copied_operands", lambda batch, M, K, N, parts, a_aligned=False: copies)
    monkeypatch.setattr(_mm_module, "_shortcuts", _dispatch.Shortcuts(differentiable=True))  # (none kept before)
    _check.replan(_mm_module)
    a, b = randn(33, 70), randn(70, 20)
    if layout == "tt":
        a, b = a.mT.contiguous().mT, b.mT.contiguous().mT
    bits = lambda t: (t.view(torch.int32) + 0x1000) & -8192  # noqa: E731  (finite values)
    rounded = lambda t: bits(t).view(torch.float32).double()  # noqa: E731
    made = []  # the copies' launches, by the operands they copy
    operands = importlib.import_module("dropin.ops.matmul_operands")
    copy, pair_copy = operands.operand_copy, operands.operand_pair_copy
    monkeypatch.setattr(operands, "operand_copy", lambda t, k_dim, *args: made.append("ab"[k_dim % 2])
                        or copy(t, k_dim, *args))
    monkeypatch.setattr(operands, "operand_pair_copy", lambda *args: made.append("ab") or pair_copy(*args))
    out = dropin.matmul(a, b)
    again = dropin.matmul(a, b)  # (no shortcut: each call copies its operands, once; both in one launch)
    _check.replan(_mm_module)
    assert made == {None: [], "ab": ["ab", "ab"], "b": ["b", "b"]}[copies]
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert rel_err(out, rounded(a) @ rounded(b)) < 1e-6
    assert rel_err(out, a.double() @ b.double()) > 1e-5  # not an fp32 product


@pytest.mark.parametrize("round_tf32,split,negate_a",
                         [(True, False, False), (False, True, True), (False, False, False)],
                         ids=["rounded", "split", "aligned"])
def test_pair_copy_is_two_copies(round_tf32, split, negate_a):
    """A and B copied in one launch (`operand_pair_copy`) give exactly the two single copies: values, layouts and
    the lo parts of split copies (-A's with negate_a), on odd sizes and B column-major (a transposed read)."""
    operands = importlib.import_module("dropin.ops.matmul_operands")
    a, b = randn(2, 33, 70), randn(2, 21, 70).mT
    copies = operands.operand_pair_copy(a, b, round_tf32, split, negate_a, False)
    singles = (operands.operand_copy(a, 2, round_tf32, False, split, negate_a),
               operands.operand_copy(b, 1, round_tf32, False, split))
    for y, single in zip(copies, singles):
        parts = [(y, single)]
        if split:  # (the lo part: `batch` batch strides past the hi part)
            parts.append(tuple(torch.as_strided(t, t.shape, t.stride(), t.storage_offset() + 2 * t.stride(0))
                               for t in (y, single)))
        for t, t_single in parts:
            assert t.stride() == t_single.stride()
            torch.testing.assert_close(t, t_single, rtol=0, atol=0)


def _chain(matmul, linear, bmm):
    def f(a, b, weight, bias, c):
        return bmm(linear(matmul(a, b), weight, bias, "gelu"), c)
    return f


# Under the interpreter the ops are opaque custom ops (`_dispatch.torch_op`), so this runs on a CPU too (~10 s).
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=gpu)])
def test_torch_compile_fullgraph(dtype):
    """matmul -> linear(+bias, gelu) -> bmm compiled with fullgraph=True (no graph break), fwd and bwd."""
    torch._dynamo.reset()
    compiled = torch.compile(_chain(dropin.ops.matmul, dropin.ops.linear, dropin.ops.bmm), fullgraph=True)
    reference = _chain(torch.matmul, linear_ref, torch.bmm)
    leaves = {"a": randn(2, 64, 96, dtype=dtype), "b": randn(96, 128, dtype=dtype),
              "weight": randn(80, 128, dtype=dtype, std=128**-0.5), "bias": randn(80, dtype=dtype),
              "c": randn(2, 80, 48, dtype=dtype)}
    check(compiled, reference, leaves)


def _mm_operands(batch, m, k, n, dtype, layout):
    """a [batch, m, k] and b [batch, k, n] in `layout`: n (row-major), t (column-major) or s (every other
    column of a wider tensor) per operand; b "b" is one matrix broadcast over the batch (batch stride 0)."""
    def make(rows, cols, form):
        if form == "t":
            return randn(batch, cols, rows, dtype=dtype).mT
        if form == "s":
            return randn(batch, rows, 2 * cols, dtype=dtype)[:, :, ::2]
        if form == "b":
            return randn(1, rows, cols, dtype=dtype).expand(batch, rows, cols)
        return randn(batch, rows, cols, dtype=dtype)
    return make(m, k, layout[0]), make(k, n, layout[1])


MM_OPS = [  # (id, batch, m, k, n, dtype, layout, bias, activation, save_preact, path)
    ("ptr-fp32", 2, 33, 40, 24, torch.float32, "nn", True, "silu", True, None),
    ("ptr-fp16-strided", 2, 20, 24, 40, torch.float16, "st", False, "none", False, None),
    ("ptr-broadcast", 3, 17, 24, 16, torch.float32, "nb", True, "gelu_tanh", False, None),
    ("fma-vector", 3, 1, 50, 20, torch.float32, "nt", True, "relu", True, None),
    ("narrow", 1, 40, 30, 10, torch.float32, "tn", False, "gelu", False, None),
    ("empty", 2, 0, 24, 16, torch.float32, "nn", True, "silu", True, None),
    ("tf32", 2, 24, 40, 16, torch.float32, "tt", True, "none", True, "tf32"),
    ("tf32-copies", 2, 24, 40, 16, torch.float32, "nn", True, "gelu", True, "tf32-copies"),
    ("tf32-copy-of-b", 2, 24, 40, 16, torch.float32, "tn", True, "none", False, "tf32-copy-of-b"),
    ("tma-fp16", 2, 64, 64, 64, torch.float16, "nt", True, "silu", True, "tma"),
    ("tma-odd-fp16", 2, 40, 37, 27, torch.float16, "nt", True, "silu", True, "tma-odd"),
    ("splitk-fp16", 1, 24, 300, 40, torch.float16, "nn", True, "silu", True, "splitk"),
]


@pytest.mark.parametrize("batch,m,k,n,dtype,layout,bias,activation,save_preact,path", [c[1:] for c in MM_OPS],
                         ids=[c[0] for c in MM_OPS])
def test_registered_mm(batch, m, k, n, dtype, layout, bias, activation, save_preact, path, allow_tf32,
                       monkeypatch):
    """Schema, fake and dynamic-shape tracing of dropin::mm (what torch.compile sees) in each kernel family:
    pointer (strided and broadcast operands), CUDA-core (one row), tf32 rounded in the kernel and through operand
    copies (forced: small products round in the kernel), TMA (offered as on Hopper: under the interpreter its
    descriptors are emulated; with odd sizes on aligned copies, forced), split K (forced)."""
    allow_tf32(str(path).startswith("tf32"))
    if path in ("tf32-copies", "tf32-copy-of-b"):
        monkeypatch.setattr(_mm_module, "tf32_copies_pay", lambda M, N: True)
        copied = "b" if path == "tf32-copy-of-b" else "ab"
        monkeypatch.setattr(_mm_module, "copied_operands", lambda batch, M, K, N, parts, a_aligned=False: copied)
    if path in ("tma", "tma-odd"):
        monkeypatch.setattr(_mm_module._runtime, "is_hopper", lambda index=0: True)
    if path == "tma-odd":
        monkeypatch.setattr(_mm_module, "aligned_copies_pay", lambda batch, M, N, K, size, precision: True)
    if path == "splitk":
        real_pick = _mm_module._autotune.pick
        split = dict(_mm_module.PTR_CONFIGS[2][-1], KERNEL="ptr")
        assert split["SPLIT_K"] > 1
        monkeypatch.setattr(_mm_module._autotune, "pick", lambda name, key, configs, prepare, **timing: split
                            if name == "matmul" else real_pick(name, key, configs, prepare, **timing))
    a, b = _mm_operands(batch, m, k, n, dtype, layout)
    _check.opcheck(torch.ops.dropin.mm.default, a, b, randn(n, dtype=dtype) if bias else None, activation,
                   save_preact)


@contextlib.contextmanager
def tma_launches(monkeypatch):
    """The constexprs of every mm_tma_kernel Launch that matmul makes inside the block (a list, filled as they are
    made), matmul's plans emptied before and after and its shortcuts new (so that the block plans anew)."""
    made = []
    real = _mm_module.Launch

    def spy(kernel, grid, constexprs, **kwargs):
        if kernel is _mm_module.mm_tma_kernel:
            made.append(constexprs)
        return real(kernel, grid, constexprs, **kwargs)
    monkeypatch.setattr(_mm_module, "Launch", spy)
    monkeypatch.setattr(_mm_module, "_shortcuts", _dispatch.Shortcuts(differentiable=True))
    _check.replan(_mm_module)
    try:
        yield made
    finally:
        _check.replan(_mm_module)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_tma_kernel_on_odd_shapes(dtype, monkeypatch):
    """Offered as on Hopper, a product whose rows are not 16-byte aligned (K = 37, N = 27: no descriptor takes
    them) runs the TMA kernel on aligned copies of its operands (`aligned_copies_pay` forced: products this small
    keep the pointer kernel) and stores C, Z and the gradients through pointers (C_PTR): linear + bias + silu,
    forward and backward, against float64. The copies pay only for large products (16-bit, or fp32 as tf32x3), and
    fit COPY_WORKSPACE."""
    pay = _mm_module.aligned_copies_pay
    assert not pay(1, 66, 27, 37, 2, "ieee") and pay(1, 4093, 4099, 4091, 2, "ieee")
    assert pay(1, 1000, 1000, 999, 4, "tf32x3") and not pay(1, 1000, 1000, 999, 2, "ieee")
    assert not pay(1, 4093, 4099, 4091, 4, "tf32") and not pay(1, 4093, 4099, 4091, 4, "ieee")
    assert not pay(1, 32768, 32768, 2047, 2, "ieee") and not pay(4, 4093, 4099, 4091, 2, "ieee")  # (256 MiB)
    monkeypatch.setattr(_mm_module._runtime, "is_hopper", lambda index=0: True)
    monkeypatch.setattr(_mm_module, "aligned_copies_pay", lambda batch, M, N, K, size, precision: True)
    with tma_launches(monkeypatch) as tma:
        check(dropin_linear("silu"), torch_linear("silu"), linear_leaves((2, 33, 37), 27, dtype))
    assert len(tma) == 3 and all(c["C_PTR"] for c in tma), tma  # (forward, input and weight gradients)


def test_tma_epilogue_in_halves(monkeypatch):
    """The TMA kernel's tiles stored as two halves (EPILOGUE_SUBTILE, forced; offered as on Hopper): linear + bias
    + silu (C and Z stored so) forward and both gradients against float64, with N a multiple of neither the tile
    nor its half."""
    subtile = [c for c in _mm_module.TMA_ROUNDED_CONFIGS if c.get("EPILOGUE_SUBTILE")]
    assert subtile
    monkeypatch.setattr(_mm_module._runtime, "is_hopper", lambda index=0: True)
    real_pick = _mm_module._autotune.pick
    monkeypatch.setattr(_mm_module._autotune, "pick", lambda name, key, configs, prepare, **timing: dict(
        subtile[0], KERNEL="tma") if name == "matmul" else real_pick(name, key, configs, prepare, **timing))
    with tma_launches(monkeypatch) as tma:
        check(dropin_linear("silu"), torch_linear("silu"), linear_leaves((2, 33, 72), 40, torch.float16))
    assert len(tma) == 3 and all(c["EPILOGUE_SUBTILE"] and not c["C_PTR"] for c in tma), tma


@pytest.mark.parametrize("copies", ["ab", "b"], ids=["copies", "copy-of-b"])
@pytest.mark.parametrize("chain", [False, True], ids=["per-tile", "correction-chain"])
def test_true_fp32_on_split_copies(chain, copies, monkeypatch):
    """True fp32 (tf32x3) on the TMA kernel from operands copied as two tf32 parts each, hi and lo a plane apart,
    or B's alone with A's tiles split in registers (`split_copies_pay` and `copied_operands` forced: products this
    small split both in registers; the interpreter's tf32x3 offered as on a GPU), each K tile's three products
    together or the correction products in a chain of their own (the config picked): linear + bias + gelu of odd
    sizes and a batched product, forward and both gradients, against float64. The copies pay for large products;
    both, B's alone or neither fit the copy budget."""
    pay = _mm_module.split_copies_pay
    assert pay(4096, 4096) and pay(1024, 1000) and not pay(64, 4096)
    copied = _mm_module.copied_operands
    assert copied(1, 2048, 4096, 2048, 2) == "ab" and copied(1, 4096, 4096, 4096, 1) == "ab"
    assert copied(1, 4096, 4096, 4096, 2) == "b" and copied(1, 16384, 16384, 16384, 2) == ""
    assert copied(1, 6007, 4999, 3001, 2, a_aligned=True) == "b" and copied(1, 9000, 4999, 3001, 2, True) == ""
    monkeypatch.setattr(_mm_module._runtime, "is_hopper", lambda index=0: True)
    monkeypatch.setattr(_mm_module, "split_copies_pay", lambda M, N: True)
    monkeypatch.setattr(_mm_module, "copied_operands", lambda batch, M, K, N, parts, a_aligned=False: copies)
    real_precision = _gemm.precision
    monkeypatch.setattr(_gemm, "precision", lambda dtype, allow_tf32=None, k=None, macs=None:
                        "tf32x3" if dtype == torch.float32 else real_precision(dtype, allow_tf32, k, macs))
    real_pick = _mm_module._autotune.pick
    monkeypatch.setattr(_mm_module._autotune, "pick", lambda name, key, configs, prepare, **timing: dict(
        configs[0], CORRECTION_CHAIN=chain) if key[2].startswith("tf32x3_split") else real_pick(
        name, key, configs, prepare, **timing))
    with tma_launches(monkeypatch) as tma:
        check(dropin_linear("gelu"), torch_linear("gelu"), linear_leaves((2, 33, 37), 27, torch.float32))
        check(dropin.ops.bmm, torch.bmm, {"a": randn(3, 20, 35, dtype=torch.float32),  # (lo parts 3 batches on)
                                          "b": randn(3, 35, 18, dtype=torch.float32)})
    assert len(tma) == 6, tma  # (forward, both gradients)
    precision = "tf32x3_split" if copies == "ab" else "tf32x3_split_b"
    assert all(c["PRECISION"] == precision and c["CORRECTION_CHAIN"] == chain for c in tma), tma


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_deep_split_k(dtype, monkeypatch):
    """A product with fewer tiles than SMs and a long K offers K split over about two programs per SM
    (`matmul_configs.deep_split_configs`, none that the fixed configs hold); forced, each matches float64 (fp32 partials
    summed by split_sum_kernel's loop over the splits) with bias and activation. None for a product that fills
    the SMs or has a short K."""
    monkeypatch.setattr(_mm_module._runtime, "num_sms", lambda index=0: 64)
    M, K, N = 5, 32768 + 40, 24
    size, max_k = dtype.itemsize, _gemm.max_k(_gemm.precision(dtype, k=K), dtype.itemsize)
    deep = matmul_configs.deep_split_configs(1, M, N, K, size, max_k, 0)
    assert deep and all(c["SPLIT_K"] > 1 and c["KERNEL"] == "ptr" for c in deep)
    assert [c["SPLIT_K"] for c in matmul_configs.deep_split_configs(1, 1024, 1024, 65536, size, max_k, 0)] == [2]
    assert not matmul_configs.deep_split_configs(1, M, N, 256, size, max_k, 0)
    assert not matmul_configs.deep_split_configs(64, 512, 512, K, size, max_k, 0)
    a, b, bias = randn(M, K, dtype=dtype), randn(K, N, dtype=dtype), randn(N, dtype=dtype)
    ref = F.gelu(a.double() @ b.double() + bias.double())
    for cfg in deep:
        monkeypatch.setattr(_mm_module._autotune, "pick", lambda name, key, configs, prepare, **timing: cfg)
        _check.replan(_mm_module)
        try:
            out = dropin.linear(a, b.T, bias, activation="gelu")
        finally:
            _check.replan(_mm_module)
        assert_close(out, ref, dtype, "fwd", torch_out=F.gelu(a @ b + bias), what=f"{cfg}")


@pytest.mark.parametrize("activation,z,bias_grad,rows", [
    ("none", False, True, 100), ("gelu", True, False, 20), ("silu", True, True, 10), ("relu", True, True, 100),
    ("silu", True, True, 0)], ids=["bias-only-splits", "gelu", "silu-bias", "relu-bias-splits", "empty"])
def test_registered_act_grad(activation, z, bias_grad, rows):
    """dropin::act_grad: the activation's gradient and the bias gradient, summed in one or in several row
    splits; grad_y strided (a transposed view), as an upstream gradient may be."""
    grad_y = randn(2, 40, rows).mT
    _check.opcheck(torch.ops.dropin.act_grad.default, grad_y, randn(2, rows, 40) if z else None, activation,
                   bias_grad)


@gpu
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", ["matmul", "bmm", "linear"])
def test_autocast(op, amp_dtype):
    """fp32 inputs under torch.autocast: the output dtype of torch's op, fp32 grads, amp tolerance."""
    if op == "linear":
        fn, ref, leaves = dropin_linear("gelu_tanh"), torch_linear("gelu_tanh"), linear_leaves((4, 96, 256), 160,
                                                                                                 torch.float32)
    else:
        fn, ref = getattr(dropin.ops, op), getattr(torch, op)
        leaves = {"a": randn(4, 96, 256), "b": randn(4, 256, 160)}
    check(fn, ref, leaves, autocast=amp_dtype)


@gpu  # (bf16 products: the interpreter's are wrong)
@pytest.mark.parametrize("op", ["matmul", "bmm", "linear"])
def test_autocast_mixed_dtypes(op):
    """Under torch.autocast an operand already in the autocast dtype (a previous op's output) meets an fp32 one (a
    weight): autocast casts both, as torch's op does, where outside autocast this is an error."""
    a, b = randn(2, 24, 40).bfloat16(), randn(2, 40, 16)
    fn, ref = getattr(dropin.ops, op), getattr(torch, op) if op != "linear" else F.linear
    if op == "linear":
        b = b[0].t()
    with pytest.raises(RuntimeError, match="same dtype"):
        fn(a, b)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out, want = fn(a, b), ref(a, b)
    assert out.dtype == want.dtype == torch.bfloat16
    assert_close(out, ref(a.double(), b.bfloat16().double()), torch.bfloat16, "fwd", torch_out=want)
