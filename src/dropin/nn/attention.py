"""Drop-ins for HF attention modules: Llama's (LlamaAttention, the 'sdpa' path: dropin linear, rope and attention)
and CvT's (CvtSelfAttention: its score product, softmax and context product as one dropin attention)."""
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


class CvtSelfAttention(DropinModule):
    """CvtSelfAttention.forward with `softmax(q k^T * scale) v` (two einsums and a softmax in HF, the [Lq, Lk]
    scores in memory) as one dropin attention call, at HF's scale (embed_dim ** -0.5). Its children (the conv and
    linear projections, the dropout) stay its children under their names and inject_ walks into them
    (`walks_children`): each is injected by its own handler. The attention dropout must be inactive (p == 0 or
    eval mode): dropin attention has none, and a forward in training mode with p > 0 raises."""

    kernel = "attention"
    walks_children = True

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        for name, child in original.named_children():
            self.add_module(name, child)

    def forward(self, hidden_state, height, width):
        a = self.original
        if self.training and self.dropout.p:
            raise RuntimeError(f"dropin CvtSelfAttention: attention dropout p={self.dropout.p} in training mode; "
                               f"dropin attention has no dropout (revert_ the model, or set the dropout's p to 0)")
        if a.with_cls_token:
            cls_token, hidden_state = torch.split(hidden_state, [1, height * width], 1)
        batch, _, channels = hidden_state.shape
        hidden_state = hidden_state.permute(0, 2, 1).view(batch, channels, height, width)
        qkv = [getattr(self, f"convolution_projection_{n}")(hidden_state) for n in ("query", "key", "value")]
        if a.with_cls_token:
            qkv = [torch.cat((cls_token, t), dim=1) for t in qkv]
        q, k, v = (getattr(self, f"projection_{n}")(t).view(batch, t.shape[1], a.num_heads, -1).transpose(1, 2)
                   for n, t in zip(("query", "key", "value"), qkv))
        out = attention(q, k, v, scale=a.scale)
        return out.transpose(1, 2).reshape(batch, q.shape[2], a.embed_dim)
