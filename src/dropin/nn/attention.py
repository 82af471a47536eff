"""Drop-ins for HF attention modules: the rotary decoder attention of Llama and the families that compute as it
(RotaryAttention, the 'sdpa' path: dropin linear, rope and attention) and CvT's (CvtSelfAttention: its score product, softmax and context product as one dropin attention)."""
import torch

from ..ops import attention, rope
from ..ops.conv2d import conv_out_hw
from .conv import Conv2d
from .linear import Linear
from .module import DropinModule, Folded

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


class RotaryAttention(DropinModule):
    """LlamaAttention.forward as HF runs it with attn_implementation='sdpa', which Mistral's, Qwen2's and Gemma's
    attention compute too (the sliding window, where there is one, is in HF's mask; biases, where the projections
    have them, are the linears'): the q/k/v/o projections through dropin linear (the children keep their names), RoPE through dropin rope with the (cos, sin) HF passes in,
    attention through dropin attention with HF's 4-D mask (or causal where HF passes none) and the K/V heads
    shared by query groups without repeating them. A cache passed in (`cache`, named `past_key_values` before
    transformers 5.24) is updated by its own `update`, as HF does. Returns (output, None): no attention weights, as
    HF's sdpa path. FORWARD_PARAMETERS: the names of HF's forward this one follows (the handler refuses others)."""

    kernel = "linear(q, k, v) + rope + attention + linear(o)"
    FORWARD_PARAMETERS = {"self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values",
                          "cache", "kwargs"}

    def __init__(self, original: torch.nn.Module):
        super().__init__(original)
        for name, child in original.named_children():
            self.add_module(name, Linear(child) if name in PROJECTIONS else child)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, cache=None,
                **kwargs):
        a = self.original
        if cache is not None and past_key_values is not None:
            raise TypeError("dropin RotaryAttention: both cache and past_key_values given (they name one argument)")
        cache = past_key_values if cache is None else cache
        shape = (*hidden_states.shape[:-1], -1, a.head_dim)
        children = self._modules  # (not getattr: see DropinModule._weight_bias)
        q, k, v = (children[n](hidden_states).view(shape).transpose(1, 2) for n in PROJECTIONS[:3])
        q, k = rope(q, k, *position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, a.layer_idx)
        causal = q.shape[2] > 1 and attention_mask is None and kwargs.get("is_causal", a.is_causal)
        out = attention(q, k, v, attention_mask, is_causal=causal, scale=a.scaling, enable_gqa=True)
        return children["o_proj"](out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


class CvtSelfAttention(DropinModule):
    """CvtSelfAttention.forward with `softmax(q k^T * scale) v` (two einsums and a softmax in HF, the [Lq, Lk]
    scores in memory) as one dropin attention call, at HF's scale (embed_dim ** -0.5). Its children (the conv and
    linear projections, the dropout) stay its children under their names and inject_ walks into them
    (`walks_children`): each is injected by its own handler. The attention dropout must be inactive (p == 0 or
    eval mode): dropin attention has none, and a forward in training mode with p > 0 raises."""

    kernel = "attention"
    walks_children = True

    def forward(self, hidden_state, height, width):
        a, children = self.original, self._modules  # (not getattr: see DropinModule._weight_bias)
        dropout = children["dropout"].p
        if self.training and dropout:
            raise RuntimeError(f"dropin CvtSelfAttention: attention dropout p={dropout} in training mode; "
                               f"dropin attention has no dropout (revert_ the model, or set the dropout's p to 0)")
        cls_token = None
        if a.with_cls_token:
            cls_token, hidden_state = torch.split(hidden_state, [1, height * width], 1)
        batch, _, channels = hidden_state.shape
        hidden_state = hidden_state.permute(0, 2, 1).view(batch, channels, height, width)
        qkv = [self._projection(n, hidden_state, cls_token) for n in ("query", "key", "value")]
        q, k, v = (children[f"projection_{n}"](t).view(batch, t.shape[1], a.num_heads, -1).transpose(1, 2)
                   for n, t in zip(("query", "key", "value"), qkv))
        out = attention(q, k, v, scale=a.scale)
        return out.transpose(1, 2).reshape(batch, q.shape[2], a.embed_dim)

    def _projection(self, name: str, hidden_state, cls_token):
        """The conv projection `name` as [B, L, C] rows, after the class token where there is one. In inference
        (no autograd, eager) with the projection's conv a dropin conv with its BatchNorm folded in and no hooks on
        the modules it passes by, the conv writes its rows straight after the token's (out=): no concatenation."""
        projection = self._modules[f"convolution_projection_{name}"]
        if cls_token is None:
            return projection(hidden_state)
        inner = getattr(projection, "convolution_projection", None)
        conv = getattr(inner, "convolution", None)
        if (torch.is_grad_enabled() or torch.compiler.is_compiling() or not isinstance(conv, Conv2d)
                or isinstance(conv.original.padding, str) or not isinstance(inner.normalization, Folded)
                or _hooked(projection, inner, inner.normalization, projection.linear_projection)):
            return torch.cat((cls_token, projection(hidden_state)), dim=1)
        c = conv.original
        batch, channels, height, width = hidden_state.shape
        (ph, pw), (kh, kw) = c.padding, c.kernel_size
        oh, ow = conv_out_hw(height, width, kh, kw, c.stride, (ph, ph, pw, pw), c.dilation)
        rows = hidden_state.new_empty(batch, 1 + oh * ow, c.out_channels)
        rows.narrow(1, 0, 1).copy_(cls_token)
        conv(hidden_state, out=rows[:, 1:].unflatten(1, (oh, ow)).permute(0, 3, 1, 2))
        return rows


def _hooked(*modules) -> bool:
    """Whether a forward hook would run on any of these modules (its own or a global one)."""
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in modules)
