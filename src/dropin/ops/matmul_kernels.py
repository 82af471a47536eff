"""The matrix products' Triton kernels (dropin.ops.matmul launches them): the pointer kernels `mm_kernel` and
`skinny_kernel` (few rows), the CUDA-core `fma_kernel`, Hopper's persistent TMA kernel `mm_tma_kernel`, the
split-K sum (sparse's too) and the activation / bias gradient. Their tile helpers (and the tf32 operand copy)
are `_gemm`'s."""
import triton
import triton.language as tl

from ._gemm import ACC_K, dot_acc, dot_parts, split_range, tf32_split, tile_coords
from .activations import activation_grad, apply_activation


@triton.jit
def _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    return acc


@triton.jit
def _mm_range(acc, a_ptrs, b_ptrs, k_from, k_to, K, stride_ak, stride_bk, PRECISION: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """(acc + the products of K tiles [k_from, k_to), the pointers advanced past them)."""
    for k in range(k_from, k_to):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=tl.arange(0, BLOCK_K)[:, None] < k_left, other=0.0)
        acc = dot_acc(acc, a, b, PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc, a_ptrs, b_ptrs


@triton.jit
def _tile_start(pid_m, pid_n, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(batch, split, first and last K tiles, offs_m, offs_n, offs_k) of the pointer kernels' program at tile (pid_m,
    pid_n); grid (tiles, batch, splits of K)."""
    batch = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    k_first, k_last = split_range(split, tl.num_programs(2), tl.cdiv(K, BLOCK_K))
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return batch, split, k_first, k_last, offs_m, offs_n, k_first * BLOCK_K + tl.arange(0, BLOCK_K)


@triton.jit
def mm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,
               M, N, K,
               stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
               HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr, PRECISION: tl.constexpr,
               SHARES: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               ACCUMULATE: tl.constexpr = False):
    """One output tile per program; grid (tiles, batch, splits of K). C and Z are contiguous [batch, M, N];
    with several splits, split s writes its fp32 partial product to C[s] of a [splits, batch, M, N] C.
    SHARES: a split's reduction is longer than ACC_K (`shares`). ACCUMULATE: C's tile is added to what C held
    (`_store_tile`)."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    batch, split, k_first, k_last, offs_m, offs_n, offs_k = _tile_start(pid_m, pid_n, K, BLOCK_M, BLOCK_N, BLOCK_K)
    # Rows and columns past the edge wrap onto valid ones, so only K needs a load mask; stores are masked.
    a_ptrs = (a_ptr + batch * stride_ab + (offs_m % M).to(tl.int64)[:, None] * stride_am
              + offs_k[None, :] * stride_ak)
    b_ptrs = (b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk
              + (offs_n % N).to(tl.int64)[None, :] * stride_bn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SHARES:  # a reduction past ACC_K: each ACC_K-long share in a fresh accumulator, added on the CUDA cores
        for k_share in range(k_first, k_last, ACC_K // BLOCK_K):
            part, a_ptrs, b_ptrs = _mm_range(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, b_ptrs,
                                             k_share, tl.minimum(k_share + ACC_K // BLOCK_K, k_last), K, stride_ak,
                                             stride_bk, PRECISION, BLOCK_K)
            acc += part
    else:
        acc, a_ptrs, b_ptrs = _mm_range(acc, a_ptrs, b_ptrs, k_first, k_last, K, stride_ak, stride_bk, PRECISION,
                                        BLOCK_K)
    _store_tile(acc, c_ptr, bias_ptr, z_ptr, offs_m, offs_n, batch, split, M, N, HAS_BIAS, ACT, STORE_Z, ACCUMULATE)


@triton.jit
def skinny_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,
                  M, N, K,
                  stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                  HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ACCUMULATE: tl.constexpr = False):
    """mm_kernel's product, grid and C layout for few rows (decoding's M = 1..16): the tile is computed as
    (B^T A^T)'s [BLOCK_N, BLOCK_M], so that B's columns fill the MMA's 64-row side and A's few rows its narrow
    16-column one (as [BLOCK_M, BLOCK_N] the 64-row side would be mostly padding); with a K split over the
    grid's third axis this keeps enough of B's bytes in flight to stream it at the memory's speed."""
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    batch, split, k_first, k_last, offs_m, offs_n, offs_k = _tile_start(pid_m, pid_n, K, BLOCK_M, BLOCK_N, BLOCK_K)
    bt_ptrs = (b_ptr + batch * stride_bb + (offs_n % N).to(tl.int64)[:, None] * stride_bn
               + offs_k[None, :] * stride_bk)
    at_ptrs = (a_ptr + batch * stride_ab + offs_k[:, None] * stride_ak
               + (offs_m % M).to(tl.int64)[None, :] * stride_am)
    acc = _mm_range(tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), bt_ptrs, at_ptrs, k_first, k_last, K, stride_bk,
                    stride_ak, PRECISION, BLOCK_K)[0]  # (B^T's tiles as the left operand)
    _store_tile(tl.trans(acc), c_ptr, bias_ptr, z_ptr, offs_m, offs_n, batch, split, M, N, HAS_BIAS, ACT, STORE_Z,
                ACCUMULATE)


@triton.jit
def _store_tile(acc, c_ptr, bias_ptr, z_ptr, offs_m, offs_n, batch, split, M, N,
                HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr, ACCUMULATE: tl.constexpr):
    """The pointer kernels' epilogue: act(acc + bias) into C's tile (and Z's) of batch `batch`, or, with a K
    split, the plain partial product into split `split`'s [batch, M, N] of C. ACCUMULATE: C's old tile plus that
    (`_with_old`)."""
    acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
    offs_c = (split * tl.num_programs(1) + batch) * M * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if STORE_Z:
        tl.store(z_ptr + offs_c, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + offs_c, _with_old(apply_activation(acc, ACT), c_ptr + offs_c, mask, ACCUMULATE), mask=mask)


@triton.jit
def _with_old(c, c_ptrs, mask, ACCUMULATE: tl.constexpr):
    """The tile to store at c_ptrs, in C's dtype: c (fp32), plus what C holds there where ACCUMULATE (a sum of
    products over several calls, each rounded to C's dtype once, as torch's addmm_ on C)."""
    if ACCUMULATE:
        c += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    return c.to(c_ptrs.dtype.element_ty)


@triton.jit
def fma_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,
                M, N, K,
                stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """Products with M == 1 (BLOCK_M = 1) or few columns (N <= 16, e.g. seed 004's 784 -> 10 layer) on the
    CUDA cores in fp32: a tensor-core tile would be mostly padding, and its latency chain dominates; here A
    streams through once in coalesced [BLOCK_M, BLOCK_K] rows, and each K chunk's sum is added to the
    accumulator on its own (a two-level sum, as dot_acc). C contiguous [batch, M, N]; grid (tiles, batch)."""
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
            acc = dot_acc(acc, a, b, "ieee")  # Triton 3.6 rewrites that into a tf32 dot, 7.7e-4 off.)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
    offs_c = (batch * M + offs_m)[:, None] * N + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if STORE_Z:
        tl.store(z_ptr + offs_c, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + offs_c, _with_old(apply_activation(acc, ACT), c_ptr + offs_c, mask, ACCUMULATE), mask=mask)


@triton.jit
def split_sum_kernel(w_ptr, c_ptr, bias_ptr, z_ptr, R, N,
                      SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    """C = act(sum_s W[s] + bias) (ACCUMULATE: C plus that) over [R, N] rows: the epilogue of a product split
    along K."""
    offs_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = offs_r[:, None] * N + offs_n[None, :]
    mask = (offs_r[:, None] < R) & (offs_n[None, :] < N)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(w_ptr + s * R * N + offs, mask=mask, other=0.0)
    acc = _add_bias(acc, bias_ptr, offs_n, N, HAS_BIAS)
    if STORE_Z:
        tl.store(z_ptr + offs, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + offs, _with_old(apply_activation(acc, ACT), c_ptr + offs, mask, ACCUMULATE), mask=mask)


@triton.jit
def _tma_tile(desc, batch, off_x, off_k, T: tl.constexpr, LEFT: tl.constexpr, BLOCK_X: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """One operand tile of mm_tma_kernel as the product reads it: A's [BLOCK_X, BLOCK_K] (LEFT) or B's [BLOCK_K,
    BLOCK_X], from its descriptor over [batch, rows, cols] (T: A stored K-major-outer, B stored K innermost)."""
    if LEFT == T:  # (A_T or B not transposed: the descriptor's rows are K)
        tile = desc.load([batch, off_k, off_x]).reshape(BLOCK_K, BLOCK_X)
        if LEFT:
            tile = tile.T
    else:
        tile = desc.load([batch, off_x, off_k]).reshape(BLOCK_X, BLOCK_K)
        if not LEFT:
            tile = tile.T
    return tile  # (one return: Triton also compiles the statements after a constexpr branch's return)


@triton.jit
def mm_tma_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, z_ptr,
                   M, N, K, BATCH,
                   stride_ab, stride_a, stride_bb, stride_b,
                   A_T: tl.constexpr, B_T: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, C_PTR: tl.constexpr = False,
                   EPILOGUE_SUBTILE: tl.constexpr = False, CORRECTION_CHAIN: tl.constexpr = False,
                   ACCUMULATE: tl.constexpr = False, SPLIT_K: tl.constexpr = 1):
    """Persistent: NUM_PROGRAMS programs (a multiple of the SM count) walk the [batch, m, n] tiles.
    A is stored [BATCH, M, K] (A_T: [BATCH, K, M]) with unit inner stride and outer stride `stride_a`;
    likewise B [BATCH, K, N] (B_T: [BATCH, N, K]). C (and Z) contiguous [BATCH, M, N], stored through
    descriptors, or with C_PTR (rows of N elements not 16-byte aligned, which a descriptor cannot take) through
    masked pointer stores (EPILOGUE_SUBTILE: a descriptor's tile stored as two halves, `_desc_store`).
    PRECISION "tf32x3_split": A and B hold the hi parts of fp32 operands split into two tf32 numbers
    (`_gemm.operand_copy_kernel`'s SPLIT; A's of -A), their lo parts BATCH batches further, loaded as they lie (no
    split in registers); "tf32x3_split_b": B's alone, A's tiles split in registers (the MMAs read A from there);
    each K tile's product is subtracted from the sum (a two-level sum, as `_gemm.dot_acc`'s).
    It is tf32x3's (`_gemm.dot_parts`); with CORRECTION_CHAIN only hi @ hi, the two correction products (under
    2^-11 of it, whose chain's truncations do not matter) accumulating over all of K in one chain of their own,
    added at the end: the PTX waits for MMA results twice a K tile, the last product's left in flight into the next
    tile, where dot_parts's waits three times (benchmarks/probes/compile_sm90.py).
    ACCUMULATE: C's tile is added to what C held (loaded through pointers: `_with_old`).
    SPLIT_K > 1 (a product of fewer tiles than programs, or whose K one accumulator would not take: ACC_K): the
    programs walk (split, batch, m, n) items, split s summing K tiles [s, s + 1) * cdiv(K tiles, SPLIT_K) of its
    tile into C [SPLIT_K * BATCH, M, N] at batch s * BATCH + batch: fp32 partials that `split_sum_kernel` adds
    (with bias, activation and accumulation: the launcher gives none here). A split past the last K tile stores
    zeros."""
    SPLIT_B: tl.constexpr = PRECISION == "tf32x3_split" or PRECISION == "tf32x3_split_b"
    PARTS_A: tl.constexpr = 2 if PRECISION == "tf32x3_split" else 1
    PARTS_B: tl.constexpr = 2 if SPLIT_B else 1
    if A_T:
        a_desc = tl.make_tensor_descriptor(a_ptr, [PARTS_A * BATCH, K, M], [stride_ab, stride_a, 1],
                                           [1, BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, [PARTS_A * BATCH, M, K], [stride_ab, stride_a, 1],
                                           [1, BLOCK_M, BLOCK_K])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b_ptr, [PARTS_B * BATCH, N, K], [stride_bb, stride_b, 1],
                                           [1, BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [PARTS_B * BATCH, K, N], [stride_bb, stride_b, 1],
                                           [1, BLOCK_K, BLOCK_N])
    if not C_PTR:
        STORE_N: tl.constexpr = BLOCK_N // 2 if EPILOGUE_SUBTILE else BLOCK_N
        c_desc = tl.make_tensor_descriptor(c_ptr, [SPLIT_K * BATCH, M, N], [M * N, N, 1], [1, BLOCK_M, STORE_N])
        if STORE_Z:
            z_desc = tl.make_tensor_descriptor(z_ptr, [SPLIT_K * BATCH, M, N], [M * N, N, 1],
                                               [1, BLOCK_M, STORE_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue recomputes its tile from a counter of its own, which keeps it out of the load pipeline (an
    # item's C batch, split * BATCH + batch, is item // tiles for splits too).
    tile_c = tl.program_id(0) - NUM_PROGRAMS
    for item in tl.range(tl.program_id(0), SPLIT_K * BATCH * tiles, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        if SPLIT_K == 1:
            tile = item
            k_first = 0
            k_last = k_tiles
        else:
            tile = item % (BATCH * tiles)
            k_first, k_last = split_range(item // (BATCH * tiles), SPLIT_K, k_tiles)
        batch = tile // tiles
        pid_m, pid_n = tile_coords(tile % tiles, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        correction = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_first, k_last):
            off_k = ki * BLOCK_K
            a = _tma_tile(a_desc, batch, off_m, off_k, A_T, True, BLOCK_M, BLOCK_K)
            b = _tma_tile(b_desc, batch, off_n, off_k, B_T, False, BLOCK_N, BLOCK_K)
            if SPLIT_B:
                if PRECISION == "tf32x3_split":
                    a_lo = _tma_tile(a_desc, batch + BATCH, off_m, off_k, A_T, True, BLOCK_M, BLOCK_K)
                else:
                    a, a_lo = tf32_split(-a)
                b_lo = _tma_tile(b_desc, batch + BATCH, off_n, off_k, B_T, False, BLOCK_N, BLOCK_K)
                if CORRECTION_CHAIN:
                    acc = acc - tl.dot(a, b, input_precision="tf32")
                    correction = tl.dot(a, b_lo, tl.dot(a_lo, b, correction, input_precision="tf32"),
                                        input_precision="tf32")
                else:
                    acc = acc - dot_parts(a, a_lo, b, b_lo)
            else:
                acc = dot_acc(acc, a, b, PRECISION)
        if CORRECTION_CHAIN:  # (non-finite where an operand is: the hi products have the answer, as in dot_parts)
            acc = acc - tl.where(tl.abs(correction) < float("inf"), correction, 0.0)
        tile_c += NUM_PROGRAMS
        batch_c = tile_c // tiles
        pid_m, pid_n = tile_coords(tile_c % tiles, num_pid_m, num_pid_n, GROUP_M)
        acc = _add_bias(acc, bias_ptr, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), N, HAS_BIAS)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs = batch_c.to(tl.int64) * M * N + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        c = _with_old(apply_activation(acc, ACT), c_ptr + offs, mask, ACCUMULATE)
        if C_PTR:
            if STORE_Z:
                tl.store(z_ptr + offs, acc.to(z_ptr.dtype.element_ty), mask=mask)
            tl.store(c_ptr + offs, c, mask=mask)
        else:
            if STORE_Z:
                _desc_store(z_desc, batch_c, pid_m * BLOCK_M, pid_n * BLOCK_N, acc.to(z_ptr.dtype.element_ty),
                            BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)
            _desc_store(c_desc, batch_c, pid_m * BLOCK_M, pid_n * BLOCK_N, c, BLOCK_M, BLOCK_N, EPILOGUE_SUBTILE)


@triton.jit
def _desc_store(desc, batch, off_m, off_n, tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                SUBTILE: tl.constexpr):
    """tile [BLOCK_M, BLOCK_N] into desc at (batch, off_m, off_n): whole, or with SUBTILE as two [BLOCK_M, BLOCK_N
    / 2] halves (desc's block shape), which take half the shared memory a whole tile's store takes (a pipeline
    stage more for the loads)."""
    if SUBTILE:
        left, right = tl.split(tile.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1))
        desc.store([batch, off_m, off_n], left.reshape(1, BLOCK_M, BLOCK_N // 2))
        desc.store([batch, off_m, off_n + BLOCK_N // 2], right.reshape(1, BLOCK_M, BLOCK_N // 2))
    else:
        desc.store([batch, off_m, off_n], tile.reshape(1, BLOCK_M, BLOCK_N))


@triton.jit
def act_grad_kernel(gy_ptr, z_ptr, gz_ptr, sum_ptr,
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
