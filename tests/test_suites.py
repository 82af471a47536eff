"""The GPU suites' selection (Makefile: test-gpu, test-gpu-quick, test-gpu-slow) stays valid as tests change."""
import functools
import importlib.util
import os
import re
import subprocess
import sys

from _suites import QUICK, SLOWEST_FIRST, TEST_GPU_LONGEST_FIRST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache
def _collected(marker: str) -> tuple:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                          marker, "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return tuple(line for line in run.stdout.splitlines() if "::" in line)


def test_quick_names_collected_tests():
    """Every entry of _suites.QUICK names a test that exists (a renamed test fails here, not silently)."""
    assert sorted(_collected("quick")) == sorted(QUICK)


def test_slow_marks_only_a_part():
    slow = _collected("slow")
    assert slow and all("::" in s for s in slow)


def test_slowest_first_names_slow_tests():
    """Every entry of _suites.SLOWEST_FIRST is the prefix of a collected slow test (the slow suite's order)."""
    slow = _collected("slow")
    assert all(any(test.startswith(prefix) for test in slow) for prefix in SLOWEST_FIRST), SLOWEST_FIRST


def _module_skipped_here(test_file: str) -> bool:
    """Whether the file skips itself at import for an optional package missing here (timm in CI's set-up)."""
    with open(os.path.join(ROOT, test_file)) as f:
        skipped = re.findall(r'^\w+ = pytest\.importorskip\("([\w.]+)"\)', f.read(), re.MULTILINE)
    return any(importlib.util.find_spec(name.split(".")[0]) is None for name in skipped)


def test_test_gpu_longest_first_names_its_tests():
    """Every entry of _suites.TEST_GPU_LONGEST_FIRST is the prefix of a test that `make test-gpu` collects
    (or of one in a file that skips itself here for a missing optional package)."""
    tests = _collected("not slow and not fuzz")
    unnamed = [prefix for prefix in TEST_GPU_LONGEST_FIRST if not any(test.startswith(prefix) for test in tests)
               and not _module_skipped_here(prefix.split("::")[0])]
    assert not unnamed
