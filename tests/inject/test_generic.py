"""inject_ / revert_ on models of torch.nn layers: fusions, report, verification, revert, state_dict, training."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dropin
import dropin.nn as dnn
from dropin.inject import InjectConfig, InjectError, VerificationError, coverage, registry
from _tol import DEVICE, gpu

from _models import (assert_same_state, check_backward, check_forward, cnn, compiled_guards, injected_pair, mlp,
                     randomize_batchnorms, snapshot)


def kinds(model):
    return [type(m).__name__ for m in model.children()]


def test_mlp_linear_activation_fused():
    model, original, report = injected_pair(mlp, example_inputs=torch.randn(4, 16, device=DEVICE))
    assert kinds(model) == ["Linear", "Folded", "Linear", "Folded", "Linear", "Folded", "Linear"]
    assert all(isinstance(m, dnn.DropinModule) for m in model)
    assert [(r.name, r.kernel, r.fused) for r in report.replaced] == [
        ("0", "linear+relu", ("1",)), ("2", "linear+gelu_tanh", ("3",)), ("4", "linear+silu", ("5",)),
        ("6", "linear", ())]
    assert report.left == [] and report.verification.startswith("verified")
    check_forward(model, original, torch.randn(3, 16, device=DEVICE))


def test_cnn_eval_conv_bn_relu_fused():
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    model, original, report = injected_pair(cnn, example_inputs=x)
    assert [(r.name, r.kernel, r.fused) for r in report.replaced] == [
        ("0", "conv2d+bn+relu", ("1", "2")), ("3", "conv2d+bn+relu", ("4", "5")), ("6", "max_pool2d", ()),
        ("8", "linear+gelu", ("9",)), ("10", "linear", ())]
    assert report.left == []  # Flatten computes nothing: not listed
    text = str(report)
    assert "MaxPool2d" in text and "conv2d+bn+relu" in text and "verified" in text
    check_forward(model, original, x)
    assert isinstance(model[1], dnn.Folded) and model[1].into == "0" and model[0].bn is model[1].original


def test_training_mode_bn_not_folded_and_backward_matches_torch():
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    model, original, report = injected_pair(cnn, train=True, example_inputs=x)
    assert [r.kernel for r in report.replaced] == ["conv2d", "batch_norm", "relu", "conv2d", "batch_norm", "relu",
                                                  "max_pool2d", "linear+gelu", "linear"]
    assert report.left == []  # BatchNorm with batch statistics: its own kernel, not folded
    assert torch.equal(model[1].running_mean, original[1].running_mean), "verification changed BN statistics"
    check_backward(model, original, x)
    assert torch.allclose(model[1].running_mean, original[1].running_mean)  # both updated alike


def test_eval_fused_backward_through_the_fold():
    """Fine-tuning with frozen BatchNorm: gradients reach the conv and the BatchNorm parameters."""
    model, original, _ = injected_pair(lambda: cnn(conv_bias=True), verify=False)
    check_backward(model, original, torch.randn(2, 3, 8, 8, device=DEVICE))


def test_fused_then_train_mode_runs_batch_statistics():
    model, original, _ = injected_pair(cnn, verify=False)
    model.train(), original.train()
    assert model[0].training and model[0].original.training and model[1].original.training
    check_backward(model, original, torch.randn(2, 3, 8, 8, device=DEVICE))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.allclose(getattr(model[1], name), getattr(original[1], name).to(getattr(model[1], name)))
    model.eval(), original.eval()  # the fold is recomputed from the updated statistics
    check_forward(model, original, torch.randn(2, 3, 8, 8, device=DEVICE))


def test_revert_restores_the_same_modules_bit_for_bit():
    model = cnn().eval()
    children = list(model.children())
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    with torch.no_grad():
        before = model(x)
    dropin.inject_(model, example_inputs=x)
    assert dropin.revert_(model) is model
    assert list(model.children()) == children and all(a is b for a, b in zip(model.children(), children))
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_state_dict_round_trip_and_fold_refresh():
    model = cnn().eval()
    state = snapshot(model)
    dropin.inject_(model, verify=False)
    assert_same_state(model, state)
    assert sum(p.numel() for p in model.parameters()) == sum(v.numel() for k, v in state.items()
                                                            if "running" not in k and "num_batches" not in k)
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    with torch.no_grad():
        model(x)  # fills the fold cache
    other = cnn().eval()
    model.load_state_dict(other.state_dict())
    check_forward(model, other, x)  # the folded weights follow the loaded values
    dropin.revert_(model)
    assert_same_state(model, snapshot(other))


def _as_captured(monkeypatch):
    """From here on the drop-ins behave as inside a CUDA graph capture: no check of their sources' versions, the
    derived buffers read as they are (what torch.compile'd code and a captured graph do)."""
    monkeypatch.setattr(dropin._runtime, "capturing", lambda: True)


def test_folds_are_buffers_refreshed_by_load_state_dict(monkeypatch):
    """The folded weights are non-persistent buffers made at inject time: not in state_dict, moved by .to(); a
    load_state_dict on the injected model (also a BatchNorm loaded after its conv) folds again for code that reads
    them without checks."""
    model = cnn().eval()
    dropin.inject_(model, verify=False)
    assert not any("derived" in k for k in model.state_dict())
    folded = [name for name, _ in model.named_buffers() if ".derived." in name]
    assert folded and all(name.endswith(("derived.weight", "derived.bias")) for name in folded)
    other = cnn().eval()
    _as_captured(monkeypatch)
    model.load_state_dict(other.state_dict())
    check_forward(model, other, torch.randn(2, 3, 8, 8, device=DEVICE))
    model.to(torch.float16)
    assert all(b.dtype == torch.float16 for name, b in model.named_buffers() if ".derived." in name)


def test_in_place_edit_then_refresh(monkeypatch):
    """An in-place change of a BatchNorm's statistics: eager calls fold again by themselves; code that reads the
    buffers unchecked (compiled, captured) sees the change after dropin.refresh_(model)."""
    model = cnn().eval()
    dropin.inject_(model, verify=False)
    reference = dropin.revert_(copy.deepcopy(model))
    batchnorms = [m.bn for m in model.modules() if isinstance(m, dnn.ConvBNAct)]
    same_in_reference = [m for m in reference.modules() if isinstance(m, nn.BatchNorm2d)]
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    with torch.no_grad():
        for bn in (batchnorms[0], same_in_reference[0]):
            bn.running_mean.add_(0.5)
    check_forward(model, reference, x)  # eager: the version check folds again
    with torch.no_grad():
        for bn in (batchnorms[1], same_in_reference[1]):
            bn.running_var.mul_(3)
    _as_captured(monkeypatch)
    with torch.no_grad():
        stale = model(x)
    assert not torch.allclose(stale, reference(x), rtol=1e-3, atol=1e-3)
    dropin.refresh_(model)
    check_forward(model, reference, x)


def test_dtype_conversion_after_injection_reaches_the_original():
    model = cnn().eval()
    dropin.inject_(model, verify=False)
    model.half()
    original = copy.deepcopy(model)
    dropin.revert_(original)
    assert all(t.dtype == torch.float16 for t in original.state_dict().values() if t.is_floating_point())
    check_forward(model, original, torch.randn(2, 3, 8, 8, device=DEVICE, dtype=torch.float16))


class _Perturbed(dnn.Linear):
    """A wrong kernel: the weight off by 1%."""

    def forward(self, x):
        return dropin.linear(x, self.weight * 1.01, self.bias, self.activation)


def test_verification_catches_a_wrong_kernel_and_reverts(monkeypatch):
    model = mlp()
    children = list(model.children())
    op, handler = registry.HANDLERS[nn.Linear]

    def plant(module, site):
        return _Perturbed(module) if site.path == "4" else handler(module, site)

    monkeypatch.setitem(registry.HANDLERS, nn.Linear, (op, plant))
    state = snapshot(model)
    with pytest.raises(VerificationError, match="'4'") as e:
        dropin.inject_(model, example_inputs=torch.randn(4, 16, device=DEVICE))
    assert e.value.module == "4" and "reverted" in str(e.value)
    assert all(a is b for a, b in zip(model.children(), children))
    assert_same_state(model, state)


def test_strict_raises_on_modules_left_to_torch():
    model = nn.Sequential(nn.Linear(4, 4), nn.PReLU()).to(DEVICE)
    children = list(model.children())
    with pytest.raises(InjectError, match="PReLU"):
        dropin.inject_(model, strict=True, verify=False)
    assert all(a is b for a, b in zip(model.children(), children))
    assert dropin.inject_(mlp(), strict=True, verify=False).left == []


def test_injecting_twice_is_idempotent():
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    model = cnn().eval()
    first = dropin.inject_(model, example_inputs=x)
    modules = list(model.children())
    second = dropin.inject_(model, example_inputs=x)
    assert all(a is b for a, b in zip(model.children(), modules))
    assert second.replaced == first.replaced and second.left == first.left
    dropin.revert_(model)
    assert not any(isinstance(m, dnn.DropinModule) for m in model.modules())


def test_config_ops_fusions_dtypes():
    model = cnn().eval()
    report = dropin.inject_(model, InjectConfig(ops={"linear"}), verify=False)
    assert isinstance(model[0], nn.Conv2d) and isinstance(model[8], dnn.Linear)
    assert "op 'conv2d' is switched off" in {e.name: e.reason for e in report.left}["0"]
    model = mlp()
    report = dropin.inject_(model, InjectConfig(fusions=False), verify=False)
    assert [r.kernel for r in report.replaced] == ["linear", "relu", "linear", "gelu_tanh", "linear", "silu",
                                                  "linear"]  # no fusion: the activations run standalone
    assert isinstance(model[1], dnn.Op)
    report = dropin.inject_(mlp().half(), InjectConfig(dtypes=(torch.float32,)), verify=False)
    # a model whose tensors are all of an excluded dtype stays whole (its activations too), the dtype named
    assert "float16" in report.left[0].reason and "left whole" in report.left[0].reason and not report.replaced
    with pytest.raises(ValueError, match="'pooling'"):
        dropin.inject_(mlp(), InjectConfig(ops={"linear", "pooling"}))


def test_verification_inputs():
    assert dropin.inject_(mlp()).verification.startswith("NOT verified")
    assert dropin.inject_(mlp(), verify=False).verification == "not verified (verify=False)"
    assert dropin.inject_(mlp(), InjectConfig(input_shape=(2, 16))).verification.startswith("verified")


def test_functional_layers():
    """Layers that are one functional op, standalone: pooling, LayerNorm, a BatchNorm not after a conv (training
    mode too: the running statistics update as torch's), activations; forward and backward against torch."""
    def model():
        return randomize_batchnorms(nn.Sequential(
            nn.BatchNorm2d(3), nn.MaxPool2d(3, 2, 1, ceil_mode=True), nn.SiLU(),
            nn.AvgPool2d(2, count_include_pad=False),
            nn.GELU(approximate="tanh"), nn.AdaptiveAvgPool2d((2, 1)), nn.Flatten(), nn.LayerNorm(6), nn.ReLU(),
        )).to(DEVICE)
    x = torch.randn(2, 3, 9, 7, device=DEVICE)
    for train in (False, True):
        injected, original, report = injected_pair(model, train=train, example_inputs=x)
        assert [r.kernel for r in report.replaced] == ["batch_norm", "max_pool2d", "silu", "avg_pool2d", "gelu_tanh",
                                                      "adaptive_avg_pool2d", "layer_norm", "relu"]
        assert report.left == []
        check_backward(injected, original, x)
        assert torch.allclose(injected[0].running_var, original[0].running_var)
        assert injected[0].num_batches_tracked == original[0].num_batches_tracked == (1 if train else 0)


def test_unsupported_modules_and_root_are_reported():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), nn.Dropout(0.5),
                          nn.BatchNorm2d(4), nn.Identity(), nn.Sequential(), nn.PReLU(),
                          nn.ConvTranspose2d(4, 4, 1)).to(DEVICE).eval()
    left = {e.name: e.reason for e in dropin.inject_(model, verify=False).left}
    assert set(left) == {"0", "5", "6"}  # eval Dropout, Identity and an empty Sequential compute nothing; BatchNorm:
    # its own kernel
    assert "padding_mode 'reflect'" in left["0"] and "no PReLU kernel" in left["5"]
    model.train()
    assert "1" in {e.name for e in dropin.inject_(model, verify=False).left}  # training Dropout computes
    report = dropin.inject_(nn.Linear(4, 4).to(DEVICE), verify=False)
    assert report.left[0].name == "" and "wrap it" in report.left[0].reason and "<root>" in str(report)


class _Product(nn.Module):
    """x @ w: a matrix product no handler knows."""
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return x @ self.w


def test_coverage_measured_with_the_profiler():
    """All of the cnn's FLOPs run in dropin; a product left to torch shows in the FLOPs and among the kernels."""
    model, x = cnn().eval(), torch.randn(2, 3, 8, 8, device=DEVICE)
    cov = dropin.inject_(model, example_inputs=x, coverage=True).coverage
    assert cov.flops == 1.0 and cov.flops_torch == 0 < cov.flops_total and cov.torch_kernels == []
    assert (cov.kernel_time is None) == (DEVICE == "cpu")
    model = nn.Sequential(nn.Linear(4, 16), _Product()).to(DEVICE)
    report = dropin.inject_(model, example_inputs=torch.randn(32, 4, device=DEVICE), coverage=True)
    cov, product = report.coverage, 2 * 32 * 16 * 8
    assert cov.flops_torch == product and cov.flops_total == product + 2 * 32 * 4 * 16 and 0 < cov.flops < 1
    assert cov.torch_kernels and "of the FLOPs in dropin" in str(report)
    if DEVICE == "cpu":
        assert [name for name, *_ in cov.torch_kernels] == ["aten::mm"]
    else:
        assert 0 < cov.kernel_time < 1
    with pytest.raises(ValueError, match="coverage=True"):
        dropin.inject_(mlp(), coverage=True)


class _Attention(nn.Module):
    """F.scaled_dot_product_attention in a forward no handler knows, after a linear."""
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        q = self.proj(x).view(2, 5, 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_coverage_counts_torch_attention(backward):
    """torch's fused attention kernels, which the profiler counts no FLOPs for, count as torch's FLOP counter counts
    them (the forward's two products, the backward's five, the scores' recomputed): left to torch, they are work
    dropin does not run."""
    original, x = _Attention().to(DEVICE), torch.randn(2, 5, 16, device=DEVICE)
    model = copy.deepcopy(original)
    dropin.inject_(model, verify=False)
    run = (lambda m: m(x).sum().backward()) if backward else (lambda m: m(x))
    cov = coverage.measure(model, original, run)
    products = 2 * 2 * 2 * 5 * 5 * 8  # (one [5, 8] @ [8, 5] or [5, 5] @ [5, 8] product a head of each of 2 x 2)
    assert cov.flops_torch == products * (7 if backward else 2) and 0 < cov.flops < 1, cov


@pytest.mark.parametrize("make, shape", [(mlp, (4, 16)), pytest.param(cnn, (2, 3, 8, 8), marks=gpu),
                                         pytest.param(lambda: _residual_model(), (2, 8, 6, 6), id="traced-residual")])
def test_torch_compile_fullgraph(make, shape):
    """(the CNN compiles in ~40 s on the CPU: GPU only)"""
    model, original, _ = injected_pair(make, verify=False)
    x = torch.randn(shape, device=DEVICE)
    check_forward(torch.compile(model, fullgraph=True), original, x)


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8)).to(DEVICE), (4, 16)),
    (cnn, (2, 3, 8, 8)), (lambda: _residual_model(), (2, 8, 6, 6))], ids=["mlp-layernorm", "cnn", "traced-residual"])
def test_compiled_guards_come_from_no_getattr(make, shape):
    """The drop-ins' forwards read their tensors and children from the module dicts or through the original:
    none through DropinModule's own __getattr__, which torch.compile traces, guarding each lookup."""
    model, _, _ = injected_pair(make, verify=False)
    guards = compiled_guards(model, torch.randn(shape, device=DEVICE))
    assert guards and not [g for g in guards if "in __getattr__" in g]


class _Projections(nn.Module):
    """CvT's pattern: depthwise conv + BatchNorm projections of one input, one after another."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8))
                                  for _ in range(3))

    def forward(self, x):
        return torch.cat((self.a(x), self.b(x), self.c(x)), 1)


def test_torch_compile_folded_weights_in_reused_buffers():
    """Compiled, each eval-mode fold is computed by the graph into a buffer that the next fold reuses: no copy of a
    weight derived from an earlier fold may be served from a cache (it once was: a 1.4 relative error)."""
    torch._dynamo.reset()
    model, original, _ = injected_pair(lambda: randomize_batchnorms(_Projections()).to(DEVICE), verify=False)
    check_forward(torch.compile(model, fullgraph=True), original, torch.randn(2, 8, 6, 6, device=DEVICE))


def test_training_mode_verification_with_dropout():
    """Every verification run draws the same dropout masks (one seed), so a training-mode model verifies."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 8)).to(DEVICE).train()
    report = dropin.inject_(model, example_inputs=torch.randn(4, 16, device=DEVICE))
    assert report.verification.startswith("verified") and [e.name for e in report.left] == ["2"]


class _AttributeBlock(nn.Module):
    """A block written with attributes, as timm's and HF's are: conv -> bn -> (Identity) -> act chains, a ReLU
    shared by two calls, a conv whose BatchNorm's output meets a residual add, an argument with a default."""

    def __init__(self, width=8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.drop_block, self.act1 = nn.Identity(), nn.ReLU(inplace=True)
        self.conv2, self.bn2, self.act2 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.SiLU()
        self.conv3, self.bn3, self.shared = nn.Conv2d(width, width, 1), nn.BatchNorm2d(width), nn.ReLU()

    def forward(self, x, scale: float = 1.0):
        x = self.act1(self.drop_block(self.bn1(self.conv1(x))))
        x = self.act2(self.bn2(self.conv2(x)))
        return self.shared(self.shared(self.bn3(self.conv3(x)) + x) * scale)


class _SharedOutputBlock(_AttributeBlock):
    """conv2's output feeds bn2 and an add: conv2 takes nothing; conv1 -> bn1 -> act1 still fuse."""

    def forward(self, x, scale: float = 1.0):
        z = self.conv2(x)
        return self.act1(self.bn1(self.conv1(x))) + self.act2(self.bn2(z)) + z


class _UntraceableBlock(_AttributeBlock):
    """A branch on a tensor's value, which torch.fx cannot trace: nothing fuses, each layer runs alone."""

    def forward(self, x, scale: float = 1.0):
        y = self.conv1(x)
        if y.sum() > 0:
            y = y * scale
        return self.act1(self.bn1(y))


def _attribute_model(block):
    return lambda: randomize_batchnorms(nn.Sequential(block(), block())).to(DEVICE)


def test_traced_chains_fuse_blocks_written_with_attributes():
    """A parent's forward traced one level deep: its conv -> bn -> act calls fuse as in an nn.Sequential (an
    nn.Identity between them passed over and kept), a ReLU called twice stays alone, and conv3 takes bn3, whose
    output meets the residual add. Verified; revert_ restores every module and the state_dict round-trips."""
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    model, original, report = injected_pair(_attribute_model(_AttributeBlock), example_inputs=x)
    assert [(r.name, r.kernel, r.fused) for r in report.replaced[:4]] == [
        ("0.conv1", "conv2d+bn+relu", ("0.bn1", "0.act1")), ("0.conv2", "conv2d+bn+silu", ("0.bn2", "0.act2")),
        ("0.conv3", "conv2d+bn", ("0.bn3",)), ("0.shared", "relu", ())]
    assert isinstance(model[0].drop_block, nn.Identity) and report.verification.startswith("verified")
    check_forward(model, original, torch.randn(3, 8, 5, 7, device=DEVICE))
    assert_same_state(model, original.state_dict())
    dropin.revert_(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]


class _NoFollower(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(self.fc(x))


def test_forwards_traced_once_and_only_where_a_fusion_could_be(monkeypatch):
    """Each parent is traced once, however many of its children ask; a parent without both a child that may open a
    fusion and one that may continue it is never traced."""
    traced, trace = [], registry._trace_chains
    monkeypatch.setattr(registry, "_trace_chains", lambda parent: traced.append(type(parent)) or trace(parent))
    injected_pair(lambda: nn.Sequential(_NoFollower(), _AttributeBlock(6).to(DEVICE)).to(DEVICE),
                  example_inputs=torch.randn(2, 6, 6, 6, device=DEVICE), verify=False)
    assert traced == [_AttributeBlock]


@pytest.mark.parametrize("block", [_SharedOutputBlock, _UntraceableBlock])
def test_shared_outputs_and_untraceable_forwards_do_not_fuse(block):
    """A conv whose output feeds two calls takes no follower; a forward that does not trace keeps its layers apart,
    each injected alone; both verified."""
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    model, original, report = injected_pair(_attribute_model(block), example_inputs=x)
    fused = {r.name: r.fused for r in report.replaced}
    assert fused["0.conv2" if block is _SharedOutputBlock else "0.conv1"] == ()
    if block is _SharedOutputBlock:
        assert fused["0.conv1"] == ("0.bn1", "0.act1")
    else:
        assert registry.traced_chains(model[0]) == []
    assert report.verification.startswith("verified")
    check_forward(model, original, x)


class _ConstantBlock(_AttributeBlock):
    """A forward that makes a tensor constant, which torch.fx keeps as an attribute of the module it traces."""

    def forward(self, x, scale: float = 1.0):
        return self.act1(self.bn1(self.conv1(x))) * torch.tensor(2.0)


def test_tracing_leaves_the_users_module_as_it_was():
    block = _ConstantBlock().to(DEVICE).eval()
    before = dict(vars(block))
    assert registry.traced_chains(block) == [("conv1", "bn1", "act1")]
    assert vars(block).keys() == before.keys()


class DropPath(nn.Module):
    """timm's and HF's stochastic depth, as they write it: the identity in eval mode or with drop_prob 0."""

    def __init__(self, drop_prob):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0 or not self.training:
            return x
        keep = torch.rand(x.shape[0], *([1] * (x.ndim - 1)), device=x.device) >= self.drop_prob
        return x * keep / (1 - self.drop_prob)


def test_stochastic_depth_in_eval_is_not_left_to_torch():
    """Stochastic depth (torchvision's StochasticDepth, a *DropPath with drop_prob) computes nothing in eval mode
    or at probability 0: not reported as left to torch; in training it is, with the reason."""
    torchvision = pytest.importorskip("torchvision")
    model = nn.Sequential(nn.Linear(4, 4), torchvision.ops.StochasticDepth(0.2, "row"), DropPath(0.1),
                          nn.Linear(4, 4), DropPath(0.0)).to(DEVICE).eval()
    assert dropin.inject_(model, verify=False).left == []
    dropin.revert_(model)
    left = {e.name for e in dropin.inject_(model.train(), verify=False).left}
    assert left == {"1", "2"}


class _ResidualBlock(nn.Module):
    """timm's BasicBlock as it is written: conv -> bn -> act, conv -> bn -> (drop path) -> += shortcut -> act, the
    shortcut a conv + bn where the width changes."""

    def __init__(self, width_in=8, width=8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width_in, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.drop_path, self.act2 = nn.Identity(), nn.ReLU(inplace=True)
        self.downsample = None if width_in == width else nn.Sequential(nn.Conv2d(width_in, width, 1, bias=False),
                                                                       nn.BatchNorm2d(width))

    def forward(self, x):
        shortcut = x
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.drop_path(self.bn2(self.conv2(x)))
        if self.downsample is not None:
            shortcut = self.downsample(shortcut)
        x += shortcut
        return self.act2(x)


def _residual_model():
    return randomize_batchnorms(nn.Sequential(_ResidualBlock(), _ResidualBlock(8, 12))).to(DEVICE)


def test_residual_blocks_written_with_attributes_fuse():
    """act(bn(conv(x)) + shortcut) in a block's own forward: the block runs its traced forward, with one conv call
    that takes the shortcut (BatchNorm folded, add and ReLU in the epilogue); its other children fuse as chains.
    Verified; the state_dict and the original modules (revert_) are kept; switched to training mode, forward and
    backward match torch's."""
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    model, original, report = injected_pair(_residual_model, example_inputs=x)
    kernels = {r.name: (r.kernel, r.fused) for r in report.replaced}
    assert isinstance(model[0], dnn.TracedBlock)
    assert kernels["0"][0] == "traced forward (conv2: conv2d+bn+residual+relu)"
    assert kernels["0.conv2"] == ("conv2d+bn+residual+relu", ("0.bn2", "0.act2"))
    assert kernels["0.conv1"] == ("conv2d+bn+relu", ("0.bn1", "0.act1"))
    assert kernels["1.downsample.0"] == ("conv2d+bn", ("1.downsample.1",)) and report.left == []
    assert report.verification.startswith("verified")
    check_forward(model, original, torch.randn(3, 8, 5, 7, device=DEVICE))
    assert_same_state(model, original.state_dict())
    model.train(), original.train()
    check_backward(model, original, torch.randn(2, 8, 6, 6, device=DEVICE))
    blocks = list(original.modules())
    dropin.revert_(model)
    assert [type(m) for m in model.modules()] == [type(m) for m in blocks]


class _ResidualWithOptions(_ResidualBlock):
    """The same block with a defaulted argument (torch.fx would fix it to its default): not rewritten."""

    def forward(self, x, scale: float = 1.0):
        return super().forward(x) * scale


def test_residual_blocks_with_defaulted_arguments_are_not_rewritten():
    model, original, report = injected_pair(
        lambda: randomize_batchnorms(nn.Sequential(_ResidualWithOptions())).to(DEVICE),
        example_inputs=torch.randn(2, 8, 6, 6, device=DEVICE))
    assert not isinstance(model[0], dnn.TracedBlock) and report.verification.startswith("verified")
    assert {r.name: r.kernel for r in report.replaced}["0.conv2"] == "conv2d+bn"


class _ModalResidualBlock(_ResidualBlock):
    """A forward that branches on self.training (torch.fx fixes the branch it traced)."""

    def forward(self, x):
        if self.training:
            x = x * 0.5
        return super().forward(x)


def test_residual_block_that_reads_its_mode_runs_the_original_in_the_other_mode():
    x = torch.randn(2, 8, 6, 6, device=DEVICE)
    model, original, report = injected_pair(lambda: randomize_batchnorms(nn.Sequential(_ModalResidualBlock())).to(
        DEVICE), example_inputs=x)
    assert isinstance(model[0], dnn.TracedBlock) and model[0].traced_mode is False
    check_forward(model, original, x)
    model.train(), original.train()
    check_backward(model, original, x)  # (the original block, as torch runs it)
