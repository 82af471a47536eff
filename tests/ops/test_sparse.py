"""dropin.ops.sparse_linear / sparsify and dropin.nn.SparseLinear against F.linear on the dense weight.

Forward and the gradients of x and bias against float64 (DESIGN.md's tolerances and the 2x-torch rule), at
0 to 100% sparsity, odd sizes, leading batch dims, strided x, prune-masked weights; the format's round trip
and bytes; every error path. The sparse kernels have no tl.dot, so bfloat16 runs under the interpreter too;
the DENSE candidate for many tokens (dropin's linear, the GPU's default there) is checked in fp32 on the CPU.
"""
import importlib

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import _check
import dropin
from _check import check, poison_allocations
from _tol import DEVICE, ON_GPU, TOLERANCES, gpu, rel_err
from dropin.ops import SparseWeight, sparse_linear, sparsify
from dropin.ops.sparse import sparse_linear_ref

sparse_module = importlib.import_module("dropin.ops.sparse")

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
# The whole sweep in bfloat16 on the GPU only (the interpreter is slow); test_bfloat16 covers it on the CPU.
SWEEP_DTYPES = DTYPES[:2] + [pytest.param(torch.bfloat16, id="bf16", marks=gpu)]
SPARSITIES = [pytest.param(s, id=f"{round(100 * s)}%") for s in (0.0, 0.5, 0.9, 0.99, 1.0)]


def pruned(n, k, sparsity, dtype=torch.float32):
    """A weight [n, k] at nn.Linear's scale with a random `sparsity` fraction of exact zeros."""
    w = torch.randn(n, k, device=DEVICE) * max(k, 1)**-0.5
    return (w * (torch.rand(n, k, device=DEVICE) >= sparsity)).to(dtype)


def ours(x, weight, bias=None):
    return sparse_linear(x, sparsify(weight), bias)


def leaves(tokens, n, k, sparsity, dtype, bias=True):
    t = {"x": torch.randn(*tokens, k, device=DEVICE, dtype=dtype), "weight": pruned(n, k, sparsity, dtype)}
    if bias:
        t["bias"] = torch.randn(n, device=DEVICE, dtype=dtype)
    return t


SHAPES = [  # (leading dims of x, N = out_features, K = in_features)
    pytest.param(((1,), 7, 1000), id="1x1000->7"),
    pytest.param(((33,), 257, 7), id="33x7->257"),
    pytest.param(((2, 3), 33, 257), id="2x3x257->33"),
    pytest.param(((7,), 1000, 33), id="7x33->1000"),
    pytest.param(((257,), 1, 33), id="257x33->1"),
    pytest.param(((16,), 4096, 4096), id="16x4096->4096", marks=gpu),
    pytest.param(((3, 700), 1000, 4096), id="2100x4096->1000", marks=gpu),
]


@pytest.mark.parametrize("dtype", SWEEP_DTYPES)
@pytest.mark.parametrize("sparsity", SPARSITIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_linear(shape, sparsity, dtype):
    tokens, n, k = shape
    check(ours, F.linear, leaves(tokens, n, k, sparsity, dtype), constant=("weight",))


@pytest.mark.parametrize("shape", [((2, 3), 33, 257), ((20,), 7, 300)], ids=["2x3x257->33", "20x300->7"])
def test_bfloat16(shape):
    tokens, n, k = shape
    check(ours, F.linear, leaves(tokens, n, k, 0.9, torch.bfloat16), constant=("weight",))


@pytest.mark.parametrize("sparsity", [0.5, 1.0], ids=["50%", "100%"])
def test_no_bias(sparsity):
    check(ours, F.linear, leaves((5,), 40, 300, sparsity, torch.float16, bias=False), constant=("weight",))


def test_all_zero_weight_gives_the_bias():
    x, bias = torch.randn(4, 3, 50, device=DEVICE), torch.randn(9, device=DEVICE)
    sw = sparsify(torch.zeros(9, 50, device=DEVICE))
    assert sw.nnz == 0 and sw.density == 0.0
    assert torch.equal(sparse_linear(x, sw, bias), bias.expand(4, 3, 9))
    assert torch.equal(sparse_linear(x, sw), torch.zeros(4, 3, 9, device=DEVICE))


@settings(max_examples=25 if ON_GPU else 12, deadline=None,
          phases=list(Phase) if ON_GPU else [Phase.explicit, Phase.reuse, Phase.generate])  # CPU: no slow shrinking
@given(tokens=st.lists(st.integers(1, 20), min_size=1, max_size=2), n=st.integers(1, 70), k=st.integers(1, 600),
       sparsity=st.sampled_from([0.0, 0.5, 0.9, 0.97, 1.0]), block_k=st.sampled_from([13, 64, 256]),
       bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_random_configs(tokens, n, k, sparsity, block_k, bias, dtype):
    t = leaves(tokens, n, k, sparsity, dtype, bias)
    check(lambda x, weight, bias=None: sparse_linear(x, sparsify(weight, block_k=block_k), bias), F.linear, t,
          constant=("weight",))


@pytest.mark.parametrize("tokens", [1, 5])
def test_non_finite_x_meets_only_non_zeros(tokens):
    """The sparse kernels (up to 16 tokens: never the dense path) skip the zeros: inf in x reaches the outputs
    whose row has a non-zero in its column."""
    w = pruned(6, 40, 0.0)
    w[:3, 5] = 0  # rows 0-2 do not see column 5
    x = torch.randn(tokens, 40, device=DEVICE)
    x[:, 5] = float("inf")
    y = sparse_linear(x, sparsify(w))
    assert torch.isfinite(y[:, :3]).all() and not torch.isfinite(y[:, 3:]).any()
    torch.testing.assert_close(y[:, :3], F.linear(x[:, :5], w[:3, :5]) + F.linear(x[:, 6:], w[:3, 6:]))


@pytest.mark.parametrize("block_k", [1, 7, 64, 256])
def test_block_k(block_k):
    check(lambda x, weight, bias: sparse_linear(x, sparsify(weight, block_k=block_k), bias), F.linear,
          leaves((3,), 17, 70, 0.8, torch.float32), constant=("weight",))


VIEWS = {  # id -> (storage shape of x, view giving a logical (3, 4, 96))
    "transposed": ((4, 3, 96), lambda t: t.transpose(0, 1)),
    "column-slice": ((3, 4, 192), lambda t: t[..., ::2]),
    "k-major": ((96, 4, 3), lambda t: t.permute(2, 1, 0)),
    "expanded": ((1, 4, 96), lambda t: t.expand(3, 4, 96)),
}


@pytest.mark.parametrize("case", VIEWS)
def test_non_contiguous_x(case):
    storage, view = VIEWS[case]
    t = {"x": torch.randn(storage, device=DEVICE), "weight": pruned(20, 96, 0.9),
         "bias": torch.randn(20, device=DEVICE)}
    check(ours, F.linear, t, build=lambda x, weight, bias: (view(x), weight, bias), constant=("weight",))


def test_shortcuts_give_each_weight_its_own_product():
    """Repeat eager calls without autograd take shortcuts (`Shortcuts`) keyed by the weight's tensors and format:
    two weights of one format called alternately each give their own product, and so does a weight of another
    format with tensors of the same sizes (8 x 256 in chunks of 256, 4 x 256 in chunks of 128: 9 run pointers and
    32 entries each); a weight made inconsistent after its calls is still refused."""
    def spread(n, per_row):  # [n, 256], per_row non-zeros in each row
        w = torch.zeros(n, 256, device=DEVICE)
        w[:, ::256 // per_row] = torch.randn(n, per_row, device=DEVICE)
        return w
    dense = [spread(8, 4), spread(8, 4), spread(4, 8)]
    weights = [sparsify(dense[0]), sparsify(dense[1]), sparsify(dense[2], block_k=128)]
    assert weights[0].chunk_ptr.shape == weights[2].chunk_ptr.shape and weights[0].nnz == weights[2].nnz
    with torch.no_grad():
        for _ in range(2):
            for w, sw in zip(dense, weights):
                x = torch.randn(3, 256, device=DEVICE)
                torch.testing.assert_close(sparse_linear(x, sw), F.linear(x, w))
        weights[0].transposed = weights[1]  # W^T of the wrong shape
        with pytest.raises(ValueError, match="'weight'"):
            sparse_linear(torch.randn(3, 256, device=DEVICE), weights[0])


def test_repeat_calls_with_autograd_through_the_shortcut(monkeypatch):
    """Repeat calls where autograd records them (2-D and 3-D x, a column slice, with and without bias, the bias's
    gradient alone) take their signature's shortcut (`SparseShortcut`), forward and backward, and give what the op's
    own path gives, bit for bit (`_check.assert_grad_calls_repeat_through_shortcuts`)."""
    sw = sparsify(torch.randn(12, 40, device=DEVICE) * (torch.rand(12, 40, device=DEVICE) > 0.7))
    x, bias = torch.randn(2, 5, 40, device=DEVICE), torch.randn(12, device=DEVICE)
    calls = [(lambda x, b: sparse_linear(x, sw, b), (x[0], bias)), (lambda x: sparse_linear(x, sw), (x,)),
             (lambda x: sparse_linear(x, sw), (torch.randn(5, 80, device=DEVICE)[:, ::2],)),
             (lambda b: sparse_linear(x, sw, b), (bias,))]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


@pytest.mark.parametrize("method", ["l1_unstructured", "random_unstructured"])
def test_prune_masked_linear(method):
    linear = torch.nn.Linear(200, 48, device=DEVICE)
    getattr(prune, method)(linear, "weight", amount=0.9)
    sw = sparsify(linear.weight)
    assert torch.equal(sw.to_dense(), linear.weight.detach())
    assert sw.nnz == int(linear.weight_mask.sum())
    check(lambda x, weight, bias: sparse_linear(x, sw, bias), F.linear,
          {"x": torch.randn(6, 200, device=DEVICE), "weight": linear.weight.detach(), "bias": linear.bias.detach()},
          constant=("weight",))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 1000), (33, 257), (1000, 33), (3, 0), (0, 5)])
def test_format_round_trip(shape, dtype):
    w = pruned(*shape, 0.7, dtype)
    w[0:1, :1] = float("nan")  # any non-zero is kept, NaN too
    sw = sparsify(w)
    assert sw.shape == shape and sw.dtype == dtype and sw.nnz == int((w != 0).sum())
    assert torch.equal(sw.to_dense().isnan(), w.isnan())
    assert torch.equal(sw.to_dense().nan_to_num(), w.nan_to_num())
    assert torch.equal(sw.transposed.to_dense().nan_to_num(), w.t().nan_to_num())
    assert sw.offsets.dtype == torch.uint8 and sw.chunk_ptr.dtype == torch.int32


def test_non_contiguous_weight():
    w = pruned(512, 256, 0.5)
    for weight in (w.t(), w[:, ::2], w.t()[::3]):
        sw = sparsify(weight)
        assert torch.equal(sw.to_dense(), weight) and torch.equal(sw.transposed.to_dense(), weight.t())


def test_autocast():
    """Under torch.autocast, x, bias and the weight's values are cast to its dtype, as F.linear's operands."""
    t = leaves((4, 3), 20, 300, 0.9, torch.float32)
    sw = sparsify(t["weight"])
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y, y_torch = sparse_linear(t["x"], sw, t["bias"]), F.linear(t["x"], t["weight"], t["bias"])
    assert y.dtype == y_torch.dtype == torch.bfloat16 and sw.dtype == torch.float32
    ref = F.linear(*(v.bfloat16().double() for v in t.values()))
    assert rel_err(y, ref) <= TOLERANCES[torch.bfloat16][0]


def test_bytes_at_90_percent():
    """fp16 at 90% sparsity: values + uint8 offsets + chunk pointers <= 0.2x the dense bytes (about 0.158x)."""
    sw = sparsify(pruned(1024, 4096, 0.9, torch.float16), transpose=False)
    ratio = sw.nbytes / sw.dense_nbytes
    assert sw.transposed is None and 0.15 < ratio <= 0.2, ratio
    assert sw.nbytes == sw.nnz * 3 + (1024 * 16 + 1) * 4
    assert abs(sw.density - 0.1) < 0.01


@pytest.mark.parametrize("tokens", [(3,), (3, 7)], ids=["few-tokens", "many-tokens"])
def test_every_output_element_written(tokens, monkeypatch):
    poison_allocations(monkeypatch)
    check(ours, F.linear, leaves(tokens, 70, 600, 0.9, torch.float16), constant=("weight",))


CONFIGS = [pytest.param(tokens, i, id=f"{tokens}-{i}") for tokens, configs in sparse_module._CONFIGS.items()
           for i in range(len(configs))]


@pytest.mark.parametrize("tokens,index", CONFIGS)
def test_every_config(tokens, index, monkeypatch):
    """Each candidate config (tuning may pick any) with block_k 32: K = 600 in 19 chunks, so 8-slot tiles
    split K (the last split partly empty) and 16-64-slot tiles take all chunks at once. Outputs and
    temporaries are allocated NaN-filled."""
    poison_allocations(monkeypatch)
    monkeypatch.setattr(sparse_module, "_plans", {})  # no plan made for another config
    monkeypatch.setitem(sparse_module._CONFIGS, tokens, [sparse_module._CONFIGS[tokens][index]])
    check(lambda x, weight, bias: sparse_linear(x, sparsify(weight, block_k=32), bias), F.linear,
          leaves({"one": (1,), "few": (5,), "many": (17,)}[tokens], 37, 600, 0.8, torch.float32),
          constant=("weight",))


def test_empty_tokens_and_empty_k():
    y = sparse_linear(torch.randn(0, 3, 16, device=DEVICE), sparsify(pruned(5, 16, 0.5)))
    assert y.shape == (0, 3, 5)
    bias = torch.randn(5, device=DEVICE)
    assert torch.equal(sparse_linear(torch.randn(4, 0, device=DEVICE), sparsify(torch.ones(5, 0, device=DEVICE)), bias),
                       bias.expand(4, 5))


def test_reference_matches_dense():
    w = pruned(6, 40, 0.5)
    x = torch.randn(3, 40, device=DEVICE, dtype=torch.float64)
    torch.testing.assert_close(sparse_linear_ref(x, sparsify(w)), F.linear(x, w.double()), rtol=0, atol=0)


def test_inference_only_weight():
    sw = sparsify(pruned(8, 32, 0.5), transpose=False)
    x = torch.randn(2, 32, device=DEVICE)
    torch.testing.assert_close(sparse_linear(x, sw), F.linear(x, sw.to_dense()), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        sparse_linear(x.requires_grad_(), sw)
    with pytest.raises(RuntimeError, match="transpose=True"):
        sparse_linear(x, sw)
    bias = torch.randn(8, device=DEVICE, requires_grad=True)  # the bias gradient alone needs no W^T
    sparse_linear(x.detach(), sw, bias).sum().backward()
    torch.testing.assert_close(bias.grad, torch.full((8,), 2.0, device=DEVICE))


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    sw = sparsify(pruned(24, 64, 0.9))

    def block(x, weight, bias):
        return sparse_linear(torch.relu(x), sw, bias) * 2

    def block_ref(x, weight, bias):
        return F.linear(torch.relu(x), weight, bias) * 2

    t = {"x": torch.randn(5, 64, device=DEVICE), "weight": sw.to_dense(), "bias": torch.randn(24, device=DEVICE)}
    check(torch.compile(block, fullgraph=True), block_ref, t, constant=("weight",))


def test_strided_bias():
    """A bias view with a stride (the kernels read bias with unit stride: it is made contiguous)."""
    check(ours, F.linear, {**leaves((5,), 8, 40, 0.5, torch.float32, bias=False),
                           "bias": torch.randn(16, device=DEVICE)},
          build=lambda x, weight, bias: (x, weight, bias[::2]), constant=("weight",))


REGISTERED = {  # id -> (x (tokens, K) maker, N, sparsity, block_k, bias, dtype, config list forced for "many")
    "one-token": (lambda: torch.randn(1, 300), 20, 0.9, 256, True, torch.float32, None),
    "few-k-major-fp16": (lambda: torch.randn(300, 5).t(), 20, 0.5, 256, True, torch.float16, None),
    "few-sliced-split-bf16": (lambda: torch.randn(5, 600)[:, ::2], 20, 0.9, 16, False, torch.bfloat16, None),
    "many-split": (lambda: torch.randn(17, 300), 37, 0.8, 8, True, torch.float32, None),
    "int64-chunk-ptr": (lambda: torch.randn(3, 70), 9, 0.5, 32, True, torch.float32, None),
    "empty-k": (lambda: torch.randn(4, 0), 5, 0.0, 256, True, torch.float32, None),
    "dense-detour": (lambda: torch.randn(17, 300), 37, 0.8, 64, True, torch.float32, [dict(DENSE=True)]),
}


@pytest.mark.parametrize("case", REGISTERED)
def test_registered_op(case, monkeypatch):
    """Schema, fake and dynamic-shape tracing of dropin::sparse_linear (what torch.compile sees): token classes,
    K split over programs or not, x read directly or through a copy, bias or none, dtypes, both index dtypes and
    the dense detour through matmul's product."""
    make, n, sparsity, block_k, bias, dtype, configs = REGISTERED[case]
    if configs is not None:
        monkeypatch.setitem(sparse_module._CONFIGS, "many", configs)
    x = make().to(DEVICE, dtype)
    sw = sparsify(pruned(n, x.shape[1], sparsity, dtype), block_k=block_k, transpose=False)
    chunk_ptr = sw.chunk_ptr.long() if case == "int64-chunk-ptr" else sw.chunk_ptr
    b = torch.randn(n, device=DEVICE, dtype=dtype) if bias else None
    _check.opcheck(torch.ops.dropin.sparse_linear.default, x, sw.values, sw.offsets, chunk_ptr, b, n, block_k)


def test_module_from_linear():
    linear = torch.nn.Linear(96, 40, device=DEVICE)
    prune.l1_unstructured(linear, "weight", amount=0.9)
    module = dropin.nn.SparseLinear.from_linear(linear)
    assert module.bias is linear.bias and (module.in_features, module.out_features) == (96, 40)
    assert abs(module.sparsity - 0.9) < 1e-3 and module.nbytes == module.weight.nbytes < 0.3 * 96 * 40 * 4
    assert torch.equal(module.weight.to_dense(), linear.weight.detach())
    check(lambda x, weight, bias: module(x), F.linear,
          {"x": torch.randn(2, 3, 96, device=DEVICE), "weight": linear.weight.detach(), "bias": linear.bias.detach()},
          constant=("weight", "bias"))
    module(torch.randn(4, 96, device=DEVICE)).sum().backward()
    torch.testing.assert_close(linear.bias.grad, torch.full((40,), 4.0, device=DEVICE))  # the original's bias trains
    half = dropin.nn.SparseLinear.from_linear(linear, transpose=False).half()
    assert half.values.dtype == torch.float16 and half.offsets.dtype == torch.uint8 and half.t_values is None
    assert set(half.state_dict()) == {"bias", "values", "offsets", "chunk_ptr"}
    x = torch.randn(3, 96, device=DEVICE, dtype=torch.float16)
    torch.testing.assert_close(half(x), F.linear(x, linear.weight.half(), linear.bias.half()), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="'linear'"):
        dropin.nn.SparseLinear.from_linear(torch.nn.Conv2d(3, 3, 1))


# ---------------------------------------------------------------------------------------------- errors
WRONG_DEVICE = "cpu" if ON_GPU else "meta"


def T(*shape, dtype=torch.float32, device=None):
    return torch.randn(shape, device=device or DEVICE).to(dtype)


def W(n=8, k=16, dtype=torch.float32, device=None):
    sw = sparsify(pruned(n, k, 0.5, dtype))
    if device is None:
        return sw
    return SparseWeight(sw.values.to(device), sw.offsets.to(device), sw.chunk_ptr.to(device), sw.shape, sw.block_k)


def broken(**changes):
    """W() with some of its fields replaced: name -> function of the old value."""
    sw = W()
    for name, change in changes.items():
        setattr(sw, name, change(getattr(sw, name)))
    return sw


ERRORS = [  # (id, lambda -> (x, weight, bias), exception, the argument the message must name)
    ("wrong-k", lambda: (T(3, 15), W(), None), RuntimeError, "x"),
    ("x-0d", lambda: (T(), W(), None), RuntimeError, "x"),
    ("x-int", lambda: (torch.ones(3, 16, dtype=torch.int32, device=DEVICE), W(), None), RuntimeError, "x"),
    ("x-float64", lambda: (T(3, 16, dtype=torch.float64), W(), None), RuntimeError, "x"),
    ("x-list", lambda: ([[1.0] * 16], W(), None), TypeError, "x"),
    ("x-device", lambda: (T(3, 16, device=WRONG_DEVICE), W(), None), RuntimeError, "x"),
    ("weight-dense", lambda: (T(3, 16), T(8, 16), None), TypeError, "weight"),
    ("weight-dtype", lambda: (T(3, 16), W(dtype=torch.float16), None), RuntimeError, "weight"),
    ("weight-device", lambda: (T(3, 16), W(device=WRONG_DEVICE), None), RuntimeError, "weight"),
    ("weight-short-ptr", lambda: (T(3, 16), broken(chunk_ptr=lambda t: t[:-1]), None), ValueError, "weight"),
    ("weight-offsets-int", lambda: (T(3, 16), broken(offsets=lambda t: t.int()), None), ValueError, "weight"),
    ("weight-values-short", lambda: (T(3, 16), broken(values=lambda t: t[1:]), None), ValueError, "weight"),
    ("weight-transposed", lambda: (T(3, 16), broken(transposed=lambda t: W(16, 9)), None), ValueError, "weight"),
    ("bias-shape", lambda: (T(3, 16), W(), T(7)), RuntimeError, "bias"),
    ("bias-2d", lambda: (T(3, 16), W(), T(1, 8)), RuntimeError, "bias"),
    ("bias-dtype", lambda: (T(3, 16), W(), T(8, dtype=torch.float16)), RuntimeError, "bias"),
    ("bias-int", lambda: (T(3, 16), W(), torch.ones(8, dtype=torch.int64, device=DEVICE)), RuntimeError, "bias"),
    ("bias-device", lambda: (T(3, 16), W(), T(8, device=WRONG_DEVICE)), RuntimeError, "bias"),
]


@pytest.mark.parametrize("args,exc,name", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_input_raises(args, exc, name):
    x, weight, bias = args()
    with pytest.raises(exc, match=f"'{name}'"):
        sparse_linear(x, weight, bias)


SPARSIFY_ERRORS = [  # (id, lambda -> (weight, kwargs), exception, argument)
    ("weight-1d", lambda: (T(16), {}), ValueError, "weight"),
    ("weight-3d", lambda: (T(2, 8, 16), {}), ValueError, "weight"),
    ("weight-int", lambda: (torch.ones(8, 16, dtype=torch.int8), {}), ValueError, "weight"),
    ("weight-float64", lambda: (T(8, 16, dtype=torch.float64), {}), ValueError, "weight"),
    ("weight-list", lambda: ([[1.0]], {}), TypeError, "weight"),
    ("block_k-0", lambda: (T(8, 16), {"block_k": 0}), ValueError, "block_k"),
    ("block_k-257", lambda: (T(8, 16), {"block_k": 257}), ValueError, "block_k"),
    ("block_k-float", lambda: (T(8, 16), {"block_k": 64.0}), ValueError, "block_k"),
]


@pytest.mark.parametrize("args,exc,name", [e[1:] for e in SPARSIFY_ERRORS], ids=[e[0] for e in SPARSIFY_ERRORS])
def test_sparsify_bad_input_raises(args, exc, name):
    weight, kwargs = args()
    with pytest.raises(exc, match=f"'{name}'"):
        sparsify(weight, **kwargs)
