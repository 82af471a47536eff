"""Scaled dot-product attention (torch.nn.functional.scaled_dot_product_attention semantics): flash attention,
forward and backward.

q [B, H, Lq, E], k and v [B, HK, Lk, E] (HK divides H: grouped-query / multi-query attention), any strides.
No kernel ever holds the [Lq, Lk] score matrix: tiles of keys stream past a tile of queries (`attention_kernels`:
a forward that keeps per query row the maximum and 1 / the sum of its scores, and a backward of three kernels that
recomputes the probabilities from them; a mask's wholly blocked tiles skipped: `attention_ranges`).
Masks: `is_causal` (top-left aligned as in torch), or `attn_mask`, boolean (True: attend) or additive float,
read through strides with stride 0 over broadcast dims. With an additive mask the scores stay in natural
units (exp instead of exp2): HF's finfo.min masks then keep torch's meaning, which scaling by log2 e would
overflow to -inf. float32's scores are in natural units too: log2 e rounded into the scale would put a relative
error of |score| * 2^-24 on every probability, as large as torch's whole error.
One query row per head, no causal mask and no gradient (a decoding step) takes `attention_decode` instead.
Rows that attend to no key give 0, as torch does (its math backend, torch >= 2.5), with 0 gradients.
float32 follows torch's rule for matmuls: tf32 when `torch.backends.cuda.matmul.allow_tf32`, otherwise true
fp32: tf32x3 on the tensor cores where the head dim and both lengths are >= 256 (matmul's rule; every MMA chain
at most 32 long, the head dim read in chunks of 32), fp32 FMAs elsewhere.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import _runtime
from . import _autotune, _gemm
from ._dispatch import Differentiable, Launch, Shortcuts, absent, aligned, plan, switch, torch_op
from .attention_decode import decode, decode_shortcut, fp32_chunk
from .attention_kernels import delta_kernel, dkdv_kernel, dq_kernel, fwd_kernel
from .attention_ranges import RANGE_ROWS, Summary

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


# --- 1. Reference ----------------------------------------------------------------------------------------

def attention_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch's math backend: softmax(q k^T * scale + mask) v, differentiated by autograd. (Its fused backends
    recompute the probabilities from one log-sum-exp, which an additive finfo.min mask absorbs: on a row with
    no unmasked key their gradient is Lk times too large.)"""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


# --- 2. Launchers ----------------------------------------------------------------------------------------

def _cfg(block_m, block_n, warps, stages):
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


# Candidates by (bytes per element, head-dim tile), the default first. Forward and dQ: BLOCK_M (queries) is a
# multiple of BLOCK_N (keys); dK/dV: BLOCK_N is a multiple of BLOCK_M (the diagonal falls on tile edges).
# Forward key tiles no wider than the head-dim tile (as tutorial 06 keeps them). Three each: tuning compiles
# every candidate (twice on Hopper: TMA and pointer loads), a few seconds apiece; fp32 d256 has a fourth for
# its tf32x3 path (the fastest there, `scratch/probe_attn_x3.py`; the FMA path spills in it).
_FWD_CONFIGS = {
    (2, 64): [_cfg(128, 64, 4, 3), _cfg(64, 64, 4, 4), _cfg(128, 32, 4, 3)],
    (2, 128): [_cfg(128, 128, 8, 3), _cfg(128, 64, 4, 3), _cfg(64, 64, 4, 3)],
    (2, 256): [_cfg(128, 64, 8, 2), _cfg(64, 64, 4, 2), _cfg(64, 32, 4, 3)],
    (4, 64): [_cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3), _cfg(32, 32, 4, 3)],
    (4, 128): [_cfg(64, 32, 4, 3), _cfg(64, 64, 4, 2), _cfg(32, 32, 4, 3)],
    (4, 256): [_cfg(32, 32, 4, 2), _cfg(64, 32, 4, 2), _cfg(16, 16, 4, 2)],
}
_DKDV_CONFIGS = {
    (2, 64): [_cfg(32, 128, 4, 5), _cfg(64, 128, 8, 3), _cfg(32, 64, 4, 3)],
    (2, 128): [_cfg(32, 128, 8, 4), _cfg(64, 128, 8, 3), _cfg(32, 64, 4, 3)],
    (2, 256): [_cfg(32, 64, 4, 2), _cfg(16, 64, 4, 2), _cfg(16, 32, 4, 2)],
    (4, 64): [_cfg(32, 64, 4, 3), _cfg(32, 128, 8, 2), _cfg(16, 32, 4, 3)],
    (4, 128): [_cfg(32, 64, 4, 2), _cfg(16, 64, 4, 2), _cfg(16, 32, 4, 3)],
    (4, 256): [_cfg(16, 32, 4, 2), _cfg(16, 64, 4, 1), _cfg(16, 16, 4, 2), _cfg(32, 32, 4, 2)],
}
_DQ_CONFIGS = {
    (2, 64): [_cfg(128, 32, 4, 5), _cfg(128, 64, 8, 3), _cfg(64, 32, 4, 3)],
    (2, 128): [_cfg(128, 32, 8, 4), _cfg(128, 64, 8, 3), _cfg(64, 32, 4, 3)],
    (2, 256): [_cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2), _cfg(32, 16, 4, 2)],
    (4, 64): [_cfg(64, 32, 4, 3), _cfg(64, 64, 8, 2), _cfg(32, 16, 4, 3)],
    (4, 128): [_cfg(64, 32, 4, 2), _cfg(32, 32, 4, 2), _cfg(32, 16, 4, 3)],
    (4, 256): [_cfg(32, 16, 4, 2), _cfg(32, 32, 4, 1), _cfg(16, 16, 4, 2), _cfg(64, 32, 4, 2)],
}
_DELTA_BLOCK_M = 64
# Key ranges up to this long take delta = rowsum(P * dP) from the scores in fp32 (dq_kernel's DELTA pass: two
# products a tile, the dQ pass's P and dP bit for bit), not rowsum(dO * O): dS = P * (dP - delta) cancels where
# dP's row is nearly constant (few keys), and what separates delta from the dP the dS pass uses then is the whole
# of dS: in 16-bit dtypes O's rounding (fp16, 2 keys: dQ 5.1e-3 against 2.7e-4 with the exact delta), in fp32 the
# two sums' orders (a row of one key, whose dS is 0: dQ 7.5e-7 against torch's 2.4e-7 on the H200, 2 x 32 keys
# causal; probes/fuzz_repro.py). Few keys keep the pass cheap.
# There the backward's probabilities are normalized by the backward's own row sums, not the forward's: each pass
# recomputes the scores, and where its products round otherwise than the forward's (other tiles, orientation or
# chunks), P = exp(s - m) / l with the forward's l is off on each row's largest probability by the two roundings'
# difference, which a softmax's own sum cancels, and a delta summed from such P is off by (sum of P - 1) * dP.
# Peaked rows of large scores (scale 1.5, head dim 32, 31 keys, a float mask: |s| up to ~30) took dK to 2.4x
# torch's error on the H200 (GPU fuzz); on the CPU, the dK / dV pass's products rounded otherwise: dK 1.5x, dV
# 1.9x; the forward's too (in chunks): dQ and dK 3.7x (test_backward_independent_of_forward_rounding). So the DELTA
# pass writes its own 1 / l beside delta, which the dQ pass (the same tiles: the same scores) takes as stats, and
# the dK / dV pass, whose tile mostly holds every key there (Lk <= BLOCK_N: SELF_NORM), sums its own l and delta
# per query, as torch's softmax backward does (on a walk of several key tiles it takes the DELTA pass's).
SHORT_KEYS = 64


def _attention_precision(q: torch.Tensor, Lk: int) -> str:
    """tl.dot's precision: `_gemm.precision`'s rule, with the shortest of the head dim and the two lengths as
    its reduction: tf32x3 for float32 where all are >= TF32X3_MIN_K (then every product's chains are cut to
    `_chunk`'s length), FMAs where one is shorter."""
    return _gemm.precision(q.dtype, k=min(q.shape[2], q.shape[3], Lk))


def _chunk(q: torch.Tensor, precision: str) -> int:
    """The longest chain of a true-fp32 product's sums (CHUNK; 0: unbounded): the decode kernels' rule
    (`attention_decode.fp32_chunk`: 32 over head-dim tiles past 32; tf32x3 as `_gemm.max_k`, its head dim 256)."""
    return fp32_chunk(q.dtype, precision, _block_d(q.shape[-1]))


def _block_d(head_dim: int) -> int:
    return max(16, _runtime.next_power_of_2(head_dim))


def _candidates(table: dict, q: torch.Tensor, Lq: int, Lk: int, tma: bool, masked: bool, chunk: int,
                reduced: str) -> list:
    """The table's list for this dtype and head dim, less tiles larger than the bucketed lengths (the
    smallest candidate if none fits); with `tma`, each with TMA loads first, then with pointer loads.
    reduced: the block the kernel's tile products sum over, and its walk steps by ("BLOCK_N": over the keys,
    "BLOCK_M": over the queries). chunk > 0: only tiles whose reduced block is at most chunk.
    masked: at most 2 stages where the head dim is 128 or more (the mask tiles take shared memory too: the
    3-stage 128x128 bf16 tile asks 234 KB of the H200's 227 KB: the untuned default would not launch).
    A walk of at most two tiles is unpipelined (1 stage): pipelining gains nothing there (CvT-13's bf16 forward
    + backward: 0.071 ms a call in a CUDA graph against 0.085 before; H200, two sessions)."""
    configs = table[(min(q.element_size(), 4), max(64, _block_d(q.shape[-1])))]
    if masked and _block_d(q.shape[-1]) >= 128:
        configs = [dict(c, num_stages=min(c["num_stages"], 2)) for c in configs]
    bm, bn = _autotune.bucket(Lq), _autotune.bucket(Lk)
    configs = [c for c in configs if c["BLOCK_M"] <= bm and c["BLOCK_N"] <= bn] or configs[-1:]
    if chunk:
        configs = [c for c in configs if c[reduced] <= chunk]
    walk = Lk if reduced == "BLOCK_N" else Lq
    configs = [dict(c, num_stages=1) if walk <= 2 * c[reduced] else c for c in configs]
    return [dict(c, TMA=True) for c in configs if tma] + [dict(c, TMA=False) for c in configs]


def _strides(t: torch.Tensor) -> tuple:
    """t's strides, those of size-1 dims (never stepped) replaced by the next dim's extent in elements: a
    valid stride for a tensor descriptor."""
    strides = list(t.stride())
    for i in range(t.dim() - 2, -1, -1):
        if t.shape[i] == 1:
            strides[i] = strides[i + 1] * max(t.shape[i + 1], 1)
    return tuple(strides)


def _tma_ok(*tensors: torch.Tensor, traced: bool = False) -> bool:
    """Whether TMA tensor descriptors can read these [B, H, L, E] operands: Hopper, 16-bit, not empty, unit
    stride along E, 16-byte aligned base, other strides (`_strides`) positive multiples of 16 bytes."""
    t = tensors[0]
    if not _runtime.is_hopper(t.device.index or 0) or t.element_size() != 2:
        return False
    return all(t.numel() > 0 and t.stride(3) == 1 and aligned(t, traced) and (t.shape[3] * 2) % 16 == 0
               and all(s > 0 and (s * 2) % 16 == 0 for s in _strides(t)[:3]) for t in tensors)


def _mask_args(mask: Optional[torch.Tensor], q: torch.Tensor, traced: bool = False):
    """(tensor, its 4 strides, kind): an expanded [B, H, Lq, Lk] mask; an `absent` stand-in for a missing one. A bool
    mask is read as bytes, or as bool under tracing (Inductor cannot lower a bool tensor's dtype view)."""
    if mask is None:
        return absent(q, traced), (0, 0, 0, 0), "none"
    if mask.dtype == torch.bool:
        return mask if traced else mask.view(torch.uint8), mask.stride(), "bool"
    return mask, mask.stride(), "float"


def _tune_key(q, k, mask_kind, is_causal, precision, tma):
    Lq, E = q.shape[2:]
    return (q.dtype, precision, _block_d(E), _autotune.bucket(Lq), _autotune.bucket(k.shape[2]), mask_kind,
            is_causal, q.shape[1] // k.shape[1] > 1, tma)


_plans: dict = {}


def _signature(*tensors, traced: bool = False) -> tuple:
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, aligned(t, traced)) for t in tensors)


def _tuned(kernel, name: str, key: tuple, configs: list, grid, meta, args: tuple,
           traced: bool = False) -> Launch:
    """A launcher of `kernel` with the config that `_autotune.pick` chooses for `key` (timing launches on
    `args` when tuning; traced: timing nothing, `_dispatch.plan`); grid(config) gives its grid, meta (a dict, or a
    function of the config giving one) the other constexprs."""
    def launcher(cfg):
        return Launch(kernel, grid(cfg), dict(meta(cfg) if callable(meta) else meta, **cfg), scratch=cfg["TMA"],
                      traced=traced)

    def prepare(cfg):  # a launch to time: built once, so it is timed on its fast path
        launch = launcher(cfg)
        return lambda: launch(*args)

    return launcher(_autotune.pick(name, key, configs, prepare))


def _scores_scale(q: torch.Tensor, mask_kind: str, scale: float) -> float:
    """The scale the kernels take the scores in: natural units with an additive mask and in float32
    (`attention_kernels._exp`), else log2 units (scale * log2 e: exp2, one instruction)."""
    return scale if mask_kind == "float" or q.dtype == torch.float32 else scale * math.log2(math.e)


def _unit_head_stride(t: torch.Tensor) -> bool:
    """Whether the kernels read `t` as it lies: its head dim (the last) of stride 1 (or of size 1)."""
    return t.stride(-1) == 1 or t.shape[-1] == 1


def _readable(*tensors) -> tuple:
    """The tensors as the kernels read them: one whose head dim has another stride (a transposed, sliced or expanded
    head dim) as a contiguous copy. Triton 3.6's Hopper tensor-core path takes tiles of such a tensor into the
    products from shared memory wrongly at 4 warps and 64-row tiles: forwards 0.9 off, reads out of range in the
    backward (probes/attention_variants.py: dense copies of the same values pass)."""
    return tuple(t if _unit_head_stride(t) else t.contiguous() for t in tensors)


def _fwd_impl(q, k, v, mask, is_causal: bool, scale: float, traced: bool = False):
    """(out, stats) for 4-D q [B, H, Lq, E], k / v [B, HK, Lk, E], mask None or [B, H, Lq, Lk] (any strides).
    out is [B, H, Lq, E] stored as [B, Lq, H, E] (as torch's flash attention stores it). traced: under
    torch.compile (`_dispatch`)."""
    B, H, Lq, E = q.shape
    # [B, Lq, H, E] in memory, its own buffer (a written view is what Inductor's mutation copy-back can miscompile)
    out = torch.empty_strided((B, H, Lq, E), (Lq * H * E, E, H * E, 1), device=q.device, dtype=q.dtype)
    stats = torch.empty((B, H, 2, Lq), device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, stats
    q, k, v = _readable(q, k, v)
    run, mask_t, qk_scale = _fwd_plan(q, k, v, mask, out, stats, is_causal, scale, traced)
    run(q, k, v, mask_t, out, stats, qk_scale)
    return out, stats


def _plan_terms(q, k, mask, scale: float, traced: bool) -> tuple:
    """What the forward's and the backward's plans of a call fix: the sizes (B, H, HK, Lq, Lk), the mask as the
    kernels read it (`_mask_args`), the products' precision and the scale of the scores they take."""
    mask_t, mask_strides, mask_kind = _mask_args(mask, q, traced)
    return ((*q.shape[:2], k.shape[1], q.shape[2], k.shape[2]), mask_t, mask_strides, mask_kind,
            _attention_precision(q, k.shape[2]), _scores_scale(q, mask_kind, scale))


def _fwd_plan(q, k, v, mask, out, stats, is_causal: bool, scale: float, traced: bool):
    """(run, mask_t, qk_scale): the forward's plan for this signature, run(q, k, v, mask_t, out, stats, qk_scale),
    the mask as the kernel reads it and the scale of the scores it takes."""
    fixed, mask_t, mask_strides, mask_kind, precision, qk_scale = _plan_terms(q, k, mask, scale, traced)
    B, H, HK, Lq, Lk = fixed
    E = q.shape[3]

    def make():  # sizes and strides are fixed by the plan's key: computed once
        masked = mask_kind != "none"
        summary = Summary(mask if masked else None, mask_kind, traced)
        strides = (*_strides(q), *_strides(k), *_strides(v), *mask_strides, *summary.strides, *out.stride())
        tma = _tma_ok(q, k, v, traced=traced)
        chunk = _chunk(q, precision)
        meta = dict(MASK=mask_kind, CAUSAL=is_causal, PRECISION=precision, FOLD=qk_scale > 0, HEAD_DIM=E,
                    BLOCK_D=_block_d(E), CHUNK=chunk, RANGE_ROWS=RANGE_ROWS)
        configs = _candidates(_FWD_CONFIGS, q, Lq, Lk, tma, masked, chunk, "BLOCK_N")
        timed_args = () if traced else (q, k, v, mask_t, summary(mask_t), out, stats, *fixed, qk_scale, *strides)
        launch = _tuned(fwd_kernel, "attention_fwd", _tune_key(q, k, mask_kind, is_causal, precision, tma),
                        configs, lambda c: (_runtime.cdiv(Lq, c["BLOCK_M"]), B * H), meta, timed_args, traced=traced)
        return lambda q, k, v, m, out, stats, qk_scale: launch(q, k, v, m, summary(m), out, stats, *fixed,
                                                               qk_scale, *strides)

    plan_key = ("fwd", _signature(q, k, v, mask, traced=traced), q.device, is_causal, precision, qk_scale > 0)
    return plan(_plans, plan_key, make, traced=traced), mask_t, qk_scale


def _fwd_shortcut(q, k, v, out, stats, is_causal: bool, scale: float):
    """attention's later eager calls of this signature without a mask (`Shortcuts`): (q, k, v) -> out, the
    forward's plan on new out and stats laid out as this call's."""
    if out.numel() == 0:
        return None
    run, _, qk_scale = _fwd_plan(q, k, v, None, out, stats, is_causal, scale, False)
    shape, strides, stats_shape, dtype, device = out.shape, out.stride(), stats.shape, out.dtype, out.device

    def shortcut(q, k, v, mask=None):
        out = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        run(q, k, v, q, out, torch.empty(stats_shape, dtype=torch.float32, device=device), qk_scale)
        return out
    return shortcut


def _bwd_buffers(q, k, v) -> tuple:
    """(dq, dk, dv, delta): the gradients laid out as their inputs (a dense input's strides: the gradient of a
    [B, L, H, E] projection's transposed view needs no copy to reach it), and the fp32 rowsum(dO * O)."""
    delta = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), delta


def _bwd_impl(grad_out, q, k, v, mask, out, stats, is_causal: bool, scale: float, traced: bool = False):
    """(dq, dk, dv), each laid out as its input (`_bwd_buffers`)."""
    dq, dk, dv, delta = _bwd_buffers(q, k, v)
    if dq.numel() == 0 or k.shape[2] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    grad_out, q, k, v = _readable(grad_out, q, k, v)
    run, mask_t, qk_scale = _bwd_plan(grad_out, q, k, v, mask, out, stats, delta, dq, dk, dv, is_causal, scale, traced)
    run(grad_out, q, k, v, mask_t, out, stats, delta, dq, dk, dv, qk_scale, scale)
    return dq, dk, dv


def _bwd_plan(grad_out, q, k, v, mask, out, stats, delta, dq, dk, dv, is_causal: bool, scale: float, traced: bool):
    """(run, mask_t, qk_scale): the backward's plan for this signature, run(grad_out, q, k, v, mask_t, out, stats,
    delta, dq, dk, dv, qk_scale, scale) (the tensors laid out as these), as `_fwd_plan`."""
    fixed, mask_t, mask_strides, mask_kind, precision, qk_scale = _plan_terms(q, k, mask, scale, traced)
    B, H, HK, Lq, Lk = fixed
    E = q.shape[3]

    def make():  # sizes and strides are fixed by the plan's key: computed once
        masked = mask_kind != "none"
        # the mask's summaries: per query rows for dQ's walk over keys, per key rows (transposed) for dK / dV's
        by_query = Summary(mask if masked else None, mask_kind, traced)
        by_key = Summary(mask.transpose(2, 3) if masked else None, mask_kind, traced)
        strides = (*_strides(q), *_strides(k), *_strides(v), *mask_strides)
        delta_fixed = (H, Lq, *out.stride(), *grad_out.stride())
        tma = _tma_ok(q, k, v, grad_out, traced=traced)
        chunk = _chunk(q, precision)
        meta = dict(MASK=mask_kind, CAUSAL=is_causal, PRECISION=precision, HEAD_DIM=E, BLOCK_D=_block_d(E),
                    CHUNK=chunk, RANGE_ROWS=RANGE_ROWS)
        key = _tune_key(q, k, mask_kind, is_causal, precision, tma)
        dkdv_configs = _candidates(_DKDV_CONFIGS, q, Lq, Lk, tma, masked, chunk, "BLOCK_M")
        dq_configs = _candidates(_DQ_CONFIGS, q, Lq, Lk, tma, masked, chunk, "BLOCK_N")
        dkdv_strides = (*strides, *by_key.strides, *_strides(grad_out), *dk.stride(), *dv.stride())
        dq_strides = (*strides, *by_query.strides, *_strides(grad_out), *dq.stride())
        short = Lk <= SHORT_KEYS
        dkdv_meta = lambda c: dict(meta, SELF_NORM=short and Lk <= c["BLOCK_N"])  # noqa: E731
        launch_dkdv = _tuned(dkdv_kernel, "attention_dkdv", key, dkdv_configs,
                             lambda c: (_runtime.cdiv(Lk, c["BLOCK_N"]), B * HK), dkdv_meta,
                             () if traced else (q, k, v, mask_t, by_key(mask_t), grad_out, stats, delta, dk, dv,
                                                *fixed, qk_scale, scale, *dkdv_strides), traced=traced)
        launch_dq = _tuned(dq_kernel, "attention_dq", key, dq_configs,
                           lambda c: (_runtime.cdiv(Lq, c["BLOCK_M"]), B * H), meta,
                           () if traced else (q, k, v, mask_t, by_query(mask_t), grad_out, stats, delta, dq,
                                              *fixed, qk_scale, scale, *dq_strides), traced=traced)
        if short:
            # the dQ pass's tiles and warps (the same P and dP bit for bit: a row of one key gets dS = 0 exactly),
            # unpipelined: a range this short has a tile or two
            scores_delta = Launch(dq_kernel, launch_dq.grid, dict(launch_dq.constexprs, DELTA=True, num_stages=1),
                                  scratch=launch_dq.scratch, traced=traced)

            def launch_delta(out, grad_out, delta, q, k, v, m, summary, stats, qk_scale, scale):
                """delta, and the stats the dK / dV and dQ passes take: the forward's maxima and the DELTA pass's
                own 1 / row sums (in the dq slot: `dq_kernel`)."""
                own = torch.empty_like(stats)
                scores_delta(q, k, v, m, summary, grad_out, stats, delta, own, *fixed, qk_scale, scale, *dq_strides)
                return own
        else:
            rows_delta = Launch(delta_kernel, (_runtime.cdiv(Lq, _DELTA_BLOCK_M), B * H),
                                dict(HEAD_DIM=E, BLOCK_D=_block_d(E), BLOCK_M=_DELTA_BLOCK_M), traced=traced)

            def launch_delta(out, grad_out, delta, q, k, v, m, summary, stats, qk_scale, scale):
                rows_delta(out, grad_out, delta, *delta_fixed)
                return stats

        def run(grad_out, q, k, v, m, out, stats, delta, dq, dk, dv, qk_scale, scale):
            summary = by_query(m)
            stats = launch_delta(out, grad_out, delta, q, k, v, m, summary, stats, qk_scale, scale)
            launch_dkdv(q, k, v, m, by_key(m), grad_out, stats, delta, dk, dv, *fixed, qk_scale, scale, *dkdv_strides)
            launch_dq(q, k, v, m, summary, grad_out, stats, delta, dq, *fixed, qk_scale, scale, *dq_strides)
        return run

    # (the gradients' layouts too: q, k and v may be copies, `_readable`, with the gradients laid out as the originals)
    plan_key = ("bwd", _signature(grad_out, q, k, v, mask, out, dq, dk, dv, traced=traced), q.device, is_causal,
                precision)
    return plan(_plans, plan_key, make, traced=traced), mask_t, qk_scale


# --- 3. Registration as torch ops (what torch.compile traces: `_dispatch`) --------------------------------

@torch_op("dropin::attention", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(q, k, v, mask, is_causal, scale, traced=True)


@torch_op("dropin::attention_bwd", mutates_args=())
def _bwd_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: Optional[torch.Tensor], out: torch.Tensor, stats: torch.Tensor, is_causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _bwd_impl(grad_out, q, k, v, mask, out, stats, is_causal, scale, traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_bwd = switch(_bwd_op, _bwd_impl)


# --- 4. Autograd -----------------------------------------------------------------------------------------

class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        out, stats = _fwd(q, k, v, mask, is_causal, scale)
        ctx.save_for_backward(q, k, v, mask, out, stats)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, out, stats = ctx.saved_tensors
        dq, dk, dv = _bwd(grad_out, q, k, v, mask, out, stats, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None, None


class _AttentionShortcut(Differentiable):
    """attention's later eager calls of this signature without a mask where autograd records them (`Shortcuts`):
    the forward's plan, saving what `_AttentionFunction` saves, and the backward's plan for each layout of dO."""

    def __init__(self, run, qk_scale: float, out: torch.Tensor, stats_shape, is_causal: bool, scale: float):
        super().__init__()
        self.run, self.qk_scale, self.is_causal, self.scale = run, qk_scale, is_causal, scale
        self.out_layout = (out.shape, out.stride(), out.dtype, out.device)
        self.stats_shape = stats_shape

    @staticmethod
    def make(q, k, v, out, is_causal: bool, scale: float):
        """The shortcut of this call (out: its output); None where the call has no work."""
        if out.numel() == 0 or k.shape[2] == 0:
            return None
        stats = torch.empty((*q.shape[:2], 2, q.shape[2]), device=q.device, dtype=torch.float32)
        run, _, qk_scale = _fwd_plan(q, k, v, None, out, stats, is_causal, scale, False)
        return _AttentionShortcut(run, qk_scale, out, stats.shape, is_causal, scale)

    def forward(self, ctx, q, k, v, mask):
        shape, strides, dtype, device = self.out_layout
        out = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        stats = torch.empty(self.stats_shape, device=device, dtype=torch.float32)
        self.run(q, k, v, q, out, stats, self.qk_scale)
        ctx.save_for_backward(q, k, v, mask, out, stats)
        return out

    def backward(self, ctx, grad_out):
        q, k, v, mask, out, stats = ctx.saved_tensors
        dq, dk, dv, delta = _bwd_buffers(q, k, v)
        grad_out, = _readable(grad_out)
        run = self.backward_plan((grad_out,), lambda: _bwd_plan(grad_out, q, k, v, None, out, stats, delta, dq, dk,
                                                                dv, self.is_causal, self.scale, False)[0])
        run(grad_out, q, k, v, q, out, stats, delta, dq, dk, dv, self.qk_scale, self.scale)
        return dq, dk, dv, None


# --- 5. Public function ----------------------------------------------------------------------------------

def _check_shapes(q, k, v, enable_gqa: bool) -> None:
    """q [B, H, Lq, E] (or [B, Lq, E]), k [B, HK, Lk, E], v [B, HK, Lk, E]; errors name the argument."""
    if q.dim() not in (3, 4):
        raise RuntimeError(f"attention: argument 'q' must be 3-D (N, L, E) or 4-D (B, H, L, E), got {q.dim()}-D")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise RuntimeError(f"attention: argument '{name}' must be {q.dim()}-D like 'q', got {t.dim()}-D")
        if t.shape[0] != q.shape[0]:
            raise RuntimeError(f"attention: argument '{name}' has batch size {t.shape[0]}, 'q' has {q.shape[0]}")
    if v.shape[-2] != k.shape[-2]:
        raise RuntimeError(f"attention: argument 'v' has {v.shape[-2]} keys (dim -2), 'k' has {k.shape[-2]}")
    E = q.shape[-1]
    if k.shape[-1] != E:
        raise RuntimeError(f"attention: argument 'k' has head dim {k.shape[-1]}, 'q' has {E}")
    if v.shape[-1] != E:
        raise RuntimeError(f"attention: argument 'v' has head dim {v.shape[-1]}; dropin needs the head dim of "
                           f"'q' ({E})")
    if not 1 <= E <= MAX_HEAD_DIM:
        raise RuntimeError(f"attention: argument 'q' has head dim {E}; dropin supports 1 to {MAX_HEAD_DIM}")
    if q.dim() == 4:
        H, HK, HV = q.shape[1], k.shape[1], v.shape[1]
        if HV != HK:
            raise RuntimeError(f"attention: argument 'v' has {HV} heads, 'k' has {HK}")
        if HK != H and not (enable_gqa and HK > 0 and H % HK == 0):
            why = "a divisor of" if enable_gqa else "equal to (or, with enable_gqa=True, a divisor of)"
            raise RuntimeError(f"attention: argument 'k' has {HK} heads; it must be {why} the {H} heads of 'q'")


def _check_mask(attn_mask, q, shape, is_causal: bool) -> torch.Tensor:
    """The mask broadcast to `shape` (a view), after torch's checks."""
    if is_causal:
        raise RuntimeError("attention: explicit 'attn_mask' should not be set when is_causal=True")
    if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise RuntimeError(f"attention: argument 'attn_mask' has dtype {attn_mask.dtype}; expected bool, "
                           f"float32 or the dtype of 'q' ({q.dtype})")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("attention: argument 'attn_mask' requires grad; dropin has no gradient for the mask")
    try:
        return attn_mask.expand(shape)
    except RuntimeError as e:
        raise RuntimeError(f"attention: argument 'attn_mask' of shape {tuple(attn_mask.shape)} does not "
                           f"broadcast to the attention shape {tuple(shape)}") from e


_shortcuts = Shortcuts(differentiable=True)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)` without
    the [Lq, Lk] score matrix (same positional order as torch's).

    q [B, H, Lq, E] or [N, Lq, E]; k and v [B, HK, Lk, E] or [N, Lk, E], any strides. HK == H, or (enable_gqa)
    a divisor of H: query heads h*H/HK .. (h+1)*H/HK - 1 share K/V head h. Head dim E up to 256 (v's the
    same as q's). attn_mask: bool (True = attend) or additive float (float32 or q's dtype), broadcasting to
    [B, H, Lq, Lk] (e.g. HF's [B, 1, Lq, Lk] causal + padding masks); no gradient for it. is_causal: key j
    attends to query i when j <= i (top-left aligned when Lq != Lk); not together with attn_mask. scale:
    default 1 / sqrt(E). dropout_p must be 0. A query row that may attend to no key gives zeros (as torch).
    float32 / float16 / bfloat16 (all the same); float32 uses tf32 only where torch's matmuls would
    (`torch.backends.cuda.matmul.allow_tf32`). Returns [B, H, Lq, E] (or [N, Lq, E]) in q's dtype."""
    key, shortcut = _shortcuts.find((q, k, v, attn_mask), (dropout_p, is_causal, scale, enable_gqa, _gemm.tf32_key(q)))
    if shortcut is not None:
        return shortcut(q, k, v, attn_mask)
    _runtime.check_kernel_device("attention", q=q, k=k, v=v, attn_mask=attn_mask)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise RuntimeError(f"attention: argument '{name}' has dtype {t.dtype}; dropin supports {_DTYPES}")
    q, k, v = _gemm.autocast(q, k, v)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise RuntimeError(f"attention: expected 'q' and '{name}' to have the same dtype, "
                               f"but got {q.dtype} and {t.dtype}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"attention: argument 'dropout_p' is {dropout_p}; dropin supports only 0")
    _check_shapes(q, k, v, enable_gqa)
    unbatched = q.dim() == 3
    if unbatched:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    B, H, Lq, E = q.shape
    if attn_mask is not None:
        shape = (B, Lq, k.shape[2]) if unbatched else (B, H, Lq, k.shape[2])
        attn_mask = _check_mask(attn_mask, q, shape, is_causal)
        attn_mask = attn_mask.unsqueeze(1) if unbatched else attn_mask
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    # (shortcuts run their plans on the tensors as given: none for those read from copies, `_readable`)
    shortcut_ok = not unbatched and all(_unit_head_stride(t) for t in (q, k, v))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out = _AttentionFunction.apply(q, k, v, attn_mask, bool(is_causal), scale)
        if attn_mask is None and shortcut_ok:
            _shortcuts.keep(key, lambda: _AttentionShortcut.make(q, k, v, out, bool(is_causal), scale), grad=True)
    elif Lq == 1 and not is_causal:
        out = decode(q, k, v, attn_mask, scale)  # a decoding step: keys split over programs
        if not unbatched:
            _shortcuts.keep(key, lambda: decode_shortcut(q, k, v, attn_mask, scale))
    else:
        out, stats = _fwd(q, k, v, attn_mask, bool(is_causal), scale)
        if attn_mask is None and shortcut_ok:
            _shortcuts.keep(key, lambda: _fwd_shortcut(q, k, v, out, stats, bool(is_causal), scale))
    return out.squeeze(1) if unbatched else out
