"""Matrix products: matmul, bmm and linear with a fused bias + activation epilogue; forward and backward.

Every product is brought to one canonical form, C[b] = act(A[b] @ B[b] + bias), A: [B, M, K] and
B: [B, K, N] with any strides (transposed views cost no copy), accumulated in fp32 by one of two kernels:
- `mm_tma_kernel` (Hopper): persistent grid, TMA tensor descriptors, wgmma. Needs each operand to have
  one unit stride among its two matrix dims and 16-byte aligned other strides (16-bit operands of odd sizes are
  copied so, where the copies pay: `matmul_operands`), and K <= `_gemm.ACC_K` (one MMA accumulator's
  reduction); A and B may each be row- or column-major; C rows not 16-byte aligned are stored through pointers.
- `mm_kernel`: pointer loads with arbitrary strides (0 for broadcast batches too); every other case.
float32 follows torch's own rule: tf32 when `torch.backends.cuda.matmul.allow_tf32` is set, otherwise true fp32:
tf32x3 on the tensor cores for long reductions (`_gemm.precision`; large products on the TMA kernel read copies
split into tf32 parts, "tf32x3_split", or B's alone where both do not fit the copy budget, "tf32x3_split_b"), fp32
FMAs for short ones and under the interpreter.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F

from .. import _runtime
from . import _autotune, _gemm
from ._common import flat_param
from ._dispatch import (Checks, Differentiable, Launch, Shortcuts, absent, aligned, plan, switch, torch_op,
                        writing)
from .activations import FROM_OUTPUT, activation_ref, check_activation, derivative_at, stores_preactivation
from .matmul_configs import (ACCUMULATE_MAX_TILE, FMA_CONFIGS, PTR_CONFIGS, TMA_CONFIGS, TMA_NARROW_CONFIGS,
                             TMA_ROUNDED_CONFIGS, TMA_SPLIT_CONFIGS, deep_split_configs, skinny_configs,
                             tma_split_configs)
from .matmul_kernels import act_grad_kernel, fma_kernel, mm_kernel, mm_tma_kernel, skinny_kernel, split_sum_kernel
from .matmul_operands import aligned_copies_pay, copied_operands, operand_copies, split_copies_pay, tf32_copies_pay


# --- 1. References ----------------------------------------------------------------------------------

def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def bmm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.bmm(a, b)


def linear_ref(x, weight, bias=None, activation=None) -> torch.Tensor:
    return activation_ref(F.linear(x, weight, bias), activation)


# --- 2. Kernels: matmul_kernels.py (their candidate configs: matmul_configs.py)


# --- 3. Launchers -----------------------------------------------------------------------------------

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


def _tma_takes(a, K) -> bool:
    """Whether the TMA kernel runs on a's device (Hopper) and takes a reduction of K: one MMA accumulator's (longer
    K runs the pointer kernels, whose loops add each ACC_K-long share to an fp32 total)."""
    return _runtime.is_hopper(a.device.index or 0) and 0 < _runtime.size_hint(K) <= _gemm.ACC_K.value


_plans: dict = {}


def mm_impl(a, b, bias, activation: str, save_preact: bool, tma: Optional[bool] = None, traced: bool = False,
            accumulate_into: Optional[torch.Tensor] = None):
    """C = act(A @ B + bias) for A [B, M, K], B [B, K, N] (same batch, any strides), bias [N] or None.
    Returns (C, Z): C contiguous [B, M, N]; Z = A @ B + bias when save_preact, else None.
    accumulate_into (a contiguous [B, M, N] of A's dtype): C is that tensor, act(A @ B + bias) added to what it
    holds in fp32 and rounded once (a sum of products over calls, as torch's addmm_; the linear + cross-entropy's
    weight gradient over its chunks of tokens).
    `tma` forces the kernel choice (tests); None picks the TMA kernel wherever it applies.
    The launch plan (kernel, grid, config) is made once per signature and reused: small products are
    bound by launch cost."""
    batch, M, K = a.shape
    N = b.shape[2]
    accumulate = accumulate_into is not None
    c = accumulate_into if accumulate else a.new_empty((batch, M, N))
    z = a.new_empty((batch, M, N)) if save_preact else c  # c stands in for an unused Z
    if c.numel() == 0:
        return c, z if save_preact else None
    a, b, run = _mm_prepared(a, b, c, bias, z, activation, save_preact, tma, traced, accumulate)
    run(a, b, c, absent(c, traced) if bias is None else bias, absent(c, traced) if z is c else z)
    return c, z if save_preact else None


def _mm_prepared(a, b, c, bias, z, activation: str, save_preact: bool, tma: Optional[bool], traced: bool,
                 accumulate: bool = False):
    """(a, b, run): the operands as the kernels read them (copies where they pay: `_operand_copies`) and the
    signature's plan, run(a, b, c, bias, z)."""
    precision, copy_a, copy_b = _operand_copies(a, b, tma, traced)
    a, b = operand_copies(a, b, copy_a, copy_b, traced)
    return a, b, _mm_plan(a, b, c, bias, z, activation, save_preact, tma, precision, traced, accumulate)


def _operand_copies(a, b, tma: Optional[bool], traced: bool):
    """(precision, copy_a, copy_b): the product's precision and, for each operand that the kernels read from a copy
    (`matmul_operands`: rounded to tf32, split into two tf32 parts for true fp32, or aligned for the TMA kernel),
    operand_copy's (round_tf32, split, negate); None for one read as it lies. Decided from the layouts alone."""
    K = a.shape[2]
    precision = _gemm.precision(a.dtype, k=K, macs=math.prod(map(_runtime.size_hint, (*a.shape, b.shape[2]))))
    if precision == "tf32" and K > 0 and tf32_copies_pay(a.shape[1], b.shape[2]):
        # tf32 MMAs read operands K-major, and Hopper's drop the low 13 bits: one pass makes K-major copies
        # rounded to tf32 (cheaper than transposed tiles or rounding every tile in the kernel: 0.38x cuBLAS)
        copied = copied_operands(*a.shape, b.shape[2], 1)
        if copied:
            rounded = (True, False, False)
            return ("tf32_rounded", rounded, rounded) if copied == "ab" else ("tf32_rounded_b", None, rounded)
    elif (tma is None and not traced and precision == "tf32x3" and split_copies_pay(a.shape[1], b.shape[2])
          and _tma_takes(a, K)):
        # true fp32: tf32x3 on copies split into their tf32 parts, which the MMAs read as they lie (the split of
        # every tile in registers ran at 46 TFLOP/s, 0.90x cuBLAS's fp32 at 4096^3); A's of -a (mm_tma_kernel),
        # or B's alone where A's do not fit too (A's tiles split in registers: A read by TMA, copied aligned if
        # need be)
        a_aligned = _tma_layout(a, traced) is None
        copied = copied_operands(*a.shape, b.shape[2], 2, a_aligned)
        split = (False, True, False)
        if copied == "ab":
            return "tf32x3_split", (False, True, True), split
        if copied:
            return "tf32x3_split_b", (False, False, False) if a_aligned else None, split
    if (tma is None and _tma_takes(a, K)
            and aligned_copies_pay(a.shape[0], a.shape[1], b.shape[2], K, a.element_size(), precision)):
        plain = (False, False, False)
        return (precision, None if _tma_layout(a, traced) is not None else plain,
                None if _tma_layout(b, traced) is not None else plain)
    return precision, None, None


# The fewest elements of A for which a matrix-vector product runs transposed (`_mm_plan`): below, launch cost rules
# and the transposition's views would only add host time.
VECTOR_MATRIX_MIN = 1 << 20


def _mm_plan(a, b, c, bias, z, activation: str, save_preact: bool, tma: Optional[bool], precision: str, traced: bool,
             accumulate: bool = False):
    """The plan of a product on operands a and b as the kernels read them: run(a, b, c, bias, z) (accumulate: into
    what c holds). A matrix-vector product (one column, A's rows K-contiguous, no bias) runs as the vector-matrix
    product it transposes to, c^T = b^T a^T, whose vector kernel streams A's rows as a decoding step's linear
    streams its weight (8192 x 8192 @ 8192 x 1 took the 128 x 16 pointer tile: 0.74x cuBLAS on the H200)."""
    if (b.shape[2] == 1 and a.shape[1] > 1 and bias is None and tma is None and not accumulate and a.stride(2) == 1
            and _runtime.size_hint(a.shape[1]) * _runtime.size_hint(a.shape[2]) >= VECTOR_MATRIX_MIN):
        run = _mm_plan(b.mT, a.mT, c.mT, None, z.mT, activation, save_preact, None, precision, traced)
        return lambda a, b, c, bias, z: run(b.mT, a.mT, c.mT, bias, z.mT)
    key = (a.shape, a.stride(), b.shape, b.stride(), a.dtype, a.device, aligned(a, traced), aligned(b, traced),
           None if bias is None else aligned(bias, traced), activation, save_preact, precision, tma, accumulate)
    return plan(_plans, key, lambda: _make_plan(a, b, c, bias, z, activation, save_preact, tma, precision, traced,
                                                accumulate), traced=traced)


def _mm_shortcut(a, b, c, bias, activation: str, save_preact: bool = False):
    """For `Shortcuts`: run(a, b, c, bias, z=None) writes act(a @ b + bias) into c (and a @ b + bias into z with
    save_preact), the eager product of this signature (a, b, c, bias as `mm_impl` takes them; c, a new contiguous
    [B, M, N] output, gives the signature, and z's); None where the call copies its operands (tf32) or has no work."""
    if c.numel() == 0:
        return None
    precision, copy_a, copy_b = _operand_copies(a, b, None, False)
    if copy_a is not None or copy_b is not None:
        return None
    run = _mm_plan(a, b, c, bias, c, activation, save_preact, None, precision, False)
    return lambda a, b, c, bias, z=None: run(a, b, c, c if bias is None else bias, c if z is None else z)


def product_shortcut(operands: tuple, given: tuple, c, activation: str, out):
    """For `Shortcuts`: a product's later eager calls of this signature, given tensors (a, b[, bias[, ...]]) ->
    a new twin of `out`, act(a @ b + bias). `operands` are what this call passed to the product (3-D views, c its
    [B, M, N] result, out the view of c it returned): the plan runs on the given tensors, which start where the
    operands do; None where a copy made an operand, or the product copies its operands (tf32)."""
    if any(o is not None and o.data_ptr() != g.data_ptr() for o, g in zip(operands, given)):
        return None
    mm = _mm_shortcut(*operands[:2], c, operands[2] if len(operands) > 2 else None, activation)
    return None if mm is None else writing(out, lambda y, a, b, bias=None, *unused: mm(a, b, y, bias))


def matmul_shortcut(a, b):
    """The shortcut that `matmul(a, b)` keeps without autograd (a and b at least 2-D), for an op that plans its
    products once per signature: (a, b) -> a new matmul(a, b) for tensors laid out as these; None where matmul
    keeps none."""
    operands, shape = _matmul_operands(a, b)
    c = a.new_empty((operands[0].shape[0], operands[0].shape[1], operands[1].shape[2]))
    return product_shortcut(operands, (a, b), c, "none", c.view(shape))


def linear_shortcut(x, weight):
    """The shortcut that `linear(x, weight)` (2-D weight, no bias, no activation) keeps without autograd: (x,
    weight) -> a new linear(x, weight) for tensors laid out as these; None where linear keeps none."""
    operands = _linear_operands(x, weight)
    c = x.new_empty((1, operands[0].shape[1], weight.shape[0]))
    return product_shortcut(operands, (x, weight), c, "none", c.view(*x.shape[:-1], weight.shape[0]))


def _product_like_run(x, y, like):
    """(run, c): run(x, y, c) writes x @ y into c, a new [B, M, N] product laid out as `_product_like` lays it out,
    for tensors that start where x and y do; run None where the product copies its operands (tf32)."""
    if like.stride(1) == 1 and like.stride(2) != 1:
        c = x.new_empty((x.shape[0], y.shape[2], x.shape[1]))
        mm = _mm_shortcut(y.mT, x.mT, c, None, "none")
        return (None if mm is None else lambda x, y, c: mm(y, x, c, None)), c.mT
    c = x.new_empty((x.shape[0], x.shape[1], y.shape[2]))
    mm = _mm_shortcut(x, y, c, None, "none")
    return (None if mm is None else lambda x, y, c: mm(x, y, c, None)), c


class ProductShortcut(Differentiable):
    """A product's later eager calls of this signature where autograd records them (`Differentiable`): given tensors (a,
    b[, bias]) that start where the product's operands do (`to_given` turns the i-th operand's gradient into the
    given tensor's, `from_out` the output's gradient into the product's [B, M, N]; neither may hold a tensor: the
    shortcut lives in the op's cache). Forward: the plan on a new output laid out as the first call's (and the
    pre-activation, kept where an activation's gradient reads it: `stores_preactivation`; relu's and the like read
    the output). Backward, for each layout of the output's gradient: the activation's and bias's gradient, then one
    planned product per gradient wanted, into new tensors laid out as the op's own path lays them out."""

    def __init__(self, operands, needs, c, out, activation: str, to_given, from_out, mm):
        super().__init__()
        self.operands = [(o.shape, o.stride()) for o in operands[:2]]  # (saved as the op's own path saves them)
        self.needs, self.c_shape, self.activation, self.mm = needs, c.shape, activation, mm  # (no tensor kept)
        self.to_given = to_given
        self.from_out = from_out or (lambda dy, shape=c.shape: dy.reshape(shape))
        self.out = out.shape, out.stride(), out.dtype, out.device
        self.save_preact = stores_preactivation(activation, needs)
        self.from_output = activation in FROM_OUTPUT  # (the backward reads the output: `derivative_at`)

    @staticmethod
    def make(operands, given, needs, c, out, activation: str, to_given, from_out=None):
        """The shortcut; None where an operand is a copy or no product has work, or the product copies its
        operands (tf32)."""
        if any(o is not None and (o.data_ptr() != g.data_ptr() or o.numel() == 0 or o.numel() != g.numel())
               for o, g in zip(operands, given)):
            return None
        save_preact = stores_preactivation(activation, needs)
        mm = _mm_shortcut(*operands[:2], c, operands[2] if len(operands) > 2 else None, activation, save_preact)
        if mm is None:
            return None
        return ProductShortcut(operands, needs, c, out, activation, to_given, from_out, mm)

    def forward(self, ctx, a, b, bias=None, *unused):  # (unused: conv2d's residual and out, None)
        shape, strides, dtype, device = self.out
        y = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        z = torch.empty(self.c_shape, dtype=dtype, device=device) if self.save_preact else None
        self.mm(a, b, y, bias, z)
        # the operands' views (the tensors, shapes and order the op's own path saves: a checkpoint's recomputation
        # served here saves what its first forward saved)
        ctx.save_for_backward(*(t.as_strided(*layout) for t, layout in zip((a, b), self.operands)),
                              self.from_out(y) if self.from_output else z)
        return y

    def backward(self, ctx, dy):
        a3, b3, z = ctx.saved_tensors
        if self.from_output:  # (the activation's gradient reads it as the product's [B, M, N], contiguous)
            z = z.contiguous()
        run = self.backward_plan((dy,), lambda: self._backward_run(dy, a3, b3, z))
        return self._backward(dy, a3, b3, z) if run is None else run(dy, a3, b3, z)

    def _gradient_z(self, dy3, z, act_grad=None):
        """(gz, gbias): the gradient of the pre-activation (dy3 itself without activation) and the bias's; act_grad:
        their plan for dy3's layout (`_act_grad_run`), None: `_act_grad_impl` looks it up."""
        need_bias = (*self.needs, False, False)[2]
        if self.activation == "none" and not need_bias:
            return dy3, None
        gz, gbias = _act_grad_impl(dy3, z, self.activation, need_bias) if act_grad is None else act_grad(dy3, z)
        return dy3 if self.activation == "none" else gz, gbias

    def _backward(self, dy, a3, b3, z):
        """The given tensors' gradients through the op's own functions (no plan kept), from the operands a3, b3."""
        need_a, need_b, need_bias = (*self.needs, False)[:3]
        gz, gbias = self._gradient_z(self.from_out(dy), z)
        return (self.to_given(_product_like(gz, b3.mT, a3), 0) if need_a else None,
                self.to_given(_product_like(a3.mT, gz, b3), 1) if need_b else None,
                self.to_given(gbias, 2) if need_bias else None, None, None)[:len(self.needs)]

    def _backward_run(self, dy, a3, b3, z):
        """run(dy, a3, b3, z) -> the given tensors' gradients, for a dy of this layout: planned products into new
        tensors laid out as `_backward`'s; None where a product copies its operands (tf32) or a gradient is no
        view of its product."""
        need_a, need_b, need_bias = (*self.needs, False)[:3]
        to_given, from_out, gradient_z, n = self.to_given, self.from_out, self._gradient_z, len(self.needs)
        dy3 = from_out(dy)
        act_grad = None if self.activation == "none" and not need_bias else \
            _act_grad_run(dy3, z, self.activation, need_bias)
        gz = gradient_z(dy3, z, act_grad)[0]
        products = []
        for i, (x, y, like) in enumerate(((gz, b3.mT, a3), (a3.mT, gz, b3))):
            if not (need_a, need_b)[i]:
                products.append(None)
                continue
            product, c = _product_like_run(x, y, like)
            g = to_given(c, i)
            if product is None or g.data_ptr() != c.data_ptr():
                return None
            products.append((product, (g.shape, g.stride(), g.dtype, g.device)))

        def run(dy, a, b, z):
            gz, gbias = gradient_z(from_out(dy), z, act_grad)
            grads = []
            for (x, y), found in zip(((gz, b), (a, gz)), products):
                g = None
                if found is not None:
                    product, (shape, strides, dtype, device) = found
                    g = torch.empty_strided(shape, strides, dtype=dtype, device=device)
                    product(x, y, g)
                grads.append(g)
            return (*grads, to_given(gbias, 2) if need_bias else None, None, None)[:n]
        return run


def _make_plan(a, b, c, bias, z, activation, save_preact, tma, precision, traced: bool, accumulate: bool):
    """Chooses the kernel and its config for this signature (tuning on first use); returns the launcher.
    Candidates: the TMA kernel's where it applies, and the pointer kernel's where it may win (skinny or
    fp32 products, or no TMA)."""
    batch, M, K = a.shape
    N = b.shape[2]
    size = a.element_size()
    a_layout, b_layout = _tma_layout(a, traced), _tma_layout(b, traced)
    tuned = tma is None
    split = precision in ("tf32x3_split", "tf32x3_split_b")  # (operands only the TMA kernel reads: `_operand_copies`)
    if tuned:
        tma = _tma_takes(a, K) and a_layout is not None and b_layout is not None
        ptr = not split and (not tma or min(_runtime.size_hint(M), _runtime.size_hint(N)) <= 64 or size == 4)
    else:
        ptr = not tma
    max_k = _gemm.max_k(precision, size)
    tma_configs = TMA_SPLIT_CONFIGS if split else TMA_NARROW_CONFIGS[size] if _autotune.bucket(N) <= 16 else \
        TMA_CONFIGS[size] + (TMA_ROUNDED_CONFIGS if precision in ("tf32_rounded", "tf32_rounded_b") else [])
    if accumulate:
        tma_configs = [c for c in tma_configs if c["BLOCK_M"] * c["BLOCK_N"] <= ACCUMULATE_MAX_TILE]
    tma_fitting = _gemm.fits(tma_configs, M, N, K, max_k, 64)
    configs = [dict(cfg, KERNEL="tma") for cfg in tma_fitting] if tma else []
    if ptr:
        configs += [dict(cfg, KERNEL="ptr") for cfg in _gemm.fits(PTR_CONFIGS[min(size, 4)], M, N, K, max_k)]
    deep = deep_split_configs(batch, M, N, K, size, max_k, a.device.index or 0) if tuned and ptr else []
    configs += deep
    # (the TMA kernel's splits also where K is past one accumulator's: each split within it)
    tma_split = tma_split_configs(batch, M, N, K, tma_fitting, a.device.index or 0) \
        if tuned and a_layout is not None and b_layout is not None and _runtime.is_hopper(a.device.index or 0) \
        else []
    configs += tma_split
    if M == 1 and tuned and not split:
        configs = [dict(cfg, KERNEL="fma") for cfg in _gemm.fits(FMA_CONFIGS["vector"], 1, N, K, min_m=1)] + configs
    elif N <= 16 and tuned and not split:
        configs += [dict(cfg, KERNEL="fma") for cfg in _gemm.cap_k(FMA_CONFIGS["narrow"], max_k)]
    skinny = M <= 16 and size == 2 and tuned and _runtime.size_hint(K) <= _gemm.ACC_K.value  # (its one accumulator)
    if skinny:
        configs = skinny_configs(N, K) + configs
    epilogue = dict(HAS_BIAS=bias is not None, ACT=activation, STORE_Z=save_preact, PRECISION=precision,
                    ACCUMULATE=accumulate)

    def launcher(cfg):
        cfg = dict(cfg)
        kernel, splits = cfg.pop("KERNEL"), cfg.pop("SPLIT_K", 1)
        tiles = _runtime.cdiv(M, cfg["BLOCK_M"]) * _runtime.cdiv(N, cfg["BLOCK_N"])
        if kernel == "fma":
            meta = dict(HAS_BIAS=epilogue["HAS_BIAS"], ACT=activation, STORE_Z=save_preact, ACCUMULATE=accumulate,
                        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                        num_warps=cfg["num_warps"])
            scalars = (M, N, K, *a.stride(), *b.stride())
            launch = Launch(fma_kernel, (tiles, batch), meta, traced=traced)
            return lambda a, b, c, bias, z: launch(a, b, c, bias, z, *scalars)
        # a split product's kernel writes fp32 partials that split_sum_kernel sums (with the epilogue)
        meta = epilogue if splits == 1 else dict(epilogue, HAS_BIAS=False, ACT="none", STORE_Z=False,
                                                 ACCUMULATE=False)
        if kernel == "tma":
            programs = cfg.pop("OCC", 1) * _runtime.num_sms(a.device.index or 0)
            grid = (min(programs, splits * batch * tiles),)
            scalars = (M, N, K, batch, a_layout[2], a_layout[1], b_layout[2], b_layout[1])
            # (split partials stored by pointers: an fp32 tile in shared memory would not fit beside the stages)
            meta = dict(meta, GROUP_M=8, A_T=a_layout[0], B_T=b_layout[0], NUM_PROGRAMS=programs,
                        C_PTR=(N * size) % 16 != 0 or splits > 1, **cfg)
            if splits > 1:
                meta["SPLIT_K"] = splits
            launch = Launch(mm_tma_kernel, grid, meta, scratch=True, traced=traced)
        else:
            scalars = (M, N, K, *a.stride(), *b.stride())
            tile_kernel, tile_meta = (skinny_kernel, {}) if kernel == "skinny" else \
                (mm_kernel, dict(GROUP_M=8, SHARES=_gemm.shares(K, splits, cfg["BLOCK_K"])))
            launch = Launch(tile_kernel, (tiles, batch, splits), dict(meta, **tile_meta, **cfg), traced=traced)
        if splits == 1:
            return lambda a, b, c, bias, z: launch(a, b, c, bias, z, *scalars)
        sum_meta = dict(SPLITS=splits, HAS_BIAS=epilogue["HAS_BIAS"], ACT=activation, STORE_Z=save_preact,
                        ACCUMULATE=accumulate, BLOCK_R=32, BLOCK_N=64)
        sum_grid = (_runtime.cdiv(batch * M, 32), _runtime.cdiv(N, 64))
        launch_sum = Launch(split_sum_kernel, sum_grid, sum_meta, traced=traced)

        def run_split(a, b, c, bias, z):
            partial = torch.empty((splits, batch, M, N), device=a.device, dtype=torch.float32)
            launch(a, b, partial, absent(partial, traced), absent(partial, traced), *scalars)
            launch_sum(partial, c, bias, z, batch * M, N)
        return run_split

    key = ("mm", a.dtype, precision, tma, ptr, M == 1, N <= 16, a.stride(2) != 1, b.stride(2) != 1)
    key += tuple(map(_autotune.bucket, (batch, M, N, K))) + (("skinny",) if skinny else ())
    key += ("deep",) if deep else ()
    key += ("tma-split",) if tma_split else ()
    key += ("accumulate",) if accumulate else ()
    args = [a, b, c, absent(c, traced) if bias is None else bias, absent(c, traced) if z is c else z]

    def prepare(cfg):  # a launch to time: built once, so it is timed on its fast path
        if accumulate and args[2] is c:  # timed into one scratch output, never adding into the real one
            args[2] = torch.zeros_like(c)
        launch = launcher(cfg)
        return lambda: launch(*args)

    return launcher(_autotune.pick("matmul", key, configs, prepare, graph=True))


def _act_grad_impl(grad_y, z, activation: str, bias_grad: bool, traced: bool = False):
    """(grad_z, grad_bias) for y = act(z): grad_z [.., N] (empty for activation "none", where it is grad_y)
    and the bias gradient, grad_z summed over every row (empty unless bias_grad)."""
    if grad_y.numel() == 0:
        grad_z = torch.empty_like(grad_y, memory_format=torch.contiguous_format) if activation != "none" \
            else grad_y.new_empty(0)
        return grad_z, grad_y.new_empty(grad_y.shape[-1] if bias_grad else 0).zero_()
    if traced:
        return _act_grad_plan(grad_y, activation, bias_grad, traced)(grad_y, z)
    return _act_grad_run(grad_y, z, activation, bias_grad)(grad_y, z)


def _act_grad_run(grad_y, z, activation: str, bias_grad: bool):
    """The eager plan of `_act_grad_impl` for grad_y of this signature (not empty): run(grad_y, z)."""
    key = ("act_grad", grad_y.shape, grad_y.stride(), grad_y.dtype, grad_y.device, aligned(grad_y), z is None,
           activation, bias_grad)
    return plan(_plans, key, lambda: _act_grad_plan(grad_y, activation, bias_grad, False))


def _act_grad_plan(grad_y, activation: str, bias_grad: bool, traced: bool):
    """`_act_grad_impl`'s launches for grad_y of this signature (not empty): run(grad_y, z) -> (grad_z, grad_bias).
    A bias gradient alone (activation "none") is torch's sum over the leading dims (strided, no copy): one launch
    where the kernel's partial sums take two (a CvT-13 training step has 79 such sums; host time counts there)."""
    N = grad_y.shape[-1]
    R = grad_y.numel() // N
    if activation == "none":
        rows = tuple(range(grad_y.dim() - 1))  # (a 1-D grad_y is one row: its own sum, copied)

        def column_sum(grad_y, z):  # (grad_z: a stand-in, unread without an activation)
            grad_bias = (grad_y.sum(rows) if rows else grad_y.clone()) if bias_grad else absent(grad_y, traced)
            return absent(grad_y, traced), grad_bias
        return column_sum
    g2 = grad_y.reshape(R, N)
    block_r, block_n = 32, min(128, _runtime.next_power_of_2(N))
    n_blocks = _runtime.cdiv(N, block_n)
    splits = min(_runtime.cdiv(R, block_r), max(1, 2 * _runtime.num_sms(grad_y.device.index or 0) // n_blocks))
    rows = _runtime.cdiv(_runtime.cdiv(R, splits), block_r) * block_r
    splits = _runtime.cdiv(R, rows)
    meta = dict(BLOCK_R=block_r, BLOCK_N=block_n)
    launch_grad = Launch(act_grad_kernel, (n_blocks, splits), dict(meta, ACT=activation, COL_SUM=bias_grad),
                         traced=traced)
    launch_sum = Launch(act_grad_kernel, (n_blocks, 1), dict(meta, ACT="none", COL_SUM=True), traced=traced)
    scalars = (R, N, *g2.stride(), rows)
    shape, device, dtype = grad_y.shape, grad_y.device, grad_y.dtype

    def run(grad_y, z):
        g2 = grad_y.reshape(R, N)
        grad_z = torch.empty(shape, device=device, dtype=dtype) if activation != "none" else g2.new_empty(0)
        grad_bias = torch.empty(N if bias_grad else 0, device=device, dtype=dtype)
        partial = grad_bias.view(1, N) if (splits == 1 and bias_grad) else \
            torch.empty((splits, N) if bias_grad else (0,), device=device, dtype=torch.float32)
        launch_grad(g2, absent(g2, traced) if z is None else z, grad_z, partial, *scalars)
        if bias_grad and splits > 1:
            launch_sum(partial, absent(partial, traced), absent(partial, traced), grad_bias, splits, N, N, 1, splits)
        return grad_z, grad_bias
    return run


# --- 4. Registration as torch ops (what torch.compile traces: `_dispatch`) ------------------------------

@torch_op("dropin::mm", mutates_args=())
def _mm_op(a: torch.Tensor, b: torch.Tensor, bias: Optional[torch.Tensor], activation: str,
           save_preact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    c, z = mm_impl(a, b, bias, activation, save_preact, traced=True)
    return c, z if z is not None else a.new_empty(0)


@torch_op("dropin::act_grad", mutates_args=())
def _act_grad_op(grad_y: torch.Tensor, z: Optional[torch.Tensor], activation: str,
                 bias_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _act_grad_impl(grad_y, z, activation, bias_grad, traced=True)


_mm = switch(_mm_op, mm_impl)
_act_grad = switch(_act_grad_op, _act_grad_impl)


# --- 5. Autograd --------------------------------------------------------------------------------------

def _product_like(x, y, like):
    """x @ y, computed in the memory layout of `like` (column-major when `like` is), so that a gradient
    lands in its parameter's own layout without a copy."""
    if like.stride(1) == 1 and like.stride(2) != 1:
        return _mm(y.mT, x.mT, None, "none", False)[0].mT
    return _mm(x, y, None, "none", False)[0]


def canonical_product(a, b, bias, activation):
    """act(a @ b + bias) in canonical form, through an autograd node only where a gradient is wanted (the
    node costs launch time, which small products feel)."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or bias is not None and bias.requires_grad):
        return _MatmulFunction.apply(a, b, bias, activation)
    return _mm(a, b, bias, activation, False)[0]


class _MatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, activation):
        save_preact = stores_preactivation(activation, ctx.needs_input_grad[:3])
        c, z = _mm(a, b, bias, activation, save_preact)
        ctx.save_for_backward(a, b, derivative_at(activation, z if save_preact else None, c))
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

_shortcuts = Shortcuts(differentiable=True)  # (one for matmul, bmm and linear: their keys name the op)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.matmul(a, b)`: 1-D, 2-D and batched operands with broadcast batch dims, any strides.

    float32 / float16 / bfloat16 (both the same), fp32 accumulation; float32 uses tf32 only where torch
    would (`torch.backends.cuda.matmul.allow_tf32`)."""
    key, shortcut = _shortcuts.find((a, b), ("matmul", _gemm.tf32_key(a)))
    if shortcut is not None:
        return shortcut(a, b)
    for name, t in (("a", a), ("b", b)):
        if isinstance(t, torch.Tensor) and t.dim() == 0:
            raise RuntimeError(f"matmul: both arguments need to be at least 1-D, but '{name}' is 0-D")
    a, b = _gemm.autocast(a, b)  # (first: autocast accepts operands of different float dtypes)
    _gemm.check_operands("matmul", a=a, b=b)
    operands, shape = _matmul_operands(a, b)
    product = canonical_product(*operands, None, "none")
    c = product.view(shape)
    if a.dim() == 1:
        c = c.squeeze(-2)
    if b.dim() == 1:
        c = c.squeeze(-1)
    if product.requires_grad:
        shapes = a.shape, b.shape
        _shortcuts.keep(key, lambda: ProductShortcut.make(
            operands, (a, b), key[0], product, c, "none", lambda g, i: g.reshape(shapes[i])), grad=True)
    else:
        _shortcuts.keep(key, lambda: product_shortcut(operands, (a, b), product, "none", c))
    return c


def _matmul_operands(a, b):
    """matmul(a, b)'s canonical operands ([B, M, K], [B, K, N]) and the product's shape [*batch, M, N]."""
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
        return (a2.reshape(1, math.prod(a2.shape[:-1]), K), b2.unsqueeze(0)), (*batch, M, N)
    return (a2.expand(*batch, M, K).reshape(math.prod(batch), M, K),
            b2.expand(*batch, K, N).reshape(math.prod(batch), K, N)), (*batch, M, N)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.bmm(a, b)`: a [B, M, K] @ b [B, K, N] -> [B, M, N], any strides."""
    key, shortcut = _shortcuts.find((a, b), ("bmm", _gemm.tf32_key(a)))
    if shortcut is not None:
        return shortcut(a, b)
    for name, t in (("a", a), ("b", b)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise RuntimeError(f"bmm: argument '{name}' must be a 3-D tensor, got {t.dim()}-D")
    a, b = _gemm.autocast(a, b)  # (first: autocast accepts operands of different float dtypes)
    _gemm.check_operands("bmm", a=a, b=b)
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise RuntimeError(f"bmm: 'a' {tuple(a.shape)} and 'b' {tuple(b.shape)} have mismatched "
                           f"batch or inner dimensions")
    c = canonical_product(a, b, None, "none")
    if c.requires_grad:
        _shortcuts.keep(key, lambda: ProductShortcut.make(
            (a, b), (a, b), key[0], c, c, "none", lambda g, i: g), grad=True)
    else:
        _shortcuts.keep(key, lambda: product_shortcut((a, b), (a, b), c, "none", c))
    return c


def _check_linear(x, weight, bias, activation) -> str:
    act = check_activation(activation)
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        raise RuntimeError("linear: argument 'x' must be at least 1-D, got 0-D")
    if isinstance(weight, torch.Tensor) and weight.dim() not in (1, 2):
        raise RuntimeError(f"linear: argument 'weight' must be 1-D or 2-D, got {weight.dim()}-D")
    _gemm.check_operands("linear", x=x, weight=weight, bias=bias)
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
    bias [N] or None; activation None or one of dropin.ops.activations.ACTIVATIONS ("relu", "gelu", "silu", ...)."""
    key, shortcut = _shortcuts.find((x, weight, bias), ("linear", activation, _gemm.tf32_key(x)))
    if shortcut is not None:
        return shortcut(x, weight, bias)
    x, weight, bias = _gemm.autocast(x, weight, bias)  # (first: autocast accepts operands of different float dtypes)
    act = _checked.once((x, weight, bias), (activation,), lambda: _check_linear(x, weight, bias, activation))
    N = weight.shape[0] if weight.dim() == 2 else 1
    b = flat_param(bias)  # (the kernels read bias with unit stride)
    operands = (*_linear_operands(x, weight), b)
    c = canonical_product(*operands, act)
    y = c.view(*x.shape[:-1], N) if weight.dim() == 2 else c.view(x.shape[:-1])
    if c.requires_grad:
        shapes = x.shape, weight.shape, None if bias is None else bias.shape
        _shortcuts.keep(key, lambda: ProductShortcut.make(
            operands, (x, weight, bias), key[0], c, y, act,
            lambda g, i: g.squeeze(0).t().reshape(shapes[1]) if i == 1 else g.reshape(shapes[i])), grad=True)
    else:
        _shortcuts.keep(key, lambda: product_shortcut(operands, (x, weight, bias), c, act, y))
    return y


def _linear_operands(x, weight):
    """linear's canonical operands: x as [1, R, K], weight as [1, K, N]."""
    w2 = weight.unsqueeze(0) if weight.dim() == 1 else weight
    return x.reshape(1, math.prod(x.shape[:-1]), w2.shape[1]), w2.t().unsqueeze(0)

