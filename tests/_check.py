"""`check`: an op against its PyTorch peer, forward and backward, in float64 on the CPU (the reference) and in the
test dtype (PyTorch's own error, DESIGN.md's 2x rule), with the memory formats of outputs and gradients.

One helper for every op: several outputs (rms_norm's (y, new_residual), rope's (q, k)), non-differentiable
inputs (cos, sin, a mask), views built from the leaves, torch.autocast. `poison_allocations` makes unwritten
elements show; `replan` makes an op plan again (a test that forces a config).
"""
import contextlib
import functools

import torch

from _tol import DEVICE, ON_GPU, assert_close, tolerance
from dropin.ops import _dispatch

CL = torch.channels_last
# Below this many numbers in the output or in a leaf, a result is a sum of a few terms (`holds_few_numbers`).
FEW = 4


def poison_allocations(monkeypatch) -> None:
    """From here to the end of the test, torch.empty, torch.empty_like, torch.empty_strided and Tensor.new_empty of
    a floating dtype return NaN-filled tensors: an output element that a kernel fails to write then shows up."""
    def poisoned(allocate):
        def wrapper(*args, **kwargs):
            t = allocate(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return wrapper
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    monkeypatch.setattr(torch, "empty_strided", poisoned(torch.empty_strided))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))


def found_shortcuts(monkeypatch) -> list:
    """A list that gets, for each `Shortcuts.find` (dropin.ops._dispatch) from here to the end of the test, whether
    it found a shortcut."""
    from dropin.ops import _dispatch
    found = []
    find = _dispatch.Shortcuts.find

    def spy(self, tensors, args):
        key, run = find(self, tensors, args)
        found.append(run is not None)
        return key, run
    monkeypatch.setattr(_dispatch.Shortcuts, "find", spy)
    return found


def assert_repeats(firsts, agains) -> None:
    """Each repeat call's output equals the first call's, bit for bit, in its layout (a shortcut against the op's
    own path)."""
    for first, again in zip(firsts, agains, strict=True):
        torch.testing.assert_close(again, first, rtol=0, atol=0, equal_nan=True)
        assert again.stride() == first.stride(), "the shortcut's output is laid out otherwise"


def assert_calls_repeat_through_shortcuts(calls, monkeypatch) -> None:
    """Each call, made twice without autograd, takes its signature's shortcut the second time (its allocations
    NaN-filled: an element left unwritten shows) and gives what the first call gave (`assert_repeats`)."""
    with torch.no_grad():
        firsts = [call() for call in calls]
        found = found_shortcuts(monkeypatch)
        poison_allocations(monkeypatch)
        agains = [call() for call in calls]
    assert found == [True] * len(calls)
    assert_repeats(firsts, agains)


def assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch) -> None:
    """Each call fn(*inputs), for (fn, inputs) in calls, made where autograd records it (its floating inputs leaves
    that require grad, in their strides), takes its signature's shortcut (a `Differentiable`) on repeat calls, and
    gives the outputs and gradients that the op's own path gives (found with every shortcut refused), bit for bit
    and in their layouts: upstream gradients contiguous, then with their dims' strides reversed (another backward
    plan), once to keep the shortcuts, then twice through them (a layout's backward plan made, then kept), the
    repeats' new allocations NaN-filled."""
    from dropin.ops import _dispatch

    def run(fn, inputs, reversed_strides):
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        outs = _as_tuple(fn(*leaves))
        gen = torch.Generator(device=outs[0].device).manual_seed(0)
        ups = [torch.randn(o.shape[::-1], generator=gen, dtype=o.dtype, device=o.device).permute(
            *range(o.dim() - 1, -1, -1)) if reversed_strides else
            torch.randn(o.shape, generator=gen, dtype=o.dtype, device=o.device) for o in outs]
        grads = torch.autograd.grad(outs, [t for t in leaves if t.requires_grad], ups)
        return [o.detach() for o in outs] + list(grads)

    with monkeypatch.context() as refused:
        refused.setattr(_dispatch.Shortcuts, "find", lambda self, tensors, args: (None, None))
        refs = [run(fn, inputs, r) for r in (False, True) for fn, inputs in calls]
    for reversed_strides in (False, True):  # (keeps the shortcuts, and those of the public ops a node calls)
        for fn, inputs in calls:
            run(fn, inputs, reversed_strides)
    found = found_shortcuts(monkeypatch)
    poison_allocations(monkeypatch)
    agains = [run(fn, inputs, r) for r in (False, True) for fn, inputs in calls]
    agains_twice = [run(fn, inputs, r) for r in (False, True) for fn, inputs in calls]
    # (every find: an op's own calls of public ops inside its node, swiglu_mlp's linear and matmuls, find theirs)
    assert len(found) >= 4 * len(calls) and all(found), "a repeat call where autograd records it took no shortcut"
    for ref, again, again_twice in zip(refs, agains, agains_twice, strict=True):
        assert_repeats(ref, again)
        assert_repeats(ref, again_twice)


def replan(op_module) -> None:
    """The op module's plans emptied and every kept shortcut dropped (each holds its plan's run): its next calls
    plan again, e.g. with the config a test forces."""
    op_module._plans.clear()
    _dispatch.forget_shortcuts()


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _channels_last(t) -> bool:
    return t.dim() == 4 and t.is_contiguous(memory_format=CL)


def _dense(t) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=CL)


def _leaf_layout(g, leaf) -> bool:
    """Whether g is laid out as its leaf, a permutation of a dense tensor: the layout torch's AccumulateGrad gives
    the leaf's .grad whatever the gradient's (its layout contract). Strides of size-1 dims are free."""
    dims = sorted((leaf.stride(d), leaf.shape[d], g.stride(d)) for d in range(leaf.dim()) if leaf.shape[d] > 1)
    expected = 1
    for stride, size, g_stride in dims:
        if stride != expected or g_stride != stride:
            return False
        expected *= size
    return True


def _assert_layout(rule, what, g, g_t, leaf) -> None:
    """rule "format": a 4-D g has the memory format (NCHW or channels_last) of torch's g_t where that is dense
    (torch may give a broadcast view, e.g. after a mean), or its leaf's layout (what .grad takes: torch's own
    gradients of a batched matmul come in either); "input": g has the strides of its leaf where that is dense;
    "torch": g has g_t's strides. Tensors of at most one element have no layout to match."""
    if g.numel() <= 1:
        return
    if rule == "format":
        if g.dim() == 4 and _dense(g_t) and not _leaf_layout(g, leaf):
            assert _channels_last(g) == _channels_last(g_t), f"{what}: not torch's memory format"
    elif rule == "input":
        if _dense(leaf):
            assert g.stride() == leaf.stride(), f"{what}: not its input's layout"
    else:
        assert rule == "torch", f"unknown layout rule {rule!r}"
        assert g.stride() == g_t.stride(), f"{what}: not torch's layout"


def holds_few_numbers(ref_op, leaves: dict, build=None) -> bool:
    """Whether ref_op(*build(**leaves))'s output or a leaf holds fewer than FEW numbers (found on meta tensors): a
    lone sum of random signs (a 1-element output, the gradient of a 1-element leaf) can cancel to ~0, so `check`
    wants positive=True there."""
    build = build or (lambda **t: tuple(t.values()))
    meta_out = ref_op(*build(**{k: torch.empty_like(v, device="meta") for k, v in leaves.items()}))
    return min(meta_out.numel(), *(v.numel() for v in leaves.values())) < FEW


def check(op, ref_op, leaves: dict, build=None, backward=True, constant=(), dtype=None, positive=False,
          peer=None, upstream_contiguous=False, grad_layout="format", zero_grad_degree=None, autocast=None,
          sources=None, ambiguous=None):
    """Checks op(*build(**leaves)) forward and, with backward, the gradient of every floating leaf not in
    `constant`.

    ref_op run on float64 CPU copies of the leaves is the reference (torch's CUDA kernels have had bugs of
    their own); `peer` (default ref_op) run on the leaves themselves gives PyTorch's own error (the 2x rule).
    - build turns the leaves into the op's arguments (views, etc.); leaves are used as given, views included.
      Leaves in `constant` are cast like the others but get no gradient. The op may return a tuple.
    - dtype: the tolerance row (default: autocast, else the first leaf's dtype).
    - autocast: a dtype; op and peer run under torch.autocast(DEVICE, dtype=autocast) and the reference sees the
      floating leaves rounded to it, as autocast does (outputs and gradients in the dtypes of torch's).
    - Inputs must come back unmodified; a 4-D output must have torch's memory format.
    - Each output requires grad where torch's does (an output of constant leaves alone does not); each that does
      gets a random upstream gradient in torch's output's memory format (as a model's next layer gives it), or
      contiguous with upstream_contiguous.
    - grad_layout: the `_assert_layout` rule for every gradient, or a dict leaf name -> rule; None: unchecked.
    - positive: leaves and upstream gradients are made positive and at least 1/4, for results that are a sum or
      a product of a few numbers (a lone sum of random signs can cancel to ~0, a product of a few small ones
      underflow fp16 (seed 635607544: 3e-8), where any rounding is a large relative error, PyTorch's too).
    - sources: the 2x rule's samples where fewer than the results' distinct values (`_tol.samples_2x`).
    - ambiguous: a function of the float64 leaves (a dict) giving a boolean mask over the first output: the
      elements whose derivative jumps within the rounding of what they are computed from (a fused activation's
      kink), where a result rounded to the dtype, torch's as dropin's, lands on either side by chance. Their
      upstream gradient is 0 (for all three backward passes alike).
    - zero_grad_degree: a gradient that is 0 in exact arithmetic (its reference at most 1e-12 * scale, with
      scale = max |upstream gradient| * max |differentiated leaf| ** zero_grad_degree) must be rounding-small
      (at most the backward tolerance * scale), as no relative error applies. A gradient whose float64 reference
      is exactly 0 everywhere is held to the same bound (degree 1 where none is given): float64's own rounding
      can make it so (tanh of a pre-activation of 33 rounds to 1, its derivative 1 - 1^2 to 0; a kernel computing
      the derivative as 4 e^-2|z| / (1 + e^-2|z|)^2 gives the true ~1e-28).
    """
    build = build or (lambda **t: tuple(t.values()))
    if positive:
        leaves = {k: v.abs().clamp_min(0.25) if v.is_floating_point() else v for k, v in leaves.items()}
    dtype = dtype or autocast or next(iter(leaves.values())).dtype
    originals = {k: v.clone() for k, v in leaves.items()}

    def run(fn, cast, amp=False):
        ins = {k: cast(v).detach().requires_grad_(backward and k not in constant and v.is_floating_point())
               for k, v in leaves.items()}
        with torch.autocast(DEVICE, dtype=autocast) if amp else contextlib.nullcontext():
            return ins, _as_tuple(fn(*build(**ins)))

    def to_reference(t):  # (contiguous: the value is layout-free, and torch's CPU float64 kernels have layout
        # bugs: conv2d's weight gradient for an input [1, 4, 1, 2] of strides (8, 1, 4, 4), groups 2, is wrong)
        if not t.is_floating_point():
            return t.cpu().contiguous()
        return (t.to(autocast) if autocast else t).cpu().double().contiguous()

    ins, outs = run(op, lambda t: t, amp=autocast is not None)
    _synchronize("dropin's forward")
    ins_t, outs_t = run(peer or ref_op, lambda t: t, amp=autocast is not None)
    _synchronize("torch's forward (the peer)")
    ins_64, refs = run(ref_op, to_reference)
    for k, v in leaves.items():
        torch.testing.assert_close(v, originals[k], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, k=k: f"the op modified its input '{k}': {m}")
    assert len(outs) == len(refs), f"{len(outs)} outputs, the reference has {len(refs)}"
    for i, (out, out_t, ref) in enumerate(zip(outs, outs_t, refs)):
        what = "forward" if len(outs) == 1 else f"forward output {i}"
        assert_close(out, ref.to(out.device), dtype, "fwd", torch_out=out_t, what=what, sources=sources)
        # (where torch's output lies in neither memory format, e.g. its batch innermost after a transposed operand,
        # or in both, its size-1 dims making them one, there is no format to follow)
        one_format = _dense(out_t) and not (out_t.is_contiguous() and _channels_last(out_t))
        if out.dim() == 4 and out.numel() > 0 and one_format:
            assert _channels_last(out) == _channels_last(out_t), f"{what}: memory format differs from torch's"
    if not backward:
        return
    names = [k for k in leaves if ins[k].requires_grad]
    for i, (out, out_t) in enumerate(zip(outs, outs_t)):  # (an output of constants alone does not, in torch)
        assert out.requires_grad == out_t.requires_grad, \
            f"output {i}: requires_grad {out.requires_grad}, torch's {out_t.requires_grad}"
    assert any(out.requires_grad for out in outs), "no output requires grad: no autograd support"
    live = [i for i, out in enumerate(outs) if out.requires_grad]
    outs, outs_t, refs = ([t[i] for i in live] for t in (outs, outs_t, refs))
    grads_in = [torch.randn(ref.shape, device=DEVICE, dtype=out_t.dtype) for ref, out_t in zip(refs, outs_t)]
    if positive:
        grads_in = [g.abs().clamp_min(0.25) for g in grads_in]
    if ambiguous is not None:
        grads_in[0] = grads_in[0].masked_fill(ambiguous({k: v.detach() for k, v in ins_64.items()}).to(DEVICE), 0)
    if not upstream_contiguous:
        grads_in = [g.contiguous(memory_format=CL) if _channels_last(o) else g for g, o in zip(grads_in, outs_t)]
    grads = torch.autograd.grad(outs, [ins[k] for k in names], grads_in, allow_unused=True)
    _synchronize("dropin's backward")
    grads_t = torch.autograd.grad(outs_t, [ins_t[k] for k in names], grads_in)
    _synchronize("torch's backward (the peer)")
    grads_64 = torch.autograd.grad(refs, [ins_64[k] for k in names], [g.cpu().double() for g in grads_in])
    degree = 1 if zero_grad_degree is None else zero_grad_degree

    @functools.cache
    def scale() -> float:  # (made where a zero reference needs it: its `.item()`s wait for the device)
        return (max((g.abs().max().item() for g in grads_in if g.numel()), default=0.0)
                * max((leaves[k].abs().max().item() for k in names if leaves[k].numel()), default=0.0) ** degree)
    layouts = grad_layout if isinstance(grad_layout, dict) else dict.fromkeys(names, grad_layout)
    for name, g, g_t, g_64 in zip(names, grads, grads_t, grads_64):
        what = f"gradient of '{name}'"
        assert g is not None, f"no gradient for '{name}'"
        zero_reference = g_64.numel() and (not g_64.any() if zero_grad_degree is None
                                           else g_64.abs().max() <= 1e-12 * scale())
        if zero_reference:
            assert g.abs().max() <= tolerance(dtype, "bwd") * scale(), f"{what}: not ~0 (its reference is)"
        else:
            assert_close(g, g_64.to(g.device), dtype, "bwd", torch_out=g_t, what=what, sources=sources)
        if layouts.get(name):
            _assert_layout(layouts[name], what, g, g_t, leaves[name])


def _synchronize(what: str) -> None:
    """On the GPU, waits for the kernels launched so far: an asynchronous CUDA error (a misaligned or illegal
    address) is raised here, naming `what` ran it, and not at a later call, where a fuzz run would report the
    case after the faulty one."""
    if ON_GPU:
        try:
            torch.cuda.synchronize()
        except RuntimeError as error:
            raise RuntimeError(f"CUDA error in {what}: {error}") from error


def opcheck(op, *args, **kwargs) -> None:
    """torch.library.opcheck of a registered dropin op (e.g. torch.ops.dropin.rms_norm_fwd.default) on these
    arguments: its schema, its fake (the traced impl run on tensors without data: what torch.compile sees) against
    the real outputs' metadata, and tracing it with dynamic shapes. Arguments that require grad are detached: the
    ops are differentiated by their autograd.Functions, not registered formulas."""
    def detached(a):
        return a.detach() if isinstance(a, torch.Tensor) else a
    args = tuple(detached(a) for a in args)
    kwargs = {k: detached(v) for k, v in kwargs.items()}
    torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
