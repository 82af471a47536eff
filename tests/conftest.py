"""Test set-up shared by the whole suite.

- Without a CUDA device the Triton interpreter is switched on (TRITON_INTERPRET=1) here, before dropin or
  triton is imported, so every kernel runs on CPU tensors.
- Kernel configs are not tuned: the first candidate runs (DROPIN_AUTOTUNE=0 unless set).
- Tests marked `gpu` are skipped without a CUDA device (or when the interpreter was forced on).
- Each test seeds torch with a fresh random seed, shown in the report when the test fails;
  DROPIN_TEST_SEED=<seed> replays it.
- DROPIN_TEST_TIMES=<file>: each finished test appends one line (outcome, seconds, worker, test id; a failure's
  message end) to that file as it ends, so a run cut off by a time limit still shows where its time went and what
  failed.
"""
import json
import os
import random
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Tests never tune (each config is checked by test_matmul_configs); DROPIN_AUTOTUNE=1 overrides.
os.environ.setdefault("DROPIN_AUTOTUNE", "0")

# pytest-xdist workers share the CPU cores for the float64 references: one process's thread pool over all of
# them, in every worker at once, oversubscribes the machine many times.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `import _tol` from any test folder

import _tol  # noqa: E402  (reads TRITON_INTERPRET, set above)
from _suites import QUICK, SLOWEST_FIRST, TEST_GPU_LONGEST_FIRST  # noqa: E402


def pytest_report_header(config):
    import triton

    where = torch.cuda.get_device_name() if _tol.ON_GPU else "cpu, Triton interpreter"
    return f"dropin tests: device={_tol.DEVICE} ({where}), torch {torch.__version__}, triton {triton.__version__}"


def pytest_collection_modifyitems(config, items):
    quick = set(QUICK)
    for item in items:
        if item.nodeid in quick:
            item.add_marker(pytest.mark.quick)
            quick.discard(item.nodeid)
    if quick and "quick" in (config.option.markexpr or ""):
        raise pytest.UsageError(f"_suites.QUICK names tests that were not collected: {sorted(quick)}")
    if _tol.ON_GPU:  # the longest tests first, in a stable sort (their suites hand items out in order)
        longest = SLOWEST_FIRST + TEST_GPU_LONGEST_FIRST
        items.sort(key=lambda item: next((i for i, prefix in enumerate(longest) if item.nodeid.startswith(prefix)),
                                         len(longest)))
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (this run uses the Triton interpreter on the CPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    path = os.environ.get("DROPIN_TEST_TIMES")
    # under xdist the controller sees every report again (with the worker's node): the workers write them
    if path and (report.when == "call" or report.outcome != "passed") and not hasattr(report, "node"):
        line = {"id": report.nodeid, "when": report.when, "outcome": report.outcome,
                "s": round(report.duration, 3), "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}
        if report.failed:  # the message's end (a fuzz test's falsifying example) is kept for a run cut off later
            line["detail"] = str(report.longrepr)[-4000:]
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    seed = int(os.environ.get("DROPIN_TEST_SEED", random.randrange(2**31)))
    torch.manual_seed(seed)
    request.node.add_report_section("setup", "seed", f"DROPIN_TEST_SEED={seed}")
    yield
    if _tol.ON_GPU:  # parallel workers share the GPU: none keeps a test's cached blocks for the next
        torch.cuda.empty_cache()


@pytest.fixture
def true_fp32():
    """TF32 off for one test, for convolutions (cuDNN's default is on) and matmuls; both switches restored."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def allow_tf32():
    """Sets torch.backends.cuda.matmul.allow_tf32 for one test (call it with True/False); restores it after."""
    saved = torch.backends.cuda.matmul.allow_tf32

    def set_(value: bool):
        torch.backends.cuda.matmul.allow_tf32 = value

    yield set_
    torch.backends.cuda.matmul.allow_tf32 = saved
