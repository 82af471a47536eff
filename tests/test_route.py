"""dropin.use() / enable() / disable(): functional code routed to dropin's ops where supported, counted; everything
else (and everything after disable()) runs torch's own functions."""
import pathlib
import re
import threading

import pytest
import torch
import torch.nn.functional as F

import dropin
from dropin import route
from _check import check
from _tol import DEVICE, assert_close, gpu


@pytest.fixture(autouse=True)
def fresh_counts(true_fp32):
    """Each test starts with the route off and its counters at zero, and leaves it off; float32 is true fp32
    (the tolerance table's float32 row; cuDNN's convolutions default to TF32)."""
    assert not route.enabled()
    dropin.route_report(reset=True)
    yield
    route.disable()


def rand(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, dtype=dtype, device=device)


def under_route(fn):
    def routed(*args):
        with dropin.use():
            return fn(*args)
    return routed


def assert_counts(routed: dict) -> None:
    """The route counted exactly these routed calls (name -> calls) and no fallback."""
    report = dropin.route_report()
    assert report.fallbacks == {}, f"calls fell back to torch:\n{report}"
    assert report.routed == routed, f"\n{report}"


# --- Models written with functional calls only: outputs and gradients against float64, every call routed ---------

def mlp(x, w1, b1, w2, w3):
    h = F.gelu(F.linear(x, w1, b1), approximate="tanh")
    h = F.silu(h @ w2)
    return F.layer_norm(F.gelu(torch.matmul(h, w3)), (8,))


def convnet(x, w1, b1, w2, mean, var, w3, b3):
    h = F.max_pool2d(F.relu(F.conv2d(x, w1, b1, padding=1)), 2)
    h = F.relu6(F.batch_norm(F.conv2d(h, w2, stride=2, padding=1, groups=2), mean, var))
    return F.linear(F.adaptive_avg_pool2d(h, 1).flatten(1), w3, b3)


def attention(x, g, wqkv, wo):
    h = F.rms_norm(x, (32,), g, 1e-6)
    q, k, v = F.linear(h, wqkv).view(2, 8, 3, 2, 16).permute(2, 0, 3, 1, 4)  # 3 x [B, H, L, E]
    flash = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    explicit = torch.softmax((q @ k.mT) * 0.25, dim=-1) @ v
    return x + F.linear((flash + explicit).transpose(1, 2).reshape(2, 8, 32), wo)


@pytest.mark.parametrize("model, leaves, constant, routed", [
    pytest.param(mlp, lambda: dict(x=rand(6, 16), w1=rand(32, 16) / 4, b1=rand(32), w2=rand(32, 24) / 6,
                                   w3=rand(24, 8) / 5),
                 (), {"F.linear": 1, "F.gelu": 2, "F.silu": 1, "matmul / @": 2, "F.layer_norm": 1}, id="mlp"),
    pytest.param(convnet, lambda: dict(x=rand(2, 4, 8, 8), w1=rand(8, 4, 3, 3), b1=rand(8), w2=rand(8, 4, 3, 3),
                                       mean=rand(8), var=rand(8).abs() + 0.5, w3=rand(5, 8), b3=rand(5)),
                 ("mean", "var"), {"F.conv2d": 2, "relu": 1, "F.max_pool2d": 1, "F.batch_norm": 1, "F.relu6": 1,
                                   "F.adaptive_avg_pool2d": 1, "F.linear": 1}, id="convnet"),
    pytest.param(attention, lambda: dict(x=rand(2, 8, 32), g=rand(32), wqkv=rand(96, 32) / 4, wo=rand(32, 32)),
                 (), {"F.rms_norm": 1, "F.linear": 2, "F.scaled_dot_product_attention": 1, "matmul / @": 2,
                      "softmax": 1}, id="attention"),
])
def test_functional_model_routed(model, leaves, constant, routed):
    check(under_route(model), model, leaves(), constant=constant, grad_layout=None)
    assert_counts(routed)  # (check's backward ran outside the route: counted nothing)


def test_backward_under_the_route_is_not_routed():
    """A backward started under the route runs unrouted (dropin's own backward calls are not re-routed); the
    gradients are autograd's through dropin's ops."""
    leaves = [t.requires_grad_() for t in (rand(6, 16), rand(32, 16) / 4, rand(32), rand(32, 24) / 6, rand(24, 8) / 5)]
    upstream = rand(6, 8)
    with dropin.use():
        out = mlp(*leaves)
        counts = dropin.route_report().routed
        grads = torch.autograd.grad(out, leaves[:2], upstream)
    assert sum(counts.values()) == 7
    assert_counts(counts)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    refs = torch.autograd.grad(mlp(*ref_leaves), ref_leaves[:2], upstream.double())
    for g, ref in zip(grads, refs):
        assert_close(g, ref, torch.float32, "bwd")


# --- Each routed function once, in each of its spellings -------------------------------------------------------

ROUTED_CALLS = {  # id: (route name, call, leaves)
    "torch.mm": ("mm", torch.mm, lambda: (rand(5, 7), rand(7, 3))),
    "Tensor.mm": ("mm", torch.Tensor.mm, lambda: (rand(5, 7), rand(7, 3))),
    "torch.bmm": ("bmm", torch.bmm, lambda: (rand(2, 5, 7), rand(2, 7, 3))),
    "Tensor.bmm": ("bmm", torch.Tensor.bmm, lambda: (rand(2, 5, 7), rand(2, 7, 3))),
    "matmul-broadcast": ("matmul / @", torch.matmul, lambda: (rand(2, 1, 5, 7), rand(3, 7, 4))),
    "matmul-vector": ("matmul / @", lambda a, b: a @ b, lambda: (rand(7), rand(2, 7, 3))),
    "conv2d-same-dilated": ("F.conv2d", lambda x, w: F.conv2d(x, w, padding="same", dilation=2),
                            lambda: (rand(2, 3, 9, 9), rand(4, 3, 3, 3))),
    "conv1d-strided-groups": ("F.conv1d", lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1, groups=2),
                              lambda: (rand(2, 4, 11), rand(6, 2, 3), rand(6))),
    "F.group_norm-affine": ("F.group_norm", lambda x, w, b: F.group_norm(x, 2, w, b, 1e-3),
                            lambda: (rand(2, 6, 5, 3), rand(6), rand(6))),
    "F.softmax-fp16-dtype": ("F.softmax", lambda x: F.softmax(x, dim=0, dtype=torch.float32),
                             lambda: (rand(5, 7, dtype=torch.float16),)),
    "Tensor.softmax": ("softmax", lambda x: x.softmax(1), lambda: (rand(5, 7),)),
    "torch.log_softmax": ("log_softmax", lambda x: torch.log_softmax(x, -1), lambda: (rand(5, 7),)),
    "Tensor.log_softmax": ("log_softmax", lambda x: x.log_softmax(0), lambda: (rand(5, 7),)),
    "F.log_softmax": ("F.log_softmax", lambda x: F.log_softmax(x, 1), lambda: (rand(5, 7),)),
    "F.relu": ("relu", F.relu, lambda: (rand(5, 7),)),
    "Tensor.relu": ("relu", torch.Tensor.relu, lambda: (rand(5, 7),)),
    "F.gelu": ("F.gelu", F.gelu, lambda: (rand(5, 7),)),
    "F.avg_pool2d": ("F.avg_pool2d", lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                     lambda: (rand(2, 3, 7, 7),)),
    "F.layer_norm-affine": ("F.layer_norm", lambda x, w, b: F.layer_norm(x, (4, 6), w, b, 1e-3),
                            lambda: (rand(3, 4, 6), rand(4, 6), rand(4, 6))),
    "F.rms_norm-default-eps": ("F.rms_norm", lambda x, w: F.rms_norm(x, [6], w), lambda: (rand(3, 6), rand(6))),
}


@pytest.mark.parametrize("case", ROUTED_CALLS)
def test_each_function_routed(case):
    name, call, leaves = ROUTED_CALLS[case]
    check(under_route(call), call, {f"t{i}": t for i, t in enumerate(leaves())}, grad_layout=None)
    assert_counts({name: 1})


# --- What dropin does not support stays torch, counted with its reason -----------------------------------------

class Tagged(torch.Tensor):
    """A tensor subclass (e.g. DTensor's kind): its calls stay torch."""


FALLBACKS = {  # id: (route name, reason, call, its arguments)
    "float64": ("F.gelu", "dtype float64 unsupported", F.gelu, lambda: (rand(4, 8, dtype=torch.float64),)),
    "int64": ("relu", "dtype int64 unsupported", torch.relu,
              lambda: (torch.arange(-3, 3, dtype=torch.int64, device=DEVICE),)),
    "subclass": ("F.gelu", "tensor subclass Tagged", F.gelu, lambda: (rand(4, 8).as_subclass(Tagged),)),
    "inplace": ("relu", "argument inplace=True unsupported", lambda x: F.relu(x, inplace=True), lambda: (rand(4, 8),)),
    "implicit-dim": ("F.softmax", "argument dim=None unsupported", F.softmax, lambda: (rand(4, 8),)),
    "out": ("matmul / @", "kwarg out", lambda a, b, c: torch.matmul(a, b, out=c),
            lambda: (rand(4, 8), rand(8, 2), rand(4, 2))),
    "dropout": ("F.scaled_dot_product_attention", "argument dropout_p=0.5 unsupported",
                lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5), lambda: (rand(1, 2, 4, 8),)),
    "rms_norm-no-weight": ("F.rms_norm", "argument weight=None unsupported", lambda x: F.rms_norm(x, [8]),
                           lambda: (rand(4, 8),)),
    "rms_norm-mixed": ("F.rms_norm", "argument weight dtype=torch.float16 unsupported",
                       lambda x, w: F.rms_norm(x, [8], w), lambda: (rand(4, 8), rand(8, dtype=torch.float16))),
    "refused-by-dropin": ("F.scaled_dot_product_attention", "dropin: attention: argument 'v' has head dim 16; dropin "
                          "needs the head dim of 'q'", lambda q, v: F.scaled_dot_product_attention(q, q, v),
                          lambda: (rand(1, 2, 4, 8), rand(1, 2, 4, 16))),
}


@pytest.mark.filterwarnings("ignore:Implicit dimension choice")  # (torch's, for F.softmax without dim)
@pytest.mark.parametrize("case", FALLBACKS)
def test_unsupported_call_runs_torch_and_is_counted(case):
    name, reason, call, arguments = FALLBACKS[case]
    args = arguments()
    torch.manual_seed(0)
    expected = call(*[a.clone() for a in args])
    torch.manual_seed(0)
    with dropin.use():
        out = call(*args)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # torch's own kernel: bit for bit
    report = dropin.route_report()
    assert report.routed == {}
    [(counted_name, counted_reason)] = report.fallbacks
    assert counted_name == name and counted_reason.startswith(reason), counted_reason
    assert f"fallback         1  {counted_reason}" in str(report)


def test_tensors_off_the_kernel_device_stay_torch(monkeypatch):
    """CPU tensors on a GPU machine (here: the kernels' device made 'cuda' on the interpreter's CPU)."""
    if DEVICE == "cpu":
        monkeypatch.setattr(route._runtime, "KERNEL_DEVICE", "cuda")
    x = rand(4, 8, device="cpu")
    with dropin.use():
        out = F.gelu(x)
    assert torch.equal(out, F.gelu(x))
    assert dropin.route_report().fallbacks == {("F.gelu", "cpu tensor"): 1}


def test_wrong_calls_raise_torchs_own_error():
    a, b = rand(2, 3, 4), rand(5, 6)
    for call in (lambda: torch.mm(a, b), lambda: F.linear(a, b)):
        with pytest.raises(RuntimeError) as torch_error:
            call()
        with dropin.use(), pytest.raises(RuntimeError) as routed_error:
            call()
        assert str(routed_error.value) == str(torch_error.value)
    (mm, mm_reason), (linear, linear_reason) = sorted(dropin.route_report().fallbacks, reverse=True)
    assert (mm, mm_reason) == ("mm", "argument dims=(3, 2) unsupported")
    assert linear == "F.linear" and linear_reason.startswith("dropin: linear:")  # (dropin's check refused it)


# --- The switches: off by default, idempotent, nested, exceptions, threads, no trace after -----------------------

def modes():
    return list(torch.overrides._get_current_function_mode_stack())


def test_switches_nest_and_leave_no_trace():
    x = rand(4, 8)
    torch_out = F.gelu(x)
    assert modes() == []
    route.disable()  # off already: nothing
    dropin.enable()
    dropin.enable()  # on already: nothing (one mode, not two)
    assert len(modes()) == 1 and route.enabled()
    with dropin.use():  # inside enable(): leaves it on
        assert len(modes()) == 1
    assert route.enabled()
    F.gelu(x)
    dropin.disable()
    assert modes() == [] and not route.enabled()
    with pytest.raises(ValueError, match="inside"):
        with dropin.use():
            with dropin.use():
                F.gelu(x)
            assert route.enabled()
            raise ValueError("inside")
    assert modes() == [] and not route.enabled()
    assert dropin.route_report().routed == {"F.gelu": 2}
    out = F.gelu(x)  # after disable() and use(): torch's own function, uncounted
    assert torch.equal(out, torch_out)
    assert dropin.route_report().routed == {"F.gelu": 2}


def test_disable_under_a_later_mode_raises():
    dropin.enable()
    with torch.overrides.TorchFunctionMode():
        with pytest.raises(RuntimeError, match="exit it first"):
            dropin.disable()
        assert route.enabled()
    dropin.disable()
    assert modes() == []


def test_route_is_per_thread():
    x = rand(4, 8)
    seen = {}

    def other_thread():
        seen["enabled"] = route.enabled()
        F.gelu(x)  # not routed: the route is the main thread's
        with dropin.use():  # routed: this thread's own
            F.gelu(x)
        seen["after"] = route.enabled()

    with dropin.use():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert route.enabled()
    assert seen == {"enabled": False, "after": False}
    assert dropin.route_report().routed == {"F.gelu": 1}


def test_composes_with_inject():
    """An injected model's dropin modules run as before; functional calls in its own forward are routed."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(x)))

    model = Block().to(DEVICE)
    x = rand(4, 16)
    with torch.no_grad():
        ref = model.double()(x.double())
        model.float()
    report = dropin.inject_(model, example_inputs=x)
    assert {r.name for r in report.replaced} == {"up", "down"}
    dropin.route_report(reset=True)  # (inject_'s verification ran the original under no route)
    with torch.no_grad(), dropin.use():
        out = model(x)
    assert_close(out, ref, torch.float32, "fwd")
    assert_counts({"F.gelu": 1})


def test_report_prints_every_count():
    with dropin.use():
        F.gelu(rand(2, 3))
        F.gelu(rand(2, 3, dtype=torch.float64))
    text = str(dropin.route_report(reset=True))
    assert text.splitlines() == ["dropin route: 1 calls routed to dropin, 1 left to torch",
                                 "  F.gelu  routed           1",
                                 "  F.gelu  fallback         1  dtype float64 unsupported"]
    assert dropin.route_report().routed == {}


# --- torch.compile traces through the route --------------------------------------------------------------------

def test_compile_traces_dropin_ops_where_routed():
    """dynamo inlines the route: the graph holds dropin's ops for the routed call and torch's for the fallback;
    the same compiled function outside the route is traced again (torch's functions)."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    def fn(x, w):
        return F.gelu(F.linear(x, w)) + F.softmax(x.double(), -1).float().sum()

    x, w = rand(4, 8), rand(8, 8)
    compiled = torch.compile(fn, backend=recording, fullgraph=True)
    with dropin.use():
        out = compiled(x, w)
    outside = compiled(x, w)
    ref = fn(x.double(), w.double())
    assert_close(out, ref, torch.float32, "fwd")
    assert_close(outside, ref, torch.float32, "fwd")
    assert len(graphs) == 2
    assert "torch.ops.dropin" in graphs[0] and "softmax" in graphs[0]
    assert "torch.ops.dropin" not in graphs[1]


# --- GPU: the routed function compiled by Inductor and captured in a CUDA graph ---------------------------------

def block(x, g, wqkv, wo, w1, w2):
    h = x + attention(x, g, wqkv, wo)
    return h + F.linear(F.gelu(F.linear(F.layer_norm(h, (32,)), w1), approximate="tanh"), w2)


def block_leaves(dtype):
    return [rand(2, 8, 32, dtype=dtype), rand(32, dtype=dtype), rand(96, 32, dtype=dtype) / 4,
            rand(32, 32, dtype=dtype) / 4, rand(64, 32, dtype=dtype) / 4, rand(32, 64, dtype=dtype) / 8]


@gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_routed_block_cuda(mode):
    leaves = block_leaves(torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, mode=mode)
    with dropin.use():
        for _ in range(3):  # (reduce-overhead records its graph on a later call)
            out = compiled(*leaves)
    assert_close(out, block(*[t.double() for t in leaves]), torch.bfloat16, "fwd", torch_out=block(*leaves))


@gpu
def test_cuda_graph_capture_routed_block():
    leaves = block_leaves(torch.bfloat16)
    static = [t.clone() for t in leaves]
    with dropin.use():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block(*static)  # warm-up: plans made and kernels compiled outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(*static)
    assert sum(dropin.route_report().routed.values()) > 0
    fresh = block_leaves(torch.bfloat16)
    for s, t in zip(static, fresh):
        s.copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, block(*[t.double() for t in fresh]), torch.bfloat16, "fwd", torch_out=block(*fresh))


def test_readme_example():
    """README's "Functional code" example runs as written (on this run's device) and routes every call."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    example = re.search(r"## Functional code: dropin.use\(\).*?```python\n(.*?)```", readme, re.S).group(1)
    exec(example.replace('"cuda"', repr(DEVICE)), {})
    assert_counts({"F.linear": 2, "F.gelu": 1, "matmul / @": 1, "softmax": 1})
