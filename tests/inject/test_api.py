"""inject_'s guarantees around verification: a model it cannot run is left whole, and an exception reverts it; its
forward that compiles the kernels ahead keeps nothing of what it computes."""
import copy
import math
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import dropin
from dropin.inject import InjectError, VerificationError
from dropin.inject.api import _REFRESH_HOOK
from dropin.nn import DropinModule
from _models import check_forward, cnn, mlp
from _tol import DEVICE, ON_GPU, gpu


def assert_whole(model: nn.Module, children: list) -> None:
    """`model` holds the given children (the same objects) and nothing of dropin."""
    assert list(model.children()) == children
    assert all(a is b for a, b in zip(model.children(), children))
    assert not any(isinstance(m, DropinModule) for m in model.modules())
    assert _REFRESH_HOOK not in model.__dict__


def test_exception_in_verification_reverts_and_names_the_module(monkeypatch):
    probe = mlp()
    dropin.inject_(probe, verify=False)
    linear_dropin = type(probe[2])

    def broken(self, *args):
        raise RuntimeError("kernel failure")

    monkeypatch.setattr(linear_dropin, "forward", broken)
    model = mlp().eval()
    children = list(model.children())
    with pytest.raises(VerificationError, match=r"'0'.*RuntimeError: kernel failure") as e:
        dropin.inject_(model, example_inputs=torch.randn(4, 16, device=DEVICE))
    assert e.value.module == "0" and isinstance(e.value.__cause__, RuntimeError)
    assert_whole(model, children)


class PositionFeatures(nn.Module):
    """A GPT-like block whose forward builds float tensors with the default dtype: position features for a
    Linear and a causal mask."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.position = nn.Linear(1, dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        seq = x.shape[1]
        x = x + self.position(torch.linspace(0, 1, seq, device=x.device)[:, None])
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = torch.full((seq, seq), -math.inf, device=x.device).triu(1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask
        return x + self.out(scores.softmax(-1) @ v)


def test_forward_that_builds_tensors_verifies():
    model = nn.Sequential(PositionFeatures(), PositionFeatures()).to(DEVICE).eval()
    report = dropin.inject_(model, example_inputs=torch.randn(2, 8, 16, device=DEVICE))
    assert report.verification.startswith("verified") and report.replaced
    assert torch.get_default_dtype() == torch.float32


def test_default_dtype_kept_when_verification_raises(monkeypatch):
    """The float64 reference's default dtype does not outlive a reference that raises."""
    monkeypatch.setattr(PositionFeatures, "forward", lambda self, x: self.qkv(x.float()))
    model = nn.Sequential(PositionFeatures()).to(DEVICE).eval()
    with pytest.raises(VerificationError, match="float64 reference"):
        dropin.inject_(model, example_inputs=torch.randn(2, 8, 16, device=DEVICE))
    assert torch.get_default_dtype() == torch.float32


def test_float64_model_left_whole_with_the_reason():
    model = mlp().double().eval()
    children = list(model.children())
    x = torch.randn(4, 16, device=DEVICE, dtype=torch.float64)
    expected = model(x)
    report = dropin.inject_(model, example_inputs=x)
    assert_whole(model, children)
    assert [(e.name, e.type) for e in report.left] == [("", "Sequential")]
    assert "float64" in report.left[0].reason and "float64" in str(report)
    assert torch.equal(model(x), expected)
    with pytest.raises(InjectError, match="float64"):
        dropin.inject_(model, example_inputs=x, strict=True)
    assert_whole(model, children)


def test_coverage_prints_no_profiler_log_lines():
    """Measuring coverage (the torch profiler) leaves stderr to the user: none of the profiler backend's own log
    lines (profile start / stop, a failed GPU count without a GPU), in a process of its own (its first profile)."""
    code = ("import torch, dropin, dropin._runtime; device = dropin._runtime.KERNEL_DEVICE; "
            "model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)).to(device); "
            "dropin.inject_(model, coverage=True, example_inputs=torch.randn(3, 16, device=device)); print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
    assert done.stdout.strip().endswith("ok"), done.stderr
    assert not [line for line in done.stderr.splitlines() if "SyncActivityProfiler" in line or "DeviceProperties"
                in line or line.startswith(("USDT:", "ERROR:", "STAGE:"))], done.stderr


def test_progress_of_the_slow_stages_is_logged(caplog):
    """inject_ logs its slow stages (verification, coverage) on the 'dropin.progress' logger at INFO, each with
    its time; nothing below WARNING by default."""
    model = mlp()
    with caplog.at_level("INFO", logger="dropin.progress"):
        dropin.inject_(model, example_inputs=torch.randn(3, 16, device=DEVICE))
    messages = [r.getMessage() for r in caplog.records if r.name == "dropin.progress"]
    assert messages[0] == "inject_: 4 module(s) replaced, 0 left to torch", messages  # (linear + activation fused)
    stages = ["compiling the forward's kernels side by side"] * ON_GPU + ["verifying against float64"]
    for i, stage in enumerate(stages):  # (each stage's start, then its end with its time)
        assert messages[1 + 2 * i].startswith(stage) and messages[1 + 2 * i].endswith("..."), messages
        assert messages[2 + 2 * i].startswith(stage) and " done in " in messages[2 + 2 * i], messages


def test_inject_compiles_ahead_with_inputs_unless_asked_not_to(monkeypatch):
    """With example inputs (where kernels compile: a GPU), inject_ runs one forward inside compile_ahead, under
    no_grad, the training-mode BatchNorms' statistics restored after it; not with InjectConfig(compile_ahead=False),
    nor without inputs."""
    api = __import__("dropin.inject.api", fromlist=["compile_ahead"])
    runs = []

    def compile_ahead(run):
        out = run()
        runs.append((torch.is_grad_enabled(), out.shape))
        return True

    monkeypatch.setattr(api, "can_compile_ahead", lambda: True)
    monkeypatch.setattr(api, "compile_ahead", compile_ahead)
    model = cnn().train()
    stats = [b.clone() for b in model.buffers()]
    dropin.inject_(model, example_inputs=torch.randn(2, 3, 8, 8, device=DEVICE), verify=False)
    assert runs == [(False, (2, 4))]
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), stats))
    dropin.inject_(cnn(), dropin.InjectConfig(compile_ahead=False), example_inputs=torch.randn(2, 3, 8, 8,
                                                                                              device=DEVICE))
    dropin.inject_(cnn())
    assert len(runs) == 1


@gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
def test_compile_ahead_compiles_the_forward_and_keeps_nothing(tf32):
    """`compile_ahead`'s forward launches no kernel, so what it computes is garbage: it keeps no plan and no weight
    copy (TF32 convs of NCHW inputs stage their weights rounded, kept per weight version), and the forward after it
    compiles nothing and is right."""
    import importlib

    import triton

    from dropin.ops import _autotune
    from dropin.ops.conv2d import weights

    plans = [importlib.import_module(f"dropin.ops.{name}")._plans for name in ("conv2d", "matmul")]

    model = cnn().eval()
    original = copy.deepcopy(model)
    dropin.inject_(model, verify=False)
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    compiles, hooks = [], triton.knobs.runtime
    try:
        kept = [len(weights._DERIVED), *map(len, plans)]
        with torch.no_grad():
            assert _autotune.compile_ahead(lambda: model(x))
        assert [len(weights._DERIVED), *map(len, plans)] == kept
        hooks.jit_post_compile_hook = lambda *args, **kwargs: compiles.append(kwargs.get("fn"))
        try:
            check_forward(model, original, x)
        finally:
            hooks.jit_post_compile_hook = None
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert compiles == []
