"""HF's activation modules (transformers.activations) injected by what each computes (issue 26): dropin's gelu,
gelu_tanh, silu or mish, alone or fused into a preceding linear; those without a dropin kernel named with the reason."""
import pytest
import torch
from torch import nn

from dropin.ops.activations import activation_ref
from _tol import DEVICE, rel_err

from _models import check_backward, check_forward, injected_pair

hf = pytest.importorskip("transformers.activations")

MAPPED = [  # (the module, the dropin activation its forward computes)
    (lambda: hf.GELUActivation(), "gelu"),
    (lambda: hf.GELUActivation(use_gelu_python=True), "gelu"),
    (lambda: hf.GELUTanh(), "gelu_tanh"),
    (lambda: hf.GELUTanh(use_gelu_tanh_python=True), "gelu_tanh"),
    (lambda: hf.PytorchGELUTanh(), "gelu_tanh"),
    (lambda: hf.NewGELUActivation(), "gelu_tanh"),
    (lambda: hf.FastGELUActivation(), "gelu_tanh"),
    (lambda: hf.AccurateGELUActivation(), "gelu_tanh"),
    (lambda: hf.SiLUActivation(), "silu"),
    (lambda: hf.MishActivation(), "mish"),
    (lambda: _python_mish(), "mish"),
]
IDS = ["gelu", "gelu_python", "gelu_tanh", "gelu_tanh_python", "pytorch_gelu_tanh", "new_gelu", "fast_gelu",
       "accurate_gelu", "silu", "mish", "mish_python"]


def _python_mish():
    """MishActivation as older torch versions had it: x * tanh(softplus(x)) in Python."""
    act = hf.MishActivation()
    act.act = act._mish_python
    return act


class _Block(nn.Module):
    """BERT's intermediate and output layers: linear -> activation as an nn.Sequential (fusable), then the
    activation as an attribute called alone after a LayerNorm."""

    def __init__(self, make_activation):
        super().__init__()
        self.up = nn.Sequential(nn.Linear(8, 16), make_activation())
        self.norm, self.act, self.down = nn.LayerNorm(16), make_activation(), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.act(self.norm(self.up(x))))


@pytest.mark.parametrize("make, name", MAPPED, ids=IDS)
def test_hf_activation_computes_what_it_is_mapped_to(make, name):
    """Each class's forward against torch's activation in float64 (FastGELU's rounded constant: 4e-12 apart)."""
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    assert rel_err(make()(x), activation_ref(x, name)) < 1e-10


def test_quick_gelu_is_no_gelu():
    """QuickGELU (x * sigmoid(1.702 x)) is another function: it stays torch."""
    x = torch.linspace(-8, 8, 1001, dtype=torch.float64)
    assert all(rel_err(hf.QuickGELUActivation()(x), activation_ref(x, n)) > 1e-3 for n in ("gelu", "gelu_tanh"))


@pytest.mark.parametrize("make, name", MAPPED, ids=IDS)
def test_hf_activations_injected_alone_and_fused(make, name):
    x = torch.randn(3, 8, device=DEVICE) * 3
    model = _Block(make).to(DEVICE)
    params, keys = dict(model.named_parameters()), list(model.state_dict())
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert [(r.name, r.kernel) for r in report.replaced] == [
        ("up.0", f"linear+{name}"), ("norm", "layer_norm"), ("act", name), ("down", "linear")]
    assert report.left == [] and report.verification.startswith("verified")
    assert all(p is params[n] for n, p in injected.named_parameters()) and list(injected.state_dict()) == keys
    check_forward(injected, original, x)
    injected.train()
    check_backward(injected, original.train(), x)


def test_hf_activations_without_a_kernel_are_named():
    model = nn.Sequential(nn.Linear(8, 8), hf.QuickGELUActivation(), hf.ClippedGELUActivation(-1.0, 1.0),
                          hf.ReLUSquaredActivation(), hf.LinearActivation(), nn.Linear(8, 4)).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert [(r.name, r.kernel) for r in report.replaced] == [("0", "linear"), ("5", "linear")]
    assert {e.name: e.type for e in report.left} == {
        "1": "QuickGELUActivation", "2": "ClippedGELUActivation", "3": "ReLUSquaredActivation"}
    assert all(f"no {e.type} kernel" in e.reason for e in report.left)
    check_forward(injected, original, x)


def test_hf_activation_with_a_forward_replaced_on_the_instance_stays_torch():
    """A forward set on the instance (as kernels' kernelize does) may compute anything: not mapped."""
    act = hf.GELUActivation()
    act.forward = torch.tanh
    injected, original, report = injected_pair(lambda: nn.Sequential(act, nn.Linear(8, 4)).to(DEVICE), verify=False)
    assert [(e.name, e.type) for e in report.left] == [("0", "GELUActivation")]
    check_forward(injected, original, torch.randn(4, 8, device=DEVICE))


@pytest.mark.parametrize("data_format", ["channels_first", "channels_last"])
@pytest.mark.parametrize("family", ["convnext", "convnextv2"])
def test_hf_convnext_layer_norm(family, data_format):
    """HF ConvNeXt's (and V2's) LayerNorm, channels first ([N, C, H, W]) or last, runs dropin's layer_norm."""
    module = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    norm = {"convnext": "ConvNextLayerNorm", "convnextv2": "ConvNextV2LayerNorm"}[family]
    make = lambda: getattr(module, norm)(6, eps=1e-6, data_format=data_format).to(DEVICE)  # noqa: E731
    model, original, report = injected_pair(lambda: nn.Sequential(make()), verify=False)
    assert not report.left and model[0].kernel.startswith("layer_norm")
    x = torch.randn(2, 6, 5, 7, device=DEVICE)
    x = x if data_format == "channels_first" else x.permute(0, 2, 3, 1)
    check_forward(model, original, x)
    check_backward(model, original, x)
