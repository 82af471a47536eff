"""What the products of several op families share (matmul, conv2d, attention, swiglu): the Triton tile helpers
(`dot`, `dot_parts`, `dot_acc`, `tile_coords`, `split_range`, `round_tf32`), the operand copy (`operand_copy_kernel`,
its tile `copy_tile`, its launch: `operand_copy_launch`) and the host-side rules (`precision`, `max_k`, `fits`,
`autocast`, `check_operands`). Callers reach the host-side rules through the module (`_gemm.precision`), so that a test
patching one reaches every op."""
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _runtime
from . import _autotune
from ._common import check_float


# --- Triton helpers -----------------------------------------------------------------------------------------

# The longest reduction one tensor-core accumulator takes. Hopper's MMA adds into its fp32 accumulator with a
# truncation: a bias toward zero of about 1.2e-9 relative per term, 1.2e-3 at K = 2^20 and 7e-2 at 2^26 (bf16 and
# fp16 alike; cuBLAS's fp32 5.7e-7 at 2^20: benchmarks/probes/long_k.py, H200). Kernels with longer reductions sum
# each ACC_K-long share in a fresh accumulator and add it to an fp32 total on the CUDA cores (rounded to nearest):
# at most 7.5e-5 of bias, under fp16's rounding of the result (2.4e-4).
ACC_K = tl.constexpr(65536)


def shares(K, splits: int, block_k: int) -> bool:
    """Whether a split of K's [splits] reductions, in tiles of block_k, is longer than ACC_K (a kernel's SHARES)."""
    return _runtime.cdiv(_runtime.cdiv(_runtime.size_hint(K), block_k), splits) * block_k > ACC_K.value


def split_counts(tiles: int, programs: int, steps: int, min_steps: int, fewest: int = 1) -> list:
    """How many ways a split-K kernel's candidates cut a reduction of `steps` steps over `tiles` output tiles on
    `programs` programs: about one and about two (split, tile) items a program, at least 2 and `fewest`, each split
    at least `min_steps` steps; distinct counts, fewest splits first."""
    counts = []
    for per_program in (1, 2):
        splits = max(2, fewest, per_program * programs // tiles)
        if steps >= min_steps * splits and splits not in counts:
            counts.append(splits)
    return counts


@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles sweep the columns together, so tiles of B are reused from L2."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group_m
    pid_n = (tile % width) // group_m
    return pid_m, pid_n


@triton.jit
def split_range(split, splits, steps):
    """[first, last) of a reduction's `steps` (K tiles, a conv's (tap, channel block) steps) for split `split` of
    `splits`: equal shares, the last one shorter, or empty where the shares run out first."""
    per_split = tl.cdiv(steps, splits)
    first = split * per_split
    return first, tl.minimum(first + per_split, steps)


@triton.jit
def round_tf32(x):
    """x (fp32) rounded to tf32's 10-bit mantissa, half away from zero (the low 13 bits cleared). Hopper's tf32
    MMA drops the low 13 bits of each operand, a truncation whose bias grows with K (4-5x cuBLAS's error, measured
    on the attention and SwiGLU tests); adding half a tf32 ulp first turns it into a rounding, and clearing the
    bits gives the interpreter (which does not truncate) the same operands. inf, nan and the largest finite values
    (which the add would carry out of range) are left to the truncation."""
    bits = (x.to(tl.int32, bitcast=True) + 0x1000) & -8192
    return tl.where(tl.abs(x) < 3.0e38, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def copy_tile(x_ptr, y_ptr, R, C, sxb, sxr, sxc, syb, syr, syc, plane, tile, batch,
              ROUND_TF32: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              NEGATE: tl.constexpr):
    """`operand_copy_kernel`'s work on its tile `tile` of batch `batch` (int64)."""
    num_c = tl.cdiv(C, BLOCK_C)
    offs_r = (tile // num_c).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (tile % num_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    x = tl.load(x_ptr + batch * sxb + offs_r[:, None] * sxr + offs_c[None, :] * sxc, mask=mask)
    y_ptrs = y_ptr + batch * syb + offs_r[:, None] * syr + offs_c[None, :] * syc
    if SPLIT:
        hi, lo = tf32_split(-x if NEGATE else x)
        tl.store(y_ptrs, hi, mask=mask)
        tl.store(y_ptrs + plane, lo, mask=mask)
    else:
        if ROUND_TF32:
            x = (round_tf32(x).to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        tl.store(y_ptrs, x, mask=mask)


@triton.jit
def operand_copy_kernel(x_ptr, y_ptr, R, C, sxb, sxr, sxc, syb, syr, syc, plane,
                        ROUND_TF32: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                        NEGATE: tl.constexpr = False):
    """y = x, [batch, R, C] in any strides each (an operand laid out as the MMAs read it); with ROUND_TF32 (fp32)
    rounded to tf32 exactly (round_tf32, the low 13 bits cleared): operands that the tf32 MMAs' truncation leaves
    unchanged; with SPLIT (fp32) x's two tf32 parts (tf32_split): hi into y, lo `plane` elements further (the
    operands of tf32x3 products that read both parts as they lie), those of -x with NEGATE (exact: a product
    subtracted from its sum, which Triton does not fold into the MMA chain, `dot_acc`). Grid (tiles, batch)."""
    copy_tile(x_ptr, y_ptr, R, C, sxb, sxr, sxc, syb, syr, syc, plane, tl.program_id(0),
              tl.program_id(1).to(tl.int64), ROUND_TF32, SPLIT, BLOCK_R, BLOCK_C, NEGATE)


def operand_copy_launch(R, C, batch, round_tf32: bool, split: bool = False, negate: bool = False) -> tuple:
    """(grid, constexprs) of operand_copy_kernel over [batch, R, C]: 64 x 64 tiles."""
    return ((_runtime.cdiv(R, 64) * _runtime.cdiv(C, 64), batch),
            dict(ROUND_TF32=round_tf32, SPLIT=split, BLOCK_R=64, BLOCK_C=64, NEGATE=negate))


@triton.jit
def tf32_split(x):
    """x (fp32) as hi + lo, two tf32 numbers: hi exact (x rounded, the largest finite values truncated),
    lo = x - hi rounded by round_tf32: |x - hi - lo| <= 2^-21 |x|, 2^-22 below 3e38. inf and nan go whole
    into hi (lo 0). Where |x| < 2^-115 lo is subnormal, with fewer bits (as in any tf32x3 scheme)."""
    bits = x.to(tl.int32, bitcast=True)
    hi = (tl.where(tl.abs(x) < 3.0e38, bits + 0x1000, bits) & -8192).to(tl.float32, bitcast=True)
    finite = tl.abs(x) < float("inf")
    return tl.where(finite, hi, x), round_tf32(tl.where(finite, x - hi, 0.0))


@triton.jit
def dot_parts(a_hi, a_lo, b_hi, b_lo):
    """tf32x3's a @ b from each operand's two tf32 parts (tf32_split): a_lo @ b_hi + a_hi @ b_lo first, their
    non-finite sums dropped (an inf in a_hi times b_lo: inf or nan; the big product has the answer), then
    + a_hi @ b_hi; a_lo @ b_lo, under 2^-22 of a product, left out."""
    c = tl.dot(a_hi, b_lo, tl.dot(a_lo, b_hi, input_precision="tf32"), input_precision="tf32")
    return tl.dot(a_hi, b_hi, tl.where(tl.abs(c) < float("inf"), c, 0.0), input_precision="tf32")


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """a @ b in fp32. PRECISION "tf32" rounds the operands first (see round_tf32); "tf32_rounded": they already
    are (matmul_operands.operand_copy's copies); "tf32_rounded_b": b is, a is rounded here; "tf32x3": true fp32 on
    the tensor cores, `dot_parts` of the operands' tf32_split; "ieee": fp32 FMAs."""
    if PRECISION == "tf32":
        c = tl.dot(round_tf32(a), round_tf32(b), input_precision="tf32")
    elif PRECISION == "tf32_rounded_b":
        c = tl.dot(round_tf32(a), b, input_precision="tf32")
    elif PRECISION == "tf32_rounded":
        c = tl.dot(a, b, input_precision="tf32")
    elif PRECISION == "tf32x3":  # (fp32 operands only)
        a_hi, a_lo = tf32_split(a)
        b_hi, b_lo = tf32_split(b)
        c = dot_parts(a_hi, a_lo, b_hi, b_lo)
    else:  # (one return: Triton also compiles the statements after a constexpr branch's return)
        c = tl.dot(a, b, input_precision=PRECISION)
    return c


@triton.jit
def dot_acc(acc, a, b, PRECISION: tl.constexpr):
    """acc + a @ b. True fp32 ("ieee", "tf32x3") adds each K tile's product separately: a two-level sum
    whose rounding error grows with BLOCK_K + K / BLOCK_K rather than with K (cuBLAS-level accuracy on long
    K). Written as a subtraction of (-a) @ b because Triton's combiner rewrites `acc + dot(a, b)` into
    `dot(a, b, acc)`, a sequential K sum again; negation is exact and folds into the FMA. Every other
    precision takes that rewrite: one MMA chain accumulating in place."""
    if PRECISION == "tf32x3" or (PRECISION == "ieee" and a.dtype == tl.float32):
        acc = acc - dot(-a, b, PRECISION)
    else:
        acc = acc + dot(a, b, PRECISION)
    return acc


# --- Host-side rules ----------------------------------------------------------------------------------------

# True fp32 as tf32x3 only for reductions at least this long. Its products are exact, but every step of an MMA
# chain truncates its fp32 sum: on short reductions that error went over 2x torch's (cuBLAS sums few terms almost
# exactly: a 10-term weight gradient 1.1x over the bound at 32-long K tiles), on long ones torch's own error grows
# and tf32x3 stays well within (docs/perf-notes.md).
TF32X3_MIN_K = 256
# ... and only for products of at least this many multiply-adds: a smaller one costs a few microseconds either way,
# and FMAs sum its reductions as near exactly as cuBLAS does (a [7, 7] gradient of 441 terms: tf32x3's truncating
# chains 3.6x torch's error). Not a rule on the output's width: FMAs ran 50000 x 784 @ 784 x 10 at half tf32x3's
# speed (docs/perf-notes.md).
TF32X3_MIN_MACS = 1 << 24


def tf32_key(t, op: str = "matmul") -> Optional[bool]:
    """What the shortcut key (`_dispatch.Shortcuts`) of a call on float32 `t` holds beside its tensors: whether torch
    now allows TF32 for `op` ("matmul" or "conv"), which a kept plan's precision follows; None for other dtypes
    and while torch.compile traces (no shortcut then; Dynamo does not trace torch's precision getters)."""
    if getattr(t, "dtype", None) is not torch.float32 or torch.compiler.is_compiling():
        return None
    return _runtime.tf32_allowed(op)


def precision(dtype: torch.dtype, allow_tf32: Optional[bool] = None, k: Optional[int] = None,
              macs: Optional[int] = None) -> str:
    """tl.dot's input precision for `dtype` (ignored for 16-bit operands): tf32 where torch allows it
    (allow_tf32, default torch's rule for matmuls, `_runtime.tf32_allowed`), else true fp32: "tf32x3" on the GPU
    (three tf32 tensor-core products, 1.1-3.5x faster than the FMAs) for a reduction of length `k` >= TF32X3_MIN_K
    (None: the caller bounds its chains itself, conv2d; attention cuts its head-dim products into chunks too) in a
    product of `macs` (None: not known to be small) >= TF32X3_MIN_MACS multiply-adds; else
    "ieee" (fp32 FMAs; under the interpreter always: the same numbers at a third of the dots). See
    docs/perf-notes.md."""
    if dtype == torch.float32 and (_runtime.tf32_allowed("matmul") if allow_tf32 is None else allow_tf32):
        return "tf32"
    if dtype == torch.float32 and not _runtime.INTERPRET and (k is None or k >= TF32X3_MIN_K) \
            and (macs is None or macs >= TF32X3_MIN_MACS):
        return "tf32x3"
    return "ieee"


# The longest FMA chain of true fp32's "ieee" dots (their BLOCK_K, the inner level of dot_acc's two-level sum).
# Chains of 16 brought one-token fp32 products' error closer to cuBLAS's (a 56-term sum: median 1.5-1.7x torch's
# error over 24 seeds, 0.8-1.1x at 16) but slowed the FMA products they tile (fp32 swiglu_mlp, 192-wide: 1.44x the
# time; 64 x 441 @ 441 x 64: 1.63x); one token takes the vector kernels' tree sums instead (docs/perf-notes.md).
# A variable of the module: probes/ieee_block_k.py sets it.
FMA_CHAIN = 64


def max_k(precision: str, size: int, chain: Optional[int] = None) -> int:
    """The largest BLOCK_K, which bounds the inner sum of dot_acc's two-level sum in true fp32: `chain` where
    given (conv2d: 64, its fp32 tests' worst at 0.69x of the 2x rule), else FMA_CHAIN for the FMAs and 32 for
    tf32x3 (its parts split in the kernel or copied: "tf32x3_split", B's alone: "tf32x3_split_b"), since every
    step of the MMA chain truncates its fp32 sum (at 64 a matmul gradient went 1.02x over the 2x rule); 256
    otherwise."""
    if size != 4 or precision not in ("ieee", "tf32x3", "tf32x3_split", "tf32x3_split_b"):
        return 256
    return chain or (FMA_CHAIN if precision == "ieee" else 32)


def cap_k(configs, max_k: int) -> list:
    """configs with their K tiles cut to max_k (duplicates dropped, order kept)."""
    out = []
    for cfg in configs:
        cfg = dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], max_k))
        if cfg not in out:
            out.append(cfg)
    return out


def fits(configs, M, N, K, max_k=256, min_m=16):
    """Drops candidates whose tile is larger than the bucketed problem, K tiles over max_k, and K splits for
    short K; keeps the smallest, its K tile cut to max_k, if none fits. A choice that only tunes: symbolic sizes
    count by their traced value, without a guard."""
    bm, bn = max(min_m, _autotune.bucket(M)), _autotune.bucket(N)
    long_k = _runtime.size_hint(K) >= 1024
    fitting = [c for c in configs if c["BLOCK_M"] <= bm and c["BLOCK_N"] <= bn and c["BLOCK_K"] <= max_k
               and (long_k or "SPLIT_K" not in c)]
    return fitting or cap_k(configs[-1:], max_k)


def autocast(*tensors):
    """Casts floating operands the way torch.autocast casts them for matmul / linear / conv2d (not float64;
    anything that is no floating tensor passes as it is, for the argument checks to name)."""
    device_type = tensors[0].device.type if isinstance(tensors[0], torch.Tensor) else None
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):  # (others: checks say)
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


def check_operands(op: str, **tensors) -> None:
    """Types, device and dtype of the operands (one float dtype for all); errors of torch's own types, naming the
    argument: mixed dtypes RuntimeError (torch's "expected m1 and m2 to have the same dtype"), then one dtype that
    is not fp16/bf16/fp32 NotImplementedError (`check_float`: cuBLAS's "addmm_cuda" not implemented for 'Int')."""
    _runtime.check_kernel_device(op, **tensors)
    first = None  # (a loop, not a comprehension: Dynamo traces a comprehension as a call of its own)
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first, dtype = name, t.dtype
        elif t.dtype != dtype:
            raise RuntimeError(f"{op}: expected '{first}' and '{name}' to have the same dtype, "
                               f"but got {dtype} and {t.dtype}")
    check_float(op, **{first: tensors[first]})
