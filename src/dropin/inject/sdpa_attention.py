"""Handlers for HF attention modules that hand q, k and v to HF's attention interface (dropin.nn.sdpa_attention):
BertSelfAttention, ViTAttention, SwinAttention and GPT2Attention's self-attention, taken where HF runs them with
attn_implementation='sdpa' and their forward is the code dropin follows (transformers 5.17 to 5.24); the others stay
torch with the reason, their projections injected one by one."""
import functools
import importlib
from typing import Optional

from torch import nn

from .. import nn as dnn
from .registry import passive, register, unfollowed, when_imported

# (module, class name) -> (dropin's module, what it reads of the original, the forward parameters it follows)
_FOLLOWED = {
    ("transformers.models.bert.modeling_bert", "BertSelfAttention"):
        (dnn.sdpa_attention.BertSelfAttention, ("attention_head_size", "is_causal", "layer_idx", "scaling"),
         {"self", "hidden_states", "attention_mask", "past_key_values", "cache", "kwargs"}),
    ("transformers.models.vit.modeling_vit", "ViTAttention"):
        (dnn.sdpa_attention.ViTAttention, ("head_dim", "is_causal", "scaling", "attention_dropout"),
         {"self", "hidden_states", "attention_mask", "kwargs"}),
    ("transformers.models.swin.modeling_swin", "SwinAttention"):
        (dnn.sdpa_attention.SwinAttention, ("head_dim", "is_causal", "scaling", "attention_dropout"),
         {"self", "hidden_states", "attention_mask", "kwargs"}),
    ("transformers.models.gpt2.modeling_gpt2", "GPT2Attention"):
        (dnn.sdpa_attention.GPT2Attention, ("head_dim", "is_causal", "layer_idx", "scaling", "split_size"),
         {"self", "hidden_states", "past_key_values", "cache", "attention_mask", "encoder_hidden_states",
          "encoder_attention_mask", "output_attentions", "kwargs"}),
}

# Children that the drop-ins run as they are: Swin's relative position bias (its table's gather) builds the mask.
_PASSIVE = {"transformers.models.swin.modeling_swin": "SwinRelativePositionBias"}


def _reason(module: nn.Module, reads: tuple, parameters: set) -> Optional[str]:
    """Why the module stays torch, or None."""
    why = unfollowed(module, parameters, reads, "transformers 5.17 to 5.24")
    if why:
        return why
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if impl != "sdpa":
        return f"attn_implementation '{impl}': dropin follows HF's 'sdpa' path only (no attention weights)"
    if getattr(module, "is_cross_attention", False):
        return "a cross-attention (its keys and values from the encoder): its attention runs in torch"
    return None


def _handler(drop_in, reads: tuple, parameters: set):
    def handle(module: nn.Module, site):
        return _reason(module, reads, parameters) or drop_in(module)
    return handle


def _register(module_name: str, class_name: str) -> None:
    module = importlib.import_module(module_name)
    kind = getattr(module, class_name, None)
    if kind is not None:  # (a transformers version without the class: nothing to take)
        register(kind, op="attention")(_handler(*_FOLLOWED[module_name, class_name]))
    if module_name in _PASSIVE:
        passive(getattr(module, _PASSIVE[module_name]))


for _module_name, _class_name in _FOLLOWED:
    when_imported(_module_name)(functools.partial(_register, _module_name, _class_name))
