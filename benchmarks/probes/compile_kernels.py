"""Probe: how torch.compile (default, reduce-overhead, dynamic) treats Triton kernels registered with
torch.library.triton_op, for the three kinds of kernel dropin has: pointer loads, tensor descriptors built on the
device (tl.make_tensor_descriptor: global scratch) and host-side TensorDescriptor arguments; inside an
autograd.Function too. Also the host cost of a launch by each path. Usage: PYTHONPATH=src python3 <this file>"""
import time
import traceback

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def ptr_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


@triton.jit
def dev_desc_kernel(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    xd = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    yd = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    m, n = tl.program_id(0) * BM, tl.program_id(1) * BN
    yd.store([m, n], xd.load([m, n]) * 2)


@triton.jit
def host_desc_kernel(xd, yd, BM: tl.constexpr, BN: tl.constexpr):
    m, n = tl.program_id(0) * BM, tl.program_id(1) * BN
    yd.store([m, n], xd.load([m, n]) * 2)


def cdiv(a, b):
    return (a + b - 1) // b


@triton_op("probe::ptr", mutates_args=())
def ptr_op(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    block = 1024 if n > 4096 else 128  # a config chosen from the shape (a guard under dynamic shapes)
    wrap_triton(ptr_kernel)[(cdiv(n, block),)](x, y, n, BLOCK=block)
    return y


def _hint(n):
    return n.node.hint if isinstance(n, torch.SymInt) else n


@triton_op("probe::ptr_hint", mutates_args=())
def ptr_hint_op(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    n = x.numel()
    block = 1024 if _hint(n) > 4096 else 128  # the same choice from the size hint: no guard
    wrap_triton(ptr_kernel)[(cdiv(n, block),)](x, y, n, BLOCK=block)
    return y


@triton_op("probe::dev_desc", mutates_args=())
def dev_desc_op(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    M, N = x.shape
    wrap_triton(dev_desc_kernel)[(cdiv(M, 64), cdiv(N, 64))](x, y, M, N, BM=64, BN=64)
    return y


@triton_op("probe::host_desc", mutates_args=())
def host_desc_op(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    M, N = x.shape
    xd = TensorDescriptor(x, list(x.shape), list(x.stride()), [64, 64])
    yd = TensorDescriptor(y, list(y.shape), list(y.stride()), [64, 64])
    wrap_triton(host_desc_kernel)[(cdiv(M, 64), cdiv(N, 64))](xd, yd, BM=64, BN=64)
    return y


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return ptr_op(x)

    @staticmethod
    def backward(ctx, g):
        return ptr_op(g)


def try_(label, fn):
    try:
        out = fn()
        print(f"OK    {label}: {out}")
    except Exception as e:  # noqa: BLE001
        print(f"FAIL  {label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        traceback.print_exc(limit=3)


def check(op, x):
    return float((op(x) - 2 * x).abs().max())


def modes(name, op, shape):
    x = torch.randn(*shape, device="cuda")
    try_(f"{name} eager", lambda: check(op, x))
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        f = torch.compile(lambda t: op(t) + 1, fullgraph=True, mode=mode)

        def run():
            errs = [float((f(x) - (2 * x + 1)).abs().max()) for _ in range(3)]
            return max(errs)
        try_(f"{name} compile {mode}", run)


def dynamic(name, op):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    f = torch.compile(lambda t: op(t) + 1, fullgraph=True, dynamic=True)

    def run():
        errs = []
        for n in (1000, 3000, 5000, 9000, 20000):
            x = torch.randn(n, device="cuda")
            errs.append(float((f(x) - (2 * x + 1)).abs().max()))
        return f"max err {max(errs)}, frames compiled {counters['stats']['unique_graphs']}"
    try_(f"{name} dynamic sizes 1000..20000", run)


def grad_modes():
    x = torch.randn(4096, device="cuda", requires_grad=True)
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        f = torch.compile(lambda t: Twice.apply(t).sum(), fullgraph=True, mode=mode)

        def run():
            for _ in range(3):
                x.grad = None
                f(x).backward()
            return float((x.grad - 2).abs().max())
        try_(f"autograd.Function(triton_op) fwd+bwd {mode}", run)


def host_cost():
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    k = ptr_kernel[(8,)](x, y, 1024, BLOCK=128)
    fn = k.function
    from dropin._runtime import Launcher
    launcher = Launcher(ptr_kernel, (8,), dict(BLOCK=128))
    launcher(x, y, 1024)
    stream = torch.cuda.current_stream().cuda_stream

    def per_call(f, n=20000):
        for _ in range(200):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            f()
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return round(dt / n * 1e6, 2)

    rows = {
        "kernel[grid](...)": lambda: ptr_kernel[(8,)](x, y, 1024, BLOCK=128),
        "dropin Launcher": lambda: launcher(x, y, 1024),
        "compiled.run direct": lambda: k.run(8, 1, 1, stream, fn, k.packed_metadata, None, None, None, x, y, 1024),
        "torch.empty_like": lambda: torch.empty_like(x),
        "torch.add": lambda: torch.add(x, x),
        "torch.mul scalar": lambda: x * 2,
        "ptr_op (triton_op eager)": lambda: ptr_op(x),
        "torch.is_grad_enabled": torch.is_grad_enabled,
        "torch.compiler.is_compiling": torch.compiler.is_compiling,
        "key of 3 tensors": lambda: tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in (x, y, x)),
    }
    for name, f in rows.items():
        try_(f"host us/call {name}", lambda f=f: per_call(f))


if __name__ == "__main__":
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    modes("pointer kernel", ptr_op, (5000,))
    modes("device descriptors", dev_desc_op, (256, 192))
    modes("host TensorDescriptor", host_desc_op, (256, 192))
    dynamic("config from the shape", ptr_op)
    dynamic("config from the size hint", ptr_hint_op)
    grad_modes()
    host_cost()
