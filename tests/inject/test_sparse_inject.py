"""inject_ with InjectConfig(sparse=...): Linears with enough zeros run the sparse kernels (SparsifiedLinear)."""
import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import dropin
import dropin.nn as dnn
from dropin.inject import SPARSE_THRESHOLD, InjectConfig
from _tol import DEVICE

from _models import assert_same_state, check_forward, snapshot


def zero_smallest(linear: nn.Linear, fraction: float) -> nn.Linear:
    """Zeros the `fraction` of linear's weights of least magnitude (plain zeros, no prune hook)."""
    with torch.no_grad():
        w = linear.weight
        w.view(-1)[w.abs().flatten().argsort()[:round(fraction * w.numel())]] = 0
    return linear


def sparse_mlp(dtype=torch.float32) -> nn.Module:
    """Layers 0 and 2 95% zeros, layer 4 dense."""
    return nn.Sequential(zero_smallest(nn.Linear(32, 64), 0.95), nn.ReLU(), zero_smallest(nn.Linear(64, 48), 0.95),
                         nn.GELU(), nn.Linear(48, 16)).to(DEVICE, dtype).eval()


def frozen(model: nn.Module) -> nn.Module:
    return model.requires_grad_(False)


def percent(sparsity: float) -> str:
    return f"{sparsity:.1%} zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_only_the_sparse_layers_go_sparse(dtype):
    model = sparse_mlp(dtype)
    original = [*model]
    x = torch.randn(3, 32, device=DEVICE, dtype=dtype)
    report = dropin.inject_(model, InjectConfig(sparse=0.9), example_inputs=x)
    assert report.verification.startswith("verified")
    assert [type(m).__name__ for m in model] == ["SparsifiedLinear", "Op", "SparsifiedLinear", "Op", "Linear"]
    assert model[0].original is original[0] and model[0].impl.sparsity == pytest.approx(0.95, abs=1e-3)
    dense_sparsity = 1 - int(torch.count_nonzero(original[4].weight)) / original[4].weight.numel()
    ratio = model[0].impl.nbytes / (original[0].weight.numel() * original[0].weight.element_size())
    kernels = {r.name: r.kernel for r in report.replaced}
    assert kernels["0"] == f"sparse_linear ({percent(model[0].impl.sparsity)}, {ratio:.2f}x weight bytes)"
    assert kernels["4"] == f"linear ({percent(dense_sparsity)}, dense: under the 90.0% threshold)"
    text = " ".join(str(report).split())  # (wrapped to the terminal)
    assert percent(model[2].impl.sparsity) in text and "dense: under the 90.0% threshold" in text
    check_forward(model, nn.Sequential(*original), x)


def test_state_dict_round_trip_and_revert_exact():
    model = frozen(sparse_mlp())
    children, state = [*model], snapshot(model)
    dropin.inject_(model, InjectConfig(sparse=0.9), verify=False)
    assert_same_state(model, state)  # the compressed copies are not in state_dict
    x = torch.randn(2, 32, device=DEVICE)
    other = sparse_mlp()
    model.load_state_dict(other.state_dict())
    check_forward(model, other, x)  # compressed again from the loaded weights
    model.load_state_dict(state)
    assert dropin.revert_(model) is model and all(a is b for a, b in zip(model, children))
    assert_same_state(model, state)


def test_half_after_inject_compresses_again():
    model = sparse_mlp()
    original = copy.deepcopy(model)
    dropin.inject_(model, InjectConfig(sparse=0.9), verify=False)
    model.half()
    x = torch.randn(2, 32, device=DEVICE, dtype=torch.float16)
    check_forward(model, original, x)
    assert model[0].impl.values.dtype == torch.float16 and model[0].impl.bias is model[0].bias


def test_pruned_layer_uses_the_mask_and_reverts_with_its_hook():
    """Eval mode, weights requiring grad (a pruned module's weight is then no graph leaf: verify copies it)."""
    model = sparse_mlp()
    prune.l1_unstructured(model[4], "weight", amount=0.95)
    pruned, hooks, state = model[4], dict(model[4]._forward_pre_hooks), snapshot(model)
    assert {"4.weight_orig", "4.weight_mask"} <= set(state)
    masked = percent(1 - float(state["4.weight_mask"].mean()))
    x = torch.randn(2, 32, device=DEVICE)
    with torch.no_grad():
        before = model(x)
    report = dropin.inject_(model, InjectConfig(sparse=0.9), example_inputs=x)
    assert isinstance(model[4], dnn.SparsifiedLinear) and report.verification.startswith("verified")
    assert percent(model[4].impl.sparsity) == masked
    assert_same_state(model, state)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)  # weight_orig alone would differ
        model[4].weight_mask.fill_(1)  # a new mask (in place): compressed again
        assert percent(model[4].impl.sparsity) == masked
        model(x)
        assert model[4].impl.sparsity < 0.9
        model[4].weight_mask.copy_(state["4.weight_mask"])
    dropin.revert_(model)
    assert model[4] is pruned and dict(pruned._forward_pre_hooks) == hooks and prune.is_pruned(model)
    assert_same_state(model, state)
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_pruned_layer_without_sparse_stays_torch_with_the_reason():
    model = nn.Sequential(nn.Linear(8, 8)).to(DEVICE)
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    report = dropin.inject_(model, example_inputs=torch.randn(2, 8, device=DEVICE))  # verify copies the model
    assert type(model[0]) is nn.Linear and report.replaced == []
    assert [e.name for e in report.left] == ["0"] and "pruned by torch.nn.utils.prune" in report.left[0].reason


def test_training_mode_keeps_dense_with_the_reason():
    model = sparse_mlp().train()
    x = torch.randn(2, 32, device=DEVICE)
    report = dropin.inject_(model, InjectConfig(sparse=0.9), example_inputs=x)
    assert [type(m).__name__ for m in model][::2] == ["Linear", "Linear", "Linear"]
    assert report.replaced[0].kernel == "linear+relu (95.0% zeros, dense: sparse kernels have no weight gradient)"
    assert "sparse kernels have no weight gradient" in " ".join(str(report).split())  # (wrapped to the terminal)
    dropin.revert_(model)
    frozen(model.train())  # frozen weights: sparse in training mode too (the bias trains)
    dropin.inject_(model, InjectConfig(sparse=0.9), verify=False)
    assert isinstance(model[0], dnn.SparsifiedLinear)


def test_sparse_forward_that_needs_a_weight_gradient_raises():
    model = sparse_mlp()
    dropin.inject_(model, InjectConfig(sparse=0.9), verify=False)
    model.train()
    with pytest.raises(RuntimeError, match="no weight gradient"):
        model(torch.randn(2, 32, device=DEVICE))
    with torch.no_grad():
        model(torch.randn(2, 32, device=DEVICE))


def test_sparse_off_changes_nothing_and_true_is_the_default_threshold():
    x = torch.randn(2, 32, device=DEVICE)
    reports = [dropin.inject_(sparse_mlp(), config, example_inputs=x)
               for config in (None, InjectConfig(), InjectConfig(sparse=False))]
    assert [[(r.name, r.kernel) for r in report.replaced] for report in reports] == [
        [("0", "linear+relu"), ("2", "linear+gelu"), ("4", "linear")]] * 3
    assert InjectConfig().sparse_threshold is None and InjectConfig(sparse=True).sparse_threshold == SPARSE_THRESHOLD
    model = sparse_mlp()
    dropin.inject_(model, InjectConfig(sparse=True), verify=False)
    assert [isinstance(m, dnn.SparsifiedLinear) for m in model][::2] == [True, True, False]


@pytest.mark.parametrize("bad", [1.5, -0.1, math.nan, "0.9"])
def test_invalid_threshold_raises(bad):
    with pytest.raises(ValueError, match="InjectConfig.sparse"):
        InjectConfig(sparse=bad)
    config = InjectConfig()
    config.sparse = bad
    with pytest.raises(ValueError, match="InjectConfig.sparse"):
        dropin.inject_(sparse_mlp(), config, verify=False)


def test_pruned_convs_go_sparse_and_resnet_blocks_unfuse():
    """A torchvision ResNet-18 (small input) globally magnitude-pruned to 90% with torch.nn.utils.prune: every
    conv with at least the threshold's zeros runs sparse_conv2d (its block no longer fuses; BatchNorm and ReLU
    run as their own kernels), the others (global pruning leaves some layers denser) stay torch with the reason,
    verified against the original; without `sparse` every pruned conv stays torch with the reason."""
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10).to(DEVICE).eval().requires_grad_(False)
    convs = [(m, "weight") for m in model.modules() if isinstance(m, nn.Conv2d)]
    prune.global_unstructured(convs, pruning_method=prune.L1Unstructured, amount=0.9)
    x = torch.randn(1, 3, 32, 32, device=DEVICE)
    plain = copy.deepcopy(model)
    report = dropin.inject_(model, InjectConfig(sparse=0.5), example_inputs=x)
    assert report.verification.startswith("verified")
    sparsity = {conv: dnn.sparse.weight_sparsity(conv) for conv, _ in convs}
    sparse = [m for m in model.modules() if isinstance(m, dnn.SparsifiedConv2d)]
    assert {m.original for m in sparse} == {conv for conv, s in sparsity.items() if s >= 0.5}
    assert len(sparse) >= len(convs) // 2 and not any(isinstance(m, dnn.ResidualBlock) for m in model.modules())
    left = [e for e in report.left if e.type == "Conv2d"]
    assert len(left) == len(convs) - len(sparse) and all("under the 50.0% threshold" in e.reason for e in left)
    left = {e.name: e.reason for e in dropin.inject_(plain, example_inputs=x).left}
    assert not any(isinstance(m, (dnn.SparsifiedConv2d, dnn.ResidualBlock)) for m in plain.modules())
    assert all("torch.nn.utils.prune" in left[name] for name, m in model.named_modules()
               if isinstance(m, dnn.SparsifiedConv2d)), left
