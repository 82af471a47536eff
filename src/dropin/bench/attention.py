"""Suite "attention": dropin vs F.scaled_dot_product_attention (its default choice and each backend) vs the
eager softmax(QK^T)V of HF's attention, checked against float64 (torch's math backend).

Each shape runs forward only ("fwd") and forward + backward ("fwd+bwd": the gradients of q, k and v for a
fixed upstream gradient, checked as one concatenated vector). FLOPs: 4 * B * H * Lq * Lk * E forward, halved
when causal; the backward counts 2.5x the forward.
Full cases (GPU): bf16 (4, 32, 4096, 128) causal and not, bf16 (16, 16, 1024, 64) causal and not, seed 002's
Llama layer (2, 4 heads, 1024, head dim 256) in fp32 with its causal + padding 4-D additive mask, and CvT-13's
stage 3 (6 heads of 64, 197 queries, 50 keys). Quick cases (interpreter, or --quick): tiny shapes.
"""
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dropin import _runtime, ops
from dropin.ops.attention import attention_ref

from .harness import TORCH_DTYPES, Case, Skipped, randn

_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
             "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_math": SDPBackend.MATH}


def _sdpa_backend(name):
    """F.scaled_dot_product_attention restricted to one backend; Skipped where it cannot take the case."""
    def provider(*args, **kwargs):
        try:
            with sdpa_kernel(_BACKENDS[name]):
                return F.scaled_dot_product_attention(*args, **kwargs)
        except RuntimeError as e:
            if "No available kernel" in str(e) or "No viable backend" in str(e):
                raise Skipped(f"skipped: no {name} kernel for this case") from e
            raise
    return provider


@functools.lru_cache(maxsize=8)
def _causal_bias(lq, lk, device, dtype):
    """HF's causal mask: finfo.min above the diagonal, in the model's dtype."""
    above = torch.ones(lq, lk, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(lq, lk, dtype=dtype, device=device).masked_fill(above, torch.finfo(dtype).min)


def hf_eager(q, k, v, attn_mask=None, is_causal=False):
    """HF's eager attention: softmax(q k^T * scale + mask) in fp32, cast back, times v (the causal mask an
    additive tensor, as HF builds it)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if is_causal:
        attn_mask = _causal_bias(q.shape[-2], k.shape[-2], q.device, q.dtype)
    if attn_mask is not None:
        scores = scores + attn_mask
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _with(fn, is_causal):
    """fn(q, k, v, mask=None) -> the attention output, with is_causal bound."""
    return lambda q, k, v, *mask: fn(q, k, v, *mask, is_causal=is_causal)


def _grads(fn, grad, q, k, v, *mask):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(fn(*leaves, *mask), leaves, grad)


def _fwd_bwd(fn):
    """A provider timing forward + backward: takes (grad, q, k, v, [mask]), returns dq, dk, dv concatenated."""
    return lambda *inputs: torch.cat([g.flatten() for g in _grads(fn, *inputs)])


def _per_batch_entry(fn, backward):
    """The reference: fn one batch entry at a time (the float64 scores of the large cases would not fit in
    memory at once), put together as the providers give their results."""
    def reference(*inputs):
        entries = [[t[i:i + 1] if t.shape[0] > 1 else t for t in inputs] for i in range(inputs[0].shape[0])]
        if not backward:
            return torch.cat([fn(*entry) for entry in entries])
        grads = zip(*(_grads(fn, *entry) for entry in entries))  # (dq parts, dk parts, dv parts)
        return torch.cat([torch.cat(parts).flatten() for parts in grads])
    return reference


def llama_mask(batch, seq, dtype):
    """Seed 002's mask as HF's eager Llama builds it: a [B, 1, L, L] additive mask, finfo.min where masked,
    from causality and the seed's padding mask tril(ones(batch, seq)) (batch b attends to tokens 0..b)."""
    padding = torch.tril(torch.ones(batch, seq, device=_runtime.KERNEL_DEVICE)) == 0
    pos = torch.arange(seq, device=padding.device)
    masked = (pos[None, :] > pos[:, None])[None] | padding[:, None, :]
    return torch.zeros(masked.shape, dtype=TORCH_DTYPES[dtype], device=padding.device).masked_fill(
        masked, torch.finfo(TORCH_DTYPES[dtype]).min)[:, None]


def attention_case(b, h, lq, lk, e, dtype, causal=False, mask=None, backward=False, note=""):
    """One shape: q [b, h, lq, e], k / v [b, h, lk, e]; mask: a function of the dtype giving a 4-D mask."""
    providers = {"dropin": ops.attention, "torch": F.scaled_dot_product_attention,
                 **{name: _sdpa_backend(name) for name in _BACKENDS}, "hf_eager": hf_eager}
    providers = {name: _with(fn, causal) for name, fn in providers.items()}
    reference = _per_batch_entry(_with(attention_ref, causal), backward)
    flops = 4 * b * h * lq * lk * e / (2 if causal else 1)
    if backward:
        providers = {name: _fwd_bwd(fn) for name, fn in providers.items()}
        flops *= 3.5

    def make_inputs():
        grad = (randn(b, h, lq, e, dtype=dtype),) if backward else ()
        return (*grad, randn(b, h, lq, e, dtype=dtype), randn(b, h, lk, e, dtype=dtype),
                randn(b, h, lk, e, dtype=dtype), *(() if mask is None else (mask(dtype),)))

    what = "causal" if causal else "mask" if mask is not None else "full"
    return Case(name=f"{'fwd+bwd' if backward else 'fwd'} {dtype} {b}x{h}x{lq}x{lk} d{e} {what}{note}",
                dtype=dtype, make_inputs=make_inputs, providers=providers, reference=reference, flops=flops)


def attention_cases(quick: bool) -> list:
    """Suite "attention": each shape forward, then forward + backward."""
    if quick:
        shapes = [dict(b=1, h=2, lq=64, lk=64, e=32, dtype="fp32", causal=True),
                  dict(b=2, h=2, lq=48, lk=48, e=32, dtype="fp32", mask=functools.partial(llama_mask, 2, 48),
                       note=" (seed 002 mask)"),
                  dict(b=2, h=2, lq=17, lk=10, e=32, dtype="fp16", note=" (CvT-like)")]
    else:
        shapes = [dict(b=4, h=32, lq=4096, lk=4096, e=128, dtype="bf16"),
                  dict(b=4, h=32, lq=4096, lk=4096, e=128, dtype="bf16", causal=True),
                  dict(b=16, h=16, lq=1024, lk=1024, e=64, dtype="bf16"),
                  dict(b=16, h=16, lq=1024, lk=1024, e=64, dtype="bf16", causal=True),
                  dict(b=2, h=4, lq=1024, lk=1024, e=256, dtype="fp32", mask=functools.partial(llama_mask, 2, 1024),
                       note=" (seed 002 Llama)"),
                  dict(b=64, h=6, lq=197, lk=50, e=64, dtype="bf16", note=" (CvT-13 stage 3)"),
                  dict(b=64, h=6, lq=197, lk=50, e=64, dtype="fp32", note=" (CvT-13 stage 3)")]
    return [attention_case(**shape, backward=backward) for shape in shapes for backward in (False, True)]

