"""dropin.ops.layer_norm against F.layer_norm: forward and the gradients of input, weight and bias vs float64
and the 2x rule (tests/_check.py); odd row lengths, several normalized dims, strided views, repeat calls through
the eager shortcut, long rows through the looped kernels, every error path."""
import pytest
import torch
import torch.nn.functional as F

import _check
import dropin.ops as ops
from _check import check
from _looped import loop_rows
import _tol
from _tol import DEVICE, gpu

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


def _leaves(shape, n_last, dtype=torch.float32, weight=True, bias=True):
    norm = shape[len(shape) - n_last:]
    out = {"x": torch.randn(shape, dtype=dtype, device=DEVICE) * 2 + 0.5}
    if weight:
        out["w"] = torch.randn(norm, dtype=dtype, device=DEVICE)
    if bias:
        out["b"] = torch.randn(norm, dtype=dtype, device=DEVICE)
    return out


def _ln(fn, norm, eps=1e-5):
    return lambda x, w=None, b=None: fn(x, norm, w, b, eps)


@pytest.mark.parametrize("n", [1, 7, 33, 64, 1000, 5003])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_lengths(n, dtype):
    """Short rows (many per program) to long ones (one per program), none a power of 2 but 64. With n = 1
    x - mean and the gradients of x and w are exactly 0 (float64 torch gives rounding noise), so only b is compared."""
    leaves = _leaves((3, n) if n > 1000 else (3, 3, n), 1, dtype)
    check(_ln(ops.layer_norm, [n]), _ln(F.layer_norm, [n]), leaves, constant=("x", "w") if n == 1 else ())


@pytest.mark.parametrize("weight,bias", [(True, False), (False, True), (False, False)])
def test_optional_affine(weight, bias):
    check(_ln(ops.layer_norm, [24]), _ln(F.layer_norm, [24]), _leaves((5, 24), 1, weight=weight, bias=bias))


def test_several_normalized_dims_and_eps():
    check(_ln(ops.layer_norm, (5, 6), eps=1e-2), _ln(F.layer_norm, (5, 6), eps=1e-2), _leaves((3, 5, 6), 2))


@pytest.mark.parametrize("view", ["sliced-rows", "transposed-batch", "strided-row", "copy-needed", "channels_last"])
def test_strided_inputs(view):
    """Views read through their strides (M0 x M1 rows of one strided dim), and one that needs a copy."""
    base = torch.randn(4, 6, 10, 18, device=DEVICE)
    x, norm = {
        "sliced-rows": (base[:, ::2, 3], [18]),  # rows stepping 2, a batch dim on top
        "transposed-batch": (base[:, :, 0].transpose(0, 1), [18]),
        "strided-row": (base[..., ::3], [6]),  # 3 batch dims, two merge
        "copy-needed": (base.transpose(2, 3), [18, 10]),  # the normalized dims do not merge
        "channels_last": (base.to(memory_format=torch.channels_last), [18]),
    }[view]
    check(_ln(ops.layer_norm, norm), _ln(F.layer_norm, norm),
          {"x": x, "w": torch.randn(norm, device=DEVICE), "b": torch.randn(norm, device=DEVICE)})


def test_repeat_calls_through_the_shortcut(monkeypatch):
    """Repeat calls without autograd on views (rows of a slice, transposed batch dims, a strided row; a 2-D
    weight) take the shortcut that the first call of their signature kept, and give what it gave, in its layout
    (the repeat's new allocations NaN-filled: an element left unwritten shows)."""
    base = torch.randn(4, 6, 10, 18, device=DEVICE)
    cases = [(base[:, ::2, 3], (18,)), (base[:, :, 0].transpose(0, 1), (18,)), (base[..., ::3], (6,)),
             (base[0], (10, 18))]
    params = [(torch.randn(norm, device=DEVICE), torch.randn(norm, device=DEVICE)) for _, norm in cases]
    calls = [lambda x=x, norm=norm, wb=wb: ops.layer_norm(x, norm, *wb, 1e-3) for (x, norm), wb in zip(cases, params)]
    _check.assert_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_repeat_calls_with_autograd_through_the_shortcut(monkeypatch):
    """As above where autograd records the calls (weight and bias, bias alone, fp32 parameters of an fp16 input):
    forward and backward through the kept plans."""
    base = torch.randn(4, 6, 10, 18, device=DEVICE)
    calls = [(lambda x, w, b: ops.layer_norm(x, (18,), w, b, 1e-3),
              (base[:, ::2, 3], torch.randn(18), torch.randn(18))),
             (lambda x, w, b: ops.layer_norm(x, (10, 18), w, b), (base[0], torch.randn(10, 18), torch.randn(10, 18))),
             (lambda x, b: ops.layer_norm(x, (18,), None, b), (base[:, :, 0].transpose(0, 1), torch.randn(18))),
             (lambda x, w, b: ops.layer_norm(x, (18,), w, b), (base[0].half(), torch.randn(18), torch.randn(18)))]
    calls = [(fn, tuple(t.to(DEVICE) for t in inputs)) for fn, inputs in calls]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_mixed_precision_params():
    """fp16 input with fp32 weight and bias (torch allows it on the CPU, not on CUDA; its peer here gets the
    parameters cast to the input's dtype): fp16 output, fp32 parameter gradients."""
    leaves = {"x": torch.randn(6, 40, device=DEVICE, dtype=torch.float16), "w": torch.randn(40, device=DEVICE),
              "b": torch.randn(40, device=DEVICE)}
    ref = lambda x, w, b: F.layer_norm(x, [40], w.to(x.dtype), b.to(x.dtype))  # noqa: E731
    check(_ln(ops.layer_norm, [40]), ref, leaves)


def test_partial_gradients_and_no_grad():
    leaves = _leaves((4, 30), 1)  # the gradient of w alone, then of x alone
    check(_ln(ops.layer_norm, [30]), _ln(F.layer_norm, [30]), leaves, constant=("x", "b"))
    check(_ln(ops.layer_norm, [30]), _ln(F.layer_norm, [30]), leaves, constant=("w", "b"))
    with torch.no_grad():
        y = ops.layer_norm(leaves["x"].requires_grad_(), [30], leaves["w"], leaves["b"])
    assert not y.requires_grad


def test_empty_and_large_batch_loop():
    assert ops.layer_norm(torch.randn(0, 8, device=DEVICE), [8]).shape == (0, 8)
    # more row blocks (22 of 32 rows) than backward programs (16 under the interpreter): each program loops
    # over several and sums its partials
    check(_ln(ops.layer_norm, [64]), _ln(F.layer_norm, [64]), _leaves((700, 64), 1))


LOOPED = "dropin.ops.layer_norm"


def _looped_kernels():
    from dropin.ops.layer_norm import _ln_bwd_long_kernel, _ln_bwd_wb_kernel, _ln_fwd_long_kernel
    return _ln_fwd_long_kernel, _ln_bwd_long_kernel, _ln_bwd_wb_kernel


@pytest.mark.parametrize("n", [300, 256])
@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("dtype", _tol.DTYPES)  # (bf16 on the GPU)
def test_long_rows_looped(dtype, weight, bias, n, monkeypatch):
    """Rows longer than the whole-row kernels take (lowered to 64 here) loop over chunks of 64: 300 elements end
    in a partial chunk, 256 in a full one; weight and bias each given or not (their gradients summed per column
    over the rows); 19 rows, more than one step of the column sums."""
    kernels = loop_rows(monkeypatch, LOOPED)
    fwd, bwd, wb = _looped_kernels()
    check(_ln(ops.layer_norm, [n]), _ln(F.layer_norm, [n]), _leaves((19, n), 1, dtype, weight, bias))
    assert kernels == [fwd, bwd] + ([wb] if weight or bias else [])


@pytest.mark.parametrize("view", ["two-dims", "strided-row", "sliced-rows", "copy-needed"])
def test_long_rows_looped_views(view, monkeypatch):
    """The looped kernels read x and dy through their strides: several normalized dims, a strided row, rows of a
    slice, and a view whose normalized dims do not merge (copied)."""
    kernels = loop_rows(monkeypatch, LOOPED)
    base = torch.randn(3, 4, 10, 30, device=DEVICE) * 2 + 0.5
    x, norm = {"two-dims": (base, [10, 30]), "strided-row": (base[..., ::3], [10, 10]),
               "sliced-rows": (base[:, ::2].flatten(2), [300]), "copy-needed": (base.transpose(2, 3), [30, 10])}[view]
    check(_ln(ops.layer_norm, norm), _ln(F.layer_norm, norm),
          {"x": x, "w": torch.randn(norm, device=DEVICE), "b": torch.randn(norm, device=DEVICE)})
    assert kernels == list(_looped_kernels())


def test_long_rows_looped_statistics(monkeypatch):
    """A large mean over a small spread (|mean| / std = 1e3): the looped kernel's variance is centred, no
    E[x^2] - E[x]^2 cancellation (its error here: 3e-2)."""
    loop_rows(monkeypatch, LOOPED)
    check(_ln(ops.layer_norm, [3000]), _ln(F.layer_norm, [3000]), {"x": torch.randn(4, 3000, device=DEVICE) + 1000.0})


def test_long_rows_looped_through_the_shortcut(monkeypatch):
    """Repeat calls of looped rows take the kept shortcuts, with and without autograd."""
    loop_rows(monkeypatch, LOOPED)
    base = torch.randn(4, 6, 100, device=DEVICE)
    w, b = torch.randn(100, device=DEVICE), torch.randn(100, device=DEVICE)
    _check.assert_calls_repeat_through_shortcuts([lambda: ops.layer_norm(base[:, ::2], (100,), w, b)], monkeypatch)
    _check.assert_grad_calls_repeat_through_shortcuts(
        [(lambda x, w, b: ops.layer_norm(x, (6, 100), w, b), (base, w.repeat(6, 1), b.repeat(6, 1))),
         (lambda x, b: ops.layer_norm(x, (100,), None, b), (base.transpose(0, 1), b))], monkeypatch)


@pytest.mark.parametrize("case", ["affine", "no-affine", "bias-only-fp16", "strided-rows", "two-dims-copied"])
def test_registered_ops_looped(case, monkeypatch):
    """`test_registered_ops`' cases through the looped kernels (rows longer than 16 elements here)."""
    kernels = loop_rows(monkeypatch, LOOPED, short=16)
    test_registered_ops(case)
    assert set(kernels) <= set(_looped_kernels()) and kernels


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    chain = lambda ln: lambda x, w, b: ln(ln(x, [20], w, b) * 2, [20], w, None)  # noqa: E731
    check(torch.compile(chain(ops.layer_norm), fullgraph=True), chain(F.layer_norm), _leaves((3, 4, 20), 1))


REGISTERED = {  # id -> (input, normalized dims, weight, bias, the parameters' gradient dtype or None)
    "affine": (lambda: _t(4, 3, 24), 1, lambda: _t(24), lambda: _t(24), torch.float32),
    "no-affine": (lambda: _t(5, 24), 1, lambda: None, lambda: None, None),
    "bias-only-fp16": (lambda: _t(5, 24, dtype=torch.float16), 1, lambda: None,
                       lambda: _t(24, dtype=torch.float16), torch.float16),
    "bf16-fp32-params": (lambda: _t(5, 24, dtype=torch.bfloat16), 1, lambda: _t(24), lambda: None, torch.float32),
    "strided-rows": (lambda: _t(4, 6, 18)[:, ::2], 1, lambda: _t(18), lambda: _t(18), torch.float32),
    "two-dims-copied": (lambda: _t(3, 6, 5).transpose(1, 2), 2, lambda: _t(30), lambda: None, None),
}


@pytest.mark.parametrize("case", REGISTERED)
def test_registered_ops(case):
    """Schema, fake and dynamic-shape tracing of the forward and backward ops (what torch.compile sees): the
    affine combinations, dtypes, a strided view and one that is copied; gradients of x alone and of the
    parameters too."""
    make_x, n_last, make_w, make_b, wb_dtype = REGISTERED[case]
    x, w, b = make_x(), make_w(), make_b()
    _check.opcheck(torch.ops.dropin.layer_norm.default, x, n_last, w, b, 1e-5, True)
    _check.opcheck(torch.ops.dropin.layer_norm.default, x, n_last, w, b, 1e-5, False)
    _, mean, rstd = torch.ops.dropin.layer_norm(x, n_last, w, b, 1e-5, True)
    dy = torch.randn_like(x).transpose(0, -1).contiguous().transpose(0, -1)  # strided as torch may give it
    _check.opcheck(torch.ops.dropin.layer_norm_backward.default, dy, x, n_last, w, mean, rstd, wb_dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 1024, 4096), (64, 3136, 64), (8, 65536), (4096, 768)])
def test_large_gpu(shape, dtype):
    n = shape[-1]
    check(_ln(ops.layer_norm, [n]), _ln(F.layer_norm, [n]), _leaves(shape, 1, dtype))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,n_last", [((4, 64, 56, 56), 3), ((8, 17, 21, 23), 4), ((3, 65537), 1)],
                         ids=["200704", "65688-fuzz", "65537"])
def test_long_rows_gpu(shape, n_last, dtype):
    """Rows longer than the whole-row kernels take (65536), through the looped kernels: a ResNet-sized feature
    map normalized over [C, H, W], the fuzz suite's find, one element past the limit."""
    norm = list(shape[len(shape) - n_last:])
    check(_ln(ops.layer_norm, norm), _ln(F.layer_norm, norm), _leaves(shape, n_last, dtype))


# ----------------------------------------------------------------------------------------- errors
def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


ERRORS = [  # (id, args, error, name in the message, torch also raises)
    ("shape-mismatch", (_t(3, 8), [7]), RuntimeError, "input", True),
    ("input-too-few-dims", (_t(8), [2, 8]), RuntimeError, "input", True),
    ("normalized-empty", (_t(3, 8), []), RuntimeError, "normalized_shape", True),
    ("weight-shape", (_t(3, 8), [8], _t(7)), RuntimeError, "weight", True),
    ("bias-shape", (_t(3, 8), [8], None, _t(2, 4)), RuntimeError, "bias", True),
    ("int-input", (torch.ones(3, 8, dtype=torch.int64), [8]), RuntimeError, "input", True),
    ("float64", (_t(3, 8, dtype=torch.float64), [8]), RuntimeError, "input", False),
    ("not-a-tensor", ([[1.0]], [1]), TypeError, "input", True),
]


@pytest.mark.parametrize("args,error,name,torch_raises", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_errors(args, error, name, torch_raises):
    with pytest.raises(error, match=f"'{name}'"):
        ops.layer_norm(*args)
    if torch_raises:
        with pytest.raises(error):
            F.layer_norm(*args)
