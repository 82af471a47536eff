"""dropin.ops.linear_cross_entropy against float64 torch (F.linear + F.cross_entropy): reductions, ignore_index
(a chunk of ignored tokens), num_items_in_batch, label smoothing, bias, strided hidden; chunks and vocab tiles made
small so that the CPU runs several of each."""
import importlib

import pytest
import torch

from tests import _check
from tests._tol import DEVICE, DTYPES, assert_close, gpu

lce = importlib.import_module("dropin.ops.linear_cross_entropy")  # (dropin.ops names the function alike)
CHUNK = 8  # tokens per chunk on the CPU


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(lce, "chunk_rows", lambda tokens, vocab, size: min(tokens, CHUNK))
    monkeypatch.setattr(lce, "VOCAB_TILE", 32)


def _inputs(dtype, tokens=37, hidden=16, vocab=100, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    leaves = dict(hidden=torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype),
                  weight=(torch.randn(vocab, hidden, generator=g) * 0.5).to(DEVICE, dtype))
    if bias:
        leaves["bias"] = torch.randn(vocab, generator=g).to(DEVICE, dtype)
    target = torch.randint(0, vocab, (tokens,), generator=g)
    target[3:4] = -100
    target[CHUNK:2 * CHUNK] = -100  # a whole chunk ignored
    return leaves, target.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_matches_torch(small_chunks, dtype, reduction, label_smoothing):
    leaves, target = _inputs(dtype)

    def run(op):
        return lambda hidden, weight, bias: op(hidden, weight, target.to(hidden.device), bias, reduction=reduction,
                                               label_smoothing=label_smoothing)
    _check.check(run(lce.linear_cross_entropy), run(lce.linear_cross_entropy_ref), leaves,
                 positive=reduction != "none")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items_in_batch(small_chunks, dtype, as_tensor):
    leaves, target = _inputs(dtype, bias=False)
    items = torch.tensor(50, device=DEVICE) if as_tensor else 50

    def run(op):
        return lambda hidden, weight: op(hidden, weight, target.to(hidden.device),
                                         num_items_in_batch=items.to(hidden.device) if as_tensor else items)
    _check.check(run(lce.linear_cross_entropy), run(lce.linear_cross_entropy_ref), leaves, positive=True)


def test_strided_hidden_and_leading_dims(small_chunks):
    leaves, target = _inputs(torch.float32, tokens=18)
    # hidden [2, 9, H] read through a transposed view: no unit stride along hidden
    leaves["hidden"] = leaves["hidden"].reshape(9, 2, -1).transpose(0, 1).contiguous().transpose(0, 1)
    target = target.reshape(9, 2)

    def run(op):
        return lambda hidden, weight, bias: op(hidden, weight, target.to(hidden.device), bias, reduction="none")
    _check.check(run(lce.linear_cross_entropy), run(lce.linear_cross_entropy_ref), leaves)


def test_all_ignored_mean_is_nan_with_zero_gradients(small_chunks):
    leaves, target = _inputs(torch.float32, tokens=10, bias=False)
    target.fill_(-100)
    hidden, weight = (t.requires_grad_() for t in leaves.values())
    loss = lce.linear_cross_entropy(hidden, weight, target)
    assert torch.isnan(loss)
    loss.backward()
    assert not hidden.grad.any() and not weight.grad.any()


def test_no_tokens():
    leaves, _ = _inputs(torch.float32, tokens=0, bias=False)
    hidden, weight = (t.requires_grad_() for t in leaves.values())
    target = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert lce.linear_cross_entropy(hidden, weight, target, reduction="none").shape == (0,)
    loss = lce.linear_cross_entropy(hidden, weight, target, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and not weight.grad.any()


def test_out_of_range_target_is_nan(small_chunks):
    leaves, target = _inputs(torch.float32, tokens=4, bias=False)
    target[1] = 100
    losses = lce.linear_cross_entropy(*leaves.values(), target, reduction="none")
    assert torch.isnan(losses[1]) and torch.isfinite(losses[[0, 2]]).all()


def test_backward_runs_once(small_chunks):
    leaves, target = _inputs(torch.float32, tokens=4, bias=False)
    hidden = leaves["hidden"].requires_grad_()
    loss = lce.linear_cross_entropy(hidden, leaves["weight"], target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_loss_dtype():
    leaves, target = _inputs(torch.float16, tokens=4, bias=False)
    assert lce.linear_cross_entropy(*leaves.values(), target).dtype == torch.float16
    assert lce.linear_cross_entropy(*leaves.values(), target, loss_dtype=torch.float32).dtype == torch.float32


def test_chunk_rows_bound_memory():
    for tokens, vocab in ((4 * 1024, 32000), (8 * 4096, 128256), (37, 100)):
        rows = lce.chunk_rows(tokens, vocab, 2)
        assert 1 <= rows <= tokens
        assert rows * vocab * 2 <= max(lce.MAX_CHUNK_BYTES, vocab * 2)
        assert rows <= max(lce.MIN_CHUNK_ROWS, -(-tokens // lce.CHUNKS))


@pytest.mark.parametrize("bad, error, name", [
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(label_smoothing=1.5), RuntimeError, "label_smoothing"),
    (dict(num_items_in_batch=3, reduction="sum"), ValueError, "num_items_in_batch"),
    (dict(target=torch.zeros(5, dtype=torch.int32)), RuntimeError, "target"),
    (dict(target=torch.zeros(4, dtype=torch.int64)), ValueError, "target"),
    (dict(weight=torch.zeros(10, 7)), RuntimeError, "weight"),
    (dict(weight=torch.zeros(3)), RuntimeError, "weight"),
    (dict(bias=torch.zeros(9)), RuntimeError, "bias"),
    (dict(hidden=torch.zeros(5, 8, dtype=torch.float16)), RuntimeError, "hidden"),
    (dict(hidden=[[0.0] * 8] * 5), TypeError, "hidden"),
])
def test_bad_inputs(bad, error, name):
    args = dict(hidden=torch.zeros(5, 8), weight=torch.zeros(10, 8), target=torch.zeros(5, dtype=torch.int64),
                bias=torch.zeros(10))
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in bad.items()})
    for k in ("hidden", "weight", "target", "bias"):
        if isinstance(args[k], torch.Tensor):
            args[k] = args[k].to(DEVICE)
    with pytest.raises(error, match=name):
        lce.linear_cross_entropy(**args)


def test_opcheck(small_chunks):
    leaves, target = _inputs(torch.float32, tokens=12)
    hidden, weight, bias = leaves.values()
    scale = torch.full((1,), 0.1, device=DEVICE)
    op = torch.ops.dropin.linear_cross_entropy.default
    _check.opcheck(op, hidden, weight, target, bias, scale, -100, 0.0, True, True, True)
    _check.opcheck(op, hidden, weight, target, None, None, -100, 0.1, False, False, False)


@gpu
@pytest.mark.parametrize("tokens, vocab", [(1000, 32000), (4096, 50257)])
def test_large_bf16(tokens, vocab):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 1024, generator=g).to(DEVICE, torch.bfloat16)
    weight = (torch.randn(vocab, 1024, generator=g) * 0.03).to(DEVICE, torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), generator=g).to(DEVICE)
    target[:100] = -100
    ins = [t.clone().requires_grad_() for t in (hidden, weight)]
    ins_t = [t.clone().requires_grad_() for t in (hidden, weight)]
    ins_64 = [t.double().requires_grad_() for t in (hidden, weight)]
    loss = lce.linear_cross_entropy(*ins, target)
    loss_t = lce.linear_cross_entropy_ref(*ins_t, target)
    loss_64 = lce.linear_cross_entropy_ref(*ins_64, target)
    assert_close(loss, loss_64.to(loss.dtype).double(), torch.bfloat16, "fwd")
    for a, b, c in zip(torch.autograd.grad(loss, ins), torch.autograd.grad(loss_t, ins_t),
                       torch.autograd.grad(loss_64, ins_64)):
        assert_close(a, c, torch.bfloat16, "bwd", torch_out=b)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_gradients_every_reduction(small_chunks, reduction):
    """torch.compile gives eager's gradients for each reduction with an fp32 loss (the cast to loss_dtype a no-op:
    torch 2.11 gives zero gradients to an autograd.Function returning such a cast). On the CPU through aot_eager:
    Inductor does not run interpreted kernels."""
    leaves, target = _inputs(torch.float32, tokens=20)

    def loss_fn(hidden, weight, bias):
        loss = lce.linear_cross_entropy(hidden * 2, weight, target, bias, reduction=reduction,
                                        loss_dtype=torch.float32)
        return loss.sum() if reduction == "none" else loss

    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    results = []
    for fn in (loss_fn, torch.compile(loss_fn, backend=backend, fullgraph=True)):
        ins = [t.clone().requires_grad_() for t in leaves.values()]
        results.append(torch.autograd.grad(fn(*ins), ins))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


@gpu
def test_compiled_gradients_match_eager():
    """Under torch.compile (inductor) the loss and the gradients match eager's at a language-model head's size
    (several chunks of several vocab tiles; HF's label shift, a strided hidden made by the graph)."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 1024, 256, generator=g).to(DEVICE, torch.bfloat16)
    weight = (torch.randn(32000, 256, generator=g) * 0.06).to(DEVICE, torch.bfloat16)
    target = torch.randint(0, 32000, (4, 1024), generator=g).to(DEVICE)

    def loss_fn(hidden, weight):
        return lce.linear_cross_entropy((hidden * 2)[:, :-1], weight, target[:, 1:].contiguous(),
                                        loss_dtype=torch.float32)

    results = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        ins = [t.clone().requires_grad_() for t in (hidden, weight)]
        loss = fn(*ins)
        results.append((loss.detach(), *torch.autograd.grad(loss, ins)))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-6)
