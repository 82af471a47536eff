"""dropin.ops max_pool2d / avg_pool2d / adaptive_avg_pool2d against torch.nn.functional: forward and backward
vs float64 and the 2x rule (tests/_check.py), NCHW / channels_last / strided views, odd sizes, every option,
ties, NaN and -inf for max pooling, every error path; larger shapes on the GPU."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _check
import dropin.ops as ops
from _check import check, found_shortcuts
from _tol import DEVICE, gpu


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
LAYOUTS = ["nchw", "channels_last", "strided"]


def _x(shape, dtype=torch.float32, layout="nchw"):
    if layout == "strided":  # a view: every other column of a wider tensor, and channels reversed
        n, c, h, w = shape
        return torch.randn(n, c, h, 2 * w, dtype=dtype, device=DEVICE)[..., ::2].flip(1)
    x = torch.randn(shape, dtype=dtype, device=DEVICE)
    return x.to(memory_format=torch.channels_last) if layout == "channels_last" else x


def _bind(fn, **kw):
    return lambda x: fn(x, **kw)


# ----------------------------------------------------------------------------------------- max_pool2d
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_resnet(dtype, layout):
    """ResNet's stem pool: 3x3, stride 2, padding 1."""
    kw = dict(kernel_size=3, stride=2, padding=1)
    check(_bind(ops.max_pool2d, **kw), _bind(F.max_pool2d, **kw), {"x": _x((2, 5, 13, 10), dtype, layout)})


MAX_CASES = [  # kernel, stride, padding, dilation, ceil_mode
    (2, None, 0, 1, False), ((3, 2), (2, 1), (1, 0), 1, False), (3, 2, 1, 1, True), (2, 3, 1, 1, True),
    (3, 1, 1, 2, False), ((2, 3), 2, 0, (2, 1), True), (1, 1, 0, 1, False), (7, 7, 3, 1, True),
]


@pytest.mark.parametrize("case", MAX_CASES, ids=[str(c) for c in MAX_CASES])
def test_max_pool_options(case):
    k, s, p, d, ceil_mode = case
    kw = dict(kernel_size=k, stride=s, padding=p, dilation=d, ceil_mode=ceil_mode)
    check(_bind(ops.max_pool2d, **kw), _bind(F.max_pool2d, **kw), {"x": _x((2, 3, 9, 7), layout="channels_last")})


def test_max_pool_ties_negative_nan_inf():
    """Ties (small integers) go to the first max, a fully negative or -inf window keeps its max, a NaN wins
    (the last NaN in window order gets the gradient): gradients land where torch's do."""
    x = torch.randint(-2, 1, (2, 3, 9, 8), device=DEVICE).float()
    x[0, 0] = -5.0 - torch.rand(9, 8)
    x[0, 1, :3, :3] = float("-inf")
    x[1, 0, 2, 2] = float("nan")
    x[1, 0, 3, 3] = float("nan")
    x[1, 2, 5, 4] = float("nan")
    kw = dict(kernel_size=3, stride=2, padding=1)
    check(_bind(ops.max_pool2d, **kw), _bind(F.max_pool2d, **kw), {"x": x})
    y = ops.max_pool2d(x, **kw)
    assert torch.isnan(y[1, 0, 1, 1]) and y[0, 1, 0, 0] == float("-inf")


# ----------------------------------------------------------------------------------------- avg_pool2d
AVG_CASES = [  # kernel, stride, padding, ceil_mode, count_include_pad, divisor_override
    (2, None, 0, False, True, None), (3, 2, 1, False, True, None), (3, 2, 1, False, False, None),
    (3, 2, 1, True, True, None), (3, 2, 1, True, False, None), ((2, 3), (1, 2), (1, 1), True, False, None),
    (3, 2, 1, False, True, 5), (7, 7, 0, False, True, None),
]


@pytest.mark.parametrize("case", AVG_CASES, ids=[str(c) for c in AVG_CASES])
def test_avg_pool_options(case):
    k, s, p, ceil_mode, count_pad, divisor = case
    kw = dict(kernel_size=k, stride=s, padding=p, ceil_mode=ceil_mode, count_include_pad=count_pad,
              divisor_override=divisor)
    check(_bind(ops.avg_pool2d, **kw), _bind(F.avg_pool2d, **kw), {"x": _x((2, 3, 9, 7))})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_pool_dtypes_layouts(dtype, layout):
    kw = dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
    check(_bind(ops.avg_pool2d, **kw), _bind(F.avg_pool2d, **kw), {"x": _x((2, 6, 11, 8), dtype, layout)})


@st.composite
def pool_configs(draw):
    """Random max / avg pooling configurations; dilation only where no window lies wholly in the padding
    (without ceil_mode, on inputs at least one dilated kernel wide: see max_pool2d's docstring)."""
    kind = draw(st.sampled_from(["max", "avg"]))
    k = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    ceil_mode = draw(st.booleans())
    d = (draw(st.integers(1, 3)), draw(st.integers(1, 3))) if kind == "max" and not ceil_mode else (1, 1)
    p = tuple(draw(st.integers(0, ki // 2)) for ki in k)
    size = tuple(draw(st.integers(max(1, di * (ki - 1) + 1 - (2 * pi if di == 1 else 0)), 12))
                 for ki, di, pi in zip(k, d, p))
    kw = dict(kernel_size=k, stride=(draw(st.integers(1, 4)), draw(st.integers(1, 4))), padding=p,
              ceil_mode=ceil_mode)
    if kind == "max":
        kw["dilation"] = d
    else:
        kw.update(count_include_pad=draw(st.booleans()), divisor_override=draw(st.sampled_from([None, 3])))
    return kind, size, kw, draw(st.sampled_from(["nchw", "channels_last", "strided"]))


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=pool_configs())
def test_random_configs(cfg):
    kind, size, kw, layout = cfg
    fn, ref = (ops.max_pool2d, F.max_pool2d) if kind == "max" else (ops.avg_pool2d, F.avg_pool2d)
    check(_bind(fn, **kw), _bind(ref, **kw), {"x": _x((2, 3, *size), layout=layout)})


# ----------------------------------------------------------------------------------------- adaptive_avg_pool2d
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_global_avg_pool(dtype, layout):
    """Output size 1: ResNet's / CvT's global pool, the reduction kernel. torch computes it as a mean, whose
    gradient is contiguous; dropin's keeps the input's layout (channels_last for a channels_last model)."""
    check(_bind(ops.adaptive_avg_pool2d, output_size=1), _bind(F.adaptive_avg_pool2d, output_size=1),
          {"x": _x((3, 7, 9, 5), dtype, layout)}, grad_layout=None)


@pytest.mark.parametrize("expanded, shape", [((0, 2), (2, 2, 2, 1)), ((2,), (2, 3, 4, 1)), ((2, 3), (2, 3, 4, 5)),
                                             ((0, 3), (2, 3, 4, 5))])
def test_global_avg_pool_of_an_expanded_input(expanded, shape):
    """Stride 0 along H (and others): an H that does not merge with W keeps its own axis (fuzz: an input of strides
    (0, 1, 0, 1) was read as one run of 2 along the channels)."""
    base = torch.randn(*(1 if d in expanded else s for d, s in enumerate(shape)), device=DEVICE)
    check(_bind(ops.adaptive_avg_pool2d, output_size=1), _bind(F.adaptive_avg_pool2d, output_size=1),
          {"x": base.expand(shape)}, grad_layout=None)


@pytest.mark.parametrize("output_size", [(3, 5), 2, (None, 4), (11, 9), (1, 3)])
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_adaptive_avg_pool_sizes(output_size, layout):
    """Overlapping windows (7 -> 3 / 5), exact splits, None, outputs larger than the input (7 -> 11)."""
    check(_bind(ops.adaptive_avg_pool2d, output_size=output_size),
          _bind(F.adaptive_avg_pool2d, output_size=output_size), {"x": _x((2, 3, 7, 6), layout=layout)})


def test_unbatched_and_empty():
    for fn, ref, kw in ((ops.max_pool2d, F.max_pool2d, dict(kernel_size=2)),
                        (ops.avg_pool2d, F.avg_pool2d, dict(kernel_size=3, padding=1)),
                        (ops.adaptive_avg_pool2d, F.adaptive_avg_pool2d, dict(output_size=1))):
        check(_bind(fn, **kw), _bind(ref, **kw), {"x": _x((1, 3, 7, 5))[0]})
        assert fn(torch.randn(0, 3, 6, 6, device=DEVICE), **kw).shape == ref(torch.randn(0, 3, 6, 6), **kw).shape
    assert ops.adaptive_avg_pool2d(_x((1, 2, 5, 5)), 0).shape == (1, 2, 0, 0)


def test_no_grad_path():
    x = _x((1, 2, 6, 6)).requires_grad_()
    with torch.no_grad():
        y = ops.max_pool2d(x, 2)
    assert not y.requires_grad
    torch.testing.assert_close(y, F.max_pool2d(x.detach(), 2), rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS + ["unbatched"])
def test_repeat_call_through_the_shortcut(layout, monkeypatch):
    """A repeat eager call without autograd takes its signature's shortcut (`Shortcuts`): on new inputs (every
    output element written) torch's values in the first call's layout, for each op and the global pool; channels_last,
    a strided view, an unbatched input (a misaligned view of a batch)."""
    calls = ((ops.max_pool2d, F.max_pool2d, dict(kernel_size=3, stride=2, padding=1)),
             (ops.avg_pool2d, F.avg_pool2d, dict(kernel_size=2, ceil_mode=True, count_include_pad=False)),
             (ops.adaptive_avg_pool2d, F.adaptive_avg_pool2d, dict(output_size=(3, 2))),
             (ops.adaptive_avg_pool2d, F.adaptive_avg_pool2d, dict(output_size=1)))

    def make():
        x = _x((2, 3, 7, 6), layout="nchw" if layout == "unbatched" else layout)
        return x[1] if layout == "unbatched" else x
    served = found_shortcuts(monkeypatch)
    _check.poison_allocations(monkeypatch)
    with torch.no_grad():
        for fn, ref, kw in calls:
            first = fn(make(), **kw)
            x = make()
            y = fn(x, **kw)
            torch.testing.assert_close(y, ref(x, **kw))
            assert y.stride() == first.stride(), f"{fn.__name__}: not the first call's layout"
    assert all(served[1::2]), "a repeat call took no shortcut"


@pytest.mark.parametrize("layout", LAYOUTS + ["unbatched"])
def test_repeat_calls_with_autograd_through_the_shortcut(layout, monkeypatch):
    """Repeat calls where autograd records them take their signature's shortcut, forward and backward, and give
    what the op's own path gives, bit for bit (`_check.assert_grad_calls_repeat_through_shortcuts`)."""
    x = _x((2, 3, 7, 6), layout="nchw" if layout == "unbatched" else layout)
    x = x[1] if layout == "unbatched" else x
    calls = [(_bind(ops.max_pool2d, kernel_size=3, stride=2, padding=1), (x,)),
             (_bind(ops.avg_pool2d, kernel_size=2, ceil_mode=True, count_include_pad=False), (x,)),
             (_bind(ops.adaptive_avg_pool2d, output_size=(3, 2)), (x,)),
             (_bind(ops.adaptive_avg_pool2d, output_size=1), (x,))]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_torch_compile_fullgraph():
    """max pool -> avg pool -> global pool compiled with fullgraph=True (registered ops, no graph break)."""
    torch._dynamo.reset()

    def chain(mp, ap, gp):
        return lambda x: gp(ap(mp(x, 3, 2, 1), 2, ceil_mode=True), 1)

    compiled = torch.compile(chain(ops.max_pool2d, ops.avg_pool2d, ops.adaptive_avg_pool2d), fullgraph=True)
    check(compiled, chain(F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d),
          {"x": _x((2, 4, 11, 9), layout="channels_last")})


REGISTERED = {  # id -> (mode, x shape, dtype, layout, kernel, stride, padding, dilation, out_hw, count_pad, divisor)
    "max-channels_last": ("max", (2, 3, 9, 7), torch.float32, "channels_last", [3, 3], [2, 2], [1, 1], [1, 1],
                          [5, 4], True, 0),
    "max-dilated-strided-fp16": ("max", (2, 3, 9, 7), torch.float16, "strided", [2, 3], [2, 1], [1, 1], [2, 1],
                                 [5, 7], True, 0),
    "avg-no-pad-count-bf16": ("avg", (2, 3, 9, 7), torch.bfloat16, "nchw", [3, 2], [2, 1], [1, 0], [1, 1],
                              [5, 6], False, 0),
    "avg-divisor": ("avg", (2, 3, 9, 7), torch.float32, "strided", [3, 3], [2, 2], [1, 1], [1, 1], [5, 4], True, 5),
    "adaptive": ("adaptive", (2, 3, 7, 6), torch.float32, "channels_last", [4, 3], [1, 1], [0, 0], [1, 1], [3, 4],
                 True, 0),
    "global-nchw": ("adaptive", (2, 3, 7, 6), torch.float32, "nchw", [7, 6], [1, 1], [0, 0], [1, 1], [1, 1],
                    True, 0),
    "global-channels_last-fp16": ("adaptive", (2, 5, 4, 3), torch.float16, "channels_last", [4, 3], [1, 1], [0, 0],
                                  [1, 1], [1, 1], True, 0),
}


@pytest.mark.parametrize("case", REGISTERED)
def test_registered_ops(case):
    """Schema, fake and dynamic-shape tracing of dropin::pool2d and dropin::pool2d_backward (what torch.compile
    sees): each mode, the global-pool kernel, layouts, dtypes, divisor options."""
    mode, shape, dtype, layout, *args = REGISTERED[case]
    x = _x(shape, dtype, layout)
    store_idx = mode == "max"
    _check.opcheck(torch.ops.dropin.pool2d.default, x, mode, *args, store_idx)
    y, idx = torch.ops.dropin.pool2d(x, mode, *args, store_idx)
    kernel, stride, padding, dilation, _, count_pad, divisor = args
    _check.opcheck(torch.ops.dropin.pool2d_backward.default, torch.randn_like(y), idx, list(shape),
                   layout == "channels_last", mode, kernel, stride, padding, dilation, count_pad, divisor)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
def test_resnet50_shapes_gpu(dtype, layout):
    check(_bind(ops.max_pool2d, kernel_size=3, stride=2, padding=1),
          _bind(F.max_pool2d, kernel_size=3, stride=2, padding=1), {"x": _x((32, 64, 112, 112), dtype, layout)})
    check(_bind(ops.adaptive_avg_pool2d, output_size=1), _bind(F.adaptive_avg_pool2d, output_size=1),
          {"x": _x((64, 2048, 7, 7), dtype, layout)}, grad_layout=None)
    check(_bind(ops.adaptive_avg_pool2d, output_size=(5, 3)), _bind(F.adaptive_avg_pool2d, output_size=(5, 3)),
          {"x": _x((8, 256, 31, 17), dtype, layout)})


# ----------------------------------------------------------------------------------------- errors
def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


ERRORS = [  # (id, op, args, kwargs, error, name in the message)
    ("max-kernel-zero", "max_pool2d", (_t(1, 2, 6, 6), 0), {}, RuntimeError, "kernel_size"),
    ("max-kernel-3-values", "max_pool2d", (_t(1, 2, 6, 6), (2, 2, 2)), {}, RuntimeError, "kernel_size"),
    ("max-stride-zero", "max_pool2d", (_t(1, 2, 6, 6), 2, 0), {}, RuntimeError, "stride"),
    ("max-dilation-zero", "max_pool2d", (_t(1, 2, 6, 6), 2), dict(dilation=0), RuntimeError, "dilation"),
    ("max-pad-too-big", "max_pool2d", (_t(1, 2, 6, 6), 3, 1, 2), {}, RuntimeError, "padding"),
    ("max-pad-negative", "max_pool2d", (_t(1, 2, 6, 6), 3, 1, -1), {}, RuntimeError, "padding"),
    ("max-output-too-small", "max_pool2d", (_t(1, 2, 2, 2), 3), {}, RuntimeError, "input"),
    ("max-input-2d", "max_pool2d", (_t(6, 6), 2), {}, RuntimeError, "input"),
    ("max-input-empty-plane", "max_pool2d", (_t(1, 2, 0, 6), 2), {}, RuntimeError, "input"),
    ("max-int-dtype", "max_pool2d", (torch.ones(1, 2, 6, 6, dtype=torch.int32), 2), {}, RuntimeError, "input"),
    ("max-float64", "max_pool2d", (_t(1, 2, 6, 6, dtype=torch.float64), 2), {}, RuntimeError, "input"),
    ("avg-pad-too-big", "avg_pool2d", (_t(1, 2, 6, 6), 2, 1, 2), {}, RuntimeError, "padding"),
    ("avg-divisor-zero", "avg_pool2d", (_t(1, 2, 6, 6), 2), dict(divisor_override=0), RuntimeError,
     "divisor_override"),
    ("adaptive-3-values", "adaptive_avg_pool2d", (_t(1, 2, 6, 6), (2, 2, 2)), {}, RuntimeError, "output_size"),
    ("adaptive-negative", "adaptive_avg_pool2d", (_t(1, 2, 6, 6), (-1, 2)), {}, RuntimeError, "output_size"),
    ("adaptive-input-5d", "adaptive_avg_pool2d", (_t(1, 1, 2, 6, 6), 1), {}, RuntimeError, "input"),
    ("not-a-tensor", "max_pool2d", ([[1.0]], 2), {}, TypeError, "input"),
]


@pytest.mark.parametrize("op,args,kwargs,error,name", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_errors(op, args, kwargs, error, name):
    with pytest.raises(error, match=f"'{name}'"):
        getattr(ops, op)(*args, **kwargs)
    if op == "max_pool2d" and isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.int32, torch.float64) \
            or op == "adaptive_avg_pool2d" and args[0].dim() == 5:
        return  # torch accepts these dtypes, and more batch dims for adaptive pooling
    with pytest.raises(error):  # torch rejects the same input with the same type
        getattr(F, op)(*args, **kwargs)


@pytest.mark.skipif(DEVICE != "cpu", reason="needs the interpreter (CPU tensors are the kernel device)")
def test_error_device_meta():
    with pytest.raises(RuntimeError, match="'input'"):
        ops.max_pool2d(torch.empty(1, 2, 6, 6, device="meta"), 2)
