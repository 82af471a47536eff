"""inject_ on HF attention modules that hand q, k and v to HF's attention interface (BERT's self-attention, ViT's
attention, GPT-2's self-attention): dropin attention in their place, verified against float64 with masks, causal,
a cache; torch's forward where a call asks for attention dropout in training or weights; the settings dropin does
not follow stay torch with the reason."""
import copy

import pytest
import torch

import dropin
import dropin.nn as dnn
from dropin.ops.attention import attention_ref
from _tol import DEVICE, assert_close

from _models import check_hf_backward

transformers = pytest.importorskip("transformers")

VOCAB = 100


def tiny(family: str, dropout: float = 0.0, attn_implementation: str = "sdpa"):
    """(model, its inputs as keyword arguments, the attention modules' names): 2 layers; BERT's and GPT-2's tokens
    with padding at the end of the second sequence."""
    tokens = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    padding = torch.ones(2, 9, dtype=torch.long, device=DEVICE)
    padding[1, 6:] = 0
    if family == "bert":
        config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=96, vocab_size=VOCAB, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=dropout)
        inputs, names = {"input_ids": tokens, "attention_mask": padding}, "encoder.layer.{}.attention.self"
    elif family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=16, vocab_size=VOCAB,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=dropout, use_cache=False)
        inputs, names = {"input_ids": tokens, "attention_mask": padding}, "h.{}.attn"
    elif family == "swin":  # (one block a stage: the first stage's windows unshifted, the second's shifted)
        config = transformers.SwinConfig(embed_dim=16, depths=[1, 1], num_heads=[1, 2], image_size=32, patch_size=4,
                                         window_size=4, attention_probs_dropout_prob=dropout)
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32, device=DEVICE)}
        names = "encoder.layers.{}.blocks.0.attention"
    else:
        config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, image_size=32, patch_size=8,
                                        attention_probs_dropout_prob=dropout, hidden_dropout_prob=0.0)
        inputs, names = {"pixel_values": torch.randn(2, 3, 32, 32, device=DEVICE)}, "layers.{}.attention"
    model = transformers.AutoModel.from_config(config, attn_implementation=attn_implementation).to(DEVICE)
    return model.eval(), inputs, [names.format(i) for i in range(2)]


def _output(model, inputs):
    return model(**inputs).last_hidden_state


@pytest.mark.parametrize("family", ["bert", "vit", "swin", "gpt2"])
def test_attention_injected_and_verified(family):
    """The attention modules run dropin attention (none left to torch, nor Swin's position bias), the injected model
    verifies, and its output matches float64 with the padding mask (BERT, GPT-2), Swin's relative position bias
    and shift mask, or no mask (ViT's)."""
    model, inputs, names = tiny(family)
    original = copy.deepcopy(model)
    report = dropin.inject_(model, example_inputs=next(iter(inputs.values())))  # (GPT-2's second argument: a cache)
    replaced = {r.name: (r.original, r.kernel) for r in report.replaced}
    for name in names:
        assert isinstance(model.get_submodule(name), dnn.sdpa_attention.SdpaAttention)
        assert replaced[name][1] == model.get_submodule(name).kernel
    assert not any("Attention" in e.type or "Bias" in e.type for e in report.left + report.notes), report
    assert report.verification.startswith("verified"), report.verification
    with torch.no_grad():
        out = _output(model, inputs)
        ref = _output(copy.deepcopy(original).double(), {k: v.double() if v.is_floating_point() else v
                                                          for k, v in inputs.items()})
    assert_close(out, ref, torch.float32, "fwd")


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_training_backward_matches_torch(family):
    """Training mode without attention dropout: dropin attention, and the gradients of the projections against
    float64."""
    model, inputs, names = tiny(family)
    model.train()
    original = copy.deepcopy(model)
    dropin.inject_(model, verify=False)
    projection = {"bert": ".query.weight", "gpt2": ".c_attn.weight"}[family]
    check_hf_backward(model, original, inputs, "last_hidden_state", [names[1] + projection, names[0] + projection])


def test_attention_dropout_in_training_runs_torch_forward(monkeypatch):
    """BERT's default attention dropout (0.1): in training the original's forward runs (torch's attention with its
    dropout); in eval dropin attention does."""
    model, inputs, names = tiny("bert", dropout=0.1)
    dropin.inject_(model, verify=False)
    calls = []
    monkeypatch.setattr(dnn.sdpa_attention, "attention", lambda *a, **k: calls.append(1) or attention_ref(*a, **k))
    torch_calls = []
    for name in names:
        original = model.get_submodule(name).original
        original.register_forward_hook(lambda *args: torch_calls.append(1))
    model.train()
    _output(model, inputs).sum().backward()
    assert torch_calls == [1, 1] and calls == []
    model.eval()
    with torch.no_grad():
        _output(model, inputs)
    assert torch_calls == [1, 1] and calls == [1, 1]


def test_swin_bias_with_a_gradient_runs_torch_forward():
    """Swin's relative position bias table needs a gradient where autograd records (dropin attention gives none for
    a mask): torch's forward runs, and the gradients match float64; without autograd, dropin attention."""
    model, inputs, names = tiny("swin")
    original = copy.deepcopy(model)
    dropin.inject_(model, verify=False)
    table = ".relative_position_bias.relative_position_bias_table"
    check_hf_backward(model, original, inputs, "last_hidden_state", [names[1] + table, names[1] + ".q_proj.weight"])


def test_gpt2_decoding_with_a_cache():
    """GPT-2 prefill and two decoding steps through HF's cache (one query row: not causal), against float64."""
    model, _, _ = tiny("gpt2")
    original = copy.deepcopy(model).double()
    dropin.inject_(model, verify=False)
    tokens = torch.randint(0, VOCAB, (2, 5), device=DEVICE)
    with torch.no_grad():
        out, ref = model(input_ids=tokens, use_cache=True), original(input_ids=tokens, use_cache=True)
        for _ in range(2):
            assert_close(out.last_hidden_state, ref.last_hidden_state, torch.float32, "fwd")
            step = torch.randint(0, VOCAB, (2, 1), device=DEVICE)
            out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
            ref = original(input_ids=step, past_key_values=ref.past_key_values, use_cache=True)


def test_settings_dropin_does_not_follow_stay_torch():
    """HF's eager attention implementation (it returns the weights) and GPT-2's cross-attention stay torch, named
    with the reason; their projections are injected."""
    model, _, names = tiny("bert", attn_implementation="eager")
    report = dropin.inject_(model, verify=False)
    reasons = {e.name: e.reason for e in report.notes + report.left}
    assert all("attn_implementation 'eager'" in reasons[name] for name in names), reasons
    assert {r.name for r in report.replaced} >= {names[0] + ".query", names[0] + ".value"}
    cross = transformers.models.gpt2.modeling_gpt2.GPT2Attention(transformers.GPT2Config(n_embd=64, n_head=4),
                                                                is_cross_attention=True, layer_idx=0)
    cross.config._attn_implementation = "sdpa"
    holder = torch.nn.Sequential(cross).to(DEVICE)
    report = dropin.inject_(holder, verify=False)
    assert any("cross-attention" in e.reason for e in report.notes + report.left), report


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_torch_compile_fullgraph(family):
    """torch.compile(fullgraph=True) traces the injected attention (Dynamo; the captured graph runs eagerly): no
    graph break, the output as eager's."""
    model, inputs, _ = tiny(family)
    dropin.inject_(model, verify=False)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert_close(_output(compiled, inputs), _output(model, inputs).double(), torch.float32, "fwd")
