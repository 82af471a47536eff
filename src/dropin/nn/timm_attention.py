"""Drop-ins for timm's attention modules (timm 1.0): `timm.layers.Attention` (ViT's, DeiT's) and the Swin
transformer's `WindowAttention`. Each projects q, k and v with one linear, runs dropin attention where timm calls
F.scaled_dot_product_attention (or computes the same softmax with its fused path off), and projects the output; the
linears, norms and dropouts stay its children under their names, injected by their own handlers."""
from ..ops import attention
from .module import DropinModule


class TimmAttention(DropinModule):
    """timm.layers.Attention: qkv split into heads, q_norm and k_norm, dropin attention with the call's mask and
    causal flag at timm's scale, the output's norm and gate (where there is one), proj and proj_drop. In training
    with attention dropout, timm's forward."""

    kernel = "linear(qkv) + attention + linear(proj) (timm's forward in training with attention dropout)"
    walks_children = True

    def forward(self, x, attn_mask=None, is_causal=False):
        a, m = self.original, self._modules
        if self.training and m["attn_drop"].p:
            return a(x, attn_mask, is_causal)
        B, N, _ = x.shape
        gate = getattr(a, "gate", None)
        gate = None if gate is None else m["gate"](x).sigmoid()
        q, k, v = m["qkv"](x).reshape(B, N, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = m["q_norm"](q), m["k_norm"](k)
        out = attention(q, k, v, attn_mask, is_causal=is_causal, scale=a.scale)
        out = out.transpose(1, 2).reshape(B, N, -1)
        out = m["norm"](out) if "norm" in m else out
        if gate is not None:
            out = out * gate
        return m["proj_drop"](m["proj"](out))


class TimmWindowAttention(DropinModule):
    """timm's Swin WindowAttention: qkv split into heads, dropin attention with the relative position bias plus the
    shifted windows' mask as its mask (combined as timm combines them), proj and proj_drop. Where autograd needs
    the bias table's gradient (dropin attention gives none for a mask), or in training with attention dropout,
    timm's forward."""

    kernel = ("linear(qkv) + attention (relative position bias and shift mask as its mask) + linear(proj) (timm's "
              "forward where the bias table needs a gradient, or in training with attention dropout)")
    walks_children = True

    def forward(self, x, mask=None):
        a, m = self.original, self._modules
        bias = None if self.training and m["attn_drop"].p else a._get_rel_pos_bias()
        if bias is None or bias.requires_grad:
            return a(x, mask)
        B_, N, _ = x.shape
        q, k, v = m["qkv"](x).reshape(B_, N, 3, a.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        if mask is not None:
            windows = mask.shape[0]
            mask = mask.view(1, windows, 1, N, N).expand(B_ // windows, -1, a.num_heads, -1, -1)
            bias = bias + mask.reshape(-1, a.num_heads, N, N)
        out = attention(q, k, v, bias, scale=a.scale)
        return m["proj_drop"](m["proj"](out.transpose(1, 2).reshape(B_, N, -1)))
