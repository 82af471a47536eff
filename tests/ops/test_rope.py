"""dropin.ops.rope against HF Llama's apply_rotary_pos_emb: forward and the gradients of q and k.

No tl.dot here, so bfloat16 runs under the interpreter too; `gpu` adds Llama-sized shapes.
"""
import importlib

import pytest
import torch

import _check
import dropin
from _check import check, found_shortcuts, poison_allocations
from _tol import DEVICE, ON_GPU, gpu

rope_module = importlib.import_module("dropin.ops.rope")
rope_ref = rope_module.rope_ref

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


def cos_sin(positions, head_dim, dtype, batch=None, base=10000.0):
    """HF's LlamaRotaryEmbedding: angles pos * inv_freq, duplicated halves; [batch, positions, D] if batch."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=DEVICE) / head_dim)
    pos = torch.arange(positions, dtype=torch.float64, device=DEVICE)
    if batch is not None:
        pos = pos + torch.randint(0, 100, (batch, 1), device=DEVICE)
    angles = pos[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def qk_leaves(b, hq, hk, s, d, dtype, cos_batch=None):
    cos, sin = cos_sin(s, d, dtype, cos_batch)
    return {"q": torch.randn(b, hq, s, d, device=DEVICE, dtype=dtype),
            "k": torch.randn(b, hk, s, d, device=DEVICE, dtype=dtype), "cos": cos, "sin": sin}


def ours(q, k, cos, sin, position_ids=None):
    return dropin.ops.rope(q, k, cos, sin, position_ids)


SHAPES = [  # (batch, q heads, k heads, seq, head_dim)
    pytest.param((1, 1, 1, 1, 2), id="1x1x1x1x2"),
    pytest.param((2, 4, 4, 7, 16), id="2x4x4x7x16"),
    pytest.param((1, 7, 1, 33, 10), id="gqa-7q-1k-seq33-d10"),
    pytest.param((3, 8, 2, 5, 128), id="gqa-8q-2k-d128"),
    pytest.param((1, 2, 2, 1000, 6), id="seq1000-d6"),
    pytest.param((2, 3, 3, 9, 34), id="weird-d34"),
    pytest.param((2, 32, 8, 1024, 128), id="llama3-2x32x8x1024x128", marks=gpu),
    pytest.param((1, 32, 32, 4096, 128), id="llama-1x32x4096x128", marks=gpu),
    pytest.param((4, 5, 1, 333, 96), id="weird-4x5x1x333x96", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cos_batch", [False, True], ids=["cos-2d", "cos-3d"])
def test_rope(shape, cos_batch, dtype):
    b, hq, hk, s, d = shape
    check(ours, rope_ref, qk_leaves(b, hq, hk, s, d, dtype, b if cos_batch else None), constant=("cos", "sin"))


@pytest.mark.parametrize("ids_shape", ["batch", "shared", "1d"])
def test_position_ids(ids_shape):
    """Older HF: a [positions, D] table indexed by position_ids."""
    b, s, d = 3, 11, 8
    cos, sin = cos_sin(64, d, torch.float32)
    ids = {"batch": torch.randint(0, 64, (b, s)), "shared": torch.randint(0, 64, (1, s)),
           "1d": torch.randint(0, 64, (s,))}[ids_shape].to(DEVICE)
    t = {"q": torch.randn(b, 4, s, d, device=DEVICE), "k": torch.randn(b, 2, s, d, device=DEVICE),
         "cos": cos, "sin": sin, "position_ids": ids}
    check(ours, rope_ref, t, constant=("cos", "sin"))


def test_cos_batch_broadcast_and_strides():
    """cos [1, S, D] broadcast over the batch; cos and sin as slices of a wider table; q, k as HF makes them
    (the projection viewed [B, S, H, D] and transposed), k a slice of a fused kv buffer."""
    b, s, d = 2, 9, 16
    cos, sin = cos_sin(s, 2 * d, torch.float32)
    t = {"q": torch.randn(b, s, 6, d, device=DEVICE), "kv": torch.randn(b, s, 2, 3, d, device=DEVICE),
         "cos": cos[None], "sin": sin[None]}

    def build(q, kv, cos, sin):
        return q.transpose(1, 2), kv[:, :, 0].transpose(1, 2), cos[..., ::2], sin[..., ::2]
    check(ours, rope_ref, t, build=build, constant=("cos", "sin"))


def test_general_cos_sin_halves():
    """The backward is exact for any cos / sin, not only for HF's duplicated halves."""
    t = {"q": torch.randn(2, 3, 5, 8, device=DEVICE), "k": torch.randn(2, 1, 5, 8, device=DEVICE),
         "cos": torch.randn(5, 8, device=DEVICE), "sin": torch.randn(5, 8, device=DEVICE)}
    check(ours, rope_ref, t, constant=("cos", "sin"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace(dtype):
    t = qk_leaves(2, 4, 2, 7, 16, dtype)

    def inplace(q, k, cos, sin):
        q2, k2 = q * 1, k * 1  # non-leaf copies, as autograd allows in-place only there
        q_out, k_out = dropin.ops.rope(q2, k2, cos, sin, inplace=True)
        assert q_out is q2 and k_out is k2
        return q_out, k_out
    check(inplace, rope_ref, t, constant=("cos", "sin"))


def test_inplace_under_no_grad_guards_saved_tensors():
    """Writing in place over a tensor that autograd saved (exp saves its output) must make the backward
    fail, as a torch in-place op would, not silently use the rotated values."""
    a = torch.randn(1, 2, 3, 8, device=DEVICE, requires_grad=True)
    q = a.exp()
    k = torch.randn(1, 1, 3, 8, device=DEVICE)
    cos, sin = cos_sin(3, 8, torch.float32)
    with torch.no_grad():
        dropin.ops.rope(q, k, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        q.sum().backward()


def test_inplace_on_views_no_grad():
    qkv = torch.randn(2, 5, 3, 4, 8, device=DEVICE)  # [B, S, (q, k, v), H, D]
    cos, sin = cos_sin(5, 8, torch.float32)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    want = rope_ref(q, k, cos, sin)
    v_before = qkv[:, :, 2].clone()
    dropin.ops.rope(q, k, cos, sin, inplace=True)
    torch.testing.assert_close(qkv[:, :, 0].transpose(1, 2), want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, :, 1].transpose(1, 2), want[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, :, 2], v_before)


def test_every_output_element_written(monkeypatch):
    poison_allocations(monkeypatch)
    check(ours, rope_ref, qk_leaves(2, 5, 3, 9, 34, torch.float16), constant=("cos", "sin"))


def test_output_layout_follows_input():
    q = torch.randn(2, 7, 4, 16, device=DEVICE).transpose(1, 2)
    k = torch.randn(2, 7, 2, 16, device=DEVICE).transpose(1, 2)
    cos, sin = cos_sin(7, 16, torch.float32)
    q_out, k_out = dropin.ops.rope(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


def test_backward_of_a_sum_of_q_only():
    """Upstream gradients as autograd makes them for `q_embed.sum()`: expanded (stride 0), none for k."""
    t = qk_leaves(2, 3, 1, 5, 8, torch.float32)
    q = t["q"].requires_grad_()
    k = t["k"].requires_grad_()
    q_out, _ = dropin.ops.rope(q, k, t["cos"], t["sin"])
    q_out.sum().backward()
    q64 = t["q"].detach().double().requires_grad_()
    rope_ref(q64, t["k"].double(), t["cos"].double(), t["sin"].double())[0].sum().backward()
    torch.testing.assert_close(q.grad, q64.grad.float(), rtol=1e-5, atol=1e-6)
    assert k.grad is None or not k.grad.any()


def test_empty():
    q, k = torch.randn(2, 4, 0, 8, device=DEVICE), torch.randn(2, 0, 0, 8, device=DEVICE)
    cos, sin = cos_sin(0, 8, torch.float32)
    q_out, k_out = dropin.ops.rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_repeat_call_through_the_shortcut(inplace, monkeypatch):
    """A repeat eager call without autograd takes its signature's shortcut (`Shortcuts`), on HF's transposed views
    with position_ids: HF's values (every element written) in the first call's layout, or in place in q and k with
    their versions bumped; the bounds of position_ids still checked on every call."""
    cos, sin = cos_sin(9, 8, torch.float32)

    def call(shift=0):  # (ours, HF's) on new inputs
        q, k = (torch.randn(2, 5, h, 8, device=DEVICE).transpose(1, 2) for h in (4, 2))
        ids = torch.randint(0, 9, (2, 5), device=DEVICE) + shift
        want = rope_ref(q, k, cos, sin, ids) if not shift else None
        versions = q._version, k._version
        out = dropin.ops.rope(q, k, cos, sin, ids, inplace=inplace)
        if inplace:
            assert out[0] is q and out[1] is k and q._version > versions[0] and k._version > versions[1]
        return out, want
    served = found_shortcuts(monkeypatch)
    poison_allocations(monkeypatch)
    with torch.no_grad():
        first, _ = call()
        out, want = call()
        with pytest.raises(RuntimeError, match="'position_ids' range"):
            call(shift=9)
    for o, w, o_first in zip(out, want, first):
        torch.testing.assert_close(o, w)
        assert o.stride() == o_first.stride()
    assert served[1:] == [True, True]


def test_repeat_calls_with_autograd_through_the_shortcut(monkeypatch):
    """Repeat calls out of place where autograd records them (HF's transposed views, with and without position_ids;
    contiguous q and k) take their signature's shortcut, forward and backward, and give what the op's own path
    gives, bit for bit (`_check.assert_grad_calls_repeat_through_shortcuts`)."""
    cos, sin = cos_sin(9, 8, torch.float32)
    ids = torch.randint(0, 9, (2, 5), device=DEVICE)
    q, k = (torch.randn(2, 5, h, 8, device=DEVICE).transpose(1, 2) for h in (4, 2))
    calls = [(lambda q, k: dropin.ops.rope(q, k, cos, sin, ids), (q, k)),
             (lambda q, k: dropin.ops.rope(q, k, cos[:5], sin[:5]), (q.contiguous(), k.contiguous()))]
    _check.assert_grad_calls_repeat_through_shortcuts(calls, monkeypatch)


def test_torch_compile_fullgraph():
    torch._dynamo.reset()

    def attn_scores(rope):
        def f(q, k, cos, sin):
            q, k = rope(q, k, cos, sin)
            return q @ k.transpose(-1, -2)
        return f
    check(torch.compile(attn_scores(ours), fullgraph=True), attn_scores(rope_ref), qk_leaves(2, 4, 4, 6, 16,
          torch.float32), constant=("cos", "sin"))


def test_torch_compile_fullgraph_position_ids():
    """The bounds check of position_ids (a host sync) stays out of the compiled graph: no graph break."""
    torch._dynamo.reset()
    cos, sin = cos_sin(16, 8, torch.float32)
    t = {"q": torch.randn(2, 4, 6, 8, device=DEVICE), "k": torch.randn(2, 2, 6, 8, device=DEVICE), "cos": cos,
         "sin": sin, "position_ids": torch.randint(0, 16, (2, 6), device=DEVICE)}
    check(torch.compile(ours, fullgraph=True), rope_ref, t, constant=("cos", "sin"))


REGISTERED = {  # id -> (q, k, cos, sin, position_ids)
    "cos-2d-fp32": lambda: (*qk_leaves(2, 4, 2, 7, 16, torch.float32).values(), None),
    "cos-3d-fp16": lambda: (*qk_leaves(2, 3, 1, 5, 10, torch.float16, cos_batch=2).values(), None),
    "hf-strides-bf16": lambda: (torch.randn(2, 7, 4, 16, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2),
                                torch.randn(2, 7, 2, 16, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2),
                                *cos_sin(7, 16, torch.bfloat16, batch=1), None),
    "ids-2d": lambda: (*qk_leaves(2, 4, 2, 7, 16, torch.float32).values(), torch.randint(0, 7, (2, 7))),
    "ids-1d-int32": lambda: (*qk_leaves(1, 2, 2, 7, 8, torch.float32).values(),
                             torch.randint(0, 7, (7,), dtype=torch.int32)),
}


@pytest.mark.parametrize("case", REGISTERED)
def test_registered_ops(case):
    """Schema, fake and dynamic-shape tracing of the ops (what torch.compile sees): forward and backward rotation,
    and the in-place one, which writes q and k (declared in mutates_args) and returns nothing."""
    q, k, cos, sin, ids = REGISTERED[case]()
    ids = None if ids is None else ids.to(DEVICE)
    for backward in (False, True):
        _check.opcheck(torch.ops.dropin.rope.default, q, k, cos, sin, ids, backward)
    _check.opcheck(torch.ops.dropin.rope_.default, q.clone(), k.clone(), cos, sin, ids)
    want, versions = rope_ref(q, k, cos, sin, ids), (q._version, k._version)
    assert torch.ops.dropin.rope_(q, k, cos, sin, ids) is None
    assert q._version > versions[0] and k._version > versions[1], "autograd not told of the writes"
    for got, w in zip((q, k), want):
        torch.testing.assert_close(got, w, rtol=1e-2, atol=1e-2)


def test_reference_is_hf_llama():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    t = qk_leaves(2, 4, 2, 7, 16, torch.float32, cos_batch=2)
    want = llama.apply_rotary_pos_emb(t["q"], t["k"], t["cos"], t["sin"])
    got = rope_ref(t["q"], t["k"], t["cos"], t["sin"])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- errors
WRONG_DEVICE = "cpu" if ON_GPU else "meta"


def T(*shape, dtype=torch.float32, device=None):
    return torch.randn(shape, device=device or DEVICE).to(dtype)


def args(**override):
    """Valid arguments (q [2, 4, 5, 8], k [2, 2, 5, 8], cos / sin [5, 8]) with some replaced."""
    a = {"q": T(2, 4, 5, 8), "k": T(2, 2, 5, 8), "cos": T(5, 8), "sin": T(5, 8), "position_ids": None}
    a.update(override)
    return a


ERRORS = [  # (id, arguments, exception, the argument the message must name)
    ("q-3d", lambda: args(q=T(4, 5, 8)), RuntimeError, "q"),
    ("k-batch", lambda: args(k=T(3, 2, 5, 8)), RuntimeError, "k"),
    ("k-seq", lambda: args(k=T(2, 2, 6, 8)), RuntimeError, "k"),
    ("k-head-dim", lambda: args(k=T(2, 2, 5, 6)), RuntimeError, "k"),
    ("odd-head-dim", lambda: args(q=T(2, 4, 5, 7), k=T(2, 2, 5, 7), cos=T(5, 7), sin=T(5, 7)), RuntimeError, "q"),
    ("cos-seq", lambda: args(cos=T(6, 8)), RuntimeError, "cos"),
    ("cos-batch", lambda: args(cos=T(3, 5, 8), sin=T(3, 5, 8)), RuntimeError, "cos"),
    ("sin-shape", lambda: args(sin=T(1, 5, 8)), RuntimeError, "sin"),
    ("k-dtype", lambda: args(k=T(2, 2, 5, 8, dtype=torch.float16)), RuntimeError, "k"),
    ("cos-dtype", lambda: args(cos=T(5, 8, dtype=torch.float16)), RuntimeError, "cos"),
    ("q-float64", lambda: args(q=T(2, 4, 5, 8, dtype=torch.float64)), RuntimeError, "q"),
    ("q-list", lambda: args(q=[1.0]), TypeError, "q"),
    ("sin-none", lambda: args(sin=None), TypeError, "sin"),
    ("k-device", lambda: args(k=T(2, 2, 5, 8, device=WRONG_DEVICE)), RuntimeError, "k"),
    ("cos-requires-grad", lambda: args(cos=T(5, 8).requires_grad_()), RuntimeError, "cos"),
    ("ids-float", lambda: args(cos=T(9, 8), sin=T(9, 8), position_ids=T(2, 5)), RuntimeError, "position_ids"),
    ("ids-shape", lambda: args(cos=T(9, 8), sin=T(9, 8), position_ids=torch.zeros(2, 4, dtype=torch.long,
                                                                                   device=DEVICE)),
     RuntimeError, "position_ids"),
    ("ids-range", lambda: args(cos=T(9, 8), sin=T(9, 8), position_ids=torch.full((2, 5), 9, device=DEVICE)),
     RuntimeError, "position_ids"),
    ("ids-3d-cos", lambda: args(cos=T(1, 5, 8), sin=T(1, 5, 8), position_ids=torch.zeros(5, dtype=torch.long,
                                                                                          device=DEVICE)),
     RuntimeError, "cos"),
]


@pytest.mark.parametrize("kwargs,exc,name", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_bad_input_raises(kwargs, exc, name):
    with pytest.raises(exc, match=f"'{name}'"):
        dropin.ops.rope(**kwargs())
