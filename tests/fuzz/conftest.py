"""The fuzz tests' case counts: each test's report carries the cases it ran, by op (a user property, also in the
junit XML), and the run ends with their sum per op."""
import collections

import pytest

import _fuzz

_totals: collections.Counter = collections.Counter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = collections.Counter(_fuzz.CASES)
    yield
    item.user_properties.extend((f"fuzz_cases:{op}", n) for op, n in sorted((_fuzz.CASES - before).items()))


def pytest_runtest_logreport(report):
    if report.when == "call":  # (under xdist the controller sees each worker's report here)
        for name, n in report.user_properties:
            if name.startswith("fuzz_cases:"):
                _totals[name.split(":", 1)[1]] += n


def pytest_terminal_summary(terminalreporter):
    if not _totals:
        return
    terminalreporter.section("fuzz cases per op")
    for op, n in sorted(_totals.items()):
        terminalreporter.write_line(f"{op:>22}: {n}")
    terminalreporter.write_line(f"{'total':>22}: {sum(_totals.values())}")
