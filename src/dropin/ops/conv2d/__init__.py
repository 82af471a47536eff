"""2-D convolution (torch.nn.functional.conv2d semantics) with a fused bias + activation epilogue; fwd and bwd.

Each pass (forward, input gradient, weight gradient) plans once per signature: it gathers the candidates of the
kernel families that take the problem, lets the tuner pick one (`planning.pick`) and keeps the launch:
- `implicit_gemm`: every conv, any strides and groups, tl.dot tiles over pixels x channels (the rows kernel for
  fewer than 16 channels a group);
- `depthwise`: one input channel per group, direct kernels with fp32 FMAs, and walks down the rows for a 3x3;
- `tma`: Hopper, one group, x and w dense channels_last, tensor descriptors (the input gradient of a stride-1
  conv as its forward over dz); the forward also over channels_last copies of x and w, rounded where tf32 is
  used (NCHW x, tf32).
The activation's and the bias's gradients are one kernel here (`_conv_act_grad_kernel`, per-tile column sums).
float32 follows torch's rule for convolutions: tf32 when `torch.backends.cudnn.allow_tf32` (torch's default:
True) is set, otherwise true fp32 as tf32x3 (`planning.precision`).
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ... import _runtime
from .. import _autotune, _gemm
from .._common import column_sums_run, empty_in, is_channels_last, pixel
from .._dispatch import Checks, Differentiable, Launch, Shortcuts, absent, aligned, plan, switch, torch_op, writing
from ..activations import (INPUT_LAYOUT_GRADS, activation_grad, activation_ref, derivative_at,
                           stores_preactivation)
from ..matmul import ProductShortcut, canonical_product, product_shortcut
from . import depthwise, implicit_gemm, planning, tma
from .args import check_conv2d, check_out, conv_args
from .planning import conv_out_hw
from .tiles import conv_tap
from .weights import derived, fold_batchnorm, frozen

__all__ = ["conv2d", "conv2d_ref", "fold_batchnorm", "frozen", "conv_args", "conv_out_hw", "conv_tap"]

_plans: dict = {}


# --- 1. Reference ----------------------------------------------------------------------------------------

def conv2d_ref(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, activation=None, residual=None):
    y = F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    return activation_ref(y if residual is None else y + residual, activation)


# --- 2. Kernel (the kernel families' own live in their modules) -------------------------------------------

@triton.jit
def _conv_act_grad_kernel(dy_ptr, z_ptr, dz_ptr, part_ptr,
                          COUT, OH, OW, P,
                          sdn, sdc, sdh, sdw, szn, szc, szh, szw,
                          ACT: tl.constexpr, COL_SUM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """dz = dy * act'(z) (dz and z share y's strides; skipped for ACT "none") and, with COL_SUM, the sum of
    dz over this program's pixels into part[pid_p, c] (fp32); grid (programs over the pixel tiles, each taking
    every num_programs(0)-th tile, channel tiles)."""
    pid_p = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < COUT
    cc = offs_c.to(tl.int64)[None, :]
    col = tl.zeros((BLOCK_C,), dtype=tl.float32)
    offs_p = pid_p.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    step = tl.num_programs(0).to(tl.int64) * BLOCK_P
    for _ in range(pid_p, tl.cdiv(P, BLOCK_P), tl.num_programs(0)):
        mask = (offs_p < P)[:, None] & c_ok[None, :]
        n, oh, ow = pixel(offs_p, OH, OW)
        dy = tl.load(dy_ptr + (n * sdn + oh * sdh + ow * sdw)[:, None] + cc * sdc, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        if ACT != "none":
            offs_z = (n * szn + oh * szh + ow * szw)[:, None] + cc * szc
            z = tl.load(z_ptr + offs_z, mask=mask, other=0.0).to(tl.float32)
            dy = dy * activation_grad(z, ACT)
            tl.store(dz_ptr + offs_z, dy.to(dz_ptr.dtype.element_ty), mask=mask)
        if COL_SUM:
            col += tl.sum(tl.where(mask, dy, 0.0), axis=0)
        offs_p += step
    if COL_SUM:
        tl.store(part_ptr + pid_p * COUT + offs_c, col, mask=c_ok)


# --- 3. Launchers ----------------------------------------------------------------------------------------

def _fwd_impl(x, w, bias, residual, stride, padding, dilation, groups: int, activation: str, save_preact: bool,
              out: Optional[torch.Tensor] = None, traced: bool = False):
    """(y, z): y into `out` where given (any strides; not with save_preact). traced: under torch.compile
    (`_dispatch`)."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = planning.dims(x, w, stride, padding, dilation, groups)
    fmt = planning.out_format(x, w)
    y = out if out is not None else empty_in((N, COUT_G * groups, OH, OW), fmt, x.dtype, x.device)
    z = torch.empty_like(y) if save_preact else y.new_empty(0)
    if y.numel() == 0:
        return y, z
    if C_G * KH * KW == 0:  # an empty reduction: bias (and residual) only
        y.copy_((bias if bias is not None else y.new_zeros(1)).view(1, -1, 1, 1).expand_as(y))
        y.add_(residual) if residual is not None else None
        z.copy_(y) if save_preact else None
        y.copy_(activation_ref(y, None if activation == "none" else activation))
        return y, z
    run, tensors = _fwd_plan(x, w, y, z, bias, residual, stride, padding, dilation, groups, activation, save_preact,
                             traced)
    run(*tensors)
    return y, z


def _fwd_plan(x, w, y, z, bias, residual, stride, padding, dilation, groups: int, activation: str,
              save_preact: bool, traced: bool):
    """(run, tensors): the forward's plan for this signature, run(*tensors), and its tensors (x, w, y, bias, z,
    residual; absent stand-ins for unused ones)."""
    dims = planning.dims(x, w, stride, padding, dilation, groups)
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    fmt = planning.out_format(x, w)
    precision = planning.precision(x.dtype, C_G * KH * KW)
    r = y if residual is None else residual
    key = ("fwd", x.shape, x.stride(), w.shape, w.stride(), y.stride(), r.stride(), x.dtype, x.device,
           *(None if t is None else aligned(t, traced) for t in (x, w, y, bias, residual)),
           stride, padding, dilation, groups, activation, save_preact, precision, fmt)
    tensors = (x, w, y, absent(y, traced) if bias is None else bias, z if save_preact else absent(y, traced),
               absent(y, traced) if residual is None else residual)

    def make():
        P = N * OH * OW
        rows = implicit_gemm.rows_fit(dims, groups, padding, x.element_size())  # a padded copy of x, few channels
        epilogue = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACT=activation,
                        STORE_Z=save_preact)

        def launcher(cfg):
            cfg = dict(cfg)
            kernel = cfg.pop("KERNEL")
            if kernel == "tma":
                return tma.fwd_launcher(cfg, dims, x, y, r, stride, padding, dilation, precision, epilogue, traced)
            if kernel == "tma-staged":
                return tma.staged_fwd_launcher(cfg, dims, x, y, r, stride, padding, dilation, precision, epilogue,
                                               traced)
            if kernel == "walk":
                return depthwise.walk_fwd_launcher(cfg, dims, x, w, y, r, stride, padding, groups, epilogue, traced)
            if kernel == "direct":
                return depthwise.direct_fwd_launcher(cfg, dims, x, w, y, r, stride, padding, dilation, groups,
                                                     epilogue, traced)
            return implicit_gemm.fwd_launcher(kernel, cfg, dims, x, w, y, r, stride, padding, dilation, groups,
                                              precision, epilogue, traced)

        gemm = implicit_gemm.fwd_configs(dims, rows, x.element_size(), precision)
        direct = C_G == 1 and depthwise.direct_fits(x, y, r)
        walk = depthwise.walkable(direct, KH, KW, stride, dilation)
        configs = depthwise.candidates(depthwise.FWD_CONFIGS, gemm, direct, OH, OW, COUT_G * groups,
                                       depthwise.WALK_FWD_CONFIGS if walk else ())
        tma_configs = tma.fwd_configs(x, w, stride, groups, traced)
        tma_staged = tma.staged_fwd_configs(x, stride, groups, precision, bool(tma_configs))
        tma_all = tma_staged + tma_configs if precision == "tf32" else tma_configs + tma_staged
        tma_split = tma.split_configs(tma_all, dims, x.device.index or 0)
        configs = tma_all + configs + tma_split
        # one channel per group is told apart from 2-15 (same bucket): only there is the direct kernel a candidate
        tkey = ("fwd", x.dtype, precision, fmt, KH, KW, stride, rows, residual is not None,
                *map(_autotune.bucket, (P, COUT_G, C_G, groups)), *depthwise.direct_tag(direct, OH, OW),
                *(("tma",) if tma_configs else ()), *(("tma-staged",) if tma_staged else ()),
                *(("walk",) if walk else ()), *(("rows",) if H == 1 else ()),  # (`tma.rows`: other candidates)
                *(("tma-split",) if tma_split else ()))
        return planning.pick("conv2d", tkey, configs, launcher, tensors)

    return plan(_plans, key, make, traced), tensors


def _fwd_shortcut(x, w, y, bias, residual, stride, padding, dilation, groups: int, activation: str, out: bool):
    """conv2d's later eager calls of this signature (`Shortcuts`): (input, weight, bias, residual, out) -> y, the
    forward's plan on a new output laid out as this call's y, or with `out` on the given out after its checks
    (x, w, y, bias, residual: this call's own tensors)."""
    if y.numel() == 0 or x.shape[1] // groups * w.shape[2] * w.shape[3] == 0:
        return None
    run = _fwd_plan(x, w, y, y, bias, residual, stride, padding, dilation, groups, activation, False, False)[0]

    def into(y, x, w, bias, residual, *out):
        run(x, w, y, y if bias is None else bias, y, y if residual is None else residual)
    if not out:
        return writing(y, into)

    def shortcut(x, w, bias, residual, out):
        check_out(out, x, w, bias, residual)
        into(out, x, w, bias, residual)
        return out
    return shortcut


def _dgrad_impl(dz, x, w, stride, padding, dilation, groups: int, traced: bool = False):
    """The gradient of the input x (same strides as x where x is dense, else contiguous). Where the TMA forward
    takes it (`tma.dgrad_as_conv`), or the depthwise 3x3 walk (`depthwise.dgrad_as_walk`), a stride-1 convolution
    of dz; else _conv_dgrad_kernel or the direct kernel."""
    if x.is_contiguous(memory_format=torch.channels_last):  # (a channels_last model's dz is; a copy otherwise)
        dz = dz.contiguous(memory_format=torch.channels_last)
    as_conv = tma.dgrad_as_conv(dz, x, w, stride, padding, dilation, groups, traced)
    if as_conv is not None:
        return _fwd_impl(dz, as_conv[0], None, None, (1, 1), as_conv[1], dilation, 1, "none", False, traced=traced)[0]
    if depthwise.dgrad_as_walk(x, w, stride, padding, dilation, groups):
        dx = _fwd_impl(dz, derived(w, "mirrored", lambda w: w.flip(2, 3), traced), None, None, (1, 1),
                       tuple(2 - p for p in padding), (1, 1), groups, "none", False, traced=traced)[0]
        return dx if dx.stride() == x.stride() else torch.empty_like(x).copy_(dx)  # (dz's layout was not x's)
    dx = torch.empty_like(x)
    if dx.numel() == 0:
        return dx
    if dz.numel() == 0 or w.shape[0] == 0:
        return dx.zero_()
    _dgrad_plan(dz, x, w, dx, stride, padding, dilation, groups, traced)(dz, w, dx)
    return dx


def _dgrad_plan(dz, x, w, dx, stride, padding, dilation, groups: int, traced: bool = False):
    """run(dz, w, dx): `_dgrad_impl`'s general route (no TMA, no walk) for this signature, made once."""
    dims = planning.dims(x, w, stride, padding, dilation, groups)
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    precision = planning.precision(x.dtype, COUT_G * KH * KW)
    key = ("dgrad", dz.shape, dz.stride(), dx.stride(), w.shape, w.stride(), x.shape, x.dtype, x.device,
           *(aligned(t, traced) for t in (dz, w, dx)), stride, padding, dilation, groups, precision)

    def make():
        P = N * H * W

        def launcher(cfg):
            cfg = dict(cfg)
            if cfg.pop("KERNEL") == "direct":
                return depthwise.dgrad_launcher(cfg, dims, dz, w, dx, stride, padding, dilation, groups, traced)
            return implicit_gemm.dgrad_launcher(cfg, dims, dz, w, dx, stride, padding, dilation, groups, precision,
                                                traced)

        gemm = implicit_gemm.dgrad_configs(dims, x.element_size(), precision)
        direct = C_G == 1 and depthwise.direct_fits(dz, dx)
        configs = depthwise.candidates(depthwise.DGRAD_CONFIGS, gemm, direct, H, W, groups)
        tkey = ("dgrad", x.dtype, precision, is_channels_last(x), KH, KW, stride, C_G == 1,
                *map(_autotune.bucket, (P, COUT_G, C_G, groups)), *depthwise.direct_tag(direct, H, W))
        return planning.pick("conv2d", tkey, configs, launcher, (dz, w, dx))

    return plan(_plans, key, make, traced)


def _wgrad_impl(dz, x, w, stride, padding, dilation, groups: int, traced: bool = False):
    """The gradient of the weight w (same strides as w where w is dense, else contiguous)."""
    if x.is_contiguous(memory_format=torch.channels_last):  # (a channels_last model's dz is; a copy otherwise)
        dz = dz.contiguous(memory_format=torch.channels_last)
    dw = torch.empty_like(w)
    if dw.numel() == 0:
        return dw
    if dz.numel() == 0:
        return dw.zero_()
    _wgrad_plan(dz, x, w, dw, stride, padding, dilation, groups, traced)(dz, x, dw)
    return dw


def _wgrad_plan(dz, x, w, dw, stride, padding, dilation, groups: int, traced: bool = False):
    """run(dz, x, dw): `_wgrad_impl`'s plan for this signature, made once."""
    dims = planning.dims(x, w, stride, padding, dilation, groups)
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    precision = planning.precision(x.dtype, N * OH * OW)
    key = ("wgrad", dz.shape, dz.stride(), x.shape, x.stride(), w.shape, dw.stride(), x.dtype, x.device,
           *(aligned(t, traced) for t in (dz, x, dw)), stride, padding, dilation, groups, precision)

    def make():
        P = N * OH * OW
        if P >= 2**31:
            raise RuntimeError(f"conv2d: dropin's weight gradient takes fewer than 2^31 output pixels, got N*OH*OW "
                               f"= {P}")

        def launcher(cfg):
            cfg = dict(cfg)
            kernel = cfg.pop("KERNEL")
            if kernel == "tma":
                return tma.wgrad_launcher(cfg, dims, x, stride, padding, dilation, precision, traced)
            if kernel in ("direct", "walk"):
                return depthwise.wgrad_launcher(kernel, cfg, dims, dz, x, dw, stride, padding, dilation, groups,
                                                traced)
            return implicit_gemm.wgrad_launcher(cfg, dims, dz, x, w, dw, stride, padding, dilation, groups,
                                                precision, traced)

        gemm = implicit_gemm.wgrad_configs(dims, x.element_size(), precision)
        direct = C_G == 1 and depthwise.direct_fits(dz, x)
        walk = depthwise.walkable(direct, KH, KW, stride, dilation)
        tma_configs = tma.wgrad_configs(dz, x, stride, groups, precision, traced)
        configs = tma_configs + [c for c in depthwise.candidates(
            depthwise.WGRAD_CONFIGS, gemm, direct, OH, OW, groups * COUT_G,
            depthwise.WALK_WGRAD_CONFIGS if walk else ()) if depthwise.wgrad_fits(c, dims, groups)]
        tkey = ("wgrad", x.dtype, precision, is_channels_last(x), KH, KW, stride, C_G == 1,
                *map(_autotune.bucket, (P, COUT_G, C_G, groups)), *depthwise.direct_tag(direct, OH, OW),
                *(("tma",) if tma_configs else ()), *(("walk",) if walk else ()), *(("rows",) if H == 1 else ()))
        return planning.pick("conv2d", tkey, configs, launcher, (dz, x, dw))

    return plan(_plans, key, make, traced)


def _act_grad_impl(dy, z, activation: str, bias_grad: bool, traced: bool = False):
    """(dz, dbias) for y = act(z): dz in z's strides (empty for activation "none", where it is dy) and the
    bias gradient (empty unless bias_grad)."""
    if traced:
        return _act_grad_plan(dy, z, activation, bias_grad, traced)(dy, z)
    key = ("act_grad", dy.shape, dy.stride(), z.stride(), dy.dtype, dy.device, aligned(dy), aligned(z), activation,
           bias_grad)
    return plan(_plans, key, lambda: _act_grad_plan(dy, z, activation, bias_grad, traced))(dy, z)


def _act_grad_plan(dy, z, activation: str, bias_grad: bool, traced: bool):
    """`_act_grad_impl`'s launch for this signature: run(dy, z) -> (dz, dbias)."""
    N, COUT, OH, OW = dy.shape
    act = activation != "none"
    P = N * OH * OW
    block_p, block_c = 64, min(64, _runtime.next_power_of_2(max(COUT, 1)))
    # one program a pixel tile, as many as the fp32 partials [programs, COUT] in planning.WORKSPACE allow
    tiles_p = torch.sym_min(_runtime.cdiv(P, block_p), max(1, planning.WORKSPACE // (4 * max(COUT, 1))))
    grad = Launch(_conv_act_grad_kernel, (tiles_p, _runtime.cdiv(COUT, block_c)),
                  dict(ACT=activation, COL_SUM=bias_grad, BLOCK_P=block_p, BLOCK_C=block_c), traced=traced)
    scalars = (COUT, OH, OW, P, *dy.stride(), *(z if act else dy).stride())
    sums = column_sums_run(tiles_p, COUT, traced) if bias_grad else None

    def run(dy, z):
        dz = torch.empty_like(z) if act else dy.new_empty(0)
        part = torch.empty((tiles_p, COUT) if bias_grad else (0,), device=dy.device, dtype=torch.float32)
        if P * COUT > 0:
            grad(dy, z if act else absent(dy, traced), dz if act else absent(dy, traced), part, *scalars)
        if not bias_grad:
            return dz, dy.new_empty(0)
        return dz, sums(part, dy.new_empty(COUT)) if P * COUT > 0 else dy.new_zeros(COUT)
    return run


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ---------------------------------

@torch_op("dropin::conv2d", mutates_args=())
def _fwd_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
            stride: list[int], padding: list[int], dilation: list[int], groups: int, activation: str,
            save_preact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _fwd_impl(x, w, bias, residual, tuple(stride), tuple(padding), tuple(dilation), groups, activation,
                     save_preact, traced=True)


@torch_op("dropin::conv2d_out", mutates_args=("out",))
def _fwd_out_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
                stride: list[int], padding: list[int], dilation: list[int], groups: int, activation: str,
                out: torch.Tensor) -> None:
    _fwd_impl(x, w, bias, residual, tuple(stride), tuple(padding), tuple(dilation), groups, activation, False, out,
              traced=True)


@torch_op("dropin::conv2d_dgrad", mutates_args=())
def _dgrad_op(dz: torch.Tensor, x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
              dilation: list[int], groups: int) -> torch.Tensor:
    return _dgrad_impl(dz, x, w, tuple(stride), tuple(padding), tuple(dilation), groups, traced=True)


@torch_op("dropin::conv2d_wgrad", mutates_args=())
def _wgrad_op(dz: torch.Tensor, x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
              dilation: list[int], groups: int) -> torch.Tensor:
    return _wgrad_impl(dz, x, w, tuple(stride), tuple(padding), tuple(dilation), groups, traced=True)


@torch_op("dropin::conv2d_act_grad", mutates_args=())
def _act_grad_op(dy: torch.Tensor, z: torch.Tensor, activation: str,
                 bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _act_grad_impl(dy, z, activation, bias_grad, traced=True)


_fwd = switch(_fwd_op, _fwd_impl)
_dgrad = switch(_dgrad_op, _dgrad_impl)
_wgrad = switch(_wgrad_op, _wgrad_impl)
_act_grad = switch(_act_grad_op, _act_grad_impl)


# --- 5. Autograd -----------------------------------------------------------------------------------------

class _Conv2dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, residual, stride, padding, dilation, groups, activation):
        save_preact = stores_preactivation(activation, ctx.needs_input_grad[:4])
        y, z = _fwd(x, w, bias, residual, stride, padding, dilation, groups, activation, save_preact)
        ctx.save_for_backward(x, w, derivative_at(activation, z if save_preact else None, y))
        ctx.args = (stride, padding, dilation, groups)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, z = ctx.saved_tensors
        return *_backward(dy, x, w, z, ctx.args, ctx.activation, ctx.needs_input_grad[:4]), None, None, None, None, None


def _backward(dy, x, w, z, args: tuple, activation: str, needs, dgrad=_dgrad, wgrad=_wgrad) -> tuple:
    """The gradients of (x, w, bias, residual) where needs says, for args (stride, padding, dilation, groups);
    dgrad(dz, x, w, *args) and wgrad(...) make the input's and the weight's."""
    need_x, need_w, need_bias, need_residual = needs
    dz, dbias = dy, None
    if activation != "none" or need_bias:
        gz, gbias = _act_grad(dy, dy if z is None else z, activation, need_bias)
        dz = gz if activation != "none" else dy
        dbias = gbias if need_bias else None
    dx = dgrad(dz, x, w, *args) if need_x else None
    dw = wgrad(dz, x, w, *args) if need_w else None
    dres = dz if need_residual else None
    if need_residual and activation not in INPUT_LAYOUT_GRADS and dz.stride() != dy.stride() and (
            dy.is_contiguous() or dy.is_contiguous(memory_format=torch.channels_last)):
        # (torch's: its activation's backward lays the gradient out as a dense dy; relu's and leaky_relu's as their
        # input, the output's layout: dz's)
        dres = torch.empty_like(dy).copy_(dz)
    return dx, dw, dbias, dres


def _backward_run(dy, x, w, z, args: tuple, activation: str, needs):
    """run(dy, x, w, z) -> `_backward`'s gradients for later calls of a `_ConvShortcut` with a dy of this layout:
    the input and weight gradients' plans looked up once, not per call (the depthwise walk's input gradient, which
    mirrors w, through `_dgrad_impl`). A float32 call whose precision setting changed since runs `_backward`."""
    if x.is_contiguous(memory_format=torch.channels_last):  # (the passes read dz so, as the impls copy it)
        def read(dz):
            return dz.contiguous(memory_format=torch.channels_last)
    else:
        def read(dz):
            return dz
    dz = read(torch.empty_like(z) if activation != "none" else dy)  # (dz's layout: made alike on every call)
    stride, padding, dilation, groups = args
    as_conv = tma.dgrad_as_conv(dz, x, w, stride, padding, dilation, groups, False)
    if as_conv is not None:
        dx = empty_in(x.shape, planning.out_format(dz, as_conv[0]), x.dtype, x.device)
        conv = _fwd_plan(dz, as_conv[0], dx, dx, None, None, (1, 1), as_conv[1], dilation, 1, "none", False,
                         False)[0]
        dx_layout = dx.shape, dx.stride()

        def dgrad(dz, x, w, *args):
            dx = torch.empty_strided(*dx_layout, dtype=x.dtype, device=x.device)
            conv(read(dz), tma.flipped(w, False), dx, dx, dx, dx)
            return dx
    elif not depthwise.dgrad_as_walk(x, w, stride, padding, dilation, groups):
        dx_plan = _dgrad_plan(dz, x, w, torch.empty_like(x), *args)

        def dgrad(dz, x, w, *args):
            dx = torch.empty_like(x)
            dx_plan(read(dz), w, dx)
            return dx
    else:
        dgrad = _dgrad_impl
    dw_plan = _wgrad_plan(dz, x, w, torch.empty_like(w), *args)

    def wgrad(dz, x, w, *args):
        dw = torch.empty_like(w)
        dw_plan(read(dz), x, dw)
        return dw
    precision = planning.precision(x.dtype) if x.dtype == torch.float32 else None

    def run(dy, x, w, z):
        if precision is not None and planning.precision(x.dtype) != precision:
            return _backward(dy, x, w, z, args, activation, needs)
        return _backward(dy, x, w, z, args, activation, needs, dgrad, wgrad)
    return run


class _ConvShortcut(Differentiable):
    """conv2d's later eager calls of this signature where autograd records them (`Differentiable`): (input, weight,
    bias, residual, out None) -> y, the forward's plan on a new y (and pre-activation, saved, where an activation's
    gradient is wanted) laid out as this call's; the backward as the op's own with its plans kept per layout of dy
    (`_backward_run`)."""

    def __init__(self, x, w, y, bias, residual, args: tuple, activation: str, needs):
        super().__init__()
        self.save_preact = stores_preactivation(activation, needs)
        self.run = _fwd_plan(x, w, y, torch.empty_like(y) if self.save_preact else y, bias, residual, *args,
                             activation, self.save_preact, False)[0]
        self.y, self.args, self.activation, self.needs = (y.shape, y.stride()), args, activation, needs[:4]

    @staticmethod
    def make(x, w, y, bias, residual, args: tuple, activation: str, needs):
        """The shortcut; None where `_fwd_shortcut` has none."""
        if y.numel() == 0 or x.shape[1] // args[3] * w.shape[2] * w.shape[3] == 0:
            return None
        return _ConvShortcut(x, w, y, bias, residual, args, activation, needs)

    def forward(self, ctx, x, w, bias, residual, out):
        y = torch.empty_strided(*self.y, dtype=x.dtype, device=x.device)
        z = torch.empty_strided(*self.y, dtype=x.dtype, device=x.device) if self.save_preact else y
        self.run(x, w, y, y if bias is None else bias, z, y if residual is None else residual)
        ctx.save_for_backward(x, w, derivative_at(self.activation, z if self.save_preact else None, y))
        return y

    def backward(self, ctx, dy):
        x, w, z = ctx.saved_tensors
        run = self.backward_plan((dy,), lambda: _backward_run(dy, x, w, z, self.args, self.activation, self.needs))
        return *run(dy, x, w, z), None


# --- 6. Public function ----------------------------------------------------------------------------------

_checked = Checks()
_shortcuts = Shortcuts(differentiable=True)


def conv2d(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, stride=1, padding=0,
           dilation=1, groups: int = 1, activation: Optional[str] = None,
           residual: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`activation(F.conv2d(input, weight, bias, stride, padding, dilation, groups) + residual)` in one kernel.

    input [N, C, H, W] or unbatched [C, H, W], any strides (NCHW and channels_last read without copies);
    weight [Cout, C / groups, KH, KW]; bias [Cout] or None; stride / padding / dilation an int or a pair,
    padding also 'valid' or 'same' (stride 1 only, the odd extra pixel on the bottom / right as in torch);
    activation None or one of dropin.ops.activations.ACTIVATIONS ("relu", "gelu", "silu", ...); residual None
    or a tensor of the output's size (e.g. a ResNet block's identity; any strides). With `fold_batchnorm`'s
    weight and bias, conv -> BatchNorm -> (+ identity) -> relu is this one call. float32 / float16 / bfloat16
    (all the same), fp32 accumulation; float32 uses tf32 only where torch's convolutions would
    (`torch.backends.cudnn.allow_tf32`). The output is channels_last when input or weight is. Under torch.autocast
    input, weight, bias and residual are cast to its dtype, as F.conv2d's operands are.

    out: where given, the result is written there and `out` returned (inference only: no argument may require
    grad; any strides, e.g. a slice of a larger buffer, which saves a copy into it; no overlap with an operand)."""
    key, shortcut = _shortcuts.find((input, weight, bias, residual, out),
                                    (stride, padding, dilation, groups, activation, _gemm.tf32_key(input, "conv")))
    if shortcut is not None:
        return shortcut(input, weight, bias, residual, out)
    input, weight, bias, residual = _gemm.autocast(input, weight, bias, residual)
    act, stride, pads, dilation, unbatched = _checked.once(
        (input, weight, bias, residual, out), (stride, padding, dilation, groups, activation),
        lambda: check_conv2d(input, weight, bias, residual, out, stride, padding, dilation, groups, activation))
    if out is not None:
        check_out(out, input, weight, bias, residual)
    x = input.unsqueeze(0) if unbatched else input
    KH, KW = weight.shape[2:]
    if bias is not None and bias.stride(0) != 1:
        bias, key = bias.contiguous(), None  # the kernel reads bias with unit stride (a copy: no shortcut)
    key = None if unbatched else key
    if residual is not None and unbatched:
        residual = residual.unsqueeze(0)
    if out is not None:
        y = out.unsqueeze(0) if unbatched else out
        if torch.compiler.is_compiling():  # the registered op while torch.compile traces, as `switch` picks
            _fwd_out_op(x, weight, bias, residual, stride, pads, dilation, groups, act, y)
        else:
            _fwd_impl(x, weight, bias, residual, stride, pads, dilation, groups, act, False, y)
            _shortcuts.keep(key, lambda: _fwd_shortcut(x, weight, y, bias, residual, stride, pads, dilation, groups,
                                                       act, out=True))
        return out
    if (KH, KW, groups) == (1, 1, 1) and stride == (1, 1) and pads == (0, 0, 0, 0) and residual is None:
        pixels = x.permute(0, 2, 3, 1)
        if pixels.is_contiguous() and planning.out_format(x, weight) == torch.channels_last and (
                x.dtype != torch.float32 or planning.precision(x.dtype) == _gemm.precision(x.dtype)):
            # A 1x1 conv over channels_last pixels is a GEMM [N*H*W, C] x [C, Cout]: matmul's kernels (TMA on
            # Hopper), bias and activation fused, its autograd; the output is channels_last as torch's is (an x
            # dense both ways, e.g. of one channel, is NCHW to torch unless the weight is channels_last).
            # (matmul's product directly, not linear: the checks are done, and a call's CPU time counts here)
            (n, h, w, c), cout = pixels.shape, weight.shape[0]
            operands = (pixels.reshape(1, n * h * w, c), weight.reshape(cout, c).t().unsqueeze(0), bias)
            product = canonical_product(*operands, act)
            y = product.view(n, h, w, cout).permute(0, 3, 1, 2)
            if product.requires_grad:
                rows, w_shape = operands[0].shape, weight.shape  # (the lambdas hold no tensor: they are kept)
                _shortcuts.keep(key, lambda: ProductShortcut.make(
                    operands, (x, weight, bias), key[0], product, y, act,
                    lambda g, i: g.view(n, h, w, c).permute(0, 3, 1, 2) if i == 0 else g[0].t().reshape(w_shape)
                    if i == 1 else g, lambda dy: dy.permute(0, 2, 3, 1).reshape(rows[:2] + (cout,))), grad=True)
            else:
                _shortcuts.keep(key, lambda: product_shortcut(operands, (x, weight, bias), product, act, y))
            return y.squeeze(0) if unbatched else y
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, residual)):
        y = _Conv2dFunction.apply(x, weight, bias, residual, stride, pads, dilation, groups, act)
        _shortcuts.keep(key, lambda: _ConvShortcut.make(x, weight, y, bias, residual, (stride, pads, dilation, groups),
                                                        act, key[0]), grad=True)
    else:
        y = _fwd(x, weight, bias, residual, stride, pads, dilation, groups, act, False)[0]
        _shortcuts.keep(key, lambda: _fwd_shortcut(x, weight, y, bias, residual, stride, pads, dilation, groups, act,
                                                   out=False))
    return y.squeeze(0) if unbatched else y
