"""Group normalization (torch.nn.functional.group_norm semantics) with an optional fused activation; forward and
backward.

input [N, C, *spatial] is read through its strides as [N, C, P] (P the spatial dims merged: NCHW, channels_last
and other views whose spatial dims merge; the rest is copied once). Group (n, g) is the CG = C / num_groups
channels g * CG ... of sample n times the P pixels, cut into tiles of BLOCK_C channels x BLOCK_P pixels; statistics
in fp32. Forward, two kernels:
- `_gn_stats_kernel`: per tile, its element count, mean and centred sum of squares (in registers: no
  E[x^2] - E[x]^2 cancellation).
- `_gn_apply_kernel`: merges its group's tile statistics (Chan's formula), y = act((x - mean) * rstd * w + b); the
  group's first tile keeps mean and rstd for the backward.
Backward, two kernels on the same tiles: `_gn_bwd_reduce_kernel` sums w * dy' and w * dy' * xhat per tile (dy' =
dy * act'(z), z the recomputed pre-activation) and the per-channel partial sums of dy' * xhat and dy' (the weight
and bias gradients, summed by `_common.column_sums`: deterministic, no atomics); `_gn_bwd_apply_kernel` writes
dx = rstd * (w dy' - mean(w dy') - xhat * mean(w dy' xhat)). Outputs and dx are in input's memory format
(channels_last stays channels_last, as torch's CPU kernel gives it).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from ._common import check_float, column_sums, empty_in, is_channels_last, merge_dims
from ._dispatch import (Checks, Differentiable, Launch, Shortcuts, absent, aligned, plan, switch, torch_op,
                        writing)
from .activations import activation_grad, activation_ref, apply_activation, check_activation

# --- 1. Reference ----------------------------------------------------------------------------------------

def group_norm_ref(input, num_groups, weight=None, bias=None, eps=1e-5, activation=None):
    return activation_ref(F.group_norm(input, num_groups, weight, bias, eps), activation)


# --- 2. Kernels ------------------------------------------------------------------------------------------

@triton.jit
def _tile(ng, t, G, CG, P, TP, sn, sc, sp, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """(offsets, mask, channels, their mask) of tile t of group ng = n * G + g, in a tensor of strides sn, sc,
    sp."""
    c = (t // TP) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = ((t % TP) * BLOCK_P + tl.arange(0, BLOCK_P)).to(tl.int64)
    ch = (ng % G) * CG + c
    offsets = (ng // G) * sn + (ch.to(tl.int64) * sc)[:, None] + (p * sp)[None, :]
    return offsets, (c < CG)[:, None] & (p < P)[None, :], ch, c < CG


@triton.jit
def _affine(xhat, w_ptr, b_ptr, ch, c_ok, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """xhat * w + b per channel (fp32)."""
    z = xhat
    if HAS_W:
        z = z * tl.load(w_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_B:
        z = z + tl.load(b_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    return z


@triton.jit
def _gn_stats_kernel(x_ptr, part_ptr, G, CG, P, TP, sxn, sxc, sxp,
                     BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """part[ng, t] = (count, mean, centred sum of squares) of tile t of group ng (fp32); grid (N * G, tiles)."""
    ng = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    offsets, mask, _, _ = _tile(ng, t, G, CG, P, TP, sxn, sxc, sxp, BLOCK_C, BLOCK_P)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    count = tl.sum(tl.sum(mask.to(tl.float32), axis=1), axis=0)
    mean = tl.div_rn(tl.sum(tl.sum(x, axis=1), axis=0), count)
    d = tl.where(mask, x - mean, 0.0)
    part = part_ptr + (ng * tl.num_programs(1) + t) * 3
    tl.store(part, count)
    tl.store(part + 1, mean)
    tl.store(part + 2, tl.sum(tl.sum(d * d, axis=1), axis=0))


@triton.jit
def _gn_apply_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, mean_ptr, rstd_ptr,
                     G, CG, P, TP, sxn, sxc, sxp, syn, syc, syp, eps,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr, ACT: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr):
    """y = act((x - mean) * rstd * w + b) on tile t of group ng, the group's statistics merged from part (Chan's
    formula, fp32); with STATS, tile 0 stores mean and rstd [N * G]; grid (N * G, tiles)."""
    eps = tl.cast(eps, tl.float32)  # (Inductor passes Python floats as fp64)
    ng = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    T = tl.num_programs(1)
    group = part_ptr + ng * T * 3
    counts = tl.zeros((BLOCK_T,), tl.float32)
    sums = tl.zeros((BLOCK_T,), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        i = t0 + tl.arange(0, BLOCK_T)
        count = tl.load(group + i * 3, mask=i < T, other=0.0)
        counts += count
        sums += count * tl.load(group + i * 3 + 1, mask=i < T, other=0.0)
    n = tl.sum(counts, axis=0)
    mean = tl.div_rn(tl.sum(sums, axis=0), n)  # per-group scalars correctly rounded (plain / and sqrt approximate)
    squares = tl.zeros((BLOCK_T,), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        i = t0 + tl.arange(0, BLOCK_T)
        d = tl.load(group + i * 3 + 1, mask=i < T, other=0.0) - mean
        squares += tl.load(group + i * 3 + 2, mask=i < T, other=0.0) + tl.load(group + i * 3, mask=i < T,
                                                                               other=0.0) * d * d
    rstd = tl.div_rn(n * 0.0 + 1.0, tl.sqrt_rn(tl.div_rn(tl.sum(squares, axis=0), n) + eps))
    offsets, mask, ch, c_ok = _tile(ng, t, G, CG, P, TP, sxn, sxc, sxp, BLOCK_C, BLOCK_P)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = apply_activation(_affine((x - mean) * rstd, w_ptr, b_ptr, ch, c_ok, HAS_W, HAS_B), ACT)
    y_offsets, _, _, _ = _tile(ng, t, G, CG, P, TP, syn, syc, syp, BLOCK_C, BLOCK_P)
    tl.store(y_ptr + y_offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    if STATS:
        if t == 0:
            tl.store(mean_ptr + ng, mean)
            tl.store(rstd_ptr + ng, rstd)


@triton.jit
def _grad_tile(x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, ng, t, G, CG, P, TP, sxn, sxc, sxp, sdn, sdc, sdp,
               HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """(xhat, dy', w * dy', rstd, mask) of a tile (fp32, 0 outside the mask): dy' = dy * act'(z)."""
    mean = tl.load(mean_ptr + ng)
    rstd = tl.load(rstd_ptr + ng)
    offsets, mask, ch, c_ok = _tile(ng, t, G, CG, P, TP, sxn, sxc, sxp, BLOCK_C, BLOCK_P)
    dy_offsets, _, _, _ = _tile(ng, t, G, CG, P, TP, sdn, sdc, sdp, BLOCK_C, BLOCK_P)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + dy_offsets, mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    if ACT != "none":
        dy = tl.where(mask, dy * activation_grad(_affine(xhat, w_ptr, b_ptr, ch, c_ok, HAS_W, HAS_B), ACT), 0.0)
    wdy = dy
    if HAS_W:
        wdy = dy * tl.load(w_ptr + ch, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    return xhat, dy, wdy, rstd, mask


@triton.jit
def _gn_bwd_reduce_kernel(x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, part_ptr, cpart_ptr,
                          C, G, CG, P, TP, sxn, sxc, sxp, sdn, sdc, sdp,
                          HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr, PARTIALS: tl.constexpr,
                          BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """part[ng, t] = (sum of w * dy', sum of w * dy' * xhat) over tile t of group ng; with PARTIALS, the tile's
    per-channel sums of dy' * xhat and dy' into cpart[n * TP + pixel tile, 0 / 1, channel] (fp32); grid (N * G,
    tiles)."""
    ng = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    xhat, dy, wdy, _, _ = _grad_tile(x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, ng, t, G, CG, P, TP,
                                     sxn, sxc, sxp, sdn, sdc, sdp, HAS_W, HAS_B, ACT, BLOCK_C, BLOCK_P)
    part = part_ptr + (ng * tl.num_programs(1) + t) * 2
    tl.store(part, tl.sum(tl.sum(wdy, axis=1), axis=0))
    tl.store(part + 1, tl.sum(tl.sum(wdy * xhat, axis=1), axis=0))
    if PARTIALS:
        # (channels from _tile, not from _grad_tile: Inductor's mutation analysis takes a pointer offset by a
        # function's result as written through every pointer that function was passed)
        _, _, ch, c_ok = _tile(ng, t, G, CG, P, TP, sxn, sxc, sxp, BLOCK_C, BLOCK_P)
        row = cpart_ptr + ((ng // G) * TP + t % TP) * 2 * C
        tl.store(row + ch, tl.sum(dy * xhat, axis=1), mask=c_ok)
        tl.store(row + C + ch, tl.sum(dy, axis=1), mask=c_ok)


@triton.jit
def _gn_bwd_apply_kernel(x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, part_ptr, dx_ptr,
                         G, CG, P, TP, sxn, sxc, sxp, sdn, sdc, sdp, son, soc, sop,
                         HAS_W: tl.constexpr, HAS_B: tl.constexpr, ACT: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr):
    """dx = rstd * (w dy' - mean(w dy') - xhat * mean(w dy' xhat)) on tile t of group ng, the group's means from
    part; grid (N * G, tiles)."""
    ng = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    T = tl.num_programs(1)
    group = part_ptr + ng * T * 2
    s1 = tl.zeros((BLOCK_T,), tl.float32)
    s2 = tl.zeros((BLOCK_T,), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        i = t0 + tl.arange(0, BLOCK_T)
        s1 += tl.load(group + i * 2, mask=i < T, other=0.0)
        s2 += tl.load(group + i * 2 + 1, mask=i < T, other=0.0)
    n = tl.sum(tl.zeros((BLOCK_T,), tl.float32), axis=0) + CG * P  # (an fp32 scalar for div_rn)
    c1 = tl.div_rn(tl.sum(s2, axis=0), n)
    c2 = tl.div_rn(tl.sum(s1, axis=0), n)
    xhat, _, wdy, rstd, mask = _grad_tile(x_ptr, dy_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, ng, t, G, CG, P, TP,
                                       sxn, sxc, sxp, sdn, sdc, sdp, HAS_W, HAS_B, ACT, BLOCK_C, BLOCK_P)
    dx = (wdy - xhat * c1 - c2) * rstd
    offsets, _, _, _ = _tile(ng, t, G, CG, P, TP, son, soc, sop, BLOCK_C, BLOCK_P)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


# --- 3. Launchers ----------------------------------------------------------------------------------------

def _strides(t: torch.Tensor):
    """t's (sn, sc, sp) as [N, C, P] with its spatial dims merged into one, or None where they do not merge."""
    spatial = merge_dims(t.shape[2:], t.stride()[2:])
    if len(spatial) > 1:
        return None
    return t.stride(0), t.stride(1), spatial[0][1] if spatial else 1


def _viewed(t: torch.Tensor):
    """(t or a contiguous copy of it, its [N, C, P] strides, whether it is a copy)."""
    strides = _strides(t)
    if strides is None:
        t = t.contiguous()
        return t, _strides(t), True
    return t, strides, False


def _out_like(x: torch.Tensor) -> torch.Tensor:
    """A new tensor of x's shape and dtype in x's memory format (channels_last for a channels_last 4-D x)."""
    fmt = torch.channels_last if is_channels_last(x) else torch.contiguous_format
    return empty_in(x.shape, fmt, x.dtype, x.device)


TILE = 4096  # elements of a tile (at most)
MERGE = 256  # tile statistics merged per step (BLOCK_T at most)


def _geometry(x: torch.Tensor, groups: int) -> dict:
    """Sizes and tiles: N, C, G, CG, P, TP, the number of tiles T per group and the launch constexprs."""
    N, C = x.shape[:2]
    P = math.prod(x.shape[2:])
    CG = C // groups
    block_c = min(_runtime.next_power_of_2(CG), 64, TILE)
    block_p = max(1, min(_runtime.next_power_of_2(P), TILE // block_c))
    TP = _runtime.cdiv(P, block_p)
    T = _runtime.cdiv(CG, block_c) * TP
    return dict(N=N, C=C, G=groups, CG=CG, P=P, TP=TP, T=T,
                tiles=dict(BLOCK_C=block_c, BLOCK_P=block_p, num_warps=4 if block_c * block_p <= 2048 else 8),
                BLOCK_T=min(_runtime.next_power_of_2(T), MERGE))


def _fwd_plan(x, groups: int, w, b, y, eps: float, act: str, stats: bool, traced: bool):
    """(run, copies): the forward's launches for this signature, (mean, rstd) = run(x, w, b, y) (with stats new
    [N * G] fp32, else `absent` stand-ins); copies: whether run reads x from a contiguous copy."""
    _, sx, copies = _viewed(x)
    sy = _strides(y)
    g = _geometry(x, groups)
    NG, T = g["N"] * groups, g["T"]
    stats_launch = Launch(_gn_stats_kernel, (NG, T), g["tiles"], traced=traced)
    apply_launch = Launch(_gn_apply_kernel, (NG, T), dict(HAS_W=w is not None, HAS_B=b is not None, STATS=stats,
                                                           ACT=act, BLOCK_T=g["BLOCK_T"], **g["tiles"]), traced=traced)
    sizes = (groups, g["CG"], g["P"], g["TP"])
    device = x.device

    def run(x, w, b, y):
        x = x.contiguous() if copies else x
        part = torch.empty(NG * T * 3, device=device, dtype=torch.float32)
        if stats:
            mean = torch.empty(NG, device=device, dtype=torch.float32)
            rstd = torch.empty_like(mean)
        else:
            mean, rstd = absent(y, traced), absent(y, traced)
        stats_launch(x, part, *sizes, *sx)
        apply_launch(x, absent(y, traced) if w is None else w, absent(y, traced) if b is None else b, y, part, mean,
                     rstd, *sizes, *sx, *sy, eps)
        return mean, rstd
    return run, copies


_plans: dict = {}


def _fwd_planned(x, groups: int, w, b, y, eps: float, act: str, stats: bool, traced: bool):
    """`_fwd_plan`'s (run, copies) for this signature (x's shape, strides, dtype, device and alignment, the
    parameters' dtypes and alignment; y is laid out by x), made once."""
    key = ("fwd", groups, eps, act, stats, x.shape, x.stride(), x.dtype, x.device, aligned(x, traced),
           *[None if t is None else (t.dtype, aligned(t, traced)) for t in (w, b)])
    return plan(_plans, key, lambda: _fwd_plan(x, groups, w, b, y, eps, act, stats, traced), traced)


def _fwd_impl(x, groups: int, w, b, eps: float, act: str, stats: bool = True, traced: bool = False):
    """(y in x's memory format, mean, rstd [N * G] fp32 with stats, else stand-ins to ignore). traced: under
    torch.compile (`_dispatch`)."""
    y = _out_like(x)
    if x.numel() == 0:
        mean = torch.empty(0, device=x.device, dtype=torch.float32)
        return y, mean, torch.empty_like(mean)
    return y, *_fwd_planned(x, groups, w, b, y, eps, act, stats, traced)[0](x, w, b, y)


def _bwd_plan(dy, x, groups: int, w, b, dx, act: str, wb_dtype: Optional[torch.dtype], traced: bool):
    """The backward's launches for this signature: run(dy, x, w, b, mean, rstd, dx, dwb) writes dx and (wb_dtype not
    None) dwb [2, C]; dy and x read from contiguous copies where their spatial dims do not merge."""
    need_wb = wb_dtype is not None
    _, sx, copies_x = _viewed(x)
    _, sd, copies_dy = _viewed(dy)
    so = _strides(dx)
    g = _geometry(x, groups)
    N, C, NG, T = g["N"], g["C"], g["N"] * groups, g["T"]
    flags = dict(HAS_W=w is not None, HAS_B=b is not None, ACT=act, **g["tiles"])
    reduce_launch = Launch(_gn_bwd_reduce_kernel, (NG, T), dict(PARTIALS=need_wb, **flags), traced=traced)
    apply_launch = Launch(_gn_bwd_apply_kernel, (NG, T), dict(BLOCK_T=g["BLOCK_T"], **flags), traced=traced)
    sizes = (groups, g["CG"], g["P"], g["TP"])
    device = x.device

    def run(dy, x, w, b, mean, rstd, dx, dwb):
        x = x.contiguous() if copies_x else x
        dy = dy.contiguous() if copies_dy else dy
        w_arg, b_arg = (absent(dx, traced) if t is None else t for t in (w, b))
        part = torch.empty(NG * T * 2, device=device, dtype=torch.float32)
        cpart = torch.empty((N * g["TP"], 2 * C), device=device, dtype=torch.float32) if need_wb else \
            absent(mean, traced)
        reduce_launch(x, dy, w_arg, b_arg, mean, rstd, part, cpart, C, *sizes, *sx, *sd)
        apply_launch(x, dy, w_arg, b_arg, mean, rstd, part, dx, *sizes, *sx, *sd, *so)
        if need_wb:
            column_sums(cpart, dwb.view(2 * C), traced)
    return run


def _bwd_impl(dy, x, groups: int, w, b, mean, rstd, act: str, wb_dtype: Optional[torch.dtype],
              traced: bool = False):
    """(dx in x's memory format, [dweight; dbias] [2, C] in wb_dtype, or empty where wb_dtype is None)."""
    dx = _out_like(x)
    C = x.shape[1]
    allocate = torch.empty if x.numel() > 0 else torch.zeros  # (the launches write every element)
    dwb = allocate((2, C), device=x.device, dtype=wb_dtype) if wb_dtype is not None else dx.new_empty(0)
    if x.numel() > 0:
        key = ("bwd", groups, act, wb_dtype, dy.shape, dy.stride(), dy.dtype, aligned(dy, traced), x.stride(),
               x.dtype, x.device, aligned(x, traced), *[None if t is None else (t.dtype, aligned(t, traced))
                                                         for t in (w, b)])
        plan(_plans, key, lambda: _bwd_plan(dy, x, groups, w, b, dx, act, wb_dtype, traced), traced)(
            dy, x, w, b, mean, rstd, dx, dwb)
    return dx, dwb


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) --------------------------------

@torch_op("dropin::group_norm", mutates_args=())
def _fwd_op(x: torch.Tensor, groups: int, w: Optional[torch.Tensor], b: Optional[torch.Tensor], eps: float,
            act: str, stats: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fwd_impl(x, groups, w, b, eps, act, stats, traced=True)


@torch_op("dropin::group_norm_backward", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, groups: int, w: Optional[torch.Tensor], b: Optional[torch.Tensor],
            mean: torch.Tensor, rstd: torch.Tensor, act: str,
            wb_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor]:
    return _bwd_impl(dy, x, groups, w, b, mean, rstd, act, wb_dtype, traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_bwd = switch(_bwd_op, _bwd_impl)


# --- 5. Autograd -----------------------------------------------------------------------------------------

def _wb_dtype(w, b, needs) -> Optional[torch.dtype]:
    """The dtype of the [dweight; dbias] pair (weight's, else bias's), None where neither gradient is needed."""
    return (b.dtype if w is None else w.dtype) if any(needs) else None


class _GroupNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups, w, b, eps, act):
        y, mean, rstd = _fwd(x, groups, w, b, eps, act, True)
        ctx.save_for_backward(x, w, b, mean, rstd)
        ctx.groups, ctx.act = groups, act
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, b, mean, rstd = ctx.saved_tensors
        need_w, need_b = ctx.needs_input_grad[2:4]
        dx, dwb = _bwd(dy, x, ctx.groups, w, b, mean, rstd, ctx.act, _wb_dtype(w, b, (need_w, need_b)))
        return dx, None, dwb[0] if need_w else None, dwb[1].to(b.dtype) if need_b else None, None, None


# --- 6. Public function ----------------------------------------------------------------------------------

def _check_group_norm(input, num_groups, weight, bias, activation) -> str:
    """group_norm's argument checks; the activation's kernel name."""
    op = "group_norm"
    act = check_activation(activation)
    _runtime.check_kernel_device(op, input=input, weight=weight, bias=bias)
    check_float(op, input=input, weight=weight, bias=bias)
    if input.dim() < 2:
        raise RuntimeError(f"{op}: expected 'input' with at least 2 dims [N, C, *], but got input of size "
                           f"{list(input.shape)}")
    C = input.shape[1]
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups <= 0:
        raise RuntimeError(f"{op}: expected 'num_groups' to be a positive int, but got {num_groups!r}")
    if C == 0 or C % num_groups != 0:
        raise RuntimeError(f"{op}: expected the channels of 'input' {list(input.shape)} to be a positive multiple "
                           f"of 'num_groups'={num_groups}")
    # an empty spatial size: torch's CPU kernel refuses it, its CUDA kernel returns the empty result
    if input.numel() == 0 and input.shape[0] != 0 and input.device.type == "cpu":
        raise RuntimeError(f"{op}: expected 'input' with spatial size > 0, but got input of size "
                           f"{list(input.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != C):
            raise RuntimeError(f"{op}: expected '{name}' of size [{C}] (input's channels), but got {name} of size "
                               f"{list(t.shape)}")
    return act


def _contiguous_params(weight, bias):
    return tuple(None if t is None else t.contiguous() for t in (weight, bias))


def _fwd_shortcut(x, groups: int, w, b, eps: float, act: str, y, weight, bias):
    """group_norm's later eager calls of this signature (`Shortcuts`): (input, weight, bias) -> y, the forward's
    plan on a new y; None where there is no work or a copy made x, weight or bias."""
    if x.numel() == 0 or any(t is not None and u.data_ptr() != t.data_ptr() for u, t in ((w, weight), (b, bias))):
        return None
    run, copies = _fwd_planned(x, groups, w, b, y, eps, act, False, False)
    return None if copies else writing(y, lambda y, x, w, b: run(x, w, b, y))


class _GroupNormShortcut(Differentiable):
    """group_norm's later eager calls of this signature where autograd records them (`Differentiable`): (input,
    weight, bias) -> y, the forward's plan with stats (mean and rstd saved), and the backward's for each layout of
    dy, into new dx and [dweight; dbias]."""

    def __init__(self, x, groups: int, w, b, y, eps: float, act: str, needs):
        super().__init__()
        self.forward_run = _fwd_planned(x, groups, w, b, y, eps, act, True, False)[0]
        self.groups, self.act, self.needs = groups, act, needs
        self.wb_dtype = _wb_dtype(w, b, needs[1:])

    @staticmethod
    def make(x, groups: int, w, b, y, eps: float, act: str, needs, weight, bias):
        """The shortcut; None where there is no work or a copy made weight or bias."""
        if x.numel() == 0 or any(t is not None and u.data_ptr() != t.data_ptr() for u, t in ((w, weight), (b, bias))):
            return None
        return _GroupNormShortcut(x, groups, w, b, y, eps, act, needs)

    def forward(self, ctx, x, weight, bias):
        y = _out_like(x)
        mean, rstd = self.forward_run(x, weight, bias, y)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return y

    def backward(self, ctx, dy):
        x, w, b, mean, rstd = ctx.saved_tensors
        dx = _out_like(x)
        run = self.backward_plan((dy,), lambda: _bwd_plan(dy, x, self.groups, w, b, dx, self.act, self.wb_dtype,
                                                          False))
        dwb = dx if self.wb_dtype is None else torch.empty((2, x.shape[1]), device=x.device, dtype=self.wb_dtype)
        run(dy, x, w, b, mean, rstd, dx, dwb)
        need_w, need_b = self.needs[1:]
        return dx, dwb[0] if need_w else None, dwb[1].to(b.dtype) if need_b else None


_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def group_norm(input: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5,
               activation: Optional[str] = None) -> torch.Tensor:
    """`activation(F.group_norm(input, num_groups, weight, bias, eps))`: each sample's C channels split into
    num_groups groups of C / num_groups channels, each group normalized over its channels and spatial elements
    with its fp32 mean and biased variance, then * weight + bias per channel.

    input [N, C, *spatial] (any number of spatial dims, none too), float32 / float16 / bfloat16, read through its
    strides (NCHW, channels_last); weight / bias [C] or None, any of those dtypes; activation None or one
    of dropin.ops.activations.ACTIVATIONS, fused. The output (and input's gradient) is in input's dtype and
    memory format."""
    key, shortcut = _shortcuts.find((input, weight, bias), (num_groups, eps, activation))
    if shortcut is not None:
        return shortcut(input, weight, bias)
    act = _checked.once((input, weight, bias), (num_groups, activation),
                        lambda: _check_group_norm(input, num_groups, weight, bias, activation))
    w, b = _contiguous_params(weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias)):
        y = _GroupNormFunction.apply(input, num_groups, w, b, float(eps), act)
        _shortcuts.keep(key, lambda: _GroupNormShortcut.make(input, num_groups, w, b, y, float(eps), act, key[0],
                                                             weight, bias), grad=True)
        return y
    y = _fwd(input, num_groups, w, b, float(eps), act, False)[0]  # (no autograd: no mean and rstd)
    _shortcuts.keep(key, lambda: _fwd_shortcut(input, num_groups, w, b, float(eps), act, y, weight, bias))
    return y
