"""inject_ on timm's layers (timm is optional: skipped without it): its GELU / GELUTanh modules as dropin's
activations (fused into the conv before them), its LayerNorm2d as dropin's channels-first layer_norm, ConvNeXt's block
as nn.ConvNeXtBlock; output and gradients against float64, nothing left to torch."""
import pytest
import torch
from torch import nn

import dropin
from _tol import DEVICE

from _models import assert_same_random_draws, check_backward, check_forward, injected_pair

timm = pytest.importorskip("timm")


@pytest.mark.parametrize("act", ["GELU", "GELUTanh"])
def test_timm_gelu_and_layer_norm_2d(act):
    """timm's LayerNorm2d (NCHW channels, timm's fast norm off) and its GELU modules after a 1x1 conv: the
    layer_norm op and conv2d + the activation in one kernel."""
    from timm.layers import LayerNorm2d, activations

    def make():
        model = nn.Sequential(LayerNorm2d(6), nn.Conv2d(6, 8, 1), getattr(activations, act)()).to(DEVICE)
        with torch.no_grad():
            model[0].weight.uniform_(0.5, 1.5), model[0].bias.uniform_(-0.5, 0.5)
        return model
    model, original, report = injected_pair(make, verify=False)
    assert not report.left, report.left
    gelu = "gelu" if act == "GELU" else "gelu_tanh"
    assert [r.kernel for r in report.replaced] == ["layer_norm (channels first)", f"conv2d+{gelu}"]
    x = torch.randn(2, 6, 5, 7, device=DEVICE)
    check_forward(model, original, x)
    check_backward(model, original, x)


def _blocks(drop_path: float = 0.0) -> nn.Module:
    from timm.models.convnext import ConvNeXtBlock
    model = nn.Sequential(*[ConvNeXtBlock(8, ls_init_value=0.5, drop_path=drop_path) for _ in range(2)]).to(DEVICE)
    with torch.no_grad():
        for block in model:
            block.norm.weight.uniform_(0.5, 1.5), block.norm.bias.uniform_(-0.5, 0.5), block.gamma.uniform_(0.2, 0.8)
    return model


def test_timm_convnext_block():
    """timm's ConvNeXtBlock (MLP of linears, channels-last LayerNorm) runs as nn.ConvNeXtBlock: verified, nothing
    left, the state_dict the original's; output and every gradient against float64; in training with drop path the
    original's rows dropped (the same draws from the same seed). A block of 1x1-conv MLP is injected layer by layer,
    with the reason."""
    x = torch.randn(2, 8, 7, 9, device=DEVICE)
    model, original, report = injected_pair(_blocks, example_inputs=x)
    assert [type(m).__module__ for m in model] == ["dropin.nn.convnext"] * 2 and not report.left
    assert report.verification.startswith("verified")
    assert list(model.state_dict()) == list(original.state_dict())
    check_forward(model, original, x)
    check_backward(model, original, x)
    trained, reference, _ = injected_pair(lambda: _blocks(0.5), train=True, verify=False)
    assert_same_random_draws(trained, reference, lambda m: m(x))
    from timm.models.convnext import ConvNeXtBlock
    model, original, report = injected_pair(lambda: nn.Sequential(ConvNeXtBlock(8, conv_mlp=True)).to(DEVICE),
                                            verify=False)
    assert type(model[0]).__module__.startswith("timm") and not report.left
    assert "its MLP is not timm's Mlp of linears" in report.notes[0].reason
    check_forward(model, original, x)
    dropin.revert_(trained)
    assert [type(m).__module__ for m in trained] == ["timm.models.convnext"] * 2


def _vit():
    return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             num_heads=2, embed_dim=32, num_classes=10).to(DEVICE)


def _swin():
    """Two stages of one block (the second's windows shifted)."""
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=32, window_size=4,
                             depths=(1, 1), num_heads=(1, 2), embed_dim=16, num_classes=10).to(DEVICE)


@pytest.mark.parametrize("make, names", [(_vit, ["blocks.0.attn", "blocks.1.attn"]),
                                         (_swin, ["layers.0.blocks.0.attn", "layers.1.blocks.0.attn"])],
                         ids=["vit", "swin"])
def test_timm_attention(make, names):
    """timm's Attention (ViT) and Swin's WindowAttention (relative position bias and shift mask) run dropin
    attention between their injected linears: verified, none left, output against float64; where autograd records,
    the Swin bias table's gradient takes timm's forward, and the gradients match float64 (ViT's with dropin's)."""
    x = torch.randn(2, 3, 32, 32, device=DEVICE)
    model, original, report = injected_pair(lambda: make().eval(), example_inputs=x)
    replaced = {r.name: r.kernel for r in report.replaced}
    for name in names:
        assert replaced[name] == model.get_submodule(name).kernel and "attention" in replaced[name]
    assert not any("Attention" in e.type for e in report.left + report.notes), report
    assert report.verification.startswith("verified")
    check_forward(model, original, x)
    check_backward(model, original, x)


@pytest.mark.parametrize("fmt", ["NCHW", "NHWC"])
@pytest.mark.parametrize("flatten", [False, True], ids=["kept", "flattened"])
def test_timm_fast_adaptive_avg_pool(flatten, fmt):
    """timm's FastAdaptiveAvgPool (the mean over H and W of NCHW, or NHWC: the Swin transformer's head) runs dropin's
    adaptive average pooling, its 1 x 1 kept in the input's format or flattened, after a linear: output and
    gradients against float64."""
    from timm.layers.adaptive_avgmax_pool import FastAdaptiveAvgPool
    x = torch.randn(2, 6, 5, 7, device=DEVICE)
    model, original, report = injected_pair(
        lambda: nn.Sequential(nn.Linear(7, 7), FastAdaptiveAvgPool(flatten, input_fmt=fmt)).to(DEVICE),
        example_inputs=x)
    assert [r.kernel for r in report.replaced] == ["linear", "adaptive_avg_pool2d"] and not report.left
    check_forward(model, original, x)
    check_backward(model, original, x)
