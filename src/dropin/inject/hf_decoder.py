"""Handlers for HF Llama (transformers.models.llama): LlamaMLP -> fused SwiGLU, LlamaRMSNorm -> dropin rms_norm,
LlamaAttention -> dropin linear + rope + attention. (nn.Embedding and LlamaRotaryEmbedding stay torch: no
dropin op for them; lm_head is an nn.Linear, which the generic handler takes.)"""
import inspect

from torch import nn

from .. import nn as dnn
from .generic import sparse_layers_reason
from .registry import register, when_imported


def _adopt(module: nn.Module, make, kernel: str):
    """dnn.Adopted(module, make(module)), or the reason make (a from_llama constructor) refused it."""
    try:
        return dnn.Adopted(module, make(module), kernel)
    except ValueError as e:
        return str(e)


def _attention_reason(attn: nn.Module):
    unknown = set(inspect.signature(type(attn).forward).parameters) - dnn.LlamaAttention.FORWARD_PARAMETERS
    if unknown:
        return (f"its forward takes {', '.join(sorted(unknown))}: a transformers version whose LlamaAttention dropin "
                f"does not follow (it follows the forward of transformers 5.17 to 5.24)")
    impl = attn.config._attn_implementation
    if impl != "sdpa":
        return f"attn_implementation '{impl}': dropin follows HF's 'sdpa' path only (no attention weights)"
    if attn.attention_dropout:
        return f"attention_dropout {attn.attention_dropout}: dropin attention has no dropout"
    if attn.head_dim % 2 or attn.head_dim > 256:
        return f"head_dim {attn.head_dim}: dropin rope and attention take an even head_dim up to 256"
    for name in dnn.attention.PROJECTIONS:
        if type(getattr(attn, name)) is not nn.Linear:
            return f"its {name} is a {type(getattr(attn, name)).__name__}, not an nn.Linear"
    return None


@when_imported("transformers.models.llama.modeling_llama")
def _register():
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

    @register(LlamaMLP, op="swiglu_mlp")
    def llama_mlp(module: nn.Module, site):
        projections = [getattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")]
        reason = sparse_layers_reason(projections, site.config, "a projection", "sparse_linear")
        if reason:
            return f"{reason}: its modules are injected one by one"
        return _adopt(module, dnn.SwiGLUMLP.from_llama, "swiglu_mlp")

    @register(LlamaRMSNorm, op="rms_norm")
    def llama_rms_norm(module: nn.Module, site):
        return _adopt(module, dnn.RMSNorm.from_llama, "rms_norm")

    @register(LlamaAttention, op="attention")
    def llama_attention(module: nn.Module, site):
        return _attention_reason(module) or dnn.LlamaAttention(module)
