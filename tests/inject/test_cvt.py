"""inject_ on HF CvT (tiny config, 2 stages): self-attention through dropin attention (its projections injected
inside it), depthwise conv projection + BatchNorm folded, Linear + GELU fused."""
import copy

import pytest
import torch

import dropin
import dropin.nn as dnn
from _tol import DEVICE, assert_close

from _models import assert_same_state, check_hf_backward, compiled_guards, randomize_batchnorms, snapshot

transformers = pytest.importorskip("transformers")


def tiny_cvt(attention_drop_rate: float = 0.0) -> torch.nn.Module:
    """Stage 1: 8 channels at 8x8, stage 2: 16 channels at 4x4 with the cls token, 3 layers in all."""
    two = lambda a, b: [a, b]  # noqa: E731
    config = transformers.CvtConfig(
        patch_sizes=two(7, 3), patch_stride=two(4, 2), patch_padding=two(2, 1), embed_dim=two(8, 16),
        num_heads=two(1, 2), depth=two(1, 2), mlp_ratio=two(4.0, 4.0),
        attention_drop_rate=two(attention_drop_rate, attention_drop_rate),
        drop_rate=two(0.0, 0.0), drop_path_rate=two(0.0, 0.0), qkv_bias=two(True, True), cls_token=two(False, True),
        qkv_projection_method=two("dw_bn", "dw_bn"), kernel_qkv=two(3, 3), padding_kv=two(1, 1),
        stride_kv=two(2, 2), padding_q=two(1, 1), stride_q=two(1, 1), num_labels=5)
    return randomize_batchnorms(transformers.CvtForImageClassification(config)).to(DEVICE).eval()


def pixels(batch=2):
    return torch.randn(batch, 3, 32, 32, device=DEVICE)


def test_cvt_fused_verified_and_hf_forward_unchanged():
    model = tiny_cvt()
    original, x = copy.deepcopy(model), pixels()
    report = dropin.inject_(model, example_inputs=x)
    kernels = [r.kernel for r in report.replaced]
    assert kernels.count("conv2d+bn") == 9 and kernels.count("linear+gelu") == 3  # q, k, v per layer; MLPs
    assert kernels.count("conv2d") == 2 and kernels.count("linear") == 3 * 5 + 1  # embeddings; q/k/v/out/MLP out
    assert kernels.count("attention") == 3
    attention = model.cvt.encoder.stages[1].layers[0].attention.attention
    assert isinstance(attention, dnn.CvtSelfAttention) and isinstance(attention.projection_query, dnn.Linear)
    where = "cvt.encoder.stages.0.layers.0.attention.attention.convolution_projection_query.convolution_projection."
    fold = next(r for r in report.replaced if r.name == where + "convolution")
    assert fold.fused == (where + "normalization",)
    assert kernels.count("layer_norm") > 0 and report.left == [] and report.verification.startswith("verified")
    with torch.no_grad():
        logits, ref = model(pixel_values=x).logits, copy.deepcopy(original).double()(pixel_values=x.double()).logits
    assert_close(logits, ref, torch.float32, "fwd")


def test_cvt_class_token_rows_without_concatenation(monkeypatch):
    """In inference the q/k/v conv projections write their rows after the class token's (conv2d out=): no
    torch.cat but the stage's own (HF's CvtStage adds the token); with autograd on, or a hook on a module the
    shortcut passes by, the concatenations are back. Every way is checked against float64."""
    model = tiny_cvt()
    ref = copy.deepcopy(model).double()
    dropin.inject_(model, verify=False)
    x = pixels()
    with torch.no_grad():
        ref = ref(pixel_values=x.double()).logits
    cat, cats = torch.cat, []
    monkeypatch.setattr(torch, "cat", lambda *a, **k: cats.append(1) or cat(*a, **k))
    projection = model.cvt.encoder.stages[1].layers[0].attention.attention.convolution_projection_key
    for grad, hook, expected in ((False, False, 1), (True, False, 1 + 2 * 3), (False, True, 1 + 1)):
        cats.clear()
        handle = projection.register_forward_hook(lambda *a: None) if hook else None
        with torch.set_grad_enabled(grad):
            logits = model(pixel_values=x).logits
        handle and handle.remove()
        assert len(cats) == expected, (grad, hook)
        assert_close(logits.detach(), ref, torch.float32, "fwd")


def test_cvt_state_dict_and_revert():
    model = tiny_cvt()
    state, x = snapshot(model), pixels()
    with torch.no_grad():
        before = model(pixel_values=x).logits
    dropin.inject_(model, verify=False)
    assert_same_state(model, state)
    dropin.revert_(model)
    assert not any(isinstance(m, dnn.DropinModule) for m in model.modules())
    assert_same_state(model, state)
    with torch.no_grad():
        assert torch.equal(model(pixel_values=x).logits, before)


def test_cvt_training_backward_matches_torch():
    """Training mode: the BatchNorms use batch statistics (not folded: dropin's batch_norm kernel); gradients flow
    through the dropin depthwise convs, norms and fused linears."""
    model = tiny_cvt().train()
    original = copy.deepcopy(model)
    report = dropin.inject_(model, example_inputs=pixels())
    kernels = [r.kernel for r in report.replaced]
    assert report.left == [] and kernels.count("batch_norm") == 9  # batch statistics: not folded, dropin's own
    layer = "cvt.encoder.stages.1.layers.1."
    check_hf_backward(model, original, {"pixel_values": pixels()}, "logits", [
        "cvt.encoder.stages.0.embedding.convolution_embeddings.projection.weight",
        layer + "attention.attention.convolution_projection_key.convolution_projection.convolution.weight",
        layer + "attention.attention.convolution_projection_key.convolution_projection.normalization.weight",
        layer + "attention.attention.projection_query.weight", layer + "intermediate.dense.weight",
        layer + "intermediate.dense.bias", layer + "output.dense.weight", "classifier.weight"])


def test_cvt_attention_dropout():
    """Attention dropout in training mode: the attention stays torch (with the reason); a model injected in eval mode
    and switched to training raises rather than skip the dropout."""
    report = dropin.inject_(tiny_cvt(attention_drop_rate=0.1).train(), verify=False)
    left = [e for e in report.notes if e.type == "CvtSelfAttention"]
    assert len(left) == 3 and "attention dropout 0.1 in training mode" in left[0].reason
    assert "attention" not in [r.kernel for r in report.replaced]
    model = tiny_cvt(attention_drop_rate=0.1)
    dropin.inject_(model, verify=False)
    with torch.no_grad():
        model(pixel_values=pixels())  # eval: no dropout
        with pytest.raises(RuntimeError, match="attention dropout p=0.1 in training mode"):
            model.train()(pixel_values=pixels())


def test_compiled_guards_come_from_no_getattr():
    """Compiled, the attention drop-in reads its projections from the module dict: no guard from tracing
    DropinModule's own __getattr__ (each lookup through it is guarded on every call)."""
    model = tiny_cvt()
    dropin.inject_(model, verify=False)
    guards = compiled_guards(model, pixels())
    assert guards and not [g for g in guards if "in __getattr__" in g]
