"""Handlers for models written in plain torch.nn (issue 26): ReLU6, Hardswish, Hardsigmoid, Sigmoid, LeakyReLU, Tanh,
Mish, ELU, SELU, CELU and Softplus as drop-ins and as conv / linear epilogues,
activations without a kernel named, subclasses that keep their base's forward, nn.MultiheadAttention's out_proj,
a CvT-style block whose forward reads its children's attributes, Dropout and Identity in eval."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dropin
from dropin import ops
from _check import check
from _tol import DEVICE, assert_close

from _models import check_backward, check_forward, injected_pair, randomize_batchnorms


def test_relu6_op_against_torch():
    """Values on both sides of both kinks (x * 4 reaches past 6), forward and backward; NaN stays NaN and the
    gradient at 0 and 6 is 0, as torch's."""
    check(lambda x: ops.activation(x, "relu6"), F.relu6, {"x": torch.randn(3, 7, 33, device=DEVICE) * 4})
    x = torch.tensor([float("nan"), 0.0, 6.0, -1.0, 3.0, 7.0], device=DEVICE, requires_grad=True)
    out = ops.activation(x, "relu6")
    assert_close(out, F.relu6(x.double()), x.dtype, "fwd")
    (grad,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert torch.equal(grad[1:], torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0], device=DEVICE))


def test_relu6_epilogues_of_linear_and_conv():
    """The fused epilogue's forward and backward (the activation's gradient inside the products' backward)."""
    check(lambda x, w, b: ops.linear(x, w, b, activation="relu6"), lambda x, w, b: F.relu6(F.linear(x, w, b)),
          {"x": torch.randn(5, 16, device=DEVICE) * 2, "w": torch.randn(8, 16, device=DEVICE),
           "b": torch.randn(8, device=DEVICE)})
    check(lambda x, w, b: ops.conv2d(x, w, b, padding=1, activation="relu6"),
          lambda x, w, b: F.relu6(F.conv2d(x, w, b, padding=1)),
          {"x": torch.randn(2, 3, 5, 5, device=DEVICE) * 2, "w": torch.randn(4, 3, 3, 3, device=DEVICE),
           "b": torch.randn(4, device=DEVICE)})


def _mobilenet_style():
    """MobileNetV2's pattern: conv -> BN -> ReLU6 (dense and depthwise), a linear + ReLU6 head."""
    return randomize_batchnorms(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
        nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.ReLU6(), nn.Flatten(), nn.Dropout(0.2),
        nn.Linear(4, 8), nn.Hardtanh(0.0, 6.0), nn.Linear(8, 4),
    )).to(DEVICE)


def test_mobilenet_style_relu6_fused_into_conv_and_linear():
    x = torch.randn(2, 3, 6, 6, device=DEVICE) * 4  # past ReLU6's upper kink: a plain ReLU would not match
    model = _mobilenet_style().eval()
    params = dict(model.named_parameters())
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert [(r.name, r.kernel, r.fused) for r in report.replaced] == [
        ("0", "conv2d+bn+relu6", ("1", "2")), ("3", "conv2d+bn+relu6", ("4", "5")), ("6", "conv2d+bn", ("7",)),
        ("8", "adaptive_avg_pool2d", ()), ("9", "relu6", ()), ("12", "linear+relu6", ("13",)), ("14", "linear", ())]
    assert report.left == [] and report.verification.startswith("verified")
    assert all(p is params[name] for name, p in injected.named_parameters()) and len(params) == len(
        list(injected.parameters()))
    check_forward(injected, original, x)
    check_backward(injected, original, x)


# torch's function of each activation whose kernel came after relu6's
TORCH_ACTIVATIONS = {"hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "sigmoid": torch.sigmoid,
                     "leaky_relu": F.leaky_relu, "tanh": torch.tanh, "mish": F.mish, "elu": F.elu, "selu": F.selu,
                     "celu": F.celu, "softplus": F.softplus}
# points beside -3, 0 and 3 where an activation has other edges: tanh's two formulas meet at 0.55, softplus's
# threshold is 20, the tails saturate
OTHER_KINKS = {"tanh": [0.5499, 0.55, -0.5501, 9.0, -30.0], "mish": [-30.0, 30.0, -1.19], "elu": [-1e-3, 1e-3, -20.0],
               "selu": [-1e-3, 1e-3, -20.0], "celu": [-1e-3, 1e-3, -20.0], "softplus": [19.5, 20.0, 20.5, -20.0]}


@pytest.mark.parametrize("name", list(TORCH_ACTIVATIONS))
def test_activation_against_torch_at_its_kinks(name):
    """Values on both sides of the kinks at -3, 0 and 3 (x * 4), forward and backward against float64; at the kinks
    themselves (selu's gradient at 0: alpha * scale, as torch's elu_backward), and for NaN, the values and gradients
    torch gives."""
    check(lambda x: ops.activation(x, name), TORCH_ACTIVATIONS[name], {"x": torch.randn(3, 7, 33, device=DEVICE) * 4})
    points = [-3.0, 3.0, -2.5, 0.0, 2.5, -4.0, 4.0] + OTHER_KINKS.get(name, [])
    x = torch.tensor(points, device=DEVICE, requires_grad=True)
    x_64 = torch.tensor(points, device=DEVICE, dtype=torch.float64, requires_grad=True)
    out, ref = ops.activation(x, name), TORCH_ACTIVATIONS[name](x_64)
    assert_close(out, ref, x.dtype, "fwd")
    (grad,), (grad_64,) = torch.autograd.grad(out, x, torch.ones_like(out)), torch.autograd.grad(
        ref, x_64, torch.ones_like(ref))
    assert_close(grad, grad_64, x.dtype, "bwd")
    nan = torch.tensor([float("nan")], device=DEVICE, requires_grad=True)
    outs = [(f(nan), torch.autograd.grad(f(nan), nan)[0]) for f in (lambda t: ops.activation(t, name),
                                                                    TORCH_ACTIVATIONS[name])]
    assert torch.isnan(outs[0][0]).all()  # (elu's gradient at NaN: scale, as torch's)
    torch.testing.assert_close(outs[0][1], outs[1][1], equal_nan=True)


@pytest.mark.parametrize("name", list(TORCH_ACTIVATIONS))
def test_activation_epilogues_of_linear_and_conv(name):
    """Each activation as the epilogue of a linear and of a conv, forward and backward in fp32; pre-activations of
    standard deviation ~4 (the tails and the middle). Sums of 30-45 terms: with 5-term sums the ratio of dropin's
    error to torch's varied so much that a rare draw went over the 2x rule (celu, selu, tanh, one each in three
    GPU suites; `probes/epilogue_grad_accuracy.py` at those sizes: none over in 600 draws, median ratio 0.8-1.0)."""
    act = TORCH_ACTIVATIONS[name]
    check(lambda x, w, b: ops.linear(x, w, b, activation=name), lambda x, w, b: act(F.linear(x, w, b)),
          {"x": torch.randn(33, 48, device=DEVICE) * 2, "w": torch.randn(24, 48, device=DEVICE) * 48 ** -0.5 * 2,
           "b": torch.randn(24, device=DEVICE)})
    check(lambda x, w, b: ops.conv2d(x, w, b, padding=1, activation=name),
          lambda x, w, b: act(F.conv2d(x, w, b, padding=1)),
          {"x": torch.randn(3, 5, 7, 7, device=DEVICE) * 2,
           "w": torch.randn(6, 5, 3, 3, device=DEVICE) * 45 ** -0.5 * 2, "b": torch.randn(6, device=DEVICE)})


def test_mobilenet_v3_style_hardswish_fused_into_conv_and_linear():
    """MobileNetV3's pattern: conv -> BN -> Hardswish, a linear + Hardswish head, a Hardsigmoid, a Sigmoid."""
    model = randomize_batchnorms(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.Hardswish(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8), nn.Hardsigmoid(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 8), nn.Hardswish(), nn.Linear(8, 4), nn.Sigmoid(),
    )).to(DEVICE).eval()
    x = torch.randn(2, 3, 6, 6, device=DEVICE) * 4
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert [(r.name, r.kernel, r.fused) for r in report.replaced] == [
        ("0", "conv2d+bn+hardswish", ("1", "2")), ("3", "conv2d+bn+hardsigmoid", ("4", "5")),
        ("6", "adaptive_avg_pool2d", ()), ("8", "linear+hardswish", ("9",)), ("10", "linear+sigmoid", ("11",))]
    assert report.left == [] and report.verification.startswith("verified")
    check_forward(injected, original, x)
    check_backward(injected, original, x)


def test_exp_activations_fused_into_conv_and_linear_and_alone():
    """Conv -> BN -> Mish (YOLOv4's), conv -> ELU, conv -> Tanh, linear -> SELU / CELU / Softplus fused; Softplus after
    a pooling and an ELU after a fused activation alone. inplace=True ones give the result torch's in-place call
    returns."""
    model = randomize_batchnorms(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.Mish(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), nn.ELU(inplace=True), nn.Conv2d(8, 8, 1), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Softplus(), nn.Flatten(), nn.Linear(8, 8), nn.SELU(inplace=True),
        nn.Linear(8, 8), nn.CELU(inplace=True), nn.Linear(8, 8), nn.Softplus(beta=1, threshold=20),
        nn.ELU(inplace=True), nn.Linear(8, 4),
    )).to(DEVICE).eval()
    x = torch.randn(2, 3, 6, 6, device=DEVICE) * 4
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert [(r.name, r.kernel, r.fused) for r in report.replaced] == [
        ("0", "conv2d+bn+mish", ("1", "2")), ("3", "conv2d+elu", ("4",)), ("5", "conv2d+tanh", ("6",)),
        ("7", "adaptive_avg_pool2d", ()), ("8", "softplus", ()), ("10", "linear+selu", ("11",)),
        ("12", "linear+celu", ("13",)), ("14", "linear+softplus", ("15",)), ("16", "elu", ()), ("17", "linear", ())]
    assert report.left == [] and report.verification.startswith("verified")
    check_forward(injected, original, x)
    check_backward(injected, original, x)


def test_activations_without_a_kernel_are_named():
    """PReLU has no kernel; an activation whose parameters are not the kernels' (torch's defaults) stays torch, the
    reason naming them."""
    model = nn.Sequential(nn.Linear(8, 8), nn.PReLU(), nn.Linear(8, 8), nn.ELU(alpha=0.5), nn.Hardtanh(-1.0, 1.0),
                          nn.LeakyReLU(0.2), nn.CELU(alpha=2.0), nn.Softplus(beta=2.0),
                          nn.Softplus(threshold=10.0)).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert [(r.name, r.kernel) for r in report.replaced] == [("0", "linear"), ("2", "linear")]
    left = {e.name: e.reason for e in report.left}
    assert set(left) == {"1", "3", "4", "5", "6", "7", "8"} and "no PReLU kernel" in left["1"]
    for name, parameter in (("3", "alpha=0.5"), ("4", "min_val=-1.0"), ("5", "negative_slope=0.2"), ("6", "alpha=2.0"),
                            ("7", "beta=2.0"), ("8", "threshold=10.0")):
        assert parameter in left[name] and "relu6" in left[name]  # (the module, then dropin's activations)
    check_forward(injected, original, x)


class _KeptLinear(nn.Linear):
    """A subclass that only renames: it computes as nn.Linear."""


class _KeptConv(nn.Conv2d):
    pass


class _KeptReLU(nn.ReLU):
    pass


class _ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


class _ScriptCastLinear(nn.Linear):
    """timm's Linear: a forward of its own that casts the weight only when TorchScript runs it."""

    def forward(self, x):
        if torch.jit.is_scripting():
            return F.linear(x, self.weight.to(dtype=x.dtype), bias=self.bias)
        return F.linear(x, self.weight, self.bias)


class _BiaslessLinear(nn.Linear):
    def forward(self, x):
        return F.linear(x, self.weight)


def test_subclasses_that_keep_the_forward_are_handled_as_their_base():
    """Subclasses that keep their base's forward, or (Linear) whose own forward calls F.linear on the input and their
    own weight and bias alone, are handled as the base; one that computes more, or leaves out its bias, stays torch."""
    def model():
        return randomize_batchnorms(nn.Sequential(
            _KeptConv(3, 4, 3, padding=1), nn.BatchNorm2d(4), _KeptReLU(), nn.Flatten(),
            _KeptLinear(4 * 4 * 4, 8), nn.ReLU(), _ScriptCastLinear(8, 8), _BiaslessLinear(8, 6),
            _BiaslessLinear(6, 5, bias=False), _ScaledLinear(5, 4))).to(DEVICE).eval()
    x = torch.randn(2, 3, 4, 4, device=DEVICE)
    injected, original, report = injected_pair(model, example_inputs=x)
    assert [(r.name, r.original, r.kernel) for r in report.replaced] == [
        ("0", "_KeptConv", "conv2d+bn+relu"), ("4", "_KeptLinear", "linear+relu"),
        ("6", "_ScriptCastLinear", "linear"), ("8", "_BiaslessLinear", "linear")]
    assert [(e.name, e.type) for e in report.left] == [("7", "_BiaslessLinear"), ("9", "_ScaledLinear")]
    assert all("forward of its own" in e.reason for e in report.left)
    check_forward(injected, original, x)


class _FastPathLayerNorm(nn.LayerNorm):
    """timm's LayerNorm: a forward of its own with a fast path that is off by default."""

    def __init__(self, *args, fast=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast = fast

    def forward(self, x):
        if self.fast:
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).clone()
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class _OtherEpsLayerNorm(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, 1e-3)


def test_layer_norm_subclasses_and_softmax_modules():
    """A LayerNorm subclass whose forward makes F.layer_norm's call on its own settings alone runs dropin's
    layer_norm (one on a path that computes more, or with another eps, stays torch); nn.Softmax and nn.LogSoftmax
    with a dim run dropin's kernels, output and gradients against float64; without a dim (torch picks it from the
    rank) they stay torch, named."""
    def model():
        return nn.Sequential(_FastPathLayerNorm(6), _FastPathLayerNorm(6, fast=True), _OtherEpsLayerNorm(6),
                             nn.Softmax(dim=-1), nn.LogSoftmax(dim=1), nn.Softmax()).to(DEVICE)
    x = torch.randn(3, 5, 6, device=DEVICE)
    injected, original, report = injected_pair(model, example_inputs=x)
    assert [(r.name, r.kernel) for r in report.replaced] == [("0", "layer_norm"), ("3", "softmax"),
                                                             ("4", "log_softmax")]
    assert [(e.name, e.type) for e in report.left] == [("1", "_FastPathLayerNorm"), ("2", "_OtherEpsLayerNorm"),
                                                       ("5", "Softmax")]
    assert "forward of its own" in report.left[0].reason and "dim=None" in report.left[2].reason
    check_forward(injected, original, x)
    check_backward(injected, original, x)


class _SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.attn(x, x, x, need_weights=False)[0])


def test_multihead_attention_out_proj_is_named_where_the_attention_stays_torch():
    """With op 'attention' off, nn.MultiheadAttention stays torch and reads its out_proj's tensors itself: a drop-in
    there would never run. (With it on, tests/inject/test_attention_modules.py.)"""
    x = torch.randn(2, 5, 8, device=DEVICE)
    injected, original, report = injected_pair(lambda: _SelfAttention().to(DEVICE).eval(), example_inputs=x,
                                               config=dropin.InjectConfig(ops={"linear"}))
    assert [r.name for r in report.replaced] == ["head"]
    assert [e.name for e in report.notes] == ["attn"] and "'attention' is switched off" in report.notes[0].reason
    assert [e.name for e in report.left] == ["attn.out_proj"] and "never calls" in report.left[0].reason
    check_forward(injected, original, x)


class _ConvProjection(nn.Module):
    """CvT's query / key / value projection: tokens -> image -> depthwise conv + BatchNorm -> tokens."""

    def __init__(self, dim, stride):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, stride, 1, groups=dim, bias=False)
        self.bn = nn.BatchNorm2d(dim)

    def forward(self, x, h, w):
        b, n, c = x.shape
        return self.bn(self.conv(x.transpose(1, 2).reshape(b, c, h, w))).flatten(2).transpose(1, 2)


class _ConvAttention(nn.Module):
    """Attention in einsum and softmax; it reads its projections' attributes (out_features, eps)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.conv_q, self.conv_k, self.conv_v = _ConvProjection(dim, 1), _ConvProjection(dim, 2), _ConvProjection(
            dim, 2)
        self.proj_q, self.proj_k, self.proj_v, self.proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, h, w):
        b, n, c = x.shape
        head_dim = self.proj_q.out_features // self.heads
        q, k, v = (proj(conv(x, h, w)).reshape(b, -1, self.heads, head_dim).transpose(1, 2) for proj, conv in (
            (self.proj_q, self.conv_q), (self.proj_k, self.conv_k), (self.proj_v, self.conv_v)))
        attn = (torch.einsum("bhld,bhtd->bhlt", q, k) * self.scale).softmax(-1)
        return self.proj(torch.einsum("bhlt,bhtd->bhld", attn, v).transpose(1, 2).reshape(b, n, c))


class _PlainCvt(nn.Module):
    """A CvT stage in plain torch.nn: conv embedding, LayerNorms (one applied with F.layer_norm on the module's
    own attributes), conv-projection attention, an MLP."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.embed, self.embed_norm = nn.Conv2d(3, dim, 3, 2, 1), nn.LayerNorm(dim)
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(dim, eps=1e-6), _ConvAttention(dim, heads), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * dim, dim))

    def forward(self, img):
        x = self.embed(img)
        b, c, h, w = x.shape
        x = self.embed_norm(x.flatten(2).transpose(1, 2))
        norm = self.norm1
        x = x + self.attn(F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps), h, w)
        return x + self.mlp(self.norm2(x))


def test_plain_torch_cvt_block_injects_and_verifies():
    """Its forward reads the attributes of children that became drop-ins: they answer as the originals."""
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    model = randomize_batchnorms(_PlainCvt()).to(DEVICE).eval()
    params = dict(model.named_parameters())
    injected, original, report = injected_pair(lambda: model, example_inputs=x)
    assert report.left == [] and report.verification.startswith("verified")
    kernels = {r.name: r.kernel for r in report.replaced}
    assert kernels["attn.conv_q.conv"] == "conv2d+bn" and "attn.conv_q.bn" not in kernels  # (a traced chain)
    assert kernels["mlp.0"] == "linear+gelu" and kernels["norm2"] == "layer_norm"
    assert injected.norm1.eps == 1e-6 and injected.attn.proj_q.out_features == 8
    assert isinstance(injected.norm1, dropin.nn.DropinModule)
    with pytest.raises(AttributeError):
        injected.norm1._not_an_attribute  # private names stay the drop-in's own
    assert all(p is params[name] for name, p in injected.named_parameters())
    check_forward(injected, original, x)


def test_dropout_and_identity_pass_through_in_eval():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Identity(), nn.ReLU6(), nn.Dropout1d(0.1),
                          nn.Linear(8, 4)).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    injected, original, report = injected_pair(lambda: model.eval(), example_inputs=x)
    assert [(r.name, r.kernel) for r in report.replaced] == [("0", "linear"), ("3", "relu6"), ("5", "linear")]
    assert report.left == [] and "Dropout" not in str(report) and "Identity" not in str(report)
    check_forward(injected, original, x)
    report = dropin.inject_(model.train(), verify=False)
    assert [e.name for e in report.left] == ["1", "4"]  # dropout computes in training mode


@pytest.mark.parametrize("size", [1, 5, (3,)], ids=["one", "five", "tuple"])
def test_adaptive_avg_pool1d(size):
    """nn.AdaptiveAvgPool1d (HF Swin's pooler: a [N, C, L] sequence to size 1) runs dropin's adaptive average pooling
    on a one-row image: batched and unbatched, after a linear, output and gradients against float64."""
    for shape in ((2, 8, 13), (8, 13)):
        x = torch.randn(*shape, device=DEVICE)
        injected, original, report = injected_pair(
            lambda: nn.Sequential(nn.Linear(13, 13), nn.AdaptiveAvgPool1d(size)).to(DEVICE), example_inputs=x)
        assert [r.kernel for r in report.replaced] == ["linear", "adaptive_avg_pool2d (one row)"] and not report.left
        check_forward(injected, original, x)
        check_backward(injected, original, x)
