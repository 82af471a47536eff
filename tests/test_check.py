"""The check's own rules (tests/_check.py): the gradient layout rules accept what torch gives and nothing else."""
import pytest
import torch

import _check

CL = torch.channels_last


def test_format_rule():
    """"format": a 4-D gradient in torch's memory format, or laid out as its leaf (what .grad takes)."""
    nchw, nhwc = torch.empty(2, 3, 4, 5), torch.empty(2, 3, 4, 5).to(memory_format=CL)
    _check._assert_layout("format", "g", nhwc, nhwc, nchw)
    _check._assert_layout("format", "g", nhwc, torch.empty(1, 3, 4, 5).expand(2, 3, 4, 5), nchw)  # (a broadcast)
    with pytest.raises(AssertionError, match="not torch's memory format"):
        _check._assert_layout("format", "g", nchw, nhwc, nchw[:, :, ::2])
    # a leaf of a batched product, its last two dims transposed, one head: torch's CUDA gradient is contiguous (also
    # channels_last: its size-1 dims), its CPU one and dropin's the leaf's layout
    leaf = torch.empty_strided((1, 1, 8, 16), (1, 128, 1, 8))  # (the fuzz's Layout(transposed, perm=(1, 3, 2, 0)))
    _check._assert_layout("format", "g", torch.empty_strided(leaf.shape, (8, 8, 1, 8)), torch.empty(1, 1, 8, 16), leaf)
    with pytest.raises(AssertionError, match="not torch's memory format"):
        _check._assert_layout("format", "g", torch.empty_strided(leaf.shape, (128, 128, 1, 8)),
                              torch.empty(1, 1, 8, 16), torch.empty(1, 1, 8, 32)[..., ::2])  # (a leaf not dense)
