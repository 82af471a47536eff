"""conv2d's memory on outputs of ~2^31 elements (issue 25): every pass's temporary buffers (fp32 partials, padded
copies, tensor descriptors' scratch) stay within planning.WORKSPACE, so that a conv's peak stays within torch's +
256 MiB. On the CPU the passes' traced bodies run on fake tensors with a pretend Hopper, every candidate config
launched, each allocation's lifetime followed; on the GPU one large conv forward and backward against torch's
memory and values. The chunked paths themselves (small WORKSPACE) are checked against F.conv2d."""
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
import triton

import dropin
from _conv2d import check, dropin_conv, leaves, torch_conv
from _tol import INTERPRET, assert_close, gpu, slow

from dropin import _runtime
from dropin.ops import _autotune, _dispatch
from dropin.ops.conv2d import depthwise, implicit_gemm, planning

cv = __import__("dropin.ops.conv2d", fromlist=["_plans"])

SLACK = 256 << 20  # issue 25's bar: dropin's peak <= torch's + 256 MiB
SCRATCH_PER_PROGRAM = 256  # the TMA kernels' two tensor descriptors, Triton's global scratch per program


class _Peak(torch.utils._python_dispatch.TorchDispatchMode):
    """Live bytes of the tensors made inside it (each storage counted once, until it is freed) and their peak; a
    dropin op runs its traced body inside it (its own allocations counted)."""

    def __init__(self, known):
        super().__init__()
        self.live = self.peak = 0
        self.seen = {id(t.untyped_storage()) for t in known}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == "dropin":
            with self:
                return torch._library.custom_ops.OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.seen:
                storage = t.untyped_storage()
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, id(storage), storage.nbytes())
        return out

    def _free(self, key, nbytes):
        self.live -= nbytes
        self.seen.discard(key)


def _workspace(monkeypatch, x_shape, w_shape, channels_last=False, **kw) -> tuple:
    """(the peak bytes beyond the output, its gradient and the input and weight gradients; the largest TMA
    scratch) of one conv forward and backward on fake tensors, a pretend Hopper, every candidate launched."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    scratch = []
    launch = _dispatch.Launch.__call__

    def recording(self, *args):
        if self.scratch:
            scratch.append(math.prod(self.grid) * SCRATCH_PER_PROGRAM)
        return launch(self, *args)

    def every_candidate(name, key, configs, prepare, graph=False):
        for cfg in configs:
            prepare(cfg)()
        return configs[0]
    monkeypatch.setattr(_dispatch.Launch, "__call__", recording)
    monkeypatch.setattr(_autotune, "pick", every_candidate)
    monkeypatch.setattr(_runtime, "is_hopper", lambda device_index=0: True)
    monkeypatch.setattr(_runtime, "num_sms", lambda device_index=0: 132)
    # the registered ops' traced bodies; Dynamo's map of in-graph functions, made once, made first with the real
    # is_compiling (made during the patch it keeps the stand-in, and later compiles fail on is_compiling)
    torch._dynamo.trace_rules.get_torch_obj_rule_map()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with FakeTensorMode():
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        x = torch.empty(x_shape, dtype=torch.bfloat16).to(memory_format=fmt).requires_grad_()
        w = torch.empty(w_shape, dtype=torch.bfloat16).to(memory_format=fmt).requires_grad_()
        peak = _Peak((x, w))
        with peak:
            y = dropin.ops.conv2d(x, w, **kw)
            dy = torch.empty_like(y)
            torch.autograd.backward([y], [dy])
        kept = sum(t.numel() * t.element_size() for t in (y, dy, x.grad, w.grad))
    return peak.peak - kept, max(scratch, default=0)


LARGE = [  # outputs of 2^31 elements, [N, C, 2048, 2048]
    pytest.param((16, 32, 2048, 2048), (32, 32, 3, 3), True, {}, id="3x3-channels_last-tma"),
    pytest.param((64, 32, 2048, 2048), (8, 32, 3, 3), True, {}, id="3x3-8-channels-tma"),
    pytest.param((16, 32, 2048, 2048), (32, 32, 3, 3), False, {}, id="3x3-nchw"),
    pytest.param((16, 32, 2048, 2048), (32, 32, 1, 1), True, {}, id="1x1-gemm"),
    pytest.param((16, 32, 2048, 2048), (32, 1, 3, 3), True, dict(groups=32), id="depthwise-walk"),
    pytest.param((64, 32, 4096, 4096), (32, 1, 3, 3), False, dict(groups=32, stride=2), id="depthwise-stride2"),
    pytest.param((16, 32, 2048, 2048), (32, 1, 5, 5), False, dict(groups=32), id="depthwise-5x5"),
    pytest.param((16, 3, 2048, 2048), (32, 3, 3, 3), True, {}, id="stem"),
]


@pytest.mark.skipif(not INTERPRET, reason="fake tensors through the interpreter's registered ops (CPU)")
@pytest.mark.parametrize("x_shape, w_shape, channels_last, kw", LARGE)
def test_large_conv_workspace_is_bounded(monkeypatch, x_shape, w_shape, channels_last, kw):
    extra, scratch = _workspace(monkeypatch, x_shape, w_shape, channels_last, padding=w_shape[-1] // 2, **kw)
    assert extra <= planning.WORKSPACE, f"temporary buffers of {extra / 2**20:.0f} MiB"
    assert scratch <= planning.WORKSPACE, f"descriptor scratch of {scratch / 2**20:.0f} MiB"
    assert extra + scratch <= SLACK


# ------------------------------------------------------------------ the chunked paths, small WORKSPACE
def test_depthwise_weight_gradient_in_chunks(monkeypatch):
    """The weight gradient's walk in chunks of images: 2 and a rest of 1 (its first config's tile covers the 12 x
    10 image: 9 taps x 8 channels of fp32 partials an image, 288 bytes)."""
    monkeypatch.setattr(depthwise, "WORKSPACE", 2 * 288)
    monkeypatch.setattr(cv, "_plans", {})
    inputs = leaves((3, 8, 12, 10), (8, 1, 3, 3))
    check(dropin_conv(padding=1, groups=8), torch_conv(padding=1, groups=8), inputs)


def test_few_channels_without_the_padded_copy(monkeypatch, true_fp32):
    """A stem whose padded copy would pass WORKSPACE takes _conv_fwd_kernel, reading x in place."""
    monkeypatch.setattr(implicit_gemm, "WORKSPACE", 1)
    monkeypatch.setattr(cv, "_plans", {})
    dims = planning.dims(torch.empty(2, 3, 9, 9), torch.empty(8, 3, 3, 3), (1, 1), (1,) * 4, (1, 1), 1)
    assert not implicit_gemm.rows_fit(dims, 1, (1,) * 4, 4)
    check(dropin_conv(padding=1), torch_conv(padding=1), leaves((2, 3, 9, 9), (8, 3, 3, 3)))


def test_bias_gradient_programs_loop(monkeypatch, true_fp32):
    """The activation's and bias's gradient kernel with fewer programs than pixel tiles (each sums several)."""
    monkeypatch.setattr(planning, "WORKSPACE", 4 * 16 * 2)  # two programs for 16 channels
    monkeypatch.setattr(cv, "_plans", {})
    check(dropin_conv(padding=1, activation="silu"), torch_conv(padding=1, activation="silu"),
          leaves((2, 8, 13, 11), (16, 8, 3, 3)))


@pytest.mark.skipif(not INTERPRET, reason="patches a kernel's global, which the interpreter reads at each run")
def test_weight_gradient_in_shares(monkeypatch, true_fp32):
    """A weight gradient's reduction past _gemm.ACC_K (patched to 128 pixels here): each share in its own
    accumulator, the shares added."""
    monkeypatch.setattr(implicit_gemm, "ACC_K", triton.language.constexpr(128))
    monkeypatch.setattr(cv, "_plans", {})
    check(dropin_conv(padding=1), torch_conv(padding=1), leaves((2, 8, 13, 11), (16, 8, 3, 3)))


# ------------------------------------------------------------------------------ GPU: one large conv
def _peak_of(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, out


@gpu
@slow
@pytest.mark.parametrize("w_shape, channels_last, kw", [
    pytest.param((32, 32, 3, 3), True, {}, id="3x3-channels_last"),
    pytest.param((32, 32, 3, 3), False, {}, id="3x3-nchw"),
    pytest.param((32, 32, 1, 1), True, {}, id="1x1"),
    pytest.param((32, 1, 3, 3), True, dict(groups=32), id="depthwise"),
])
def test_large_conv_on_gpu(w_shape, channels_last, kw):
    """A [16, 32, 2048, 2048] bf16 output (2^31 elements): forward and backward within torch's peak + 256 MiB,
    the first and last images' output and input gradient against F.conv2d of those images alone, the weight
    gradient against its float64 sum over the images, one image at a time (torch's bf16 result as the 2x yardstick:
    a sum of 2^26 products a channel pair)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(16, 32, 2048, 2048, device="cuda", dtype=torch.bfloat16).to(memory_format=fmt)
    w = (torch.randn(w_shape, device="cuda", dtype=torch.bfloat16) / 4).to(memory_format=fmt)
    args = dict(padding=w_shape[-1] // 2, **kw)
    dy = torch.randn(16, 32, 2048, 2048, device="cuda", dtype=torch.bfloat16).to(memory_format=fmt)

    def run(conv):
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = conv(xg, wg, **args)
        y.backward(dy)
        return y.detach(), xg.grad, wg.grad
    torch_peak, (_, _, dw_torch) = _peak_of(lambda: run(F.conv2d))
    dropin_peak, (y, dx, dw) = _peak_of(lambda: run(dropin.ops.conv2d))
    assert dropin_peak <= torch_peak + SLACK, f"dropin {dropin_peak / 2**30:.2f} GiB, torch {torch_peak / 2**30:.2f}"
    for n in (0, 15):
        xn = x[n:n + 1].double().requires_grad_()
        ref = F.conv2d(xn, w.double(), **args)
        ref.backward(dy[n:n + 1].double())
        assert_close(y[n:n + 1], ref, torch.bfloat16, "fwd", what=f"output of image {n}")
        assert_close(dx[n:n + 1], xn.grad, torch.bfloat16, "bwd", what=f"input gradient of image {n}")
    dw_ref = sum(torch.nn.grad.conv2d_weight(x[n:n + 1].double(), w.shape, dy[n:n + 1].double(), **args)
                 for n in range(x.shape[0]))
    assert_close(dw, dw_ref, torch.bfloat16, "bwd", torch_out=dw_torch, what="weight gradient")
