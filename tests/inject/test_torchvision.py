"""inject_ on torchvision ResNet blocks: BasicBlock and Bottleneck as one ResidualBlock of fused convs (eval)."""
import copy
import importlib

import pytest
import torch
from torch import nn

import dropin
import dropin.nn as dnn
from _tol import DEVICE, gpu

from _models import (assert_same_random_draws, assert_same_state, check_backward, check_forward, injected_pair,
                     randomize_batchnorms, snapshot)

resnet = pytest.importorskip("torchvision.models.resnet")


def _shortcut(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


def tiny_resnet() -> nn.Module:
    """torchvision's blocks at 4-16 channels: identity and downsample shortcuts, BasicBlock and Bottleneck."""
    return randomize_batchnorms(nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        resnet.BasicBlock(4, 4),
        resnet.BasicBlock(4, 8, stride=2, downsample=_shortcut(4, 8, 2)),
        resnet.Bottleneck(8, 2),
        resnet.Bottleneck(8, 4, stride=2, downsample=_shortcut(8, 16, 2)),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5),
    )).to(DEVICE)


X_SHAPE = (2, 3, 8, 8)


def test_blocks_fused_in_eval():
    x = torch.randn(X_SHAPE, device=DEVICE)
    model, original, report = injected_pair(tiny_resnet, example_inputs=x)
    assert [type(m).__name__ for m in model] == ["ConvBNAct", "Folded", "Folded", *["ResidualBlock"] * 4,
                                                 "Op", "Flatten", "Linear"]
    kernels = {r.name: r.kernel for r in report.replaced}
    assert kernels["3"] == "2 x conv2d+bn+relu (the last + residual)"
    assert kernels["6"] == "3 x conv2d+bn+relu (the last + residual), shortcut conv2d+bn"
    assert kernels["7"] == "adaptive_avg_pool2d"
    assert report.left == [] and report.verification.startswith("verified")
    block = model[4]
    assert isinstance(block.conv2, dnn.ConvBNAct) and block.bn2 is block.conv2.bn and block.bn2 is \
        block.original.bn2 and isinstance(block.downsample[1], dnn.Folded)
    check_forward(model, original, x)


def test_block_state_dict_revert_and_reinject():
    model = tiny_resnet().eval()
    state, blocks = snapshot(model), list(model.children())
    x = torch.randn(X_SHAPE, device=DEVICE)
    with torch.no_grad():
        before = model(x)
    report = dropin.inject_(model, verify=False)
    assert_same_state(model, state)
    assert dropin.inject_(model, verify=False).replaced == report.replaced
    dropin.revert_(model)
    assert all(a is b for a, b in zip(model.children(), blocks))
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_training_mode_blocks_not_fused_and_backward_matches_torch():
    x = torch.randn(X_SHAPE, device=DEVICE)
    model, original, report = injected_pair(tiny_resnet, train=True, example_inputs=x)
    assert {n.name for n in report.notes} == {"3", "4", "5", "6"}
    assert "training mode" in report.notes[0].reason and "one by one" in report.notes[0].reason
    assert isinstance(model[4].conv1, dnn.Conv2d) and isinstance(model[4].downsample[0], dnn.Conv2d)
    assert isinstance(model[4].bn1, dnn.Op) and model[4].bn1.kernel == "batch_norm"  # batch statistics
    assert report.left == []
    check_backward(model, original, x)


def test_eval_blocks_then_train_mode_backward():
    model, original, _ = injected_pair(tiny_resnet, verify=False)
    model.train(), original.train()
    check_backward(model, original, torch.randn(X_SHAPE, device=DEVICE))


def test_channels_last_eval():
    x = torch.randn(X_SHAPE, device=DEVICE).to(memory_format=torch.channels_last)
    model, original, _ = injected_pair(lambda: tiny_resnet().to(memory_format=torch.channels_last),
                                       example_inputs=x)
    check_forward(model, original, x)


@gpu
@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_torchvision_resnet(name):
    import torchvision

    x = torch.randn(2, 3, 64, 64, device=DEVICE)
    model, original, report = injected_pair(lambda: randomize_batchnorms(
        getattr(torchvision.models, name)().to(DEVICE)), example_inputs=x)
    assert sum(r.original in ("BasicBlock", "Bottleneck") for r in report.replaced) == (8 if name == "resnet18" else 16)
    assert report.left == []  # the max pool and the global average pool run dropin kernels too
    check_forward(model, original, x)
    assert_same_state(model, snapshot(dropin.revert_(copy.deepcopy(model))))


def test_resnet_stem_is_a_chain():
    """ResNet's forward runs conv1 -> bn1 -> relu: declared a chain, fused like an nn.Sequential (no forward
    here: the full-width ResNet is slow under the interpreter; test_torchvision_resnet runs it on the GPU)."""
    model = resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1]).to(DEVICE).eval()
    report = dropin.inject_(model, verify=False)
    stem = report.replaced[0]
    assert (stem.name, stem.kernel, stem.fused, stem.covers) == ("conv1", "conv2d+bn+relu", ("bn1", "relu"), 3)
    assert report.replaced[1].kernel == "max_pool2d"
    assert report.replaced[2].covers == 5 and report.replaced[3].covers == 7  # block, block with downsample
    assert isinstance(model.bn1, dnn.Folded) and isinstance(model.relu, dnn.Folded)


def _swin_blocks(version, frozen_bias=False):
    """Two torchvision Swin blocks (dim 16, 2 heads, 4 x 4 windows): unshifted, then shifted by 2; the bias table
    (V1) or bias MLP (V2) frozen where asked."""
    swin = pytest.importorskip("torchvision.models.swin_transformer")
    from torchvision.ops.misc import Permute

    block = {"v1": swin.SwinTransformerBlock, "v2": swin.SwinTransformerBlockV2}[version]
    model = nn.Sequential(block(16, 2, [4, 4], [0, 0]), block(16, 2, [4, 4], [2, 2]), Permute([0, 3, 1, 2]))
    for attn in (model[0].attn, model[1].attn):
        if version == "v1":
            with torch.no_grad():  # (the table starts near zero: a bias that counts)
                attn.relative_position_bias_table.normal_()
        (attn.cpb_mlp if version == "v2" else attn.relative_position_bias_table).requires_grad_(not frozen_bias)
    return model.to(DEVICE)


@pytest.mark.parametrize("version", ["v1", "v2"])
# (7 x 10 and 4 x 10 padded to whole windows; 4 rows are one window: no shift along them)
@pytest.mark.parametrize("size", [(8, 8), (7, 10), (4, 10)])
def test_swin_window_attention(version, size, monkeypatch):
    """torchvision's shifted-window attention (F.linear on its children's weights, matmuls and softmax in its own
    forward) as one dropin attention a window (bias and shift mask its mask) between dropin linears: output against
    torch's in float64, with windows padded and shifted; in grad mode with a trainable bias (no mask gradient in
    dropin attention) the original's forward under dropin's route, gradients against float64; the state_dict keys
    and tensors unchanged; revert_ puts the same modules back."""
    model = _swin_blocks(version)
    original, attentions = copy.deepcopy(model), [model[0].attn, model[1].attn]
    assert not dropin.inject_(model, verify=False).left  # (torchvision's Permute, a view, is passive)
    assert [type(m.attn) for m in model[:2]] == [dnn.WindowAttention] * 2
    assert [m.attn.original for m in model[:2]] == attentions
    assert_same_state(model, original.state_dict())
    calls = []
    swin_module = importlib.import_module("dropin.nn.swin")
    monkeypatch.setattr(swin_module, "attention", lambda *a, **kw: calls.append(a[3].shape) or dropin.attention(
        *a, **kw))
    x = torch.randn(2, *size, 16, device=DEVICE)
    dropin.route_report(reset=True)
    check_forward(model, original, x)
    windows = 2 * -(-size[0] // 4) * -(-size[1] // 4)
    assert calls == [(1, 2, 16, 16), (windows, 2, 16, 16)]  # (unshifted: the bias alone, broadcast)
    assert set(dropin.route_report(reset=True).routed) <= {"F.linear"}  # (V2's bias MLP)
    calls.clear()
    check_backward(model, original, x)
    assert not calls and {"F.linear", "matmul / @", "F.softmax"} <= set(dropin.route_report(reset=True).routed)
    dropin.revert_(model)
    assert [m.attn for m in model[:2]] == attentions


def _torchvision_shift_mask(padded_h, padded_w, window, shift):
    """torchvision's construction of the mask (slices of region counts), as `shifted_window_attention` writes it."""
    ids = torch.zeros(padded_h, padded_w)
    count = 0
    for h in ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None)):
        for w in ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None)):
            ids[h[0]:h[1], w[0]:w[1]] = count
            count += 1
    ids = ids.view(padded_h // window[0], window[0], padded_w // window[1], window[1]).permute(0, 2, 1, 3)
    ids = ids.reshape(-1, window[0] * window[1])
    diff = ids.unsqueeze(1) - ids.unsqueeze(2)
    return diff.masked_fill(diff != 0, -100.0).masked_fill(diff == 0, 0.0)


@pytest.mark.parametrize("sizes", [(8, 8, [4, 4], [2, 2]), (8, 12, [4, 4], [0, 2]), (14, 21, [7, 7], [3, 3]),
                                   (6, 9, [3, 3], [1, 2])])
def test_swin_shift_mask(sizes):
    """The shift mask from region ids per axis equals torchvision's slice-built one (a zero shift along an axis
    too), and an eager call's mask is kept for the next."""
    from dropin.nn.swin import shift_mask

    mask = shift_mask(*sizes, DEVICE)
    torch.testing.assert_close(mask.cpu(), _torchvision_shift_mask(*sizes), rtol=0, atol=0)
    assert shift_mask(*sizes, DEVICE) is mask


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_swin_window_attention_frozen_bias_trains(version):
    """With the bias frozen (no gradient asked of the mask), a training forward runs dropin attention too: the
    input's and every trainable parameter's gradient against float64."""
    model = _swin_blocks(version, frozen_bias=True)
    original = copy.deepcopy(model)
    dropin.inject_(model, verify=False)
    dropin.route_report(reset=True)
    check_backward(model, original, torch.randn(2, 8, 8, 16, device=DEVICE))
    assert "F.softmax" not in dropin.route_report(reset=True).routed


def test_convnext_layer_norm_2d():
    """torchvision's LayerNorm2d (a LayerNorm subclass normalizing the channels of NCHW) runs dropin's layer_norm:
    output and gradients against float64, nothing left to torch."""
    convnext = pytest.importorskip("torchvision.models.convnext")
    model, original, report = injected_pair(lambda: nn.Sequential(convnext.LayerNorm2d(6), nn.Conv2d(6, 4, 1)).to(
        DEVICE), verify=False)
    assert not report.left and model[0].kernel == "layer_norm (channels first)"
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5), model[0].bias.uniform_(-0.5, 0.5)
    original.load_state_dict(model.state_dict())
    x = torch.randn(2, 6, 5, 7, device=DEVICE)
    check_forward(model, original, x)
    check_backward(model, original, x)


def _convnext_blocks(stochastic_depth: float = 0.0) -> nn.Module:
    """torchvision's ConvNeXt blocks at 8 channels, a non-trivial layer scale, LayerNorms' affine drawn."""
    convnext = pytest.importorskip("torchvision.models.convnext")
    model = nn.Sequential(*[convnext.CNBlock(8, 0.5, stochastic_depth) for _ in range(2)]).to(DEVICE)
    with torch.no_grad():
        for block in model:
            block.block[2].weight.uniform_(0.5, 1.5), block.block[2].bias.uniform_(-0.5, 0.5)
            block.layer_scale.uniform_(0.2, 0.8)
    return model


def test_convnext_block():
    """torchvision's CNBlock runs as nn.ConvNeXtBlock: its depthwise conv, LayerNorm, MLP (GELU in the first
    linear's epilogue), layer scale and residual as dropin calls on the block's own tensors, nothing left, the
    state_dict the original's; output and every gradient against float64; in training with stochastic depth the
    original's rows dropped (the same draws from the same seed); revert_ gives the blocks back."""
    model, original, report = injected_pair(_convnext_blocks, example_inputs=torch.randn(2, 8, 7, 9, device=DEVICE))
    assert [type(m).__name__ for m in model] == ["ConvNeXtBlock"] * 2 and not report.left
    assert report.verification.startswith("verified")
    assert list(model.state_dict()) == list(original.state_dict())
    x = torch.randn(2, 8, 7, 9, device=DEVICE)
    check_forward(model, original, x)
    check_backward(model, original, x)
    trained, reference, _ = injected_pair(lambda: _convnext_blocks(0.5), train=True, verify=False)
    assert_same_random_draws(trained, reference, lambda m: m(x))
    dropin.revert_(model)
    assert [type(m).__name__ for m in model] == ["CNBlock"] * 2


def _compiled_call(model: nn.Module, x: torch.Tensor) -> tuple:
    """(output, the functions its graph calls) of torch.compile(model, fullgraph=True)(x), the captured graph run
    as it is (no Inductor: the interpreter's kernels run under it)."""
    targets = set()

    def backend(graph_module, example_inputs):
        targets.update(str(n.target) for n in graph_module.graph.nodes if n.op == "call_function")
        return graph_module.forward
    return torch.compile(model, backend=backend, fullgraph=True)(x), targets


def test_convnext_block_under_compile():
    """torch.compile(fullgraph=True) traces nn.ConvNeXtBlock without a graph break: dropin's conv2d, layer_norm and
    product (the linears) ops in the graph, the compiled output the eager one's."""
    model = _convnext_blocks().eval()
    dropin.inject_(model, verify=False)
    x = torch.randn(2, 8, 7, 9, device=DEVICE)
    with torch.no_grad():
        out, targets = _compiled_call(model, x)
        assert {"dropin.conv2d.default", "dropin.layer_norm.default", "dropin.mm.default"} <= targets, sorted(targets)
        torch.testing.assert_close(out, model(x))


def test_convnext_block_other_layers_injected_one_by_one():
    """A CNBlock whose block is not the layers torchvision builds (an extra layer) is not fused: the report says
    why, and its modules are injected by their own handlers."""
    def make():
        model = _convnext_blocks()[:1]
        model[0].block.append(nn.Identity())
        return model
    model, original, report = injected_pair(make, verify=False)
    assert type(model[0]).__name__ == "CNBlock"
    assert any("its block is not (Conv2d, Permute, LayerNorm, Linear, GELU, Linear, Permute)" in str(r.reason)
               for r in report.notes), report.notes
    assert type(model[0].block[0]).__name__ == "Conv2d" and isinstance(model[0].block[0], dnn.DropinModule)
    check_forward(model, original, torch.randn(2, 8, 7, 9, device=DEVICE))


@pytest.mark.parametrize("grad", [False, True])
def test_swin_window_attention_under_compile(grad):
    """torch.compile(fullgraph=True) traces the window attention: without grad its graph holds dropin's attention;
    with a trainable bias in grad mode the original's forward under the route (the route decides at trace time:
    dropin's differentiable products and softmax in the graph, as autograd functions); the compiled output is the
    eager one's."""
    model = _swin_blocks("v1")[1:2].eval()
    dropin.inject_(model, verify=False)
    x = torch.randn(2, 8, 8, 16, device=DEVICE)
    with torch.set_grad_enabled(grad):
        out, targets = _compiled_call(model, x)
        assert ("autograd_function_apply" in targets) == grad, sorted(targets)
        assert ("dropin.attention.default" in targets) != grad, sorted(targets)
        torch.testing.assert_close(out, model(x))


def _maxvit():
    """torchvision's MaxViT of two stages of one block (16 and 32 channels, heads of 8, windows and grids of 7)."""
    from torchvision.models.maxvit import MaxVit
    return MaxVit(input_size=(56, 56), stem_channels=16, partition_size=7, block_channels=[16, 32],
                  block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0, num_classes=10).to(DEVICE)


def test_maxvit_attention():
    """MaxViT's relative positional attention (window and grid) runs as one dropin attention with its bias as the
    mask, its partitions passive: verified, nothing left, output against float64; where autograd records, the bias
    table's gradient takes torchvision's forward: output and every gradient against float64."""
    x = torch.randn(1, 3, 56, 56, device=DEVICE)
    model, original, report = injected_pair(lambda: _maxvit().eval(), example_inputs=x)
    attentions = [m for m in model.modules() if isinstance(m, dnn.MaxVitAttention)]
    assert len(attentions) == 4 and not report.left and report.verification.startswith("verified"), report
    check_forward(model, original, x)
    check_backward(model, original, x)
