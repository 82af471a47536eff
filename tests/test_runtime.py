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
