"""dropin.ops.attention for one query row per head (a decoding step: ops/attention_decode.py) against
F.scaled_dot_product_attention in float64: every split count, GQA / MQA, masks (bool, additive finfo.min, a row
that attends to no key), strided caches, and the registered op."""
import pytest
import torch

import _check
import dropin
from dropin.ops import attention_decode as decode
from _tol import DEVICE, DTYPES, assert_close, gpu


def _mask(kind, B, H, L, dtype):
    """HF's decoding mask [B, 1, 1, L] (key 0 always kept) broadcast to [B, H, 1, L]: bool or additive."""
    keep = torch.rand(B, 1, 1, L, device=DEVICE) > 0.3
    keep[..., 0] = True
    if kind == "bool":
        return keep.expand(B, H, 1, L)
    if kind == "float":
        return torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype).expand(B, H, 1, L)
    return None


CASES = [  # (B, H, HK, Lk, E)
    pytest.param((2, 4, 2, 150, 64), id="gqa-150-d64"),
    pytest.param((1, 8, 1, 300, 32), id="mqa-300-d32"),
    pytest.param((2, 3, 3, 70, 40), id="mha-70-d40"),
    pytest.param((1, 2, 2, 1, 16), id="one-key"),
    pytest.param((3, 6, 2, 513, 128), id="gqa-513-d128"),
    pytest.param((4, 32, 8, 4096, 128), id="llama-4096", marks=gpu),
    pytest.param((1, 32, 32, 1000, 128), id="mha-1000", marks=gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", [None, "bool", "float"])
@pytest.mark.parametrize("case", CASES)
def test_decode(case, mask, dtype):
    """Through the public function (no gradient wanted: the decoding path), the cache in HF's [B, HK, L, E]
    layout read from a [B, L, HK, E] buffer (strided)."""
    B, H, HK, L, E = case
    q = torch.randn(B, H, 1, E, device=DEVICE, dtype=dtype)
    k, v = (torch.randn(B, L, HK, E, device=DEVICE, dtype=dtype).transpose(1, 2) for _ in range(2))
    m = _mask(mask, B, H, L, dtype)
    with torch.no_grad():
        out = dropin.ops.attention(q, k, v, m, enable_gqa=True)
        theirs = decode.decode_ref(q, k, v, m)
    m64 = None if m is None else m if m.dtype == torch.bool else m.double()
    ref = decode.decode_ref(q.double(), k.double(), v.double(), m64)
    assert_close(out, ref, dtype, "fwd", torch_out=theirs)


def test_every_split_count(monkeypatch):
    """1 to 7 splits of the same keys give the same result (the combine rescales each split's partials)."""
    q, k, v = (torch.randn(2, 4, n, 32, device=DEVICE) for n in (1, 400, 400))
    k, v = k[:, :2], v[:, :2]
    ref = decode.decode_ref(q.double(), k.double(), v.double())
    for splits in range(1, 8):
        keys = -(-400 // splits // decode.BLOCK_N) * decode.BLOCK_N or decode.BLOCK_N
        monkeypatch.setattr(decode, "_splits", lambda B, HK, Lk, index, keys=keys: (-(-Lk // keys), keys))
        _check.replan(decode)
        assert_close(decode.decode(q, k, v), ref, torch.float32, "fwd")
    _check.replan(decode)


def test_row_with_no_key_is_zero():
    q, k, v = (torch.randn(1, 2, n, 16, device=DEVICE) for n in (1, 90, 90))
    mask = torch.ones(1, 2, 1, 90, dtype=torch.bool, device=DEVICE)
    mask[0, 1] = False
    out = decode.decode(q, k, v, mask)
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))
    assert_close(out[0, 0], decode.decode_ref(q.double(), k.double(), v.double())[0, 0], torch.float32, "fwd")


@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_registered_op(mask):
    q = torch.randn(2, 4, 1, 32, device=DEVICE)
    k, v = (torch.randn(2, 2, 70, 32, device=DEVICE) for _ in range(2))
    _check.opcheck(torch.ops.dropin.attention_decode.default, q, k, v, _mask(mask, 2, 4, 70, torch.float32), 0.2)


@gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_fp32_scores_within_2x_torch(head_dim, true_fp32):
    """True fp32, one query per head, a few keys and an additive mask (the fuzz suite's case 51): over 12 seeds the
    median of dropin's forward error over torch's (float64 reference) is at most 2. One FMA chain over the head dim
    made it 2.53 (H200); the scores' sums now run in chains of 32."""
    ratios = []
    for seed in range(12):
        torch.manual_seed(seed)
        q = torch.randn(7, 7, 1, head_dim, device=DEVICE)
        k, v = (torch.randn(7, 1, 22, head_dim, device=DEVICE) for _ in range(2))
        mask = torch.randn(1, 22, device=DEVICE)
        with torch.no_grad():
            ref = torch.nn.functional.scaled_dot_product_attention(
                *(t.double() for t in (q, k, v)), mask.double(), scale=0.55, enable_gqa=True)
            errors = [torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref) for out in (
                dropin.ops.attention(q, k, v, mask, scale=0.55, enable_gqa=True),
                torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=0.55, enable_gqa=True))]
        ratios.append((errors[0] / errors[1]).item())
    assert sorted(ratios)[len(ratios) // 2] <= 2, f"dropin / torch error over 12 seeds: {sorted(ratios)}"
