"""Every public op and every injected model in each execution mode a user picks, against eager dropin (GPU):
- a CUDA graph captured after warm-up and replayed on new input data written into its static inputs;
- torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graph trees), forward and forward + backward, on new
  inputs every call;
- a reduce-overhead training step whose weights change every step (no stale copy of a weight);
- eager on a non-default stream, and on a second GPU while the first is the current device.
The ops and their tiny inputs are `dropin bench overhead`'s (dropin.bench.overhead.pairs).
"""
import copy

import pytest
import torch
from torch import nn

import dropin
from dropin.bench.overhead import pairs
from _tol import gpu, rel_err, slow, tolerance

pytestmark = gpu

PAIRS = {p.name: p for p in pairs()}
NAMES = list(PAIRS)


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _assert_same(got, want, what: str) -> None:
    """got within the dtype's forward tolerance of want (the same kernels on the same data: a result computed
    from stale inputs, or not at all, is off by O(1))."""
    for i, (g, w) in enumerate(zip(_outputs(got), _outputs(want))):
        err = rel_err(g, w)
        assert err <= tolerance(w.dtype, "fwd"), f"{what}, output {i}: relative error {err:.2e} against eager"


def _fill(static: tuple, new: tuple) -> None:
    for s, n in zip(static, new):
        if isinstance(s, torch.Tensor) and s is not n:
            s.copy_(n)


@pytest.mark.parametrize("name", NAMES)
def test_op_cuda_graph(name):
    pair = PAIRS[name]
    static = pair.make()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            pair.dropin(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = pair.dropin(*static)
    for replay in range(2):
        new = pair.make()
        _fill(static, new)
        graph.replay()
        with torch.no_grad():
            _assert_same(out, pair.dropin(*new), f"{name}, replay {replay}")


@pytest.mark.parametrize("name", NAMES)
def test_op_reduce_overhead(name):
    """Forward under no_grad, then forward + backward (the gradients of the first n_grad inputs)."""
    pair = PAIRS[name]
    torch._dynamo.reset()
    compiled = torch.compile(pair.dropin, mode="reduce-overhead", fullgraph=True)
    for call in range(3):
        inputs = pair.make()
        with torch.no_grad():
            _assert_same(compiled(*inputs), pair.dropin(*inputs), f"{name}, call {call}")
    torch._dynamo.reset()
    compiled = torch.compile(pair.dropin, mode="reduce-overhead", fullgraph=True)
    for call in range(3):
        inputs = pair.make()
        grads = []
        for fn in (compiled, pair.dropin):
            leaves = [t.detach().requires_grad_(i < pair.n_grad) for i, t in enumerate(inputs)]
            outs = _outputs(fn(*leaves))
            torch.manual_seed(call)
            upstream = [torch.randn_like(o) for o in outs]
            grads.append(torch.autograd.grad(outs, leaves[:pair.n_grad], upstream))
        _assert_same(grads[0], grads[1], f"{name} gradients, call {call}")


def _forward_backward(pair, inputs) -> tuple:
    """pair.dropin's outputs and the gradients of its first n_grad inputs (a seeded upstream gradient)."""
    leaves = [t.detach().requires_grad_(i < pair.n_grad) for i, t in enumerate(inputs)]
    outs = _outputs(pair.dropin(*leaves))
    gen = torch.Generator(device=outs[0].device).manual_seed(0)
    upstream = [torch.randn(o.shape, generator=gen, dtype=o.dtype, device=o.device) for o in outs]
    return tuple(o.detach() for o in outs) + torch.autograd.grad(outs, leaves[:pair.n_grad], upstream)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("name", NAMES)
def test_op_on_second_gpu(name):
    """After the op ran on cuda:0 (its plans, launches and caches made there), tensors on cuda:1 while cuda:0 is
    the current device: the results lie on cuda:1 and are those of the call with cuda:1 current, which are
    torch's there."""
    _forward_backward(PAIRS[name], PAIRS[name].make())
    with torch.cuda.device(1):
        pair = {p.name: p for p in pairs()}[name]  # (its weights on cuda:1)
        inputs = pair.make()
    got = _forward_backward(pair, inputs)
    assert torch.cuda.current_device() == 0 and all(t.device == torch.device("cuda", 1) for t in got)
    with torch.cuda.device(1):
        want = _forward_backward(pair, inputs)
        with torch.no_grad():
            peer = _outputs(pair.torch(*inputs))
    _assert_same(got, want, f"{name} on cuda:1 from cuda:0")
    _assert_same(want[:len(peer)], peer, f"{name} on cuda:1 against torch")


@pytest.mark.parametrize("name", NAMES)
def test_op_on_side_stream(name):
    """On a non-default stream, behind a ~30 ms sleep there that precedes its inputs' writes, through the repeat
    path: the op's launches follow that stream (on another stream they would read the inputs unwritten)."""
    pair = PAIRS[name]
    static, new = pair.make(), pair.make()
    with torch.no_grad():
        pair.dropin(*static)  # (plans and launches made)
        want = pair.dropin(*new)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            _fill(static, new)
            got = pair.dropin(*static)
        torch.cuda.current_stream().wait_stream(side)
    _assert_same(got, want, f"{name} on a side stream")


# ------------------------------------------------------------------------------------------------ models
def _resnet18():
    import torchvision
    x = torch.randn(2, 3, 64, 64, device="cuda").to(memory_format=torch.channels_last)
    model = torchvision.models.resnet18().cuda().eval().to(memory_format=torch.channels_last)
    return model, (x,), lambda: (torch.randn_like(x).to(memory_format=torch.channels_last),)


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    model = transformers.LlamaForCausalLM(config).cuda().eval()
    ids = lambda: (torch.randint(0, 100, (2, 16), device="cuda"),)  # noqa: E731
    return model, ids(), ids


def _cvt():
    transformers = pytest.importorskip("transformers")
    config = transformers.CvtConfig(num_labels=10, embed_dim=[16, 32, 48], num_heads=[1, 2, 2], depth=[1, 2, 3])
    model = transformers.CvtForImageClassification(config).cuda().eval()
    pixels = lambda: (torch.randn(2, 3, 64, 64, device="cuda"),)  # noqa: E731
    return model, pixels(), pixels


def _mlp():
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16)).cuda().eval()
    x = lambda: (torch.randn(8, 32, device="cuda"),)  # noqa: E731
    return model, x(), x


MODELS = {"resnet18": _resnet18, "llama": _llama, "cvt": _cvt, "generic-mlp": _mlp}


def _main(out):
    return out if isinstance(out, torch.Tensor) else out[0]


@pytest.mark.parametrize("name", MODELS)
def test_model_cuda_graph(name, true_fp32):
    model, static, new_inputs = MODELS[name]()
    dropin.inject_(model, example_inputs=static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            model(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = _main(model(*static))
    for replay in range(2):
        new = new_inputs()
        _fill(static, new)
        graph.replay()
        with torch.no_grad():
            _assert_same(out, _main(model(*new)), f"{name}, replay {replay}")


# resnet18 is slow: its fused conv + BN (+ residual) + ReLU ops run under reduce-overhead in
# test_op_reduce_overhead[conv2d+residual+relu] and in the CvT's convolutions here, the injected resnet18 in a CUDA
# graph in test_model_cuda_graph[resnet18].
@pytest.mark.parametrize("name", [pytest.param(name, marks=slow) if name == "resnet18" else name for name in MODELS])
def test_model_reduce_overhead(name, true_fp32):
    model, inputs, new_inputs = MODELS[name]()
    dropin.inject_(model, example_inputs=inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, mode="reduce-overhead")
    for call in range(3):
        new = new_inputs()
        with torch.no_grad():
            _assert_same(_main(compiled(*new)), _main(model(*new)), f"{name}, call {call}")


def test_reduce_overhead_training_step_weights_change(true_fp32):
    """Fine-tuning with frozen BatchNorms (eval mode, weights that require grad): the folds are computed in the
    step from the current weights, which the optimizer changes after every step; the losses follow torch's."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 10)).cuda().eval()
    original = copy.deepcopy(model)
    dropin.inject_(model, example_inputs=torch.randn(4, 3, 8, 8, device="cuda"))
    x, target = torch.randn(4, 3, 8, 8, device="cuda"), torch.randint(0, 10, (4,), device="cuda")
    torch._dynamo.reset()
    losses = []
    for net in (model, original):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        step = torch.compile(lambda: nn.functional.cross_entropy(net(x), target), mode="reduce-overhead")
        run = []
        for _ in range(4):
            loss = step()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[0][0] != losses[0][-1], "the weights did not change"
    for i, (ours, theirs) in enumerate(zip(*losses)):
        assert abs(ours - theirs) <= 1e-4 * abs(theirs), f"step {i}: loss {ours} against torch's {theirs}"


def test_dynamic_batch_sizes_without_a_recompile_per_size():
    """torch.compile(dynamic=True) of an injected model over changing batch sizes: the plans of symbolic sizes are
    not per size, so the frames compiled stay few (a guard per tile-size bucket at most)."""
    from torch._dynamo.utils import counters

    model, _, _ = _mlp()
    dropin.inject_(model, example_inputs=torch.randn(8, 32, device="cuda"))
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, dynamic=True)
    for batch in (3, 5, 8, 13, 21, 34, 55, 89):
        x = torch.randn(batch, 32, device="cuda")
        with torch.no_grad():
            _assert_same(compiled(x), model(x), f"batch {batch}")
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_compile_fullgraph_under_autocast(dtype):
    """An injected float32 model compiled with fullgraph=True and run under torch.autocast: dropin's products cast
    their operands as torch's do."""
    model, inputs, new_inputs = _mlp()
    dropin.inject_(model, example_inputs=inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = new_inputs()[0]
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        got, want = compiled(x), model(x)
    assert got.dtype == want.dtype
    _assert_same(got, want, "autocast")
