"""nn.MultiheadAttention, nn.TransformerEncoderLayer and nn.TransformerEncoder (also inside nn.Transformer) injected
(issue 26): dropin linear + attention against torch in float64, with masks (bool and float, merged as torch merges
them), batch first or not, batched or not, cross attention; calls that ask for the attention weights run torch; what
stays torch is named with its reason."""
import pytest
import torch
from torch import nn

import dropin
from dropin.inject import VerificationError
from _tol import DEVICE

from _models import check_backward, check_forward, injected_pair

E, H, L, B = 8, 2, 5, 2  # embed dim, heads, tokens, batch


class _Attend(nn.Module):
    """Self-attention (or cross attention on `memory`) through an nn.MultiheadAttention with fixed masks (buffers:
    .double() converts the float ones with the model) and call arguments."""

    def __init__(self, attention: nn.MultiheadAttention, attn_mask=None, key_padding_mask=None, memory=None,
                 **call):
        super().__init__()
        self.attn, self.call = attention, call
        self.register_buffer("attn_mask", attn_mask)
        self.register_buffer("key_padding_mask", key_padding_mask)
        self.register_buffer("memory", memory)

    def forward(self, x):
        kv = x if self.memory is None else self.memory
        out = self.attn(x, kv, kv, attn_mask=self.attn_mask, key_padding_mask=self.key_padding_mask, **self.call)
        return out if self.call.get("need_weights", True) else out[0]


def _masks(kind: str, batch: int = B) -> dict:
    """Masks for L queries over L keys: each query keeps itself, the last key of batch 0 is padding (the fixed seed
    leaves no row masked whole)."""
    gen = torch.Generator().manual_seed(0)
    blocked = (torch.rand(L, L, generator=gen) > 0.6) & ~torch.eye(L, dtype=torch.bool)
    padding = torch.zeros(batch, L, dtype=torch.bool)
    padding[0, -1] = True
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    per_head = torch.randn(batch * H, L, L, generator=gen)
    masks = {
        "none": {},
        "key_padding_bool": dict(key_padding_mask=padding),
        "attn_bool": dict(attn_mask=blocked),
        "both_bool": dict(attn_mask=blocked, key_padding_mask=padding),
        "both_float_per_head": dict(attn_mask=per_head, key_padding_mask=padding.float() * -1e4),
        "causal_hint": dict(attn_mask=causal, is_causal=True),
        "causal_hint_with_padding": dict(attn_mask=causal, key_padding_mask=padding.float() * -1e9, is_causal=True),
    }[kind]
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in masks.items()}


def _attend(batch_first=True, masks="none", need_weights=False, **mha):
    return lambda: _Attend(nn.MultiheadAttention(E, H, batch_first=batch_first, **mha),
                           need_weights=need_weights, **_masks(masks)).to(DEVICE)


def _tokens(batch_first=True):
    return torch.randn(*((B, L) if batch_first else (L, B)), E, device=DEVICE)


@pytest.mark.parametrize("masks", ["none", "key_padding_bool", "attn_bool", "both_bool", "both_float_per_head",
                                   "causal_hint", "causal_hint_with_padding"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_multihead_attention_against_torch(batch_first, masks):
    x = _tokens(batch_first)
    injected, original, report = injected_pair(_attend(batch_first, masks), example_inputs=x)
    assert [(r.name, r.original) for r in report.replaced] == [("attn", "MultiheadAttention")]
    assert report.left == [] and report.verification.startswith("verified")
    assert isinstance(injected.attn, dropin.nn.MultiheadAttention)
    check_forward(injected, original, x)


@pytest.mark.parametrize("masks", ["both_bool", "causal_hint"])
def test_multihead_attention_gradients_in_training_mode(masks):
    """dropout=0 (the default): the input's and every parameter's gradient (in_proj, out_proj) against float64."""
    x = _tokens()
    injected, original, report = injected_pair(_attend(masks=masks), train=True)
    assert [r.name for r in report.replaced] == ["attn"]
    check_backward(injected, original, x)


def test_multihead_attention_unbatched_and_without_bias():
    x = torch.randn(L, E, device=DEVICE)
    def make():
        return _Attend(nn.MultiheadAttention(E, H, bias=False), attn_mask=_masks("attn_bool")["attn_mask"],
                       key_padding_mask=_masks("key_padding_bool", 1)["key_padding_mask"][0],
                       need_weights=False).to(DEVICE)
    injected, original, report = injected_pair(make, example_inputs=x)
    assert [r.name for r in report.replaced] == ["attn"] and report.verification.startswith("verified")
    check_forward(injected, original, x)


def test_multihead_attention_cross_attention_with_own_key_and_value_dims():
    """Queries over another sequence of another length, keys and values of their own widths (kdim, vdim: the
    module's q/k/v_proj_weight): one linear per projection."""
    memory = torch.randn(B, L + 2, 6, device=DEVICE)
    def make():
        return _Attend(nn.MultiheadAttention(E, H, batch_first=True, kdim=6, vdim=6), memory=memory,
                       need_weights=False).to(DEVICE)
    x = _tokens()
    injected, original, report = injected_pair(make, train=True)
    assert [r.name for r in report.replaced] == ["attn"]
    check_backward(injected, original, x)


def test_multihead_attention_keeps_parameters_and_state_dict_keys():
    model = _attend()()
    params, keys = dict(model.named_parameters()), list(model.state_dict())
    dropin.inject_(model, verify=False)
    assert list(model.state_dict()) == keys
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[name] for name, p in model.named_parameters())
    dropin.revert_(model)
    assert type(model.attn) is nn.MultiheadAttention and list(model.state_dict()) == keys


def test_multihead_attention_calls_that_need_weights_run_torch(monkeypatch):
    """need_weights=True (the module's default) returns torch's output and weights: dropin attention has none."""
    x = _tokens()
    injected, original, report = injected_pair(_attend(masks="both_bool", need_weights=True, dropout=0.0),
                                               example_inputs=x)
    assert [r.name for r in report.replaced] == ["attn"] and "need_weights=True" in report.replaced[0].kernel
    monkeypatch.setattr(dropin.nn.transformer, "attention", None)  # dropin attention is not called
    with torch.no_grad():
        (out, weights), (ref, ref_weights) = injected(x), original(x)
    assert torch.equal(out, ref) and torch.equal(weights, ref_weights)


@pytest.mark.parametrize("mha, train, reason", [
    (dict(add_bias_kv=True), False, "add_bias_kv"),
    (dict(add_zero_attn=True), False, "add_zero_attn"),
    (dict(dropout=0.1), True, "dropout 0.1 in training mode"),
])
def test_multihead_attention_left_to_torch_with_reason(mha, train, reason):
    x = _tokens()
    injected, original, report = injected_pair(_attend(**mha), train=train, verify=False)
    assert report.replaced == []
    assert [e.name for e in report.notes] == ["attn"] and reason in report.notes[0].reason
    assert [e.name for e in report.left] == ["attn.out_proj"]  # read by torch's forward, never called
    torch.manual_seed(0)
    out = injected(x)
    torch.manual_seed(0)
    assert torch.equal(out, original(x))


def test_torchvision_vit_runs_its_attention_in_dropin():
    """torchvision's VisionTransformer (its EncoderBlock calls nn.MultiheadAttention with need_weights=False): nothing
    left to torch; output in eval mode and gradients in training mode against float64."""
    vit = pytest.importorskip("torchvision.models.vision_transformer")
    img = torch.randn(2, 3, 8, 8, device=DEVICE)
    def make():
        return vit.VisionTransformer(image_size=8, patch_size=4, num_layers=1, num_heads=H, hidden_dim=E, mlp_dim=16,
                                     num_classes=3).to(DEVICE).eval()
    injected, original, report = injected_pair(make, example_inputs=img)
    assert report.left == [] and report.verification.startswith("verified")
    kernels = {r.name: r.kernel for r in report.replaced}
    block = "encoder.layers.encoder_layer_0"
    assert kernels[f"{block}.self_attention"].startswith("linear(q, k, v) + attention")
    assert kernels[f"{block}.mlp.0"] == "linear+gelu"
    check_forward(injected, original, img)
    check_backward(injected.train(), original.train(), img)


class _Encoder(nn.Module):
    def __init__(self, norm_first: bool, activation="relu", masks="none"):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, activation=activation,
                                                batch_first=True, norm_first=norm_first)
        masks = _masks(masks)
        self.register_buffer("src_mask", masks.get("attn_mask"))
        self.register_buffer("src_key_padding_mask", masks.get("key_padding_mask"))

    def forward(self, x):
        return self.layer(x, self.src_mask, self.src_key_padding_mask)


@pytest.mark.parametrize("norm_first, activation, masks", [(False, "relu", "key_padding_bool"),
                                                          (True, "gelu", "both_bool")])
def test_transformer_encoder_layer_runs_dropin_not_torch_fused_kernel(norm_first, activation, masks, monkeypatch):
    """In eval mode without autograd the original takes torch's fused kernel (torch._transformer_encoder_layer_fwd);
    the injected layer runs its eager path on its drop-ins, and matches in float64, gradients too."""
    x = _tokens()
    injected, original, report = injected_pair(lambda: _Encoder(norm_first, activation, masks).to(DEVICE).eval(),
                                               example_inputs=x)
    assert report.left == [] and report.verification.startswith("verified")
    kernels = {r.name: r.kernel for r in report.replaced}
    assert set(kernels) == {"layer", "layer.self_attn", "layer.linear1", "layer.linear2", "layer.norm1",
                            "layer.norm2"}
    fused_calls = []
    fused = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a: fused_calls.append(1) or fused(*a))
    with torch.no_grad():
        original(x)
        assert fused_calls == [1]  # the original's path
        injected(x)
        assert fused_calls == [1]  # not the injected one's
    check_forward(injected, original, x, reference_grad=True)  # (torch's eager path: its fused one is 3e-5 off)
    check_backward(injected.train(), original.train(), x)


class _Stack(nn.Module):
    """nn.TransformerEncoder (nested tensors enabled: its default) with a final norm, called with a padding mask."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(E))
        self.register_buffer("padding", _masks("key_padding_bool")["key_padding_mask"])

    def forward(self, x):
        return self.encoder(x, src_key_padding_mask=self.padding)


def test_transformer_encoder_with_padding_and_revert():
    """In eval mode without autograd torch runs the layers on a nested tensor (zeros at the padded positions before
    the final norm); the injected encoder runs its drop-in layers on the padding mask and gives the same. In training
    mode, the gradients. revert_ puts the torch modules back."""
    x = _tokens()
    injected, original, report = injected_pair(lambda: _Stack().to(DEVICE).eval(), example_inputs=x)
    assert report.left == [] and report.verification.startswith("verified")
    assert {"encoder", "encoder.layers.0", "encoder.layers.1.self_attn", "encoder.norm"} <= {
        r.name for r in report.replaced}
    with torch.no_grad():
        padded_row = original(x)[0, -1]
    assert torch.allclose(padded_row, original.encoder.norm.bias)  # torch's nested path: LayerNorm of zeros
    check_forward(injected, original, x)
    check_backward(injected.train(), original.train(), x)
    dropin.revert_(injected)
    assert type(injected.encoder) is nn.TransformerEncoder
    assert all(type(m) is nn.TransformerEncoderLayer for m in injected.encoder.layers)
    assert type(injected.encoder.layers[0].self_attn) is nn.MultiheadAttention


def test_verification_names_the_diverging_module_past_nested_tensors(monkeypatch):
    """Without the zeros at the padded positions the injected encoder diverges from torch's nested path; the
    verification names the first module whose output diverged, passing over the layers' outputs that are nested
    tensors in torch's run."""
    monkeypatch.setattr(dropin.nn.transformer, "_torch_pads_with_zeros", lambda *args: False)
    with pytest.raises(VerificationError, match="first replaced module whose output diverged: 'encoder.norm'"):
        dropin.inject_(_Stack().to(DEVICE).eval(), example_inputs=_tokens())


def test_transformer_encoder_layer_float_masks_in_training_mode():
    """Float masks checked where the original runs its eager path (torch's fused CPU kernel returns NaN for a
    float mask with nonzero entries, torch 2.14)."""
    x = _tokens()
    injected, original, report = injected_pair(lambda: _Encoder(True, "gelu", "both_float_per_head").to(DEVICE),
                                               train=True)
    assert report.left == [] and [r.name for r in report.replaced][:2] == ["layer", "layer.self_attn"]
    check_backward(injected, original, x)


class _Seq2Seq(nn.Module):
    """nn.Transformer: the decoder's causal self-attention (the is_causal hint) and its cross attention over the
    encoder's output (queries of another length; key is value)."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(E, H, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16,
                                          dropout=0.0, batch_first=True)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(3))

    def forward(self, x):
        return self.transformer(x, x[:, :3], tgt_mask=self.causal, tgt_is_causal=True)


def test_nn_transformer_encoder_and_decoder():
    x = _tokens()
    injected, original, report = injected_pair(lambda: _Seq2Seq().to(DEVICE).eval(), example_inputs=x)
    assert report.left == [] and report.verification.startswith("verified")
    attention = {r.name for r in report.replaced if r.original == "MultiheadAttention"}
    assert attention == {"transformer.encoder.layers.0.self_attn", "transformer.decoder.layers.0.self_attn",
                         "transformer.decoder.layers.0.multihead_attn"}
    check_forward(injected, original, x)
    check_backward(injected.train(), original.train(), x)
