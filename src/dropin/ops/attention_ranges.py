"""Which keys an attention mask lets each block of queries see: a summary of the mask per block of query rows, from
which the flash forward skips the key tiles that the mask blocks wholly and reads no mask where it blocks nothing.

For every RANGE_ROWS query rows and each mask head (broadcast dims once), four key positions, multiples of
RANGE_COLS (or Lk): [lo, hi), the span of key blocks where some row attends to some key (none: lo = Lk, hi = 0),
and [full_lo, full_hi), the first run of key blocks inside Lk where every row attends to every key (none: 0, 0).
A bool mask attends where True; an additive float mask blocks only -inf (a finite value, HF's finfo.min too, still
weighs in a row that attends to nothing else) and attends fully where 0. A causal, sliding-window or key-padding
mask then costs what `is_causal` costs; any other mask stays exact (its tiles inside [lo, hi) read it entry by
entry). The backward's walk over query tiles per key tile reads the summary of the transposed mask.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _runtime
from ._dispatch import Launch, absent

RANGE_ROWS = 16  # query rows per summary entry (divides every forward query tile)
RANGE_COLS = 16  # key granularity of the summary (divides every forward key tile)
_CHUNK = 256  # keys read per step
_NONE = 1 << 30  # "no such block" while reducing


@triton.jit
def _ranges_kernel(mask_ptr, ranges_ptr, Lq, Lk, HM, stride_mb, stride_mh, stride_mq, stride_mk,
                   MASK: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, CHUNK: tl.constexpr,
                   NONE: tl.constexpr):
    """Grid (row blocks, mask batches * mask heads); ranges [.., row blocks, 4] int32 contiguous: lo, hi, full_lo,
    full_hi. Rows past Lq block nothing and attend to nothing; keys past Lk make their block not full."""
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    base = mask_ptr + (bh // HM).to(tl.int64) * stride_mb + (bh % HM).to(tl.int64) * stride_mh
    rows = rb * ROWS + tl.arange(0, ROWS)
    row_ok = rows < Lq
    BLOCKS: tl.constexpr = CHUNK // COLS
    lo = tl.zeros((), tl.int32) + NONE
    hi = tl.zeros((), tl.int32)
    full_lo = tl.zeros((), tl.int32) + NONE
    full_hi = tl.zeros((), tl.int32) + NONE
    for c0 in range(0, Lk, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        col_ok = cols < Lk
        m = tl.load(base + rows[:, None].to(tl.int64) * stride_mq + cols[None, :] * stride_mk,
                    mask=row_ok[:, None] & col_ok[None, :], other=0)
        if MASK == "float":
            attends = m != float("-inf")
            free = m == 0
        else:
            attends = m != 0
            free = attends
        attends = attends & row_ok[:, None] & col_ok[None, :]
        free = (free | (rows >= Lq)[:, None]) & col_ok[None, :]
        some = tl.max(tl.max(tl.reshape(attends.to(tl.int32), (ROWS, BLOCKS, COLS)), 2), 0)
        every = tl.min(tl.min(tl.reshape(free.to(tl.int32), (ROWS, BLOCKS, COLS)), 2), 0)
        block = c0 // COLS + tl.arange(0, BLOCKS)
        lo = tl.minimum(lo, tl.min(tl.where(some > 0, block, NONE)))
        hi = tl.maximum(hi, tl.max(tl.where(some > 0, block + 1, 0)))
        # full_lo is final once a chunk sets it (later chunks hold later blocks): the run ends at the first
        # block after it that is not full
        full_lo = tl.minimum(full_lo, tl.min(tl.where(every > 0, block, NONE)))
        full_hi = tl.minimum(full_hi, tl.min(tl.where((every == 0) & (block > full_lo), block, NONE)))
    full_hi = tl.minimum(full_hi, Lk // COLS)
    empty = lo == NONE
    no_full = full_lo == NONE
    out = ranges_ptr + (bh.to(tl.int64) * tl.cdiv(Lq, ROWS) + rb) * 4
    tl.store(out, tl.where(empty, Lk, lo * COLS))
    tl.store(out + 1, tl.where(empty, 0, tl.minimum(hi * COLS, Lk)))
    tl.store(out + 2, tl.where(no_full, 0, full_lo * COLS))
    tl.store(out + 3, tl.where(no_full, 0, full_hi * COLS))


@triton.jit
def query_tile_ranges(ranges_base, start_m, Lq, Lk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      ROWS: tl.constexpr):
    """(lo, full_lo, full_hi, hi), multiples of BLOCK_N (hi: or Lk), for the query tile at start_m: key tiles
    [lo, full_lo) and [full_hi, hi) read the mask, [full_lo, full_hi) attend wholly (inside Lk), the rest are
    blocked for every row of the tile. ranges_base: the summary of this tile's mask head."""
    blocks = start_m // ROWS + tl.arange(0, BLOCK_M // ROWS)
    ok = blocks < tl.cdiv(Lq, ROWS)
    entry = ranges_base + blocks.to(tl.int64) * 4
    lo = tl.min(tl.load(entry, mask=ok, other=Lk)) // BLOCK_N * BLOCK_N
    hi = tl.minimum(tl.cdiv(tl.max(tl.load(entry + 1, mask=ok, other=0)), BLOCK_N) * BLOCK_N, Lk)
    full_lo = tl.cdiv(tl.max(tl.load(entry + 2, mask=ok, other=0)), BLOCK_N) * BLOCK_N
    full_hi = tl.min(tl.load(entry + 3, mask=ok, other=Lk)) // BLOCK_N * BLOCK_N
    some_full = full_lo < full_hi
    return lo, tl.where(some_full, full_lo, hi), tl.where(some_full, full_hi, hi), hi


def mask_heads(mask: torch.Tensor) -> tuple:
    """(batches, heads) of the summary of a [B, H, Lq, Lk] mask view: 1 where the mask broadcasts (stride 0)."""
    return (1 if mask.stride(0) == 0 else mask.shape[0]), (1 if mask.stride(1) == 0 else mask.shape[1])


class Summary:
    """The summary of the masks of one signature: summary(mask_t) returns a new int32 tensor of `shape` holding it,
    for the mask at mask_t's address ([B, H, Lq, Lk] as `mask` gave shape and strides, any strides; read as `kind`
    "bool" or "float"; mask_t may be the tensor of which `mask` is a view at the same address, e.g. the
    untransposed mask of a transposed view). strides: the summary's batch and head strides for a reader indexing it
    with the attention's b and h (0 over broadcast dims). Without a mask (None), summary(stand_in) returns an
    `absent` stand-in for the kernel's unused pointer, strides (0, 0)."""

    def __init__(self, mask: Optional[torch.Tensor], kind: str = "none", traced: bool = False):
        self.traced = traced
        if mask is None:
            self.launch, self.strides = None, (0, 0)
            return
        B, H, Lq, Lk = mask.shape
        batches, heads = mask_heads(mask)
        blocks = _runtime.cdiv(Lq, RANGE_ROWS)
        self.shape = (batches, heads, blocks, 4)
        self.strides = (0 if batches == 1 else heads * blocks * 4, 0 if heads == 1 else blocks * 4)
        self.launch = Launch(_ranges_kernel, (blocks, batches * heads),
                             dict(MASK=kind, ROWS=RANGE_ROWS, COLS=RANGE_COLS, CHUNK=_CHUNK, NONE=_NONE), traced=traced)
        self.fixed = (Lq, Lk, heads, *mask.stride())

    def __call__(self, mask_t: torch.Tensor) -> torch.Tensor:
        if self.launch is None:
            return absent(mask_t, self.traced)
        ranges = torch.empty(self.shape, device=mask_t.device, dtype=torch.int32)
        self.launch(mask_t, ranges, *self.fixed)
        return ranges
