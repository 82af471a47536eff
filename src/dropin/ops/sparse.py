"""Unstructured-sparse linear layers: y = x @ W^T + bias with a pruned weight W [N, K] kept compressed.

Format (`SparseWeight`, built once by `sparsify`): chunked CSR. K is cut into chunks of `block_k` <= 256
columns; row n's non-zeros in chunk c are stored contiguously, in (row, chunk, column) order, as their values
(W's dtype) and their uint8 offsets within the chunk; `chunk_ptr` [N * C + 1] (int32, int64 beyond 2^31
non-zeros) gives where each (row, chunk) run starts, C = cdiv(K, block_k). Nothing is padded: the bytes are
nnz * (itemsize + 1) + 4 * (N * C + 1), e.g. fp16 at 90% sparsity 0.158x dense (0.15x of values and offsets,
0.008x of pointers), and a kernel reads only those bytes.

Kernel (`sparse_kernel`, CUDA cores, fp32 accumulation): a program owns BLOCK_N weight rows (output
columns), BLOCK_C chunks of K and up to 16 tokens; it loads the run pointers of all its BLOCK_N * BLOCK_C
(row, chunk) runs at once and walks them together BLOCK_P entries at a time, gathering x through its
transpose [K, tokens] (the tokens of one entry's column are one contiguous read). Built for the memory-bound
small-token products (M <= 16), where reading only the non-zero weight bytes is the win. With many tokens
every product is a gathered FMA, so tensor cores on the dense weight win: there the weight is expanded into
a temporary dense [N, K] (`_scatter_kernel`) for dropin's tensor-core product (matmul's; the default on the GPU
when M * density >= 2, else a tuning candidate; docs/perf-notes.md has the arithmetic).

Backward (weights frozen): dx = dy @ W is the same product with W^T [K, N], compressed at sparsify time
(`transpose=True`, the default) and run through the same kernel: no atomics, deterministic, at the cost of a
second copy of the (small) compressed weight. The bias gradient is dy summed over the tokens.
"""
import math
import operator
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from . import _autotune
from ._common import FLOAT_DTYPES
from ._dispatch import Differentiable, Launch, Shortcuts, absent, launch, plan, switch, torch_op
from .conv2d import conv_tap
from .matmul import mm_impl
from .matmul_kernels import split_sum_kernel

MAX_BLOCK_K = 256  # a chunk offset fits a uint8


# --- 1. Reference and format ---------------------------------------------------------------------

def sparse_linear_ref(x, weight, bias=None) -> torch.Tensor:
    """F.linear on the dense weight [N, K] (a SparseWeight is expanded with to_dense() first)."""
    if isinstance(weight, SparseWeight):
        weight = weight.to_dense()
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


class SparseWeight:
    """A weight [N, K] in chunked CSR (module docstring): values [nnz] (the weight's dtype), offsets [nnz]
    uint8 (column within its chunk of block_k), chunk_ptr [N * C + 1] int32/int64, and optionally
    `transposed`, the same format of W^T [K, N] (for the input gradient). Build with `sparsify`.
    A conv2d weight [Cout, Cin / groups, KH, KW] has `kernel` = (KH, KW, groups) and is stored as
    [Cout, Cin / groups * KH * KW] (torch's flattening); its `transposed` is the input gradient's weight:
    per group, [Cin / groups, Cout / groups * KH * KW] (columns (output channel, kh, kw)), groups stacked."""

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, chunk_ptr: torch.Tensor, shape: tuple,
                 block_k: int, transposed: Optional["SparseWeight"] = None, kernel: Optional[tuple] = None):
        self.values, self.offsets, self.chunk_ptr = values, offsets, chunk_ptr
        self.shape, self.block_k, self.transposed = tuple(shape), block_k, transposed
        self.kernel = None if kernel is None else tuple(kernel)

    @property
    def conv_shape(self) -> Optional[tuple]:
        """[Cout, Cin / groups, KH, KW] of a conv2d weight, else None."""
        if self.kernel is None:
            return None
        KH, KW, _ = self.kernel
        return (self.shape[0], self.shape[1] // (KH * KW), KH, KW)

    def _transposed_shape(self) -> tuple:
        N, K = self.shape
        if self.kernel is None:
            return (K, N)
        KH, KW, groups = self.kernel
        return (K // (KH * KW) * groups, N // groups * KH * KW)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def density(self) -> float:
        """nnz / (N * K); 0 for an empty shape."""
        return self.nnz / max(1, math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        """Bytes of the forward format (values, offsets, chunk pointers); `transposed` is not counted."""
        return self.values.nbytes + self.offsets.nbytes + self.chunk_ptr.nbytes

    @property
    def dense_nbytes(self) -> int:
        return math.prod(self.shape) * self.values.element_size()

    def to(self, dtype: torch.dtype) -> "SparseWeight":
        """The same weight with its values cast to dtype (self when it has that dtype already)."""
        if dtype == self.dtype:
            return self
        t = self.transposed
        return SparseWeight(self.values.to(dtype), self.offsets, self.chunk_ptr, self.shape, self.block_k,
                            None if t is None else t.to(dtype), self.kernel)

    def to_dense(self) -> torch.Tensor:
        """The weight [N, K] (a conv2d weight: [Cout, Cin / groups, KH, KW]) with its zeros back (exactly the
        values that went in)."""
        N, K = self.shape
        chunks = _runtime.cdiv(K, self.block_k)
        runs = torch.repeat_interleave(torch.arange(N * chunks, device=self.device), self.chunk_ptr.diff(),
                                       output_size=self.nnz)  # (no device sync)
        dense = self.values.new_zeros((N, chunks * self.block_k))
        dense[runs // chunks, (runs % chunks) * self.block_k + self.offsets.long()] = self.values
        return dense[:, :K] if self.kernel is None else dense[:, :K].reshape(self.conv_shape)

    def consistent(self) -> bool:
        """Whether the tensors fit the shape (a kernel trusts them): 1-D contiguous values and uint8 offsets of
        one length, chunk_ptr with N * C + 1 integers, all on one device; and the same for `transposed`.
        Remembered for the fields it was checked with (a call costs ~7 us of CPU time otherwise)."""
        fields = (self.values, self.offsets, self.chunk_ptr, self.shape, self.block_k, self.transposed, self.kernel)
        checked = getattr(self, "_checked", None)
        if checked is None or not all(map(operator.is_, checked, fields)):
            self._checked = fields if self._check_fields() else None
        return self._checked is not None

    def _check_fields(self) -> bool:
        N, K = self.shape
        tensors = (self.values, self.offsets, self.chunk_ptr)
        return (isinstance(self.block_k, int) and 1 <= self.block_k <= MAX_BLOCK_K
                and all(isinstance(t, torch.Tensor) and t.dim() == 1 and t.is_contiguous()
                        and t.device == self.values.device for t in tensors)
                and self.offsets.dtype == torch.uint8 and self.chunk_ptr.dtype in (torch.int32, torch.int64)
                and self.offsets.numel() == self.values.numel()
                and self.chunk_ptr.numel() == N * _runtime.cdiv(K, self.block_k) + 1
                and (self.kernel is None or len(self.kernel) == 3 and min(self.kernel) >= 1
                     and K % (self.kernel[0] * self.kernel[1]) == 0 and N % self.kernel[2] == 0)
                and (self.transposed is None or self.transposed.shape == self._transposed_shape()
                     and self.transposed.kernel == self.kernel and self.transposed.consistent()))

    def __repr__(self) -> str:
        return (f"SparseWeight(shape={self.shape}, dtype={self.dtype}, density={self.density:.4f}, "
                f"nbytes={self.nbytes} ({self.nbytes / max(1, self.dense_nbytes):.3f}x dense), "
                f"block_k={self.block_k}, transposed={self.transposed is not None}"
                + ("" if self.kernel is None else f", conv_shape={self.conv_shape}, groups={self.kernel[2]}") + ")")


def _compress(weight: torch.Tensor, block_k: int, kernel: Optional[tuple] = None) -> SparseWeight:
    """Chunked CSR of a 2-D weight [N, K], vectorized: torch.nonzero lists the entries in (row, chunk,
    column) order, which is the storage order."""
    N, K = weight.shape
    chunks = _runtime.cdiv(K, block_k)
    padded = F.pad(weight, (0, chunks * block_k - K)).reshape(N, chunks, block_k)
    nonzero = padded != 0
    counts = nonzero.sum(-1).flatten()
    index_dtype = torch.int32 if int(counts.sum()) < 2**31 else torch.int64
    chunk_ptr = torch.zeros(N * chunks + 1, dtype=index_dtype, device=weight.device)
    torch.cumsum(counts, 0, out=chunk_ptr[1:])
    offsets = torch.arange(block_k, dtype=torch.uint8, device=weight.device).expand_as(padded)[nonzero]
    return SparseWeight(padded[nonzero].contiguous(), offsets, chunk_ptr, (N, K), block_k, kernel=kernel)


def sparsify(weight: torch.Tensor, block_k: int = MAX_BLOCK_K, transpose: bool = True,
             groups: int = 1) -> SparseWeight:
    """Compresses a pruned weight into a SparseWeight (fp32 / fp16 / bf16; zeros where pruned, e.g. a
    `torch.nn.utils.prune`d module's masked `weight`): [N, K] (nn.Linear layout) for `sparse_linear`, or
    [Cout, Cin / groups, KH, KW] (nn.Conv2d layout, with the conv's `groups`) for `sparse_conv2d`.

    block_k: the chunk width (1..256; offsets are uint8). transpose: also compress the input gradient's
    weight (W^T; twice the compressed bytes; False for inference only). The result holds no graph."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"sparsify: argument 'weight' must be a Tensor, got {type(weight).__name__}")
    if weight.dim() not in (2, 4):
        raise ValueError(f"sparsify: argument 'weight' must be 2-D [out_features, in_features] or 4-D "
                         f"[out_channels, in_channels / groups, kH, kW], got {weight.dim()}-D")
    if weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"sparsify: argument 'weight' has dtype {weight.dtype}; dropin supports {FLOAT_DTYPES}")
    if isinstance(block_k, bool) or not isinstance(block_k, int) or not 1 <= block_k <= MAX_BLOCK_K:
        raise ValueError(f"sparsify: argument 'block_k' must be an int in [1, {MAX_BLOCK_K}], got {block_k!r}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or weight.shape[0] % groups \
            or weight.dim() == 2 and groups != 1:
        raise ValueError(f"sparsify: argument 'groups' must be a positive int dividing out_channels (1 for a 2-D "
                         f"weight), got {groups!r} for weight of size {list(weight.shape)}")
    weight = weight.detach()
    if weight.dim() == 2:
        sparse = _compress(weight, block_k)
        if transpose:
            sparse.transposed = _compress(weight.t(), block_k)
        return sparse
    cout, cin_g, KH, KW = weight.shape
    kernel = (KH, KW, groups)
    sparse = _compress(weight.reshape(cout, -1), block_k, kernel)
    if transpose:  # per group [Cin / groups, Cout / groups * KH * KW], columns (output channel, kh, kw)
        t = weight.reshape(groups, cout // groups, cin_g, KH * KW).permute(0, 2, 1, 3)
        sparse.transposed = _compress(t.reshape(groups * cin_g, cout // groups * KH * KW), block_k, kernel)
    return sparse


# --- 2. Kernel ----------------------------------------------------------------------------------------

@triton.jit
def sparse_kernel(x_ptr, val_ptr, off_ptr, chunk_ptr, bias_ptr, y_ptr,
                   M, N, chunks, stride_t, H, W, OW, m_tiles,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
                   CONV: tl.constexpr = False, KH: tl.constexpr = 1, KW: tl.constexpr = 1,
                   ROWS_G: tl.constexpr = 1, CH_G: tl.constexpr = 1, C_X: tl.constexpr = 1,
                   STRIDE_H: tl.constexpr = 1, STRIDE_W: tl.constexpr = 1, PAD_H: tl.constexpr = 0,
                   PAD_W: tl.constexpr = 0, DIL_H: tl.constexpr = 1, DIL_W: tl.constexpr = 1,
                   TRANSPOSED: tl.constexpr = False):
    """y = (the weight's N rows, in chunked CSR) applied to BLOCK_M tokens at a time (+ bias); fp32 sums.
    Grid (N tiles, images * m_tiles, splits). A program takes BLOCK_N rows x BLOCK_C chunk slots (split s:
    chunks [s * BLOCK_C, (s + 1) * BLOCK_C)): all BLOCK_N * BLOCK_C runs at once, BLOCK_P entries of each
    per step, so the loads of a step are independent (one dependent chain: run pointers -> entries -> x).
    acc [BLOCK_N, BLOCK_C, BLOCK_P, BLOCK_M] is summed over runs and entries once at the end.
    - linear (CONV False): tokens are x's rows, read through x's transpose xt [K, M] (row stride stride_t,
      unit column stride: the tokens of one entry's column are one contiguous read); y [M, N] contiguous.
    - conv (CONV): tokens are the M = OH * OW output pixels of an image (x NCHW contiguous [images, C_X, H,
      W]); column k of row r is input channel (r // ROWS_G) * CH_G + k // (KH * KW) at tap (k // KW % KH,
      k % KW), read where conv2d's `conv_tap` says (TRANSPOSED: the input gradient, x being the output's
      gradient); y [images, N, M] contiguous (NCHW).
    With SPLIT, y is fp32 partial sums [splits, ...] (the bias is left to their sum)."""
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    image = tl.program_id(1) // m_tiles
    offs_m = (tl.program_id(1) % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    offs_c = split * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_p = tl.arange(0, BLOCK_P)
    n_ok, m_ok = offs_n < N, offs_m < M
    run = chunk_ptr + offs_n[:, None] * chunks + offs_c[None, :]  # run (n, c): entries [run[0], run[1])
    run_ok = n_ok[:, None] & (offs_c < chunks)[None, :]
    start = tl.load(run, mask=run_ok, other=0).to(tl.int64)
    count = (tl.load(run + 1, mask=run_ok, other=0) - start).to(tl.int32)
    if CONV:
        oh = (offs_m // OW)[None, None, None, :]
        ow = (offs_m % OW)[None, None, None, :]
        x_img = x_ptr + image.to(tl.int64) * C_X * H * W
        group_ch = (offs_n // ROWS_G * CH_G)[:, None, None]
    else:
        xt_cols = x_ptr + (offs_c * BLOCK_K).to(tl.int64)[None, :, None, None] * stride_t \
            + offs_m[None, None, None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_C, BLOCK_P, BLOCK_M), dtype=tl.float32)
    for p in range(0, tl.max(tl.max(count, axis=1), axis=0), BLOCK_P):
        ok = (p + offs_p)[None, None, :] < count[:, :, None]
        entry = start[:, :, None] + (p + offs_p)[None, None, :]
        w = tl.load(val_ptr + entry, mask=ok, other=0.0).to(tl.float32)
        off = tl.load(off_ptr + entry, mask=ok, other=0)
        if CONV:
            col = offs_c[None, :, None] * BLOCK_K + off.to(tl.int32)
            tap = col % (KH * KW)
            ih, h_ok = conv_tap(oh, (tap // KW)[:, :, :, None], H, STRIDE_H, PAD_H, DIL_H, TRANSPOSED)
            iw, w_ok = conv_tap(ow, (tap % KW)[:, :, :, None], W, STRIDE_W, PAD_W, DIL_W, TRANSPOSED)
            ch = (group_ch + col // (KH * KW)).to(tl.int64)
            x_at = x_img + ch[:, :, :, None] * H * W + ih * W + iw
            x_ok = ok[:, :, :, None] & m_ok[None, None, None, :] & h_ok & w_ok
        else:
            x_at = xt_cols + off.to(tl.int64)[:, :, :, None] * stride_t
            x_ok = ok[:, :, :, None] & m_ok[None, None, None, :]
        acc += tl.load(x_at, mask=x_ok, other=0.0).to(tl.float32) * w[:, :, :, None]
    acc = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N, BLOCK_M]
    if CONV:
        out = image.to(tl.int64) * N * M + offs_n[:, None] * M + offs_m[None, :]
        total = tl.num_programs(1) // m_tiles * N * M
    else:
        out = offs_m[None, :] * N + offs_n[:, None]
        total = M * N
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(y_ptr + split.to(tl.int64) * total + out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scatter_kernel(val_ptr, off_ptr, chunk_ptr, w_ptr, N, K, chunks,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """w[n, chunk * BLOCK_K + offset] = value for the entries of BLOCK_N rows in one chunk; w [N, K]
    contiguous (zeroed before); grid (N tiles, chunks)."""
    offs_n = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    n_ok = offs_n < N
    start = tl.load(chunk_ptr + offs_n * chunks + c, mask=n_ok, other=0).to(tl.int64)
    count = (tl.load(chunk_ptr + offs_n * chunks + c + 1, mask=n_ok, other=0) - start).to(tl.int32)
    for p in range(0, tl.max(count, axis=0), BLOCK_P):
        ok = (p + offs_p)[None, :] < count[:, None]
        entry = start[:, None] + (p + offs_p)[None, :]
        col = c * BLOCK_K + tl.load(off_ptr + entry, mask=ok, other=0).to(tl.int64)
        tl.store(w_ptr + offs_n[:, None] * K + col, tl.load(val_ptr + entry, mask=ok), mask=ok)


# --- 3. Launcher --------------------------------------------------------------------------------------

# Candidates by token count (BLOCK_N, BLOCK_C, BLOCK_P, warps), from sweeps on the H200 (docs/perf-notes.md);
# the first is the default when not tuning. BLOCK_M = min(16, M rounded up to a power of two); BLOCK_C is cut
# to the chunk count rounded up to a power of two, and K is split over programs (fp32 partials summed by a
# second kernel) only beyond BLOCK_C chunks. Short steps (BLOCK_P 2-8 entries of each run) over many runs
# won; with several tokens, one or two rows a program on one or two warps (more programs a wave: the kernel
# waits on its gathers, ncu). DENSE (many tokens): the weight expanded
# into a temporary dense [N, K] (one scatter kernel) for dropin's tensor-core product; the default where
# M * density >= 2.
def _cfg(n, c, p, warps):
    return dict(BLOCK_N=n, BLOCK_C=c, BLOCK_P=p, num_warps=warps)


_CONFIGS = {
    "one": [_cfg(4, 64, 8, 4), _cfg(1, 16, 8, 1), _cfg(8, 32, 8, 8), _cfg(8, 64, 8, 4), _cfg(4, 16, 32, 4)],
    "few": [_cfg(1, 16, 2, 1), _cfg(1, 16, 4, 1), _cfg(2, 16, 2, 1), _cfg(2, 16, 2, 2), _cfg(8, 32, 4, 4),
            _cfg(4, 64, 2, 4)],
}
_CONFIGS["many"] = _CONFIGS["few"] + [dict(DENSE=True)]
MAX_M_TILES = 65535  # the grid's second dimension; more tokens take the dense path


def _densify(values, offsets, chunk_ptr, N: int, K: int, block_k: int, traced: bool = False) -> torch.Tensor:
    """The dense weight [N, K] of a chunked CSR (zeros, then one scatter of the entries)."""
    dense = torch.zeros((N, K), device=values.device, dtype=values.dtype)
    chunks = _runtime.cdiv(K, block_k)
    if N * chunks:
        launch(_scatter_kernel, (_runtime.cdiv(N, 32), chunks), values, offsets, chunk_ptr, dense, N, K, chunks,
               BLOCK_K=block_k, BLOCK_N=32, BLOCK_P=32, traced=traced)
    return dense


_plans: dict = {}


def _sparse_linear_impl(x, values, offsets, chunk_ptr, bias: Optional[torch.Tensor], N: int, block_k: int,
                        traced: bool = False):
    """x [M, K] (any strides), the weight's chunked CSR (values, offsets, chunk_ptr of N rows), bias [N]
    (contiguous) or None -> y [M, N] contiguous in x's dtype. traced: under torch.compile (`_dispatch`)."""
    M, K = x.shape
    if M * N == 0:
        return x.new_empty((M, N))
    return _sparse_linear_plan(x, values, offsets, chunk_ptr, bias, N, block_k, traced)(x, values, offsets, chunk_ptr,
                                                                                        bias)


def _sparse_linear_plan(x, values, offsets, chunk_ptr, bias, N: int, block_k: int, traced: bool = False):
    """run(x, values, offsets, chunk_ptr, bias) -> y: the product's plan for this signature, made once and reused (a
    one-token product takes a few us of GPU time, as much as a call's CPU time)."""
    key = None if traced else (
        x.shape, x.stride(), x.dtype, x.device, values.numel(), chunk_ptr.dtype, N, block_k, x.data_ptr() & 15,
        values.data_ptr() & 15, offsets.data_ptr() & 15, chunk_ptr.data_ptr() & 15,
        None if bias is None else bias.data_ptr() & 15)
    return plan(_plans, key, lambda: _make_plan(x, values, offsets, chunk_ptr, bias, N, block_k, traced),
                traced=traced)


def _make_plan(x, values, offsets, chunk_ptr, bias, N: int, block_k: int, traced: bool = False):
    """Chooses the config for this signature (tuning on first use); returns run(x, values, offsets, chunk_ptr,
    bias) -> y."""
    M, K = x.shape
    chunks = _runtime.cdiv(K, block_k)
    block_m = min(16, _runtime.next_power_of_2(M))

    def runner(cfg):
        if cfg.get("DENSE"):
            return lambda x, values, offsets, chunk_ptr, bias: mm_impl(
                x.unsqueeze(0), _densify(values, offsets, chunk_ptr, N, K, block_k, traced).t().unsqueeze(0), bias,
                "none", False, traced=traced)[0][0]
        block_c = min(cfg["BLOCK_C"], _runtime.next_power_of_2(max(chunks, 1)))
        splits = max(1, _runtime.cdiv(chunks, block_c))
        # the kernel reads x through its transpose xt [K, M] with unit column stride: x itself when one token
        # or column-major, else a copy
        direct = M == 1 or x.stride(0) == 1
        stride_t = x.stride(1) if direct else M
        m_tiles = _runtime.cdiv(M, block_m)
        grid = (_runtime.cdiv(N, cfg["BLOCK_N"]), m_tiles, splits)
        scalars = (M, N, chunks, stride_t, 1, 1, 1, m_tiles)
        meta = dict(cfg, BLOCK_C=block_c, HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_K=block_k,
                    BLOCK_M=block_m)
        product = Launch(sparse_kernel, grid, meta, traced=traced)
        sum_meta = dict(SPLITS=splits, HAS_BIAS=bias is not None, ACT="none", STORE_Z=False, BLOCK_R=32, BLOCK_N=64)
        split_sum = Launch(split_sum_kernel, (_runtime.cdiv(M, 32), _runtime.cdiv(N, 64)), sum_meta, traced=traced)

        def run(x, values, offsets, chunk_ptr, bias):
            xt = x if direct else x.t().contiguous()
            y = x.new_empty((M, N))
            bias = absent(y, traced) if bias is None else bias
            if splits == 1:
                product(xt, values, offsets, chunk_ptr, bias, y, *scalars)
                return y
            partial = torch.empty((splits, M, N), device=x.device, dtype=torch.float32)
            product(xt, values, offsets, chunk_ptr, bias, partial, *scalars)
            split_sum(partial, y, bias, absent(y, traced), M, N)
            return y
        return run

    tokens = "one" if M == 1 else "few" if M <= 16 else "many"
    nnz = values.numel()
    configs = _CONFIGS[tokens]
    if _runtime.cdiv(M, block_m) > MAX_M_TILES:
        configs = configs[-1:]
    elif tokens == "many" and M * nnz >= 2 * max(1, N * K) and not _runtime.INTERPRET:
        # M * density >= 2: the dense product is predicted faster (docs/perf-notes.md); not under the
        # interpreter, where speed is moot and tl.dot on bfloat16 is wrong
        configs = configs[-1:] + configs[:-1]
    density = _runtime.size_hint(nnz) / max(1, _runtime.size_hint(N * K))  # (a tuning key only)
    key = (x.dtype, block_k, tokens, *map(_autotune.bucket, (M, N, K)), round(math.log2(max(density, 1e-3))))

    def prepare(cfg):  # a launch to time: built once, so it is timed on its fast path
        run = runner(cfg)
        return lambda: run(x, values, offsets, chunk_ptr, bias)

    return runner(_autotune.pick("sparse_linear", key, configs, prepare))


# --- 4. Registration as a torch op (what torch.compile traces: `_dispatch`) ----------------------------

@torch_op("dropin::sparse_linear", mutates_args=())
def _sparse_linear_op(x: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, chunk_ptr: torch.Tensor,
                      bias: Optional[torch.Tensor], N: int, block_k: int) -> torch.Tensor:
    return _sparse_linear_impl(x, values, offsets, chunk_ptr, bias, N, block_k, traced=True)


_sparse_linear = switch(_sparse_linear_op, _sparse_linear_impl)


# --- 5. Autograd ----------------------------------------------------------------------------------------

class _SparseLinearFunction(torch.autograd.Function):
    """Differentiable in x and bias; the compressed weight is frozen. W^T's tensors come along (t_*) so the
    backward needs no Python object."""

    @staticmethod
    def forward(ctx, x, values, offsets, chunk_ptr, t_values, t_offsets, t_ptr, bias, N, block_k):
        ctx.save_for_backward(t_values, t_offsets, t_ptr)
        ctx.K, ctx.block_k = x.shape[1], block_k
        return _sparse_linear(x, values, offsets, chunk_ptr, bias, N, block_k)

    @staticmethod
    def backward(ctx, dy):
        t_values, t_offsets, t_ptr = ctx.saved_tensors
        need_x, need_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[7]
        dx = _sparse_linear(dy, t_values, t_offsets, t_ptr, None, ctx.K, ctx.block_k) if need_x else None
        dbias = dy.sum(0, dtype=torch.float32).to(dy.dtype) if need_bias else None
        return dx, None, None, None, None, None, None, dbias, None, None


# --- 6. Public function ---------------------------------------------------------------------------------

def check_sparse_operands(op: str, x, weight, bias, x_name: str, conv: bool) -> None:
    """The checks that sparse_linear and sparse_conv2d share: a consistent SparseWeight of the right kind,
    one device, one float dtype."""
    if not isinstance(weight, SparseWeight):
        raise TypeError(f"{op}: argument 'weight' must be a SparseWeight (from dropin.ops.sparsify), "
                        f"got {type(weight).__name__}")
    if not weight.consistent():
        raise ValueError(f"{op}: argument 'weight' {weight.shape} has tensors that do not fit its shape "
                         f"(see SparseWeight.consistent); build it with dropin.ops.sparsify")
    if (weight.kernel is not None) != conv:
        kind = "a 2-D [out_features, in_features]" if conv else "a conv2d"
        raise ValueError(f"{op}: argument 'weight' is {kind} weight; use "
                         f"{'sparse_linear' if conv else 'sparse_conv2d'}")
    _runtime.check_kernel_device(op, **{x_name: x}, weight=weight.values, bias=bias)
    for name, t in ((x_name, x), ("bias", bias)):
        if t is not None and t.dtype not in FLOAT_DTYPES:
            raise RuntimeError(f"{op}: argument '{name}' has dtype {t.dtype}; dropin supports {FLOAT_DTYPES}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise RuntimeError(f"{op}: expected '{x_name}' and '{name}' to have the same dtype, "
                               f"but got {x.dtype} and {t.dtype}")


def find_shortcut(shortcuts: Shortcuts, x, weight, bias, args: tuple = ()):
    """`shortcuts.find` for a call of sparse_linear or sparse_conv2d: (key, shortcut, tensors), shortcut(*tensors)
    the call: tensors are (x, values, offsets, chunk_ptr, bias) and, where autograd records the call, W^T's
    (values, offsets, chunk_ptr), the weight's own where it has no `transposed` (`SparseShortcut` saves them).
    The key holds the weight's tensors and its format (shape, block_k, kernel): another weight of that format is
    read the same way, through its own tensors. Not for a weight that is no SparseWeight, or one inconsistent now
    (the op's checks say why)."""
    if not isinstance(weight, SparseWeight):
        return None, None, None
    tensors = (x, weight.values, weight.offsets, weight.chunk_ptr, bias)
    if torch.is_grad_enabled() and (getattr(x, "requires_grad", False) or getattr(bias, "requires_grad", False)):
        t = weight.transposed or weight
        tensors += (t.values, t.offsets, t.chunk_ptr)
    key, shortcut = shortcuts.find(tensors, (weight.shape, weight.block_k, weight.kernel, *args))
    if shortcut is not None and not weight.consistent():
        return None, None, None
    return key, shortcut, tensors


class SparseShortcut(Differentiable):
    """sparse_linear's and sparse_conv2d's later eager calls of a signature where autograd records them
    (`Differentiable`), of `find_shortcut`'s tensors: the forward runs the op's shortcut without autograd,
    forward_run(x, values, offsets, chunk_ptr, bias), and saves W^T's tensors, as the op's Function does; the
    backward takes dy viewed as `grad_shape` (None: as it comes), x's gradient through the run that
    backward_run(dy, *W^T's tensors) plans for dy's layout, run(dy, *W^T's tensors), and the bias's as dy summed
    over `bias_dims` in fp32."""

    def __init__(self, forward_run, backward_run, grad_shape, bias_dims, needs):
        super().__init__()
        self.forward_run, self.backward_run, self.grad_shape, self.bias_dims = \
            forward_run, backward_run, grad_shape, bias_dims
        self.need_x, self.need_bias = needs[0], needs[4]

    def forward(self, ctx, x, values, offsets, chunk_ptr, bias, t_values, t_offsets, t_ptr):
        ctx.save_for_backward(t_values, t_offsets, t_ptr)
        return self.forward_run(x, values, offsets, chunk_ptr, bias)

    def backward(self, ctx, dy):
        if self.grad_shape is not None:
            dy = dy.reshape(self.grad_shape)
        dx = None
        if self.need_x:
            transposed = ctx.saved_tensors
            dx = self.backward_plan((dy,), lambda: self.backward_run(dy, *transposed))(dy, *transposed)
        dbias = dy.sum(self.bias_dims, dtype=torch.float32).to(dy.dtype) if self.need_bias else None
        return dx, None, None, None, dbias, None, None, None


def _check(x, weight, bias) -> None:
    check_sparse_operands("sparse_linear", x, weight, bias, "x", conv=False)
    if x.dim() == 0:
        raise RuntimeError("sparse_linear: argument 'x' must be at least 1-D, got 0-D")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise RuntimeError(f"sparse_linear: 'x' {tuple(x.shape)} and 'weight' {weight.shape} cannot be "
                           f"multiplied (in_features {x.shape[-1]} and {K})")
    if bias is not None and tuple(bias.shape) != (N,):
        raise RuntimeError(f"sparse_linear: argument 'bias' must have shape ({N},) (out_features), "
                           f"got {tuple(bias.shape)}")


_shortcuts = Shortcuts(differentiable=True)


def sparse_linear(x: torch.Tensor, weight: SparseWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight.to_dense(), bias)` reading only the weight's non-zeros.

    x [..., K] (any strides), weight a SparseWeight of shape [N, K] from `sparsify`, bias [N] or None; all
    float32 / float16 / bfloat16 of one dtype (under torch.autocast all are cast to its dtype, as for
    F.linear); fp32 accumulation; the output [..., N] in x's dtype.
    Differentiable in x (needs `sparsify(..., transpose=True)`, the default) and bias; the weight is frozen.
    Non-finite x: the sparse kernels skip the zeros, so an inf or NaN in x reaches only the outputs whose rows
    have a non-zero in its column; the dense path for many tokens multiplies them, as F.linear does (0 * inf =
    NaN in every output). Finite x gives the same results either way."""
    key, shortcut, tensors = find_shortcut(_shortcuts, x, weight, bias)
    if shortcut is not None:
        return shortcut(*tensors)
    _check(x, weight, bias)
    if torch.is_autocast_enabled(x.device.type):  # as torch.autocast casts F.linear's operands
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    N, K = weight.shape
    x2 = x.reshape(math.prod(x.shape[:-1]), K)
    b = None if bias is None else bias.contiguous()  # the kernels read bias with unit stride
    t = weight.transposed
    if torch.is_grad_enabled() and (x.requires_grad or bias is not None and bias.requires_grad):
        if t is None and x.requires_grad:
            raise RuntimeError("sparse_linear: the gradient of 'x' needs W^T in 'weight': build it with "
                               "sparsify(weight, transpose=True)")
        t = t or weight  # (only the bias gradient is wanted: W^T is never read)
        y = _SparseLinearFunction.apply(x2, weight.values, weight.offsets, weight.chunk_ptr, t.values, t.offsets,
                                        t.chunk_ptr, b, N, weight.block_k)
        out = y.view(*x.shape[:-1], N)
        _shortcuts.keep(key, lambda: _sparse_linear_grad_shortcut(x, x2, weight, bias, b, out, key[0]), grad=True)
        return out
    y = _sparse_linear(x2, weight.values, weight.offsets, weight.chunk_ptr, b, N, weight.block_k)
    out = y.view(*x.shape[:-1], N)
    _shortcuts.keep(key, lambda: _sparse_linear_shortcut(x, x2, weight, bias, b, out))
    return out


def _sparse_linear_shortcut(x, x2, weight, bias, b, out):
    """sparse_linear's later eager calls of this signature (`Shortcuts`): (x, values, offsets, chunk_ptr, bias) ->
    out, the product's plan run on x as [M, K] and the call's own weight tensors and bias; None where a copy made an
    operand (x's leading dims do not collapse, a strided bias) or there is no work."""
    if out.numel() == 0 or x2.data_ptr() != x.data_ptr() or bias is not None and b.data_ptr() != bias.data_ptr():
        return None
    run = _sparse_linear_plan(x2, weight.values, weight.offsets, weight.chunk_ptr, b, weight.shape[0], weight.block_k)
    if x.dim() == 2:
        return run
    rows, shape = x2.shape, out.shape
    return lambda x, values, offsets, chunk_ptr, bias: run(x.view(rows), values, offsets, chunk_ptr, bias).view(shape)


def _sparse_linear_grad_shortcut(x, x2, weight, bias, b, out, needs):
    """sparse_linear's later eager calls of this signature where autograd records them (`SparseShortcut`): x's
    gradient the product of dy [M, N] and W^T, as x's shape; None where the call keeps no shortcut without
    autograd, or x is empty."""
    forward_run = _sparse_linear_shortcut(x, x2, weight, bias, b, out)
    if forward_run is None or x.numel() == 0:
        return None
    K, block_k, x_shape = x2.shape[1], weight.block_k, x.shape

    def backward_run(dy, t_values, t_offsets, t_ptr):
        run = _sparse_linear_plan(dy, t_values, t_offsets, t_ptr, None, K, block_k)
        if len(x_shape) == 2:
            return lambda dy, *transposed: run(dy, *transposed, None)
        return lambda dy, *transposed: run(dy, *transposed, None).view(x_shape)
    grad_shape = None if x.dim() == 2 else (x2.shape[0], out.shape[-1])  # (dy [M, N] as the Function's)
    return SparseShortcut(forward_run, backward_run, grad_shape, 0, needs)
