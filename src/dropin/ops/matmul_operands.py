"""The operand copies of matmul's products (dropin.ops.matmul): when a copy pays, and the copy itself (tf32-rounded,
16-byte aligned for TMA descriptors, or split into two tf32 parts for true fp32), of one operand or of both in one
launch."""
import torch
import triton
import triton.language as tl

from .. import _runtime
from . import _gemm
from ._gemm import copy_tile
from ._dispatch import launch


def tf32_copies_pay(M, N) -> bool:
    """Whether a tf32 product of M x N outputs copies its operands rounded (`operand_copy`) rather than rounding
    every tile in the kernel. The copies move 8 (MK + KN) bytes (~3.5 TB/s), and save about 1.5 of the product's
    2MNK FLOPs at tf32's ~370 TFLOP/s (tiles rounded in registers run at 0.38x cuBLAS, copied ones at 0.82x): they
    pay where 1/M + 1/N < 1/300. Below that (few rows, small batched products) the product is bound by memory or
    launches, where the rounding in registers is free and a copy doubles the traffic."""
    return _outputs_pay(M, N, 300)


def _outputs_pay(M, N, ratio: int) -> bool:
    """Whether an M x N product is large enough for copies of its operands to pay: 1/M + 1/N < 1/ratio."""
    M, N = _runtime.size_hint(M), _runtime.size_hint(N)
    return M > 0 and N > 0 and ratio * (M + N) < M * N


# The most memory that the aligned copies of a product's operands may take (`aligned_copies_pay`).
COPY_WORKSPACE = 128 << 20


def aligned_copies_pay(batch, M, N, K, size: int, precision: str) -> bool:
    """Whether a product whose operands a TMA descriptor cannot read (a row of K elements not 16-byte aligned: odd
    sizes) copies them aligned for the TMA kernel rather than running the pointer kernel, which took 0.64-0.68x
    cuBLAS on 16-bit products of such sizes and 0.50x on fp32's tf32x3 (H200, results/h200/matmul.json; aligned,
    the TMA kernel took 0.91-1.09x). 16-bit: the copies move 4 (MK + KN) bytes (~3.5 TB/s) to save about a third
    of the product's 2MNK FLOPs at ~700 TFLOP/s: they pay where 1/M + 1/N < 1/1100. tf32x3 runs at ~46 TFLOP/s
    and moves 8 bytes an element: 1/M + 1/N < 1/150. Taken where they fit COPY_WORKSPACE."""
    batch, M, N, K = (_runtime.size_hint(v) for v in (batch, M, N, K))
    ratio = {2: 1100, 4: 150 if precision == "tf32x3" else 0}.get(size, 0)
    return ratio > 0 and _outputs_pay(M, N, ratio) and batch * (M + N) * (K + 16 // size) * size <= COPY_WORKSPACE


@triton.jit
def operand_pair_copy_kernel(a_ptr, ya_ptr, Ra, Ca, sab, sar, sac, syab, syar, syac, plane_a,
                             b_ptr, yb_ptr, Rb, Cb, sbb, sbr, sbc, sybb, sybr, sybc, plane_b, tiles_a,
                             ROUND_TF32: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_C: tl.constexpr, NEGATE_A: tl.constexpr, NEGATE_B: tl.constexpr):
    """`operand_copy_kernel` of two operands in one launch (a product's A and B: one launch's gap and tail less):
    grid (tiles_a + B's tiles, batch), A's tiles first."""
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    if tile < tiles_a:
        copy_tile(a_ptr, ya_ptr, Ra, Ca, sab, sar, sac, syab, syar, syac, plane_a, tile, batch,
                  ROUND_TF32, SPLIT, BLOCK_R, BLOCK_C, NEGATE_A)
    else:
        copy_tile(b_ptr, yb_ptr, Rb, Cb, sbb, sbr, sbc, sybb, sybr, sybc, plane_b, tile - tiles_a, batch,
                  ROUND_TF32, SPLIT, BLOCK_R, BLOCK_C, NEGATE_B)


def operand_copies(a: torch.Tensor, b: torch.Tensor, copy_a, copy_b, traced: bool = False) -> tuple:
    """(a, b) as the product's kernels read them: each copied where its copy_* (operand_copy's round_tf32, split,
    negate) is given, both in one launch where they are copied alike but for the negation."""
    if copy_a is not None and copy_b is not None and copy_a[:2] == copy_b[:2]:
        return operand_pair_copy(a, b, *copy_a[:2], copy_a[2], copy_b[2], traced)
    if copy_b is not None:
        b = operand_copy(b, 1, copy_b[0], traced, *copy_b[1:])
    if copy_a is not None:
        a = operand_copy(a, 2, copy_a[0], traced, *copy_a[1:])
    return a, b


def operand_copy(t: torch.Tensor, k_dim: int, round_tf32: bool, traced: bool = False,
                 split: bool = False, negate: bool = False) -> torch.Tensor:
    """A copy of t [batch, R, C] (rounded to tf32 with round_tf32) with dimension k_dim (1 or 2) contiguous and the
    other's stride padded to 16 bytes, as a TMA descriptor reads it (the padding is never read). split (fp32):
    t's two tf32 parts (-t's with negate), the hi part returned and the lo part `batch` batch strides further, in
    the same storage (the TMA kernel's "tf32x3_split" operands)."""
    y, plane = _copy_buffer(t, k_dim, split)
    grid, meta = _gemm.operand_copy_launch(*t.shape[1:], t.shape[0], round_tf32, split, negate)
    launch(_gemm.operand_copy_kernel, grid, t, y, *t.shape[1:], *t.stride(), *y.stride(), plane, traced=traced, **meta)
    return y


def operand_pair_copy(a: torch.Tensor, b: torch.Tensor, round_tf32: bool, split: bool, negate_a: bool,
                      negate_b: bool, traced: bool = False) -> tuple:
    """(A's copy, B's copy): `operand_copy` of a product's A [batch, M, K] and B [batch, K, N] (each copy K-major)
    alike in one launch: one kernel's launch gap and tail less than two."""
    (ya, plane_a), (yb, plane_b) = _copy_buffer(a, 2, split), _copy_buffer(b, 1, split)
    (tiles_a, batch), meta = _gemm.operand_copy_launch(*a.shape[1:], a.shape[0], round_tf32, split)
    (tiles_b, _), _ = _gemm.operand_copy_launch(*b.shape[1:], b.shape[0], round_tf32, split)
    del meta["NEGATE"]
    launch(operand_pair_copy_kernel, (tiles_a + tiles_b, batch), a, ya, *a.shape[1:], *a.stride(), *ya.stride(),
           plane_a, b, yb, *b.shape[1:], *b.stride(), *yb.stride(), plane_b, tiles_a, traced=traced, **meta,
           NEGATE_A=negate_a, NEGATE_B=negate_b)
    return ya, yb


def _copy_buffer(t: torch.Tensor, k_dim: int, split: bool) -> tuple:
    """(y, plane): `operand_copy`'s empty copy of t and the offset of its lo part (elements)."""
    batch, R, C = t.shape
    unit = 16 // t.element_size()
    if k_dim == 2:
        outer = _runtime.cdiv(C, unit) * unit
        strides = (R * outer, outer, 1)
    else:
        outer = _runtime.cdiv(R, unit) * unit
        strides = (C * outer, 1, outer)
    y = torch.empty_strided((2 * batch if split else batch, R, C), strides, device=t.device, dtype=t.dtype)
    return (y[:batch] if split else y), batch * strides[0]  # (the lo part past the view's end: eager only)


def split_copies_pay(M, N) -> bool:
    """Whether a true fp32 (tf32x3) product on the TMA kernel reads its operands from copies split into tf32 parts
    (`operand_copy`, split) rather than splitting every tile in registers. The copies move 12 (MK + KN) bytes
    (~3.5 TB/s; the kernel then reads twice the operands) to run the product at the tf32 MMAs' pace (3 products a
    tile) instead of ~46 TFLOP/s: they pay where 1/M + 1/N < 1/128 (which of them fit: `copied_operands`)."""
    return _outputs_pay(M, N, 128)


# The most memory that the rounded or split copies of an fp32 product's operands may take: a dropin op may take at
# most 256 MiB over torch's peak for the same call (torch's product allocates its output alone), its scratch aside.
COPY_BUDGET = 240 << 20


def copied_operands(batch, M, K, N, parts: int, a_aligned: bool = False) -> str:
    """Which operands of an fp32 product get copies of `parts` planes each (1: rounded to tf32, 2: split into tf32
    parts) within COPY_BUDGET: "ab" both, "b" B's alone (the kernel rounds or splits A's tiles in registers, where
    the MMAs read them; with a_aligned beside A's plain copy, aligned for TMA), "" neither (4096^3 split: 256 MiB,
    B's alone 128)."""
    batch, M, K, N = (_runtime.size_hint(v) for v in (batch, M, K, N))
    row = batch * (K + 4) * 4  # bytes a copy of a row of A or a column of B takes (its K padding at most 4)
    if parts * row * (M + N) <= COPY_BUDGET:
        return "ab"
    return "b" if row * (parts * N + (M if a_aligned else 0)) <= COPY_BUDGET else ""
