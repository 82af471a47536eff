"""dropin.ops.rms_norm against HF Llama's RMSNorm: forward and gradients of x, weight and residual; long rows
through the looped kernels.

No tl.dot here, so bfloat16 runs under the interpreter too. On the CPU the rows stay few; `gpu` adds
Llama-sized rows and hidden sizes.
"""
import importlib

import pytest
import torch

import dropin
import _check
from _check import check, found_shortcuts, poison_allocations
from _looped import loop_rows
from _tol import DEVICE, ON_GPU, gpu

rms_norm_module = importlib.import_module("dropin.ops.rms_norm")
rms_norm_ref = rms_norm_module.rms_norm_ref

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


def leaves(shape, dtype, residual=False, weight_dtype=None):
    t = {"x": torch.randn(shape, device=DEVICE, dtype=dtype),
         "weight": (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).to(weight_dtype or dtype)}
    if residual:
        t["residual"] = torch.randn(shape, device=DEVICE, dtype=dtype)
    return t


def ops(eps=1e-6, form="llama"):
    def ours(x, weight, residual=None):
        return dropin.ops.rms_norm(x, weight, eps, residual=residual, form=form)

    def ref(x, weight, residual=None):
        return rms_norm_ref(x, weight, eps, residual, form)
    return ours, ref


SHAPES = [
    pytest.param((1, 33), id="1x33"),
    pytest.param((7,), id="1d-7"),
    pytest.param((33, 7), id="33x7"),
    pytest.param((3, 5, 1000), id="3x5x1000"),
    pytest.param((2, 1, 3, 33), id="2x1x3x33"),
    pytest.param((9, 127), id="weird-9x127"),
    pytest.param((4, 4096), id="4x4096"),
    pytest.param((64, 5120), id="64x5120", marks=gpu),
    pytest.param((2, 1024, 4096), id="2x1024x4096", marks=gpu),
    pytest.param((300, 16384), id="300x16384", marks=gpu),
    pytest.param((17, 32768), id="17x32768", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(shape, residual, dtype):
    ours, ref = ops()
    check(ours, ref, leaves(shape, dtype, residual))


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fp32_weight_on_half_activations(x_dtype):
    """HF keeps fp32 weights under mixed precision: the output is then float32, as in HF."""
    ours, ref = ops()
    t = leaves((5, 40), x_dtype, residual=True, weight_dtype=torch.float32)
    assert ours(**t)[0].dtype == torch.float32
    check(ours, ref, t, dtype=x_dtype)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_eps(eps):
    ours, ref = ops(eps)
    check(ours, ref, leaves((6, 48), torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_size_1(dtype):
    """x / sqrt(x^2 + eps): its gradient eps / (x^2 + eps)^1.5 is a cancellation unless eps is large, and
    the weight gradient, one sum over the rows, is one unless the terms are positive."""
    ours, ref = ops(eps=1.0)
    check(ours, ref, leaves((5, 1), dtype, residual=True), positive=True)


VIEWS = {  # id -> (storage shape, view) of x and of residual, for a logical (4, 6, 40)
    "permuted": ((6, 4, 40), lambda t: t.transpose(0, 1)),
    "column-slice": ((4, 6, 80), lambda t: t[..., ::2]),
    "hidden-transposed": ((40, 6, 4), lambda t: t.permute(2, 1, 0)),
    "offset": ((5, 6, 43), lambda t: t[1:, :, 3:]),
    "expanded": ((1, 6, 40), lambda t: t.expand(4, 6, 40)),
}


@pytest.mark.parametrize("case", VIEWS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_non_contiguous(case, residual):
    storage, view = VIEWS[case]
    ours, ref = ops()
    t = leaves(storage, torch.float32, residual)
    t["weight"] = 1 + 0.1 * torch.randn(40, device=DEVICE)

    def build(x, weight, residual=None):
        return view(x), weight, None if residual is None else view(residual)
    check(ours, ref, t, build=build)


@pytest.mark.parametrize("case", ["contiguous", *VIEWS])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_repeat_call_through_the_shortcut(case, residual, monkeypatch):
    """A repeat eager call without autograd takes its signature's shortcut (`Shortcuts`) where x's and residual's
    rows are views (a misaligned one included); where flattening copies them it takes the op's path. Either way
    HF's values (every element written) in the first call's layout."""
    storage, view = VIEWS.get(case, ((4, 6, 40), lambda t: t))
    weight = 1 + 0.1 * torch.randn(40, device=DEVICE)

    def call():  # (ours, HF's) on new inputs
        x, r = (view(torch.randn(storage, device=DEVICE)) for _ in range(2))
        r = r if residual else None
        return dropin.ops.rms_norm(x, weight, residual=r), rms_norm_ref(x, weight, 1e-6, r)
    served = found_shortcuts(monkeypatch)
    poison_allocations(monkeypatch)
    with torch.no_grad():
        first, _ = call()
        out, want = call()
    for o, w, o_first in zip(*(t if residual else (t,) for t in (out, want, first))):
        torch.testing.assert_close(o, w)
        assert o.stride() == o_first.stride()
    assert served[1] == (case in ("contiguous", "column-slice", "offset"))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_repeat_calls_with_autograd_through_the_shortcut(residual, monkeypatch):
    """Repeat calls where autograd records them (contiguous, a column slice, an offset view) take their signature's
    shortcut, forward and backward, and give what the op's own path gives, bit for bit
    (`_check.assert_grad_calls_repeat_through_shortcuts`)."""
    calls = []
    for case in ("contiguous", "column-slice", "offset"):
        storage, view = VIEWS.get(case, ((4, 6, 40), lambda t: t))
        x, r = (view(torch.randn(storage, device=DEVICE)) for _ in range(2))
        weight = 1 + 0.1 * torch.randn(40, device=DEVICE)
        if residual:
            calls.append((lambda x, w, r: dropin.ops.rms_norm(x, w, residual=r), (x, weight, r)))
        else:
            calls.append((dropin.ops.rms_norm, (x, weight)))
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_weight_view_and_empty_rows():
    ours, ref = ops()
    check(ours, ref, {"x": torch.randn(3, 10, device=DEVICE), "weight": torch.randn(20, device=DEVICE)},
          build=lambda x, weight: (x, weight[::2]))
    x, w = torch.randn(0, 16, device=DEVICE, requires_grad=True), torch.randn(16, device=DEVICE, requires_grad=True)
    y = dropin.ops.rms_norm(x, w)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_every_output_element_written(residual, monkeypatch):
    poison_allocations(monkeypatch)
    ours, ref = ops()
    check(ours, ref, leaves((3, 7, 65), torch.float16, residual))


def test_same_tensor_as_x_and_residual():
    ours, ref = ops()
    check(ours, ref, leaves((3, 24), torch.float32), build=lambda x, weight: (x, weight, x))


def test_only_new_residual_used():
    """The gradient still flows when only the new residual stream (not the normed output) is used."""
    x = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    r = torch.randn(4, 8, device=DEVICE, requires_grad=True)
    _, s = dropin.ops.rms_norm(x, torch.ones(8, device=DEVICE), residual=r)
    s.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(r.grad, torch.ones_like(r))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_registered_ops(residual):
    """Schema, fake and dynamic-shape tracing of the forward and backward ops (what torch.compile sees)."""
    x, w = torch.randn(5, 3, 40, device=DEVICE)[:, 1], torch.randn(40, device=DEVICE)
    r = torch.randn(5, 40, device=DEVICE) if residual else None
    _check.opcheck(torch.ops.dropin.rms_norm_fwd.default, x, w, r, 1e-6)
    y, s, rstd = torch.ops.dropin.rms_norm_fwd(x, w, r, 1e-6)
    ds = torch.randn(5, 40, device=DEVICE) if residual else None
    _check.opcheck(torch.ops.dropin.rms_norm_bwd.default, torch.randn(5, 40, device=DEVICE), ds,
                   s if residual else x, w, rstd)


LOOPED = "dropin.ops.rms_norm"
FORMS = ["llama", "gemma"]


def _looped_kernels():
    m = rms_norm_module
    return [m._rms_norm_fwd_long_kernel, m._rms_norm_bwd_long_kernel, m._rms_norm_bwd_w_kernel]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("n", [300, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_looped(dtype, n, residual, form, monkeypatch):
    """Rows longer than the whole-row kernels take (lowered to 64 here) loop over chunks of 64: 300 elements end
    in a partial chunk, 256 in a full one; 19 rows, more than one step of the weight gradient's row loop."""
    kernels = loop_rows(monkeypatch, LOOPED)
    check(*ops(form=form), leaves((19, n), dtype, residual))
    assert kernels == _looped_kernels()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_long_rows_looped_fp32_weight(x_dtype, form, monkeypatch):
    """`test_fp32_weight_on_half_activations` through the looped kernels (gemma: the output in x's dtype)."""
    loop_rows(monkeypatch, LOOPED)
    ours, ref = ops(form=form)
    t = leaves((5, 300), x_dtype, residual=True, weight_dtype=torch.float32)
    assert ours(**t)[0].dtype == (torch.float32 if form == "llama" else x_dtype)
    check(ours, ref, t, dtype=x_dtype)


@pytest.mark.parametrize("case", VIEWS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_long_rows_looped_views(case, residual, monkeypatch):
    """The looped kernels read x, residual, dy and a weight slice through their strides (rows longer than 16
    here, in chunks of 16)."""
    kernels = loop_rows(monkeypatch, LOOPED, short=16)
    storage, view = VIEWS[case]
    t = leaves(storage, torch.float32, residual)
    t["weight"] = 1 + 0.1 * torch.randn(80, device=DEVICE)

    def build(x, weight, residual=None):
        return view(x), weight[::2], None if residual is None else view(residual)
    check(*ops(), t, build=build)
    assert kernels == _looped_kernels()


def test_long_rows_looped_through_the_shortcut(monkeypatch):
    """Repeat calls of looped rows take the kept shortcuts: without autograd, with it (x, weight and residual
    leaves), and with a weight that needs no gradient (none computed)."""
    kernels = loop_rows(monkeypatch, LOOPED)
    base, r = torch.randn(4, 6, 200, device=DEVICE), torch.randn(4, 3, 100, device=DEVICE)
    w = 1 + 0.1 * torch.randn(100, device=DEVICE)
    _check.assert_calls_repeat_through_shortcuts(
        [*(lambda i=i: dropin.ops.rms_norm(base[:, ::2, 100:], w, residual=r)[i] for i in (0, 1)),
         lambda: dropin.ops.rms_norm(base[..., ::2], w, form="gemma")], monkeypatch)
    _check.assert_grad_calls_repeat_through_shortcuts(
        [(lambda x, w, r: dropin.ops.rms_norm(x, w, residual=r), (base[:, ::2, 100:], w, r)),
         (lambda x, w: dropin.ops.rms_norm(x, w, form="gemma"), (base[..., ::2], w))], monkeypatch)
    x = base[..., :100].clone().requires_grad_()
    found, grads = found_shortcuts(monkeypatch), []
    for _ in range(2):
        dropin.ops.rms_norm(x, w).sum().backward()
        grads.append(x.grad)
        x.grad = None
    assert found == [False, True] and torch.equal(grads[0], grads[1])
    assert set(kernels) == set(_looped_kernels())


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_registered_ops_looped(residual, monkeypatch):
    """`test_registered_ops`' cases through the looped kernels (rows longer than 16 elements here)."""
    kernels = loop_rows(monkeypatch, LOOPED, short=16)
    test_registered_ops(residual)
    assert kernels and set(kernels) <= set(_looped_kernels())


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    ours, ref = ops()

    def block(x, weight, residual):
        y, s = ours(x, weight, residual)
        return ours(y * 2, weight), s

    def block_ref(x, weight, residual):
        y, s = ref(x, weight, residual)
        return ref(y * 2, weight), s

    check(torch.compile(block, fullgraph=True), block_ref, leaves((2, 5, 64), torch.float32, residual=True))


def test_reference_is_hf_llama():
    transformers = pytest.importorskip("transformers.models.llama.modeling_llama")
    norm = transformers.LlamaRMSNorm(48, eps=1e-5).to(DEVICE)
    norm.weight.data.normal_()
    x = torch.randn(3, 7, 48, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight, 1e-5), norm(x), rtol=0, atol=0)


def test_module_from_llama_shares_weight():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = llama.LlamaRMSNorm(40, eps=1e-5).to(DEVICE)
    hf.weight.data.normal_()
    norm = dropin.nn.RMSNorm.from_llama(hf)
    assert norm.weight is hf.weight and norm.variance_epsilon == 1e-5
    assert norm.state_dict().keys() == hf.state_dict().keys()
    x = torch.randn(2, 3, 40, device=DEVICE, dtype=torch.float16)
    check(lambda x, w: norm(x), lambda x, w: rms_norm_ref(x, w, 1e-5), {"x": x, "weight": hf.weight.detach()},
          backward=False)
    r = torch.randn_like(x)
    y, s = norm(x, r)
    torch.testing.assert_close(s, x + r, rtol=0, atol=0)
    norm(x).float().sum().backward()
    assert hf.weight.grad is not None  # the gradient lands in the HF module's own parameter
    with pytest.raises(ValueError, match="'norm'"):
        dropin.nn.RMSNorm.from_llama(torch.nn.Linear(4, 4))


def test_module_constructor():
    norm = dropin.nn.RMSNorm(24, eps=1e-5, device=DEVICE)
    x = torch.randn(3, 24, device=DEVICE)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, 1e-5), rtol=1e-6, atol=1e-6)


@gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 40000), (2, 65537)], ids=["40000", "65537"])
def test_long_rows_gpu(shape, dtype, residual, form):
    """Hidden sizes past the whole-row kernels' 32768 (and past `_common.MAX_ROW`), through the looped kernels."""
    check(*ops(form=form), leaves(shape, dtype, residual))


# ---------------------------------------------------------------------------------------------- errors
WRONG_DEVICE = "cpu" if ON_GPU else "meta"


def T(*shape, dtype=torch.float32, device=None):
    return torch.randn(shape, device=device or DEVICE).to(dtype)


ERRORS = [  # (id, x, weight, kwargs, exception, the argument the message must name)
    ("weight-size", lambda: (T(3, 8), T(7), {}), RuntimeError, "weight"),
    ("weight-2d", lambda: (T(3, 8), T(1, 8), {}), RuntimeError, "weight"),
    ("x-0d", lambda: (T(), T(1), {}), RuntimeError, "x"),
    ("x-int", lambda: (torch.ones(3, 8, dtype=torch.int32, device=DEVICE), T(8), {}), RuntimeError, "x"),
    ("x-float64", lambda: (T(3, 8, dtype=torch.float64), T(8), {}), RuntimeError, "x"),
    ("x-list", lambda: ([[1.0]], T(1), {}), TypeError, "x"),
    ("weight-none", lambda: (T(3, 8), None, {}), TypeError, "weight"),
    ("residual-shape", lambda: (T(3, 8), T(8), {"residual": T(4, 8)}), RuntimeError, "residual"),
    ("residual-dtype", lambda: (T(3, 8), T(8), {"residual": T(3, 8, dtype=torch.float16)}), RuntimeError,
     "residual"),
    ("residual-device", lambda: (T(3, 8), T(8), {"residual": T(3, 8, device=WRONG_DEVICE)}), RuntimeError,
     "residual"),
    ("x-device", lambda: (T(3, 8, device=WRONG_DEVICE), T(8), {}), RuntimeError, "x"),
    ("weight-device", lambda: (T(3, 8), T(8, device=WRONG_DEVICE), {}), RuntimeError, "weight"),
    ("eps-negative", lambda: (T(3, 8), T(8), {"eps": -1e-6}), ValueError, "eps"),
    ("eps-nan", lambda: (T(3, 8), T(8), {"eps": float("nan")}), ValueError, "eps"),
    ("eps-tensor", lambda: (T(3, 8), T(8), {"eps": torch.tensor(1e-6)}), ValueError, "eps"),
]


@pytest.mark.parametrize("args,exc,name", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_input_raises(args, exc, name):
    x, weight, kwargs = args()
    with pytest.raises(exc, match=f"'{name}'"):
        dropin.ops.rms_norm(x, weight, **kwargs)
