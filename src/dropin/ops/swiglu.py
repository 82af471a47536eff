"""The SwiGLU MLP of HF Llama (LlamaMLP): down(silu(x @ G^T) * (x @ U^T)); forward and backward. The same
kernels run the gated MLPs with another activation in place of silu (Gemma's GeGLU: gelu_tanh), a constexpr.

Forward: `_swiglu_kernel` (on Hopper `_swiglu_tma_kernel`, persistent) computes, for one (M, N) tile, both
x @ G^T and x @ U^T in two fp32 accumulators from one read of each x tile, and writes only h = silu(g) * u:
the two pre-activations never reach memory. The down projection is dropin's `linear`.
Backward, by default (recompute=False), recomputes what is cheap and keeps what is not: the forward also
writes g and u (SAVE), and the backward's elementwise pass (SAVED) turns them, with dh = dy @ D, into
h = silu(g) * u (for D's gradient, over g), du = dh * silu(g) (over u) and dg = dh * u * silu'(g) (over dh):
2 buffers of size [tokens, intermediate] live from the forward to the backward (eager keeps 4: g, silu(g),
u, h), and the backward peaks at 3; the gradients of x and of the three weights are dropin matmuls. g and u
are kept on the autograd node, not saved, so that the backward can free them as it goes: it therefore runs
once per forward (retain_graph raises). recompute=True keeps nothing of that size: the same kernel
(BACKWARD) recomputes the tile's g and u from x and writes h, du and dg; two GEMMs more, the same backward
peak.
float32 follows torch's rule (tf32 only when `torch.backends.cuda.matmul.allow_tf32`), as matmul does.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from . import _autotune, _gemm
from ._dispatch import Differentiable, Launch, Shortcuts, absent, aligned, plan, switch, torch_op
from ._gemm import dot_acc, tile_coords
from .activations import ACTIVATIONS, activation_grad, activation_ref, apply_activation
from .matmul import linear, linear_shortcut, matmul, matmul_shortcut


# --- 1. Reference -----------------------------------------------------------------------------------

def swiglu_mlp_ref(x, gate_weight, up_weight, down_weight, activation="silu"):
    """HF LlamaMLP.forward with these weights (no biases); GemmaMLP's with activation "gelu_tanh"."""
    return F.linear(activation_ref(F.linear(x, gate_weight), activation) * F.linear(x, up_weight), down_weight)


# --- 2. Kernels -------------------------------------------------------------------------------------

@triton.jit
def _gate_up_tile(x_ptr, g_ptr, u_ptr, pid_m, pid_n, M, N, K,
                  stride_xm, stride_xk, stride_gn, stride_gk, stride_un, stride_uk,
                  PRECISION: tl.constexpr, SWAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(x @ G^T, x @ U^T) for one [BLOCK_M, BLOCK_N] tile, fp32, each x tile loaded once for both products;
    pointer loads with any strides. SWAP (few rows: decoding) computes each as (W x^T)'s [BLOCK_N, BLOCK_M], the
    weights' rows on the MMA's 64-row side and x's few rows on its narrow one (matmul's skinny_kernel)."""
    offs_k = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap onto valid ones, so only K needs a load mask.
    rows_m = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M).to(tl.int64)
    rows_n = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
    if SWAP:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        x_ptrs = x_ptr + offs_k[:, None] * stride_xk + rows_m[None, :] * stride_xm
        g_ptrs = g_ptr + rows_n[:, None] * stride_gn + offs_k[None, :] * stride_gk
        u_ptrs = u_ptr + rows_n[:, None] * stride_un + offs_k[None, :] * stride_uk
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        g_ptrs = g_ptr + offs_k[:, None] * stride_gk + rows_n[None, :] * stride_gn
        u_ptrs = u_ptr + offs_k[:, None] * stride_uk + rows_n[None, :] * stride_un
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        if SWAP:
            a = tl.load(x_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            g = tl.load(g_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            u = tl.load(u_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            acc_g = dot_acc(acc_g, g, a, PRECISION)
            acc_u = dot_acc(acc_u, u, a, PRECISION)
        else:
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            g = tl.load(g_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            u = tl.load(u_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if BLOCK_M == 1:  # one row (VECTOR_CONFIGS): broadcast products summed as a tree over the K tile
                a = tl.reshape(a.to(tl.float32), (BLOCK_K, 1))
                acc_g += tl.sum(a * g.to(tl.float32), axis=0)[None, :]
                acc_u += tl.sum(a * u.to(tl.float32), axis=0)[None, :]
            else:
                acc_g = dot_acc(acc_g, a, g, PRECISION)
                acc_u = dot_acc(acc_u, a, u, PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_gk
        u_ptrs += BLOCK_K * stride_uk
    if SWAP:
        acc_g, acc_u = tl.trans(acc_g), tl.trans(acc_u)
    return acc_g, acc_u


@triton.jit
def _swiglu_values(g, u, dh, ACT: tl.constexpr):
    """fp32 h = act(g) * u, du = dh * act(g), dg = dh * u * act'(g) (act: silu for SwiGLU)."""
    act = apply_activation(g, ACT)
    return act * u, dh * act, dh * u * activation_grad(g, ACT)


@triton.jit
def _swiglu_kernel(x_ptr, g_ptr, u_ptr, h_ptr, dh_ptr, du_ptr, zg_ptr, zu_ptr,
                   M, N, K,
                   stride_xm, stride_xk, stride_gn, stride_gk, stride_un, stride_uk,
                   BACKWARD: tl.constexpr, SAVE: tl.constexpr, SAVED: tl.constexpr, ACT: tl.constexpr,
                   PRECISION: tl.constexpr, SWAP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One [M, N] tile per program: g = x @ G^T and u = x @ U^T in registers (pointer loads); writes h, and
    when BACKWARD also du and dg over dh (_swiglu_values). SAVE (forward): g and u are also written to zg and
    zu; SAVED (backward): g and u are read from zg and zu instead of computed, and h and du written over them (an
    elementwise pass in place; x, g, u, h and du unused). h, dh, du, zg, zu: contiguous [M, N]."""
    pid_m, pid_n = tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SAVED:
        g = tl.load(zg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(zu_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        g, u = _gate_up_tile(x_ptr, g_ptr, u_ptr, pid_m, pid_n, M, N, K,
                             stride_xm, stride_xk, stride_gn, stride_gk, stride_un, stride_uk,
                             PRECISION, SWAP, BLOCK_M, BLOCK_N, BLOCK_K)
    dh = 0.0
    if BACKWARD:
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SAVE:
        tl.store(zg_ptr + offs, g.to(zg_ptr.dtype.element_ty), mask=mask)
        tl.store(zu_ptr + offs, u.to(zu_ptr.dtype.element_ty), mask=mask)
    h, du, dg = _swiglu_values(g, u, dh, ACT)
    h_dst = zg_ptr if SAVED else h_ptr
    tl.store(h_dst + offs, h.to(h_dst.dtype.element_ty), mask=mask)
    if BACKWARD:
        du_dst = zu_ptr if SAVED else du_ptr
        tl.store(du_dst + offs, du.to(du_dst.dtype.element_ty), mask=mask)
        tl.store(dh_ptr + offs, dg.to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_tma_kernel(x_ptr, g_ptr, u_ptr, h_ptr, dh_ptr, du_ptr, zg_ptr, zu_ptr,
                       M, N, K, stride_xm, stride_gn, stride_un,
                       BACKWARD: tl.constexpr, SAVE: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """_swiglu_kernel's forward and backward (not SAVED) through tensor descriptors (Hopper: x and the weights
    with unit stride along K, every row 16-byte aligned, the [M, N] tensors too; zeros past the edges, stores
    clipped there), persistent: NUM_PROGRAMS programs walk the tiles in tile_coords' order. The tile loop is
    not flattened: flattened, it ran 15% slower (H200)."""
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
    g_desc = tl.make_tensor_descriptor(g_ptr, [N, K], [stride_gn, 1], [BLOCK_N, BLOCK_K])
    u_desc = tl.make_tensor_descriptor(u_ptr, [N, K], [stride_un, 1], [BLOCK_N, BLOCK_K])
    h_desc = tl.make_tensor_descriptor(h_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
    if BACKWARD:
        dh_desc = tl.make_tensor_descriptor(dh_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
        du_desc = tl.make_tensor_descriptor(du_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
    if SAVE:
        zg_desc = tl.make_tensor_descriptor(zg_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
        zu_desc = tl.make_tensor_descriptor(zu_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([off_m, k * BLOCK_K])
            g = dot_acc(g, a, g_desc.load([off_n, k * BLOCK_K]).T, PRECISION)
            u = dot_acc(u, a, u_desc.load([off_n, k * BLOCK_K]).T, PRECISION)
        dh = 0.0
        if BACKWARD:
            dh = dh_desc.load([off_m, off_n]).to(tl.float32)
        if SAVE:
            zg_desc.store([off_m, off_n], g.to(zg_ptr.dtype.element_ty))
            zu_desc.store([off_m, off_n], u.to(zu_ptr.dtype.element_ty))
        h, du, dg = _swiglu_values(g, u, dh, ACT)
        h_desc.store([off_m, off_n], h.to(h_ptr.dtype.element_ty))
        if BACKWARD:
            du_desc.store([off_m, off_n], du.to(du_ptr.dtype.element_ty))
            dh_desc.store([off_m, off_n], dg.to(dh_ptr.dtype.element_ty))


# --- 3. Launchers -----------------------------------------------------------------------------------

_cfg = _autotune.config
# Two accumulators per tile: a 128 x 128 tile holds as many fp32 numbers as matmul's 128 x 256. The
# smallest last (_gemm.fits keeps it when nothing else fits); true fp32 takes BLOCK_K <= `_gemm.max_k` (dot_acc).
# SWAP: the few-rows tile (decoding), first among the candidates where M <= 16.
_CONFIGS = {
    2: [_cfg(128, 128, 64, 8, 3), _cfg(128, 128, 32, 8, 4), _cfg(128, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 4),
        _cfg(64, 64, 64, 4, 4), _cfg(16, 64, 128, 4, 4, SWAP=True), _cfg(16, 64, 128, 4, 3, SWAP=True),
        _cfg(16, 64, 128, 4, 3), _cfg(16, 32, 64, 4, 2)],
    4: [_cfg(128, 128, 32, 8, 3), _cfg(128, 64, 32, 4, 4), _cfg(64, 128, 32, 4, 4), _cfg(64, 64, 32, 4, 4),
        _cfg(16, 64, 64, 4, 3, SWAP=True), _cfg(16, 64, 64, 4, 3), _cfg(16, 32, 32, 4, 2)],
}
# One row in true fp32's FMAs ("ieee"): one-row tiles whose products are summed as a tree over each K tile, as
# cuBLAS sums a vector's few terms (a chain of FMAs over a tile went to 3.3x torch's error on a 56-term sum, and
# to 4x the fp32 tolerance on constant rows: docs/perf-notes.md); the only candidates there, smallest last.
VECTOR_CONFIGS = [_cfg(1, 64, 64, 4, 1), _cfg(1, 128, 32, 4, 1), _cfg(1, 32, 128, 4, 1)]
_TMA_CONFIGS = {  # _swiglu_tma_kernel's (persistent, a program an SM)
    2: [_cfg(128, 128, 64, 8, 3, WARP_SPECIALIZE=False), _cfg(128, 128, 64, 8, 3, WARP_SPECIALIZE=True),
        _cfg(128, 128, 64, 8, 4, WARP_SPECIALIZE=False), _cfg(128, 64, 64, 4, 4, WARP_SPECIALIZE=False),
        _cfg(64, 64, 64, 4, 4, WARP_SPECIALIZE=False)],
    4: [_cfg(128, 128, 32, 8, 3, WARP_SPECIALIZE=False), _cfg(128, 64, 32, 4, 4, WARP_SPECIALIZE=False),
        _cfg(64, 64, 32, 4, 4, WARP_SPECIALIZE=False)],
}


def _tma_ok(t: torch.Tensor, traced: bool = False) -> bool:
    """A 2-D tensor a descriptor can read and write: unit inner stride, 16-byte aligned base and rows."""
    return t.stride(1) == 1 and aligned(t, traced) and (t.stride(0) * t.element_size()) % 16 == 0


_plans: dict = {}


def _launch(x, gate_weight, up_weight, h, dh=None, du=None, zg=None, zu=None, save=False, act: str = "silu",
            tma: Optional[bool] = None, traced: bool = False):
    """The kernel over the [M, N] tiles; x [M, K] and the weights [N, K] with any strides. Backward when
    dh is given; with zg and zu, forward saves g and u there (save) or backward reads them (not save: the
    elementwise backward in place over zg, zu and dh; x, the weights, h and du None). A tensor the kernel leaves
    alone is None here (`absent` in its slot). The launch plan (kernel, grid, config) is made once per signature
    and reused. act: the gate's activation."""
    run, ptrs = _launch_plan(x, gate_weight, up_weight, h, dh, du, zg, zu, save, act, tma, traced)
    run(*ptrs)


def _launch_plan(x, gate_weight, up_weight, h, dh, du, zg, zu, save: bool, act: str, tma: Optional[bool],
                 traced: bool):
    """(run, ptrs): `_launch`'s plan for this signature, run(*ptrs), and its 8 tensors (`absent` for None)."""
    backward, saved = dh is not None, zg is not None and not save
    like = zg if saved else h
    precision = _gemm.precision(like.dtype, k=0 if saved else x.shape[1])
    ptrs = tuple(absent(like, traced) if t is None else t for t in (x, gate_weight, up_weight, h, dh, du, zg, zu))
    operands = () if saved else (x.shape[1], x.stride(), gate_weight.stride(), up_weight.stride())
    key = (backward, saved, save, act, precision, tma, like.device, like.shape, *operands,
           tuple((t.dtype, aligned(t, traced)) for t in ptrs))
    return plan(_plans, key, lambda: _make_plan(ptrs, backward, saved, save, act, precision, tma, traced),
                traced=traced), ptrs


def _make_plan(ptrs, backward, saved, save, act, precision, tma, traced: bool):
    """Chooses the kernel and its config for this signature (tuning on first use); returns the launcher of
    `_launch`'s 8 tensors. Candidates for the products: _swiglu_tma_kernel's where every tensor suits a
    descriptor (Hopper; not on fp32 FMA dots, where TMA loads ran 10-30x slower than pointer ones, H200) and
    _swiglu_kernel's; the config is tuned once per (pass, dtype, precision, kernels, size bucket). `tma` forces
    the choice (tests). The activation does not enter the tuning key: it costs the same few elementwise ops."""
    x, gate_weight, up_weight, h = ptrs[:4]
    (M, N), K = ptrs[6 if saved else 3].shape, 0 if saved else x.shape[1]
    max_k = _gemm.max_k(precision, x.element_size())
    if saved:  # elementwise, in place: not tuned (the best of 7 tiles on the H200: 3.1 TB/s)
        configs, kinds = [dict(_cfg(32, 128, 16, 4, 1), TMA=False)], ()
    elif _runtime.size_hint(M) == 1 and precision == "ieee" and x.dtype == torch.float32 and tma is None:
        configs, kinds = [dict(cfg, TMA=False) for cfg in _gemm.fits(VECTOR_CONFIGS, 1, N, K, min_m=1)], ("vector",)
    else:
        if tma is None:
            used = ptrs[:4] + (ptrs[4:6] if backward else ()) + (ptrs[6:] if save else ())
            tma_ok = (_runtime.is_hopper(x.device.index or 0) and all(_tma_ok(t, traced) for t in used)
                      and not (x.dtype == torch.float32 and precision == "ieee"))
            kinds = (True, False) if tma_ok else (False,)
        else:
            kinds = (tma,)
        configs = []
        for kind in kinds:
            fitting = _gemm.fits((_TMA_CONFIGS if kind else _CONFIGS)[x.element_size()], M, N, K, max_k)
            if _runtime.size_hint(M) >= 64:  # the 16-row tiles are for few tokens: fewer candidates (tunes only)
                fitting = [cfg for cfg in fitting if cfg["BLOCK_M"] > 16] or fitting
            configs += [dict(cfg, TMA=kind) for cfg in fitting]
        if _runtime.size_hint(M) <= 16:  # few rows: the swapped tiles first (the untimed choice)
            configs.sort(key=lambda cfg: not cfg.get("SWAP", False))

    def launcher(cfg):
        cfg = dict(cfg)
        tiles = _runtime.cdiv(M, cfg["BLOCK_M"]) * _runtime.cdiv(N, cfg["BLOCK_N"])
        meta = dict(BACKWARD=backward, SAVE=save, ACT=act, PRECISION=precision, GROUP_M=8)
        if cfg.pop("TMA"):
            programs = _runtime.num_sms(x.device.index or 0)
            scalars = (M, N, K, x.stride(0), gate_weight.stride(0), up_weight.stride(0))
            launch = Launch(_swiglu_tma_kernel, (min(tiles, programs),), dict(meta, NUM_PROGRAMS=programs, **cfg),
                            scratch=True, traced=traced)
        else:
            strides = (0,) * 6 if saved else (*x.stride(), *gate_weight.stride(), *up_weight.stride())
            scalars = (M, N, K, *strides)
            cfg.setdefault("SWAP", False)
            launch = Launch(_swiglu_kernel, (tiles,), dict(meta, SAVED=saved, **cfg), traced=traced)
        return lambda *tensors: launch(*tensors, *scalars)

    tuning = {}

    def prepare(cfg):  # a launch to time, built once; the backward writes dg over dh, so its timed runs
        if backward and not tuning:  # write over a copy of dh
            tuning["ptrs"] = (*ptrs[:4], ptrs[4].clone(), *ptrs[5:])
        launch, args = launcher(cfg), tuning.get("ptrs", ptrs)
        return lambda: launch(*args)

    key = ("bwd" if backward else "fwd", saved, save, x.dtype, precision, kinds, *map(_autotune.bucket, (M, N, K)))
    return launcher(_autotune.pick("swiglu", key, configs, prepare))


def _swiglu_fwd_impl(x, gate_weight, up_weight, save: bool, act: str = "silu", tma: Optional[bool] = None,
                     traced: bool = False):
    """h = act(x @ G^T) * (x @ U^T): x [M, K], G and U [N, K] -> (h, g, u), [M, N] contiguous; g and u
    (the pre-activations) are written only when `save`, else empty."""
    M, N = x.shape[0], gate_weight.shape[0]
    h = x.new_empty((M, N))
    zg, zu = (x.new_empty((M, N)), x.new_empty((M, N))) if save else (x.new_empty(0), x.new_empty(0))
    if h.numel():
        _launch(x, gate_weight, up_weight, h, zg=zg if save else None, zu=zu if save else None, save=save,
                act=act, tma=tma, traced=traced)
    return h, zg, zu


def _swiglu_bwd_impl(x, gate_weight, up_weight, dh, act: str = "silu", tma: Optional[bool] = None,
                     traced: bool = False):
    """Recomputes g and u; given dh [M, N] (contiguous; overwritten with dg = dh * u * act'(g)), returns
    (h, du)."""
    h, du = torch.empty_like(dh), torch.empty_like(dh)
    if h.numel():
        _launch(x, gate_weight, up_weight, h, dh, du, act=act, tma=tma, traced=traced)
    return h, du


def _swiglu_bwd_saved_impl(g, u, dh, act: str = "silu", traced: bool = False) -> None:
    """From the saved pre-activations, in place: g becomes h = act(g) * u, u becomes du = dh * act(g),
    dh becomes dg = dh * u * act'(g) (all [M, N] contiguous)."""
    if g.numel():
        _launch(None, None, None, None, dh, None, g, u, act=act, traced=traced)
    if not traced:  # (the registered op's dispatcher bumps the versions of the arguments it mutates)
        _written(g, u, dh)


def _written(*tensors) -> None:
    """Tells autograd, whose saved-tensor checks rely on it, that a kernel wrote these tensors through pointers."""
    for t in tensors:
        torch.autograd.graph.increment_version(t)


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ------------------------------

@torch_op("dropin::swiglu_fwd", mutates_args=())
def _swiglu_fwd_op(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                   save: bool, act: str = "silu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _swiglu_fwd_impl(x, gate_weight, up_weight, save, act, traced=True)


@torch_op("dropin::swiglu_bwd", mutates_args=("dh",))
def _swiglu_bwd_op(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
                   dh: torch.Tensor, act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    return _swiglu_bwd_impl(x, gate_weight, up_weight, dh, act, traced=True)


@torch_op("dropin::swiglu_bwd_saved_", mutates_args=("g", "u", "dh"))
def _swiglu_bwd_saved_op(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, act: str = "silu") -> None:
    _swiglu_bwd_saved_impl(g, u, dh, act, traced=True)


_swiglu_fwd = switch(_swiglu_fwd_op, _swiglu_fwd_impl)
_swiglu_bwd = switch(_swiglu_bwd_op, _swiglu_bwd_impl)
_swiglu_bwd_saved = switch(_swiglu_bwd_saved_op, _swiglu_bwd_saved_impl)


# --- 5. Autograd --------------------------------------------------------------------------------------

class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, recompute, act):
        save = not recompute and any(ctx.needs_input_grad[:4])
        h, g, u = _swiglu_fwd(x, gate_weight, up_weight, save, act)
        ctx.act = act
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight)
        # Kept on ctx, not saved: the backward takes them over as its own buffers and frees them early.
        ctx.saved_mode, ctx.pre_activations = save, [g, u] if save else None
        return linear(h, down_weight)

    @staticmethod
    def backward(ctx, dy):
        return *_backward(ctx, ctx.saved_tensors, dy, ctx.needs_input_grad[:4]), None, None


_OWN = ((matmul,) * 6, _swiglu_bwd, _swiglu_bwd_saved)


def _backward(ctx, saved, dy, needs, planned=_OWN) -> tuple:
    """The gradients of (x [M, K], gate_weight, up_weight, down_weight) where needs says, dy [M, K]; saved: the
    forward's saved tensors (x, the weights; ctx.saved_tensors, read once), ctx holds act, saved_mode and
    pre_activations. planned: (the six products, the recomputing pass, the pass over the saved pre-activations),
    the op's own functions or the plans that `_SwiGLUShortcut` keeps for a dy of this layout."""
    x, gate_weight, up_weight, down_weight = saved
    need_x, need_g, need_u, need_d = needs
    (mm_dh, mm_down, mm_dx, mm_gate, mm_dx_up, mm_up), bwd, bwd_saved = planned
    dg = mm_dh(dy, down_weight).contiguous()  # dh = dy @ D; it becomes dg in place
    if not ctx.saved_mode:
        h, du = bwd(x, gate_weight, up_weight, dg, ctx.act)
    else:
        if ctx.pre_activations is None:
            raise RuntimeError("swiglu_mlp (recompute=False, the default): the backward turns the kept "
                               "pre-activations into its own buffers, so it runs once per forward "
                               "(retain_graph is not supported); use recompute=True")
        (g, u), ctx.pre_activations = ctx.pre_activations, None
        bwd_saved(g, u, dg, ctx.act)  # in place: g becomes h, u becomes du
        h, du = g, u
        del g, u
    d_down = mm_down(dy.mT, h) if need_d else None
    del h
    # dg's products first, then dg is freed: the weight gradients do not pile up on three [M, N] buffers
    dx = mm_dx(dg, gate_weight) if need_x else None
    d_gate = mm_gate(dg.mT, x) if need_g else None
    del dg
    if need_x:
        dx.add_(mm_dx_up(du, up_weight))
    d_up = mm_up(du.mT, x) if need_u else None
    return dx, d_gate, d_up, d_down


# --- 6. Public function -------------------------------------------------------------------------------

_shortcuts = Shortcuts(differentiable=True)


def swiglu_mlp(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor,
               down_weight: torch.Tensor, recompute: bool = False, activation: str = "silu") -> torch.Tensor:
    """HF Llama's MLP, `down_proj(silu(gate_proj(x)) * up_proj(x))` without biases; with another `activation`
    of dropin's (dropin.ops.activations.ACTIVATIONS) in place of silu, the same gated MLP (Gemma's: "gelu_tanh").

    x [..., hidden] (any strides), gate_weight and up_weight [intermediate, hidden], down_weight
    [hidden, intermediate] (nn.Linear's layouts) -> [..., hidden]. float32 / float16 / bfloat16 (all the
    same), fp32 accumulation; float32 uses tf32 only where torch would. Under torch.autocast the operands
    are cast as autocast casts linear's. Differentiable in x and all three weights. recompute=False (the
    default) keeps the gate and up projections for the backward (2 buffers of size [..., intermediate], eager
    keeps 4), which turns them into its own buffers in place: it runs once per forward. recompute=True
    keeps nothing of that size and recomputes the two projections in the backward (two more GEMMs), for the
    lowest memory across many layers, a backward that may run again (retain_graph), and activation
    checkpointing with use_reentrant=False (whose saved-tensor hooks do not see the kept projections, which
    stay on the autograd node); within one MLP both peak alike."""
    key, shortcut = _shortcuts.find((x, gate_weight, up_weight, down_weight),
                                    (recompute, activation, _gemm.tf32_key(x)))
    if shortcut is not None:
        return shortcut(x, gate_weight, up_weight, down_weight)
    if activation not in ACTIVATIONS:
        raise ValueError(f"swiglu_mlp: argument 'activation' must be one of {ACTIVATIONS}, got {activation!r}")
    for name, t in (("x", x), ("gate_weight", gate_weight), ("up_weight", up_weight), ("down_weight", down_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"swiglu_mlp: argument '{name}' must be a Tensor, got {type(t).__name__}")
        if name != "x" and t.dim() != 2:
            raise RuntimeError(f"swiglu_mlp: argument '{name}' must be 2-D, got {t.dim()}-D")
    if x.dim() == 0:
        raise RuntimeError("swiglu_mlp: argument 'x' must be at least 1-D, got 0-D")
    x, gate_weight, up_weight, down_weight = _gemm.autocast(x, gate_weight, up_weight, down_weight)
    _gemm.check_operands("swiglu_mlp", x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    K = x.shape[-1]
    N = gate_weight.shape[0]
    if gate_weight.shape[1] != K:
        raise RuntimeError(f"swiglu_mlp: 'gate_weight' {tuple(gate_weight.shape)} does not match the hidden size "
                           f"{K} of 'x' {tuple(x.shape)}")
    if up_weight.shape != gate_weight.shape:
        raise RuntimeError(f"swiglu_mlp: 'up_weight' {tuple(up_weight.shape)} must have the shape of "
                           f"'gate_weight' {tuple(gate_weight.shape)}")
    if down_weight.shape != (K, N):
        raise RuntimeError(f"swiglu_mlp: 'down_weight' must have shape ({K}, {N}) (hidden, intermediate), "
                           f"got {tuple(down_weight.shape)}")
    rows = math.prod(x.shape[:-1])
    # Leading dims flatten into rows: a view whenever they collapse, a copy only otherwise; the kernel
    # reads x with any row and column stride.
    x2 = x.reshape(rows, K)
    if key is None or key[0] is not None:  # (no shortcut may serve the call, or autograd records it)
        y = _SwiGLUFunction.apply(x2, gate_weight, up_weight, down_weight, bool(recompute), activation)
        _shortcuts.keep(key, lambda: _SwiGLUShortcut.make(x2, gate_weight, up_weight, down_weight, x, y,
                                                          bool(recompute), activation, key[0]), grad=True)
    else:  # no autograd: the forward's launch and the down projection
        h = _swiglu_fwd(x2, gate_weight, up_weight, False, activation)[0]
        y = linear(h, down_weight)
        _shortcuts.keep(key, lambda: _swiglu_shortcut(x2, gate_weight, up_weight, h, x, y.view(*x.shape[:-1], K),
                                                      activation))
    return y.view(*x.shape[:-1], K)


def _swiglu_shortcut(x2, gate_weight, up_weight, h, x, y, act: str):
    """swiglu_mlp's later eager calls of this signature (`Shortcuts`): (x, gate_weight, up_weight, down_weight,
    recompute) -> y, the forward's plan on x at its address (None where x's rows are a copy) into a new h, then
    linear (its own shortcut) into y's shape."""
    if h.numel() == 0 or x2.data_ptr() != x.data_ptr():
        return None
    run = _launch_plan(x2, gate_weight, up_weight, h, None, None, None, None, False, act, None, False)[0]
    h_shape, shape, dtype, device = h.shape, y.shape, h.dtype, h.device

    def shortcut(x, gate_weight, up_weight, down_weight, recompute=False):
        h = torch.empty(h_shape, dtype=dtype, device=device)
        run(x, gate_weight, up_weight, h, h, h, h, h)
        return linear(h, down_weight).view(shape)
    return shortcut


class _SwiGLUShortcut(Differentiable):
    """swiglu_mlp's later eager calls of this signature where autograd records them (`Differentiable`): the
    forward's plan on x at its address (the pre-activations kept on ctx unless recompute), the down projection
    through linear's shortcut into y's shape; the backward as the op's own (`_backward`) through the products and
    the elementwise pass planned per layout of dy (`_backward_plan`), dx in x's shape."""

    def __init__(self, run, down, h_shape, x_shape, save: bool, act: str, needs):
        super().__init__()
        self.run, self.down, self.h_shape, self.x_shape, self.save, self.needs = \
            run, down, h_shape, x_shape, save, needs
        self.act = act

    @staticmethod
    def make(x2, gate_weight, up_weight, down_weight, x, y, recompute: bool, act: str, needs):
        """The shortcut; None where x's rows are a copy or there is no work."""
        if y.numel() == 0 or gate_weight.shape[0] == 0 or x2.data_ptr() != x.data_ptr():
            return None
        h = x2.new_empty((x2.shape[0], gate_weight.shape[0]))
        save = not recompute
        run = _launch_plan(x2, gate_weight, up_weight, h, None, None, h if save else None, h if save else None, save,
                           act, None, False)[0]
        down = linear_shortcut(h, down_weight) or linear  # (linear's own path where it keeps no shortcut: tf32)
        return _SwiGLUShortcut(run, down, h.shape, x.shape, save, act, needs)

    def forward(self, ctx, x, gate_weight, up_weight, down_weight):
        h = torch.empty(self.h_shape, dtype=x.dtype, device=x.device)
        g, u = (torch.empty_like(h), torch.empty_like(h)) if self.save else (h, h)
        self.run(x, gate_weight, up_weight, h, h, h, g, u)
        ctx.save_for_backward(x.view(self.h_shape[0], x.shape[-1]), gate_weight, up_weight, down_weight)
        ctx.act, ctx.saved_mode, ctx.pre_activations = self.act, self.save, [g, u] if self.save else None
        return self.down(h, down_weight).view(self.x_shape)

    def backward(self, ctx, dy):
        dy, saved = dy.reshape(self.h_shape[0], self.x_shape[-1]), ctx.saved_tensors
        planned = _OWN
        if not (torch.is_grad_enabled() or torch.is_autocast_enabled(_runtime.KERNEL_DEVICE)):  # (where matmul's
            # own path records its products or casts their operands, the backward takes it)
            planned = self.backward_plan((dy,), lambda: self._backward_plan(ctx, dy, *saved)) or _OWN
        dx, d_gate, d_up, d_down = _backward(ctx, saved, dy, self.needs, planned)
        return None if dx is None else dx.view(self.x_shape), d_gate, d_up, d_down

    def _backward_plan(self, ctx, dy, x, gate_weight, up_weight, down_weight):
        """`_backward`'s planned for a dy [M, K] of this layout: matmul's shortcuts of the six products (h, du and
        dg are new contiguous [M, N] tensors) and the elementwise pass's plan; None where matmul keeps no shortcut
        of a product wanted. Plans read shapes, strides and alignment only: one contiguous [M, N] tensor stands for
        dg, h and du (a kept pre-activation where there is one), so that planning adds no memory at the peak."""
        need_x, need_g, need_u, need_d = self.needs
        dg = ctx.pre_activations[0] if self.save and ctx.pre_activations else dy.new_empty(self.h_shape)
        products = []
        for a, b, need in ((dy, down_weight, True), (dy.mT, dg, need_d), (dg, gate_weight, need_x),
                           (dg.mT, x, need_g), (dg, up_weight, need_x), (dg.mT, x, need_u)):
            product = matmul_shortcut(a, b) if need else None
            if need and product is None:
                return None
            products.append(product)
        if self.save:
            run = _launch_plan(None, None, None, None, dg, None, dg, dg, False, self.act, None, False)[0]

            def bwd_saved(g, u, dh, act):
                run(g, g, g, g, dh, g, g, u)
                _written(g, u, dh)
            return tuple(products), None, bwd_saved
        run = _launch_plan(x, gate_weight, up_weight, dg, dg, dg, None, None, False, self.act, None, False)[0]

        def bwd(x, gate_weight, up_weight, dh, act):
            h, du = torch.empty_like(dh), torch.empty_like(dh)
            run(x, gate_weight, up_weight, h, dh, du, h, h)
            return h, du
        return tuple(products), bwd, None
