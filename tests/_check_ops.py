"""`check`: one op against its PyTorch peer, forward and backward, in float64 on the CPU (the reference) and
in the dtype itself on the test device (the 2x rule), for the memory-bound ops (pooling, norms, softmax,
activations)."""
import torch

from _tol import DEVICE, assert_close


def check(op, ref_op, inputs: dict, backward=True, grad_of=None, grad_layout=True):
    """op(*inputs.values()) vs ref_op: forward and the gradient of each input in `grad_of` (default: all) for
    a random upstream gradient in the layout of torch's output; the output and (with grad_layout) the
    gradients keep torch's memory formats. Inputs are used as given (views included), so strided reads are
    exercised."""
    dtype = next(iter(inputs.values())).dtype
    grad_of = list(inputs) if grad_of is None else grad_of

    def run(fn, cast):
        ins = {k: cast(v).detach().requires_grad_(backward and k in grad_of) for k, v in inputs.items()}
        return ins, fn(*ins.values())

    ins, out = run(op, lambda t: t)
    ins_t, out_t = run(ref_op, lambda t: t)
    ins_64, ref_cpu = run(ref_op, lambda t: t.cpu().double())  # torch's CUDA kernels have had bugs of their own
    ref = ref_cpu.to(out.device)
    assert_close(out, ref, dtype, "fwd", torch_out=out_t, what="forward")
    if out.dim() == 4 and out.numel() > 0:
        assert out.is_contiguous(memory_format=torch.channels_last) == \
            out_t.is_contiguous(memory_format=torch.channels_last), "output memory format differs from torch's"
    if not backward:
        return
    grad = torch.randn(ref.shape, device=DEVICE, dtype=dtype)
    if out_t.dim() == 4 and out_t.is_contiguous(memory_format=torch.channels_last):
        grad = grad.contiguous(memory_format=torch.channels_last)  # as a model's next layer gives it
    leaves = lambda d: [d[k] for k in grad_of]  # noqa: E731
    grads = torch.autograd.grad(out, leaves(ins), grad)
    grads_t = torch.autograd.grad(out_t, leaves(ins_t), grad)
    grads_64 = torch.autograd.grad(ref_cpu, leaves(ins_64), grad.cpu().double())
    for name, g, g_t, g_64 in zip(grad_of, grads, grads_t, grads_64):
        assert_close(g, g_64.to(g.device), dtype, "bwd", torch_out=g_t, what=f"gradient of '{name}'")
        dense_t = g_t.is_contiguous() or g_t.is_contiguous(memory_format=torch.channels_last)
        # (torch may give a broadcast view, e.g. after a mean: no layout to match then)
        if grad_layout and g.dim() == 4 and g.numel() > 1 and dense_t:
            assert g.is_contiguous(memory_format=torch.channels_last) == \
                g_t.is_contiguous(memory_format=torch.channels_last), f"gradient of '{name}': not torch's layout"
