"""`check`: forward and backward of an op with one or several outputs against float64 and PyTorch's own error.

The ops of the LLM blocks (rms_norm, rope, swiglu_mlp) take non-differentiable tensors (cos, sin) and
return tuples ((y, new_residual), (q, k)); this is test_matmul's `check` generalized to both.
"""
import torch

from _tol import DEVICE, assert_close


def poison_allocations(monkeypatch) -> None:
    """From here to the end of the test, torch.empty, torch.empty_like and Tensor.new_empty of a floating
    dtype return NaN-filled tensors: an output element that a kernel fails to write then shows up."""
    def poisoned(allocate):
        def wrapper(*args, **kwargs):
            t = allocate(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return wrapper
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned(torch.Tensor.new_empty))


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def check(op, ref_op, leaves: dict, build=None, backward=True, constant=(), dtype=None, positive=False):
    """Checks op(*build(**leaves)) forward and, with backward, the gradient of every leaf not in `constant`.

    ref_op is the PyTorch peer: run on float64 copies of the leaves it is the reference, run on the leaves
    themselves it gives PyTorch's own error (DESIGN.md's 2x rule). Leaves named in `constant` are cast
    like the others but get no gradient. dtype: the tolerance row (default: the first leaf's dtype).
    Each output gets a random upstream gradient; inputs must come back unmodified. positive: leaves and
    upstream gradients are made positive, for gradients that are a sum of a few numbers (a lone sum of
    random signs can cancel to ~0, where any rounding is a large relative error, PyTorch's too).
    """
    build = build or (lambda **t: tuple(t.values()))
    if positive:
        leaves = {k: v.abs() if v.is_floating_point() else v for k, v in leaves.items()}
    dtype = dtype or next(iter(leaves.values())).dtype
    originals = {k: v.clone() for k, v in leaves.items()}

    def run(fn, cast):
        ins = {k: cast(v).detach().requires_grad_(backward and k not in constant and v.is_floating_point())
               for k, v in leaves.items()}
        return ins, _as_tuple(fn(*build(**ins)))

    ins, outs = run(op, lambda t: t)
    ins_t, outs_t = run(ref_op, lambda t: t)
    ins_64, refs = run(ref_op, lambda t: t.double() if t.is_floating_point() else t)
    for k, v in leaves.items():
        torch.testing.assert_close(v, originals[k], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, k=k: f"the op modified its input '{k}': {m}")
    assert len(outs) == len(refs), f"{len(outs)} outputs, the reference has {len(refs)}"
    for i, (out, out_t, ref) in enumerate(zip(outs, outs_t, refs)):
        assert_close(out, ref, dtype, "fwd", torch_out=out_t, what=f"forward output {i}")
    if not backward:
        return
    names = [k for k in leaves if ins[k].requires_grad]
    grads_in = [torch.randn(ref.shape, device=DEVICE, dtype=out_t.dtype) for ref, out_t in zip(refs, outs_t)]
    if positive:
        grads_in = [g.abs() for g in grads_in]
    for out in outs:
        assert out.requires_grad, "forward output does not require grad: no autograd support"
    grads = torch.autograd.grad(outs, [ins[k] for k in names], grads_in, allow_unused=True)
    grads_t = torch.autograd.grad(outs_t, [ins_t[k] for k in names], grads_in)
    grads_64 = torch.autograd.grad(refs, [ins_64[k] for k in names], [g.double() for g in grads_in])
    for name, g, g_t, g_64 in zip(names, grads, grads_t, grads_64):
        assert g is not None, f"no gradient for '{name}'"
        assert_close(g, g_64, dtype, "bwd", torch_out=g_t, what=f"gradient of '{name}'")
