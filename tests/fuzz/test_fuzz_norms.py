"""Fuzzing the normalizations, softmax, the activations and rope against torch: layer_norm, rms_norm, group_norm,
batch_norm, softmax / log_softmax, relu / gelu / silu / activation and rope, forward and backward (or forward alone)
vs float64 and the 2x rule (`_check.check`)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st
from torch._prims_common import suggest_memory_format

import dropin
from _fuzz import CONTIGUOUS, FUZZ, SEEDS, compare, layouts, sizes, start
from _tol import DEVICE, DTYPES
from dropin.ops.activations import ACTIVATIONS, activation_ref
from dropin.ops.group_norm import group_norm_ref
from dropin.ops.rms_norm import rms_norm_ref
from dropin.ops.rope import rope_ref

pytestmark = [pytest.mark.fuzz, pytest.mark.usefixtures("true_fp32")]

BACKWARD = st.booleans()  # False: forward alone, without autograd (the ops' inference paths)
EPS = st.sampled_from((1e-6, 1e-5, 1e-2))


def shapes(min_rank=0, max_rank=4, hi=9):
    return st.lists(sizes(1, hi), min_size=min_rank, max_size=max_rank).map(tuple)


def equal_within_sets(layout, extents: dict) -> bool:
    """Whether x's layout repeats one value over every dim along which a normalized set extends (dim -> extent):
    the set's values are then all equal and its normalized output is 0 exactly, where float64 torch returns its
    rounding (1e-15), which no relative error can compare with. Such draws are left out."""
    spread = [d for d, n in extents.items() if n > 1]
    return bool(spread) and layout.kind == "expanded" and all(d in layout.dims for d in spread)


@st.composite
def layer_norm_cases(draw):
    """normalized_shape the last 1 to all dims; weight and bias each given or not, in input's dtype (torch's CPU
    kernel takes no other)."""
    shape = draw(shapes(1, 4))
    norm = shape[len(shape) - draw(st.integers(1, len(shape))):]
    layout = draw(layouts(len(shape)))
    assume(not equal_within_sets(layout, {d: shape[d] for d in range(len(shape) - len(norm), len(shape))}))
    return dict(shape=shape, norm=norm, weight=draw(st.booleans()), bias=draw(st.booleans()), eps=draw(EPS),
                layout=layout, w_layout=draw(layouts(len(norm))), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=layer_norm_cases(), seed=SEEDS)
def test_layer_norm(dtype, case, seed):
    start("layer_norm", seed)
    norm, eps = list(case["norm"]), case["eps"]
    leaves = {"x": case["layout"].tensor(case["shape"], dtype)}
    for name in ("weight", "bias"):
        if case[name]:
            leaves[name] = case["w_layout"].tensor(case["norm"], dtype)
    # one normalized element: x's and the weight's gradients are 0 exactly (xhat is 0); two: xhat is +-1 whatever
    # x is, so x's gradient is eps-sized, a cancellation that fp16 cannot resolve (torch's own error too)
    count = torch.Size(norm).numel()
    constant = ("x", "weight") if count == 1 else ("x",) if count == 2 else ()
    compare(lambda t: dropin.ops.layer_norm(t["x"], norm, t.get("weight"), t.get("bias"), eps),
            lambda t: F.layer_norm(t["x"], norm, t.get("weight"), t.get("bias"), eps), leaves,
            build=lambda **t: (t,), constant=constant, backward=case["backward"])


@st.composite
def rms_norm_cases(draw):
    """HF's Llama or Gemma RMSNorm; the weight in x's dtype or float32 (the output then promoted, as HF's); a
    residual of x's shape and dtype or none."""
    shape = draw(shapes(1, 3, hi=40))
    return dict(shape=shape, weight_fp32=draw(st.booleans()), residual=draw(st.booleans()),
                form=draw(st.sampled_from(("llama", "gemma"))), eps=draw(EPS), layout=draw(layouts(len(shape))),
                r_layout=draw(layouts(len(shape))), w_layout=draw(layouts(1)), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=rms_norm_cases(), seed=SEEDS)
def test_rms_norm(dtype, case, seed):
    start("rms_norm", seed)
    leaves = {"x": case["layout"].tensor(case["shape"], dtype),
              "weight": case["w_layout"].tensor(case["shape"][-1:], torch.float32 if case["weight_fp32"] else dtype,
                                                scale=0.1, offset=1.0)}
    if case["residual"]:
        leaves["residual"] = case["r_layout"].tensor(case["shape"], dtype)
    eps, form = case["eps"], case["form"]
    # one element a row: x's gradient is eps-sized, a cancellation fp32 cannot resolve (torch's own error ~1e-2)
    constant = ("x", "residual") if case["shape"][-1] == 1 else ()
    compare(lambda x, weight, residual=None: dropin.ops.rms_norm(x, weight, eps, residual, form),
            lambda x, weight, residual=None: rms_norm_ref(x, weight, eps, residual, form), leaves, dtype=dtype,
            constant=constant, backward=case["backward"])


@st.composite
def group_norm_cases(draw):
    """input [N, C, *spatial] (0 to 3 spatial dims), num_groups a divisor of C, weight and bias each given or not
    (input's dtype: torch's CPU kernel takes no other), a fused activation."""
    G, per_group = draw(sizes(1, 4)), draw(sizes(1, 4))
    shape = (draw(sizes(1, 3)), G * per_group, *draw(shapes(0, 3, hi=6)))
    if torch.Size(shape).numel() == G:  # torch refuses one value a group over the whole batch
        shape = (2, *shape[1:])
    layout, bias = draw(layouts(len(shape), channels_last=True)), draw(st.booleans())
    extents = {1: per_group, **{d: shape[d] for d in range(2, len(shape))}}
    assume(not equal_within_sets(layout, extents))
    # one value a group and no bias: the output is 0 exactly, float64 torch's its rounding (as above)
    assume(bias or torch.Size(extents.values()).numel() > 1)
    return dict(shape=shape, groups=G, weight=draw(st.booleans()), bias=bias, eps=draw(EPS),
                activation=draw(st.sampled_from((None, *ACTIVATIONS))), layout=layout, backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=group_norm_cases(), seed=SEEDS)
def test_group_norm(dtype, case, seed):
    start("group_norm", seed)
    shape, G = case["shape"], case["groups"]
    leaves = {"x": case["layout"].tensor(shape, dtype)}
    for name in ("weight", "bias"):
        if case[name]:
            leaves[name] = CONTIGUOUS.tensor(shape[1:2], dtype)
    args = case["eps"], case["activation"]
    # one element a group: x's and the weight's gradients are 0 exactly (xhat is 0); two: xhat is +-1 whatever x
    # is, x's gradient eps-sized (as layer_norm's)
    per_group = torch.Size(shape[1:]).numel() // G
    constant = ("x", "weight") if per_group == 1 else ("x",) if per_group == 2 else ()

    def weight(t):
        """t's weight, else ones in x's dtype and device (it rounds nothing), for torch's peer and the reference:
        older torch's native_group_norm_backward (2.11's) allocates the bias's gradient by empty_like(weight), and
        an undefined weight raises "tensor does not have a device"; that code is shared by CPU and CUDA, so the
        float64 CPU reference raises it too (newer torch allocates it from x's options)."""
        return t["weight"] if "weight" in t else torch.ones(shape[1], device=t["x"].device, dtype=t["x"].dtype)

    def peer(t):
        """torch in the test dtype: `weight`'s; a 4-D output and x's gradient in x's suggested memory format
        (torch's CPU kernel's; its CUDA kernel's are NCHW whatever the input, where dropin keeps a channels_last
        model's)."""
        x = _InFormat.apply(t["x"])
        y = group_norm_ref(x, G, weight(t), t.get("bias"), *args)
        return y.contiguous(memory_format=_format(x))
    compare(lambda t: dropin.ops.group_norm(t["x"], G, t.get("weight"), t.get("bias"), *args),
            lambda t: group_norm_ref(t["x"], G, weight(t), t.get("bias"), *args), leaves, peer=peer,
            build=lambda **t: (t,), constant=constant, backward=case["backward"])


def _format(x) -> torch.memory_format:
    return suggest_memory_format(x) if x.dim() == 4 else torch.contiguous_format


class _InFormat(torch.autograd.Function):
    """x itself, its gradient in `_format(x)`."""

    @staticmethod
    def forward(ctx, x):
        ctx.format = _format(x)
        return x.clone()  # (its strides exactly: a view's size-1 dims may get others, which can change the format)

    @staticmethod
    def backward(ctx, dx):
        return dx.contiguous(memory_format=ctx.format)


@st.composite
def batch_norm_cases(draw):
    """input [N, C, *spatial] (2-D to 5-D); inference (running statistics needed: torch has none else) or
    training (more than one value a channel: torch refuses one), with or without running statistics (contiguous:
    dropin updates them in place), float32 or input's dtype; weight and bias each given or not."""
    training = draw(st.booleans())
    shape = (draw(sizes(1, 4)), draw(sizes(1, 6)), *draw(shapes(0, 3, hi=6)))
    if training and torch.Size(shape[:1] + shape[2:]).numel() == 1:
        shape = (2, *shape[1:])
    layout = draw(layouts(len(shape), channels_last=True))
    assume(not (training and equal_within_sets(layout, {d: n for d, n in enumerate(shape) if d != 1})))
    return dict(shape=shape, training=training, stats=not training or draw(st.booleans()),
                params_fp32=draw(st.booleans()), weight=draw(st.booleans()), bias=draw(st.booleans()),
                momentum=draw(st.sampled_from((0.1, 0.5, 1.0))), eps=draw(EPS), layout=layout,
                backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=batch_norm_cases(), seed=SEEDS)
def test_batch_norm(dtype, case, seed):
    start("batch_norm", seed)
    C, params = case["shape"][1], torch.float32 if case["params_fp32"] else dtype
    leaves = {"x": case["layout"].tensor(case["shape"], dtype, scale=2.0, offset=0.5)}
    for name in ("weight", "bias"):
        if case[name]:
            leaves[name] = CONTIGUOUS.tensor((C,), params)
    stats = (torch.randn(C, device=DEVICE).to(params), torch.rand(C, device=DEVICE).add(0.5).to(params)) \
        if case["stats"] else None
    training, momentum, eps = case["training"], case["momentum"], case["eps"]

    def bind(fn, weight=None):  # fresh copies of the running statistics in each call (float64 for the reference)
        def call(t):
            x = t["x"]
            rm, rv = (None, None) if stats is None else (
                s.to(x.device, torch.float64 if x.dtype == torch.float64 else s.dtype, copy=True) for s in stats)
            return fn(x, rm, rv, t.get("weight", weight), t.get("bias"), training, momentum, eps)
        return call
    # training on two values a channel: x's gradient is eps-sized, a cancellation fp32 cannot resolve (torch's own
    # error ~1e-2)
    values = torch.Size(case["shape"][:1] + case["shape"][2:]).numel()
    constant = ("x",) if training and values == 2 else ()
    # inference: torch's CUDA backward gives an NCHW gradient for a channels_last input, dropin the input's layout
    # torch's peer: a weight of ones where there is none (it rounds nothing; torch's CUDA backward returns an empty
    # gradient for a bias without a weight)
    peer = bind(F.batch_norm, torch.ones(C, device=DEVICE, dtype=params))
    compare(bind(dropin.ops.batch_norm), bind(F.batch_norm), leaves, peer=peer, build=lambda **t: (t,),
            constant=constant, grad_layout="format" if training else None, backward=case["backward"])


@st.composite
def softmax_cases(draw):
    shape = draw(shapes(0, 4, hi=12))
    return dict(op=draw(st.sampled_from(("softmax", "log_softmax"))), shape=shape,
                dim=draw(st.integers(-max(1, len(shape)), max(1, len(shape)) - 1)),
                layout=draw(layouts(len(shape))), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=softmax_cases(), seed=SEEDS)
def test_softmax(dtype, case, seed):
    op, dim = case["op"], case["dim"]
    start(op, seed)
    # a dim of one element: the gradient is 0 exactly, so it must be rounding-small
    compare(lambda x: getattr(dropin.ops, op)(x, dim), lambda x: getattr(torch, op)(x, dim),
            {"x": case["layout"].tensor(case["shape"], dtype, scale=3.0)}, zero_grad_degree=0,
            backward=case["backward"])


ACTIVATION_CALLS = {  # (dropin's call, torch's) by the function called
    "relu": (dropin.ops.relu, F.relu),
    "gelu": (dropin.ops.gelu, F.gelu),
    "gelu_tanh": (lambda x: dropin.ops.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "silu": (dropin.ops.silu, F.silu),
    **{f"activation:{a}": (lambda x, a=a: dropin.ops.activation(x, a), lambda x, a=a: activation_ref(x, a))
       for a in ACTIVATIONS},
}


@st.composite
def activation_cases(draw):
    shape = draw(shapes(0, 4, hi=12))
    return dict(call=draw(st.sampled_from(sorted(ACTIVATION_CALLS))), shape=shape,
                layout=draw(layouts(len(shape), channels_last=True)), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=activation_cases(), seed=SEEDS)
def test_activations(dtype, case, seed):
    start(case["call"], seed)
    compare(*ACTIVATION_CALLS[case["call"]], {"x": case["layout"].tensor(case["shape"], dtype, scale=3.0)},
            backward=case["backward"])


@st.composite
def rope_cases(draw):
    """q [B, H, S, D] and k [B, HK, S, D], D even (rotate_half's halves); cos / sin [S, D], [1 or B, S, D], or a
    [P, D] table with position_ids [1 or B, S] or [S]; in place or not (in place on copies: autograd allows it on
    non-leaves only; a written tensor is not expanded)."""
    B, H, HK, S, D = (draw(sizes(1, 3)), draw(sizes(1, 4)), draw(sizes(1, 4)), draw(sizes(1, 12)),
                      2 * draw(sizes(1, 20)))
    table = draw(st.sampled_from(("2d", "3d", "ids")))
    cos = (S, D) if table == "2d" else (draw(st.sampled_from((1, B))), S, D) if table == "3d" else \
        (draw(sizes(1, 16)), D)
    ids = None if table != "ids" else draw(st.sampled_from(((S,), (1, S), (B, S))))
    inplace = draw(st.booleans())
    return dict(q=(B, H, S, D), k=(B, HK, S, D), cos=cos, ids=ids, inplace=inplace,
                q_layout=draw(layouts(4, expanded=not inplace)), k_layout=draw(layouts(4, expanded=not inplace)),
                cos_layout=draw(layouts(len(cos))), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=rope_cases(), seed=SEEDS)
def test_rope(dtype, case, seed):
    start("rope", seed)
    leaves = {"q": case["q_layout"].tensor(case["q"], dtype), "k": case["k_layout"].tensor(case["k"], dtype),
              **{name: case["cos_layout"].tensor(case["cos"], dtype) for name in ("cos", "sin")}}
    if case["ids"] is not None:
        leaves["position_ids"] = torch.randint(0, case["cos"][0], case["ids"], device=DEVICE)
    inplace = case["inplace"]

    def ours(q, k, cos, sin, position_ids=None):
        if inplace:
            q, k = q * 1, k * 1
        return dropin.ops.rope(q, k, cos, sin, position_ids, inplace=inplace)
    # gradients unchecked for layout: torch's is autograd's order of accumulating q's three uses (contiguous for a
    # channels_last-stored q), dropin's the upstream gradient's
    compare(ours, rope_ref, leaves, constant=("cos", "sin"), grad_layout=None, backward=case["backward"])
