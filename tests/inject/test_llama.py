"""inject_ on HF Llama (tiny config): fused SwiGLU MLP, RMSNorm, attention with RoPE; cache, revert, training."""
import copy
import os
import subprocess
import sys

import pytest
import torch

import dropin
import dropin.nn as dnn
from _tol import DEVICE, assert_close

from _models import assert_same_state, check_hf_backward, compiled_guards, snapshot

transformers = pytest.importorskip("transformers")

LAYER = {"self_attn": "linear(q, k, v) + rope + attention + linear(o)", "mlp": "swiglu_mlp",
         "input_layernorm": "rms_norm", "post_attention_layernorm": "rms_norm"}


def tiny_llama(**config) -> torch.nn.Module:
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=128, **config)
    return transformers.LlamaForCausalLM(config).to(DEVICE).eval()


def ids(batch=2, seq=8):
    return torch.randint(0, 128, (batch, seq), device=DEVICE)


def logits_64(original, **inputs):
    with torch.no_grad():
        return copy.deepcopy(original).double()(**inputs).logits


def test_llama_injected_verified_and_hf_forward_unchanged():
    model = tiny_llama()
    original, x = copy.deepcopy(model), ids()
    report = dropin.inject_(model, example_inputs=x)
    expected = {f"model.layers.{i}.{name}": kernel for i in range(2) for name, kernel in LAYER.items()}
    expected.update({"model.norm": "rms_norm", "lm_head": "linear", "": dnn.CausalLMForward.kernel})
    assert {r.name: r.kernel for r in report.replaced} == expected
    assert {(e.name, e.type) for e in report.left} == {("model.embed_tokens", "Embedding"),
                                                      ("model.rotary_emb", "LlamaRotaryEmbedding")}
    assert all("no dropin handler" in e.reason for e in report.left) and report.verification.startswith("verified")
    assert isinstance(model.model.layers[0].self_attn.q_proj, dnn.Linear)
    with torch.no_grad():
        out = model(input_ids=x)  # HF's own forward, its cache included
    assert_close(out.logits, logits_64(original, input_ids=x), torch.float32, "fwd")


@pytest.mark.gpu
def test_llama_cuda_graph():
    """The injected model captured whole in a CUDA graph (HF builds its 4-D mask while capturing)."""
    model, x = tiny_llama(), ids()
    original = copy.deepcopy(model)
    dropin.inject_(model, verify=False)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(input_ids=x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = model(input_ids=x).logits
    x.copy_(ids())
    graph.replay()
    assert_close(out, logits_64(original, input_ids=x), torch.float32, "fwd")


def test_llama_padding_mask_and_kv_cache_decoding():
    """Left padding (HF's 4-D mask), then two decoding steps through the DynamicCache (one query row)."""
    model = tiny_llama()
    original = copy.deepcopy(model)
    dropin.inject_(model, verify=False)
    x, mask = ids(), torch.ones(2, 8, dtype=torch.long, device=DEVICE)
    mask[1, :3] = 0
    runs = []
    for m in (model, copy.deepcopy(original).double()):
        with torch.no_grad():
            out = m(input_ids=x, attention_mask=mask, use_cache=True)
            logits, cache, step_mask = [out.logits], out.past_key_values, mask
            for token in (5, 7):
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], 1)
                out = m(input_ids=torch.full((2, 1), token, device=DEVICE), attention_mask=step_mask,
                        past_key_values=cache, use_cache=True)
                logits.append(out.logits)
        runs.append(torch.cat(logits, 1))
    keep = torch.cat([mask, torch.ones_like(mask[:, :2])], 1).bool().unsqueeze(-1)  # padded rows: not compared
    assert_close(runs[0].masked_fill(~keep, 0), runs[1].masked_fill(~keep, 0), torch.float32, "fwd")


def test_llama_state_dict_and_revert():
    model = tiny_llama()
    state, x = snapshot(model), ids()
    with torch.no_grad():
        before = model(input_ids=x).logits
    dropin.inject_(model, verify=False)
    assert_same_state(model, state)
    layer = model.model.layers[0]
    assert layer.mlp.gate_proj is layer.mlp.original.gate_proj and layer.input_layernorm.weight is \
        layer.input_layernorm.original.weight
    dropin.revert_(model)
    assert not any(isinstance(m, dnn.DropinModule) for m in model.modules())
    assert_same_state(model, state)
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, before)


def test_llama_training_backward_matches_torch():
    model = tiny_llama().train()
    original = copy.deepcopy(model)
    dropin.inject_(model, example_inputs=ids())
    layer = "model.layers.1."
    check_hf_backward(model, original, {"input_ids": ids(), "use_cache": False}, "logits", [
        "model.embed_tokens.weight", layer + "self_attn.q_proj.weight", layer + "self_attn.k_proj.weight",
        layer + "self_attn.v_proj.weight", layer + "self_attn.o_proj.weight", layer + "mlp.gate_proj.weight",
        layer + "mlp.down_proj.weight", layer + "input_layernorm.weight", "model.norm.weight", "lm_head.weight"])


def test_llama_attention_backward_copies_no_gradient(monkeypatch):
    """The q / k / v gradients reach the projections' [B, L, H * E] outputs without a copy: attention and rope
    give each gradient its input's layout (the transposed view of a projection), so the views' backwards are
    views. (Launches stubbed: the interpreter's own copies aside; the values are not looked at.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dropin.ops import _dispatch

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._reshape_copy):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    model = tiny_llama()
    dropin.inject_(model, verify=False)
    attention, x = model.model.layers[0].self_attn, torch.randn(2, 8, 64, device=DEVICE, requires_grad=True)
    cos_sin = model.model.rotary_emb(x, torch.arange(8, device=DEVICE)[None])
    out = attention(x, position_embeddings=cos_sin, attention_mask=None)[0]
    monkeypatch.setattr(_dispatch.Launch, "__call__", lambda self, *args: None)
    with Copies() as copies:
        out.backward(torch.randn_like(out))
    assert copies.ops == [] and x.grad is not None


def test_llama_unsupported_configs_stay_torch_with_reasons(monkeypatch):
    report = dropin.inject_(tiny_llama(attn_implementation="eager", mlp_bias=True), verify=False)
    notes = {e.name: e.reason for e in report.notes}
    assert "attn_implementation 'eager'" in notes["model.layers.0.self_attn"]
    assert "bias in 'gate_proj'" in notes["model.layers.0.mlp"]
    assert "model.layers.0.self_attn.q_proj" in {r.name for r in report.replaced}  # handled one by one
    report = dropin.inject_(tiny_llama(attention_dropout=0.1), verify=False)
    assert "attention_dropout 0.1" in {e.name: e.reason for e in report.notes}["model.layers.1.self_attn"]
    # a forward with an argument dropin's does not follow (transformers 4.x and 5.0 passed cache_position)
    hf_attention = transformers.models.llama.modeling_llama.LlamaAttention
    hf_forward = hf_attention.forward
    monkeypatch.setattr(hf_attention, "forward", lambda self, hidden_states, cache_position=None, **kwargs:
                        hf_forward(self, hidden_states, **kwargs))
    report = dropin.inject_(tiny_llama(), verify=False)
    assert "its forward takes cache_position" in {e.name: e.reason for e in report.notes}["model.layers.0.self_attn"]


def test_compiled_guards_near_the_originals():
    """Every compiled call evaluates its guards on the host (a decoding step's ~0.5 ms under reduce-overhead): the
    injected model's forwards read their tensors and children from the module dicts, so that none comes through
    DropinModule's own __getattr__ (traced by Dynamo, where nn.Module's is read directly: it had added 267 guards
    to a 4-layer tiny Llama's 1482, and 62 us to each decoding step of a 4-layer 7B-shaped one on an H100); dropin's
    ops add a few guards each."""
    model, x = tiny_llama(), ids()
    original = compiled_guards(copy.deepcopy(model), x)
    dropin.inject_(model, example_inputs=x)
    injected = compiled_guards(model, x)
    assert not [g for g in injected if "in __getattr__" in g], "guards from tracing a __getattr__"
    assert len(injected) <= 1.4 * len(original), (len(injected), len(original))  # (CPU 1.22x, H100 1.33x)


def test_import_dropin_does_not_import_transformers():
    """The HF handlers register when inject_ runs after transformers' model file was imported."""
    code = "import sys, dropin; assert 'transformers' not in sys.modules, 'transformers imported'"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
