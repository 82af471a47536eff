"""Does dropin's fused linear + cross-entropy give eager's loss and gradients under torch.compile (inductor) at a
language-model head's size (several chunks, HF's label shift)? Prints the relative differences."""
import sys

import torch

from dropin.ops.linear_cross_entropy import linear_cross_entropy

tokens, hidden, vocab = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 1024, 32000)
torch.manual_seed(0)
h = torch.randn(4, tokens // 4, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5).requires_grad_()
labels = torch.randint(vocab, (4, tokens // 4), device="cuda")


def loss_fn(h, w, labels):
    x = h * 2  # an inductor-made input
    return linear_cross_entropy(x[:, :-1, :], w, labels[:, 1:].contiguous(), loss_dtype=torch.float32)


def step(fn):
    h.grad = w.grad = None
    loss = fn(h, w, labels)
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), h.grad.clone(), w.grad.clone()


ref = step(loss_fn)
for _ in range(2):
    got = step(torch.compile(loss_fn))
    print("compiled vs eager:", [f"{((a.float() - b.float()).norm() / b.float().norm()).item():.2e}"
                                  for a, b in zip(got, ref)])
