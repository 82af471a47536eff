"""Scaled dot-product attention (torch.nn.functional.scaled_dot_product_attention semantics): flash attention,
forward and backward.

q [B, H, Lq, E], k and v [B, HK, Lk, E] (HK divides H: grouped-query / multi-query attention), any strides.
No kernel ever holds the [Lq, Lk] score matrix: tiles of keys stream past a tile of queries.
- forward `_fwd_kernel`: one program per (query tile, batch * head); online softmax in base 2 with the
  softmax scale times log2(e) folded into the scores. Per query row it keeps the row maximum and 1 / the row
  sum (`stats`), from which the backward recomputes the probabilities.
- backward: `_delta_kernel` (rowsum(dO * O)), `_dkdv_kernel` (one program per key tile and K/V head, walking
  the query tiles of every query head of its group: no atomics) and `_dq_kernel` (one program per query tile,
  walking the key tiles).
Tiles that lie inside both sequences and (causal) below the diagonal skip all per-entry masking; only the
tiles on the diagonal and at the ends of the sequences pay for it (EDGE). q, k, v and dO are read with TMA
tensor descriptors (Hopper, 16-bit, aligned strides: rows past the end read 0) or with pointers (any
strides: rows past the end read the last row); either way such rows are masked out of the scores.
Masks: `is_causal` (top-left aligned as in torch), or `attn_mask`, boolean (True: attend) or additive float,
read through strides with stride 0 over broadcast dims. With an additive mask the scores stay in natural
units (exp instead of exp2): HF's finfo.min masks then keep torch's meaning, which scaling by log2 e would
overflow to -inf.
One query row per head, no causal mask and no gradient (a decoding step) takes `attention_decode` instead.
Rows that attend to no key give 0, as torch does (its math backend, torch >= 2.5), with 0 gradients.
float32 follows torch's rule for matmuls: tf32 when `torch.backends.cuda.matmul.allow_tf32`, otherwise true
fp32: tf32x3 on the tensor cores where the head dim and both lengths are >= 256 (matmul's rule; every MMA chain
at most 32 long, the head dim read in chunks of 32), fp32 FMAs elsewhere.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _runtime
from . import _autotune
from ._dispatch import Launch, Shortcuts, absent, aligned, plan, switch, torch_op
from .attention_decode import decode, decode_shortcut
from .attention_ranges import RANGE_ROWS, query_tile_ranges, ranges_launch
from .matmul import _autocast, _dot, _dot_acc, _precision

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# --- 1. Reference ----------------------------------------------------------------------------------------

def attention_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch's math backend: softmax(q k^T * scale + mask) v, differentiated by autograd. (Its fused backends
    recompute the probabilities from one log-sum-exp, which an additive finfo.min mask absorbs: on a row with
    no unmasked key their gradient is Lk times too large.)"""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


# --- 2. Kernels ------------------------------------------------------------------------------------------

@triton.jit
def _rows(start, L, BLOCK: tl.constexpr, EDGE: tl.constexpr):
    """Indices start .. start + BLOCK, and the row each reads: clamped into [0, L) on an EDGE tile."""
    offs = start + tl.arange(0, BLOCK)
    if EDGE:
        rows = tl.minimum(offs, L - 1)
    else:
        rows = offs
    return offs, rows


@triton.jit
def _source(ptr, B, HEADS, L, stride_b, stride_h, stride_l,
            HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """What `_tile` reads q, k, v or dO from: (TMA) a tensor descriptor over [B, HEADS, L, HEAD_DIM] (unit
    stride last), else the pointer itself."""
    if TMA:
        src = tl.make_tensor_descriptor(ptr, [B, HEADS, L, HEAD_DIM], [stride_b, stride_h, stride_l, 1],
                                        [1, 1, BLOCK, BLOCK_D])
    else:
        src = ptr
    return src


@triton.jit
def _tile(src, b, h, start, rows, stride_b, stride_h, stride_l, stride_d,
          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, TMA: tl.constexpr):
    """Rows start .. start + BLOCK of head (b, h) as a [BLOCK, BLOCK_D] tile, columns past HEAD_DIM 0: TMA
    reads rows past the end as 0, pointers read `rows` (clamped by `_rows` on an EDGE tile)."""
    if TMA:
        tile = src.load([b, h, start, 0]).reshape(BLOCK, BLOCK_D)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        ptrs = (src + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None] * stride_l
                + offs_d[None, :] * stride_d)
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _cols(ptr, b, h, rows, stride_b, stride_h, stride_l, stride_d, d0,
          HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Columns d0 .. d0 + CHUNK of `rows` of head (b, h) (pointer loads), columns past HEAD_DIM 0."""
    offs_d = d0 + tl.arange(0, CHUNK)
    ptrs = (ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None] * stride_l
            + offs_d[None, :] * stride_d)
    if HEAD_DIM % CHUNK == 0:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def _dot_t(a, a_ptr, a_b, a_h, a_rows, sa_b, sa_h, sa_l, sa_d, b, b_ptr, b_b, b_h, b_rows, sb_b, sb_h, sb_l, sb_d,
           PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr):
    """a @ b^T, a product over the head dim of two row tiles. CHUNK > 0 (true fp32 on the tensor cores, tf32x3,
    whose MMA chains truncate their running sums): the rows are read again from memory CHUNK columns at a time
    and the chunks' products summed in fp32, so that no chain is longer than CHUNK (a two-level sum, as
    _dot_acc's); else the tiles a and b as they are."""
    if CHUNK:  # (a loop, not unrolled: each unrolled chunk's operands took shared memory of their own)
        c = tl.zeros((a.shape[0], b.shape[0]), dtype=tl.float32)
        for d0 in tl.range(0, BLOCK_D, CHUNK):
            c = c - _dot(-_cols(a_ptr, a_b, a_h, a_rows, sa_b, sa_h, sa_l, sa_d, d0, HEAD_DIM, CHUNK),
                         tl.trans(_cols(b_ptr, b_b, b_h, b_rows, sb_b, sb_h, sb_l, sb_d, d0, HEAD_DIM, CHUNK)),
                         PRECISION)
    else:
        c = _dot(a, tl.trans(b), PRECISION)
    return c


@triton.jit
def _scores(qk, qi, kj, Lq, Lk, mask_base, stride_mq, stride_mk, qk_scale,
            MASK: tl.constexpr, CAUSAL: tl.constexpr, EDGE: tl.constexpr):
    """Scores of one tile from qk = q . k; qi / kj: the query / key index of each entry (broadcasting to the
    tile, in either orientation). Log2 units (qk_scale = scale * log2 e), natural units with an additive
    mask (qk_scale = scale). -inf where the mask says no, and (EDGE) past Lq or Lk or above the diagonal."""
    s = qk * qk_scale
    if MASK != "none":
        # bounds as the load's mask (constant along runs of 16 keys: vector loads), not as clamped indices
        mask = tl.load(mask_base + qi.to(tl.int64) * stride_mq + kj * stride_mk, mask=(qi < Lq) & (kj < Lk),
                       other=0)
        if MASK == "float":
            s = s + mask.to(tl.float32)
        else:
            s = tl.where(mask != 0, s, float("-inf"))
    if EDGE:
        keep = (qi < Lq) & (kj < Lk)
        if CAUSAL:
            keep = keep & (kj <= qi)
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def _exp(x, MASK: tl.constexpr):
    """exp of a difference of scores, in their units."""
    if MASK == "float":
        y = tl.exp(x)
    else:
        y = tl.math.exp2(x)
    return y


@triton.jit
def _key_ranges(start_m, Lk, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(mid, hi) for a query tile at start_m: key tiles [0, mid) need no masking, [mid, hi) are EDGE tiles
    (BLOCK_M is a multiple of BLOCK_N, so the diagonal starts on a key tile boundary)."""
    full = Lk // BLOCK_N * BLOCK_N
    if CAUSAL:
        mid = tl.minimum(start_m, full)
        hi = tl.minimum(start_m + BLOCK_M, Lk)
    else:
        mid = full
        hi = Lk
    return mid, hi


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
               offs_m, lo, hi, k_ptr, k_src, v_src, hk, mask_base, Lq, Lk, qk_scale,
               stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
               stride_mq, stride_mk,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, EDGE: tl.constexpr, FULL: tl.constexpr,
               PRECISION: tl.constexpr, TMA: tl.constexpr, FOLD: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Online softmax over the key tiles [lo, hi): the running output, row sums and row maxima. FULL: the mask
    attends wholly on these tiles (`attention_ranges`): it is not read, its kind only sets the units. FOLD
    (scale > 0): on tiles whose scores are all finite (no mask read, not EDGE) the row maximum is taken before
    scaling and the scale folds into one FMA with its subtraction."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)  # every lo is one (or its range is empty)
        offs_n, rows_n = _rows(start_n, Lk, BLOCK_N, EDGE)
        k = _tile(k_src, b, hk, start_n, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                  HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
        qk = _dot_t(q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
                    k, k_ptr, b, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                    PRECISION, HEAD_DIM, BLOCK_D, CHUNK)
        if FOLD and not EDGE and (MASK == "none" or FULL):
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_use = m_new
            p = _exp(qk * qk_scale - m_new[:, None], MASK)
        else:
            if FULL:
                s = _scores(qk, offs_m[:, None], offs_n[None, :], Lq, Lk, mask_base, stride_mq, stride_mk,
                            qk_scale, "none", CAUSAL, EDGE)
            else:
                s = _scores(qk, offs_m[:, None], offs_n[None, :], Lq, Lk, mask_base, stride_mq, stride_mk,
                            qk_scale, MASK, CAUSAL, EDGE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp away from -inf - -inf
            p = _exp(s - m_use[:, None], MASK)
        alpha = _exp(m_i - m_use, MASK)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(v_src, b, hk, start_n, rows_n, stride_vb, stride_vh, stride_vn, stride_vd,
                  HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
        acc = _dot_acc(acc * alpha[:, None], p.to(v.dtype), v, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, ranges_ptr, o_ptr, stats_ptr,
                B, H, HK, Lq, Lk, qk_scale,
                stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_mq, stride_mk,
                stride_rb, stride_rh, stride_ob, stride_oh, stride_om, stride_od,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                FOLD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, RANGE_ROWS: tl.constexpr):
    """Grid (query tiles, B * H). stats [B, H, 2, Lq] fp32: the row maximum of the scores (+inf for a row that
    attends to nothing) and 1 / the row sum: the backward's P = exp(s - max) / sum is then the forward's own
    (no log-sum-exp, whose rounding would not cancel against O in rowsum(dO * O), and which a finfo.min
    maximum would absorb). With a mask, ranges (`attention_ranges`, strides stride_rb / stride_rh) say which key
    tiles to skip, which to read the mask on and which attend wholly."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # (Inductor passes Python floats as fp64)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // (H // HK)
    offs_m, rows_m = _rows(start_m, Lq, BLOCK_M, True)
    q_src = _source(q_ptr, B, H, Lq, stride_qb, stride_qh, stride_qm, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    k_src = _source(k_ptr, B, HK, Lk, stride_kb, stride_kh, stride_kn, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    v_src = _source(v_ptr, B, HK, Lk, stride_vb, stride_vh, stride_vn, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    q = _tile(q_src, b, h, start_m, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
              HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    mask_base = mask_ptr + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    if MASK == "none":  # key tiles [0, mid) unmasked, [mid, hi) EDGE
        mid, hi = _key_ranges(start_m, Lk, CAUSAL, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm,
                                   stride_qd, offs_m, 0, mid, k_ptr, k_src, v_src, hk, mask_base, Lq, Lk,
                                   qk_scale, stride_kb, stride_kh, stride_kn, stride_kd,
                                   stride_vb, stride_vh, stride_vn, stride_vd, stride_mq, stride_mk,
                                   MASK, CAUSAL, False, False, PRECISION, TMA, FOLD, HEAD_DIM, BLOCK_D, BLOCK_N,
                                   CHUNK)
    else:  # [lo, full_lo) and [full_hi, hi) read the mask (EDGE), [full_lo, full_hi) attend wholly
        ranges_base = ranges_ptr + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh
        lo, full_lo, full_hi, hi = query_tile_ranges(ranges_base, start_m, Lq, Lk, BLOCK_M, BLOCK_N, RANGE_ROWS)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm,
                                   stride_qd, offs_m, full_lo, full_hi, k_ptr, k_src, v_src, hk, mask_base, Lq, Lk,
                                   qk_scale, stride_kb, stride_kh, stride_kn, stride_kd,
                                   stride_vb, stride_vh, stride_vn, stride_vd, stride_mq, stride_mk,
                                   MASK, CAUSAL, False, True, PRECISION, TMA, FOLD, HEAD_DIM, BLOCK_D, BLOCK_N,
                                   CHUNK)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm,
                                   stride_qd, offs_m, lo, full_lo, k_ptr, k_src, v_src, hk, mask_base, Lq, Lk,
                                   qk_scale, stride_kb, stride_kh, stride_kn, stride_kd,
                                   stride_vb, stride_vh, stride_vn, stride_vd, stride_mq, stride_mk,
                                   MASK, CAUSAL, True, False, PRECISION, TMA, FOLD, HEAD_DIM, BLOCK_D, BLOCK_N,
                                   CHUNK)
        mid = full_hi
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
                               offs_m, mid, hi, k_ptr, k_src, v_src, hk, mask_base, Lq, Lk,
                               qk_scale, stride_kb, stride_kh, stride_kn, stride_kd,
                               stride_vb, stride_vh, stride_vn, stride_vd, stride_mq, stride_mk,
                               MASK, CAUSAL, True, False, PRECISION, TMA, FOLD, HEAD_DIM, BLOCK_D, BLOCK_N, CHUNK)
    empty = l_i == 0.0
    l_i = tl.where(empty, 1.0, l_i)
    out = acc / l_i[:, None]
    in_rows = offs_m < Lq
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = (o_ptr + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
              + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=in_rows[:, None] & (offs_d[None, :] < HEAD_DIM))
    stats = stats_ptr + bh.to(tl.int64) * 2 * Lq + offs_m
    tl.store(stats, tl.where(empty, float("inf"), m_i), mask=in_rows)
    tl.store(stats + Lq, 1.0 / l_i, mask=in_rows)


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, H, Lq,
                  stride_ob, stride_oh, stride_om, stride_od, stride_db, stride_dh, stride_dm, stride_dd,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[B, H, Lq] = rowsum(dO * O) in fp32; grid (query tiles, B * H)."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start_m = tl.program_id(0) * BLOCK_M
    offs_m, rows_m = _rows(start_m, Lq, BLOCK_M, True)
    o = _tile(o_ptr, b, h, start_m, rows_m, stride_ob, stride_oh, stride_om, stride_od,
              HEAD_DIM, BLOCK_D, BLOCK_M, False)
    do = _tile(do_ptr, b, h, start_m, rows_m, stride_db, stride_dh, stride_dm, stride_dd,
               HEAD_DIM, BLOCK_D, BLOCK_M, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, k_ptr, v_ptr, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd, offs_n, lo, hi, q_ptr, q_src, do_ptr, do_src, b, h,
                stats_base, delta_base, mask_base, Lq, Lk, qk_scale, stride_qb, stride_qh, stride_qm, stride_qd,
                stride_db, stride_dh, stride_dm, stride_dd, stride_mq, stride_mk,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, EDGE: tl.constexpr, PRECISION: tl.constexpr,
                TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                CHUNK: tl.constexpr):
    """dK, dV of one key tile summed over the query tiles [lo, hi) of head h, in the transposed orientation
    (rows are keys), so that P^T and dS^T feed the products as they come out of the score product."""
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)  # every lo is one (or its range is empty)
        offs_m, rows_m = _rows(start_m, Lq, BLOCK_M, EDGE)
        q = _tile(q_src, b, h, start_m, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
                  HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
        kq = _dot_t(k, k_ptr, b, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                    q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd, PRECISION, HEAD_DIM,
                    BLOCK_D, CHUNK)
        st = _scores(kq, offs_m[None, :], offs_n[:, None], Lq, Lk,
                     mask_base, stride_mq, stride_mk, qk_scale, MASK, CAUSAL, EDGE)
        m = tl.load(stats_base + rows_m)
        inv_l = tl.load(stats_base + Lq + rows_m)
        pt = _exp(st - m[None, :], MASK) * inv_l[None, :]
        do = _tile(do_src, b, h, start_m, rows_m, stride_db, stride_dh, stride_dm, stride_dd,
                   HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
        dv = _dot_acc(dv, pt.to(do.dtype), do, PRECISION)
        dpt = _dot_t(v, v_ptr, b, hk, rows_n, stride_vb, stride_vh, stride_vn, stride_vd,
                     do, do_ptr, b, h, rows_m, stride_db, stride_dh, stride_dm, stride_dd, PRECISION, HEAD_DIM,
                     BLOCK_D, CHUNK)
        dst = pt * (dpt - tl.load(delta_base + rows_m)[None, :])
        dk = _dot_acc(dk, dst.to(q.dtype), q, PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, stats_ptr, delta_ptr, dk_ptr, dv_ptr,
                 B, H, HK, Lq, Lk, qk_scale, sm_scale,
                 stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_mq, stride_mk,
                 stride_db, stride_dh, stride_dm, stride_dd,
                 MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CHUNK: tl.constexpr):
    """Grid (key tiles, B * HK); dk and dv are contiguous [B, HK, Lk, E]. BLOCK_N is a multiple of BLOCK_M.
    Causal: query tiles before the key tile see none of it; those on the diagonal are EDGE tiles."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # (Inductor passes Python floats as fp64)
    sm_scale = tl.cast(sm_scale, tl.float32)
    start_n = tl.program_id(0) * BLOCK_N
    bhk = tl.program_id(1)
    b = bhk // HK
    hk = bhk % HK
    group = H // HK
    offs_n, rows_n = _rows(start_n, Lk, BLOCK_N, True)
    k = _tile(_source(k_ptr, B, HK, Lk, stride_kb, stride_kh, stride_kn, HEAD_DIM, BLOCK_D, BLOCK_N, TMA),
              b, hk, start_n, rows_n, stride_kb, stride_kh, stride_kn, stride_kd, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    v = _tile(_source(v_ptr, B, HK, Lk, stride_vb, stride_vh, stride_vn, HEAD_DIM, BLOCK_D, BLOCK_N, TMA),
              b, hk, start_n, rows_n, stride_vb, stride_vh, stride_vn, stride_vd, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    q_src = _source(q_ptr, B, H, Lq, stride_qb, stride_qh, stride_qm, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    do_src = _source(do_ptr, B, H, Lq, stride_db, stride_dh, stride_dm, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    full = Lq // BLOCK_M * BLOCK_M
    if CAUSAL:
        lo = start_n
        band = tl.minimum(start_n + BLOCK_N, Lq)
    else:
        lo = 0
        band = 0
    tail = tl.maximum(band, full)
    for g in range(group):
        h = hk * group + g
        row = (b * H + h).to(tl.int64) * Lq
        mask_base = mask_ptr + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
        dk, dv = _dkdv_tiles(dk, dv, k, v, k_ptr, v_ptr, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                             stride_vb, stride_vh, stride_vn, stride_vd, offs_n, lo, band, q_ptr, q_src, do_ptr,
                             do_src, b, h, stats_ptr + 2 * row, delta_ptr + row, mask_base, Lq, Lk, qk_scale,
                             stride_qb, stride_qh, stride_qm, stride_qd, stride_db, stride_dh, stride_dm, stride_dd,
                             stride_mq, stride_mk, MASK, CAUSAL, True, PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_M,
                             CHUNK)
        dk, dv = _dkdv_tiles(dk, dv, k, v, k_ptr, v_ptr, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                             stride_vb, stride_vh, stride_vn, stride_vd, offs_n, band, full, q_ptr, q_src, do_ptr,
                             do_src, b, h, stats_ptr + 2 * row, delta_ptr + row, mask_base, Lq, Lk, qk_scale,
                             stride_qb, stride_qh, stride_qm, stride_qd, stride_db, stride_dh, stride_dm, stride_dd,
                             stride_mq, stride_mk, MASK, CAUSAL, False, PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_M,
                             CHUNK)
        dk, dv = _dkdv_tiles(dk, dv, k, v, k_ptr, v_ptr, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                             stride_vb, stride_vh, stride_vn, stride_vd, offs_n, tail, Lq, q_ptr, q_src, do_ptr,
                             do_src, b, h, stats_ptr + 2 * row, delta_ptr + row, mask_base, Lq, Lk, qk_scale,
                             stride_qb, stride_qh, stride_qm, stride_qd, stride_db, stride_dh, stride_dm, stride_dd,
                             stride_mq, stride_mk, MASK, CAUSAL, True, PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_M,
                             CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    offs = bhk.to(tl.int64) * Lk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    store_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dk_ptr + offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=store_mask)
    tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _dq_tiles(dq, q, do, q_ptr, do_ptr, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
              stride_db, stride_dh, stride_dm, stride_dd, m, inv_l, delta, offs_m, lo, hi, k_ptr, k_src, v_ptr,
              v_src, b, hk, mask_base, Lq, Lk, qk_scale,
              stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
              stride_mq, stride_mk,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, EDGE: tl.constexpr, PRECISION: tl.constexpr,
              TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              CHUNK: tl.constexpr):
    """dQ of one query tile summed over the key tiles [lo, hi)."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)  # every lo is one (or its range is empty)
        offs_n, rows_n = _rows(start_n, Lk, BLOCK_N, EDGE)
        k = _tile(k_src, b, hk, start_n, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                  HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
        qk = _dot_t(q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
                    k, k_ptr, b, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd, PRECISION, HEAD_DIM,
                    BLOCK_D, CHUNK)
        s = _scores(qk, offs_m[:, None], offs_n[None, :], Lq, Lk,
                    mask_base, stride_mq, stride_mk, qk_scale, MASK, CAUSAL, EDGE)
        p = _exp(s - m[:, None], MASK) * inv_l[:, None]
        v = _tile(v_src, b, hk, start_n, rows_n, stride_vb, stride_vh, stride_vn, stride_vd,
                  HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
        dp = _dot_t(do, do_ptr, b, h, rows_m, stride_db, stride_dh, stride_dm, stride_dd,
                    v, v_ptr, b, hk, rows_n, stride_vb, stride_vh, stride_vn, stride_vd, PRECISION, HEAD_DIM,
                    BLOCK_D, CHUNK)
        ds = p * (dp - delta[:, None])
        dq = _dot_acc(dq, ds.to(k.dtype), k, PRECISION)
    return dq


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, stats_ptr, delta_ptr, dq_ptr,
               B, H, HK, Lq, Lk, qk_scale, sm_scale,
               stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
               stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_mq, stride_mk,
               stride_db, stride_dh, stride_dm, stride_dd,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CHUNK: tl.constexpr):
    """Grid (query tiles, B * H); dq is contiguous [B, H, Lq, E]."""
    qk_scale = tl.cast(qk_scale, tl.float32)  # (Inductor passes Python floats as fp64)
    sm_scale = tl.cast(sm_scale, tl.float32)
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // (H // HK)
    offs_m, rows_m = _rows(start_m, Lq, BLOCK_M, True)
    q = _tile(_source(q_ptr, B, H, Lq, stride_qb, stride_qh, stride_qm, HEAD_DIM, BLOCK_D, BLOCK_M, TMA),
              b, h, start_m, rows_m, stride_qb, stride_qh, stride_qm, stride_qd, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    do = _tile(_source(do_ptr, B, H, Lq, stride_db, stride_dh, stride_dm, HEAD_DIM, BLOCK_D, BLOCK_M, TMA),
               b, h, start_m, rows_m, stride_db, stride_dh, stride_dm, stride_dd, HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
    k_src = _source(k_ptr, B, HK, Lk, stride_kb, stride_kh, stride_kn, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    v_src = _source(v_ptr, B, HK, Lk, stride_vb, stride_vh, stride_vn, HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
    row = bh.to(tl.int64) * Lq
    m = tl.load(stats_ptr + 2 * row + rows_m)
    inv_l = tl.load(stats_ptr + 2 * row + Lq + rows_m)
    delta = tl.load(delta_ptr + row + rows_m)
    mask_base = mask_ptr + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    mid, hi = _key_ranges(start_m, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_tiles(dq, q, do, q_ptr, do_ptr, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_db, stride_dh, stride_dm, stride_dd, m, inv_l, delta, offs_m, 0, mid, k_ptr, k_src, v_ptr,
                   v_src, b, hk, mask_base, Lq, Lk, qk_scale,
                   stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_mq, stride_mk, MASK, CAUSAL, False, PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_N, CHUNK)
    dq = _dq_tiles(dq, q, do, q_ptr, do_ptr, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_db, stride_dh, stride_dm, stride_dd, m, inv_l, delta, offs_m, mid, hi, k_ptr, k_src, v_ptr,
                   v_src, b, hk, mask_base, Lq, Lk, qk_scale,
                   stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_mq, stride_mk, MASK, CAUSAL, True, PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_N, CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    offs = row * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(dq_ptr + offs, (dq * sm_scale).to(dq_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))


# --- 3. Launchers ----------------------------------------------------------------------------------------

def _cfg(block_m, block_n, warps, stages):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


# Candidates by (bytes per element, head-dim tile), the default first. Forward and dQ: BLOCK_M (queries) is a
# multiple of BLOCK_N (keys); dK/dV: BLOCK_N is a multiple of BLOCK_M (the diagonal falls on tile edges).
# Forward key tiles no wider than the head-dim tile (as tutorial 06 keeps them). Three each: tuning compiles
# every candidate (twice on Hopper: TMA and pointer loads), a few seconds apiece; fp32 d256 has a fourth for
# its tf32x3 path (the fastest there, `scratch/probe_attn_x3.py`; the FMA path spills in it).
_FWD_CONFIGS = {
    (2, 64): [_cfg(128, 64, 4, 3), _cfg(64, 64, 4, 4), _cfg(128, 32, 4, 3)],
    (2, 128): [_cfg(128, 128, 8, 3), _cfg(128, 64, 4, 3), _cfg(64, 64, 4, 3)],
    (2, 256): [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2), _cfg(64, 32, 4, 3)],
    (4, 64): [_cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3), _cfg(32, 32, 4, 3)],
    (4, 128): [_cfg(64, 32, 4, 3), _cfg(64, 64, 4, 2), _cfg(32, 32, 4, 3)],
    (4, 256): [_cfg(32, 32, 4, 2), _cfg(64, 32, 4, 2), _cfg(16, 16, 4, 2)],
}
_DKDV_CONFIGS = {
    (2, 64): [_cfg(32, 128, 4, 5), _cfg(64, 128, 8, 3), _cfg(32, 64, 4, 3)],
    (2, 128): [_cfg(32, 128, 8, 4), _cfg(64, 128, 8, 3), _cfg(32, 64, 4, 3)],
    (2, 256): [_cfg(32, 64, 4, 2), _cfg(16, 64, 4, 2), _cfg(16, 32, 4, 2)],
    (4, 64): [_cfg(32, 64, 4, 3), _cfg(32, 128, 8, 2), _cfg(16, 32, 4, 3)],
    (4, 128): [_cfg(32, 64, 4, 2), _cfg(16, 64, 4, 2), _cfg(16, 32, 4, 3)],
    (4, 256): [_cfg(16, 32, 4, 2), _cfg(16, 64, 4, 1), _cfg(16, 16, 4, 2), _cfg(32, 32, 4, 2)],
}
_DQ_CONFIGS = {
    (2, 64): [_cfg(128, 32, 4, 5), _cfg(128, 64, 8, 3), _cfg(64, 32, 4, 3)],
    (2, 128): [_cfg(128, 32, 8, 4), _cfg(128, 64, 8, 3), _cfg(64, 32, 4, 3)],
    (2, 256): [_cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2), _cfg(32, 16, 4, 2)],
    (4, 64): [_cfg(64, 32, 4, 3), _cfg(64, 64, 8, 2), _cfg(32, 16, 4, 3)],
    (4, 128): [_cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2), _cfg(32, 16, 4, 3)],
    (4, 256): [_cfg(32, 16, 4, 2), _cfg(32, 32, 4, 1), _cfg(16, 16, 4, 2), _cfg(64, 32, 4, 2)],
}
_DELTA_BLOCK_M = 64


def _attention_precision(q: torch.Tensor, Lk: int) -> str:
    """tl.dot's precision: matmul's rule (`_precision`), with the shortest of the head dim and the two lengths as
    its reduction: tf32x3 for float32 where all are >= TF32X3_MIN_K (then every product's chains are cut to
    `_chunk`'s length), FMAs where one is shorter."""
    return _precision(q.dtype, k=min(q.shape[2], q.shape[3], Lk))


def _chunk(precision: str) -> int:
    """The longest MMA chain of a product (CHUNK; 0: unbounded): 32 for tf32x3, as matmul's `_max_k`."""
    return 32 if precision == "tf32x3" else 0


def _block_d(head_dim: int) -> int:
    return max(16, _runtime.next_power_of_2(head_dim))


def _candidates(table: dict, q: torch.Tensor, Lq: int, Lk: int, tma: bool, masked: bool, chunk: int = 0,
                reduced: str = "") -> list:
    """The table's list for this dtype and head dim, less tiles larger than the bucketed lengths (the
    smallest candidate if none fits); with `tma`, each with TMA loads first, then with pointer loads.
    chunk > 0: only tiles whose `reduced` block (the one the kernel's tile products sum over) is at most chunk.
    masked: at most 2 stages where the head dim is 128 or more (the mask tiles take shared memory too: the
    3-stage 128x128 bf16 tile asked 234 KB of the H200's 227 KB, so the untuned default did not launch)."""
    configs = table[(min(q.element_size(), 4), max(64, _block_d(q.shape[-1])))]
    if masked and _block_d(q.shape[-1]) >= 128:
        configs = [dict(c, num_stages=min(c["num_stages"], 2)) for c in configs]
    bm, bn = _autotune.bucket(Lq), _autotune.bucket(Lk)
    configs = [c for c in configs if c["BLOCK_M"] <= bm and c["BLOCK_N"] <= bn] or configs[-1:]
    if chunk:
        configs = [c for c in configs if c[reduced] <= chunk]
    return [dict(c, TMA=True) for c in configs if tma] + [dict(c, TMA=False) for c in configs]


def _strides(t: torch.Tensor) -> tuple:
    """t's strides, those of size-1 dims (never stepped) replaced by the next dim's extent in elements: a
    valid stride for a tensor descriptor."""
    strides = list(t.stride())
    for i in range(t.dim() - 2, -1, -1):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * max(t.shape[i + 1], 1)
    return tuple(strides)


def _tma_ok(*tensors: torch.Tensor, traced: bool = False) -> bool:
    """Whether TMA tensor descriptors can read these [B, H, L, E] operands: Hopper, 16-bit, not empty, unit
    stride along E, 16-byte aligned base, other strides (`_strides`) positive multiples of 16 bytes."""
    t = tensors[0]
    if not _runtime.is_hopper(t.device.index or 0) or t.element_size() != 2:
        return False
    return all(t.numel() > 0 and t.stride(3) == 1 and aligned(t, traced) and (t.shape[3] * 2) % 16 == 0
               and all(s > 0 and (s * 2) % 16 == 0 for s in _strides(t)[:3]) for t in tensors)


def _mask_args(mask: Optional[torch.Tensor], q: torch.Tensor, traced: bool = False):
    """(tensor, its 4 strides, kind): an expanded [B, H, Lq, Lk] mask; an `absent` stand-in for a missing one. A bool
    mask is read as bytes, or as bool under tracing (Inductor cannot lower a bool tensor's dtype view)."""
    if mask is None:
        return absent(q, traced), (0, 0, 0, 0), "none"
    if mask.dtype == torch.bool:
        return mask if traced else mask.view(torch.uint8), mask.stride(), "bool"
    return mask, mask.stride(), "float"


def _tune_key(q, k, mask_kind, is_causal, precision, tma):
    Lq, E = q.shape[2:]
    return (q.dtype, precision, _block_d(E), _autotune.bucket(Lq), _autotune.bucket(k.shape[2]), mask_kind,
            is_causal, q.shape[1] // k.shape[1] > 1, tma)


_plans: dict = {}


def _signature(*tensors, traced: bool = False) -> tuple:
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, aligned(t, traced)) for t in tensors)


def _tuned(kernel, name: str, key: tuple, configs: list, grid, meta: dict, args: tuple,
           traced: bool = False) -> Launch:
    """A launcher of `kernel` with the config that `_autotune.pick` chooses for `key` (timing launches on
    `args` when tuning; traced: timing nothing, `_dispatch.plan`); grid(config) gives its grid."""
    def launcher(cfg):
        return Launch(kernel, grid(cfg), dict(meta, **cfg), scratch=cfg["TMA"], traced=traced)

    def prepare(cfg):  # a launch to time: built once, so it is timed on its fast path
        launch = launcher(cfg)
        return lambda: launch(*args)

    return launcher(_autotune.pick(name, key, configs, prepare))


def _fwd_impl(q, k, v, mask, is_causal: bool, scale: float, traced: bool = False):
    """(out, stats) for 4-D q [B, H, Lq, E], k / v [B, HK, Lk, E], mask None or [B, H, Lq, Lk] (any strides).
    out is [B, H, Lq, E] stored as [B, Lq, H, E] (as torch's flash attention stores it). traced: under
    torch.compile (`_dispatch`)."""
    B, H, Lq, E = q.shape
    # [B, Lq, H, E] in memory, its own buffer (a written view is what Inductor's mutation copy-back can miscompile)
    out = torch.empty_strided((B, H, Lq, E), (Lq * H * E, E, H * E, 1), device=q.device, dtype=q.dtype)
    stats = torch.empty((B, H, 2, Lq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, stats
    run, mask_t, qk_scale = _fwd_plan(q, k, v, mask, out, stats, is_causal, scale, traced)
    run(q, k, v, mask_t, out, stats, qk_scale)
    return out, stats


def _fwd_plan(q, k, v, mask, out, stats, is_causal: bool, scale: float, traced: bool):
    """(run, mask_t, qk_scale): the forward's plan for this signature, run(q, k, v, mask_t, out, stats, qk_scale),
    the mask as the kernel reads it and the scale of the scores it takes."""
    B, H, Lq, E = q.shape
    HK, Lk = k.shape[1], k.shape[2]
    mask_t, mask_strides, mask_kind = _mask_args(mask, q, traced)
    precision = _attention_precision(q, Lk)
    qk_scale = scale if mask_kind == "float" else scale * math.log2(math.e)

    def make():  # sizes and strides are fixed by the plan's key: computed once
        fixed = (B, H, HK, Lq, Lk)
        masked = mask_kind != "none"
        summarize, ranges_shape, ranges_strides = ranges_launch(mask, mask_kind, traced) if masked else (
            None, (0,), (0, 0))
        strides = (*_strides(q), *_strides(k), *_strides(v), *mask_strides, *ranges_strides, *out.stride())
        tma = _tma_ok(q, k, v, traced=traced)
        chunk = _chunk(precision)
        meta = dict(MASK=mask_kind, CAUSAL=is_causal, PRECISION=precision, FOLD=qk_scale > 0, HEAD_DIM=E,
                    BLOCK_D=_block_d(E), CHUNK=chunk, RANGE_ROWS=RANGE_ROWS)
        configs = _candidates(_FWD_CONFIGS, q, Lq, Lk, tma, masked, chunk, "BLOCK_N")

        def ranges_of(m):  # the mask's summary, or a stand-in without a mask
            if not masked:
                return absent(q, traced) if traced else m
            ranges = torch.empty(ranges_shape, device=q.device, dtype=torch.int32)
            summarize(m, ranges)
            return ranges

        timed_args = () if traced else (q, k, v, mask_t, ranges_of(mask_t), out, stats, *fixed, qk_scale, *strides)
        launch = _tuned(_fwd_kernel, "attention_fwd", _tune_key(q, k, mask_kind, is_causal, precision, tma),
                        configs, lambda c: (_runtime.cdiv(Lq, c["BLOCK_M"]), B * H), meta, timed_args, traced=traced)
        return lambda q, k, v, m, out, stats, qk_scale: launch(q, k, v, m, ranges_of(m), out, stats, *fixed,
                                                               qk_scale, *strides)

    plan_key = ("fwd", _signature(q, k, v, mask, traced=traced), q.device, is_causal, precision, qk_scale > 0)
    return plan(_plans, plan_key, make, traced=traced), mask_t, qk_scale


def _fwd_shortcut(q, k, v, out, stats, is_causal: bool, scale: float):
    """attention's later eager calls of this signature without a mask (`Shortcuts`): (q, k, v) -> out, the
    forward's plan on new out and stats laid out as this call's."""
    if out.numel() == 0:
        return None
    run, _, qk_scale = _fwd_plan(q, k, v, None, out, stats, is_causal, scale, False)
    shape, strides, stats_shape, dtype, device = out.shape, out.stride(), stats.shape, out.dtype, out.device

    def shortcut(q, k, v, mask=None):
        out = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        run(q, k, v, q, out, torch.empty(stats_shape, dtype=torch.float32, device=device), qk_scale)
        return out
    return shortcut


def _bwd_impl(grad_out, q, k, v, mask, out, stats, is_causal: bool, scale: float, traced: bool = False):
    """(dq, dk, dv), each shaped like its input; dq and dk / dv contiguous."""
    B, H, Lq, E = q.shape
    HK, Lk = k.shape[1], k.shape[2]
    dq = torch.empty((B, H, Lq, E), device=q.device, dtype=q.dtype)
    dk = torch.empty((B, HK, Lk, E), device=q.device, dtype=q.dtype)
    dv = torch.empty_like(dk)
    if dq.numel() == 0 or Lk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    mask_t, mask_strides, mask_kind = _mask_args(mask, q, traced)
    precision = _attention_precision(q, Lk)
    qk_scale = scale if mask_kind == "float" else scale * math.log2(math.e)
    delta = torch.empty((B, H, Lq), device=q.device, dtype=torch.float32)

    def make():  # sizes and strides are fixed by the plan's key: computed once
        fixed = (B, H, HK, Lq, Lk)
        strides = (*_strides(q), *_strides(k), *_strides(v), *mask_strides, *_strides(grad_out))
        delta_fixed = (H, Lq, *out.stride(), *grad_out.stride())
        tma = _tma_ok(q, k, v, grad_out, traced=traced)
        chunk = _chunk(precision)
        meta = dict(MASK=mask_kind, CAUSAL=is_causal, PRECISION=precision, HEAD_DIM=E, BLOCK_D=_block_d(E),
                    CHUNK=chunk)
        key = _tune_key(q, k, mask_kind, is_causal, precision, tma)
        masked = mask_kind != "none"
        launch_delta = Launch(_delta_kernel, (_runtime.cdiv(Lq, _DELTA_BLOCK_M), B * H),
                              dict(HEAD_DIM=E, BLOCK_D=_block_d(E), BLOCK_M=_DELTA_BLOCK_M), traced=traced)
        dkdv_configs = _candidates(_DKDV_CONFIGS, q, Lq, Lk, tma, masked, chunk, "BLOCK_M")
        dq_configs = _candidates(_DQ_CONFIGS, q, Lq, Lk, tma, masked, chunk, "BLOCK_N")
        launch_dkdv = _tuned(_dkdv_kernel, "attention_dkdv", key, dkdv_configs,
                             lambda c: (_runtime.cdiv(Lk, c["BLOCK_N"]), B * HK), meta,
                             (q, k, v, mask_t, grad_out, stats, delta, dk, dv, *fixed, qk_scale, scale, *strides),
                             traced=traced)
        launch_dq = _tuned(_dq_kernel, "attention_dq", key, dq_configs,
                           lambda c: (_runtime.cdiv(Lq, c["BLOCK_M"]), B * H), meta,
                           (q, k, v, mask_t, grad_out, stats, delta, dq, *fixed, qk_scale, scale, *strides),
                           traced=traced)

        def run(grad_out, q, k, v, m, out, stats, delta, dq, dk, dv, qk_scale, scale):
            launch_delta(out, grad_out, delta, *delta_fixed)
            launch_dkdv(q, k, v, m, grad_out, stats, delta, dk, dv, *fixed, qk_scale, scale, *strides)
            launch_dq(q, k, v, m, grad_out, stats, delta, dq, *fixed, qk_scale, scale, *strides)
        return run

    plan_key = ("bwd", _signature(grad_out, q, k, v, mask, out, traced=traced), q.device, is_causal, precision)
    plan(_plans, plan_key, make, traced=traced)(
        grad_out, q, k, v, mask_t, out, stats, delta, dq, dk, dv, qk_scale, scale)
    return dq, dk, dv


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) --------------------------------

@torch_op("dropin::attention", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, mask, is_causal, scale, traced=True)


@torch_op("dropin::attention_bwd", mutates_args=())
def _bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: Optional[torch.Tensor], out: torch.Tensor, stats: torch.Tensor, is_causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(grad_out, q, k, v, mask, out, stats, is_causal, scale, traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_bwd = switch(_bwd_op, _bwd_impl)


# --- 5. Autograd -----------------------------------------------------------------------------------------

class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        out, stats = _fwd(q, k, v, mask, is_causal, scale)
        ctx.save_for_backward(q, k, v, mask, out, stats)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, stats = ctx.saved_tensors
        dq, dk, dv = _bwd(grad_out, q, k, v, mask, out, stats, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None, None


# --- 6. Public function ----------------------------------------------------------------------------------

def _check_shapes(q, k, v, enable_gqa: bool) -> None:
    """q [B, H, Lq, E] (or [B, Lq, E]), k [B, HK, Lk, E], v [B, HK, Lk, E]; errors name the argument."""
    if q.dim() not in (3, 4):
        raise RuntimeError(f"attention: argument 'q' must be 3-D (N, L, E) or 4-D (B, H, L, E), got {q.dim()}-D")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise RuntimeError(f"attention: argument '{name}' must be {q.dim()}-D like 'q', got {t.dim()}-D")
        if t.shape[0] != q.shape[0]:
            raise RuntimeError(f"attention: argument '{name}' has batch size {t.shape[0]}, 'q' has {q.shape[0]}")
    if v.shape[-2] != k.shape[-2]:
        raise RuntimeError(f"attention: argument 'v' has {v.shape[-2]} keys (dim -2), 'k' has {k.shape[-2]}")
    E = q.shape[-1]
    if k.shape[-1] != E:
        raise RuntimeError(f"attention: argument 'k' has head dim {k.shape[-1]}, 'q' has {E}")
    if v.shape[-1] != E:
        raise RuntimeError(f"attention: argument 'v' has head dim {v.shape[-1]}; dropin needs the head dim of "
                           f"'q' ({E})")
    if not 1 <= E <= MAX_HEAD_DIM:
        raise RuntimeError(f"attention: argument 'q' has head dim {E}; dropin supports 1 to {MAX_HEAD_DIM}")
    if q.dim() == 4:
        H, HK, HV = q.shape[1], k.shape[1], v.shape[1]
        if HV != HK:
            raise RuntimeError(f"attention: argument 'v' has {HV} heads, 'k' has {HK}")
        if HK != H and not (enable_gqa and HK > 0 and H % HK == 0):
            why = "a divisor of" if enable_gqa else "equal to (or, with enable_gqa=True, a divisor of)"
            raise RuntimeError(f"attention: argument 'k' has {HK} heads; it must be {why} the {H} heads of 'q'")


def _check_mask(attn_mask, q, shape, is_causal: bool) -> torch.Tensor:
    """The mask broadcast to `shape` (a view), after torch's checks."""
    if is_causal:
        raise RuntimeError("attention: explicit 'attn_mask' should not be set when is_causal=True")
    if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise RuntimeError(f"attention: argument 'attn_mask' has dtype {attn_mask.dtype}; expected bool, "
                           f"float32 or the dtype of 'q' ({q.dtype})")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("attention: argument 'attn_mask' requires grad; dropin has no gradient for the mask")
    try:
        return attn_mask.expand(shape)
    except RuntimeError as e:
        raise RuntimeError(f"attention: argument 'attn_mask' of shape {tuple(attn_mask.shape)} does not "
                           f"broadcast to the attention shape {tuple(shape)}") from e


_shortcuts = Shortcuts()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)` without
    the [Lq, Lk] score matrix (same positional order as torch's).

    q [B, H, Lq, E] or [N, Lq, E]; k and v [B, HK, Lk, E] or [N, Lk, E], any strides. HK == H, or (enable_gqa)
    a divisor of H: query heads h*H/HK .. (h+1)*H/HK - 1 share K/V head h. Head dim E up to 256 (v's the
    same as q's). attn_mask: bool (True = attend) or additive float (float32 or q's dtype), broadcasting to
    [B, H, Lq, Lk] (e.g. HF's [B, 1, Lq, Lk] causal + padding masks); no gradient for it. is_causal: key j
    attends to query i when j <= i (top-left aligned when Lq != Lk); not together with attn_mask. scale:
    default 1 / sqrt(E). dropout_p must be 0. A query row that may attend to no key gives zeros (as torch).
    float32 / float16 / bfloat16 (all the same); float32 uses tf32 only where torch's matmuls would
    (`torch.backends.cuda.matmul.allow_tf32`). Returns [B, H, Lq, E] (or [N, Lq, E]) in q's dtype."""
    key, shortcut = _shortcuts.find((q, k, v, attn_mask), (dropout_p, is_causal, scale, enable_gqa))
    if shortcut is not None:
        return shortcut(q, k, v, attn_mask)
    _runtime.check_kernel_device("attention", q=q, k=k, v=v, attn_mask=attn_mask)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise RuntimeError(f"attention: argument '{name}' has dtype {t.dtype}; dropin supports {_DTYPES}")
    q, k, v = _autocast(q, k, v)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise RuntimeError(f"attention: expected 'q' and '{name}' to have the same dtype, "
                               f"but got {q.dtype} and {t.dtype}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"attention: argument 'dropout_p' is {dropout_p}; dropin supports only 0")
    _check_shapes(q, k, v, enable_gqa)
    unbatched = q.dim() == 3
    if unbatched:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    B, H, Lq, E = q.shape
    if attn_mask is not None:
        shape = (B, Lq, k.shape[2]) if unbatched else (B, H, Lq, k.shape[2])
        attn_mask = _check_mask(attn_mask, q, shape, is_causal)
        attn_mask = attn_mask.unsqueeze(1) if unbatched else attn_mask
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = _AttentionFunction.apply(q, k, v, attn_mask, bool(is_causal), scale)
    elif Lq == 1 and not is_causal:
        out = decode(q, k, v, attn_mask, scale)  # a decoding step: keys split over programs
        if not unbatched:
            _shortcuts.keep(key, lambda: decode_shortcut(q, k, v, attn_mask, scale))
    else:
        out, stats = _fwd(q, k, v, attn_mask, bool(is_causal), scale)
        if attn_mask is None and not unbatched:
            _shortcuts.keep(key, lambda: _fwd_shortcut(q, k, v, out, stats, bool(is_causal), scale))
    return out.squeeze(1) if unbatched else out
