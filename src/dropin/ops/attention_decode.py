"""Attention of one query per head over a long key/value cache (a decoding step): flash decoding, the keys split
across programs.

One query row per head gives the flash forward (`attention_kernels.fwd_kernel`) one program per head, each walking every
key: a handful of programs on a GPU of 100+ SMs. Here the keys of each K/V head are cut into `splits` ranges, one
program per (batch, K/V head, range) over the query heads of its group (grouped-query attention reads each K/V tile
once for the whole group); each writes its range's unnormalized output, row maximum and row sum in fp32, and a
second kernel combines the ranges (rescaling each by exp(its max - the overall max)). Scores stay in natural units
(an additive mask of HF's finfo.min keeps its meaning). A row that attends to no key gives 0, as torch.
Inference only: the autograd path takes the flash kernels.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from . import _gemm
from ._dispatch import Launch, absent, aligned, plan, switch, torch_op
from ._gemm import dot
from .attention_kernels import natural_exp

BLOCK_N = 64


def fp32_chunk(dtype: torch.dtype, precision: str, block_d: int) -> int:
    """The longest chain of true fp32's sums over the head dim (CHUNK; 0: one chain), for these kernels and the
    flash kernels (`attention._chunk`): 32 over head-dim tiles past 32. One chain over a head dim of 128 took the
    fuzz suite's one-query fp32 cases to 2.5x torch's error (median over 24 seeds; probes/fuzz_repro.py 51), chains
    of 32 within 2x."""
    return 32 if dtype == torch.float32 and precision in ("ieee", "tf32x3") and block_d > 32 else 0


# --- 1. Reference --------------------------------------------------------------------------------------------

def decode_ref(q, k, v, mask=None, scale=None):
    return F.scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=True)


# --- 2. Kernels ----------------------------------------------------------------------------------------------

@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, part_ptr, stats_ptr,
                  HK, Lk, keys_per_split, splits, scale,
                  s_qb, s_qh, s_qd, s_kb, s_kh, s_kn, s_kd, s_vb, s_vh, s_vn, s_vd, s_mb, s_mh, s_mk,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """Program (b * HK + hk, split): the query heads hk * GROUP ... of batch b against keys [start, end) of this
    split. part [B, H, splits, E] (fp32): the unnormalized output; stats [B, H, splits, 2]: row max, row sum.
    CHUNK > 0 (true fp32): the scores' sums over the head dim in chains of CHUNK terms, added in fp32 (as
    `_gemm.dot_acc`'s two levels; q and k read CHUNK columns at a time)."""
    scale = tl.cast(scale, tl.float32)  # (Inductor passes Python floats as fp64)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // HK
    hk = bh % HK
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    h = (hk * GROUP + g).to(tl.int64)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * s_qb + h[:, None] * s_qh + d[None, :] * s_qd, mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    k_base = k_ptr + b64 * s_kb + hk.to(tl.int64) * s_kh
    v_base = v_ptr + b64 * s_vb + hk.to(tl.int64) * s_vh
    m_base = mask_ptr + b64 * s_mb + h[:, None] * s_mh
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, Lk)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_ok = n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        if CHUNK:
            s = tl.zeros((BLOCK_G, BLOCK_N), tl.float32)
            for d0 in tl.range(0, HEAD_DIM, CHUNK):  # (not unrolled: each unrolled chunk takes shared memory)
                dc = d0 + tl.arange(0, CHUNK)
                qc = tl.load(q_ptr + b64 * s_qb + h[:, None] * s_qh + dc[None, :] * s_qd,
                             mask=g_ok[:, None] & (dc < HEAD_DIM)[None, :], other=0.0)
                kc = tl.load(k_base + n[:, None] * s_kn + dc[None, :] * s_kd,
                             mask=n_ok[:, None] & (dc < HEAD_DIM)[None, :], other=0.0)
                s = s - dot(-qc, tl.trans(kc), PRECISION)  # (a fresh chain per chunk: `_gemm.dot_acc`)
            s = s * scale
        else:
            k = tl.load(k_base + n[:, None] * s_kn + d[None, :] * s_kd, mask=kv_mask, other=0.0)
            s = dot(q, tl.trans(k), PRECISION) * scale
        if MASK == "float":
            s += tl.load(m_base + n[None, :] * s_mk, mask=g_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        elif MASK == "bool":
            keep = tl.load(m_base + n[None, :] * s_mk, mask=g_ok[:, None] & n_ok[None, :], other=0)
            s = tl.where(keep != 0, s, float("-inf"))
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # (a row with no key so far: exp(-inf) = 0)
        p = natural_exp(s - m_safe[:, None], q_ptr.dtype.element_ty == tl.float32)
        alpha = natural_exp(m_i - m_safe, q_ptr.dtype.element_ty == tl.float32)
        v = tl.load(v_base + n[:, None] * s_vn + d[None, :] * s_vd, mask=kv_mask, other=0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    row = (b64 * HK * GROUP + h) * splits + split
    tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(stats_ptr + row * 2, m_i, mask=g_ok)
    tl.store(stats_ptr + row * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _combine_kernel(part_ptr, stats_ptr, o_ptr, H, splits, s_ob, s_oh, s_od,
                    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program b * H + h: out[b, h] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s (0 with no key)."""
    bh = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < splits
    rows = bh * splits + s
    m = tl.load(stats_ptr + rows * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(stats_ptr + rows * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & (d < HEAD_DIM)[None, :],
                  other=0.0)
    top = tl.max(m, 0)
    w = natural_exp(m - tl.where(top == float("-inf"), 0.0, top), o_ptr.dtype.element_ty == tl.float32)
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    b = bh // H
    h = bh % H
    tl.store(o_ptr + b * s_ob + h * s_oh + d * s_od, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# --- 3. Launcher ---------------------------------------------------------------------------------------------

def _splits(B: int, HK: int, Lk: int, device_index: int) -> tuple[int, int]:
    """(splits, keys per split): about two programs per SM over B * HK groups, each split a whole number of
    BLOCK_N tiles and at least one."""
    tiles = _runtime.cdiv(Lk, BLOCK_N)
    wanted = max(1, min(tiles, _runtime.cdiv(2 * _runtime.num_sms(device_index), B * HK)))
    keys = _runtime.cdiv(tiles, wanted) * BLOCK_N
    return _runtime.cdiv(Lk, keys), keys


_plans: dict = {}


def _decode_impl(q, k, v, mask: Optional[torch.Tensor], scale: float, traced: bool = False):
    """out [B, H, 1, E] (contiguous) for q [B, H, 1, E], k / v [B, HK, Lk, E], mask None or [B, H, 1, Lk]
    (bool or additive float; any strides, stride 0 where broadcast). traced: under torch.compile (`_dispatch`)."""
    B, H, _, E = q.shape
    out = q.new_empty((B, H, 1, E))
    if out.numel() == 0:
        return out
    run, mask_t, (part_shape, stats_shape) = _decode_plan(q, k, v, mask, scale, traced)
    run(q, k, v, mask_t, torch.empty(part_shape, device=q.device, dtype=torch.float32),
        torch.empty(stats_shape, device=q.device, dtype=torch.float32), out)
    return out


def _decode_plan(q, k, v, mask: Optional[torch.Tensor], scale: float, traced: bool):
    """(run, mask_t, (part shape, stats shape)): the plan for this signature, run(q, k, v, mask_t, part, stats,
    out), the mask as the kernel reads it and the shapes of the fp32 partials."""
    B, H, _, E = q.shape
    HK, Lk = k.shape[1], k.shape[2]
    kind = "none" if mask is None else "bool" if mask.dtype == torch.bool else "float"
    # a bool mask read as bytes, or as bool under tracing (Inductor cannot lower a bool tensor's dtype view)
    mask_t = absent(q, traced) if mask is None else mask.view(torch.uint8) if kind == "bool" and not traced else mask
    mask_strides = (0, 0, 0) if mask is None else (mask.stride(0), mask.stride(1), mask.stride(3))
    group = H // HK
    precision = _gemm.precision(q.dtype, k=E)
    splits, keys = _splits(B, HK, Lk, q.device.index or 0)

    def make():
        block_d = max(16, _runtime.next_power_of_2(E))
        meta = dict(GROUP=group, HEAD_DIM=E, MASK=kind, PRECISION=precision,
                    BLOCK_G=max(16, _runtime.next_power_of_2(group)), BLOCK_N=BLOCK_N, BLOCK_D=block_d,
                    CHUNK=fp32_chunk(q.dtype, precision, block_d), num_warps=4 if block_d <= 64 else 8)
        split = Launch(_split_kernel, (B * HK, splits), meta, traced=traced)
        combine = Launch(_combine_kernel, (B * H,), dict(HEAD_DIM=E, BLOCK_D=block_d, num_warps=4,
                                                          BLOCK_S=max(2, _runtime.next_power_of_2(splits))),
                         traced=traced)
        strides = (q.stride(0), q.stride(1), q.stride(3), *k.stride(), *v.stride(), *mask_strides)

        def run(q, k, v, mask_t, part, stats, out):
            split(q, k, v, mask_t, part, stats, HK, Lk, keys, splits, scale, *strides)
            combine(part, stats, out, H, splits, out.stride(0), out.stride(1), out.stride(3))
        return run

    key = tuple(None if t is None else (t.shape, t.stride(), t.dtype, aligned(t, traced)) for t in (q, k, v, mask))
    return plan(_plans, (key, q.device, scale, precision), make, traced), mask_t, ((B, H, splits, E),
                                                                                 (B, H, splits, 2))


def decode_shortcut(q, k, v, mask: Optional[torch.Tensor], scale: float):
    """For `Shortcuts`: run(q, k, v, mask) -> out, `decode`'s later eager calls of this signature (q, k, v and
    mask as decode takes them: the shortcut's caller passes tensors at their addresses, a mask of its dtype)."""
    if q.numel() == 0:
        return None
    plan_run, _, (part_shape, stats_shape) = _decode_plan(q, k, v, mask, scale, False)
    as_bytes = mask is not None and mask.dtype == torch.bool
    out_shape, dtype, device = q.shape, q.dtype, q.device

    def run(q, k, v, mask):
        out = torch.empty(out_shape, dtype=dtype, device=device)
        mask_t = q if mask is None else mask.view(torch.uint8) if as_bytes else mask
        plan_run(q, k, v, mask_t, torch.empty(part_shape, device=device, dtype=torch.float32),
                 torch.empty(stats_shape, device=device, dtype=torch.float32), out)
        return out
    return run


# --- 4. Registration as a torch op (what torch.compile traces: `_dispatch`) -------------------------------------

@torch_op("dropin::attention_decode", mutates_args=())
def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
               scale: float) -> torch.Tensor:
    return _decode_impl(q, k, v, mask, scale, traced=True)


_decode = switch(_decode_op, _decode_impl)


def decode(q, k, v, mask: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Attention of q [B, H, 1, E] over k / v [B, HK, Lk, E] (HK divides H) with an optional mask broadcast to
    [B, H, 1, Lk] (bool: True attends; or additive float), no causal mask, no gradient: the `attention` call of a
    decoding step after its argument checks (see dropin.ops.attention)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _decode(q, k, v, mask, scale)
