"""The Triton kernels of flash attention (`attention`): the forward, and the backward's three (rowsum(dO * O), dK / dV,
dQ), with the tile helpers they share.

- `fwd_kernel`: one program per (query tile, batch * head); online softmax in base 2 with the softmax scale times
  log2(e) folded into the scores. Per query row it keeps the row maximum and 1 / the row sum (`stats`), from which
  the backward recomputes the probabilities.
- backward: `delta_kernel` (rowsum(dO * O)), `dkdv_kernel` (one program per key tile and K/V head, walking the query
  tiles of every query head of its group: no atomics) and `dq_kernel` (one program per query tile, walking the key
  tiles).
Tiles that lie inside both sequences and (causal) below the diagonal skip all per-entry masking; only the tiles on
the diagonal and at the ends of the sequences pay for it (EDGE). With a mask, its summary (`attention_ranges`) tells
each walk which tiles it blocks wholly (skipped), which it attends wholly (no mask read) and which to read it on
(EDGE). With a float mask or in fp32 the scores stay in natural units (`natural_exp`, also the decode kernels').
q, k, v and dO are read with TMA tensor descriptors (Hopper, 16-bit, aligned strides: rows past the end read 0) or
with pointers (any strides: rows past the end read the last row); either way such rows are masked out of the scores.
"""
import triton
import triton.language as tl

from ._gemm import dot, dot_acc
from .attention_ranges import query_tile_ranges


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
    dot_acc's); else the tiles a and b as they are."""
    if CHUNK:  # (a loop, not unrolled: each unrolled chunk's operands take shared memory of their own)
        c = tl.zeros((a.shape[0], b.shape[0]), dtype=tl.float32)
        for d0 in tl.range(0, HEAD_DIM, CHUNK):  # (to HEAD_DIM: `_cols` reads a multiple of CHUNK unmasked)
            c = c - dot(-_cols(a_ptr, a_b, a_h, a_rows, sa_b, sa_h, sa_l, sa_d, d0, HEAD_DIM, CHUNK),
                        tl.trans(_cols(b_ptr, b_b, b_h, b_rows, sb_b, sb_h, sb_l, sb_d, d0, HEAD_DIM, CHUNK)),
                        PRECISION)
    else:
        c = dot(a, tl.trans(b), PRECISION)
    return c


@triton.jit
def _part(PART: tl.constexpr, start0, stop0, start1, stop1, start2, stop2):
    """The PART-th of a walk's three tile ranges [start0, stop0), [start1, stop1), [start2, stop2)."""
    start = start0
    stop = stop0
    if PART == 1:
        start = start1
        stop = stop1
    if PART == 2:
        start = start2
        stop = stop2
    return start, stop


@triton.jit
def _scores(qk, qi, kj, Lq, Lk, mask_base, stride_mq, stride_mk, qk_scale,
            MASK: tl.constexpr, CAUSAL: tl.constexpr, EDGE: tl.constexpr):
    """Scores of one tile from qk = q . k; qi / kj: the query / key index of each entry (broadcasting to the
    tile, in either orientation). Log2 units (qk_scale = scale * log2 e), natural units with an additive
    mask or in fp32 (qk_scale = scale). -inf where the mask says no, and (EDGE) past Lq or Lk or above the diagonal."""
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
def natural_exp(x, FP32: tl.constexpr):
    """exp(x). tl.exp multiplies by log2 e and rounds the exponent: a relative error of |x| * 2^-24 on the result,
    as large as torch's whole error on the softmax of large scores. FP32 (fp32 inputs): the exponent's rounding
    error, taken by an FMA, corrects the result to first order (16-bit inputs: the probabilities are rounded to
    16 bits anyway)."""
    if FP32:
        x = tl.where(x < -1000.0, -1000.0, x)  # (exp gives 0 from there on; -inf and finfo.min would make e NaN)
        t = x * 1.4426950216293335  # log2 e in fp32; 1.925963e-08 the rest of it
        e = tl.fma(x, 1.4426950216293335, -t) + x * 1.92596298909109e-08
        y = tl.math.exp2(t)
        y = tl.fma(y, e * 0.6931471805599453, y)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _exp(x, MASK: tl.constexpr, FP32: tl.constexpr):
    """exp of a difference of scores, in their units (natural with a float mask or in fp32)."""
    if MASK == "float" or FP32:
        y = natural_exp(x, FP32)
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
            p = _exp(qk * qk_scale - m_new[:, None], MASK, q_ptr.dtype.element_ty == tl.float32)
        else:
            if FULL:
                s = _scores(qk, offs_m[:, None], offs_n[None, :], Lq, Lk, mask_base, stride_mq, stride_mk,
                            qk_scale, "none", CAUSAL, EDGE)
            else:
                s = _scores(qk, offs_m[:, None], offs_n[None, :], Lq, Lk, mask_base, stride_mq, stride_mk,
                            qk_scale, MASK, CAUSAL, EDGE)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp away from -inf - -inf
            p = _exp(s - m_use[:, None], MASK, q_ptr.dtype.element_ty == tl.float32)
        alpha = _exp(m_i - m_use, MASK, q_ptr.dtype.element_ty == tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(v_src, b, hk, start_n, rows_n, stride_vb, stride_vh, stride_vn, stride_vd,
                  HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
        acc = dot_acc(acc * alpha[:, None], p.to(v.dtype), v, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def fwd_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, ranges_ptr, o_ptr, stats_ptr,
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
def delta_kernel(o_ptr, do_ptr, delta_ptr, H, Lq,
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
                MASK: tl.constexpr, CAUSAL: tl.constexpr, EDGE: tl.constexpr, FULL: tl.constexpr,
                PRECISION: tl.constexpr, TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SELF_NORM: tl.constexpr):
    """dK, dV of one key tile summed over the query tiles [lo, hi) of head h, in the transposed orientation
    (rows are keys), so that P^T and dS^T feed the products as they come out of the score product. FULL: the
    mask attends wholly on these tiles and is not read (as `_fwd_tiles`). SELF_NORM (the tile holds every key):
    each query's probabilities are normalized by their own sum and delta = rowsum(P * dP) taken from them, as
    torch's softmax backward does, instead of the row sum and delta that stats and delta hold."""
    for start_m in tl.range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)  # every lo is one (or its range is empty)
        offs_m, rows_m = _rows(start_m, Lq, BLOCK_M, EDGE)
        q = _tile(q_src, b, h, start_m, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
                  HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
        kq = _dot_t(k, k_ptr, b, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                    q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd, PRECISION, HEAD_DIM,
                    BLOCK_D, CHUNK)
        if FULL:
            st = _scores(kq, offs_m[None, :], offs_n[:, None], Lq, Lk,
                         mask_base, stride_mq, stride_mk, qk_scale, "none", CAUSAL, EDGE)
        else:
            st = _scores(kq, offs_m[None, :], offs_n[:, None], Lq, Lk,
                         mask_base, stride_mq, stride_mk, qk_scale, MASK, CAUSAL, EDGE)
        m = tl.load(stats_base + rows_m)
        et = _exp(st - m[None, :], MASK, q_ptr.dtype.element_ty == tl.float32)
        if SELF_NORM:
            # this pass's own row sums: the forward's, of scores rounded otherwise, would leave each row's largest
            # probability off by the two roundings' difference (a softmax's own sum cancels its rounding there).
            # Key rows past Lk (copies of the last key) are out of the sums.
            et = tl.where(offs_n[:, None] < Lk, et, 0.0)
            l_t = tl.sum(et, 0)
            pt = et * (1.0 / tl.where(l_t > 0.0, l_t, 1.0))[None, :]  # (a query with no key: et and P 0)
        else:
            pt = et * tl.load(stats_base + Lq + rows_m)[None, :]
        do = _tile(do_src, b, h, start_m, rows_m, stride_db, stride_dh, stride_dm, stride_dd,
                   HEAD_DIM, BLOCK_D, BLOCK_M, TMA)
        dv = dot_acc(dv, pt.to(do.dtype), do, PRECISION)
        dpt = _dot_t(v, v_ptr, b, hk, rows_n, stride_vb, stride_vh, stride_vn, stride_vd,
                     do, do_ptr, b, h, rows_m, stride_db, stride_dh, stride_dm, stride_dd, PRECISION, HEAD_DIM,
                     BLOCK_D, CHUNK)
        if SELF_NORM:
            delta = tl.sum(pt * dpt, 0)
        else:
            delta = tl.load(delta_base + rows_m)
        dst = pt * (dpt - delta[None, :])
        dk = dot_acc(dk, dst.to(q.dtype), q, PRECISION)
    return dk, dv


@triton.jit
def dkdv_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, ranges_ptr, do_ptr, stats_ptr, delta_ptr, dk_ptr, dv_ptr,
                 B, H, HK, Lq, Lk, qk_scale, sm_scale,
                 stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_mq, stride_mk,
                 stride_rb, stride_rh, stride_db, stride_dh, stride_dm, stride_dd,
                 stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                 MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CHUNK: tl.constexpr, RANGE_ROWS: tl.constexpr, SELF_NORM: tl.constexpr = False):
    """Grid (key tiles, B * HK); dk and dv [B, HK, Lk, E], any strides. BLOCK_N is a multiple of BLOCK_M.
    Causal: query tiles before the key tile see none of it; those on the diagonal are EDGE tiles. With a mask,
    ranges: the summary of the transposed mask (per key rows, the query tiles to skip, read or take wholly).
    SELF_NORM (Lk <= BLOCK_N: one key tile): the probabilities' row sums and delta from this pass's own scores
    (`_dkdv_tiles`); stats' maxima only shift the exponents, delta is not read."""
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
    if MASK == "none":  # query tiles [lo, band) EDGE (the diagonal), [band, full) unmasked, [tail, Lq) EDGE
        full = Lq // BLOCK_M * BLOCK_M
        if CAUSAL:
            lo = start_n
            band = tl.minimum(start_n + BLOCK_N, Lq)
        else:
            lo = 0
            band = 0
        tail = tl.maximum(band, full)
        end = Lq
    for g in range(group):
        h = hk * group + g
        row = (b * H + h).to(tl.int64) * Lq
        mask_base = mask_ptr + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
        if MASK != "none":  # [lo, band) and [tail, end) read the mask (EDGE), [band, full) attend wholly
            ranges_base = ranges_ptr + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh
            lo, band, full, end = query_tile_ranges(ranges_base, start_n, Lk, Lq, BLOCK_N, BLOCK_M, RANGE_ROWS)
            tail = full
        for part in tl.static_range(3):  # [lo, band) EDGE, [band, full) attended wholly (FULL), [tail, end) EDGE
            start, stop = _part(part, lo, band, band, full, tail, end)
            dk, dv = _dkdv_tiles(dk, dv, k, v, k_ptr, v_ptr, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                                 stride_vb, stride_vh, stride_vn, stride_vd, offs_n, start, stop, q_ptr, q_src,
                                 do_ptr, do_src, b, h, stats_ptr + 2 * row, delta_ptr + row, mask_base, Lq, Lk,
                                 qk_scale, stride_qb, stride_qh, stride_qm, stride_qd, stride_db, stride_dh,
                                 stride_dm, stride_dd, stride_mq, stride_mk, MASK, CAUSAL, part != 1, part == 1,
                                 PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_M, CHUNK, SELF_NORM)
    offs_d = tl.arange(0, BLOCK_D)
    store_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
    n = offs_n[:, None].to(tl.int64)
    dk_offs = (b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + n * stride_dkn
               + offs_d[None, :] * stride_dkd)
    dv_offs = (b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + n * stride_dvn
               + offs_d[None, :] * stride_dvd)
    tl.store(dk_ptr + dk_offs, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=store_mask)
    tl.store(dv_ptr + dv_offs, dv.to(dv_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _dq_tiles(dq, dsum, lsum, q, do, q_ptr, do_ptr, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
              stride_db, stride_dh, stride_dm, stride_dd, m, inv_l, delta, offs_m, lo, hi, k_ptr, k_src, v_ptr,
              v_src, b, hk, mask_base, Lq, Lk, qk_scale,
              stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
              stride_mq, stride_mk,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, EDGE: tl.constexpr, FULL: tl.constexpr,
              PRECISION: tl.constexpr, TMA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, DELTA: tl.constexpr):
    """(dq, dsum, lsum): dQ of one query tile summed over the key tiles [lo, hi), or (DELTA, inv_l 1: p is
    exp(s - m)) the row sums of p * dP and of p there instead; FULL as in `_dkdv_tiles`."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)  # every lo is one (or its range is empty)
        offs_n, rows_n = _rows(start_n, Lk, BLOCK_N, EDGE)
        k = _tile(k_src, b, hk, start_n, rows_n, stride_kb, stride_kh, stride_kn, stride_kd,
                  HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
        qk = _dot_t(q, q_ptr, b, h, rows_m, stride_qb, stride_qh, stride_qm, stride_qd,
                    k, k_ptr, b, hk, rows_n, stride_kb, stride_kh, stride_kn, stride_kd, PRECISION, HEAD_DIM,
                    BLOCK_D, CHUNK)
        if FULL:
            s = _scores(qk, offs_m[:, None], offs_n[None, :], Lq, Lk,
                        mask_base, stride_mq, stride_mk, qk_scale, "none", CAUSAL, EDGE)
        else:
            s = _scores(qk, offs_m[:, None], offs_n[None, :], Lq, Lk,
                        mask_base, stride_mq, stride_mk, qk_scale, MASK, CAUSAL, EDGE)
        p = _exp(s - m[:, None], MASK, q_ptr.dtype.element_ty == tl.float32) * inv_l[:, None]
        v = _tile(v_src, b, hk, start_n, rows_n, stride_vb, stride_vh, stride_vn, stride_vd,
                  HEAD_DIM, BLOCK_D, BLOCK_N, TMA)
        dp = _dot_t(do, do_ptr, b, h, rows_m, stride_db, stride_dh, stride_dm, stride_dd,
                    v, v_ptr, b, hk, rows_n, stride_vb, stride_vh, stride_vn, stride_vd, PRECISION, HEAD_DIM,
                    BLOCK_D, CHUNK)
        if DELTA:
            dsum += tl.sum(p * dp, 1)
            lsum += tl.sum(p, 1)
        else:
            ds = p * (dp - delta[:, None])
            dq = dot_acc(dq, ds.to(k.dtype), k, PRECISION)
    return dq, dsum, lsum


@triton.jit
def dq_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, ranges_ptr, do_ptr, stats_ptr, delta_ptr, dq_ptr,
               B, H, HK, Lq, Lk, qk_scale, sm_scale,
               stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
               stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_mq, stride_mk,
               stride_rb, stride_rh, stride_db, stride_dh, stride_dm, stride_dd,
               stride_dqb, stride_dqh, stride_dqm, stride_dqd,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, TMA: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CHUNK: tl.constexpr, RANGE_ROWS: tl.constexpr, DELTA: tl.constexpr = False):
    """Grid (query tiles, B * H); dq [B, H, Lq, E], any strides. Key tiles as the forward walks them. DELTA: from
    this pass's own scores, each row's sum l of exp(s - m) and delta = rowsum(P * dP) with P = exp(s - m) / l (the
    sum that rowsum(dO * O) stands for, without O's rounding; `attention.SHORT_KEYS`): delta into delta_ptr, and
    into dq_ptr, laid out as stats [B, H, 2, Lq], the maxima of stats and 1 / l, which the dQ pass on the same tiles
    (the same scores bit for bit) then takes as its stats: its P sums to 1 over its own scores, as delta's does."""
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
    if DELTA:
        inv_l = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
        delta = tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:
        inv_l = tl.load(stats_ptr + 2 * row + Lq + rows_m)
        delta = tl.load(delta_ptr + row + rows_m)
    mask_base = mask_ptr + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    lsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if MASK == "none":  # key tiles [0, full_hi) unmasked, [full_hi, hi) EDGE
        lo = 0
        full_lo = 0
        full_hi, hi = _key_ranges(start_m, Lk, CAUSAL, BLOCK_M, BLOCK_N)
    else:  # [lo, full_lo) and [full_hi, hi) read the mask (EDGE), [full_lo, full_hi) attend wholly
        ranges_base = ranges_ptr + b.to(tl.int64) * stride_rb + h.to(tl.int64) * stride_rh
        lo, full_lo, full_hi, hi = query_tile_ranges(ranges_base, start_m, Lq, Lk, BLOCK_M, BLOCK_N, RANGE_ROWS)
    for part in tl.static_range(3):  # [lo, full_lo) EDGE, [full_lo, full_hi) attended wholly (FULL), [full_hi, hi) EDGE
        start, stop = _part(part, lo, full_lo, full_lo, full_hi, full_hi, hi)
        dq, dsum, lsum = _dq_tiles(dq, dsum, lsum, q, do, q_ptr, do_ptr, h, rows_m, stride_qb, stride_qh,
                                   stride_qm, stride_qd, stride_db, stride_dh, stride_dm, stride_dd, m, inv_l, delta,
                                   offs_m, start, stop, k_ptr, k_src, v_ptr, v_src, b, hk, mask_base, Lq, Lk,
                                   qk_scale, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh,
                                   stride_vn, stride_vd, stride_mq, stride_mk, MASK, CAUSAL, part != 1, part == 1,
                                   PRECISION, TMA, HEAD_DIM, BLOCK_D, BLOCK_N, CHUNK, DELTA)
    if DELTA:
        in_rows = offs_m < Lq
        inv = 1.0 / tl.where(lsum > 0.0, lsum, 1.0)  # (a row with no key: p, P and delta 0)
        tl.store(delta_ptr + row + offs_m, dsum * inv, mask=in_rows)
        tl.store(dq_ptr + 2 * row + offs_m, m, mask=in_rows)
        tl.store(dq_ptr + 2 * row + Lq + offs_m, inv, mask=in_rows)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        offs = (b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
                + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :] * stride_dqd)
        tl.store(dq_ptr + offs, (dq * sm_scale).to(dq_ptr.dtype.element_ty),
                 mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))
