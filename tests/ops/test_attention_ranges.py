"""The key-tile summary of an attention mask (dropin.ops.attention_ranges) against a reference computed with torch
from its definition: per block of RANGE_ROWS query rows, the span of key blocks some row attends to and the first
run of key blocks inside Lk that every row attends to wholly. (The outputs of attention with such masks, forward
and backward, are test_attention.py's test_structured_masks.)"""
import pytest
import torch

from _tol import DEVICE
from dropin.ops.attention_ranges import RANGE_COLS, RANGE_ROWS, Summary


def ranges_ref(mask: torch.Tensor, kind: str) -> torch.Tensor:
    """[B, H, row blocks, 4] (lo, hi, full_lo, full_hi) of a [B, H, Lq, Lk] mask (no broadcast dims)."""
    B, H, Lq, Lk = mask.shape
    attends = mask if kind == "bool" else mask != float("-inf")
    free = mask if kind == "bool" else mask == 0
    blocks = -(-Lk // RANGE_COLS)
    out = torch.empty(B, H, -(-Lq // RANGE_ROWS), 4, dtype=torch.int32)
    for b in range(B):
        for h in range(H):
            for r in range(out.shape[2]):
                rows = slice(r * RANGE_ROWS, (r + 1) * RANGE_ROWS)
                cols = [slice(j * RANGE_COLS, (j + 1) * RANGE_COLS) for j in range(blocks)]
                some = [bool(attends[b, h, rows, c].any()) for c in cols]
                every = [bool(free[b, h, rows, c].all()) and (j + 1) * RANGE_COLS <= Lk for j, c in enumerate(cols)]
                hit = [j for j in range(blocks) if some[j]]
                lo, hi = (hit[0] * RANGE_COLS, min((hit[-1] + 1) * RANGE_COLS, Lk)) if hit else (Lk, 0)
                full_lo = full_hi = 0
                if any(every):
                    first = every.index(True)
                    end = next((j for j in range(first, blocks) if not every[j]), Lk // RANGE_COLS)
                    full_lo, full_hi = first * RANGE_COLS, end * RANGE_COLS
                out[b, h, r] = torch.tensor([lo, hi, full_lo, full_hi])
    return out


def patterns(B, Lq, Lk):
    """Masks [B, 1, Lq, Lk] (bool, True: attend) of the shapes the summary is for, and a random one."""
    i = torch.arange(Lq, device=DEVICE)[:, None]
    j = torch.arange(Lk, device=DEVICE)[None, :]
    lengths = torch.tensor([Lk, Lk // 2 + 3][:B], device=DEVICE)
    padding = (j[None] < lengths[:, None, None]).expand(B, Lq, Lk)
    causal = (j <= i).expand(B, Lq, Lk)
    return {
        "causal": causal,
        "window": causal & (j > i - 37),
        "padding": padding,
        "causal-left-padding": causal & (j[None] >= Lk - lengths[:, None, None]),  # whole rows that attend nothing
        "two-runs": ((j < 20) | (j >= 50) & (j < 90)).expand(B, Lq, Lk),
        "random": torch.rand(B, Lq, Lk, device=DEVICE) > 0.5,
        "none": torch.zeros(B, Lq, Lk, dtype=torch.bool, device=DEVICE),
    }


def poison_ints(monkeypatch) -> None:
    """torch.empty of an integer dtype fills -7 from here on: an entry the kernel fails to write shows."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(-7))


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("lengths", [(100, 100), (37, 130), (130, 47)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("pattern", list(patterns(2, 4, 4)))
def test_summary(pattern, lengths, kind, monkeypatch):
    mask = patterns(2, *lengths)[pattern][:, None].contiguous()
    if kind == "float":  # blocked -inf, attended 0 or (to tell "attends" from "attends wholly") a random value
        values = torch.where(torch.rand(mask.shape, device=DEVICE) > 0.2, 0.0, torch.randn(mask.shape, device=DEVICE))
        mask = torch.where(mask, values, float("-inf"))
    summary = Summary(mask, kind)
    poison_ints(monkeypatch)
    ranges = summary(mask.view(torch.uint8) if kind == "bool" else mask)
    assert summary.strides == (ranges.shape[1] * ranges.shape[2] * 4, 0)
    torch.testing.assert_close(ranges.cpu(), ranges_ref(mask.cpu(), kind), rtol=0, atol=0)


@pytest.mark.parametrize("view", ["batch-and-heads", "heads", "strided"])
def test_summary_views(view, monkeypatch):
    """Broadcast dims are summarized once (stride 0 for the reader); any strides are read."""
    base = patterns(2, 50, 70)["window"][:, None]
    if view == "batch-and-heads":
        mask, expect_shape = base[:1].expand(2, 3, 50, 70), (1, 1)
    elif view == "heads":
        mask, expect_shape = base.expand(2, 3, 50, 70), (2, 1)
    else:
        wide = torch.rand(2, 3, 140, 50, device=DEVICE) > 0.5
        mask, expect_shape = wide.transpose(2, 3)[..., ::2], (2, 3)  # strides (7000, 2800, 1, 100)
    summary = Summary(mask, "bool")
    poison_ints(monkeypatch)
    ranges = summary(mask.view(torch.uint8))
    assert ranges.shape[:2] == expect_shape
    dense = mask[:expect_shape[0], :expect_shape[1]].contiguous()
    torch.testing.assert_close(ranges.cpu(), ranges_ref(dense.cpu(), "bool"), rtol=0, atol=0)
