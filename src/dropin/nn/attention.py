"""Drop-in for HF Llama's attention (LlamaAttention, the 'sdpa' path): dropin linear, rope and attention."""
import torch

from ..ops import attention, rope
from .linear import Linear
from .module import DropinModule

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LlamaAttention(DropinModule):
    """LlamaAttention.forward as HF runs it with attn_implementation='sdpa': the q/k/v/o projections through
    dropin linear (the children keep their names), RoPE through dropin rope with the (cos, sin) HF passes in,
    attention through dropin attention with HF's 4-D mask (or causal where HF passes none) and the K/V heads
    shared by query groups without repeating them. A cache passed in (past_key_values) is updated by its own
    `update`, as HF does. Returns (output, None): no attention weights, as HF's sdpa path."""

    kernel = "linear(q, k, v) + rope + attention + linear(o)"

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        for name, child in original.named_children():
            self.add_module(name, Linear(child) if name in PROJECTIONS else child)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        a = self.original
        shape = (*hidden_states.shape[:-1], -1, a.head_dim)
        q, k, v = (getattr(self, n)(hidden_states).view(shape).transpose(1, 2) for n in PROJECTIONS[:3])
        q, k = rope(q, k, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, a.layer_idx)
        causal = q.shape[2] > 1 and attention_mask is None and kwargs.get("is_causal", a.is_causal)
        out = attention(q, k, v, attention_mask, is_causal=causal, scale=a.scaling, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None
