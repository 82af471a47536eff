"""The CPU path does not depend on what was imported before dropin."""
import importlib.util
import os
import subprocess
import sys

import pytest

from _tol import ON_GPU

LINEAR_MATCHES_TORCH = ("import dropin, torch; x, w = torch.randn(4, 8), torch.randn(5, 8); "
                        "torch.testing.assert_close(dropin.linear(x, w), x @ w.T)")


@pytest.mark.skipif(ON_GPU, reason="the interpreter switch is for machines without a GPU")
@pytest.mark.parametrize("first", ["torch, triton", "torch, torchvision"])
def test_interpreter_on_whatever_was_imported_first(first):
    """triton imported before dropin (directly, or by torchvision) decorated triton.language's functions without
    the interpreter; a kernel that calls them (tl.cdiv) still runs."""
    if importlib.util.find_spec(first.split(", ")[-1]) is None:
        pytest.skip(f"{first.split(', ')[-1]} is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", f"import {first}; {LINEAR_MATCHES_TORCH}"], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


TF32_SETTINGS = """
import torch
from dropin import _runtime
b = torch.backends
steps = [
    ("defaults", lambda: None),
    ("legacy matmul flag on", lambda: setattr(b.cuda.matmul, "allow_tf32", True)),
    ("legacy cudnn flag off", lambda: setattr(b.cudnn, "allow_tf32", False)),
    ("matmul precision highest", lambda: torch.set_float32_matmul_precision("highest")),
    ("matmul precision medium", lambda: torch.set_float32_matmul_precision("medium")),
    ("matmul fp32_precision ieee", lambda: setattr(b.cuda.matmul, "fp32_precision", "ieee")),
    ("conv fp32_precision tf32", lambda: setattr(b.cudnn.conv, "fp32_precision", "tf32")),
    ("matmul fp32_precision tf32", lambda: setattr(b.cuda.matmul, "fp32_precision", "tf32")),
    ("both ieee", lambda: (setattr(b.cuda.matmul, "fp32_precision", "ieee"),
                           setattr(b.cudnn.conv, "fp32_precision", "ieee"))),
    ("global tf32, the ops inherit", lambda: (setattr(b.cuda.matmul, "fp32_precision", "none"),
                                              setattr(b.cudnn.conv, "fp32_precision", "none"),
                                              setattr(b, "fp32_precision", "tf32"))),
]
for name, step in steps:
    step()
    print(name, "|", _runtime.tf32_allowed("matmul"), _runtime.tf32_allowed("conv"))
"""
# (matmul, conv) after each step, as torch's cuBLAS / cuDNN rules read them
TF32_EXPECTED = [(False, True), (True, True), (True, False), (False, False), (True, False), (False, False),
                 (False, True), (True, True), (False, False), (True, True)]


def test_tf32_allowed_follows_both_of_torchs_interfaces():
    """_runtime.tf32_allowed answers for the legacy flags and the fp32_precision settings alike, without reading a
    legacy flag after the settings were used (torch raises for that). In a fresh process: the settings are global."""
    if not hasattr(__import__("torch").backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has the legacy flags only")
    run = subprocess.run([sys.executable, "-c", TF32_SETTINGS], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = [tuple(part == "True" for part in line.split("|")[1].split()) for line in run.stdout.splitlines()]
    names = [line.split("|")[0].strip() for line in run.stdout.splitlines()]
    assert dict(zip(names, got)) == dict(zip(names, TF32_EXPECTED))
