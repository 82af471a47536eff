"""dropin.ops.attention against F.scaled_dot_product_attention: torch semantics, DESIGN.md tolerances.

Every numerical test goes through `check`: the output and the gradients of q, k and v (for a random upstream
gradient) against torch's math backend in float64 on the CPU (the reference) and against torch's own error in
the same dtype.
Under the interpreter the tuner is replaced by small tiles (`small_tiles`), so that small shapes still cross
several tiles: the unmasked middle, the diagonal and the ragged ends all run. The shipped configs run in
`test_default_configs` (CPU) and `test_every_config` (GPU).
"""
import importlib

import pytest
import torch
import torch.nn.functional as F

import _check
import dropin
from _tol import DEVICE, DTYPES, ON_GPU, UNIT_ROUNDOFF, assert_close, gpu, rel_err, slow, sweep

# fp16 on the CPU where its path differs (lengths, masks, padding and empty rows, TMA, default configs);
# elsewhere fp32 only there, to keep the interpreter's run short: every dtype on the GPU.
DTYPES_LIGHT = [DTYPES[0], pytest.param(torch.float16, id="fp16", marks=gpu), DTYPES[2]]
CAUSAL = [pytest.param(False, id="full"), pytest.param(True, id="causal")]
KINDS = [pytest.param("bool", id="bool"), pytest.param("float", id="float")]


def ids(values):
    return [pytest.param(v, id=str(v)) for v in values]

attn = importlib.import_module("dropin.ops.attention")  # dropin.ops.attention is also the function

SMALL_TILES = {  # kernel -> config: 32 x 16 tiles (the smallest tl.dot takes) cross tiles on tiny shapes
    "attention_fwd": dict(attn._cfg(32, 16, 4, 1), TMA=False),
    "attention_dkdv": dict(attn._cfg(16, 32, 4, 1), TMA=False),
    "attention_dq": dict(attn._cfg(32, 16, 4, 1), TMA=False),
}


@pytest.fixture(autouse=True)
def small_tiles(request, monkeypatch):
    """Forces SMALL_TILES under the interpreter (not on the GPU, nor in test_default_configs); launch plans
    made by other tests are forgotten."""
    _check.replan(attn)
    if not ON_GPU and request.function.__name__ != "test_default_configs":
        monkeypatch.setattr(attn._autotune, "pick", lambda name, key, configs, prepare: SMALL_TILES[name])
    yield
    _check.replan(attn)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def qkv(B, H, HK, Lq, Lk, E, dtype):
    return {"q": randn(B, H, Lq, E, dtype=dtype), "k": randn(B, HK, Lk, E, dtype=dtype),
            "v": randn(B, HK, Lk, E, dtype=dtype)}


def check(leaves: dict, build=None, peer=F.scaled_dot_product_attention, attn_mask=None, backward=True,
          autocast=None, **kwargs):
    """The shared check of attention(*build(**leaves), attn_mask, **kwargs): the mask is a constant leaf (in
    float64 for the reference if a float one); a gradient 0 in exact arithmetic (each row attends to one key:
    a softmax of one entry is constant) must be rounding-small, scaled by the upstream gradient times two leaves."""
    build = build or (lambda **t: tuple(t.values()))
    bind = lambda fn: lambda q, k, v, mask=None: fn(q, k, v, attn_mask=mask, **kwargs)  # noqa: E731
    mask = {} if attn_mask is None else {"attn_mask": attn_mask}
    _check.check(bind(dropin.ops.attention), bind(attn.attention_ref), {**leaves, **mask}, peer=bind(peer),
                 build=lambda attn_mask=None, **qkv: (*build(**qkv), attn_mask), constant=("attn_mask",),
                 grad_layout="input", zero_grad_degree=2, backward=backward, autocast=autocast)


# ------------------------------------------------------------------------------------- lengths, causal
SHAPES = [  # (B, H, Lq, Lk, E)
    pytest.param((1, 1, 1, 1, 32), id="1x1-d32"),
    pytest.param((2, 2, 7, 7, 64), id="7x7-d64"),
    pytest.param((1, 2, 33, 33, 32), id="33x33-d32"),
    pytest.param((1, 2, 70, 64, 64), id="70x64-d64"),
    pytest.param((2, 1, 33, 7, 64), id="lq-33-lk-7"),
    pytest.param((1, 2, 7, 50, 64), id="lq-7-lk-50"),
    pytest.param((2, 4, 1, 33, 32), id="lq-1-lk-33"),  # 8 rows: a lone row's error ratio to torch's is noise
]
LONG_SHAPES = [
    pytest.param((2, 4, 1000, 1000, 64), id="1000x1000-d64"),
    pytest.param((1, 3, 1000, 333, 128), id="1000x333-d128"),
    pytest.param((1, 2, 257, 1000, 128), id="257x1000-d128"),
]


# Pairwise in `make test-gpu`: each shape full and causal, each in its own dtype (two dtypes a shape), every dtype
# full and causal; the tile walk over the lengths is the same in every dtype. The other combinations are slow.
@pytest.mark.parametrize("shape,causal,dtype", sweep(SHAPES, CAUSAL, DTYPES,
                                                     default=lambda s, c, d: d == (s + 2 * c) % 3))
def test_lengths(shape, causal, dtype):
    B, H, Lq, Lk, E = shape
    check(qkv(B, H, H, Lq, Lk, E, dtype), is_causal=causal)


@gpu
@pytest.mark.parametrize("dtype", [*DTYPES[1:], pytest.param(torch.float32, id="fp32", marks=slow)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", LONG_SHAPES)
def test_long_lengths(shape, causal, dtype):
    """Many tiles of each kernel; fp32 runs the same tile walk as the 16-bit dtypes (its own products are
    test_lengths' and test_head_dims')."""
    B, H, Lq, Lk, E = shape
    check(qkv(B, H, H, Lq, Lk, E, dtype), is_causal=causal)


HEAD_DIMS = [32, 64, 80, 96, 128, 256, 8, 40]


# fp32 at head dims other than 40 is slow: the padded head dims take the same padded-head-dim tile walk as the
# 16-bit ones (fp32's own padded walk runs at d40), and on the GPU (untuned: the first candidate) fp32 at
# d64 / d128 / d256 runs causal in test_default_configs, with the same configs on longer lengths.
@pytest.mark.parametrize("head_dim,dtype", sweep(ids(HEAD_DIMS), DTYPES_LIGHT,
                                                 default=lambda e, d: d != 0 or HEAD_DIMS[e] == 40))
def test_head_dims(head_dim, dtype):
    check(qkv(1, 2, 2, 40, 36, head_dim, dtype), is_causal=True)


def test_scale():
    """A given scale, a negative one, and on the same shapes a negative one large enough that a row maximum
    taken before scaling (the forward does so only for a positive scale: a launch plan of its own) would
    overflow exp: there finite and within the fp32 tolerance (scores near 1e3 put torch's own fp32 result
    far enough from the reference that the 2x rule says little)."""
    leaves = qkv(1, 2, 2, 20, 40, 32, torch.float32)
    check(leaves, scale=0.3)
    check(leaves, scale=-0.3)
    ref = attn.attention_ref(*(t.double() for t in leaves.values()), scale=-10.0)
    assert_close(dropin.ops.attention(**leaves, scale=-10.0), ref, torch.float32, "fwd")


# ---------------------------------------------------------------------------------------------- masks
MASK_SHAPES = {  # broadcast shapes of a mask for (B, H, Lq, Lk) = (2, 3, 20, 40)
    "LqxLk": (20, 40),
    "1x1xLqxLk": (1, 1, 20, 40),
    "Bx1xLqxLk": (2, 1, 20, 40),
    "BxHxLqxLk": (2, 3, 20, 40),
    "Bx1x1xLk": (2, 1, 1, 40),
    "1xHx1xLk": (1, 3, 1, 40),
}


def random_mask(shape, kind, dtype):
    """A bool mask (every row keeps key 0: rows with no key are test_fully_masked_rows'), or an additive one
    in float32 or (kind "q-dtype") in the dtype of q."""
    if kind == "bool":
        mask = torch.rand(shape, device=DEVICE) > 0.3
        mask[..., 0] = True
        return mask
    return randn(*shape, dtype=dtype if kind == "q-dtype" else torch.float32)


# Pairwise in `make test-gpu`: each broadcast shape as a bool and as a float mask, each in its own dtype (two
# dtypes a shape), every (kind, dtype); a mask's strides do not depend on q's dtype. The others are slow.
@pytest.mark.parametrize("mask_shape,kind,dtype", sweep(ids(MASK_SHAPES), KINDS, DTYPES_LIGHT,
                                                        default=lambda m, k, d: d == (m + 2 * k) % 3))
def test_masks(mask_shape, kind, dtype):
    check(qkv(2, 3, 3, 20, 40, 32, dtype), attn_mask=random_mask(MASK_SHAPES[mask_shape], kind, dtype))


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("kind", ["bool", "float", "q-dtype"])
def test_mask_dtypes(kind, dtype):
    check(qkv(2, 3, 3, 20, 40, 32, dtype), attn_mask=random_mask((2, 1, 20, 40), kind, dtype))


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_broadcast_along_keys(kind, dtype):
    """A mask of one value per query row, broadcast along the keys (stride 0 there; 21 and 33 keys: the DELTA
    pass of few keys and the flash walk), as in the fuzz cases whose bf16 forward was 94% off and whose fp16
    DELTA pass read out of range on the H200 (probes/fuzz_repro.py 57, 58)."""
    for lk in (21, 33):
        mask = random_mask((1, 1, 20, 1), kind, dtype).expand(1, 1, 20, lk)
        if kind == "bool":
            mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=DEVICE).expand(1, 1, 20, lk)
        check(qkv(2, 3, 3, 20, lk, 28, dtype), attn_mask=mask)


def hf_mask(lengths, L, dtype, fill):
    """HF's 4-D [B, 1, L, L] additive mask: causal + left padding (batch b has lengths[b] real tokens), masked
    entries `fill`. The padding rows see no real key; under finfo.min they still attend: by their scores where
    the offset is exact (fp16's -65504), uniformly where finfo.min absorbs the scores (bf16, fp32)."""
    pos = torch.arange(L, device=DEVICE)
    pad = torch.stack([pos < L - n for n in lengths])  # [B, L]: left padding
    masked = (pos[None, :] > pos[:, None])[None] | pad[:, None, :]
    return torch.zeros(masked.shape, dtype=dtype, device=DEVICE).masked_fill(masked, fill)[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fill", ["finfo.min", "-inf"])
def test_hf_padding_mask(fill, dtype):
    L = 37
    value = torch.finfo(dtype).min if fill == "finfo.min" else float("-inf")
    check(qkv(2, 2, 2, L, L, 64, dtype), attn_mask=hf_mask([L, 20], L, dtype, value))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows(kind, dtype):
    """Rows that attend to no key give 0 and no gradient, as torch gives."""
    mask = torch.rand(2, 1, 24, 40, device=DEVICE) > 0.3
    mask[..., 0] = True
    mask[0, :, 5] = False
    mask[1, :, 17:] = False
    if kind == "float":
        mask = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, float("-inf"))
    leaves = qkv(2, 2, 2, 24, 40, 32, dtype)
    out = dropin.ops.attention(**leaves, attn_mask=mask)
    assert (out[0, :, 5] == 0).all() and (out[1, :, 17:] == 0).all()
    check(leaves, attn_mask=mask)


STRUCTURED = ["causal", "window", "padding", "causal-left-padding", "two-runs", "none"]


STRUCTURED_LENGTHS = [pytest.param((100, 100), id="100x100"), pytest.param((37, 130), id="37x130")]


# Pairwise in `make test-gpu`: each pattern at both lengths and as both kinds, in two dtypes; every (lengths,
# kind), (lengths, dtype) and (kind, dtype) pair. The other combinations are slow.
@pytest.mark.parametrize("pattern,lengths,kind,dtype", sweep(
    ids(STRUCTURED), STRUCTURED_LENGTHS, KINDS, DTYPES_LIGHT,
    default=lambda p, n, k, d: k == (p + n) % 2 and d == (2 * p + n) % 3))
def test_structured_masks(pattern, lengths, kind, dtype):
    """Masks whose summary (`attention_ranges`) lets the forward skip key tiles, read no mask on tiles that
    attend wholly and read it on the rest: causal, sliding-window and padding patterns, rows that attend to
    nothing, a mask that blocks everything. A float mask blocks with -inf and attends with 0."""
    from test_attention_ranges import patterns
    Lq, Lk = lengths
    mask = patterns(2, Lq, Lk)[pattern][:, None]
    if kind == "float":
        mask = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, float("-inf"))
    check(qkv(2, 2, 2, Lq, Lk, 16, dtype), attn_mask=mask)


def test_no_keys():
    """Lk = 0: every row attends to nothing."""
    out = dropin.ops.attention(randn(1, 2, 5, 32), randn(1, 2, 0, 32), randn(1, 2, 0, 32))
    assert out.shape == (1, 2, 5, 32) and (out == 0).all()


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("masking", ["none", "mask", "causal"])
def test_few_keys_gradients_at_rounding(masking, dtype):
    """2 keys and positive values: dP's rows nearly constant, so dS = P * (dP - delta) cancels, and delta from O
    rounded to 16 bits left dq 20x over the error of an exact delta (fp16: 5.1e-3 against 2.7e-4); delta from the
    scores keeps q's and k's gradients at the dtype's rounding (`attention.SHORT_KEYS`)."""
    q, k, v, grad = (torch.randn(shape, device=DEVICE).abs().clamp_min(0.25).to(dtype)
                     for shape in ((2, 3, 15, 32), (2, 3, 2, 32), (2, 3, 2, 32), (2, 3, 15, 32)))
    mask = {"mask": torch.rand(15, 2, device=DEVICE) > 0.3, "none": None, "causal": None}[masking]
    kw = dict(attn_mask=mask, is_causal=masking == "causal")
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=None if mask is None else mask.cpu(),
                                         is_causal=kw["is_causal"])
    refs = torch.autograd.grad(out, leaves[:2], grad.cpu().double())
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(dropin.ops.attention(*ins, **kw), ins[:2], grad)
    for name, g, ref in zip("qk", grads, refs):
        err = rel_err(g, ref.to(g.device))
        assert err <= 2 * UNIT_ROUNDOFF[dtype], f"gradient of {name}: relative error {err:.2e}"


@pytest.mark.parametrize("masking", ["float-mask", "causal"])
def test_backward_independent_of_forward_rounding(masking, monkeypatch):
    """The GPU fuzz's case (fp32, 31 keys, scale 1.5, a float mask, GQA; causal too): peaked rows of scores up to
    ~30; the gradients stay within 2x torch's error where the backward's products round otherwise than the
    forward's. Probabilities normalized by the forward's row sums carry the difference of the two roundings on
    each row's largest one (dK 2.4x torch's error on the H200; dQ and dK 3.7x here); the backward's own sums cancel
    it (`attention.SHORT_KEYS`). On the CPU, whose small tiles round alike in every pass, the forward sums its
    scores over the head dim in two chains of 16 and the backward in one; on the GPU the passes are as they come."""
    if not ON_GPU:  # (on the GPU no config has the 16-key tiles that 16-column chunks ask for)
        plan = attn._fwd_plan

        def fwd_plan(*args, **kwargs):  # the forward's plan made with 16-column chunks, the backward's with none
            with pytest.MonkeyPatch.context() as chunked:
                chunked.setattr(attn, "_chunk", lambda q, precision: 16)
                return plan(*args, **kwargs)
        monkeypatch.setattr(attn, "_fwd_plan", fwd_plan)
    leaves = qkv(3, 5, 5, 57, 31, 32, torch.float32)
    if masking == "causal":
        check(leaves, is_causal=True, scale=1.5, enable_gqa=True)
    else:
        check(leaves, attn_mask=randn(1, 1, 57, 31), scale=1.5, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_of_one_key_has_no_query_gradient(dtype):
    """Causal, 2 queries over 24 keys: the first query attends to one key, so its P is 1 and dS = P * (dP - delta)
    is 0 exactly; q's gradient there is 0 where delta and the dS pass's dP are the same sum (fp32 too: a delta
    summed as rowsum(dO * O) in another order left that row the two sums' difference, and dq 3x torch's error)."""
    q, grad = randn(3, 2, 2, 32, dtype=dtype), randn(3, 2, 2, 32, dtype=dtype)
    k, v = randn(3, 2, 24, 32, dtype=dtype), randn(3, 2, 24, 32, dtype=dtype)
    q.requires_grad_()
    (dq,) = torch.autograd.grad(dropin.ops.attention(q, k, v, is_causal=True), q, grad)
    assert (dq[:, :, 0] == 0).all() and (dq[:, :, 1] != 0).any()


# ------------------------------------------------------------------------------------------- grouped heads
GROUPS = [pytest.param((6, 1), id="mqa-6-1"), pytest.param((6, 2), id="gqa-6-2"), pytest.param((6, 3), id="gqa-6-3")]


# Pairwise in `make test-gpu`: each grouping causal and masked, each in its own dtype; every (masking, dtype).
# The others are slow.
@pytest.mark.parametrize("masking,heads,dtype", sweep(ids(["causal", "mask"]), GROUPS, DTYPES_LIGHT,
                                                      default=lambda m, h, d: d == (h + 2 * m + 1) % 3))
def test_grouped_query(masking, heads, dtype):
    H, HK = heads
    kwargs = {"is_causal": True} if masking == "causal" else {"attn_mask": randn(2, 1, 19, 35)}
    check(qkv(2, H, HK, 19, 35, 32, dtype), enable_gqa=True, **kwargs)


# ------------------------------------------------------------------------------------- strides and views
VIEWS = {  # id -> (storage shape for q / k / v of logical (B, H, L, E), the view)
    "BLHE-transposed": (lambda B, H, L, E: (B, L, H, E), lambda t: t.transpose(1, 2)),
    "head-dim-strided": (lambda B, H, L, E: (B, H, E, L), lambda t: t.transpose(2, 3)),
    "sliced": (lambda B, H, L, E: (B, H + 1, L + 2, 2 * E), lambda t: t[:, 1:, 2:, ::2]),
    "batch-expanded": (lambda B, H, L, E: (1, H, L, E), lambda t: t.expand(2, -1, -1, -1)),
}


@pytest.mark.parametrize("dtype", DTYPES_LIGHT)
@pytest.mark.parametrize("view", VIEWS)
def test_strided_views(view, dtype):
    storage, make_view = VIEWS[view]
    leaves = {"q": randn(*storage(2, 2, 21, 32), dtype=dtype), "k": randn(*storage(2, 2, 30, 32), dtype=dtype),
              "v": randn(*storage(2, 2, 30, 32), dtype=dtype)}

    def build(q, k, v):
        return make_view(q), make_view(k), make_view(v)

    check(leaves, build=build, is_causal=True)


HEAD_DIM_STRIDES = {  # id -> (q, k, v: (storage shape, view) each; mask: (storage, view, kind) or None; kwargs)
    # the attention fuzz run's GPU failures (H200, Triton 3.6): forwards 0.9 off, illegal addresses in the backward
    "k-expanded": (((1, 4, 53, 18), None), ((1, 1, 1, 1), lambda t: t.expand(1, 1, 49, 18)), ((1, 1, 49, 18), None),
                   ((49, 53), lambda t: t.t(), "bool"), dict(enable_gqa=True)),
    "k-permuted-3d": (((3, 33, 28), None), ((33, 28, 3), lambda t: t.permute(2, 0, 1)), ((3, 33, 28), None),
                      ((1, 1, 1), lambda t: t.expand(1, 1, 33), "q"), dict(scale=-0.82)),
    "v-permuted": (((5, 3, 27, 53), lambda t: t[:, 1::2]), ((5, 1, 21, 53), None),
                   ((1, 21, 53, 5), lambda t: t.permute(3, 0, 1, 2)), ((1, 1, 1), lambda t: t.expand(1, 1, 21), "q"),
                   dict(scale=-0.17)),
    "v-head-expanded": (((1, 2, 2, 56), None), ((33, 56, 1, 1), lambda t: t.permute(2, 3, 0, 1)),
                        ((1, 1, 33, 1), lambda t: t.expand(1, 1, 33, 56)), None, dict(enable_gqa=True)),
}


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("case", HEAD_DIM_STRIDES)
def test_head_dim_not_unit_stride(case, dtype, monkeypatch):
    """q, k or v whose head dim has a stride other than 1 (permuted, sliced, expanded): right results, and the
    kernels' plans see unit-stride copies (`attention._readable`); the gradients still reach the leaves."""
    *operands, mask_spec, kwargs = HEAD_DIM_STRIDES[case]
    leaves = {name: randn(*storage, dtype=dtype) for name, (storage, _) in zip("qkv", operands)}
    views = [view or (lambda t: t) for _, view in operands]
    mask = None
    if mask_spec is not None:
        storage, view, kind = mask_spec
        mask = view(torch.rand(storage, device=DEVICE) > 0.25 if kind == "bool" else randn(*storage, dtype=dtype))
    seen = []
    for name, operands in (("_fwd_plan", 3), ("_bwd_plan", 4)):  # (q, k, v; dO, q, k, v)
        def record(*args, _plan=getattr(attn, name), _operands=operands, **kw):
            seen.extend(args[:_operands])
            return _plan(*args, **kw)
        monkeypatch.setattr(attn, name, record)

    def build(q, k, v):
        return tuple(view(t) for view, t in zip(views, (q, k, v)))

    check(leaves, build=build, attn_mask=mask, **kwargs)
    assert seen and all(t.stride(-1) == 1 for t in seen), [t.stride() for t in seen]


def test_gradient_layouts_of_copied_operands():
    """A k read from a copy (its head dim permuted) and then a contiguous k of the same shape: the same operands
    for the kernels, gradients of different layouts; each call's gradients right (the backward's plan is keyed by
    them too: a plan of the first call's dk strides wrote the second's dk 1.4 off)."""
    for k_storage, view in (((2, 3, 16, 9), lambda t: t.transpose(-1, -2)), ((2, 3, 9, 16), lambda t: t)):
        leaves = {"q": randn(2, 3, 11, 16), "k": randn(*k_storage), "v": randn(2, 3, 9, 16)}
        check(leaves, build=lambda q, k, v: (q, view(k), v))


def test_unbatched_3d():
    """(N, L, E) operands, as torch takes them, with a (Lq, Lk) mask."""
    check({"q": randn(3, 9, 32), "k": randn(3, 20, 32), "v": randn(3, 20, 32)},
          attn_mask=torch.rand(9, 20, device=DEVICE) > 0.2)


def test_no_grad_and_output_layout():
    leaves = qkv(2, 3, 3, 9, 20, 32, torch.float32)
    with torch.no_grad():
        out = dropin.ops.attention(**leaves)
    ref = F.scaled_dot_product_attention(*leaves.values())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.transpose(1, 2).is_contiguous(), "stored [B, L, H, E], as torch's flash attention stores it"


def test_repeat_calls_with_autograd(monkeypatch):
    """Repeat calls where autograd records them (no mask: causal, GQA, strided q) take their `Differentiable`
    shortcut and give the outputs and gradients of the op's own path, bit for bit."""
    strided_q = randn(2, 9, 3, 32).transpose(1, 2)  # [B, H, L, E] viewed from [B, L, H, E]
    calls = [(lambda q, k, v: dropin.ops.attention(q, k, v, is_causal=True), list(qkv(2, 3, 3, 9, 20, 32,
                                                                                     torch.float32).values())),
             (lambda q, k, v: dropin.ops.attention(q, k, v, enable_gqa=True), list(qkv(2, 4, 2, 9, 20, 32,
                                                                                      torch.float32).values())),
             (dropin.ops.attention, [strided_q, randn(2, 3, 20, 32), randn(2, 3, 20, 32)])]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


CHUNKED = {  # id -> (B, H, HK, Lq, Lk, E, keyword arguments)
    "causal-gqa-d40": (2, 4, 2, 45, 37, 40, {"is_causal": True, "enable_gqa": True}),
    "mask-d64": (1, 2, 2, 33, 50, 64, {"attn_mask": "float"}),
    "d48": (1, 2, 2, 20, 23, 48, {}),  # (a multiple of the chunk, short of the head-dim tile)
}


@gpu  # (on the CPU torch's own fp32 error is 2-3x dropin's: no yardstick)
def test_fp32_large_scores_within_2x_torch():
    """fp32 scores of magnitude ~30 without a mask: over 6 seeds the median of dropin's forward error over torch's
    (float64 reference) is at most 2. In log2 units the rounding of scale * log2 e alone puts |score| * 2^-24 on
    every probability (`attention._scores_scale`: natural units in fp32)."""
    ratios = []
    for _ in range(6):
        q, k, v = randn(2, 2, 24, 64) * 2, randn(2, 2, 40, 64) * 2, randn(2, 2, 40, 64)
        ref = F.scaled_dot_product_attention(*(t.cpu().double() for t in (q, k, v)), scale=0.37)
        errors = [rel_err(out, ref.to(out.device)) for out in (
            dropin.ops.attention(q, k, v, scale=0.37), F.scaled_dot_product_attention(q, k, v, scale=0.37))]
        ratios.append(errors[0] / errors[1])
    assert sorted(ratios)[len(ratios) // 2] <= 2, ratios


@pytest.mark.skipif(ON_GPU, reason="forces 16-column chunks on the interpreter's small tiles")
@pytest.mark.parametrize("case", CHUNKED)
def test_head_dim_in_chunks(case, monkeypatch):
    """The products over the head dim read in chunks of columns (CHUNK, tf32x3's path on the GPU, where
    `test_float32_follows_allow_tf32` and `test_every_config` run it at d256), forced here at 16 columns (the
    last one partial at d40) with the interpreter's FMA dots."""
    B, H, HK, Lq, Lk, E, kwargs = CHUNKED[case]
    monkeypatch.setattr(attn, "_chunk", lambda q, precision: 16)
    if kwargs.get("attn_mask") == "float":
        kwargs = dict(kwargs, attn_mask=randn(B, 1, Lq, Lk))
    check(qkv(B, H, HK, Lq, Lk, E, torch.float32), **kwargs)


# ------------------------------------------------------------------------------------------------ configs
def test_config_tables():
    """Forward / dQ tiles: BLOCK_M a multiple of BLOCK_N; dK/dV: BLOCK_N a multiple of BLOCK_M (the diagonal
    falls on tile edges); tl.dot needs 16."""
    for table, outer, inner in ((attn._FWD_CONFIGS, "BLOCK_M", "BLOCK_N"), (attn._DQ_CONFIGS, "BLOCK_M", "BLOCK_N"),
                                (attn._DKDV_CONFIGS, "BLOCK_N", "BLOCK_M")):
        assert set(table) == {(s, d) for s in (2, 4) for d in (64, 128, 256)}
        for configs in table.values():
            for c in configs:
                assert c[inner] >= 16 and c[outer] % c[inner] == 0, c


CPU_TABLE_KEYS = [(torch.float16, 64), (torch.float16, 128), (torch.float32, 64), (torch.float32, 128),
                  (torch.float16, 256), (torch.float32, 256)]


@pytest.mark.parametrize("dtype,head_dim", CPU_TABLE_KEYS, ids=[f"{d}-d{e}".replace("torch.", "")
                                                                for d, e in CPU_TABLE_KEYS])
def test_default_configs(dtype, head_dim):
    """The first (default) candidate of each table, on lengths that fit its tiles and end ragged."""
    check(qkv(1, 1, 1, 130, 140, head_dim, dtype), is_causal=True)


TMA_CASES = {  # id -> (B, H, HK, Lq, Lk, E, keyword arguments)
    "causal-gqa": (2, 4, 2, 45, 37, 32, {"is_causal": True, "enable_gqa": True}),
    "mask-d80": (1, 2, 2, 33, 50, 80, {"attn_mask": "float"}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TMA_CASES)
def test_tma_loads(case, dtype, monkeypatch):
    """The tensor-descriptor loads (Hopper) of every kernel, forced (on the GPU: the first TMA candidate,
    which must be one for this layout): rows and head-dim columns past the end read 0; (B, L, H, E) storage."""
    B, H, HK, Lq, Lk, E, kwargs = TMA_CASES[case]
    if not ON_GPU:
        forced = lambda name, key, configs, prepare: dict(SMALL_TILES[name], TMA=True)  # noqa: E731
    elif attn._runtime.is_hopper() and dtype != torch.float32:
        forced = lambda name, key, configs, prepare: next(c for c in configs if c["TMA"])  # noqa: E731
    else:
        pytest.skip("TMA loads: Hopper, 16-bit")
    monkeypatch.setattr(attn._autotune, "pick", forced)
    if kwargs.get("attn_mask") == "float":
        kwargs = dict(kwargs, attn_mask=randn(B, 1, Lq, Lk))
    leaves = {"q": randn(B, Lq, H, E, dtype=dtype), "k": randn(B, Lk, HK, E, dtype=dtype),
              "v": randn(B, Lk, HK, E, dtype=dtype)}

    def build(q, k, v):
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    check(leaves, build=build, **kwargs)


EVERY_CONFIG = [pytest.param(table, key, i, tma, id=f"{table}-{key[0]}B-d{key[1]}-{i}{'-tma' if tma else ''}")
                for table in ("_FWD_CONFIGS", "_DKDV_CONFIGS", "_DQ_CONFIGS")
                for key, configs in getattr(attn, table).items() for i in range(len(configs))
                for tma in ((False, True) if key[0] == 2 else (False,))]


@gpu
@slow
@pytest.mark.parametrize("table,key,index,tma", EVERY_CONFIG)
def test_every_config(table, key, index, tma, monkeypatch):
    """Each candidate forced (the others' defaults), causal with grouped heads (diagonal band, ragged ends,
    the group loop) on ragged lengths."""
    if tma and not attn._runtime.is_hopper():
        pytest.skip("TMA loads: Hopper")
    cfg = dict(getattr(attn, table)[key][index], TMA=tma)
    name = {"_FWD_CONFIGS": "attention_fwd", "_DKDV_CONFIGS": "attention_dkdv", "_DQ_CONFIGS": "attention_dq"}[table]
    pick = attn._autotune.pick
    monkeypatch.setattr(attn._autotune, "pick",
                        lambda n, k, configs, prepare: cfg if n == name else pick(n, k, configs, prepare))
    dtype = torch.float32 if key[0] == 4 else torch.float16
    E = {64: 64, 128: 96, 256: 256}[key[1]]
    check(qkv(2, 4, 2, 300, 277, E, dtype), is_causal=True, enable_gqa=True)


# ---------------------------------------------------------------------------------------- registered ops
REGISTERED = {  # id -> (B, H, HK, Lq, Lk, E, mask kind, is_causal, scale, storage): what each op branches on
    "plain": (1, 2, 2, 20, 24, 16, None, False, 0.25, "BHLE"),
    "causal-gqa": (2, 4, 2, 20, 17, 16, None, True, 0.25, "BHLE"),
    "bool-mask-BLHE": (1, 2, 2, 20, 24, 16, "bool", False, 0.25, "BLHE"),
    "float-mask-d40-negative-scale": (1, 2, 1, 9, 20, 40, "float", False, -0.3, "BHLE"),
    "no-keys": (1, 2, 2, 5, 0, 16, None, False, 0.25, "BHLE"),
    "no-queries": (1, 2, 2, 0, 5, 16, None, True, 0.25, "BHLE"),
}


@pytest.mark.parametrize("loads", ["pointers", "tma", "chunked"])
@pytest.mark.parametrize("case", REGISTERED)
def test_registered_ops(case, loads, monkeypatch):
    """Schema, fake and dynamic-shape tracing of the forward and backward ops (what torch.compile sees): masks,
    causal, grouped heads, (B, L, H, E) storage, empty lengths; loads through pointers, tensor descriptors
    (forced; on the GPU fp16, where the layout allows them) and head-dim chunks (forced under the interpreter).
    Nothing is tuned: the GPU takes the first candidate with the loads asked for."""
    B, H, HK, Lq, Lk, E, mask_kind, is_causal, scale, storage = REGISTERED[case]
    tma = loads == "tma"
    dtype = torch.float16 if tma and ON_GPU else torch.float32
    if ON_GPU:
        if loads == "chunked":
            pytest.skip("chunks are forced on the interpreter's small tiles (tf32x3 on the GPU)")
        forced = lambda name, key, configs, prepare: next(  # noqa: E731
            (c for c in configs if c["TMA"] == tma), configs[0])
        monkeypatch.setattr(attn._autotune, "pick", forced)
    elif tma:
        monkeypatch.setattr(attn._autotune, "pick", lambda name, key, configs, prepare: dict(SMALL_TILES[name],
                                                                                            TMA=True))
    elif loads == "chunked":
        monkeypatch.setattr(attn, "_chunk", lambda q, precision: 16)

    def make(heads, length):
        if storage == "BLHE":
            return randn(B, length, heads, E, dtype=dtype).transpose(1, 2)
        return randn(B, heads, length, E, dtype=dtype)
    q, k, v = make(H, Lq), make(HK, Lk), make(HK, Lk)
    mask = {None: None, "bool": torch.rand(B, 1, Lq, Lk, device=DEVICE) > 0.3,
            "float": randn(B, 1, Lq, Lk)}[mask_kind]
    mask = None if mask is None else mask.expand(B, H, Lq, Lk)
    _check.opcheck(torch.ops.dropin.attention.default, q, k, v, mask, is_causal, scale)
    out, stats = torch.ops.dropin.attention(q, k, v, mask, is_causal, scale)
    grad_out = torch.randn_like(out)
    _check.opcheck(torch.ops.dropin.attention_bwd.default, grad_out, q, k, v, mask, out, stats, is_causal, scale)


# ------------------------------------------------------------------------------------------- compile
def _block(attention):
    def f(q, k, v, mask):
        return attention(q, k, v, attn_mask=mask).relu().sum(-1, keepdim=True) * attention(q, k, v, is_causal=True)
    return f


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=gpu)])
def test_torch_compile_fullgraph(dtype):
    """Two attentions (masked, causal) in one graph, compiled with fullgraph=True; fwd and bwd."""
    torch._dynamo.reset()
    compiled = torch.compile(_block(dropin.ops.attention), fullgraph=True)
    leaves = qkv(1, 2, 2, 24, 24, 32, dtype)
    mask = randn(1, 1, 24, 24)
    out = compiled(**{k: v.requires_grad_() for k, v in leaves.items()}, mask=mask)
    ref_leaves = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    ref = _block(F.scaled_dot_product_attention)(**ref_leaves, mask=mask.double())
    assert_close(out, ref, dtype, "fwd")
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(leaves.values()), grad)
    grads_64 = torch.autograd.grad(ref, list(ref_leaves.values()), grad.double())
    for name, g, g_64 in zip(leaves, grads, grads_64):
        assert_close(g, g_64, dtype, "bwd", what=f"gradient of '{name}'")


@gpu
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.bfloat16], ids=["bool", "float"])
def test_untuned_default_with_mask_d128_bf16(mask_dtype):
    """The first candidate (what runs untuned, or inside a CUDA-graph capture) fits in shared memory with a
    mask at d128: it once asked 234 KB of 227."""
    mask = torch.rand(1, 1, 256, 256, device=DEVICE) > 0.2 if mask_dtype is torch.bool else \
        randn(1, 1, 256, 256, dtype=mask_dtype)
    check(qkv(1, 2, 2, 256, 256, 128, torch.bfloat16), attn_mask=mask)


# ------------------------------------------------------------------------------------ TF32, autocast
@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["allow_tf32-off", "allow_tf32-on"])
def test_float32_follows_allow_tf32(tf32, allow_tf32):
    """True fp32 (1e-5 and within 2x torch) unless torch.backends.cuda.matmul.allow_tf32; then tf32. The peer
    is torch's math backend, whose matmuls follow the same switch (its fused fp32 backends ignore it)."""
    allow_tf32(tf32)
    check(qkv(2, 4, 4, 1024, 1024, 256, torch.float32), attn_mask=randn(2, 1, 1024, 1024), peer=attn.attention_ref)


@gpu
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast(amp_dtype):
    """fp32 leaves under torch.autocast: the output in its dtype, against float64 on the leaves rounded to it."""
    check(qkv(2, 4, 4, 128, 128, 64, torch.float32), autocast=amp_dtype, backward=False, is_causal=True)


# ------------------------------------------------------------------------------------------ reference
def test_reference_function():
    q, k, v = (t.double() for t in qkv(1, 4, 2, 5, 7, 16, torch.float32).values())
    mask = torch.rand(5, 7, device=DEVICE) > 0.3
    mask[:, 0] = True
    scores = (q @ k.repeat_interleave(2, 1).mT / 4).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(attn.attention_ref(q, k, v, attn_mask=mask, enable_gqa=True),
                               scores.softmax(-1) @ v.repeat_interleave(2, 1))


# --------------------------------------------------------------------------------------------- errors
WRONG_DEVICE = "cpu" if ON_GPU else "meta"


def T(*shape, dtype=torch.float32, device=None):
    return torch.randn(shape, device=device or DEVICE).to(dtype)


fp16 = torch.float16
ERRORS = [  # (id, arguments, keyword arguments, exception, the argument the message must name)
    ("q-int", lambda: (T(1, 2, 3, 8, dtype=torch.int32), T(1, 2, 3, 8), T(1, 2, 3, 8)), {}, RuntimeError, "q"),
    ("k-dtype-mismatch", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8, dtype=fp16), T(1, 2, 3, 8)), {}, RuntimeError, "k"),
    ("v-dtype-mismatch", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8, dtype=fp16)), {}, RuntimeError, "v"),
    ("q-list", lambda: ([[1.0]], T(1, 2, 3, 8), T(1, 2, 3, 8)), {}, TypeError, "q"),
    ("k-device", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8, device=WRONG_DEVICE), T(1, 2, 3, 8)), {}, RuntimeError, "k"),
    ("q-2d", lambda: (T(3, 8), T(3, 8), T(3, 8)), {}, RuntimeError, "q"),
    ("k-3d-q-4d", lambda: (T(1, 2, 3, 8), T(2, 3, 8), T(1, 2, 3, 8)), {}, RuntimeError, "k"),
    ("v-batch", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(2, 2, 3, 8)), {}, RuntimeError, "v"),
    ("v-keys", lambda: (T(1, 2, 3, 8), T(1, 2, 5, 8), T(1, 2, 4, 8)), {}, RuntimeError, "v"),
    ("k-head-dim", lambda: (T(1, 2, 3, 8), T(1, 2, 5, 16), T(1, 2, 5, 8)), {}, RuntimeError, "k"),
    ("v-head-dim", lambda: (T(1, 2, 3, 8), T(1, 2, 5, 8), T(1, 2, 5, 16)), {}, RuntimeError, "v"),
    ("head-dim-512", lambda: (T(1, 1, 3, 512), T(1, 1, 5, 512), T(1, 1, 5, 512)), {}, RuntimeError, "q"),
    ("heads-no-gqa", lambda: (T(1, 4, 3, 8), T(1, 2, 5, 8), T(1, 2, 5, 8)), {}, RuntimeError, "k"),
    ("heads-gqa-not-divisor", lambda: (T(1, 4, 3, 8), T(1, 3, 5, 8), T(1, 3, 5, 8)), {"enable_gqa": True},
     RuntimeError, "k"),
    ("v-heads", lambda: (T(1, 4, 3, 8), T(1, 2, 5, 8), T(1, 1, 5, 8)), {"enable_gqa": True}, RuntimeError, "v"),
    ("dropout", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8)), {"dropout_p": 0.1}, NotImplementedError,
     "dropout_p"),
    ("mask-and-causal", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8), T(3, 3)), {"is_causal": True},
     RuntimeError, "attn_mask"),
    ("mask-int", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8), T(3, 3, dtype=torch.int32)), {},
     RuntimeError, "attn_mask"),
    ("mask-fp16-for-fp32", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8), T(3, 3, dtype=fp16)), {},
     RuntimeError, "attn_mask"),
    ("mask-shape", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8), T(3, 4)), {}, RuntimeError, "attn_mask"),
    ("mask-5d", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8), T(2, 1, 2, 3, 3)), {}, RuntimeError,
     "attn_mask"),
    ("mask-device", lambda: (T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8), T(3, 3, device=WRONG_DEVICE)), {},
     RuntimeError, "attn_mask"),
]


@pytest.mark.parametrize("args,kwargs,exc,name", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_input_raises(args, kwargs, exc, name):
    args = args()
    with pytest.raises(exc, match=f"'{name}'"):
        dropin.ops.attention(*args, **kwargs)
    try:  # where torch rejects the input too, it raises the same type
        F.scaled_dot_product_attention(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, exc), f"torch raises {type(e).__name__}, the test expects {exc.__name__}"


def test_mask_gradient_raises():
    mask = T(3, 3).requires_grad_()
    with pytest.raises(RuntimeError, match="'attn_mask'"):
        dropin.ops.attention(T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8), attn_mask=mask)
    with torch.no_grad():
        dropin.ops.attention(T(1, 2, 3, 8), T(1, 2, 3, 8), T(1, 2, 3, 8), attn_mask=mask)
