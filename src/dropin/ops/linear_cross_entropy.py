"""Fused linear + cross-entropy for language-model heads: F.cross_entropy(hidden @ weight.T + bias, target) without
the whole [tokens, vocab] logits in memory; forward and backward.

The tokens are cut into chunks whose logits take at most MAX_CHUNK_BYTES (and at most about 1/CHUNKS of the whole
logits). For each chunk, in the forward:
1. logits = hidden_chunk @ weight.T + bias: dropin's product (`mm_impl`, fp32 accumulation, stored in the inputs'
   dtype as F.linear's logits are);
2. `_cross_entropy_kernel`, one program per token: the row's logsumexp (online over vocab tiles, fp32), its loss
   and, where gradients are wanted, the logits' gradient (softmax - one-hot, label smoothing's share, times the
   token's scale) written over the logits in place;
3. the gradient of the chunk's hidden rows (dropin's product, `grad @ weight`), of the weight (dropin's product
   accumulating into it, `grad.T @ hidden_chunk` added in fp32 and rounded to the weight's dtype once per chunk,
   as Liger-Kernel's addmm does) and of the bias (a column sum).
So the gradients are made in the forward, three GEMMs in all, and for the "mean" and "sum" reductions the backward
only scales them by the incoming gradient (in place: it runs once per forward). With reduction="none" the incoming
gradient differs per token: the forward computes the losses alone and the backward runs the same chunk pass with
the incoming gradient as the tokens' scales (one product more).
Why dropin's products and a separate loss kernel rather than one fused kernel: the three products are plain GEMMs
that `mm_impl` already tunes (TMA, persistent grid; the weight gradient's reads the chunk's gradient transposed
through its descriptor), and the loss pass over a chunk's logits is memory-bound and cheap beside them.
Peak memory beyond the inputs: the weight's and hidden's gradients plus one chunk's logits (and, transiently, its
hidden gradient), against torch's several [tokens, vocab] tensors.
"""
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import _runtime
from . import _gemm
from ._dispatch import Launch, opaque_op, switch
from .matmul import mm_impl

MAX_CHUNK_BYTES = 256 << 20  # a chunk's logits at most this large
CHUNKS = 8  # and at most about 1/CHUNKS of the whole logits (but at least MIN_CHUNK_ROWS rows)
MIN_CHUNK_ROWS = 256
VOCAB_TILE = 4096  # the loss kernel's widest vocab tile
REDUCTIONS = ("mean", "sum", "none")


# --- 1. Reference -----------------------------------------------------------------------------------

def linear_cross_entropy_ref(hidden, weight, target, bias=None, ignore_index=-100, reduction="mean",
                             num_items_in_batch=None, label_smoothing=0.0):
    """F.cross_entropy on the whole logits; with num_items_in_batch, the sum divided by it (HF's
    fixed_cross_entropy)."""
    logits = F.linear(hidden, weight, bias).reshape(-1, weight.shape[0])
    target = target.reshape(-1)
    if num_items_in_batch is not None:
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum",
                               label_smoothing=label_smoothing) / num_items_in_batch
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    return loss.view(hidden.shape[:-1]) if reduction == "none" else loss


# --- 2. Kernels -------------------------------------------------------------------------------------

@triton.jit
def _cross_entropy_kernel(logits_ptr, target_ptr, scale_ptr, loss_ptr,
                          V, stride_row, scale_stride, ignore_index, smoothing,
                          WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """One token per program: loss = (1 - smoothing) * (lse - x[target]) + smoothing * (lse - mean(x)), 0 where the
    target is ignore_index, NaN where it is out of range; with WRITE_GRAD the row becomes
    (softmax(x) - (1 - smoothing) * onehot - smoothing / V) * scale (0 for an ignored token)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(target_ptr + row)
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running max, sum of exp(x - m), sum of x
    s = 0.0
    total = 0.0
    for start in range(0, V, BLOCK_V):
        mask = start + cols < V
        x = tl.load(row_ptr + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < V)
    x_target = tl.load(row_ptr + target, mask=valid & in_range, other=0.0).to(tl.float32)
    loss = (1.0 - smoothing) * (lse - x_target) + smoothing * (lse - total / V)
    loss = tl.where(in_range, loss, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(scale_ptr + row * scale_stride), 0.0)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            mask = offs < V
            x = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # softmax as exp(x - m) / s, correctly rounded (softmax's kernel's): exp(x - lse) takes on log(s)'s
            # rounding, |lse| ulps of it (fp32 gradients 2.5x torch's error, H200)
            p = tl.div_rn(tl.exp(x - m), tl.zeros((BLOCK_V,), tl.float32) + s)
            g = p - smoothing / V - tl.where(offs == target, 1.0 - smoothing, 0.0)
            tl.store(row_ptr + offs, (g * scale).to(logits_ptr.dtype.element_ty), mask=mask)


# --- 3. Launchers -----------------------------------------------------------------------------------

def chunk_rows(tokens: int, vocab: int, element_size: int) -> int:
    """Tokens per chunk: logits of at most MAX_CHUNK_BYTES and about 1/CHUNKS of the whole (at least MIN_CHUNK_ROWS
    rows), a multiple of 128 from 128 rows on (whole MMA tiles)."""
    rows = min(MAX_CHUNK_BYTES // max(1, vocab * element_size), max(MIN_CHUNK_ROWS, -(-tokens // CHUNKS)))
    rows = rows - rows % 128 if rows >= 128 else max(1, rows)
    return min(tokens, rows)


def _cross_entropy(logits, target, scale, losses, ignore_index: int, smoothing: float, write_grad: bool):
    """The loss kernel over the rows of logits [rows, V] (unit column stride); scale [1] or [rows] fp32."""
    rows, V = logits.shape
    block = min(VOCAB_TILE, triton.next_power_of_2(V))
    scale_ptr = scale if write_grad else losses
    scale_stride = 1 if write_grad and scale.numel() > 1 else 0
    Launch(_cross_entropy_kernel, (rows,), dict(WRITE_GRAD=write_grad, BLOCK_V=block,
                                                num_warps=8 if block >= 2048 else 4))(
        logits, target, scale_ptr, losses, V, logits.stride(0), scale_stride, ignore_index, smoothing)


def _lce_impl(hidden, weight, target, bias, scale, ignore_index: int, label_smoothing: float,
              need_hidden: bool, need_weight: bool, need_bias: bool):
    """hidden [N, H] (any strides), weight [V, H], target [N] int64 (contiguous), bias [V] or None; scale: None
    (losses only) or fp32 [1] or [N], the gradient's factor per token. Returns (losses fp32 [N], hidden's gradient
    [N, H], weight's [V, H], bias's [V]), a gradient not asked for an empty tensor."""
    (N, H), V = hidden.shape, weight.shape[0]
    losses = torch.empty(N, dtype=torch.float32, device=hidden.device)
    grad_hidden = hidden.new_empty((N, H) if need_hidden else 0)
    grad_weight = weight.new_zeros((V, H) if need_weight and N == 0 else 0)  # (the first chunk's product makes it)
    grad_bias = torch.zeros(V if need_bias else 0, dtype=torch.float32, device=hidden.device)
    if N == 0:
        return losses, grad_hidden, grad_weight, grad_bias.to(weight.dtype)
    write_grad = need_hidden or need_weight or need_bias
    rows = chunk_rows(N, V, hidden.element_size())
    weight_t = weight.t().unsqueeze(0)
    for start in range(0, N, rows):
        stop = min(N, start + rows)
        chunk = hidden[start:stop]
        logits = mm_impl(chunk.unsqueeze(0), weight_t, bias, "none", False)[0][0]
        chunk_scale = scale[start:stop] if write_grad and scale.numel() > 1 else scale
        _cross_entropy(logits, target[start:stop], chunk_scale, losses[start:stop], ignore_index, label_smoothing,
                       write_grad)
        if need_hidden:
            grad_hidden[start:stop].copy_(mm_impl(logits.unsqueeze(0), weight.unsqueeze(0), None, "none",
                                                  False)[0][0])
        if need_weight:
            grad_weight = mm_impl(logits.t().unsqueeze(0), chunk.unsqueeze(0), None, "none", False,
                                  accumulate_into=grad_weight.unsqueeze(0) if start > 0 else None)[0][0]
        if need_bias:
            grad_bias += logits.sum(0, dtype=torch.float32)
    return losses, grad_hidden, grad_weight, grad_bias.to(weight.dtype)


# --- 4. Registration as a torch op (opaque to torch.compile: `_dispatch.opaque_op`) -----------------

@opaque_op("dropin::linear_cross_entropy")
def _lce_op(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
            scale: Optional[torch.Tensor], ignore_index: int, label_smoothing: float, need_hidden: bool,
            need_weight: bool, need_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _lce_impl(hidden, weight, target, bias, scale, ignore_index, label_smoothing, need_hidden, need_weight,
                     need_bias)


@_lce_op.register_fake
def _lce_fake(hidden, weight, target, bias, scale, ignore_index, label_smoothing, need_hidden, need_weight,
              need_bias):
    (N, H), V = hidden.shape, weight.shape[0]
    return (hidden.new_empty(N, dtype=torch.float32), hidden.new_empty((N, H) if need_hidden else 0),
            weight.new_empty((V, H) if need_weight else 0), weight.new_empty(V if need_bias else 0))


_lce = switch(_lce_op, _lce_impl)


# --- 5. Autograd --------------------------------------------------------------------------------------

class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, reduction, ignore_index, label_smoothing, denominator):
        need_hidden, need_weight, _, need_bias = ctx.needs_input_grad[:4]
        ctx.args = (ignore_index, label_smoothing, need_hidden, need_weight, need_bias)
        ctx.reduction = reduction
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, target, bias)
            return _lce(hidden, weight, target, bias, None, ignore_index, label_smoothing, False, False, False)[0]
        grads = need_hidden or need_weight or need_bias
        scale = denominator.reciprocal() if grads else None
        losses, *gradients = _lce(hidden, weight, target, bias, scale, ignore_index, label_smoothing,
                                  need_hidden, need_weight, need_bias)
        if grads:  # saved (not kept on ctx: torch.compile sees saved tensors alone), scaled by the backward
            ctx.save_for_backward(*gradients)
        return losses.sum() / denominator

    @staticmethod
    def backward(ctx, grad_loss):
        ignore_index, label_smoothing, need_hidden, need_weight, need_bias = ctx.args
        if ctx.reduction == "none":
            hidden, weight, target, bias = ctx.saved_tensors
            scale = grad_loss.float().contiguous()
            gradients = _lce(hidden, weight, target, bias, scale, ignore_index, label_smoothing,
                             need_hidden, need_weight, need_bias)[1:]
        elif torch.compiler.is_compiling():  # the graph's own buffers: inductor reuses them where it can
            gradients = [g * grad_loss for g in ctx.saved_tensors]
        else:  # in place, one multi-tensor launch reading grad_loss on the device (torch's mul_ of a bf16 tensor by
            # a float32 one takes its casting path, 4x the memory time); a second backward (retain_graph) meets
            # autograd's error for a saved tensor modified
            gradients = ctx.saved_tensors
            torch._foreach_mul_([g for g in gradients if g.numel()], grad_loss.reshape(()))
        grad_hidden, grad_weight, grad_bias = (g if need else None for g, need in
                                               zip(gradients, (need_hidden, need_weight, need_bias)))
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None


# --- 6. Public function -------------------------------------------------------------------------------

def _check(hidden, weight, target, bias, reduction, label_smoothing, num_items_in_batch) -> None:
    """Argument checks; errors of torch's own types, naming the argument."""
    op = "linear_cross_entropy"
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: {reduction!r} is not a valid value for 'reduction' (one of {REDUCTIONS})")
    if not 0.0 <= label_smoothing <= 1.0:
        raise RuntimeError(f"{op}: 'label_smoothing' must be between 0.0 and 1.0, got {label_smoothing}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(f"{op}: 'num_items_in_batch' replaces the mean's divisor: it needs reduction='mean', "
                         f"got {reduction!r}")
    _runtime.check_kernel_device(op, hidden=hidden, weight=weight, target=target, bias=bias)
    _gemm.check_operands(op, hidden=hidden, weight=weight, bias=bias)
    if target.dtype != torch.int64:
        raise RuntimeError(f"{op}: argument 'target' must hold class indices of dtype torch.int64, "
                           f"got {target.dtype}")
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise RuntimeError(f"{op}: argument 'weight' must be 2-D [vocab, hidden] with vocab > 0, "
                           f"got shape {tuple(weight.shape)}")
    if hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise RuntimeError(f"{op}: 'hidden' {tuple(hidden.shape)} and 'weight' {tuple(weight.shape)} cannot be "
                           f"multiplied (hidden size {hidden.shape[-1] if hidden.dim() else None} and "
                           f"{weight.shape[1]})")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"{op}: expected 'target' of shape {tuple(hidden.shape[:-1])} (hidden's leading dims), "
                         f"got {tuple(target.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise RuntimeError(f"{op}: argument 'bias' must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100, reduction: str = "mean",
                         num_items_in_batch=None, label_smoothing: float = 0.0, *,
                         loss_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias), target, ...)` without the whole logits in memory.

    hidden [..., H] (any strides), weight [V, H], bias [V] or None, target [...] int64 class indices (hidden's
    leading dims; ignore_index marks tokens left out). float32 / float16 / bfloat16 (one dtype), products accumulated
    in fp32 and the logits stored in that dtype (as F.linear's), the loss math in fp32. reduction "mean" (over the
    tokens not ignored; NaN when all are), "sum" or "none" (a loss per token, 0 where ignored). num_items_in_batch
    (a number or a tensor, with reduction "mean"): the sum divided by it instead, as HF's fixed_cross_entropy does.
    label_smoothing as F.cross_entropy's. The loss has hidden's dtype, or loss_dtype (HF's upcast logits: float32).
    A target outside [0, V) gives a NaN loss (no check of the values: it would wait for the GPU).
    Differentiable in hidden, weight and bias; with "mean" and "sum" the gradients are made in the forward and the
    backward runs once per forward (no retain_graph)."""
    hidden, weight, bias = _gemm.autocast(hidden, weight, bias)
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"linear_cross_entropy: argument '{name}' must be a Tensor, got {type(t).__name__}")
    _check(hidden, weight, target, bias, reduction, label_smoothing, num_items_in_batch)
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    target1 = target.reshape(-1).contiguous()
    bias1 = None if bias is None else bias.contiguous()
    if num_items_in_batch is not None:
        denominator = torch.as_tensor(num_items_in_batch, device=hidden.device).float().reshape(1)
    elif reduction == "mean":
        denominator = (target1 != ignore_index).sum().float().reshape(1)
    else:
        denominator = torch.ones(1, device=hidden.device)
    loss = _LinearCrossEntropyFunction.apply(hidden2, weight, target1, bias1, reduction, int(ignore_index),
                                             float(label_smoothing), denominator)
    # the cast outside the Function: one returning `.to()`'s no-op alias (fp32 to fp32) gets zero gradients under
    # torch.compile on torch 2.11 (benchmarks/probes/function_alias_output.py)
    loss = loss.to(loss_dtype or hidden.dtype)
    return loss.view(target.shape) if reduction == "none" else loss.reshape(())
