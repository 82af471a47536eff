"""Handlers for HF decoder families (Llama, Mistral, Qwen2, Gemma, Gemma2, ...), taken by what their modules
compute: an RMSNorm -> dropin rms_norm (Llama's form, or Gemma's `(x_normed * (1 + weight))` in fp32), a gated MLP
(gate / up / down projections) -> fused swiglu_mlp with its activation (SiLU; Gemma's GELU-tanh), the rotary
attention -> dropin linear + rope + attention. The references are the families' own classes (_NORMS, _MLP,
_ATTENTIONS); any other class whose forward has one of their code (registry.same_code: transformers' generated
modeling files copy one family's modules into the next) is handled as that reference, whatever its name. An
attention whose code is none of them (Gemma2's softcapping, Qwen3's q/k norms) is named with the reason, its
projections injected one by one. (nn.Embedding and the rotary embedding module stay torch: no dropin op for them;
lm_head is an nn.Linear, which the generic handler takes.) A causal LM given to inject_ as the root
(LlamaForCausalLM and the classes of its code) gets dropin.nn.CausalLMForward: with labels, the loss from the fused
linear + cross-entropy, without logits."""
import importlib
from typing import Optional

from torch import nn

from .. import nn as dnn
from .generic import sparse_layers_reason
from .registry import (HANDLERS, code_names, recognizer, register, register_root, same_code, unfollowed,
                       when_imported)

# (family, class) of transformers.models.<family>.modeling_<family>: the modules whose computation dropin follows
_NORMS = {"llama": ("llama", "LlamaRMSNorm"), "gemma": ("gemma", "GemmaRMSNorm")}  # form -> its reference
_MLP = ("llama", "LlamaMLP")
_ATTENTIONS = (("llama", "LlamaAttention"), ("mistral", "MistralAttention"), ("qwen2", "Qwen2Attention"))
_PROJECTIONS = frozenset(dnn.attention.PROJECTIONS)
_CAUSAL_LM = ("llama", "LlamaForCausalLM")  # a root model whose loss with labels runs linear_cross_entropy
_ATTENTION_READS = ("config", "head_dim", "layer_idx", "is_causal", "scaling")  # what RotaryAttention reads


def _reference(family: str, name: str) -> Optional[type]:
    """transformers' class `name` of that family, or None where this transformers version lacks it."""
    try:
        return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name, None)
    except ImportError:
        return None


def _adopted(module: nn.Module, make, kernel):
    """dnn.Adopted(module, make(module)) running kernel(that impl), or the reason make (a from_* constructor)
    refused it."""
    try:
        impl = make(module)
    except ValueError as e:
        return str(e)
    return dnn.Adopted(module, impl, kernel(impl))


def _mlp_kernel(mlp: dnn.SwiGLUMLP) -> str:
    return "swiglu_mlp" if mlp.activation == "silu" else f"swiglu_mlp({mlp.activation})"


def _norm_kernel(norm: dnn.RMSNorm) -> str:
    return "rms_norm" if norm.form == "llama" else f"rms_norm({norm.form})"


def _attention_reason(attn: nn.Module) -> Optional[str]:
    why = unfollowed(attn, dnn.RotaryAttention.FORWARD_PARAMETERS, _ATTENTION_READS, "transformers 5.17 to 5.24")
    if why:
        return why
    impl = getattr(attn.config, "_attn_implementation", None)
    if impl != "sdpa":
        return f"attn_implementation '{impl}': dropin follows HF's 'sdpa' path only (no attention weights)"
    dropout = getattr(attn, "attention_dropout", 0.0)
    if dropout:
        return f"attention_dropout {dropout}: dropin attention has no dropout"
    if attn.head_dim % 2 or attn.head_dim > 256:
        return f"head_dim {attn.head_dim}: dropin rope and attention take an even head_dim up to 256"
    for name in dnn.attention.PROJECTIONS:
        if type(getattr(attn, name, None)) is not nn.Linear:
            return f"its {name} is a {type(getattr(attn, name, None)).__name__}, not an nn.Linear"
    return None


def rotary_attention(module: nn.Module, site):
    return _attention_reason(module) or dnn.RotaryAttention(module)


def gated_mlp(module: nn.Module, site):
    projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if all(isinstance(p, nn.Module) for p in projections):
        reason = sparse_layers_reason(projections, site.config, "a projection", "sparse_linear")
        if reason:
            return f"{reason}: its modules are injected one by one"
    return _adopted(module, dnn.SwiGLUMLP.from_gated, _mlp_kernel)


def llama_rms_norm(module: nn.Module, site):
    return _adopted(module, dnn.RMSNorm.from_llama, _norm_kernel)


def gemma_rms_norm(module: nn.Module, site):
    return _adopted(module, dnn.RMSNorm.from_gemma, _norm_kernel)


def causal_lm(model: nn.Module, config):
    from transformers.loss.loss_utils import ForCausalLMLoss
    return dnn.CausalLMForward(model, ForCausalLMLoss)


def unfollowed_attention(module: nn.Module, site):
    references = ", ".join(name for _, name in _ATTENTIONS)
    return (f"its forward is not the code of an attention dropin follows ({references}; e.g. logit softcapping, "
            f"q/k norms): its attention runs in torch, its projections are injected one by one")


@when_imported("transformers.modeling_utils")
def _register():
    norm_handlers = {"llama": llama_rms_norm, "gemma": gemma_rms_norm}
    references = [(_reference(*ref), "rms_norm", norm_handlers[form]) for form, ref in _NORMS.items()]
    references.append((_reference(*_MLP), "swiglu_mlp", gated_mlp))
    references += [(_reference(*ref), "attention", rotary_attention) for ref in _ATTENTIONS]
    references = [(kind, op, fn) for kind, op, fn in references if kind is not None]
    for kind, op, fn in references:
        register(kind, op=op)(fn)
    causal_lm_reference = _reference(*_CAUSAL_LM)
    if causal_lm_reference is not None:
        register_root(causal_lm_reference, "linear_cross_entropy", causal_lm)

    @recognizer
    def same_code_as_a_reference(kind: type):
        """The handler of the reference that `kind` computes as; for an attention of other code, the reason."""
        reference = next((ref for ref, _, _ in references if same_code(kind, ref)), None)
        if reference is not None:
            return HANDLERS[reference]
        if _PROJECTIONS <= code_names(kind):
            return None, unfollowed_attention
        return None
