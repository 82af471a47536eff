"""Suite "attention": its quick cases pass, and its helpers mean what they say."""
import torch
import torch.nn.functional as F

from dropin import _runtime
from dropin.bench import attention as suite
from dropin.bench import harness
from dropin.cli import main


def test_quick_cases_pass(capsys):
    assert main(["bench", "attention", "--quick", "--no-save", "--warmup", "1", "--rep", "1"]) == 0
    out = capsys.readouterr().out
    assert "[FAILED]" not in out and "fwd+bwd" in out and "hf_eager" in out


def test_hf_eager_is_sdpa():
    """Up to its float32 softmax (as HF computes it)."""
    q, k, v = (torch.randn(2, 3, 9, 16, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        torch.testing.assert_close(suite.hf_eager(q, k, v, is_causal=causal),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=causal), rtol=1e-5, atol=1e-6)


def test_llama_mask():
    """Seed 002: batch b has tokens 0..b; each query sees the real keys at or before it."""
    mask = suite.llama_mask(2, 6, "fp32")
    assert mask.shape == (2, 1, 6, 6) and mask.device.type == _runtime.KERNEL_DEVICE
    seen = mask[:, 0] == 0
    assert seen[0].nonzero().tolist() == [[i, 0] for i in range(6)]
    assert seen[1, 3].tolist() == [True, True, False, False, False, False]
    assert (mask[~(mask == 0)] == torch.finfo(torch.float32).min).all()


def test_flops_count_backward_and_causal():
    full = suite.attention_case(1, 2, 8, 4, 16, "fp32")
    assert full.flops == 4 * 2 * 8 * 4 * 16
    assert suite.attention_case(1, 2, 8, 4, 16, "fp32", causal=True, backward=True).flops == full.flops / 2 * 3.5
    assert isinstance(full, harness.Case)


def test_reference_per_batch_entry_is_the_whole():
    """The per-entry reference gives what the providers give on the whole batch (mask with batch 1 shared)."""
    grad, q, k, v = (torch.randn(3, 2, 5, 8, dtype=torch.float64) for _ in range(4))
    mask = torch.randn(1, 1, 5, 5, dtype=torch.float64)
    for backward, inputs in ((False, (q, k, v, mask)), (True, (grad, q, k, v, mask))):
        case = suite.attention_case(3, 2, 5, 5, 8, "fp32", mask=lambda dtype: mask, backward=backward)
        torch.testing.assert_close(case.reference(*inputs), case.providers["sdpa_math"](*inputs))
