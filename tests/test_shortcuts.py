"""Eager shortcuts (`dropin.ops._dispatch.Shortcuts`): a repeat call of a public op, with the signature of an
earlier one, takes the shortcut that the first call kept, and gives what the op's own path gives: every public op
of `dropin bench overhead` (tiny shapes) without autograd, and those with a `Differentiable` where autograd records
the call (outputs and gradients), on new inputs, with poisoned allocations, against torch in float64; and no
shortcut where the call differs (grad wanted where the first call had none, autocast, other arguments or
strides)."""
import gc
import importlib
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dropin
from dropin.bench.overhead import Pair, pairs
from dropin.ops import _dispatch
from _check import found_shortcuts, poison_allocations
from _tol import DEVICE, assert_close, gpu

PAIRS = {p.name: p for p in pairs()}


@pytest.fixture
def taken(monkeypatch):
    """A list that gets, for each `Shortcuts.find` from here on, whether it found a shortcut."""
    return found_shortcuts(monkeypatch)


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _float64(t):
    return t.detach().cpu().double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


@pytest.mark.parametrize("name", list(PAIRS))
def test_repeat_call_takes_the_shortcut(name, taken, monkeypatch):
    pair = PAIRS[name]
    with torch.no_grad():
        first = _tuple(pair.dropin(*pair.make()))
        poison_allocations(monkeypatch)
        inputs = pair.make()
        taken.clear()
        outs = _tuple(pair.dropin(*inputs))
        refs = _tuple(pair.torch(*map(_float64, inputs)))
    assert taken and all(taken), f"{name}: the repeat call took no shortcut ({taken})"
    for out, ref, out_first in zip(outs, refs, first):
        assert_close(out, ref.to(out.device), out.dtype, "fwd", what=f"{name} through its shortcut")
        assert out.stride() == out_first.stride(), f"{name}: the shortcut's output is laid out otherwise"


@pytest.mark.parametrize("name", list(PAIRS))
def test_repeat_call_with_autograd_takes_the_shortcut(name, taken, monkeypatch):
    """The same where autograd records the calls (`_dispatch.Differentiable`): the repeat's outputs and the
    gradients of its first n_grad inputs against torch in float64, its allocations NaN-filled."""
    pair = PAIRS[name]

    def leaves(inputs):
        return [t.detach().requires_grad_(i < pair.n_grad) for i, t in enumerate(inputs)]
    _tuple(pair.dropin(*leaves(pair.make())))
    poison_allocations(monkeypatch)
    inputs = pair.make()
    ours, refs = leaves(inputs), leaves(map(_float64, inputs))
    taken.clear()
    outs = _tuple(pair.dropin(*ours))
    assert taken and all(taken), f"{name}: the repeat call took no shortcut ({taken})"
    ref_outs = _tuple(pair.torch(*refs))
    ups = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, ours[:pair.n_grad], ups)
    ref_grads = torch.autograd.grad(ref_outs, refs[:pair.n_grad], [u.cpu().double() for u in ups])
    for out, ref in zip(outs, ref_outs):
        assert_close(out, ref.to(out.device), out.dtype, "fwd", what=f"{name} through its shortcut")
    for i, (g, ref) in enumerate(zip(grads, ref_grads)):
        assert_close(g, ref.to(g.device), g.dtype, "bwd", what=f"{name}: gradient {i} through its shortcut")


POINTWISE = Pair("conv2d 1x1", lambda: (torch.randn(2, 8, 3, 3, device=DEVICE).to(memory_format=torch.channels_last),
                                        torch.randn(5, 8, 1, 1, device=DEVICE), torch.randn(5, device=DEVICE)),
                 lambda x, w, b: dropin.conv2d(x, w, b, activation="silu"), None, 3)  # (matmul's product)


@pytest.mark.parametrize("name", list(PAIRS) + [POINTWISE.name])
def test_kept_shortcuts_hold_no_tensor(name, taken):
    """A kept shortcut (and its backward plans) holds none of the tensors of the calls that made it: once the
    caller lets go of its inputs, outputs and gradients, they are freed (the caches live as long as the process)."""
    pair = POINTWISE if name == POINTWISE.name else PAIRS[name]
    refs = []
    for _ in range(3):  # the op's own path (keeps the shortcut), then twice through it (a backward plan kept)
        leaves = [t.detach().requires_grad_(i < pair.n_grad) for i, t in enumerate(pair.make())]
        outs = _tuple(pair.dropin(*leaves))
        torch.autograd.grad(outs, leaves[:pair.n_grad], [torch.randn_like(o) for o in outs])
        refs += [weakref.ref(t) for t in (*leaves, *outs, *(o._base for o in outs if o._base is not None))]
        del leaves, outs
    assert taken[-1], f"{name}: the last call took no shortcut"
    gc.collect()
    assert all(ref() is None for ref in refs), f"{name}: a kept shortcut holds a call's tensor"


@pytest.mark.parametrize("name", list(PAIRS) + [POINTWISE.name])
def test_checkpoint_recomputation_through_the_shortcut(name, monkeypatch):
    """torch.utils.checkpoint (use_reentrant=False) compares what a recomputed forward saves with what the first
    forward saved: the first call of a signature runs the op's own path (and keeps the shortcut), the backward's
    recomputation takes the shortcut, which saves the same tensors (count, shapes, dtypes), giving the gradients of
    the call without checkpointing."""
    pair = POINTWISE if name == POINTWISE.name else PAIRS[name]
    inputs = pair.make()
    leaves = [t.detach().requires_grad_(i < pair.n_grad) for i, t in enumerate(inputs)]
    outs = _tuple(pair.dropin(*leaves))
    ups = [torch.randn_like(o) for o in outs]
    want = torch.autograd.grad(outs, leaves[:pair.n_grad], ups)
    from dropin.ops import _dispatch
    find, calls = _dispatch.Shortcuts.find, []

    def first_refused(self, tensors, args):  # (the first find gives the op's own path, which keeps a new shortcut)
        key, run = find(self, tensors, args)
        calls.append(run)
        if len(calls) == 1:
            self._runs.pop(key, None)
            return key, None
        return key, run
    monkeypatch.setattr(_dispatch.Shortcuts, "find", first_refused)
    leaves = [t.detach().requires_grad_(i < pair.n_grad) for i, t in enumerate(inputs)]
    outs = _tuple(checkpoint(pair.dropin, *leaves, use_reentrant=False))
    got = torch.autograd.grad(outs, leaves[:pair.n_grad], ups)
    assert len(calls) == 1 or calls[-1] is not None, f"{name}: the recomputation took no shortcut"  # (1: nothing
    # saved, as average pooling saves: nothing recomputed)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_no_shortcut_where_the_call_differs(taken):
    x, w, b = (torch.randn(*s, device=DEVICE) for s in ((2, 8, 6, 6), (8, 8, 3, 3), (8,)))
    with torch.no_grad():
        dropin.conv2d(x, w, b, padding=1)
        taken.clear()
        y = dropin.conv2d(x, w, b, padding=1)
        assert taken == [True]
        for args, kwargs in (((x, w, b), dict(padding=(1, 1))), ((x, w, b), dict(padding=1.0)),
                             ((x, w, b), dict(padding=1, activation="relu")),
                             ((x.contiguous(memory_format=torch.channels_last), w, b), dict(padding=1)),
                             ((x, w, None), dict(padding=1))):
            taken.clear()
            try:
                dropin.conv2d(*args, **kwargs)
            except (TypeError, RuntimeError, ValueError):
                pass  # (padding=1.0: the op's own checks reject it)
            assert taken == [False], f"a shortcut for {kwargs}"
    taken.clear()
    w.requires_grad_(True)
    y_grad = dropin.conv2d(x, w, b, padding=1)
    assert taken == [False] and y_grad.requires_grad, "a no-grad call's shortcut where autograd records the call"
    with torch.no_grad():
        taken.clear()
        dropin.conv2d(x, w, b, padding=1)
        assert taken == [True], "a parameter's requires_grad kept the shortcut out under no_grad"
    torch.testing.assert_close(y_grad.detach(), y)


OPS_TF32 = {  # (op, its inputs, the module holding its shortcuts, the backend whose allow_tf32 it follows)
    "matmul": (dropin.matmul, ((24, 300), (300, 40)), "dropin.ops.matmul", torch.backends.cuda.matmul),
    "linear": (dropin.linear, ((24, 300), (40, 300)), "dropin.ops.matmul", torch.backends.cuda.matmul),
    "conv2d": (lambda x, w: dropin.conv2d(x, w, padding=1), ((2, 32, 9, 9), (40, 32, 3, 3)), "dropin.ops.conv2d",
               torch.backends.cudnn),  # (GPU: under the interpreter convolutions take no TF32)
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=gpu) if n == "conv2d" else n for n in OPS_TF32])
def test_float32_shortcut_follows_the_tf32_switch(name, taken, monkeypatch):
    """A float32 call's shortcut is kept for the TF32 setting it was made under: after the switch changes, a
    repeat call gives what a first call under the new setting gives (TF32's operand rounding, or not)."""
    op, shapes, module, backend = OPS_TF32[name]
    x, w = (torch.randn(*s, device=DEVICE) for s in shapes)
    cache = next(v for v in vars(importlib.import_module(module)).values() if isinstance(v, _dispatch.Shortcuts))
    saved, results = backend.allow_tf32, {}
    try:
        with torch.no_grad():
            for tf32 in (False, True):
                backend.allow_tf32 = tf32
                monkeypatch.setattr(cache, "_runs", {})
                results[tf32] = op(x, w)  # (a first call: the op's own path)
            backend.allow_tf32 = False
            monkeypatch.setattr(cache, "_runs", {})
            op(x, w)
            op(x, w)  # (the true-fp32 call's shortcut, kept)
            backend.allow_tf32 = True
            taken.clear()
            repeat = op(x, w)
    finally:
        backend.allow_tf32 = saved
    assert taken == [False], "the true-fp32 call's shortcut served a call with TF32 allowed"
    assert not torch.equal(results[False], results[True]), "TF32 changed nothing: the test cannot fail"
    torch.testing.assert_close(repeat, results[True], rtol=0, atol=0)


def test_no_shortcut_under_autocast(taken):
    x, w = torch.randn(4, 16, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    with torch.no_grad():
        dropin.linear(x, w)
        dropin.linear(x, w)
        taken.clear()
        with torch.autocast(DEVICE, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float16):
            y = dropin.linear(x, w)
    assert taken == [False] and y.dtype != torch.float32, "autocast did not cast: a shortcut took the call"
    assert_close(y, F.linear(x.double(), w.double()), y.dtype, "fwd", what="linear under autocast")


def test_conv2d_out_through_its_shortcut_keeps_the_overlap_check(taken, monkeypatch, true_fp32):
    """conv2d(out=) (CvT's projections write their rows after the class token): a repeat call's shortcut writes
    the given out, and still checks out's addresses (an overlap with an operand raises, as on the first call)."""
    x, w, b = (torch.randn(*s, device=DEVICE) for s in ((2, 8, 6, 6), (8, 8, 3, 3), (8,)))
    rows = torch.randn(2, 1 + 36, 8, device=DEVICE)
    out = rows[:, 1:].unflatten(1, (6, 6)).permute(0, 3, 1, 2)
    with torch.no_grad():
        dropin.conv2d(x, w, b, padding=1, out=out)
        poison_allocations(monkeypatch)
        x.copy_(torch.randn_like(x))
        head = rows[:, :1].clone()
        taken.clear()
        assert dropin.conv2d(x, w, b, padding=1, out=out) is out
        assert taken == [True]
        assert_close(out, F.conv2d(x.double(), w.double(), b.double(), padding=1), x.dtype, "fwd",
                     what="conv2d out= through its shortcut")
        assert torch.equal(rows[:, :1], head), "the shortcut wrote outside out"
        buffer = torch.randn(rows.numel(), device=DEVICE)  # x and out of the same signatures, overlapping
        x_overlapped = buffer[:x.numel()].view(x.shape)
        out_overlapping = buffer.as_strided(out.shape, out.stride(), out.storage_offset())
        taken.clear()
        with pytest.raises(RuntimeError, match="overlaps"):
            dropin.conv2d(x_overlapped, w, b, padding=1, out=out_overlapping)
        assert taken == [True]


@pytest.mark.parametrize("mask_dtype", [None, torch.bool, torch.float32])
def test_attention_decode_step_through_its_shortcut(mask_dtype, taken, monkeypatch):
    """A decoding step (one query over the cache, HF's [B, 1, 1, Lk] mask broadcast over the heads) on a repeat
    call takes its shortcut; a bool mask is read as bytes there too."""
    B, H, HK, Lk, E = 2, 4, 2, 37, 16
    q, k, v = (torch.randn(B, h, n, E, device=DEVICE) for h, n in ((H, 1), (HK, Lk), (HK, Lk)))

    def mask():
        if mask_dtype is None:
            return None
        keep = torch.rand(B, 1, 1, Lk, device=DEVICE) > 0.3
        keep[..., 0] = True
        return keep if mask_dtype == torch.bool else torch.zeros(B, 1, 1, Lk, device=DEVICE).masked_fill(~keep, -1e4)
    with torch.no_grad():
        dropin.attention(q, k, v, mask(), enable_gqa=True)
        poison_allocations(monkeypatch)
        q.copy_(torch.randn_like(q))
        m = mask()
        taken.clear()
        out = dropin.attention(q, k, v, m, enable_gqa=True)
    assert taken == [True]
    ref = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v)),
                                         None if m is None else m if m.dtype == torch.bool else m.double(),
                                         enable_gqa=True)
    assert_close(out, ref, q.dtype, "fwd", what="a decoding step through its shortcut")


def test_replan_drops_the_kept_shortcuts(monkeypatch):
    """A kept shortcut holds its plan's run, so emptying an op's plans alone leaves it in use (a test forcing another
    config for a signature called before would run the old plan); `_check.replan` drops every shortcut too, and the
    next call plans again."""
    from _check import replan

    matmul = importlib.import_module("dropin.ops.matmul")
    a, b = torch.randn(24, 40, device=DEVICE), torch.randn(40, 16, device=DEVICE)
    dropin.matmul(a, b)
    picks = []
    monkeypatch.setattr(_dispatch._autotune, "pick", lambda name, key, configs, prepare, **timing: picks.append(
        name) or configs[0])
    matmul._plans.clear()
    dropin.matmul(a, b)
    assert picks == []
    replan(matmul)
    dropin.matmul(a, b)
    assert picks
