"""Helpers shared by the ops: the versions of tensors that cached values are made from, memory formats (outputs in
one, the format torch picks), and for the memory-bound ops (pooling, norms, softmax, activations, batch_norm) dtype
checks, per-channel parameters as unit-stride dims, strided views and their merged dims, row and pixel tiles, the
launch heuristics for row-wise kernels (whole rows, or long rows in chunks); the column sums of per-program fp32
partials (the norms' weight gradients)."""
import torch
import triton
import triton.language as tl
from torch._prims_common import make_channels_last_strides_for, make_contiguous_strides_for, suggest_memory_format

from .. import _runtime
from ._dispatch import Launch, launch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def versions(*tensors):
    """What identifies the data of these tensors, for a cache of values made from them (a weight in another layout,
    a folded BatchNorm, a sparse weight): each one's identity, storage address (a new `.data`, dtype or device) and
    version (in-place writes bump it); None for a None. The cache keeps the tensors referenced, so that another
    tensor cannot take an identity or an address over. None overall where one cannot be tracked (an inference
    tensor has no version): make the value anew. Edits through a `.data` alias are invisible here, as to
    autograd."""
    try:
        return tuple(None if t is None else (id(t), t.data_ptr(), t._version) for t in tensors)
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def empty_in(shape, memory_format, dtype: torch.dtype, device) -> torch.Tensor:
    """`torch.empty(shape, memory_format=...)` (contiguous or channels_last) as `torch.empty_strided` with its
    strides: under torch.compile the memory_format form lowers to a kernel that fills the whole tensor (with NaN)
    before the kernel that writes it; empty_strided lowers to an allocation alone."""
    strides = (make_channels_last_strides_for(shape) if memory_format == torch.channels_last
               else make_contiguous_strides_for(shape))
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def is_channels_last(t: torch.Tensor) -> bool:
    """torch's suggest_memory_format for a 4-D tensor (the rule its convolutions pick the output layout by);
    dense tensors of one unambiguous layout and no size-1 dim are answered by two cheap contiguity checks first
    (a size-1 dim's stride is free: [5, 2, 1, 2] of strides (4, 1, 2, 2) is channels_last-contiguous, yet torch
    suggests NCHW for it)."""
    if t.dim() != 4:
        return False
    nchw, nhwc = t.is_contiguous(), t.is_contiguous(memory_format=torch.channels_last)
    if nchw != nhwc and 1 not in t.shape:
        return nhwc
    return suggest_memory_format(t) == torch.channels_last


@triton.jit
def pixel(offs, H, W):
    """(n, h, w) of flat pixel indices offs = (n * H + h) * W + w."""
    t = offs // W
    return t // H, t % H, offs % W


def pixel_tiles(P: int, C: int, channels_last: bool) -> tuple:
    """(BLOCK_P, BLOCK_C) of a pixels x channels tile (pooling, batch_norm): about 1024 elements, the unit-stride
    axis (channels or pixels) the long one."""
    if channels_last:
        block_c = min(_runtime.next_power_of_2(C), 128)
        return max(2, min(1024 // block_c, _runtime.next_power_of_2(P))), block_c
    block_p = min(_runtime.next_power_of_2(P), 256)
    return block_p, max(1, min(1024 // block_p, _runtime.next_power_of_2(C)))


def check_float(op: str, **tensors) -> None:
    """An error naming the first tensor that is not fp16/bf16/fp32, of torch's type: the first tensor given (the
    op's input, whose dtype torch's kernels dispatch on) raises NotImplementedError, as torch's AT_DISPATCH
    (`"..." not implemented for 'Long'`, on CPU and CUDA alike; float64, which torch runs and dropin has no kernel
    for, too); a later one (a parameter) RuntimeError, as torch's mixed-dtype checks."""
    error = NotImplementedError
    for name, t in tensors.items():  # (no enumerate: Dynamo traces its polyfill on every call)
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise error(f"{op}: argument '{name}' has dtype {t.dtype}; dropin supports {FLOAT_DTYPES}")
        error = RuntimeError


def flat_param(t):
    """A per-channel parameter (weight, bias) as one unit-stride dim, a copy only for a strided one; a 1-D
    unit-stride one as it is (no view: under torch.compile each view is a node of the graph); None for None."""
    if t is None or t.dim() == 1 and t.stride(0) == 1:
        return t
    return t.reshape(-1).contiguous()


def merge_dims(sizes, strides) -> list:
    """A strided view's dims as (size, stride) pairs, outermost first, size-1 dims dropped and neighbours
    merged where one stride steps over the other (as `view` could merge them)."""
    out = []
    for size, stride in zip(sizes, strides):
        if size == 1:
            continue
        if out and out[-1][1] == size * stride:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def is_dense(t: torch.Tensor) -> bool:
    """True when t's elements fill one block of memory without gaps or overlaps, in any dim order."""
    dims = sorted(zip(t.stride(), t.shape), reverse=True)
    merged = merge_dims([s for _, s in dims], [st for st, _ in dims])
    return not merged or len(merged) == 1 and merged[0][1] == 1


def joint_dims(shape, strides: list) -> list:
    """The dims of several same-shaped views merged where every view allows it: [(size, (strides...))], size-1 dims
    dropped."""
    out = []
    for d, size in enumerate(shape):
        if size == 1:
            continue
        st = tuple(s[d] for s in strides)
        if out and all(prev == size * cur for prev, cur in zip(out[-1][1], st)):
            out[-1] = (out[-1][0] * size, st)
        else:
            out.append((size, st))
    return out


def row_view(t: torch.Tensor, n_last: int):
    """t as M0 x M1 rows of N elements, [(M0, s0), (M1, s1), (N, sn)], read through t's strides; None when
    the last n_last dims do not merge into one strided dim or the leading ones into two."""
    k = t.dim() - n_last
    row = merge_dims(t.shape[k:], t.stride()[k:]) or [(1, 1)]
    lead = merge_dims(t.shape[:k], t.stride()[:k])
    if len(row) > 1 or len(lead) > 2:
        return None
    return [(1, 0)] * (2 - len(lead)) + lead + row


def rows_or_copy(x: torch.Tensor, n_last: int):
    """(x, [(M0, s0), (M1, s1), (N, sn)]): x itself where its strides allow a row view, else a contiguous
    copy (a copy only for views whose batch dims do not merge into two strided dims)."""
    view = row_view(x, n_last)
    if view is None:
        x = x.contiguous()
        view = row_view(x, n_last)
    return x, view


@triton.jit
def row_start(row, M1, s0, s1):
    """Offset of row r = i0 * M1 + i1 (int64) of a strided M0 x M1 batch of rows."""
    return (row // M1) * s0 + (row % M1) * s1


@triton.jit
def row_offsets(rows, cols, M1, s0, s1, sn):
    """Offsets of elements cols of rows r = i0 * M1 + i1 (int64) of a strided M0 x M1 batch of rows."""
    return row_start(rows, M1, s0, s1)[:, None] + cols.to(tl.int64)[None, :] * sn


MAX_ROW = 65536  # the longest row that `row_config`'s kernels hold whole; longer rows loop (`chunk_config`)
CHUNK = 4096  # the elements of one step of a looped row


def long_row(n: int, limit=None) -> bool:
    """Whether rows of n elements take the looped kernels (`chunk_config`) rather than the whole-row ones: rows
    longer than MAX_ROW, or than limit where an op's whole-row kernels hold less."""
    return n > (MAX_ROW if limit is None else min(MAX_ROW, limit))


def row_config(n: int) -> dict:
    """Launch settings for a kernel holding BLOCK_M whole rows of n elements in registers: about 2048+
    elements per program, 8 per thread (up to 8192-element rows; longer rows hold more per thread and spill
    in the backward kernels), contiguous along the row for vectorized loads."""
    block_n = _runtime.next_power_of_2(max(n, 1))
    block_m = max(1, 2048 // block_n)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=min(32, block_m * block_n // 256))


def chunk_config(n: int) -> dict:
    """Launch settings for a kernel looping over one row of n elements (a row too long for `row_config`) per
    program in chunks of BLOCK_N = CHUNK elements (n rounded up to a power of 2 where shorter): 16 per thread,
    contiguous along the row."""
    block_n = min(CHUNK, _runtime.next_power_of_2(max(n, 1)))
    return dict(BLOCK_N=block_n, num_warps=max(1, min(8, block_n // 512)))


@triton.jit
def sum_partials_kernel(part_ptr, out_ptr, T, C, s_c, s_h, s_w, KW: tl.constexpr, TAPS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[c, tap // KW, tap % KW] (strides s_c, s_h, s_w; out's dtype) = the sum over t of the fp32 partials
    part[t, tap, c] (contiguous [T, TAPS, C]): one launch for the sum, a transpose and the cast; grid (TAPS,
    channel blocks)."""
    tap = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    rows = tl.arange(0, BLOCK_T)
    cols = part_ptr + tap * C + c[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + rows
        acc += tl.load(cols + (t.to(tl.int64) * TAPS * C)[:, None], mask=(t < T)[:, None] & c_ok[None, :], other=0.0)
    out = out_ptr + c * s_c + (tap // KW) * s_h + (tap % KW) * s_w
    tl.store(out, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=c_ok)


def column_sums(part: torch.Tensor, out: torch.Tensor, traced: bool = False) -> torch.Tensor:
    """out[j] = sum_g part[g, j] in out's dtype (part fp32 [G, N] and out [N], both contiguous), one launch: column
    tiles as narrow as needed for ~128 programs (torch's sum over dim 0 of Llama's 528 x 4096 partials takes 16 us)."""
    G, N = part.shape
    grid, meta = _column_sums_launch(N)
    launch(sum_partials_kernel, grid, part, out, G, N, 1, 0, 0, **meta, traced=traced)
    return out


def column_sums_run(G: int, N: int, traced: bool = False):
    """`column_sums` for partials [G, N], as a launch that a caller's plan holds (no launch key per call):
    run(part, out) -> out."""
    grid, meta = _column_sums_launch(N)
    summed = Launch(sum_partials_kernel, grid, meta, traced=traced)

    def run(part, out):
        summed(part, out, G, N, 1, 0, 0)
        return out
    return run


def _column_sums_launch(N: int):
    """(grid, constexprs) of `column_sums`' launch over N columns."""
    block_n = min(256, max(16, _runtime.next_power_of_2(_runtime.cdiv(N, 128))))
    return (1, _runtime.cdiv(N, block_n)), dict(KW=1, TAPS=1, BLOCK_T=max(8, 2048 // block_n), BLOCK_C=block_n,
                                                num_warps=4)
