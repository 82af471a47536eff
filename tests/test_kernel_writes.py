"""Each dropin kernel, as Inductor's analysis of its TTIR reads it, writes no tensor that its launch does not write.

Every public op of dropin.ops runs forward and backward through its registered ops' traced bodies
(tests/_kernel_writes.py, in a fresh process: the kernels compile for a pretend H100 without a GPU, for the GPU
with one). A launch fails where torch's analysis raises (Inductor then takes every tensor argument as written),
where a tensor it takes as written is, or shares storage with, an input of the registered op that does not
declare it written (mutates_args: Inductor clones the input; under autograd a leaf that requires grad fails "in
an in-place operation"), or where one tensor fills two of its slots (`_dispatch.absent`). dropin's memo of that
analysis (`_runtime.memoize_launch_analysis`) gives torch's own results, and its memo of Inductor's collection of a
kernel's source code (`_runtime.memoize_kernel_source`) torch's own source."""
import json
import os
import subprocess
import sys

import pytest

import _kernel_writes
import dropin.ops

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _report() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, _kernel_writes.__file__], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_kernels_write_only_their_outputs():
    """One test (one process of ~10 s, however many workers run the suite), its failures listed per op."""
    report = _report()
    if "skip" in report:
        pytest.skip(report["skip"])
    assert not report["failed"], f"cases that did not run: {report['failed']}"
    assert not report["without_case"], f"public ops of dropin.ops without a case: {report['without_case']}"
    assert not report["uncalled"], f"registered ops that no case calls: {report['uncalled']}"
    launched = {r["public"] for r in report["records"]}
    assert launched >= set(dropin.ops.__all__) - _kernel_writes.NOT_OPS - _kernel_writes.OPAQUE, \
        "public ops that launched no kernel"
    problems = set()
    for r in report["records"]:
        where = f"{r['case']}: {r['op']} {r['kernel']}"
        if r["error"]:
            problems.add(f"{where}: the analysis raised ({r['error']}), so every tensor is taken as written")
        if r["inputs_written"]:
            problems.add(f"{where}: taken to write the op's inputs {r['inputs_written']} (slot: input); "
                         f"written {r['written']}")
        if r["shared"]:
            problems.add(f"{where}: one tensor in two slots {r['shared']}")
    assert not problems, "\n".join(sorted(problems))
    memo = report["memo"]  # (the memo of torch's analysis: its results torch's own, a copy each call, and one
    assert memo["installed"] and memo["kernels"] > 20, memo  # analysis a specialization of a kernel)
    assert not memo["mismatched"] and not memo["same_object"], memo
    assert memo["misses"] <= memo["specializations"] and memo["hits"] >= memo["launches"] - memo["misses"], memo
    # (specializations that differ in integers Triton does not specialize on share an analysis: one TTIR)
    assert memo["shared"] > 0 and not memo["split"], memo
    source = report["source_memo"]  # (kernel sources: torch's, one collection a kernel, a changed global seen)
    assert source["installed"] and source["kernels"] > 20 and not source["mismatched"], source
    assert source["misses"] == source["hits"] == source["kernels"] and source["replaced"] and source["restored"], source
