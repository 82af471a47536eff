"""Drop-ins for HF attention modules that project q, k and v from one input and hand them to HF's attention
interface, as HF runs them with attn_implementation='sdpa': BERT's self-attention, ViT's attention, Swin's window
attention and GPT-2's self-attention (transformers 5.17 to 5.24). The interface's scaled_dot_product_attention runs
as dropin attention; the projections stay the module's children under their names, injected by their own
handlers."""
from ..ops import attention
from .module import DropinModule


class SdpaAttention(DropinModule):
    """The attention of the module, as HF's `sdpa_attention_forward` computes it: dropin attention with HF's mask
    (boolean or additive, or none), the module's scaling, causal where the queries are more than one row, no mask is
    passed and the module is causal (or the call's is_causal says so), a cache updated by its own `update` as HF
    does. A call that asks for what dropin's attention has not (attention dropout in training, the attention
    weights, cross-attention) runs the original's forward: torch's attention and projections (`kernel` says so).
    Subclasses give q, k and v (`_qkv`) and the attention dropout (`_dropout`); their forward projects the output
    where the module does."""

    kernel = "linear(q, k, v) + attention (torch's forward in training with attention dropout, or for weights)"
    walks_children = True

    def _attend(self, hidden_states, attention_mask, cache, head_dim: int, kwargs):
        """The attention's output [B, L, H * head_dim] of the module's q, k, v."""
        shape = (*hidden_states.shape[:-1], -1, head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in self._qkv(hidden_states))
        if cache is not None:  # (an EncoderDecoderCache's self-attention cache, as HF takes it)
            k, v = getattr(cache, "self_attention_cache", cache).update(k, v, self.original.layer_idx)
        causal = q.shape[2] > 1 and attention_mask is None and kwargs.get("is_causal", self.original.is_causal)
        out = attention(q, k, v, attention_mask, is_causal=bool(causal), scale=self.original.scaling)
        return out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)

    def _torch_forward(self, kwargs) -> bool:
        """Whether this call runs the original's forward."""
        return bool(self.training and self._dropout() or kwargs.get("output_attentions"))


class BertSelfAttention(SdpaAttention):
    """BertSelfAttention: query, key and value linears; the output projection is BertSelfOutput's, outside."""

    def forward(self, hidden_states, attention_mask=None, cache=None, past_key_values=None, **kwargs):
        if self._torch_forward(kwargs):
            return self.original(hidden_states, attention_mask, cache if cache is not None else past_key_values,
                                 **kwargs)
        cache = past_key_values if cache is None else cache
        return self._attend(hidden_states, attention_mask, cache, self.original.attention_head_size, kwargs), None

    def _qkv(self, x):
        return (self._modules[n](x) for n in ("query", "key", "value"))

    def _dropout(self) -> float:
        return self._modules["dropout"].p


class ViTAttention(SdpaAttention):
    """ViTAttention: q, k, v and o projections (no cache)."""

    kernel = ("linear(q, k, v) + attention + linear(o) (torch's forward in training with attention dropout, or for "
              "weights)")

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        if self._torch_forward(kwargs):
            return self.original(hidden_states, attention_mask, **kwargs)
        out = self._attend(hidden_states, attention_mask, None, self.original.head_dim, kwargs)
        return self._modules["o_proj"](out), None

    def _qkv(self, x):
        return (self._modules[n](x) for n in ("q_proj", "k_proj", "v_proj"))

    def _dropout(self) -> float:
        return self.original.attention_dropout


class SwinAttention(ViTAttention):
    """SwinAttention: ViTAttention's, with its additive mask the relative position bias (its child's) plus the
    shifted windows' mask, combined as HF combines them. Where autograd needs the bias table's gradient (dropin
    attention gives none for a mask), torch's forward."""

    kernel = ("linear(q, k, v) + attention (relative position bias and shift mask as its mask) + linear(o) (torch's "
              "forward where the bias table needs a gradient, or in training with attention dropout)")

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        bias = None if self._torch_forward(kwargs) else self._modules["relative_position_bias"]()
        if bias is None or bias.requires_grad:
            return self.original(hidden_states, attention_mask, **kwargs)
        if attention_mask is not None:  # [windows, L, L] -> [batch * windows, 1, L, L]
            windows, tokens = attention_mask.shape[0], hidden_states.shape[1]
            bias = bias + attention_mask[None, :, None].expand(hidden_states.shape[0] // windows, -1, -1, -1, -1)\
                .reshape(-1, 1, tokens, tokens)
        out = self._attend(hidden_states, bias, None, self.original.head_dim, kwargs)
        return self._modules["o_proj"](out), None


class GPT2Attention(SdpaAttention):
    """GPT2Attention's self-attention: c_attn (a Conv1D) split into q, k and v; c_proj, then resid_dropout."""

    kernel = ("linear(qkv) + attention + linear(proj) (torch's forward in training with attention dropout, for "
              "weights, or for cross-attention)")

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, output_attentions=False, past_key_values=None, **kwargs):
        kwargs = dict(kwargs, output_attentions=output_attentions)
        cache = past_key_values if cache is None else cache
        if encoder_hidden_states is not None or self._torch_forward(kwargs):
            return self.original(hidden_states, cache, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                 **kwargs)
        kwargs.pop("output_attentions")
        out = self._attend(hidden_states, attention_mask, cache, self.original.head_dim, kwargs)
        return self._modules["resid_dropout"](self._modules["c_proj"](out)), None

    def _qkv(self, x):
        return self._modules["c_attn"](x).split(self.original.split_size, dim=2)

    def _dropout(self) -> float:
        return self._modules["attn_dropout"].p

