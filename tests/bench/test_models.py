"""dropin.bench.models' training step (the loss, the AdamW step, the memory row) and dropin.bench.peers (a
library's module-wide patches kept to its own model)."""
import copy
import types

import pytest
import torch
from torch import nn

from dropin import _runtime
from dropin.bench import harness, models, peers
from dropin.inject import inject_
from _tol import DEVICE


def _classifier():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5)).to(DEVICE)


def test_training_loss_of_a_classifier_is_the_cross_entropy_of_its_logits():
    model, x = _classifier(), torch.randn(4, 8, device=DEVICE)
    labels = models.training_labels(model, (x,))
    assert labels.shape == (4,) and labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() < 5
    assert torch.equal(labels, models.training_labels(model, (x,)))  # fixed
    loss = models.TrainingLoss(model, labels)
    assert not loss.own_loss and list(dict(loss.named_parameters())) == [f"model.{k}" for k, _ in
                                                                          model.named_parameters()]
    torch.testing.assert_close(loss(x), nn.functional.cross_entropy(model(x), labels), rtol=1e-6, atol=0)
    assert models.upstream_gradient(loss, (x,)).item() == 1.0  # (a loss: sum(output * 1))


def test_training_loss_of_a_language_model_is_its_own():
    """A causal LM computes its loss from the labels itself (HF's label shift): the same value as cross-entropy of
    its logits shifted by one; the labels are [batch, tokens]."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).to(DEVICE).eval()
    ids = torch.randint(0, 50, (2, 7), device=DEVICE)
    labels = models.training_labels(model, (ids,))
    loss = models.TrainingLoss(model, labels)
    assert labels.shape == (2, 7) and loss.own_loss
    logits = model(ids).logits
    expected = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
    torch.testing.assert_close(loss(ids), expected, rtol=1e-5, atol=0)


def test_bench_train_rows_take_an_optimizer_step(monkeypatch):
    """Each timed training step ends with an AdamW step (lr 0: the weights stay, the work is done); rows say the
    peak memory on the GPU only; a peer the model has none of gets a note, one that cannot run a note or error."""
    steps = []

    class Counting(torch.optim.AdamW):
        def step(self, closure=None):
            steps.append(self)
            return super().step(closure)

    monkeypatch.setattr(models, "timing_optimizer", lambda model: Counting(model.parameters(), lr=0.0))
    original, x = _classifier(), torch.randn(4, 8, device=DEVICE)
    injected = models.TrainingLoss(_classifier(), models.training_labels(original, (x,)))
    injected.model.load_state_dict(original.state_dict())
    original = models.TrainingLoss(original, injected.labels)
    before = {k: v.clone() for k, v in original.state_dict().items()}
    grad = models.upstream_gradient(original, (x,))
    reference = models.float64_step(original, (x,), grad)

    def missing():
        raise harness.Skipped("not here")
    rows = models.bench_rows("mlp", original, injected, (x,), grad=grad, reference=reference, dtype="float32",
                             batch=4, cover={}, warmup_ms=1, rep_ms=1, providers=("original", "dropin", "liger"),
                             peers={})
    assert steps and all(s.state for s in steps)  # stepped, with its moments
    assert all(torch.equal(v, original.state_dict()[k]) for k, v in before.items())
    assert [r["provider"] for r in rows] == ["original", "dropin", "liger"]
    assert rows[2]["note"] == "no liger version of mlp"
    for row in rows[:2]:
        assert row["mode"] == "train" and row["rel_err_vs_fp64"] < 1e-5 and row["median_ms"] > 0
        assert (row["peak_memory_mib"] is None) == _runtime.INTERPRET
    assert all(p.grad is None for p in (*original.parameters(), *injected.parameters()))
    rows = models.bench_rows("mlp", original, injected, (x,), grad=grad, reference=reference, dtype="float32",
                             batch=4, cover={}, warmup_ms=1, rep_ms=1, providers=("liger",), peers={"liger": missing})
    assert rows[0]["note"] == "not here" and rows[0]["median_ms"] is None


def test_host_bound_providers_are_timed_in_alternation(monkeypatch):
    """The eager providers' steps are timed again at the end in alternation (the host's speed drifts within a
    process): ROUNDS rounds of original's calls then dropin's; each row's times are that alternation's."""
    order, alternated = [], []
    provider_step, alternated_times = models._provider_step, harness.alternated_times

    def spy_step(name, provider, *args):
        step = provider_step(name, provider, *args)
        return lambda: order.append(provider) or step()

    def spy_times(fns, rounds, calls):
        alternated.append((calls, alternated_times(fns, rounds, calls)))
        return alternated[-1][1]
    monkeypatch.setattr(models, "_provider_step", spy_step)
    monkeypatch.setattr(harness, "alternated_times", spy_times)
    original, x = _classifier(), torch.randn(4, 8, device=DEVICE)
    injected = copy.deepcopy(original)
    rows = models.bench_rows("mlp", original, injected, (x,), grad=None, reference=models.float64_step(
        original, (x,), None), dtype="float32", batch=4, cover={}, warmup_ms=1, rep_ms=1,
        providers=("original", "dropin"))
    (calls, times), = alternated
    assert order[-2 * calls * models.ROUNDS:] == (["original"] * calls + ["dropin"] * calls) * models.ROUNDS
    assert [r["median_ms"] for r in rows] == [harness.summarize(t)["median_ms"] for t in times]


def test_liger_row_says_why_it_does_not_run():
    reason = peers.LIGER_MISSING if harness.optional("liger_kernel.transformers", "apply_liger_kernel_to_llama") \
        is None else "skipped: interpreter"
    if not _runtime.INTERPRET and reason != peers.LIGER_MISSING:
        pytest.skip("Liger-Kernel runs here")
    with pytest.raises(harness.Skipped, match=reason.split(" (")[0]):
        peers.liger_llama(nn.Linear(2, 2), loss=False)


def test_module_patches_reach_the_patched_model_only():
    """A library's patch of a Python module's globals: undone at once, set again around the patched model's calls
    only (and undone when a call raises)."""
    module = types.ModuleType("stand_in")
    module.rope = lambda: "torch"
    seen = []

    class Model(nn.Module):
        def forward(self, fail=False):
            seen.append(module.rope())
            if fail:
                raise ValueError("boom")
            return module.rope()

    def patch():
        module.rope = lambda: "library"
        module.extra = 1

    patched = peers.module_patches(module, patch)
    assert set(patched) == {"rope", "extra"} and module.rope() == "torch" and not hasattr(module, "extra")
    model, other = peers.with_patches(Model(), module, patched), Model()
    assert model() == "library" and other() == "torch" and module.rope() == "torch"
    with pytest.raises(ValueError):
        model(fail=True)
    assert seen[-1] == "library" and module.rope() == "torch" and not hasattr(module, "extra")


def test_injected_training_keeps_no_more_for_the_backward_than_torch():
    """Convs, training BatchNorms, ReLUs, a conv and a linear with the ReLU fused (a ResNet's and an MLP's
    patterns): the injected model's activation memory (saved_bytes: what the forward keeps for the backward,
    weights aside) is at most the original's, but for one float32 per BatchNorm channel (dropin keeps the batch
    mean as two float32, a high and a low part, for its accuracy, where torch keeps one)."""
    original = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                             nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16), nn.ReLU(),
                             nn.Linear(16, 5)).to(DEVICE).train()
    injected, x = copy.deepcopy(original), torch.randn(2, 3, 9, 7, device=DEVICE)
    report = inject_(injected, example_inputs=(x,), verify=False)
    assert {"conv2d+relu", "linear+relu"} <= {r.kernel for r in report.replaced}, report
    grad = torch.randn(2, 5, device=DEVICE)
    ours, theirs = (models.saved_bytes(lambda m=m: models.train_step(m, m, (x,), grad), m)
                    for m in (injected, original))
    activation, means = 2 * 8 * 9 * 7 * 4, 2 * 8 * 4  # one [2, 8, 9, 7] float32 tensor; the two BatchNorms' means
    assert theirs >= 5 * activation and ours <= theirs + means, (ours, theirs)
