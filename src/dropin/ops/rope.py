"""Rotary position embeddings as HF Llama applies them (`apply_rotary_pos_emb`, rotate_half convention).

out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]), for q and k of
shape [batch, heads, seq, head_dim] (k may have fewer heads: GQA), computed in fp32 and rounded once.
cos / sin: [seq, D] or [batch or 1, seq, D] as HF's rotary embedding returns them, or a [positions, D]
table that `position_ids` [batch or 1, seq] (or [seq]) indexes. The backward is the transposed rotation:
dx1 = g1 * cos1 + g2 * sin2, dx2 = g2 * cos2 - g1 * sin1 (the forward with sin halves swapped and negated,
which for HF's duplicated halves is the rotation by -sin). One launch: each program rotates a tile of
rows (b, s, h) of q or of k, reading the cos / sin rows of its positions once for all their heads.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _runtime
from ._common import is_dense
from ._dispatch import Checks, Differentiable, Launch, Shortcuts, absent, plan, switch, torch_op

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- 1. Reference -----------------------------------------------------------------------------------

def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(q, k, cos, sin, position_ids=None):
    """HF Llama's apply_rotary_pos_emb (with the older `cos[position_ids]` indexing when ids are given)."""
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# --- 2. Kernels -------------------------------------------------------------------------------------

@triton.jit
def _rotate_rows(x_ptr, o_ptr, cos_ptr, sin_ptr, pos_ptr, tile, B, H, S, HALF,
                 sxb, sxh, sxs, sxd, sob, soh, sos, sod, scb, scs, scd, ssb, sss, ssd, spb, sps,
                 HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates BLOCK_T rows of x [B, H, S, 2 * HALF] into o (which may be x: in place). Rows are numbered
    (b, s, h), heads fastest: a tile's rows share few positions, so its cos / sin loads hit the same
    addresses, and in HF's layout (projections [B, S, H, D] transposed) the tile is one contiguous block."""
    rows = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < B * H * S
    b = rows // (H * S)
    s = (rows // H) % S
    h = rows % H
    if HAS_POS:
        table_row = tl.load(pos_ptr + b * spb + s * sps, mask=row_mask, other=0).to(tl.int64)
    else:
        table_row = s
    d = tl.arange(0, BLOCK_HALF)
    mask = row_mask[:, None] & (d < HALF)[None, :]
    c_lo = cos_ptr + (b * scb + table_row * scs)[:, None] + d[None, :] * scd
    s_lo = sin_ptr + (b * ssb + table_row * sss)[:, None] + d[None, :] * ssd
    c1 = tl.load(c_lo, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_lo + HALF * scd, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_lo, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_lo + HALF * ssd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transposed rotation
        s1, s2 = -s2, -s1
    x_lo = x_ptr + (b * sxb + h * sxh + s * sxs)[:, None] + d[None, :] * sxd
    o_lo = o_ptr + (b * sob + h * soh + s * sos)[:, None] + d[None, :] * sod
    x1 = tl.load(x_lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_lo + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_lo, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_lo + HALF * sod, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
                 B, S, HQ, HK, HALF, Q_TILES,
                 sqb, sqh, sqs, sqd, skb, skh, sks, skd, sqob, sqoh, sqos, sqod, skob, skoh, skos, skod,
                 scb, scs, scd, ssb, sss, ssd, spb, sps,
                 HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    """Programs [0, Q_TILES) rotate tiles of q's rows, the others tiles of k's. cos / sin are read at
    [b, s, :], or [b, position_ids[b, s], :] when HAS_POS (batch strides 0 where they broadcast). IN_PLACE:
    qo and ko are read and written, q_ptr and k_ptr unused."""
    pid = tl.program_id(0)
    if pid < Q_TILES:
        _rotate_rows(qo_ptr if IN_PLACE else q_ptr, qo_ptr, cos_ptr, sin_ptr, pos_ptr, pid, B, HQ, S, HALF,
                     sqb, sqh, sqs, sqd, sqob, sqoh, sqos, sqod, scb, scs, scd, ssb, sss, ssd, spb, sps,
                     HAS_POS, BACKWARD, BLOCK_T, BLOCK_HALF)
    else:
        _rotate_rows(ko_ptr if IN_PLACE else k_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, pid - Q_TILES, B, HK, S, HALF,
                     skb, skh, sks, skd, skob, skoh, skos, skod, scb, scs, scd, ssb, sss, ssd, spb, sps,
                     HAS_POS, BACKWARD, BLOCK_T, BLOCK_HALF)


# --- 3. Launcher --------------------------------------------------------------------------------------

def _table_strides(t: torch.Tensor, batch: int):
    """(batch stride, row stride, column stride) of a [rows, D] or [batch or 1, rows, D] tensor; batch
    stride 0 where it broadcasts."""
    if t.dim() == 2:
        return (0, *t.stride())
    return (t.stride(0) if t.shape[0] == batch and batch > 1 else 0, t.stride(1), t.stride(2))


_plans: dict = {}


def _rope_plan(q, k, cos, sin, position_ids: Optional[torch.Tensor], q_out, k_out, backward: bool,
               traced: bool = False):
    """run(q, k, cos, sin, position_ids, q_out, k_out): the rotation's launch for this signature, made once (every
    tensor's shape, strides and 16-byte alignment, q's and position_ids' dtypes, the device, whether it is in
    place)."""
    key = None if traced else (
        backward, q_out is q and k_out is k, q.shape, q.stride(), k.shape, k.stride(), q_out.stride(), k_out.stride(),
        cos.shape, cos.stride(), sin.shape, sin.stride(), q.dtype, q.device,
        *(t.data_ptr() & 15 for t in (q, k, q_out, k_out, cos, sin)),
        None if position_ids is None else (position_ids.shape, position_ids.stride(), position_ids.dtype,
                                           position_ids.data_ptr() & 15))
    return plan(_plans, key, lambda: _make_plan(q, k, cos, sin, position_ids, q_out, k_out, backward, traced), traced)


def _make_plan(q, k, cos, sin, position_ids, q_out, k_out, backward, traced):
    B, HQ, S, D = q.shape
    HK = k.shape[1]
    half = D // 2
    in_place = q_out is q and k_out is k
    # position_ids [S] or [B or 1, S] read as a table of one column: (batch stride, seq stride)
    pos_strides = (0, 0) if position_ids is None else _table_strides(position_ids[..., None], B)[:2]
    block_half = _runtime.next_power_of_2(half)
    block_t = max(1, 2048 // block_half)  # rows per program: tiles of 2 x 2048 elements
    q_tiles = _runtime.cdiv(B * HQ * S, block_t)
    launch = Launch(_rope_kernel, (q_tiles + _runtime.cdiv(B * HK * S, block_t),),
                    dict(HAS_POS=position_ids is not None, BACKWARD=backward, IN_PLACE=in_place, BLOCK_T=block_t,
                         BLOCK_HALF=block_half, num_warps=4), traced=traced)
    scalars = (B, S, HQ, HK, half, q_tiles, *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(),
               *_table_strides(cos, B), *_table_strides(sin, B), *pos_strides)

    def run(q, k, cos, sin, position_ids, q_out, k_out):
        launch(*((absent(q, traced), absent(k, traced)) if in_place else (q, k)), q_out, k_out, cos, sin,
               absent(q, traced) if position_ids is None else position_ids, *scalars)
    return run


def _no_work(q, k) -> bool:
    """Whether the rotation of q and k writes nothing."""
    B, HQ, S, D = q.shape
    return B * S * (D // 2) == 0 or HQ + k.shape[1] == 0


def _rope_impl(q, k, cos, sin, position_ids: Optional[torch.Tensor], q_out, k_out, backward: bool,
               traced: bool = False):
    """Writes the rotation (its transpose when `backward`) of q and k into q_out and k_out (q and k
    themselves for in place); every tensor may have any strides. traced: under torch.compile (`_dispatch`)."""
    if _no_work(q, k):
        return
    _rope_plan(q, k, cos, sin, position_ids, q_out, k_out, backward, traced)(q, k, cos, sin, position_ids, q_out,
                                                                             k_out)


def _outputs(q, k, cos, sin, position_ids: Optional[torch.Tensor]):
    """q's and k's outputs laid out as torch lays out rope_ref's: their own layouts where both are dense (the
    first operand decides TensorIterator's order); where one is not (an expanded dim), the order rope_ref
    gives on meta tensors, where the tables decide that dim."""
    if is_dense(q) and is_dense(k):
        return torch.empty_like(q), torch.empty_like(k)
    metas = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
             for t in (q, k, cos, sin, position_ids)]
    return tuple(torch.empty_strided(t.shape, like.stride(), dtype=t.dtype, device=t.device)
                 for t, like in zip((q, k), rope_ref(*metas)))


def _rope_out_impl(q, k, cos, sin, position_ids: Optional[torch.Tensor], backward: bool, traced: bool = False):
    q_out, k_out = _outputs(q, k, cos, sin, position_ids)
    _rope_impl(q, k, cos, sin, position_ids, q_out, k_out, backward, traced=traced)
    return q_out, k_out


def _rope_inplace_impl(q, k, cos, sin, position_ids: Optional[torch.Tensor], traced: bool = False) -> None:
    _rope_impl(q, k, cos, sin, position_ids, q, k, False, traced=traced)
    if not traced:  # (the registered op's dispatch bumps the versions itself: mutates_args)
        _written(q, k)


def _written(q, k) -> None:
    """Bumps q's and k's versions after an eager write through pointers, as autograd's saved-tensor checks need."""
    torch.autograd.graph.increment_version((q, k))


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ------------------------------

@torch_op("dropin::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             position_ids: Optional[torch.Tensor], backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_out_impl(q, k, cos, sin, position_ids, backward, traced=True)


@torch_op("dropin::rope_", mutates_args=("q", "k"))
def _rope_inplace_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     position_ids: Optional[torch.Tensor]) -> None:
    _rope_inplace_impl(q, k, cos, sin, position_ids, traced=True)


_rope_out = switch(_rope_op, _rope_out_impl)
_rope_inplace = switch(_rope_inplace_op, _rope_inplace_impl)


# --- 5. Autograd --------------------------------------------------------------------------------------

class _RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, inplace):
        ctx.save_for_backward(cos, sin, position_ids)
        if inplace:
            _rope_inplace(q, k, cos, sin, position_ids)
            ctx.mark_dirty(q, k)
            return q, k
        return _rope_out(q, k, cos, sin, position_ids, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        dq, dk = _rope_out(dq, dk, cos, sin, position_ids, True)
        return dq, dk, None, None, None, None


# --- 6. Public function -------------------------------------------------------------------------------

def _check(q, k, cos, sin, position_ids):
    """The checks of shapes, dtypes and devices (once per signature: `Checks`)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rope: argument '{name}' must be a Tensor, got {type(t).__name__}")
    _runtime.check_kernel_device("rope", q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype not in _DTYPES:
            raise RuntimeError(f"rope: argument '{name}' has dtype {t.dtype}; dropin supports {_DTYPES}")
        if t is not q and t.dtype != q.dtype:
            raise RuntimeError(f"rope: expected 'q' and '{name}' to have the same dtype, "
                               f"but got {q.dtype} and {t.dtype}")
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise RuntimeError(f"rope: argument '{name}' must be 4-D [batch, heads, seq, head_dim], "
                               f"got shape {tuple(t.shape)}")
    B, _, S, D = q.shape
    if k.shape[0] != B or k.shape[2:] != q.shape[2:]:
        raise RuntimeError(f"rope: argument 'k' {tuple(k.shape)} must match 'q' {tuple(q.shape)} in batch, "
                           f"seq and head_dim")
    if D % 2:
        raise RuntimeError(f"rope: head_dim of 'q' must be even, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if position_ids is not None:
            if t.dim() != 2 or t.shape[1] != D:
                raise RuntimeError(f"rope: with position_ids, argument '{name}' must be a 2-D [positions, "
                                   f"{D}] table, got shape {tuple(t.shape)}")
        elif not (t.dim() == 2 and t.shape == (S, D)
                  or t.dim() == 3 and t.shape[0] in (1, B) and t.shape[1:] == (S, D)):
            raise RuntimeError(f"rope: argument '{name}' must have shape ({S}, {D}) or (1 or {B}, {S}, {D}) "
                               f"for 'q' {tuple(q.shape)}, got {tuple(t.shape)}")
    if cos.shape != sin.shape:
        raise RuntimeError(f"rope: argument 'sin' {tuple(sin.shape)} must have the shape of 'cos' "
                           f"{tuple(cos.shape)}")
    if position_ids is not None:
        if position_ids.dtype not in (torch.int32, torch.int64):
            raise RuntimeError(f"rope: argument 'position_ids' must be int32 or int64, got {position_ids.dtype}")
        if not (position_ids.dim() == 1 and position_ids.shape[0] == S
                or position_ids.dim() == 2 and position_ids.shape[0] in (1, B) and position_ids.shape[1] == S):
            raise RuntimeError(f"rope: argument 'position_ids' must have shape ({S},) or (1 or {B}, {S}), "
                               f"got {tuple(position_ids.shape)}")


def _check_positions(position_ids, cos):
    """position_ids' values index cos's rows, checked on every call. A bounds check costs a device sync; it is
    skipped while torch.compile traces or a CUDA graph is captured (where a sync is not allowed)."""
    if position_ids.numel() and not torch.compiler.is_compiling() and not _runtime.capturing():
        lo, hi = position_ids.min().item(), position_ids.max().item()
        if lo < 0 or hi >= cos.shape[0]:
            raise RuntimeError(f"rope: 'position_ids' range [{lo}, {hi}] is outside the {cos.shape[0]} "
                               f"rows of 'cos'")


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         position_ids: Optional[torch.Tensor] = None, inplace: bool = False):
    """HF Llama's `apply_rotary_pos_emb(q, k, cos, sin)`: returns (q_embed, k_embed).

    q [batch, heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim] (any strides, e.g. HF's
    transposed projections); cos, sin [seq, head_dim] or [batch or 1, seq, head_dim], or with
    position_ids ([batch or 1, seq] or [seq], int) a [positions, head_dim] table indexed by them. All four
    float tensors share one dtype (float32 / float16 / bfloat16); head_dim is even. inplace=True writes
    into q and k and returns them. Differentiable in q and k (cos and sin must not require grad)."""
    key, shortcut = _shortcuts.find((q, k, cos, sin, position_ids), (inplace,))
    if shortcut is not None:
        return shortcut(q, k, cos, sin, position_ids)
    _checked.once((q, k, cos, sin, position_ids), (), lambda: _check(q, k, cos, sin, position_ids))
    grad = torch.is_grad_enabled()
    for name, t in (("cos", cos), ("sin", sin)):
        if grad and t.requires_grad:
            raise RuntimeError(f"rope: argument '{name}' requires grad; dropin's rope differentiates q and k "
                               f"only (HF computes cos and sin without grad)")
    if position_ids is not None:
        _check_positions(position_ids, cos)
    if grad and (q.requires_grad or k.requires_grad):
        out = _RopeFunction.apply(q, k, cos, sin, position_ids, bool(inplace))
        if not inplace:
            _shortcuts.keep(key, lambda: _RopeShortcut.make(q, k, cos, sin, position_ids, *out), grad=True)
        return out
    # no autograd node (its cost is a small op's whole launch)
    if inplace:
        _rope_inplace(q, k, cos, sin, position_ids)
        out = q, k
    else:
        out = _rope_out(q, k, cos, sin, position_ids, False)
    _shortcuts.keep(key, lambda: _rope_shortcut(q, k, cos, sin, position_ids, *out))
    return out


def _rope_shortcut(q, k, cos, sin, position_ids, q_out, k_out):
    """rope's later eager calls of this signature (`Shortcuts`): (q, k, cos, sin, position_ids) -> (q_out, k_out),
    new outputs laid out as this call's, or q and k themselves in place (their versions bumped); position_ids'
    bounds checked as on every call. None where there is no work."""
    if _no_work(q, k):
        return None
    run = _rope_plan(q, k, cos, sin, position_ids, q_out, k_out, False)
    if q_out is q and k_out is k:
        def inplace(q, k, cos, sin, position_ids):
            if position_ids is not None:
                _check_positions(position_ids, cos)
            run(q, k, cos, sin, position_ids, q, k)
            _written(q, k)
            return q, k
        return inplace
    layouts = [(t.shape, t.stride(), t.dtype, t.device) for t in (q_out, k_out)]

    def rotated(q, k, cos, sin, position_ids):
        if position_ids is not None:
            _check_positions(position_ids, cos)
        q_out, k_out = (torch.empty_strided(shape, strides, dtype=dtype, device=device)
                        for shape, strides, dtype, device in layouts)
        run(q, k, cos, sin, position_ids, q_out, k_out)
        return q_out, k_out
    return rotated


class _RopeShortcut(Differentiable):
    """rope's later eager calls of this signature out of place where autograd records them (`Differentiable`): the
    forward as `_rope_shortcut`'s (cos, sin and position_ids saved), the backward's plan (the transposed rotation)
    for each layout of (dq, dk) into new gradients laid out as the op's own path lays them out."""

    def __init__(self, forward_run):
        super().__init__()
        self.forward_run = forward_run

    @staticmethod
    def make(q, k, cos, sin, position_ids, q_out, k_out):
        """The shortcut; None where there is no work."""
        forward_run = _rope_shortcut(q, k, cos, sin, position_ids, q_out, k_out)
        return None if forward_run is None else _RopeShortcut(forward_run)

    def forward(self, ctx, q, k, cos, sin, position_ids):
        ctx.save_for_backward(cos, sin, position_ids)
        return self.forward_run(q, k, cos, sin, position_ids)

    def backward(self, ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        run = self.backward_plan((dq, dk), lambda: _RopeShortcut._backward_run(dq, dk, cos, sin, position_ids))
        return (*run(dq, dk, cos, sin, position_ids), None, None, None)

    @staticmethod
    def _backward_run(dq, dk, cos, sin, position_ids):
        """run(dq, dk, cos, sin, position_ids) -> the gradients of q and k, for dq and dk of these layouts."""
        dq_out, dk_out = _outputs(dq, dk, cos, sin, position_ids)  # (as `_rope_out_impl` lays them out)
        rotate = _rope_plan(dq, dk, cos, sin, position_ids, dq_out, dk_out, True)
        layouts = [(t.shape, t.stride(), t.dtype, t.device) for t in (dq_out, dk_out)]

        def run(dq, dk, cos, sin, position_ids):
            dq_out, dk_out = (torch.empty_strided(shape, strides, dtype=dtype, device=device)
                              for shape, strides, dtype, device in layouts)
            rotate(dq, dk, cos, sin, position_ids, dq_out, dk_out)
            return dq_out, dk_out
        return run
