"""Matrix products: matmul, bmm and linear with a fused bias + activation epilogue; forward and backward.

Every product is brought to one canonical form, C[b] = act(A[b] @ B[b] + bias), A: [B, M, K] and
B: [B, K, N] with any strides (transposed views cost no copy), accumulated in fp32 by one of two kernels:
- `_mm_tma_kernel` (Hopper): persistent grid, TMA tensor descriptors, wgmma. Needs each operand to have
  one unit stride among its two matrix dims and 16-byte aligned other strides; A and B may each be
  row- or column-major.
- `_mm_kernel`: pointer loads with arbitrary strides (0 for broadcast batches too); every other case.
float32 follows torch's own rule: tf32 when `torch.backends.cuda.matmul.allow_tf32` is set, otherwise true fp32:
tf32x3 on the tensor cores for long reductions (`_precision`), fp32 FMAs for short ones and under the interpreter.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from . import _autotune
from ._dispatch import Checks, Launch, Shortcuts, absent, aligned, launch, plan, switch, torch_op, writing
from .activations import activation_grad, activation_ref, apply_activation, check_activation

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --- 1. References ----------------------------------------------------------------------------------

def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b)


def linear_ref(x, weight, bias=None, activation=None) -> torch.Tensor:
    return activation_ref(F.linear(x, weight, bias), activation)


# --- 2. Kernels -------------------------------------------------------------------------------------

@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles sweep the columns together, so tiles of B are reused from L2."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group_m
    pid_n = (tile % width) // group_m
    return pid_m, pid_n


@triton.jit
def _split_range(split, K, BLOCK_K: tl.constexpr):
    """[first, last) K tiles of reduction split `split` out of tl.num_programs(2) splits."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, tl.num_programs(2))
    k_first = split * per_split
    return k_first, tl.minimum(k_first + per_split, k_tiles)


@triton.jit
def _tf32(x):
    """x (fp32) rounded to tf32's 10-bit mantissa, half away from zero. Hopper's tf32 MMA drops the low 13
    bits of each operand, a truncation whose bias grows with K (4-5x cuBLAS's error, measured on the
    attention and SwiGLU tests); adding half a tf32 ulp first turns it into a rounding. inf, nan and the
    largest finite values (which the add would carry out of range) are left to the truncation."""
    bits = x.to(tl.int32, bitcast=True) + 0x1000
    return tl.where(tl.abs(x) < 3.0e38, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def _tf32_split(x):
    """x (fp32) as hi + lo, two tf32 numbers: hi exact (x rounded, the largest finite values truncated),
    lo = x - hi rounded by _tf32: |x - hi - lo| <= 2^-21 |x|, 2^-22 below 3e38. inf and nan go whole
    into hi (lo 0). Where |x| < 2^-115 lo is subnormal, with fewer bits (as in any tf32x3 scheme)."""
    bits = x.to(tl.int32, bitcast=True)
    hi = (tl.where(tl.abs(x) < 3.0e38, bits + 0x1000, bits) & -8192).to(tl.float32, bitcast=True)
    finite = tl.abs(x) < float("inf")
    return tl.where(finite, hi, x), _tf32(tl.where(finite, x - hi, 0.0))


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b in fp32. PRECISION "tf32" rounds the operands first (see _tf32); "tf32_rounded": they already are
    (`_tf32_operand` copies); "tf32x3": true fp32 on the tensor cores, a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi
    of the operands' _tf32_split (small terms first, non-finite ones dropped; a_lo @ b_lo, under 2^-22 of a
    product, dropped); "ieee": fp32 FMAs."""
    if PRECISION == "tf32":
        c = tl.dot(_tf32(a), _tf32(b), input_precision="tf32")
    elif PRECISION == "tf32_rounded":
        c = tl.dot(a, b, input_precision="tf32")
    elif PRECISION == "tf32x3":  # (fp32 operands only; an inf in a_hi times b_lo: inf or nan, dropped: the
        a_hi, a_lo = _tf32_split(a)  # big product has the answer)
        b_hi, b_lo = _tf32_split(b)
        c = tl.dot(a_hi, b_lo, tl.dot(a_lo, b_hi, input_precision="tf32"), input_precision="tf32")
        c = tl.dot(a_hi, b_hi, tl.where(tl.abs(c) < float("inf"), c, 0.0), input_precision="tf32")
    else:  # (one return: Triton also compiles the statements after a constexpr branch's return)
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def _dot_acc(acc, a, b, PRECISION: tl.constexpr):
    """acc + a @ b. True fp32 ("ieee", "tf32x3") adds each K tile's product separately: a two-level sum
    whose rounding error grows with BLOCK_K + K / BLOCK_K rather than with K (cuBLAS-level accuracy on long
    K). Written as a subtraction of (-a) @ b because Triton's combiner rewrites `acc + dot(a, b)` into
    `dot(a, b, acc)`, a sequential K sum again; negation is exact and folds into the FMA. Every other
    precision takes that rewrite: one MMA chain accumulating in place."""
    if PRECISION == "tf32x3" or (PRECISION == "ieee" and a.dtype == tl.float32):
        acc = acc - _dot(-a, b, PRECISION)
    else:
        acc = acc + _dot(a, b, PRECISION)
    return acc


@triton.jit
def _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    return acc


@triton.jit
def _mm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,
               M, N, K,
               stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
               HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One output tile per program; grid (tiles, batch, splits of K). C and Z are contiguous [batch, M, N];
    with several splits, split s writes its fp32 partial product to C[s] of a [splits, batch, M, N] C."""
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    batch = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    k_first, k_last = _split_range(split, K, BLOCK_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_first * BLOCK_K + tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap onto valid ones, so only K needs a load mask; stores are masked.
    a_ptrs = (a_ptr + batch * stride_ab + (offs_m % M).to(tl.int64)[:, None] * stride_am
              + offs_k[None, :] * stride_ak)
    b_ptrs = (b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk
              + (offs_n % N).to(tl.int64)[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_last):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=tl.arange(0, BLOCK_K)[:, None] < k_left, other=0.0)
        acc = _dot_acc(acc, a, b, PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
    offs_c = (split * tl.num_programs(1) + batch) * M * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if STORE_Z:
        tl.store(z_ptr + offs_c, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + offs_c, apply_activation(acc, ACT).to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fma_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,
                M, N, K,
                stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Products with M == 1 (BLOCK_M = 1) or few columns (N <= 16, e.g. seed 004's 784 -> 10 layer) on the
    CUDA cores in fp32: a tensor-core tile would be mostly padding, and its latency chain dominates; here A
    streams through once in coalesced [BLOCK_M, BLOCK_K] rows, and each K chunk's sum is added to the
    accumulator on its own (a two-level sum, as _dot_acc). C contiguous [batch, M, N]; grid (tiles, batch)."""
    batch = tl.program_id(1).to(tl.int64)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (tl.program_id(0) // num_n).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        if BLOCK_M == 1:  # vector x matrix: a broadcast product summed as a tree over the K chunk
            acc += tl.sum(tl.reshape(a, (BLOCK_K, 1)) * b, axis=0)[None, :]
        else:  # tl.dot's CUDA-core fp32 path, two-level K sum. (Not sum(a[:, :, None] * b[None, :, :], 1):
            acc = _dot_acc(acc, a, b, "ieee")  # Triton 3.6 rewrites that into a tf32 dot, 7.7e-4 off.)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
    offs_c = (batch * M + offs_m)[:, None] * N + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if STORE_Z:
        tl.store(z_ptr + offs_c, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + offs_c, apply_activation(acc, ACT).to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tf32_copy_kernel(x_ptr, y_ptr, R, C, sxb, sxr, sxc, syb, syr, syc,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = x rounded to tf32 (exactly: the low 13 bits cleared), [batch, R, C] in any strides each; grid
    (tiles, batch). One pass gives the tf32 MMAs operands that their truncation leaves unchanged."""
    batch = tl.program_id(1).to(tl.int64)
    num_c = tl.cdiv(C, BLOCK_C)
    offs_r = (tl.program_id(0) // num_c).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (tl.program_id(0) % num_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    x = tl.load(x_ptr + batch * sxb + offs_r[:, None] * sxr + offs_c[None, :] * sxc, mask=mask)
    y = (_tf32(x).to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    tl.store(y_ptr + batch * syb + offs_r[:, None] * syr + offs_c[None, :] * syc, y, mask=mask)


@triton.jit
def _split_sum_kernel(w_ptr, c_ptr, bias_ptr, z_ptr, R, N,
                      SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """C = act(sum_s W[s] + bias) over [R, N] rows: the epilogue of a product split along K."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = offs_r[:, None] * N + offs_n[None, :]
    mask = (offs_r[:, None] < R) & (offs_n[None, :] < N)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(w_ptr + s * R * N + offs, mask=mask, other=0.0)
    acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
    if STORE_Z:
        tl.store(z_ptr + offs, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + offs, apply_activation(acc, ACT).to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mm_tma_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,
                   M, N, K, BATCH,
                   stride_ab, stride_a, stride_bb, stride_b,
                   A_T: tl.constexpr, B_T: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Persistent: NUM_PROGRAMS programs (a multiple of the SM count) walk the [batch, m, n] tiles.
    A is stored [BATCH, M, K] (A_T: [BATCH, K, M]) with unit inner stride and outer stride `stride_a`;
    likewise B [BATCH, K, N] (B_T: [BATCH, N, K])."""
    if A_T:
        a_desc = tl.make_tensor_descriptor(a_ptr, [BATCH, K, M], [stride_ab, stride_a, 1], [1, BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, [BATCH, M, K], [stride_ab, stride_a, 1], [1, BLOCK_M, BLOCK_K])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b_ptr, [BATCH, N, K], [stride_bb, stride_b, 1], [1, BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [BATCH, K, N], [stride_bb, stride_b, 1], [1, BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(c_ptr, [BATCH, M, N], [M * N, N, 1], [1, BLOCK_M, BLOCK_N])
    if STORE_Z:
        z_desc = tl.make_tensor_descriptor(z_ptr, [BATCH, M, N], [M * N, N, 1], [1, BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue recomputes its tile from a counter of its own, which keeps it out of the load pipeline.
    tile_c = tl.program_id(0) - NUM_PROGRAMS
    for tile in tl.range(tl.program_id(0), BATCH * tiles, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        batch = tile // tiles
        pid_m, pid_n = _tile_coords(tile % tiles, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_T:
                a = a_desc.load([batch, off_k, off_m]).reshape(BLOCK_K, BLOCK_M).T
            else:
                a = a_desc.load([batch, off_m, off_k]).reshape(BLOCK_M, BLOCK_K)
            if B_T:
                b = b_desc.load([batch, off_n, off_k]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = b_desc.load([batch, off_k, off_n]).reshape(BLOCK_K, BLOCK_N)
            acc = _dot_acc(acc, a, b, PRECISION)
        tile_c += NUM_PROGRAMS
        batch_c = tile_c // tiles
        pid_m, pid_n = _tile_coords(tile_c % tiles, num_pid_m, num_pid_n, GROUP_M)
        acc = _add_bias(acc, bias_ptr, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, HAS_BIAS)
        if STORE_Z:
            z_desc.store([batch_c, pid_m * BLOCK_M, pid_n * BLOCK_N],
                         acc.to(z_ptr.dtype.element_ty).reshape(1, BLOCK_M, BLOCK_N))
        c = apply_activation(acc, ACT).to(c_ptr.dtype.element_ty)
        c_desc.store([batch_c, pid_m * BLOCK_M, pid_n * BLOCK_N], c.reshape(1, BLOCK_M, BLOCK_N))


@triton.jit
def _act_grad_kernel(gy_ptr, z_ptr, gz_ptr, sum_ptr,
                     R, N, stride_gr, stride_gn, rows_per_program,
                     ACT: tl.constexpr, COL_SUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """grad_z = grad_y * act'(z) for [R, N] rows (when ACT != "none"), and the column sums of grad_z over
    this program's rows into sum[program_id(1), :] (when COL_SUM). z, grad_z and sum are contiguous."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_start = tl.program_id(1) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, R)
    col_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r in range(row_start, row_end, BLOCK_R):
        offs_r = (r + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (offs_r < row_end)[:, None] & (offs_n < N)[None, :]
        g = tl.load(gy_ptr + offs_r[:, None] * stride_gr + offs_n[None, :] * stride_gn, mask=mask, other=0.0)
        g = g.to(tl.float32)
        if ACT != "none":
            offs = offs_r[:, None] * N + offs_n[None, :]
            z = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            g = (g * activation_grad(z, ACT)).to(gz_ptr.dtype.element_ty)
            tl.store(gz_ptr + offs, g, mask=mask)
        if COL_SUM:
            col_sum += tl.sum(g.to(tl.float32), axis=0)
    if COL_SUM:
        tl.store(sum_ptr + tl.program_id(1) * N + offs_n, col_sum.to(sum_ptr.dtype.element_ty), mask=offs_n < N)


# --- 3. Launchers -----------------------------------------------------------------------------------

_cfg = _autotune.config
# Hopper TMA kernel, 16-bit and 32-bit operands: the largest tiles first (the default when not tuning).
# OCC: programs per SM (2 lets one program's epilogue overlap another's loads).
_TMA_CONFIGS = {
    2: [_cfg(128, 256, 64, 8, 3, WARP_SPECIALIZE=False), _cfg(128, 256, 64, 8, 3, WARP_SPECIALIZE=True),
        _cfg(128, 128, 64, 8, 4, WARP_SPECIALIZE=False), _cfg(128, 128, 64, 4, 4, WARP_SPECIALIZE=True),
        _cfg(64, 128, 64, 4, 4, WARP_SPECIALIZE=False), _cfg(64, 64, 128, 4, 4, WARP_SPECIALIZE=False),
        _cfg(64, 64, 128, 4, 6, WARP_SPECIALIZE=False), _cfg(64, 32, 256, 4, 4, WARP_SPECIALIZE=False),
        _cfg(128, 128, 64, 4, 2, WARP_SPECIALIZE=False, OCC=2), _cfg(128, 64, 64, 4, 3, WARP_SPECIALIZE=False, OCC=2),
        _cfg(64, 256, 64, 4, 4, WARP_SPECIALIZE=False)],  # M ~ 3136 (ResNet's 7x7 1x1s): 392 tiles, 3 full waves
    4: [_cfg(128, 128, 32, 8, 4, WARP_SPECIALIZE=False), _cfg(128, 128, 32, 8, 3, WARP_SPECIALIZE=True),
        _cfg(128, 128, 64, 8, 2, WARP_SPECIALIZE=False), _cfg(128, 64, 32, 4, 4, WARP_SPECIALIZE=False),
        _cfg(64, 64, 64, 4, 3, WARP_SPECIALIZE=False), _cfg(64, 32, 64, 4, 3, WARP_SPECIALIZE=False)],
}
# Pointer kernel; SPLIT_K > 1 splits K over programs (skinny products that would leave SMs idle).
_PTR_CONFIGS = {
    2: [_cfg(128, 128, 64, 8, 3), _cfg(128, 64, 64, 4, 4), _cfg(64, 64, 64, 4, 4), _cfg(128, 16, 64, 4, 4),
        _cfg(32, 64, 128, 4, 3), _cfg(16, 64, 256, 4, 3), _cfg(16, 32, 256, 4, 4), _cfg(16, 16, 256, 4, 2),
        _cfg(16, 64, 128, 4, 4, SPLIT_K=4), _cfg(16, 32, 256, 4, 3, SPLIT_K=4), _cfg(16, 64, 128, 4, 4, SPLIT_K=8)],
    4: [_cfg(128, 128, 32, 8, 3), _cfg(128, 128, 16, 8, 4), _cfg(128, 64, 32, 4, 4), _cfg(64, 128, 32, 4, 4),
        _cfg(64, 64, 32, 4, 4), _cfg(64, 64, 64, 4, 3), _cfg(32, 128, 32, 4, 4), _cfg(256, 16, 64, 8, 3),
        _cfg(128, 16, 64, 4, 4), _cfg(128, 16, 32, 4, 4), _cfg(64, 16, 32, 4, 4), _cfg(64, 16, 128, 4, 4),
        _cfg(32, 64, 64, 4, 3), _cfg(16, 64, 256, 4, 2), _cfg(16, 16, 256, 4, 2), _cfg(16, 64, 128, 4, 3, SPLIT_K=4),
        _cfg(16, 32, 128, 4, 3, SPLIT_K=8)],
}
# The CUDA-core kernel (any dtype): M == 1 (vector-matrix), and at most 16 columns (candidates beside `ptr`).
_FMA_CONFIGS = {
    "vector": [_cfg(1, 64, 128, 4, 1), _cfg(1, 16, 256, 4, 1), _cfg(1, 32, 256, 4, 1), _cfg(1, 128, 64, 4, 1),
               _cfg(1, 256, 32, 8, 1)],
    "narrow": [_cfg(32, 16, 32, 4, 3), _cfg(64, 16, 16, 4, 3), _cfg(16, 16, 64, 4, 2), _cfg(128, 16, 16, 8, 3)],
}


def _fits(configs, M, N, K, max_k=256, min_m=16):
    """Drops candidates whose tile is larger than the bucketed problem, K tiles over max_k, and K splits for
    short K; keeps the smallest if none fits. A choice that only tunes: symbolic sizes count by their traced
    value, without a guard."""
    bm, bn = max(min_m, _autotune.bucket(M)), _autotune.bucket(N)
    long_k = _runtime.size_hint(K) >= 1024
    fitting = [c for c in configs if c["BLOCK_M"] <= bm and c["BLOCK_N"] <= bn and c["BLOCK_K"] <= max_k
               and (long_k or "SPLIT_K" not in c)]
    return fitting or configs[-1:]


# True fp32 as tf32x3 only for reductions at least this long. Its products are exact, but every step of an MMA
# chain truncates its fp32 sum: on short reductions that error went over 2x torch's (cuBLAS sums few terms almost
# exactly: a 10-term weight gradient 1.1x over the bound at 32-long K tiles), on long ones torch's own error grows
# and tf32x3 stays well within (docs/perf-notes.md).
TF32X3_MIN_K = 256


def _precision(dtype: torch.dtype, allow_tf32: Optional[bool] = None, k: Optional[int] = None) -> str:
    """tl.dot's input precision for `dtype` (ignored for 16-bit operands): tf32 where torch allows it
    (allow_tf32, default torch.backends.cuda.matmul.allow_tf32), else true fp32: "tf32x3" on the GPU (three tf32
    tensor-core products, 1.1-3.5x faster than the FMAs) for a reduction of length `k` >= TF32X3_MIN_K (None:
    the caller bounds its chains itself, conv2d; attention cuts its head-dim products into chunks too); else
    "ieee" (fp32 FMAs; under the interpreter always: the same numbers at a third of the dots). See
    docs/perf-notes.md."""
    if dtype == torch.float32 and (torch.backends.cuda.matmul.allow_tf32 if allow_tf32 is None else allow_tf32):
        return "tf32"
    if dtype == torch.float32 and not _runtime.INTERPRET and (k is None or k >= TF32X3_MIN_K):
        return "tf32x3"
    return "ieee"


def _max_k(precision: str, size: int, tf32x3_k: int = 32) -> int:
    """The largest BLOCK_K, which bounds the inner sum of _dot_acc's two-level sum in true fp32: 64 for the FMAs;
    for tf32x3 `tf32x3_k`, since every step of the MMA chain truncates its fp32 sum (at 64 a matmul gradient went
    1.02x over the 2x rule; conv2d keeps 64, its fp32 tests' worst at 0.69x of the bound); 256 otherwise."""
    if size != 4 or precision not in ("ieee", "tf32x3"):
        return 256
    return tf32x3_k if precision == "tf32x3" else 64


def _tma_layout(t: torch.Tensor, traced: bool = False):
    """(transposed, outer stride, batch stride) when `t` [B, R, C] suits a TMA descriptor, else None."""
    size = t.element_size()
    batch, rows, cols = t.shape
    sb, sr, sc = t.stride()
    if not aligned(t, traced):
        return None
    if sc == 1 and rows > 1 and (sr * size) % 16 == 0:
        transposed, outer, extent = False, sr, rows
    elif sr == 1 and (sc * size) % 16 == 0:
        transposed, outer, extent = True, sc, cols
    else:
        return None
    if batch == 1:
        sb = outer * extent  # unused, but the descriptor needs a valid stride
    elif sb == 0 or (sb * size) % 16:
        return None
    return transposed, outer, sb


_plans: dict = {}


def _mm_impl(a, b, bias, activation: str, save_preact: bool, tma: Optional[bool] = None, traced: bool = False):
    """C = act(A @ B + bias) for A [B, M, K], B [B, K, N] (same batch, any strides), bias [N] or None.
    Returns (C, Z): C contiguous [B, M, N]; Z = A @ B + bias when save_preact, else None.
    `tma` forces the kernel choice (tests); None picks the TMA kernel wherever it applies.
    The launch plan (kernel, grid, config) is made once per signature and reused: small products are
    bound by launch cost."""
    batch, M, K = a.shape
    N = b.shape[2]
    c = a.new_empty((batch, M, N))
    z = a.new_empty((batch, M, N)) if save_preact else c  # c stands in for an unused Z
    if c.numel() == 0:
        return c, z if save_preact else None
    a, b, run = _mm_prepared(a, b, c, bias, z, activation, save_preact, tma, traced)
    run(a, b, c, absent(c, traced) if bias is None else bias, absent(c, traced) if z is c else z)
    return c, z if save_preact else None


def _mm_prepared(a, b, c, bias, z, activation: str, save_preact: bool, tma: Optional[bool], traced: bool):
    """(a, b, run): the operands as the kernels read them (where tf32 is used, copies rounded to it) and the
    signature's plan, run(a, b, c, bias, z)."""
    K = a.shape[2]
    precision = _precision(a.dtype, k=K)
    if precision == "tf32" and K > 0:
        # tf32 MMAs read operands K-major, and Hopper's drop the low 13 bits: one pass makes K-major copies
        # rounded to tf32 (cheaper than transposed tiles or rounding every tile in the kernel: 0.38x cuBLAS)
        a, b, precision = _tf32_operand(a, 2, traced), _tf32_operand(b, 1, traced), "tf32_rounded"
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.device, aligned(a, traced), aligned(b, traced),
           None if bias is None else aligned(bias, traced), activation, save_preact, precision, tma)
    run = plan(_plans, key, lambda: _make_plan(a, b, c, bias, z, activation, save_preact, tma, precision, traced),
               traced=traced)
    return a, b, run


def _mm_shortcut(a, b, c, bias, activation: str):
    """For `Shortcuts`: run(a, b, c, bias) writes act(a @ b + bias) into c, the eager product without autograd
    of this signature (a, b, c, bias as `_mm_impl` takes them; c, a new contiguous [B, M, N] output, gives the
    signature); None where the call copies its operands (tf32) or has no work."""
    if c.numel() == 0:
        return None
    a2, b2, run = _mm_prepared(a, b, c, bias, c, activation, False, None, False)
    if a2 is not a or b2 is not b:
        return None
    return lambda a, b, c, bias: run(a, b, c, c if bias is None else bias, c)


def product_shortcut(operands: tuple, given: tuple, c, activation: str, out):
    """For `Shortcuts`: a product's later eager calls of this signature, given tensors (a, b[, bias[, ...]]) ->
    a new twin of `out`, act(a @ b + bias). `operands` are what this call passed to the product (3-D views, c its
    [B, M, N] result, out the view of c it returned): the plan runs on the given tensors, which start where the
    operands do; None where a copy made an operand, or the product copies its operands (tf32)."""
    if any(o is not None and o.data_ptr() != g.data_ptr() for o, g in zip(operands, given)):
        return None
    mm = _mm_shortcut(*operands[:2], c, operands[2] if len(operands) > 2 else None, activation)
    return None if mm is None else writing(out, lambda y, a, b, bias=None, *unused: mm(a, b, y, bias))


def _tf32_operand(t: torch.Tensor, k_dim: int, traced: bool = False) -> torch.Tensor:
    """A copy of t [batch, R, C] rounded to tf32, with dimension k_dim (1 or 2) contiguous."""
    batch, R, C = t.shape
    y = t.new_empty((batch, R, C)) if k_dim == 2 else torch.empty_strided((batch, R, C), (R * C, 1, R),
                                                                         device=t.device, dtype=t.dtype)
    grid = (_runtime.cdiv(R, 64) * _runtime.cdiv(C, 64), batch)
    launch(_tf32_copy_kernel, grid, t, y, R, C, *t.stride(), *y.stride(), BLOCK_R=64, BLOCK_C=64, traced=traced)
    return y


def _make_plan(a, b, c, bias, z, activation, save_preact, tma, precision, traced: bool):
    """Chooses the kernel and its config for this signature (tuning on first use); returns the launcher.
    Candidates: the TMA kernel's where it applies, and the pointer kernel's where it may win (skinny or
    fp32 products, or no TMA)."""
    batch, M, K = a.shape
    N = b.shape[2]
    size = a.element_size()
    a_layout, b_layout = _tma_layout(a, traced), _tma_layout(b, traced)
    tuned = tma is None
    if tuned:
        tma = (_runtime.is_hopper(a.device.index or 0) and K > 0 and a_layout is not None
               and b_layout is not None and (N * size) % 16 == 0)
        ptr = not tma or min(_runtime.size_hint(M), _runtime.size_hint(N)) <= 64 or size == 4  # (tunes only)
    else:
        ptr = not tma
    max_k = _max_k(precision, size)
    configs = [dict(cfg, KERNEL="tma") for cfg in _fits(_TMA_CONFIGS[size], M, N, K, max_k, 64)] if tma else []
    if ptr:
        configs += [dict(cfg, KERNEL="ptr") for cfg in _fits(_PTR_CONFIGS[min(size, 4)], M, N, K, max_k)]
    if M == 1 and tuned:
        configs = [dict(cfg, KERNEL="fma") for cfg in _fits(_FMA_CONFIGS["vector"], 1, N, K, min_m=1)] + configs
    elif N <= 16 and tuned:
        configs += [dict(cfg, KERNEL="fma") for cfg in _FMA_CONFIGS["narrow"]]
    epilogue = dict(HAS_BIAS=bias is not None, ACT=activation, STORE_Z=save_preact, PRECISION=precision,
                    GROUP_M=8)

    def launcher(cfg):
        cfg = dict(cfg)
        kernel, splits = cfg.pop("KERNEL"), cfg.pop("SPLIT_K", 1)
        tiles = _runtime.cdiv(M, cfg["BLOCK_M"]) * _runtime.cdiv(N, cfg["BLOCK_N"])
        if kernel == "fma":
            meta = dict(HAS_BIAS=epilogue["HAS_BIAS"], ACT=activation, STORE_Z=save_preact, BLOCK_M=cfg["BLOCK_M"],
                        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"])
            scalars = (M, N, K, *a.stride(), *b.stride())
            launch = Launch(_fma_kernel, (tiles, batch), meta, traced=traced)
            return lambda a, b, c, bias, z: launch(a, b, c, bias, z, *scalars)
        if kernel == "tma":
            programs = cfg.pop("OCC", 1) * _runtime.num_sms(a.device.index or 0)
            grid = (min(programs, batch * tiles),)
            scalars = (M, N, K, batch, a_layout[2], a_layout[1], b_layout[2], b_layout[1])
            meta = dict(epilogue, A_T=a_layout[0], B_T=b_layout[0], NUM_PROGRAMS=programs)
            meta.update(cfg)
            launch = Launch(_mm_tma_kernel, grid, meta, scratch=True, traced=traced)
            return lambda a, b, c, bias, z: launch(a, b, c, bias, z, *scalars)
        scalars = (M, N, K, *a.stride(), *b.stride())
        if splits == 1:
            meta = dict(epilogue)
            meta.update(cfg)
            launch = Launch(_mm_kernel, (tiles, batch, 1), meta, traced=traced)
            return lambda a, b, c, bias, z: launch(a, b, c, bias, z, *scalars)
        partial_meta = dict(epilogue, HAS_BIAS=False, ACT="none", STORE_Z=False)
        partial_meta.update(cfg)
        sum_meta = dict(SPLITS=splits, HAS_BIAS=epilogue["HAS_BIAS"], ACT=activation, STORE_Z=save_preact,
                        BLOCK_R=32, BLOCK_N=64)
        launch_partial = Launch(_mm_kernel, (tiles, batch, splits), partial_meta, traced=traced)
        sum_grid = (_runtime.cdiv(batch * M, 32), _runtime.cdiv(N, 64))
        launch_sum = Launch(_split_sum_kernel, sum_grid, sum_meta, traced=traced)

        def run_split(a, b, c, bias, z):
            partial = torch.empty((splits, batch, M, N), device=a.device, dtype=torch.float32)
            launch_partial(a, b, partial, absent(partial, traced), absent(partial, traced), *scalars)
            launch_sum(partial, c, bias, z, batch * M, N)
        return run_split

    key = ("mm", a.dtype, precision, tma, ptr, M == 1, N <= 16, a.stride(2) != 1, b.stride(2) != 1)
    key += tuple(map(_autotune.bucket, (batch, M, N, K)))
    args = (a, b, c, absent(c, traced) if bias is None else bias, absent(c, traced) if z is c else z)

    def prepare(cfg):  # a launch to time: built once, so it is timed on its fast path
        launch = launcher(cfg)
        return lambda: launch(*args)

    return launcher(_autotune.pick("matmul", key, configs, prepare))


def _act_grad_impl(grad_y, z, activation: str, bias_grad: bool, traced: bool = False):
    """(grad_z, grad_bias) for y = act(z): grad_z [.., N] (empty for activation "none", where it is grad_y)
    and the bias gradient, grad_z summed over every row (empty unless bias_grad)."""
    N = grad_y.shape[-1]
    g2 = grad_y.reshape(math.prod(grad_y.shape[:-1]), N)
    R = g2.shape[0]
    grad_z = torch.empty_like(grad_y, memory_format=torch.contiguous_format) if activation != "none" \
        else grad_y.new_empty(0)
    grad_bias = grad_y.new_empty(N if bias_grad else 0)
    if R * N == 0:
        return grad_z, grad_bias.zero_()
    block_r, block_n = 32, min(128, _runtime.next_power_of_2(N))
    n_blocks = _runtime.cdiv(N, block_n)
    splits = min(_runtime.cdiv(R, block_r), max(1, 2 * _runtime.num_sms(grad_y.device.index or 0) // n_blocks))
    rows = _runtime.cdiv(_runtime.cdiv(R, splits), block_r) * block_r
    splits = _runtime.cdiv(R, rows)
    partial = grad_bias.view(1, N) if (splits == 1 and bias_grad) else \
        torch.empty((splits, N) if bias_grad else (0,), device=grad_y.device, dtype=torch.float32)
    launch(_act_grad_kernel, (n_blocks, splits), g2, absent(g2, traced) if z is None else z, grad_z, partial, R, N,
           *g2.stride(), rows, ACT=activation, COL_SUM=bias_grad, BLOCK_R=block_r, BLOCK_N=block_n, traced=traced)
    if bias_grad and splits > 1:
        launch(_act_grad_kernel, (n_blocks, 1), partial, absent(partial, traced), absent(partial, traced), grad_bias,
               splits, N, N, 1, splits, ACT="none", COL_SUM=True, BLOCK_R=block_r, BLOCK_N=block_n, traced=traced)
    return grad_z, grad_bias


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ------------------------------

@torch_op("dropin::mm", mutates_args=())
def _mm_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], activation: str,
           save_preact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    c, z = _mm_impl(a, b, bias, activation, save_preact, traced=True)
    return c, z if z is not None else a.new_empty(0)


@torch_op("dropin::act_grad", mutates_args=())
def _act_grad_op(grad_y: torch.Tensor, z: Optional[torch.Tensor], activation: str,
                 bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _act_grad_impl(grad_y, z, activation, bias_grad, traced=True)


_mm = switch(_mm_op, _mm_impl)
_act_grad = switch(_act_grad_op, _act_grad_impl)


# --- 5. Autograd --------------------------------------------------------------------------------------

def _product_like(x, y, like):
    """x @ y, computed in the memory layout of `like` (column-major when `like` is), so that a gradient
    lands in its parameter's own layout without a copy."""
    if like.stride(1) == 1 and like.stride(2) != 1:
        return _mm(y.mT, x.mT, None, "none", False)[0].mT
    return _mm(x, y, None, "none", False)[0]


def _product(a, b, bias, activation):
    """act(a @ b + bias) in canonical form, through an autograd node only where a gradient is wanted (the
    node costs launch time, which small products feel)."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or bias is not None and bias.requires_grad):
        return _MatmulFunction.apply(a, b, bias, activation)
    return _mm(a, b, bias, activation, False)[0]


class _MatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, activation):
        save_preact = activation != "none" and any(ctx.needs_input_grad[:3])
        c, z = _mm(a, b, bias, activation, save_preact)
        ctx.save_for_backward(a, b, z if save_preact else None)
        ctx.activation = activation
        return c

    @staticmethod
    def backward(ctx, grad_c):
        a, b, z = ctx.saved_tensors
        need_a, need_b, need_bias, _ = ctx.needs_input_grad
        grad_z, grad_bias = grad_c, None
        if ctx.activation != "none" or need_bias:
            gz, gbias = _act_grad(grad_c, z, ctx.activation, need_bias)
            grad_z = gz if ctx.activation != "none" else grad_c
            grad_bias = gbias if need_bias else None
        grad_a = _product_like(grad_z, b.mT, a) if need_a else None
        grad_b = _product_like(a.mT, grad_z, b) if need_b else None
        return grad_a, grad_b, grad_bias, None


# --- 6. Public functions -------------------------------------------------------------------------------

def _check(op: str, **tensors) -> None:
    """Types, device and dtype of the operands; errors of torch's own types, naming the argument."""
    _runtime.check_kernel_device(op, **tensors)
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.dtype not in _DTYPES:
            raise RuntimeError(f"{op}: argument '{name}' has dtype {t.dtype}; dropin supports {_DTYPES}")
        if first is None:
            first = name, t.dtype
        elif t.dtype != first[1]:
            raise RuntimeError(f"{op}: expected '{first[0]}' and '{name}' to have the same dtype, "
                               f"but got {first[1]} and {t.dtype}")


def _autocast(*tensors):
    """Casts floating operands the way torch.autocast casts them for matmul / linear / conv2d (not float64;
    anything that is no floating tensor passes as it is, for the argument checks to name)."""
    device_type = tensors[0].device.type if isinstance(tensors[0], torch.Tensor) else None
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):  # (others: checks say)
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


_shortcuts = Shortcuts()  # (one for matmul, bmm and linear: their keys name the op)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)`: 1-D, 2-D and batched operands with broadcast batch dims, any strides.

    float32 / float16 / bfloat16 (both the same), fp32 accumulation; float32 uses tf32 only where torch
    would (`torch.backends.cuda.matmul.allow_tf32`)."""
    key, shortcut = _shortcuts.find((a, b), ("matmul",))
    if shortcut is not None:
        return shortcut(a, b)
    for name, t in (("a", a), ("b", b)):
        if isinstance(t, torch.Tensor) and t.dim() == 0:
            raise RuntimeError(f"matmul: both arguments need to be at least 1-D, but '{name}' is 0-D")
    a, b = _autocast(a, b)  # (first: autocast accepts operands of different float dtypes)
    _check("matmul", a=a, b=b)
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    (M, K), (K2, N) = a2.shape[-2:], b2.shape[-2:]
    if K != K2:
        raise RuntimeError(f"matmul: 'a' {tuple(a.shape)} and 'b' {tuple(b.shape)} cannot be multiplied "
                           f"(inner dimensions {K} and {K2})")
    batch_a, batch_b = a2.shape[:-2], b2.shape[:-2]
    try:  # (torch.broadcast_shapes costs ~10 us of CPU time: only where the batches differ)
        batch = batch_a if batch_a == batch_b or not batch_b else torch.broadcast_shapes(batch_a, batch_b)
    except RuntimeError as e:
        raise RuntimeError(f"matmul: batch dimensions of 'a' {tuple(a.shape)} and 'b' {tuple(b.shape)} "
                           f"do not broadcast") from e
    if b2.dim() == 2 and a2.dim() > 2:  # fold a's batch into M: one large product
        operands = (a2.reshape(1, math.prod(a2.shape[:-1]), K), b2.unsqueeze(0))
    else:
        operands = (a2.expand(*batch, M, K).reshape(math.prod(batch), M, K),
                    b2.expand(*batch, K, N).reshape(math.prod(batch), K, N))
    product = _product(*operands, None, "none")
    c = product.view(*batch, M, N)
    if a.dim() == 1:
        c = c.squeeze(-2)
    if b.dim() == 1:
        c = c.squeeze(-1)
    _shortcuts.keep(key, lambda: product_shortcut(operands, (a, b), product, "none", c))
    return c


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm(a, b)`: a [B, M, K] @ b [B, K, N] -> [B, M, N], any strides."""
    key, shortcut = _shortcuts.find((a, b), ("bmm",))
    if shortcut is not None:
        return shortcut(a, b)
    for name, t in (("a", a), ("b", b)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise RuntimeError(f"bmm: argument '{name}' must be a 3-D tensor, got {t.dim()}-D")
    a, b = _autocast(a, b)  # (first: autocast accepts operands of different float dtypes)
    _check("bmm", a=a, b=b)
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise RuntimeError(f"bmm: 'a' {tuple(a.shape)} and 'b' {tuple(b.shape)} have mismatched "
                           f"batch or inner dimensions")
    c = _product(a, b, None, "none")
    _shortcuts.keep(key, lambda: product_shortcut((a, b), (a, b), c, "none", c))
    return c


def _check_linear(x, weight, bias, activation) -> str:
    act = check_activation(activation)
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        raise RuntimeError("linear: argument 'x' must be at least 1-D, got 0-D")
    if isinstance(weight, torch.Tensor) and weight.dim() not in (1, 2):
        raise RuntimeError(f"linear: argument 'weight' must be 1-D or 2-D, got {weight.dim()}-D")
    _check("linear", x=x, weight=weight, bias=bias)
    K = weight.shape[-1]
    if x.shape[-1] != K:
        raise RuntimeError(f"linear: 'x' {tuple(x.shape)} and 'weight' {tuple(weight.shape)} cannot be "
                           f"multiplied (in_features {x.shape[-1]} and {K})")
    N = weight.shape[0] if weight.dim() == 2 else 1
    if bias is not None and (bias.dim() > 1 or bias.numel() != N):
        raise RuntimeError(f"linear: argument 'bias' must have {N} elements (out_features), "
                           f"got shape {tuple(bias.shape)}")
    return act


_checked = Checks()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           activation: Optional[str] = None) -> torch.Tensor:
    """`activation(F.linear(x, weight, bias))` in one kernel: x [..., K], weight [N, K] (or [K]),
    bias [N] or None; activation None, "relu", "gelu", "gelu_tanh" or "silu"."""
    key, shortcut = _shortcuts.find((x, weight, bias), ("linear", activation))
    if shortcut is not None:
        return shortcut(x, weight, bias)
    x, weight, bias = _autocast(x, weight, bias)  # (first: autocast accepts operands of different float dtypes)
    act = _checked.once((x, weight, bias), (activation,), lambda: _check_linear(x, weight, bias, activation))
    w2 = weight.unsqueeze(0) if weight.dim() == 1 else weight
    N, K = w2.shape
    b = None if bias is None else bias.reshape(N).contiguous()  # the kernels read bias with unit stride
    operands = (x.reshape(1, math.prod(x.shape[:-1]), K), w2.t().unsqueeze(0), b)
    c = _product(*operands, act)
    y = c.view(*x.shape[:-1], N) if weight.dim() == 2 else c.view(x.shape[:-1])
    _shortcuts.keep(key, lambda: product_shortcut(operands, (x, weight, bias), c, act, y))
    return y

