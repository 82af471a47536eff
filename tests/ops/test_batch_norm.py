"""dropin.ops.batch_norm against F.batch_norm, inference and training: forward, the gradients of input, weight
and bias vs float64 and the 2x rule (tests/_check.py), the in-place running-statistics update, 2-D / 3-D /
4-D / 5-D inputs, NCHW / channels_last / strided views, repeat calls through the eager shortcut, every error
path."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import _check
import dropin.ops as ops
from dropin import _runtime
from _check import check
from _tol import DEVICE, assert_close, gpu

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


def _x(shape, dtype=torch.float32, layout="nchw", mean=0.5, std=2.0):
    if layout == "strided":
        n, c, h, w = shape
        x = torch.randn(n, c, h, 2 * w, device=DEVICE)[..., ::2].flip(1)
    else:
        x = torch.randn(shape, device=DEVICE)
        if layout == "channels_last":
            x = x.to(memory_format=torch.channels_last)
    return (x * std + mean).to(dtype)


def _params(C, dtype=torch.float32):
    return {"w": torch.randn(C, device=DEVICE, dtype=dtype), "b": torch.randn(C, device=DEVICE, dtype=dtype)}


def _stats(C, dtype=torch.float32):
    return torch.randn(C, device=DEVICE).to(dtype), torch.rand(C, device=DEVICE).add(0.5).to(dtype)


def _bn(fn, stats, training, momentum=0.1, eps=1e-5, log=None):
    """fn with fresh copies of the running statistics (in the caller's dtype or float64, like x) per call;
    the updated copies are appended to log."""
    def f(x, w=None, b=None):
        rm, rv = (None, None) if stats is None else (s.to(x.device, torch.float64 if x.dtype == torch.float64
                                                          else s.dtype, copy=True) for s in stats)
        y = fn(x, rm, rv, w, b, training, momentum, eps)
        if log is not None:
            log.append((rm, rv))
        return y
    return f


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "strided"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_4d(training, dtype, layout):
    C = 7
    log = []
    stats = _stats(C)
    inputs = {"x": _x((3, C, 5, 9), dtype, layout), **_params(C)}
    # (inference: torch's CUDA backward returns an NCHW gradient for channels_last input; dropin keeps the
    # input's layout)
    check(_bn(ops.batch_norm, stats, training, log=log), _bn(F.batch_norm, stats, training, log=log), inputs,
          grad_layout="format" if training else None)
    if training:  # dropin's updated statistics vs float64 torch's (the third call), and torch's own (the second)
        for (got, want_t, want) in zip(log[0], log[1], log[2]):
            assert_close(got, want.to(got.device), torch.float32, "fwd", torch_out=want_t, what="running statistics")
    else:
        assert all(torch.equal(a, b) for a, b in zip(log[0], stats)), "inference changed the running statistics"


@pytest.mark.parametrize("shape", [(5, 3), (4, 6, 33), (2, 3, 4, 5, 6), (33, 1)], ids=["2d", "3d", "5d", "C1"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_other_ranks(shape, training):
    stats = _stats(shape[1])
    check(_bn(ops.batch_norm, stats, training), _bn(F.batch_norm, stats, training),
          {"x": _x(shape), **_params(shape[1])})


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_views_whose_spatial_dims_merge_otherwise(training):
    """Crops: a 4-D one, whose spatial dims stay two while the output's and the upstream gradient's merge into
    one, read through the spatial dims merged alike in every tensor; a 5-D one, whose three do not merge, read
    from a contiguous copy; a dense 5-D one with its last two dims transposed, whose output takes its strides
    (torch's empty_like), written through a copy in memory order."""
    for x in (_x((2, 3, 7, 8))[..., 1:-1, 1:-1], _x((2, 3, 4, 5, 6))[..., 1:-1, 1:-1, 1:-1],
              _x((2, 3, 4, 6, 5)).transpose(3, 4)):
        stats = _stats(3)
        check(_bn(ops.batch_norm, stats, training), _bn(F.batch_norm, stats, training), {"x": x, **_params(3)})


@pytest.mark.parametrize("affine", ["none", "weight", "bias"])
def test_training_without_running_stats_and_affine(affine):
    inputs = {"x": _x((4, 5, 3, 3))}
    if affine != "none":
        inputs[affine[0]] = torch.randn(5, device=DEVICE)
    op = (lambda x, p=None: ops.batch_norm(x, None, None, p if affine == "weight" else None,
                                           p if affine == "bias" else None, True))
    # (torch's CUDA backward fails for a bias without a weight: its peer gets a weight of ones there)
    ref = (lambda x, p=None: F.batch_norm(x, None, None, p if affine == "weight" else
                                          torch.ones_like(p) if affine == "bias" else None,
                                          p if affine == "bias" else None, True))
    check(op, ref, inputs)


def test_large_mean_and_many_splits():
    """mean 1000, std 1: the one-pass statistics must not cancel; 4 x 64 x 37 pixels split over programs."""
    log = []
    stats = _stats(3)
    inputs = {"x": _x((64, 3, 37, 4), mean=1000.0, std=1.0), **_params(3)}
    check(_bn(ops.batch_norm, stats, True, momentum=0.3, log=log), _bn(F.batch_norm, stats, True, momentum=0.3,
                                                                       log=log), inputs)
    for (got, want_t, want) in zip(log[0], log[1], log[2]):
        assert_close(got, want.to(got.device), torch.float32, "fwd", torch_out=want_t, what="running statistics")


def test_finalize_merges_many_splits_in_steps(monkeypatch):
    """More splits than the finalize step reads at once (BLOCK_S), the last step ragged: 300 channels_last
    channels (ten finalize programs of 32, the last ragged too), the device's SM count raised so that the
    reduction splits 144 ways; forward and backward."""
    module = importlib.import_module("dropin.ops.batch_norm")  # (the package's name is the public function)
    monkeypatch.setattr(_runtime, "num_sms", lambda index=0: 128)
    made = []
    real = module.Launch

    def spy(kernel, grid, constexprs, **kwargs):
        made.append((kernel, grid, constexprs))
        return real(kernel, grid, constexprs, **kwargs)
    monkeypatch.setattr(module, "Launch", spy)
    log = []
    stats = _stats(300)
    inputs = {"x": _x((4, 300, 24, 24), layout="channels_last"), **_params(300)}
    check(_bn(ops.batch_norm, stats, True, log=log), _bn(F.batch_norm, stats, True, log=log), inputs,
          grad_layout="format")
    splits = {grid[1] for kernel, grid, _ in made if kernel is module._bn_reduce_kernel}
    finalize = {(grid, c["BLOCK_S"], c["BLOCK_C"]) for kernel, grid, c in made if kernel is module._bn_finalize_kernel}
    assert splits == {144} and finalize == {((10,), 128, 32)}, (splits, finalize)


def test_half_running_stats_and_mixed_params():
    """fp16 input with fp32 weight / bias / running statistics (as torch allows)."""
    stats = _stats(6)
    check(_bn(ops.batch_norm, stats, True), _bn(F.batch_norm, stats, True),
          {"x": _x((4, 6, 5, 5), torch.float16, "channels_last"), **_params(6)})


def test_partial_gradients_and_no_grad():
    stats = _stats(4)
    inputs = {"x": _x((3, 4, 5, 5)), **_params(4)}
    for training in (False, True):  # the gradient of w alone, then of x alone
        check(_bn(ops.batch_norm, stats, training), _bn(F.batch_norm, stats, training), inputs, constant=("x", "b"))
        check(_bn(ops.batch_norm, stats, training), _bn(F.batch_norm, stats, training), inputs, constant=("w", "b"))
    with torch.no_grad():
        y = ops.batch_norm(inputs["x"].requires_grad_(), *stats, inputs["w"], inputs["b"])
    assert not y.requires_grad


def test_empty_batch():
    y = ops.batch_norm(torch.randn(0, 3, 4, 4, device=DEVICE), *_stats(3))
    assert y.shape == (0, 3, 4, 4)


def test_torch_compile_fullgraph():
    """Training then inference under torch.compile(fullgraph=True): forward, gradients, and the running
    statistics updated in place by the compiled graph, against float64 torch."""
    torch._dynamo.reset()
    stats = _stats(5)
    stats_64 = tuple(s.double() for s in stats)

    def chain(bn, rm, rv):
        return lambda x, w, b: bn(bn(x, rm, rv, w, b, True).relu(), rm, rv, w, b, False)

    leaves = {"x": _x((3, 5, 4, 6)), **_params(5)}
    ins = [t.clone().requires_grad_() for t in leaves.values()]
    ins_64 = [t.double().requires_grad_() for t in leaves.values()]
    out = torch.compile(chain(ops.batch_norm, *stats), fullgraph=True)(*ins)
    ref = chain(F.batch_norm, *stats_64)(*ins_64)
    assert_close(out, ref, torch.float32, "fwd", what="compiled forward")
    grad = torch.randn_like(ref)
    for g, g_64 in zip(torch.autograd.grad(out, ins, grad.float()), torch.autograd.grad(ref, ins_64, grad)):
        assert_close(g, g_64, torch.float32, "bwd", what="compiled gradient")
    for got, want in zip(stats, stats_64):
        assert_close(got, want, torch.float32, "fwd", what="running statistics after compile")


def test_running_statistics_updated_once_per_call():
    """Each call updates the running statistics once, eager and compiled, with and without autograd: three
    training calls match torch's three updates (a call replayed or split into two updates would not)."""
    torch._dynamo.reset()
    x, (w, b) = _x((4, 5, 3, 3)), _params(5).values()
    w.requires_grad_()  # the autograd Function's forward (b alone: the op without it)
    for fn in (ops.batch_norm, torch.compile(ops.batch_norm, fullgraph=True)):
        stats = _stats(5)
        stats_t = tuple(s.clone() for s in stats)
        for weight in (w, None, w):
            fn(x, *stats, weight, b, True, 0.3)
            F.batch_norm(x, *stats_t, weight, b, True, 0.3)
        for got, want in zip(stats, stats_t):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_repeat_calls_through_the_shortcut(training, monkeypatch):
    """Repeat calls without autograd (NCHW, channels_last, a strided fp16 view) take the shortcut that the first
    call of their signature kept, and give what it gave, in its layout (the repeats' new allocations NaN-filled:
    an element left unwritten shows); in training each call updates the running statistics once, as torch's
    three calls do."""
    cases = [_x((3, 5, 4, 6)), _x((3, 5, 4, 6), layout="channels_last"), _x((3, 5, 4, 6), torch.float16, "strided")]
    stats = [_stats(5) for _ in cases]
    stats_t = [tuple(s.clone() for s in pair) for pair in stats]
    params = _params(5).values()
    with torch.no_grad():
        firsts = [ops.batch_norm(x, *pair, *params, training, 0.3) for x, pair in zip(cases, stats)]
        found = _check.found_shortcuts(monkeypatch)
        _check.poison_allocations(monkeypatch)
        agains = [ops.batch_norm(x, *pair, *params, training, 0.3) for x, pair in zip(cases, stats)]
        thirds = [ops.batch_norm(x, *pair, *params, training, 0.3) for x, pair in zip(cases, stats)]
        for x, pair in zip(cases, stats_t):
            for _ in range(3):
                F.batch_norm(x, *pair, *params, training, 0.3)
    assert found == [True] * 2 * len(cases)
    _check.assert_repeats(firsts, agains)
    _check.assert_repeats(firsts, thirds)
    for pair, pair_t in zip(stats, stats_t):
        for got, want in zip(pair, pair_t):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_repeat_calls_with_autograd_through_the_shortcut(training, monkeypatch):
    """Repeat calls where autograd records them (NCHW, channels_last, a strided fp16 view; weight and bias, bias
    alone, neither) take their signature's shortcut, forward and backward, and give what the op's own path gives,
    bit for bit (`_check.assert_grad_calls_repeat_through_shortcuts`)."""
    stats = _stats(5)
    w, b = _params(5).values()
    calls = [(lambda x, w, b: ops.batch_norm(x, *stats, w, b, training, 0.3), (_x((3, 5, 4, 6)), w, b)),
             (lambda x, b: ops.batch_norm(x, *stats, None, b, training), (_x((3, 5, 4, 6), layout="channels_last"), b)),
             (lambda x: ops.batch_norm(x, *stats, training=training), (_x((3, 5, 4, 6), torch.float16, "strided"),))]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


@pytest.mark.parametrize("layout", ["nchw", "channels_last", "strided"])
def test_inference_in_one_launch(layout, monkeypatch):
    """Inference without autograd is one launch (`_bn_eval_kernel`), with the numbers of the path that saves the
    statistics (finalize + apply, bit for bit), affine or not."""
    from dropin.ops import _dispatch
    x, stats = _x((3, 5, 4, 6), torch.float16, layout), _stats(5)
    for params in (_params(5).values(), (None, None)):
        y_saved = ops.batch_norm(x.detach().requires_grad_(), *stats, *params, False).detach()
        launched = []
        call = _dispatch.Launch.__call__
        monkeypatch.setattr(_dispatch.Launch, "__call__",
                            lambda self, *a: launched.append(self.kernel) or call(self, *a))
        with torch.no_grad():
            y = ops.batch_norm(x, *stats, *params, False)
        monkeypatch.undo()
        assert [k.fn.__name__ for k in launched] == ["_bn_eval_kernel"]
        torch.testing.assert_close(y, y_saved, rtol=0, atol=0)
        assert y.stride() == y_saved.stride()


REGISTERED = {  # id -> (x, running statistics, affine, training, dtype of the weight / bias gradients)
    "train-nchw": (lambda: _x((3, 7, 5, 9)), True, True, True, torch.float32),
    "train-channels_last-fp16": (lambda: _x((3, 7, 5, 9), torch.float16, "channels_last"), True, True, True,
                                 torch.float32),
    "train-no-stats-no-affine-strided": (lambda: _x((3, 7, 5, 9), layout="strided"), False, False, True, None),
    "eval-bf16": (lambda: _x((3, 7, 5, 9), torch.bfloat16), True, True, False, None),
    "eval-5d-weight-grads": (lambda: _x((2, 3, 4, 5, 6)), True, True, False, torch.float32),
    "train-2d-no-affine": (lambda: _x((5, 3)), True, False, True, None),
}


@pytest.mark.parametrize("case", REGISTERED)
def test_registered_ops(case):
    """Schema (running_mean / running_var mutated in training, nothing else), fake and dynamic-shape tracing of
    dropin::batch_norm and dropin::batch_norm_backward (what torch.compile sees)."""
    make, has_stats, affine, training, wb_dtype = REGISTERED[case]
    x = make()
    C = x.shape[1]
    stats = _stats(C) if has_stats else (None, None)
    w, b = _params(C).values() if affine else (None, None)
    _check.opcheck(torch.ops.dropin.batch_norm.default, x, w, b, *stats, training, 0.1, 1e-5, True)
    if not training:
        _check.opcheck(torch.ops.dropin.batch_norm.default, x, w, b, *stats, training, 0.1, 1e-5, False)
    _, center, invstd = torch.ops.dropin.batch_norm(x, w, b, *stats, training, 0.1, 1e-5, True)
    _check.opcheck(torch.ops.dropin.batch_norm_backward.default, torch.randn_like(x), x, w, center, invstd,
                   training, wb_dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_resnet_shapes_gpu(training, layout, dtype):
    for shape in [(64, 64, 112, 112), (64, 2048, 7, 7), (8, 256, 56, 56)]:
        stats = _stats(shape[1])
        check(_bn(ops.batch_norm, stats, training), _bn(F.batch_norm, stats, training),  # (layouts as test_4d)
              {"x": _x(shape, dtype, layout), **_params(shape[1])}, grad_layout="format" if training else None)


# ----------------------------------------------------------------------------------------- errors
def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


ERRORS = [  # (id, args, kwargs, error, name in the message, torch also raises)
    ("input-1d", (_t(3), _t(3), _t(3)), {}, RuntimeError, "input", True),
    ("running-mean-size", (_t(2, 3, 4), _t(4), _t(3)), {}, RuntimeError, "running_mean", True),
    ("running-var-size", (_t(2, 3, 4), _t(3), _t(2)), {}, RuntimeError, "running_var", True),
    ("weight-size", (_t(2, 3, 4), _t(3), _t(3), _t(2)), {}, RuntimeError, "weight", True),
    ("bias-size", (_t(2, 3, 4), _t(3), _t(3), None, _t(5)), {}, RuntimeError, "bias", True),
    ("eval-without-stats", (_t(2, 3, 4), None, None), {}, RuntimeError, "running_mean", True),
    ("one-value-per-channel", (_t(1, 3), _t(3), _t(3)), dict(training=True), ValueError, "input", True),
    ("momentum-none", (_t(2, 3, 4), _t(3), _t(3)), dict(training=True, momentum=None), TypeError, "momentum", True),
    ("int-input", (torch.ones(2, 3, 4, dtype=torch.int64), _t(3), _t(3)), {}, RuntimeError, "input", True),
    ("float64", (_t(2, 3, 4, dtype=torch.float64), _t(3), _t(3)), {}, RuntimeError, "input", False),
    ("one-stat-missing", (_t(2, 3, 4), _t(3), None), dict(training=True), RuntimeError, "running_var", False),
    ("strided-stats", (_t(2, 3, 4), _t(6)[::2], _t(3)), {}, RuntimeError, "running_mean", False),
    ("not-a-tensor", (_t(2, 3, 4), [0.0] * 3, _t(3)), {}, TypeError, "running_mean", True),
]


@pytest.mark.parametrize("args,kwargs,error,name,torch_raises", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_errors(args, kwargs, error, name, torch_raises):
    with pytest.raises(error, match=f"'{name}'"):
        ops.batch_norm(*args, **kwargs)
    if torch_raises:
        with pytest.raises(error):
            F.batch_norm(*args, **kwargs)
