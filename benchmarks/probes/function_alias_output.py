"""Which outputs of a torch.autograd.Function lose their gradient under torch.compile? An output that is `.to()`'s
no-op alias of the forward's result (fp32 to fp32) gets zero gradients on torch 2.11 (aot_eager and inductor, CPU
and CUDA; right on 2.14), which made dropin's fused linear + cross-entropy train nothing when compiled. Prints the
gradient's norm, eager and compiled, for each way of returning the result. Usage: python function_alias_output.py
[cpu|cuda]."""
import sys

import torch

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
RETURNS = {  # how the forward hands back its result `out` (fp32)
    "out": lambda out: out,
    "out.to(float32)": lambda out: out.to(torch.float32),
    "out.to(bfloat16)": lambda out: out.to(torch.bfloat16),
    "out.contiguous()": lambda out: out.contiguous(),
    "out.view_as(out)": lambda out: out.view_as(out),
    "out.reshape(())": lambda out: out.reshape(()),
    "out.clone()": lambda out: out.clone(),
}


def function(give):
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return give((x * x).sum())

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    return lambda x: Square.apply(x).float() * 3


print(torch.__version__, device)
for name, give in RETURNS.items():
    fn = function(give)
    x = torch.randn(8, 4, device=device, requires_grad=True)
    grads = [torch.autograd.grad(f(x), x)[0].norm().item()
             for f in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True))]
    print(f"{name:20s} gradient norm eager {grads[0]:.4f}  compiled {grads[1]:.4f}"
          + ("" if abs(grads[0] - grads[1]) < 1e-4 * grads[0] else "  WRONG"))
