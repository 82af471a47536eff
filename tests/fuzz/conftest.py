"""The fuzz tests' parts, order and case counts: each test runs as `_fuzz.PARTS` items (`fuzz_part`), the slowest
tests' first, and each item's report carries the cases it ran, by op (a user property, also in the junit XML); the
run ends with their sum per op."""
import collections

import pytest

import _fuzz

_totals: collections.Counter = collections.Counter()


@pytest.fixture(autouse=True)
def fuzz_part():
    """Which part of its test this item runs (`_fuzz.PARTS`; parametrized below): each part draws its own cases."""


# The fuzz tests whose items take longest on the GPU, slowest first (make fuzz-gpu on the H200, 2026-11-27: an
# item of attention 54-222 s, swiglu_mlp 70-151, sparse_conv2d 70-126, rope 80-108, conv2d, linear, matmul_bmm and
# fold_batchnorm 40-100; the others under 60).
SLOWEST_FIRST = ("test_attention", "test_swiglu_mlp", "test_sparse_conv2d", "test_rope", "test_conv2d", "test_linear",
                 "test_matmul_bmm", "test_fold_batchnorm")


def pytest_collection_modifyitems(items):
    """On the GPU, the slowest tests' items first (a stable sort: the rest keep their order). xdist's load
    scheduling (`make fuzz-gpu`) hands items out in this order, so that the long ones start at once and the short
    ones fill the workers' ends; in file order the attention items started last and ran past the 10 minutes."""
    if not _fuzz.ON_GPU:  # (the CPU suite's few fuzz cases keep their place)
        return
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(getattr(item, "originalname", ""), len(rank)))


def pytest_generate_tests(metafunc):
    if _fuzz.PARTS > 1 and hasattr(metafunc.function, "hypothesis"):  # (the drawing tests alone)
        metafunc.parametrize("fuzz_part", range(_fuzz.PARTS), ids=lambda part: f"part{part}")


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
