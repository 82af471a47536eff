"""inject_ on HF families beside Llama (tiny configs): Mistral, Qwen2, Gemma and Gemma2 taken by what their modules
compute (Gemma's `1 + weight` RMSNorm, its GELU-tanh gated MLP), GPT-2's Conv1D with its GELU fused; verification,
logits and gradients against float64, revert, state_dict, and classes recognized by their code alone."""
import copy
import inspect

import pytest
import torch
from torch import nn

import dropin
import dropin.nn as dnn
from dropin.ops.rms_norm import rms_norm_ref
from _tol import DEVICE, assert_close

from _models import assert_same_random_draws, assert_same_state, check_hf_backward, injected_pair, snapshot

transformers = pytest.importorskip("transformers")

VOCAB = 100
ATTENTION = "linear(q, k, v) + rope + attention + linear(o)"
DECODER = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, vocab_size=VOCAB)
# family -> (config class, model class, config extras, the kernels of one layer's modules)
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {},
                {"self_attn": ATTENTION, "mlp": "swiglu_mlp", "input_layernorm": "rms_norm",
                 "post_attention_layernorm": "rms_norm"}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {},  # (q/k/v with biases)
              {"self_attn": ATTENTION, "mlp": "swiglu_mlp", "input_layernorm": "rms_norm",
               "post_attention_layernorm": "rms_norm"}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16},
              {"self_attn": ATTENTION, "mlp": "swiglu_mlp(gelu_tanh)", "input_layernorm": "rms_norm(gemma)",
               "post_attention_layernorm": "rms_norm(gemma)"}),
    # softcapped attention (eager in HF): its projections one by one, its attention in torch
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16},
               {**{f"self_attn.{p}": "linear" for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
                "mlp": "swiglu_mlp(gelu_tanh)",
                **{f"{n}_layernorm": "rms_norm(gemma)" for n in ("input", "post_attention", "pre_feedforward",
                                                                  "post_feedforward")}}),
}
NORM_KERNEL = {"mistral": "rms_norm", "qwen2": "rms_norm", "gemma": "rms_norm(gemma)", "gemma2": "rms_norm(gemma)"}


def _class(name: str):
    kind = getattr(transformers, name, None)
    if kind is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return kind


def tiny(family: str, train: bool = False) -> nn.Module:
    """The family's causal LM with 2 layers, its norms' weights away from their init (Gemma's zeros: 1 + 0)."""
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=16, vocab_size=VOCAB,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config_name, model_name, extra, _ = FAMILIES[family]
        model = _class(model_name)(_class(config_name)(**DECODER, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.to(DEVICE).train(train)


def ids(batch=2, seq=8):
    return torch.randint(0, VOCAB, (batch, seq), device=DEVICE)


def logits_64(original, x):
    with torch.no_grad():
        return copy.deepcopy(original).double()(input_ids=x).logits


FUSED_LOSS = {"mistral", "qwen2", "gemma"}  # their ForCausalLM has LlamaForCausalLM's code: the fused loss


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoder_family_injected_verified(family):
    model = tiny(family)
    original, x = copy.deepcopy(model), ids()
    report = dropin.inject_(model, example_inputs=x)
    layer = FAMILIES[family][3]
    expected = {f"model.layers.{i}.{name}": kernel for i in range(2) for name, kernel in layer.items()}
    expected.update({"model.norm": NORM_KERNEL[family], "lm_head": "linear"})
    if family in FUSED_LOSS:
        expected[""] = dnn.CausalLMForward.kernel
    assert {r.name: r.kernel for r in report.replaced} == expected
    assert {e.name for e in report.left} == {"model.embed_tokens", "model.rotary_emb"}  # a gather, the cos/sin table
    assert all("no dropin handler" in e.reason for e in report.left) and report.verification.startswith("verified")
    notes = {e.name: e.reason for e in report.notes}
    if family == "gemma2":
        assert set(notes) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
        assert "not the code of an attention dropin follows" in notes["model.layers.0.self_attn"]
    else:
        assert not notes
    with torch.no_grad():
        out = model(input_ids=x)  # HF's own forward, its mask and cache included
    assert_close(out.logits, logits_64(original, x), torch.float32, "fwd")


@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_decoder_family_training_backward_matches_torch(family):
    model = tiny(family, train=True)
    original = copy.deepcopy(model)
    dropin.inject_(model, example_inputs=ids())
    layer = "model.layers.1."
    check_hf_backward(model, original, {"input_ids": ids(), "use_cache": False}, "logits", [
        "model.embed_tokens.weight", layer + "self_attn.q_proj.weight", layer + "self_attn.k_proj.weight",
        layer + "mlp.gate_proj.weight", layer + "mlp.down_proj.weight", layer + "input_layernorm.weight",
        "model.norm.weight"] + ([layer + "self_attn.q_proj.bias"] if family == "qwen2" else []))


def test_gpt2_conv1d_and_gelu_fused_verified():
    model = tiny("gpt2")
    original, x = copy.deepcopy(model), ids()
    report = dropin.inject_(model, example_inputs=x)
    kernels = {r.name: (r.original, r.kernel, r.fused) for r in report.replaced}
    block = "transformer.h.0."
    assert kernels[block + "mlp.c_fc"] == ("Conv1D", "linear+gelu_tanh", (block + "mlp.act",))
    assert kernels[block + "attn.c_attn"] == ("Conv1D", "linear", ())
    assert kernels[block + "mlp.c_proj"][1] == kernels["lm_head"][1] == "linear"
    assert kernels[block + "ln_1"][1] == kernels["transformer.ln_f"][1] == "layer_norm"
    assert kernels[block + "attn"] == ("GPT2Attention", dnn.sdpa_attention.GPT2Attention.kernel, ())
    assert len(kernels) == 2 * 7 + 2
    assert {e.name for e in report.left} == {"transformer.wte", "transformer.wpe"} and not report.notes
    assert report.verification.startswith("verified")
    assert isinstance(model.transformer.h[0].mlp.c_fc, dnn.TransposedLinear)
    with torch.no_grad():
        out = model(input_ids=x)
    assert_close(out.logits, logits_64(original, x), torch.float32, "fwd")


def test_gpt2_training_backward_matches_torch():
    model = tiny("gpt2", train=True)
    original = copy.deepcopy(model)
    dropin.inject_(model, example_inputs=ids())
    block = "transformer.h.1."
    check_hf_backward(model, original, {"input_ids": ids(), "use_cache": False}, "logits", [
        "transformer.wte.weight", block + "attn.c_attn.weight", block + "attn.c_attn.bias",
        block + "mlp.c_fc.weight", block + "mlp.c_fc.bias", block + "mlp.c_proj.weight", block + "ln_2.weight"])


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma", "gemma2", "gpt2"])
def test_state_dict_parameters_and_revert(family):
    model = tiny(family)
    state, x = snapshot(model), ids()
    params = dict(model.named_parameters())
    classes = {name: type(m) for name, m in model.named_modules()}
    with torch.no_grad():
        before = model(input_ids=x).logits
    dropin.inject_(model, verify=False)
    assert_same_state(model, state)
    injected = dict(model.named_parameters())
    assert list(injected) == list(params) and all(injected[n] is p for n, p in params.items())  # the same objects
    dropin.revert_(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert_same_state(model, state)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, before)


def _renamed(reference: type, name: str) -> type:
    """`reference`'s class source run again under another name (as transformers' generated files copy modules)."""
    source = inspect.getsource(reference).replace(f"class {reference.__name__}(", f"class {name}(", 1)
    namespace = dict(vars(inspect.getmodule(reference)))
    exec(compile(source, f"<{name}>", "exec"), namespace)
    return namespace[name]


def test_classes_recognized_by_their_code_not_their_name():
    """A norm and an MLP with Llama's and Gemma's code under new names are handled as theirs; a norm whose forward
    differs stays torch with the reason."""
    from transformers.models.gemma import modeling_gemma
    from transformers.models.llama import modeling_llama

    config = transformers.LlamaConfig(**DECODER, hidden_act="gelu_pytorch_tanh")

    class OtherNorm(modeling_llama.LlamaRMSNorm):
        def forward(self, x):
            return self.weight * x

    norm, gemma_norm = _renamed(modeling_llama.LlamaRMSNorm, "MyNorm"), _renamed(modeling_gemma.GemmaRMSNorm, "MyG")
    mlp = _renamed(modeling_llama.LlamaMLP, "MyMLP")
    model = nn.Sequential(norm(64), mlp(config), gemma_norm(64), OtherNorm(64)).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    report = dropin.inject_(model, example_inputs=torch.randn(2, 5, 64, device=DEVICE))
    assert {r.name: r.kernel for r in report.replaced} == {"0": "rms_norm", "1": "swiglu_mlp(gelu_tanh)",
                                                           "2": "rms_norm(gemma)"}
    assert [(e.name, e.type) for e in report.left] == [("3", "OtherNorm")]
    assert "forward of its own" in report.left[0].reason and report.verification.startswith("verified")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gemma_rms_norm_numerics(dtype):
    """GemmaRMSNorm's own rounding (normalized and scaled by 1 + weight in fp32, rounded once): within 2x of
    torch's error against float64, and its gradients."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    hf = GemmaRMSNorm(48, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        hf.weight.normal_()
    ours = dnn.RMSNorm.from_gemma(hf)
    assert ours.weight is hf.weight
    x = torch.randn(3, 7, 48, device=DEVICE, dtype=dtype, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    hf_torch, w64 = copy.deepcopy(hf), hf.weight.detach().double().requires_grad_()
    y, y_torch, y64 = ours(x), hf_torch(x.detach()), rms_norm_ref(x64, w64, 1e-6, form="gemma")  # (HF's: fp32 inside)
    assert y.dtype == y_torch.dtype == dtype
    assert_close(y, y64, dtype, "fwd", torch_out=y_torch)
    grad = torch.randn_like(y64)
    for out, g in ((y, grad.to(dtype)), (y_torch, grad.to(dtype)), (y64, grad)):
        out.backward(g)
    assert_close(x.grad, x64.grad, dtype, "bwd")
    assert_close(hf.weight.grad, w64.grad, dtype, "bwd", torch_out=hf_torch.weight.grad, what="weight.grad")


def _hf_convnext(drop_path: float = 0.0, layer_scale: float = 0.5):
    """HF's ConvNextModel at 8-16 channels, one and two blocks a stage, its LayerNorms' affine and layer scales
    drawn."""
    config = transformers.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 2],
                                         patch_size=2, drop_path_rate=drop_path, layer_scale_init_value=layer_scale)
    model = transformers.ConvNextModel(config).to(DEVICE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "layer_scale" in name:
                p.uniform_(0.2, 1.2) if name.endswith(("weight", "parameter")) else p.uniform_(-0.5, 0.5)
    return model


@pytest.mark.parametrize("layer_scale", [0.5, 0.0], ids=["layer-scale", "none"])
def test_hf_convnext_layer_as_one_block(layer_scale):
    """HF ConvNeXt's ConvNextLayer runs as nn.ConvNeXtBlock (depthwise conv, LayerNorm, MLP with its GELU fused,
    layer scale (none where the config has none) and residual on its own tensors): verified, nothing left, the
    state_dict the original's; the pooled output and every gradient against float64; in training with drop path the
    original's rows dropped (the same draws from the same seed). The first stage's empty ModuleList of downsampling
    layers is passive."""
    x = torch.randn(2, 3, 16, 12, device=DEVICE)
    model, original, report = injected_pair(lambda: _hf_convnext(layer_scale=layer_scale), example_inputs=x)
    layers = [m for name, m in model.named_modules() if name.endswith(tuple(f"layers.{i}" for i in range(2)))]
    assert [type(m).__name__ for m in layers] == ["ConvNeXtBlock"] * 3 and not report.left, report
    assert report.verification.startswith("verified")
    assert list(model.state_dict()) == list(original.state_dict())
    check_hf_backward(model, original, {"pixel_values": x}, "pooler_output",
                      ["encoder.stages.1.layers.1.dwconv.weight", "encoder.stages.1.layers.1.pwconv1.weight"]
                      + (["encoder.stages.0.layers.0.layer_scale_parameter"] if layer_scale else []))
    trained, reference, _ = injected_pair(lambda: _hf_convnext(drop_path=0.5, layer_scale=layer_scale), train=True,
                                          verify=False)
    assert_same_random_draws(trained, reference, lambda m: m(pixel_values=x).pooler_output)
