"""The GPU suites' selection (Makefile: test-gpu, test-gpu-quick, test-gpu-slow) stays valid as tests change."""
import os
import subprocess
import sys

from _suites import QUICK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collected(marker: str) -> list[str]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                          marker, "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_quick_names_collected_tests():
    """Every entry of _suites.QUICK names a test that exists (a renamed test fails here, not silently)."""
    assert sorted(_collected("quick")) == sorted(QUICK)


def test_slow_marks_only_a_part():
    slow = _collected("slow")
    assert slow and all("::" in s for s in slow)
