"""dropin.ops.activation / relu / gelu / silu (the standalone elementwise op) against torch: forward and
backward vs float64 and the 2x rule (tests/_check.py), dense layouts kept, strided views, repeat calls through
the eager shortcut, NaN / inf, errors."""
import pytest
import torch
import torch.nn.functional as F

import _check
import dropin.ops as ops
from dropin.ops.activations import FROM_OUTPUT, activation_ref
from _check import check
from _tol import DEVICE, gpu, sweep

# sigmoid(-large) under the interpreter: numpy's exp overflows to inf (the result, 0, is right); silu(-inf)
# multiplies -inf by 0 (NaN, as torch's)
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
ACTS = {"relu": (ops.relu, F.relu), "gelu": (ops.gelu, F.gelu), "silu": (ops.silu, F.silu),
        "gelu_tanh": (lambda x: ops.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
        **{name: (lambda x, name=name: ops.activation(x, name), ref)
           for name, ref in (("hardswish", F.hardswish), ("hardsigmoid", F.hardsigmoid), ("sigmoid", torch.sigmoid),
                             ("leaky_relu", F.leaky_relu), ("tanh", torch.tanh), ("mish", F.mish), ("elu", F.elu),
                             ("selu", F.selu), ("celu", F.celu), ("softplus", F.softplus))}}
# the activations computed from exp (their own expm1, log1p and tanh): inputs where a naive formula cancels or overflows
EXP_BASED = ["tanh", "mish", "elu", "selu", "celu", "softplus"]


@pytest.mark.parametrize("name", list(ACTS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes(dtype, name):
    check(*ACTS[name], {"x": torch.randn(3, 7, 33, dtype=dtype, device=DEVICE) * 3})


@pytest.mark.parametrize("name", EXP_BASED)
@pytest.mark.parametrize("inputs", ["near-0", "positive-tail", "negative-tail"])
def test_near_zero_and_in_the_tails(name, inputs):
    """Forward and backward against float64 and the 2x rule: near 0 (1e-3 scale: exp(x) - 1 and 1 - exp(-2|x|)
    cancel there) and in each tail, |x| in [10, 25] (past softplus's threshold 20, tanh and mish saturated,
    softplus and mish of very negative x, where log(1 + exp(x)) rounds to 0); finite at +-90 and +-100, where
    exp(2|x|) is inf (inf / inf in a naive tanh or mish)."""
    x = {"near-0": lambda: torch.randn(4, 65) * 1e-3, "positive-tail": lambda: 10 + 15 * torch.rand(4, 65),
         "negative-tail": lambda: -10 - 15 * torch.rand(4, 65)}[inputs]().to(DEVICE)
    check(*ACTS[name], {"x": x})
    big = torch.tensor([-100.0, -90.0, 90.0, 100.0], device=DEVICE, requires_grad=True)
    out = ACTS[name][0](big)
    (grad,) = torch.autograd.grad(out, big, torch.ones_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("layout", ["channels_last", "transposed", "sliced", "expanded", "6d-strided", "scalar"])
@pytest.mark.parametrize("name", ["relu", "gelu"])
def test_layouts(name, layout):
    """Dense layouts are kept (one flat pass); views are read through their strides."""
    x = {"channels_last": lambda: torch.randn(2, 5, 4, 3).to(memory_format=torch.channels_last),
         "transposed": lambda: torch.randn(6, 9).t(),
         "sliced": lambda: torch.randn(4, 10, 6)[:, 1::3, ::2],
         "expanded": lambda: torch.randn(5, 1).expand(5, 7),
         "6d-strided": lambda: torch.randn(2, 3, 2, 3, 2, 6)[..., ::2].transpose(1, 4),
         "scalar": lambda: torch.randn(())}[layout]().to(DEVICE)
    check(*ACTS[name], {"x": x})
    if layout in ("channels_last", "transposed"):
        assert ACTS[name][0](x).stride() == x.stride()


@pytest.mark.parametrize("name", list(ACTS))
def test_gradient_layout_as_torch(name):
    """x channels_last, the upstream gradient NCHW: the input's gradient is laid out as torch's (as x for relu and
    leaky_relu, whose backward takes x first; as the gradient for the others)."""
    x = torch.randn(2, 5, 4, 3, device=DEVICE).to(memory_format=torch.channels_last)
    dy = torch.randn(2, 5, 4, 3, device=DEVICE)
    strides = []
    for fn in ACTS[name]:
        leaf = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(fn(leaf), leaf, dy)
        strides.append(g.stride())
    assert strides[0] == strides[1]


def test_repeat_calls_through_the_shortcut(monkeypatch):
    """Repeat calls without autograd on views (channels_last, transposed, sliced, expanded) take the shortcut that
    the first call of their signature kept, and give what it gave, in its layout (the repeat's new allocations
    NaN-filled: an element left unwritten shows)."""
    views = [torch.randn(2, 5, 4, 3).to(memory_format=torch.channels_last), torch.randn(6, 9).t(),
             torch.randn(4, 10, 6)[:, 1::3, ::2], torch.randn(5, 1).expand(5, 7)]
    calls = [lambda x=x.to(DEVICE), fn=fn: fn(x) for x in views for fn, _ in ACTS.values()]
    _check.assert_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_repeat_calls_with_autograd_through_the_shortcut(monkeypatch):
    """As above where autograd records the calls: forward and backward through the kept plans."""
    views = [torch.randn(2, 5, 4, 3).to(memory_format=torch.channels_last), torch.randn(6, 9).t(),
             torch.randn(4, 10, 6)[:, 1::3, ::2]]
    calls = [(fn, (x.to(DEVICE),)) for x in views for fn, _ in ACTS.values()]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_special_values_and_generic_entry():
    """NaN propagates, tails saturate; +-inf as torch for relu and silu (torch's CPU gelu gives NaN at +inf,
    dropin the limit, inf)."""
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e-30, -40.0, 40.0], device=DEVICE)
    for name, (fn, ref) in ACTS.items():
        xs = x[3:] if name.startswith("gelu") else x
        torch.testing.assert_close(fn(xs), ref(xs), equal_nan=True)
        torch.testing.assert_close(ops.activation(xs, name), ref(xs), equal_nan=True)
    # relu's gradient at 0 is 0, as torch's
    x = torch.zeros(4, device=DEVICE, requires_grad=True)
    (g,) = torch.autograd.grad(ops.relu(x).sum(), x)
    assert torch.equal(g, torch.zeros(4, device=DEVICE))


@pytest.mark.parametrize("name", [*ACTS, "relu6"])
def test_backward_keeps_one_tensor(name):
    """The backward keeps one tensor: the output for the activations whose derivative it determines
    (activations.FROM_OUTPUT, as torch's relu: the next op keeps that same tensor), else the input; on the first
    call and through the shortcut. From the output, the gradient at the kinks (0, relu6's 6) and at NaN is still
    torch's (NaN: relu and relu6 pass the upstream gradient, leaky_relu scales it)."""
    x = torch.tensor([-1.5, -0.0, 0.0, 0.5, 3.0, 6.0, 7.0, float("nan")], device=DEVICE, requires_grad=True)
    for _ in range(2):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = ops.activation(x, name)
        kept = y if name in FROM_OUTPUT else x
        assert [t.untyped_storage().data_ptr() for t in saved] == [kept.untyped_storage().data_ptr()]
    if name in FROM_OUTPUT:
        dy = torch.randn_like(x)
        (ours,) = torch.autograd.grad(y, x, dy)
        (theirs,) = torch.autograd.grad(activation_ref(x, name), x, dy)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_no_grad_and_empty():
    x = torch.randn(5, device=DEVICE, requires_grad=True)
    with torch.no_grad():
        assert not ops.silu(x).requires_grad
    assert ops.relu(torch.randn(0, 3, device=DEVICE)).shape == (0, 3)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    chain = lambda relu, gelu, silu: lambda x: silu(gelu(relu(x) - 0.5) * 2)  # noqa: E731
    check(torch.compile(chain(ops.relu, ops.gelu, ops.silu), fullgraph=True), chain(F.relu, F.gelu, F.silu),
          {"x": torch.randn(4, 6, 5, device=DEVICE)})


REGISTERED = {  # id -> (x, dy or None (forward), activation): each kernel path, layout and dtype
    "fwd-relu-flat": (lambda: torch.randn(3, 7, 33), False, "relu"),
    "fwd-gelu-channels_last-fp16": (lambda: torch.randn(2, 5, 4, 3, dtype=torch.float16).to(
        memory_format=torch.channels_last), False, "gelu"),
    "fwd-gelu_tanh-sliced-bf16": (lambda: torch.randn(4, 10, 6, dtype=torch.bfloat16)[:, 1::3, ::2], False,
                                  "gelu_tanh"),
    "fwd-silu-6d-copied": (lambda: torch.randn(2, 3, 2, 3, 2, 6)[..., ::2].transpose(1, 4), False, "silu"),
    "bwd-relu-flat": (lambda: torch.randn(3, 7, 33), True, "relu"),
    "bwd-silu-transposed": (lambda: torch.randn(6, 9).t(), True, "silu"),
    "bwd-gelu-channels_last-dy": (lambda: torch.randn(2, 5, 4, 3), True, "gelu"),
}


@pytest.mark.parametrize("case", REGISTERED)
def test_registered_op(case):
    """Schema, fake and dynamic-shape tracing of dropin::activation (what torch.compile sees), forward (dy None)
    and backward (dy in another layout than x where the id says so)."""
    make, backward, act = REGISTERED[case]
    x = make().to(DEVICE)
    dy = None
    if backward:
        dy = torch.randn_like(x, memory_format=torch.channels_last if case.endswith("-dy") and x.dim() == 4
                              else torch.preserve_format)
    _check.opcheck(torch.ops.dropin.activation.default, x, dy, act)


# Each activation once in `make test-gpu`, the dtypes in turn: the large grid and its channels_last walk are the same
# kernel for every activation and dtype, each activation's own math in every dtype runs in test_dtypes. The other
# combinations are slow.
@gpu
@pytest.mark.parametrize("dtype,name", sweep(DTYPES, [pytest.param(name, id=name) for name in ACTS],
                                             default=lambda d, a: d == a % 3))
def test_large_gpu(dtype, name):
    check(*ACTS[name], {"x": torch.randn(64, 256, 56, 56, dtype=dtype, device=DEVICE).to(
        memory_format=torch.channels_last)})


def test_errors():
    with pytest.raises(ValueError, match="'activation'"):
        ops.activation(torch.randn(3, device=DEVICE), "prelu")
    with pytest.raises(RuntimeError, match="'approximate'"):
        ops.gelu(torch.randn(3, device=DEVICE), approximate="erf")
    with pytest.raises(RuntimeError):
        F.gelu(torch.randn(3), approximate="erf")
    with pytest.raises(RuntimeError, match="'input'"):
        ops.relu(torch.randn(3, dtype=torch.float64, device=DEVICE))
    with pytest.raises(RuntimeError, match="'input'"):
        ops.silu(torch.ones(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="'input'"):
        ops.relu([1.0])
