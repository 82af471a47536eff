"""dropin.ops.sparse_conv2d against F.conv2d on the dense weight: forward and the gradients of input and bias
in float64 (DESIGN.md's tolerances and the 2x-torch rule) over strides, paddings ('same' with even kernels
too), dilations, groups (depthwise included), odd sizes, 0-100% sparsity, unbatched, channels_last and strided
inputs, K split over programs, every config; the error paths. No tl.dot: bfloat16 runs under the interpreter."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import _check
from _check import check, poison_allocations
from _tol import DEVICE, gpu
from dropin.ops import sparse_conv2d, sparse_linear, sparsify

conv_module = importlib.import_module("dropin.ops.sparse_conv2d")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


def pruned(shape, sparsity, dtype):
    fan_in = shape[1] * shape[2] * shape[3]
    w = torch.randn(*shape, device=DEVICE) * fan_in**-0.5
    return (w * (torch.rand(*shape, device=DEVICE) >= sparsity)).to(dtype)


def leaves(x_shape, w_shape, sparsity=0.7, dtype=torch.float32, bias=True):
    t = {"input": torch.randn(*x_shape, device=DEVICE, dtype=dtype), "weight": pruned(w_shape, sparsity, dtype)}
    if bias:
        t["bias"] = torch.randn(w_shape[0], device=DEVICE, dtype=dtype)
    return t


def run(block_k=256, **geometry):
    """(ours, torch's) for these conv arguments; the weight is sparsified inside ours (a constant leaf)."""
    groups = geometry.get("groups", 1)

    def ours(input, weight, bias=None):
        return sparse_conv2d(input, sparsify(weight, block_k=block_k, groups=groups), bias, **geometry)
    return ours, lambda input, weight, bias=None: F.conv2d(input, weight, bias, **geometry)


CASES = [  # (input shape, weight shape, conv arguments)
    pytest.param((2, 16, 20, 12), (32, 16, 6, 6), dict(stride=2, padding=3), id="seed000-6x6-s2-p3"),
    pytest.param((2, 8, 9, 11), (12, 8, 3, 3), dict(padding=1), id="3x3-p1"),
    pytest.param((1, 8, 15, 13), (8, 8, 3, 3), dict(stride=2, padding=1), id="3x3-s2"),
    pytest.param((2, 6, 12, 12), (4, 6, 3, 3), dict(dilation=2, padding=2), id="3x3-d2"),
    pytest.param((1, 6, 10, 9), (6, 3, 3, 3), dict(groups=2, padding=1), id="groups2"),
    pytest.param((2, 8, 7, 7), (8, 1, 3, 3), dict(groups=8, padding=1), id="depthwise"),
    pytest.param((2, 7, 5, 6), (9, 7, 1, 1), {}, id="1x1"),
    pytest.param((1, 5, 9, 8), (7, 5, 4, 2), dict(padding="same"), id="same-even-kernel"),
    pytest.param((1, 3, 11, 10), (4, 3, 5, 5), dict(stride=(3, 2), padding=(2, 0), dilation=(1, 2)), id="asym"),
    pytest.param((1, 4, 3, 3), (5, 4, 3, 3), dict(padding="valid"), id="1-pixel"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape,w_shape,geometry", CASES)
def test_sparse_conv2d(x_shape, w_shape, geometry, dtype):
    ours, theirs = run(**geometry)
    check(ours, theirs, leaves(x_shape, w_shape, dtype=dtype), constant=("weight",), grad_layout="format")


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9, 1.0])
def test_sparsities(sparsity):
    ours, theirs = run(padding=1)
    check(ours, theirs, leaves((2, 9, 8, 7), (10, 9, 3, 3), sparsity), constant=("weight",))


def test_k_split_over_programs(monkeypatch):
    """block_k 1: 72 chunks, more than a program's 64 slots: fp32 partials summed (with the bias)."""
    poison_allocations(monkeypatch)
    ours, theirs = run(block_k=1, padding=1)
    check(ours, theirs, leaves((1, 8, 6, 7), (5, 8, 3, 3), 0.5), constant=("weight",))


@pytest.mark.parametrize("index", range(len(conv_module._CONFIGS)))
def test_every_config(index, monkeypatch):
    """Each candidate config (tuning may pick any); outputs allocated NaN-filled."""
    poison_allocations(monkeypatch)
    monkeypatch.setattr(conv_module, "_plans", {})
    monkeypatch.setattr(conv_module, "_CONFIGS", [conv_module._CONFIGS[index]])
    ours, theirs = run(block_k=16, stride=2, padding=1)
    check(ours, theirs, leaves((2, 6, 13, 11), (7, 6, 3, 3), 0.6), constant=("weight",))


def test_layouts_unbatched_and_no_bias():
    ours, theirs = run(padding=1)
    t = leaves((2, 6, 9, 9), (5, 6, 3, 3), bias=False)
    check(ours, theirs, dict(t, input=t["input"].contiguous(memory_format=torch.channels_last)),
          constant=("weight",))
    check(ours, theirs, dict(t, input=torch.randn(2, 6, 9, 18, device=DEVICE)[..., ::2]), constant=("weight",))
    check(ours, theirs, dict(t, input=torch.randn(6, 9, 9, device=DEVICE)), constant=("weight",))
    check(ours, theirs, dict(t, bias=torch.randn(10, device=DEVICE)[::2]), constant=("weight",))  # strided bias


def test_weight_round_trip_and_bytes():
    w = pruned((64, 32, 3, 3), 0.9, torch.float16)
    sw = sparsify(w)
    assert torch.equal(sw.to_dense(), w) and sw.conv_shape == (64, 32, 3, 3) and sw.kernel == (3, 3, 1)
    assert sw.nbytes <= 0.2 * w.numel() * 2
    wg = pruned((8, 2, 3, 3), 0.5, torch.float32)
    assert torch.equal(sparsify(wg, groups=4).to_dense(), wg)


REGISTERED = {  # id: (x shape, w shape, block_k, groups, stride, padding (top, bottom, left, right), dilation, bias,
    #                  transposed, dtype)
    "bias-fp32": ((2, 4, 7, 6), (6, 4, 3, 3), 256, 1, (1, 1), (1, 1, 1, 1), (1, 1), True, False, torch.float32),
    "k-split-fp16": ((1, 8, 5, 6), (5, 8, 3, 3), 1, 1, (2, 1), (1, 1, 2, 2), (1, 1), True, False, torch.float16),
    "transposed-groups-bf16": ((1, 4, 6, 7), (6, 2, 3, 3), 16, 2, (1, 2), (2, 2, 1, 1), (2, 1), False, True,
                               torch.bfloat16),
}


@pytest.mark.parametrize("case", list(REGISTERED))
def test_registered_op(case):
    """Schema, fake and dynamic-shape tracing of dropin::sparse_conv2d (what torch.compile sees): one pass and K
    split over programs (block_k 1: 72 chunks, fp32 partials), with and without bias, the transposed weight (the
    input gradient: x is the output gradient), each dtype."""
    x_shape, w_shape, block_k, groups, stride, pads, dilation, bias, transposed, dtype = REGISTERED[case]
    weight = sparsify(pruned(w_shape, 0.5, dtype), block_k=block_k, groups=groups)
    geometry = (list(weight.kernel), list(stride), list(pads), list(dilation))
    out_hw = F.conv2d(torch.empty(x_shape, device="meta"), torch.empty(w_shape, device="meta"), None, stride,
                      (pads[0], pads[2]), dilation, groups).shape[2:]
    x, rows, hw, w = torch.randn(x_shape, device=DEVICE, dtype=dtype), w_shape[0], list(out_hw), weight
    if transposed:
        x, rows, hw, w = torch.randn(x_shape[0], w_shape[0], *out_hw, device=DEVICE, dtype=dtype), x_shape[1], \
            list(x_shape[2:]), weight.transposed
    b = torch.randn(rows, device=DEVICE, dtype=dtype) if bias else None
    _check.opcheck(torch.ops.dropin.sparse_conv2d.default, x, w.values, w.offsets, w.chunk_ptr, b, rows, block_k,
                   *geometry, hw, transposed)


def test_shortcuts_give_each_weight_its_own_conv():
    """Repeat eager calls without autograd take shortcuts (`Shortcuts`) keyed by the weight's tensors and format:
    two weights of one format (the same non-zeros, other values) called alternately each give their own conv."""
    w = pruned((6, 4, 3, 3), 0.5, torch.float32)
    dense = [w, -2 * w]
    weights = [sparsify(d) for d in dense]
    with torch.no_grad():
        for _ in range(2):
            for d, sw in zip(dense, weights):
                x, b = torch.randn(2, 4, 7, 5, device=DEVICE), torch.randn(6, device=DEVICE)
                torch.testing.assert_close(sparse_conv2d(x, sw, b, padding=1), F.conv2d(x, d, b, padding=1))


def test_repeat_calls_with_autograd_through_the_shortcut(monkeypatch):
    """Repeat calls where autograd records them (NCHW inputs, with and without bias, stride 2, the bias's gradient
    alone) take their signature's shortcut (`SparseShortcut`), forward and backward, and give what the op's own path
    gives, bit for bit (`_check.assert_grad_calls_repeat_through_shortcuts`)."""
    sw = sparsify(pruned((6, 4, 3, 3), 0.5, torch.float32))
    x, bias = torch.randn(2, 4, 7, 5, device=DEVICE), torch.randn(6, device=DEVICE)
    calls = [(lambda x, b: sparse_conv2d(x, sw, b, padding=1), (x, bias)),
             (lambda x: sparse_conv2d(x, sw, stride=2), (x,)),
             (lambda b: sparse_conv2d(x[:1], sw, b, padding=1), (bias,))]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


@gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_resnet_shapes_gpu(batch):
    ours, theirs = run(padding=1)
    check(ours, theirs, leaves((batch, 64, 56, 56), (64, 64, 3, 3), 0.9, torch.float16), constant=("weight",))


def _w(groups=1, transpose=True):
    return sparsify(pruned((4, 4 // groups, 3, 3), 0.5, torch.float32), groups=groups, transpose=transpose)


ERRORS = [  # (id, lambda -> call, exception, text the message must contain)
    ("groups-mismatch", lambda: sparse_conv2d(torch.randn(1, 4, 5, 5, device=DEVICE), _w(2), groups=1),
     ValueError, "'groups'"),
    ("linear-weight", lambda: sparse_conv2d(torch.randn(1, 4, 5, 5, device=DEVICE),
                                            sparsify(torch.randn(4, 36, device=DEVICE))), ValueError, "sparse_linear"),
    ("conv-weight-to-linear", lambda: sparse_linear(torch.randn(2, 36, device=DEVICE), _w()), ValueError,
     "sparse_conv2d"),
    ("channels", lambda: sparse_conv2d(torch.randn(1, 3, 5, 5, device=DEVICE), _w()), RuntimeError, "channels"),
    ("padding-string", lambda: sparse_conv2d(torch.randn(1, 4, 5, 5, device=DEVICE), _w(), padding="full"),
     RuntimeError, "'padding'"),
    ("too-small", lambda: sparse_conv2d(torch.randn(1, 4, 2, 2, device=DEVICE), _w()), RuntimeError, "smaller"),
    ("input-2d", lambda: sparse_conv2d(torch.randn(4, 5, device=DEVICE), _w()), RuntimeError, "'input'"),
    ("dtype", lambda: sparse_conv2d(torch.randn(1, 4, 5, 5, device=DEVICE, dtype=torch.float16), _w()),
     RuntimeError, "same dtype"),
    ("bias-shape", lambda: sparse_conv2d(torch.randn(1, 4, 5, 5, device=DEVICE), _w(), torch.randn(3, device=DEVICE)),
     RuntimeError, "'bias'"),
    ("grad-needs-transposed", lambda: sparse_conv2d(torch.randn(1, 4, 5, 5, device=DEVICE, requires_grad=True),
                                                    _w(transpose=False)), RuntimeError, "transpose=True"),
    ("sparsify-groups", lambda: sparsify(torch.randn(6, 2, 3, 3, device=DEVICE), groups=4), ValueError, "'groups'"),
]


@pytest.mark.parametrize("call,exc,text", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors(call, exc, text):
    with pytest.raises(exc, match=text):
        call()
