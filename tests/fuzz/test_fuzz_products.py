"""Fuzzing the products against torch: matmul, bmm, linear, swiglu_mlp, sparse_linear, linear_cross_entropy and
attention, forward and backward (or forward alone, the inference path) vs float64 and the 2x rule
(`_check.check`)."""
import importlib
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from hypothesis import given
from hypothesis import strategies as st

import dropin
from _fuzz import CONTIGUOUS, FUZZ, FUZZ_HALF, SEEDS, compare, kink_mask, layouts, sizes, start
from _tol import DEVICE, DTYPES
from dropin.ops.activations import ACTIVATIONS
from dropin.ops.linear_cross_entropy import linear_cross_entropy_ref
from dropin.ops.matmul import linear_ref
from dropin.ops.sparse import sparsify
from dropin.ops.swiglu import swiglu_mlp_ref

attn = importlib.import_module("dropin.ops.attention")  # (dropin.ops.attention is also the function)
lce = importlib.import_module("dropin.ops.linear_cross_entropy")

pytestmark = [pytest.mark.fuzz, pytest.mark.usefixtures("true_fp32")]

BACKWARD = st.booleans()  # False: forward alone, without autograd (the ops' inference paths)
ACTIVATION = st.sampled_from((None, *ACTIVATIONS))


@st.composite
def matmul_cases(draw):
    """torch.matmul's operand ranks 1-4 with broadcast batch dims (each a 1 or the batch's), any strides."""
    M, K, N = draw(sizes(1, 24)), draw(sizes(1, 24)), draw(sizes(1, 24))
    batch = draw(st.lists(sizes(1, 3), max_size=2))

    def shape(matrix):
        rank = draw(st.integers(1, 2 + len(batch)))
        if rank == 1:
            return (K,)
        return (*(draw(st.sampled_from((1, b))) for b in batch[len(batch) - (rank - 2):]), *matrix)
    a_shape, b_shape = shape((M, K)), shape((K, N))
    return dict(a=a_shape, b=b_shape, a_layout=draw(layouts(len(a_shape))),
                b_layout=draw(layouts(len(b_shape))), backward=draw(BACKWARD))


@st.composite
def bmm_cases(draw):
    B, M, K, N = draw(sizes(1, 4)), draw(sizes(1, 24)), draw(sizes(1, 24)), draw(sizes(1, 24))
    return dict(a=(B, M, K), b=(B, K, N), a_layout=draw(layouts(3)), b_layout=draw(layouts(3)),
                backward=draw(BACKWARD))


@st.composite
def linear_cases(draw):
    """x [..., K] of rank 1-3; weight [N, K] or [K] (a 1-D weight gives [...]; torch takes a bias with it, one
    number, only for a 1-D x)."""
    K, N = draw(sizes(1, 24)), draw(sizes(1, 24))
    x = (*draw(st.lists(sizes(1, 9), max_size=2)), K)
    weight = draw(st.sampled_from(((N, K), (K,))))
    bias = draw(st.sampled_from((None, (N,)))) if len(weight) == 2 else draw(st.sampled_from((None, ()))) \
        if len(x) == 1 else None
    return dict(x=x, weight=weight, bias=bias, activation=draw(ACTIVATION), x_layout=draw(layouts(len(x))),
                weight_layout=draw(layouts(len(weight))), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=st.one_of(matmul_cases().map(lambda c: ("matmul", c)), bmm_cases().map(lambda c: ("bmm", c))),
       seed=SEEDS)
def test_matmul_bmm(dtype, case, seed):
    op, c = case
    start(op, seed)
    leaves = {"a": c["a_layout"].tensor(c["a"], dtype), "b": c["b_layout"].tensor(c["b"], dtype)}
    compare(getattr(dropin.ops, op), getattr(torch, op), leaves, backward=c["backward"])


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=linear_cases(), seed=SEEDS)
def test_linear(dtype, case, seed):
    start("linear", seed)
    leaves = {"x": case["x_layout"].tensor(case["x"], dtype),
              "weight": case["weight_layout"].tensor(case["weight"], dtype, scale=case["x"][-1] ** -0.5)}
    if case["bias"] is not None:
        leaves["bias"] = CONTIGUOUS.tensor(case["bias"], dtype)
    act = case["activation"]
    kinks = kink_mask(act, lambda t, f: F.linear(f(t["x"]), f(t["weight"]), f(t["bias"]) if "bias" in t else None),
                      dtype)  # (the pre-activation x @ weight.T + bias)
    compare(lambda x, weight, bias=None: dropin.ops.linear(x, weight, bias, act),
            lambda x, weight, bias=None: linear_ref(x, weight, bias, act), leaves, backward=case["backward"],
            ambiguous=kinks)


@st.composite
def swiglu_cases(draw):
    hidden, inter = draw(sizes(1, 24)), draw(sizes(1, 24))
    x = (*draw(st.lists(sizes(1, 9), max_size=2)), hidden)
    shapes = {"gate_weight": (inter, hidden), "up_weight": (inter, hidden), "down_weight": (hidden, inter)}
    return dict(x=x, weights=shapes, x_layout=draw(layouts(len(x))),
                layouts={k: draw(layouts(2)) for k in shapes}, activation=draw(st.sampled_from(ACTIVATIONS)),
                recompute=draw(st.booleans()), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=swiglu_cases(), seed=SEEDS)
def test_swiglu_mlp(dtype, case, seed):
    start("swiglu_mlp", seed)
    leaves = {"x": case["x_layout"].tensor(case["x"], dtype)}
    for name, shape in case["weights"].items():
        leaves[name] = case["layouts"][name].tensor(shape, dtype, scale=shape[1] ** -0.5)
    act, recompute = case["activation"], case["recompute"]
    # every result is a function of the hidden units of the distinct token rows (an expanded x repeats its rows,
    # and with them the same roundings), and of no more distinct sums than the weights' ranks allow: a weight
    # expanded over its rows or its columns has rank 1 (equal rows: one gate sum for every unit; one value a row:
    # every output one multiple of the hidden units' sum, whose rounding all of them carry)
    rows = torch.unique(leaves["x"].reshape(-1, case["x"][-1]), dim=0).shape[0]
    rank = {name: int(torch.linalg.matrix_rank(leaves[name].detach().cpu().double())) for name in case["weights"]}
    hidden = rows * min(case["weights"]["gate_weight"][0], rank["gate_weight"] + rank["up_weight"], rank["down_weight"])
    compare(lambda x, g, u, d: dropin.ops.swiglu_mlp(x, g, u, d, recompute=recompute, activation=act),
            lambda x, g, u, d: swiglu_mlp_ref(x, g, u, d, act), leaves, backward=case["backward"], sources=hidden)


@st.composite
def sparse_linear_cases(draw):
    """A pruned weight (a drawn fraction of zeros) in chunks of block_k; its transpose compressed too unless the
    case is inference only (the gradient of x needs it)."""
    K, N = draw(sizes(1, 40)), draw(sizes(1, 24))
    x = (*draw(st.lists(sizes(1, 9), max_size=2)), K)
    backward = draw(BACKWARD)
    return dict(x=x, weight=(N, K), bias=draw(st.booleans()), x_layout=draw(layouts(len(x))),
                sparsity=draw(st.sampled_from((0.0, 0.5, 0.9, 1.0))),
                block_k=draw(st.one_of(st.sampled_from((1, 16, 32, 64, 256)), st.integers(1, 256))),
                transpose=backward or draw(st.booleans()), backward=backward)


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=sparse_linear_cases(), seed=SEEDS)
def test_sparse_linear(dtype, case, seed):
    start("sparse_linear", seed)
    weight = CONTIGUOUS.tensor(case["weight"], dtype, scale=case["x"][-1] ** -0.5)
    weight = weight * (torch.rand(case["weight"], device=weight.device) >= case["sparsity"])
    leaves = {"x": case["x_layout"].tensor(case["x"], dtype), "weight": weight}
    if case["bias"]:
        leaves["bias"] = CONTIGUOUS.tensor(case["weight"][:1], dtype)
    block_k, transpose = case["block_k"], case["transpose"]
    compare(lambda x, weight, bias=None: dropin.ops.sparse_linear(x, sparsify(weight, block_k, transpose), bias),
            F.linear, leaves, constant=("weight",), backward=case["backward"])


@st.composite
def linear_cross_entropy_cases(draw):
    """A language model's head and loss: hidden [*tokens, H] (no token dim to two), weight [V, H], a bias or none,
    int64 targets in [0, V) of which a drawn share is ignore_index (HF's -100, or a class index: F.cross_entropy
    ignores whatever it names; every token ignored too: a mean of NaN), each reduction, label smoothing,
    num_items_in_batch with "mean"; the tokens in chunks of a drawn size (1 token to all) and the loss kernel's
    vocab tiles of 32 or 4096. loss_dtype is left to tests/ops/test_linear_cross_entropy.py: its torch peer is
    another computation (HF's logits upcast before the loss), not F.cross_entropy in the inputs' dtype."""
    H, V = draw(sizes(1, 24)), draw(sizes(1, 40))
    tokens = tuple(draw(st.lists(sizes(1, 9), max_size=2)))
    reduction = draw(st.sampled_from(("mean", "sum", "none")))
    return dict(hidden=(*tokens, H), weight=(V, H), bias=draw(st.booleans()), reduction=reduction,
                ignore_index=draw(st.sampled_from((-100, 0))), ignored=draw(st.sampled_from((0.0, 0.25, 1.0))),
                label_smoothing=draw(st.sampled_from((0.0, 0.1, 1.0))),
                num_items_in_batch=draw(st.sampled_from((None, 3))) if reduction == "mean" else None,
                chunk=draw(st.sampled_from((1, 2, 7, None))), vocab_tile=draw(st.sampled_from((32, 4096))),
                hidden_layout=draw(layouts(len(tokens) + 1)), weight_layout=draw(layouts(2)),
                backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=linear_cross_entropy_cases(), seed=SEEDS)
def test_linear_cross_entropy(dtype, case, seed):
    start("linear_cross_entropy", seed)
    (V, H), tokens = case["weight"], case["hidden"][:-1]
    target = torch.randint(0, V, tokens, device=DEVICE)
    target = torch.where(torch.rand(tokens, device=DEVICE) < case["ignored"], case["ignore_index"], target)
    leaves = {"hidden": case["hidden_layout"].tensor(case["hidden"], dtype),
              "weight": case["weight_layout"].tensor(case["weight"], dtype, scale=H ** -0.5), "target": target}
    if case["bias"]:
        leaves["bias"] = CONTIGUOUS.tensor((V,), dtype)
    kw = {k: case[k] for k in ("ignore_index", "reduction", "num_items_in_batch", "label_smoothing")}
    chunk = case["chunk"] or max(1, math.prod(tokens))
    # the losses are sums of non-negative terms (no cancellation): the leaves keep their signs (no `positive`)
    with mock.patch.object(lce, "chunk_rows", lambda n, vocab, size: min(n, chunk)), \
            mock.patch.object(lce, "VOCAB_TILE", case["vocab_tile"]):
        compare(lambda hidden, weight, target, bias=None: dropin.ops.linear_cross_entropy(hidden, weight, target, bias,
                                                                                          **kw),
                lambda hidden, weight, target, bias=None: linear_cross_entropy_ref(hidden, weight, target, bias, **kw),
                leaves, constant=("target",), positive=False, backward=case["backward"])


PEER_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@st.composite
def attention_cases(draw):
    """q [B, H, Lq, E] (or unbatched [N, Lq, E]), k and v [B, HK, Lk, E]: HK == H, or a divisor of H with
    enable_gqa; a mask (bool, float32 or q's dtype; broadcast from any of its dims) or is_causal (torch refuses
    both together); scale None or any float. E up to 256 (dropin's limit; v's head dim is q's, dropin's too)."""
    B, H, Lq, Lk = draw(sizes(1, 3)), draw(sizes(1, 4)), draw(sizes(1, 20)), draw(sizes(1, 20))
    E = draw(st.one_of(st.sampled_from((8, 16, 32, 40, 64, 80, 128, 256)), st.integers(1, 64)))
    if draw(st.booleans()):  # 4-D
        HK = draw(st.sampled_from([d for d in range(1, H + 1) if H % d == 0]))
        q, kv, full = (B, H, Lq, E), (B, HK, Lk, E), (B, H, Lq, Lk)
        gqa = HK != H or draw(st.booleans())
    else:
        q, kv, full, gqa = (B, Lq, E), (B, Lk, E), (B, Lq, Lk), False
    mask = draw(st.sampled_from((None, torch.bool, torch.float32, "q")))
    mask_shape = None
    if mask is not None:
        rank = draw(st.integers(2, len(full)))
        mask_shape = tuple(draw(st.sampled_from((1, n))) for n in full[len(full) - rank:])
    causal = mask is None and draw(st.booleans())
    return dict(q=q, kv=kv, mask=mask, mask_shape=mask_shape, is_causal=causal, enable_gqa=gqa,
                scale=draw(st.one_of(st.none(), st.floats(-1.5, 1.5))),
                layouts={k: draw(layouts(len(q))) for k in "qkv"},
                mask_layout=draw(layouts(len(mask_shape))) if mask is not None else CONTIGUOUS,
                backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ_HALF
@given(case=attention_cases(), seed=SEEDS)
def test_attention(dtype, case, seed):
    start("attention", seed)
    lay = case["layouts"]
    leaves = {"q": lay["q"].tensor(case["q"], dtype), "k": lay["k"].tensor(case["kv"], dtype),
              "v": lay["v"].tensor(case["kv"], dtype)}
    if case["mask"] is not None:
        mask_dtype = dtype if case["mask"] == "q" else case["mask"]
        leaves["attn_mask"] = case["mask_layout"].tensor(case["mask_shape"], mask_dtype)
    kw = dict(is_causal=case["is_causal"], scale=case["scale"], enable_gqa=case["enable_gqa"])

    def bind(fn):
        return lambda q, k, v, attn_mask=None: fn(q, k, v, attn_mask=attn_mask, **kw)

    def peer(q, k, v, attn_mask=None):
        """torch's output stored [B, Lq, H, E], as its flash and efficient kernels and dropin store it (its math
        kernel's, which some cases take, is [B, H, Lq, E]: with a head dim of 1 the two differ in memory format). A
        mask whose last dim is strided or broadcast (size 1 against several keys) goes in as a dense copy of its
        broadcast shape: torch's efficient kernel refuses a bias whose last dim is not contiguous ("(*bias): last
        dimension must be contiguous"; a bool mask becomes such a bias too), and its rounding does not depend on the
        mask's layout. Where torch refuses q, k or v in their strides (its efficient kernel: "query is not correctly
        aligned (strideM)" for a transposed q of one row, whose size-1 dim's stride is 1: `contiguous()` keeps it;
        "cutlassF: no kernel found to launch!" for a q sliced along its rows beside a transposed k), they go in as
        copies of standard strides; where its efficient kernel refuses a float32 mask of a 16-bit q
        ("invalid dtype for bias"), its math kernel takes the case. cuDNN's backend is left out: its backward raised
        a CUDA misaligned address on few-key fp16 cases (torch 2.11, H200), which poisons the process's later cases."""
        if attn_mask is not None and (attn_mask.stride(-1) != 1 or attn_mask.shape[-1] != k.shape[-2]):
            full = torch.broadcast_shapes(attn_mask.shape, (*q.shape[:-1], k.shape[-2]))
            attn_mask = attn_mask.expand(full).contiguous()
        backends = PEER_BACKENDS
        for attempt in range(3):  # (a refusal of the strides can hide one of the mask's dtype)
            try:
                with sdpa_kernel(backends):
                    o = bind(F.scaled_dot_product_attention)(q, k, v, attn_mask)
                break
            except RuntimeError as e:
                if attempt == 2:
                    raise
                if "aligned" in str(e) or "no kernel found" in str(e):
                    q, k, v = (t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
                elif "dtype for bias" in str(e):
                    backends = [SDPBackend.MATH]
                else:
                    raise
        return o.transpose(1, 2).contiguous().transpose(1, 2) if o.dim() == 4 else o
    # a gradient 0 in exact arithmetic (a row that attends to one key) must be rounding-small; every result is a
    # function of the probabilities, whose rounding the 2x rule samples
    compare(bind(dropin.ops.attention), bind(attn.attention_ref), leaves, peer=peer,
            constant=("attn_mask",), grad_layout=None, zero_grad_degree=2, backward=case["backward"],
            sources=math.prod(case["q"][:-1]) * case["kv"][-2])
