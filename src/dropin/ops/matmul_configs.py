"""The candidate configs of the matrix products' kernels (`matmul_kernels`), which `matmul`'s plans offer the tuner:
block sizes, warps, stages and each kernel's own constexprs, the untimed default first."""
from .. import _runtime
from . import _autotune
from ._gemm import ACC_K, fits, split_counts

_cfg = _autotune.config
# Hopper TMA kernel, 16-bit and 32-bit operands: the largest tiles first (the default when not tuning).
# OCC: programs per SM (2 lets one program's epilogue overlap another's loads).
TMA_CONFIGS = {
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
# The TMA kernel for products of at most 16 columns (16 x 2^20 @ 2^20 x 16), whose columns the tiles above would
# fill with zeros (a 64 x 256 tile multiplies 16x the MMA work): 16 columns, long K tiles, A's rows past M never read.
TMA_NARROW_CONFIGS = {size: [_cfg(64, 16, block_k, 4, stages, WARP_SPECIALIZE=False) for block_k, stages in tiles]
                      for size, tiles in ((2, [(256, 4), (128, 6)]), (4, [(128, 4), (64, 6)]))}
# The TMA kernel on tf32-rounded copies ("tf32_rounded"), beside TMA_CONFIGS[4]: 128 x 256 tiles in 3 stages with
# C stored in halves (its fp32 tile whole would take 128 KB): 214 KB by compile_sm90.py, 246 KB where tiles are
# split or rounded in registers too.
TMA_ROUNDED_CONFIGS = [_cfg(128, 256, 32, 8, 3, WARP_SPECIALIZE=ws, EPILOGUE_SUBTILE=True) for ws in (False, True)]
# The TMA kernel on fp32 operands copied as two tf32 parts each ("tf32x3_split"): four tiles a K step, BLOCK_K at
# most max_k's 32, stages within the shared memory (benchmarks/probes/compile_sm90.py: 147-197 KB; 128 x 128 in 3
# stages takes 262); each with the correction products in one chain over K (CORRECTION_CHAIN, mm_tma_kernel) and
# without. The first is the untimed choice.
TMA_SPLIT_CONFIGS = [_cfg(*tile, WARP_SPECIALIZE=ws, CORRECTION_CHAIN=chain) for chain in (False, True)
                      for tile, ws in [((128, 64, 32, 4, 3), False), ((128, 128, 32, 8, 2), False),
                                       ((128, 128, 32, 8, 2), True), ((64, 128, 32, 4, 3), False),
                                       ((64, 64, 32, 4, 4), False)]]
# The largest TMA tile (BLOCK_M x BLOCK_N) that accumulates into C: its old tile, loaded and changed into the
# accumulator's layout through shared memory, takes 64-128 KB more, and 128 x 256 tiles then exceed sm_90's 227 KB
# (245,816 B at 16 bits, 294,944 in fp32 halves: benchmarks/probes/compile_sm90.py, Triton 3.8).
ACCUMULATE_MAX_TILE = 128 * 128
# Pointer kernel; SPLIT_K > 1 splits K over programs (skinny products that would leave SMs idle).
PTR_CONFIGS = {
    2: [_cfg(128, 128, 64, 8, 3), _cfg(128, 64, 64, 4, 4), _cfg(64, 64, 64, 4, 4), _cfg(128, 16, 64, 4, 4),
        _cfg(32, 64, 128, 4, 3), _cfg(16, 64, 256, 4, 3), _cfg(16, 32, 256, 4, 4), _cfg(16, 16, 256, 4, 2),
        _cfg(16, 64, 128, 4, 4, SPLIT_K=4), _cfg(16, 32, 256, 4, 3, SPLIT_K=4), _cfg(16, 64, 128, 4, 4, SPLIT_K=8)],
    4: [_cfg(128, 128, 32, 8, 3), _cfg(128, 128, 16, 8, 4), _cfg(128, 64, 32, 4, 4), _cfg(64, 128, 32, 4, 4),
        _cfg(64, 64, 32, 4, 4), _cfg(64, 64, 64, 4, 3), _cfg(32, 128, 32, 4, 4), _cfg(256, 16, 64, 8, 3),
        _cfg(128, 16, 64, 4, 4), _cfg(128, 16, 32, 4, 4), _cfg(64, 16, 32, 4, 4), _cfg(64, 16, 128, 4, 4),
        _cfg(32, 64, 64, 4, 3), _cfg(16, 64, 256, 4, 2), _cfg(16, 16, 256, 4, 2), _cfg(16, 64, 128, 4, 3, SPLIT_K=4),
        _cfg(16, 32, 128, 4, 3, SPLIT_K=8)],
}
# Bases of the deep K splits (`deep_split_configs`), each operand size: full tiles, few rows, few rows and
# columns (the smallest last: `_gemm.fits` keeps it where none fits).
DEEP_SPLIT_BASES = {2: [_cfg(128, 128, 64, 8, 3), _cfg(16, 64, 128, 4, 4), _cfg(16, 16, 256, 4, 3)],
                     4: [_cfg(128, 128, 32, 8, 3), _cfg(16, 64, 64, 4, 3), _cfg(16, 16, 32, 4, 3)]}
# The few-rows kernel, 16-bit operands, M <= 16 (decoding): B streams through 64-column tiles. The first config
# (untimed plans take it: torch.compile, capture) keeps four 32 KB tiles of B in flight per program, no K split: the
# fastest at M = 1 and 8, K = 4096 and 11008 on an H200 (perf-notes, "Decoding: the skinny products").
SKINNY_CONFIGS = [_cfg(16, 64, 256, 4, 5), _cfg(16, 64, 128, 4, 5, SPLIT_K=2), _cfg(16, 64, 128, 4, 3, SPLIT_K=4),
                   _cfg(16, 128, 128, 4, 3, SPLIT_K=4), _cfg(16, 64, 256, 4, 3, SPLIT_K=2),
                   _cfg(16, 64, 128, 4, 3, SPLIT_K=2), _cfg(16, 32, 128, 4, 3, SPLIT_K=2)]
# The CUDA-core kernel (any dtype): M == 1 (vector-matrix), and at most 16 columns (candidates beside `ptr`).
FMA_CONFIGS = {
    "vector": [_cfg(1, 64, 128, 4, 1), _cfg(1, 16, 256, 4, 1), _cfg(1, 32, 256, 4, 1), _cfg(1, 128, 64, 4, 1),
               _cfg(1, 256, 32, 8, 1)],
    "narrow": [_cfg(32, 16, 32, 4, 3), _cfg(64, 16, 16, 4, 3), _cfg(16, 16, 64, 4, 2), _cfg(128, 16, 16, 8, 3)],
}


def deep_split_configs(batch, M, N, K, size: int, max_k: int, device_index: int) -> list:
    """Pointer-kernel candidates for a product with fewer tiles than SMs and a long K (16 x 2^20 @ 2^20 x 16, 1024
    x 65536 @ 65536 x 1024): K split so that about two programs run per SM, each over at least 8 K tiles (none that
    the fixed configs hold); their fp32 partials (at most 64 MiB) summed by split_sum_kernel."""
    batch, M, N, K = (_runtime.size_hint(v) for v in (batch, M, N, K))
    sms, out = _runtime.num_sms(device_index), []
    if K < 1024:  # (`fits`' rule for K splits)
        return out
    for cfg in fits(DEEP_SPLIT_BASES[min(size, 4)], M, N, K, max_k):
        tiles = batch * _runtime.cdiv(M, cfg["BLOCK_M"]) * _runtime.cdiv(N, cfg["BLOCK_N"])
        split = dict(cfg, SPLIT_K=min(2 * sms // tiles, K // (8 * cfg["BLOCK_K"])))
        if split["SPLIT_K"] > 1 and split["SPLIT_K"] * batch * M * N * 4 <= 64 << 20 \
                and split not in PTR_CONFIGS[min(size, 4)]:
            out.append(dict(split, KERNEL="ptr"))
    return out


TMA_SPLIT_TILES = 3  # the TMA kernel's K splits are offered for its first this many fitting tiles


def tma_split_configs(batch, M, N, K, configs: list, device_index: int) -> list:
    """The TMA kernel's candidates for a product with fewer tiles than programs and a long K (1024 x 65536 @ 65536
    x 1024: 64 tiles of 128 x 128 on 132 SMs; 16 x 2^20 @ 2^20 x 16, whose K one accumulator would not take): for
    each of the first TMA_SPLIT_TILES of `configs` (its fitting ones), K split so that the (split, tile) items come
    to about one and about two a program, each split at least 8 K tiles and at most ACC_K long; their fp32 partials
    (at most 64 MiB) summed by split_sum_kernel."""
    batch, M, N, K = (_runtime.size_hint(v) for v in (batch, M, N, K))
    out = []
    if K < 1024:  # (`fits`' rule for K splits)
        return out
    for cfg in configs[:TMA_SPLIT_TILES]:
        tiles = batch * _runtime.cdiv(M, cfg["BLOCK_M"]) * _runtime.cdiv(N, cfg["BLOCK_N"])
        programs = cfg.get("OCC", 1) * _runtime.num_sms(device_index)
        k_tiles = _runtime.cdiv(K, cfg["BLOCK_K"])
        fewest = _runtime.cdiv(k_tiles, ACC_K.value // cfg["BLOCK_K"])  # (each split within one accumulator)
        if tiles >= programs and fewest == 1:
            continue
        out += [dict(cfg, SPLIT_K=splits, KERNEL="tma") for splits in split_counts(tiles, programs, k_tiles, 8, fewest)
                if splits * batch * M * N * 4 <= 64 << 20]
    return out


def skinny_configs(N, K) -> list:
    """The few-rows kernel's candidates (the first is the untimed choice)."""
    return [dict(cfg, KERNEL="skinny") for cfg in fits(SKINNY_CONFIGS, 16, N, K)]
