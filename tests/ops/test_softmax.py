"""dropin.ops.softmax / log_softmax against torch: forward and backward vs float64 and the 2x rule
(tests/_check.py), rows of 1 to 65536 elements and longer ones through the looped kernels, every dim, strided views
and layouts, repeat calls through the eager shortcut, -inf, errors."""
import pytest
import torch

import _check
import _tol
import dropin.ops as ops
from _check import check
from _looped import loop_rows
from _tol import DEVICE, gpu, slow

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]
OPS = [pytest.param((ops.softmax, torch.softmax), id="softmax"),
       pytest.param((ops.log_softmax, torch.log_softmax), id="log_softmax")]


def _along(fn, dim):
    return lambda x: fn(x, dim)


@pytest.mark.parametrize("fns", OPS)
@pytest.mark.parametrize("n", [1, 7, 33, 128, 1000, 4099])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_lengths(dtype, n, fns):
    # 24 short rows, not 6: the 2x rule compares two rounding errors, and on 42 numbers their ratio has a
    # heavy tail (seed 815640565, n=7: 3.3x, while the median over 400 seeds is 0.72x); on 168 at most 1.9x
    x = torch.randn(3 if n > 1000 else 8, 3, n, dtype=dtype, device=DEVICE) * 3
    check(_along(fns[0], -1), _along(fns[1], -1), {"x": x})


@pytest.mark.parametrize("fns", OPS)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided", "transposed"])
def test_dims_and_layouts(layout, dim, fns):
    """Any dim over NCHW, channels_last, a sliced view and a transposed one (the latter may need a copy)."""
    base = torch.randn(3, 5, 6, 14, device=DEVICE)
    x = {"contiguous": base, "channels_last": base.to(memory_format=torch.channels_last),
         "strided": base[:, 1:, ::2, ::3], "transposed": base.transpose(1, 3)}[layout]
    check(_along(fns[0], dim), _along(fns[1], dim), {"x": x})


def test_repeat_calls_through_the_shortcut(monkeypatch):
    """Repeat calls without autograd on views and along other dims (channels_last, a slice, transposed batch
    dims; a scalar) take the shortcut that the first call of their signature kept, and give what it gave, in its layout
    (the repeat's new allocations NaN-filled: an element left unwritten shows)."""
    base = torch.randn(3, 5, 6, 14, device=DEVICE)
    cases = [(base.to(memory_format=torch.channels_last), 1), (base[:, 1:, ::2, ::3], 3), (base.transpose(0, 1), 0),
             (torch.randn((), device=DEVICE), 0)]
    calls = [lambda x=x, dim=dim, fn=fn: fn(x, dim) for x, dim in cases for fn in (ops.softmax, ops.log_softmax)]
    _check.assert_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_repeat_calls_with_autograd_through_the_shortcut(monkeypatch):
    """As above where autograd records the calls: forward and backward through the kept plans."""
    base = torch.randn(3, 5, 6, 14, device=DEVICE)
    cases = [(base.to(memory_format=torch.channels_last), 1), (base[:, 1:, ::2, ::3], 3), (base.transpose(0, 1), 0)]
    calls = [(lambda x, dim=dim, fn=fn: fn(x, dim), (x,)) for x, dim in cases for fn in (ops.softmax, ops.log_softmax)]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the all -inf row: NaN, as in torch
def test_infinities_and_scalar():
    """-inf entries get probability 0; a row of only -inf gives NaN, as in torch; 0-d input."""
    x = torch.randn(4, 9, device=DEVICE)
    x[0, :4] = float("-inf")
    x[1] = float("-inf")
    x[2, 3] = 80.0  # large logits: no overflow
    for fn, ref in ((ops.softmax, torch.softmax), (ops.log_softmax, torch.log_softmax)):
        torch.testing.assert_close(fn(x, -1), ref(x, -1), equal_nan=True)
        assert fn(torch.tensor(2.0, device=DEVICE), 0).shape == ()
        check(_along(fn, 0), _along(ref, 0), {"x": torch.randn((), device=DEVICE)})


def test_long_rows_and_empty():
    check(_along(ops.softmax, 1), _along(torch.softmax, 1), {"x": torch.randn(2, 65536, device=DEVICE)})
    assert ops.softmax(torch.randn(0, 5, device=DEVICE), -1).shape == (0, 5)


LOOPED = "dropin.ops.softmax"


def _looped_kernels():
    from dropin.ops.softmax import _softmax_bwd_long_kernel, _softmax_fwd_long_kernel
    return [_softmax_fwd_long_kernel, _softmax_bwd_long_kernel]


@pytest.mark.parametrize("fns", OPS)
@pytest.mark.parametrize("n", [300, 256])
@pytest.mark.parametrize("dtype", _tol.DTYPES)  # (bf16 on the GPU)
def test_long_rows_looped(dtype, n, fns, monkeypatch):
    """Rows longer than the whole-row kernels take (lowered to 64 here) loop over chunks of 64: 300 elements end
    in a partial chunk, 256 in a full one."""
    kernels = loop_rows(monkeypatch, LOOPED)
    check(_along(fns[0], -1), _along(fns[1], -1), {"x": torch.randn(6, n, dtype=dtype, device=DEVICE) * 3})
    assert kernels == _looped_kernels()


@pytest.mark.parametrize("fns", OPS)
@pytest.mark.parametrize("dim,layout", [(1, "contiguous"), (2, "contiguous"), (1, "channels_last"),
                                        (2, "strided"), (3, "transposed")])
def test_long_rows_looped_dims(dim, layout, fns, monkeypatch):
    """Looped rows along a dim other than the last (strided rows), over NCHW, channels_last (a unit-stride row),
    a sliced view and a transposed one (copied)."""
    kernels = loop_rows(monkeypatch, LOOPED, short=16)  # (rows longer than 16, in chunks of 16)
    base = torch.randn(35, 40, 2, 2, device=DEVICE).transpose(0, 2)  # [2, 40, 35, 2]
    x = {"contiguous": base.contiguous(), "channels_last": base.contiguous(memory_format=torch.channels_last),
         "strided": base[:, ::2, 1:], "transposed": base.transpose(1, 3)}[layout]
    check(_along(fns[0], dim), _along(fns[1], dim), {"x": x * 3})
    assert kernels == _looped_kernels()


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the all -inf row: NaN, as in torch
def test_long_rows_looped_infinities(monkeypatch):
    """-inf entries (a lane's first chunks all -inf, a whole chunk of them), a row of only -inf (NaN, as in
    torch), large logits."""
    loop_rows(monkeypatch, LOOPED)
    x = torch.randn(4, 300, device=DEVICE)
    x[0, :130] = float("-inf")
    x[1] = float("-inf")
    x[2, 250] = 80.0
    x[3, ::7] = float("-inf")
    for fn, ref in ((ops.softmax, torch.softmax), (ops.log_softmax, torch.log_softmax)):
        torch.testing.assert_close(fn(x, -1), ref(x, -1), equal_nan=True)


def test_long_rows_looped_through_the_shortcut(monkeypatch):
    """Repeat calls of looped rows take the kept shortcuts, with and without autograd."""
    loop_rows(monkeypatch, LOOPED)
    base = torch.randn(3, 100, 5, device=DEVICE)
    calls = [lambda fn=fn: fn(base[:, :, 1:], 1) for fn in (ops.softmax, ops.log_softmax)]
    _check.assert_calls_repeat_through_shortcuts(calls, monkeypatch)
    _check.assert_grad_calls_repeat_through_shortcuts(
        [(lambda x, fn=fn: fn(x, 1), (base,)) for fn in (ops.softmax, ops.log_softmax)], monkeypatch)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("case", ["last-dim-fp32", "middle-dim-fp16", "bf16", "sliced"])
def test_registered_ops_looped(case, log, monkeypatch):
    """`test_registered_ops`' cases through the looped kernels (rows longer than 2 elements here)."""
    kernels = loop_rows(monkeypatch, LOOPED, short=2)
    test_registered_ops(case, log)
    assert kernels and set(kernels) <= set(_looped_kernels())


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    chain = lambda sm, lsm: lambda x: lsm(sm(x, -1) * 4, 1)  # noqa: E731
    check(torch.compile(chain(ops.softmax, ops.log_softmax), fullgraph=True), chain(torch.softmax, torch.log_softmax),
          {"x": torch.randn(3, 6, 10, device=DEVICE)})


REGISTERED = {  # id -> (input, dim)
    "last-dim-fp32": (lambda: torch.randn(4, 3, 20, device=DEVICE), 2),
    "middle-dim-fp16": (lambda: torch.randn(4, 9, 6, device=DEVICE, dtype=torch.float16), 1),
    "bf16": (lambda: torch.randn(6, 33, device=DEVICE, dtype=torch.bfloat16), 1),
    "channels-last": (lambda: torch.randn(2, 5, 3, 4, device=DEVICE).to(memory_format=torch.channels_last), 1),
    "sliced": (lambda: torch.randn(3, 8, 12, device=DEVICE)[:, 1:, ::2], 2),
    "copied": (lambda: torch.randn(3, 5, 6, 14, device=DEVICE).transpose(1, 3), 0),
}


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("case", REGISTERED)
def test_registered_ops(case, log):
    """Schema, fake and dynamic-shape tracing of the forward and backward ops (what torch.compile sees): dtypes,
    dims, strided views and a view whose other dims are copied."""
    make_x, dim = REGISTERED[case]
    x = make_x()
    _check.opcheck(torch.ops.dropin.softmax.default, x, dim, log)
    y = torch.ops.dropin.softmax(x, dim, log)
    _check.opcheck(torch.ops.dropin.softmax_backward.default, torch.randn_like(x), y, dim, log)


@gpu
@pytest.mark.parametrize("fns", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [pytest.param((4, 32, 1024, 1024), marks=slow),
                                   pytest.param((8192, 32000), marks=slow), (64, 65536), (4096, 1)])
def test_large_gpu(shape, dtype, fns):
    check(_along(fns[0], -1), _along(fns[1], -1), {"x": torch.randn(shape, dtype=dtype, device=DEVICE)})


@gpu
@pytest.mark.parametrize("fns", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((2, 131073), 1), ((3, 100000, 4), 1), ((65537,), 0)])
def test_long_rows_gpu(shape, dim, dtype, fns):
    """Rows longer than the whole-row kernels take (65536), through the looped kernels: a 131073-long last dim, a
    100000-long middle dim (strided rows), one row one element past the limit."""
    check(_along(fns[0], dim), _along(fns[1], dim), {"x": torch.randn(shape, dtype=dtype, device=DEVICE) * 3})


ERRORS = [  # (id, args, error, name in the message, torch also raises)
    ("dim-out-of-range", (torch.randn(3, 4, device=DEVICE), 2), IndexError, "dim", True),
    ("dim-negative-out-of-range", (torch.randn(3, 4, device=DEVICE), -3), IndexError, "dim", True),
    ("dim-float", (torch.randn(3, 4, device=DEVICE), 1.0), TypeError, "dim", True),
    ("int-input", (torch.ones(3, 4, dtype=torch.int64, device=DEVICE), 1), RuntimeError, "input", True),
    ("float64", (torch.randn(3, 4, dtype=torch.float64, device=DEVICE), 1), RuntimeError, "input", False),
    ("not-a-tensor", ([1.0, 2.0], 0), TypeError, "input", True),
]


@pytest.mark.parametrize("args,error,name,torch_raises", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_errors(args, error, name, torch_raises):
    for fn, ref in ((ops.softmax, torch.softmax), (ops.log_softmax, torch.log_softmax)):
        with pytest.raises(error, match=f"'{name}'"):
            fn(*args)
        if torch_raises:
            with pytest.raises(error):
                ref(*args)
