"""`dropin zoo`: every model of the zoo (dropin.bench.zoo_models) built with random weights (a parameter its init
leaves all zero drawn from N(0, 0.02), so that no output is zeros), injected, verified against float64, its
coverage measured and timed beside the original; one row per (model, dtype) in RESULTS_DIR/<gpu>/zoo.json
(zoo-tiny.json with --tiny).

Each model runs in a process of its own (`python -m dropin.bench.zoo TASK ROW_PATH`), stopped at its time limit,
so that no model (a hang, a crash, a poisoned CUDA context) stops the run. A run resumes by itself: rows are keyed
by (model, dtype, versions) and a model with a row for the same key is skipped unless --rerun; the file is
written (atomically) after each model.

Row keys: model, dtype, versions ({torch, triton, transformers, dropin}), status (ok | failed: it raised, `error`
says where and what | timeout: it ran out of its time limit | crashed: its process died, `error` holds its last
output | skipped: not buildable here, `error` says why), input, replaced (dropin modules), covered (torch modules
whose work they do), left (count), left_modules ([{name, type, reason}]), coverage_modules / coverage_flops /
coverage_time (shares done by dropin; see dropin.bench.models.coverage), verification (inject_'s verdict) and
verified, err_vs_fp64 (the worst relative error of the injected model's output against the original's in float64:
its first output and every timed mode), torch_err_vs_fp64 (the original's own), err_limit, first_output_s (from
inject_ to the first injected output, kernels tuned and compiled on the way), compile_s ({original, dropin}:
torch.compile's first call), ms ({provider: median}), speedup ({mode: original / injected in that mode}),
eager_speedup, best_speedup (the original's fastest mode / the injected model's fastest mode within err_limit),
best_original, best_dropin, speed_notes ({provider: why it has no time}), note, seconds, date.
"""
from __future__ import annotations

import copy
import datetime
import fcntl
import fnmatch
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from . import zoo_models

DTYPES = {"bfloat16": ("bfloat16",), "float32": ("float32",), "both": ("bfloat16", "float32")}
# The zoo's targets (summary lines): share of the models that must meet each criterion (crashes: none).
BAR = {"crashes": 0.0, "flops": 0.90, "verified": 1.0, "best": 0.80, "eager": 0.80}
FLOPS_BAR = 0.95  # a model meets the FLOPs criterion with at least this share in dropin kernels
MIN_START_S = 30  # with --budget: a model starts only with at least this much of it left
# Model kinds whose forward cannot be captured in one plain CUDA graph (their `_graph` rows say so).
TEXT_NO_GRAPH = ("HF text models' mask and position code cannot be captured in one plain CUDA graph; "
                 "reduce-overhead captures them")


def versions() -> dict:
    """The versions that key a row."""
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    import dropin
    import torch
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": version("transformers"),
            "dropin": dropin.__version__}


def row_key(row: dict) -> tuple:
    return row["model"], row["dtype"], tuple(sorted(row["versions"].items()))


def new_row(model: str, dtype: str, versions_: dict) -> dict:
    return {"model": model, "dtype": dtype, "versions": versions_, "status": "ok", "error": None, "note": None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# --- one model, in its own process ----------------------------------------------------------------------------

def _on_device(inputs: tuple, dtype) -> tuple:
    import torch

    from .. import _runtime

    return tuple(t.to(_runtime.KERNEL_DEVICE, dtype if t.is_floating_point() else t.dtype)
                 if isinstance(t, torch.Tensor) else t for t in inputs)


def _report_fields(report) -> dict:
    covered = sum(r.covers for r in report.replaced)
    cover = report.coverage
    return {"replaced": len(report.replaced), "covered": covered, "left": len(report.left),
            "left_modules": [{"name": e.name, "type": e.type, "reason": e.reason} for e in report.left],
            "coverage_modules": covered / max(covered + len(report.left), 1),
            "coverage_flops": cover and cover.flops, "coverage_time": cover and cover.kernel_time}


def speed_fields(rows: list[dict], err_limit: float) -> dict:
    """The zoo row's speed keys from dropin.bench.models.bench_rows' rows."""
    by = {r["provider"]: r for r in rows}
    ms = {p: r["median_ms"] for p, r in by.items() if r["median_ms"]}
    speedup = {}
    for provider in by:
        if provider.startswith("original"):
            mode = provider.removeprefix("original").lstrip("_") or "eager"
            ours = provider.replace("original", "dropin")
            if provider in ms and ours in ms:
                speedup[mode] = ms[provider] / ms[ours]
    theirs = [p for p in ms if p.startswith("original")]
    ours = [p for p in ms if p.startswith("dropin") and (by[p]["rel_err_vs_fp64"] or 0.0) <= err_limit]
    best_original = min(theirs, key=ms.get, default=None)
    best_dropin = min(ours, key=ms.get, default=None)
    first = {who: by.get(f"{who}_compile", {}).get("first_call_ms") for who in ("original", "dropin")}
    return {"ms": ms, "speedup": speedup, "eager_speedup": speedup.get("eager"),
            "best_speedup": ms[best_original] / ms[best_dropin] if best_original and best_dropin else None,
            "best_original": best_original, "best_dropin": best_dropin,
            "compile_s": {who: v and v / 1e3 for who, v in first.items()},
            "speed_notes": {p: r.get("error") or r.get("note") for p, r in by.items()
                            if not r["median_ms"] and (r.get("error") or r.get("note"))}}


def measure(task: dict) -> dict:
    """One zoo row (see the module docstring) for task {model, dtype, versions, tiny, speed, warmup_ms, rep_ms}."""
    import torch

    from .. import _runtime
    from .._tolerance import default_dtype, limit, rel_err
    from ..inject import VerificationError, inject_
    from . import harness, models

    row = new_row(task["model"], task["dtype"], task["versions"])
    start = time.perf_counter()
    stage = "build"

    def sync():
        if not _runtime.INTERPRET:
            torch.cuda.synchronize()
    try:
        torch.manual_seed(0)
        entry = zoo_models.entry(task["model"])
        dtype = getattr(torch, task["dtype"])
        model, inputs = entry.build(task["tiny"])
        with torch.no_grad():  # (timm's heads start at zero: an output of zeros would verify nothing)
            for parameter in model.parameters():
                if parameter.numel() and not parameter.any():
                    parameter.normal_(0.0, 0.02)
        model = model.eval().to(_runtime.KERNEL_DEVICE, dtype)
        inputs = _on_device(inputs, dtype)
        row["input"] = ", ".join("x".join(map(str, t.shape)) for t in inputs if isinstance(t, torch.Tensor))
        original = copy.deepcopy(model)
        stage = "float64 reference"
        with default_dtype(torch.float64):
            reference = models.float64_step(original, inputs, None)
        with torch.no_grad():
            torch_err = rel_err(models.main_output(original(*inputs)), reference[0])
        row.update(torch_err_vs_fp64=torch_err, err_limit=limit(dtype, torch_err))
        stage = "inject_ and first output"
        sync()
        begin = time.perf_counter()
        inject_(model, example_inputs=inputs, verify=False)
        with torch.no_grad():
            out = models.main_output(model(*inputs))
        sync()
        row["first_output_s"] = time.perf_counter() - begin
        row["err_vs_fp64"] = rel_err(out, reference[0])
        stage = "verification and coverage"
        try:
            report = inject_(model, example_inputs=inputs, coverage=True)
        except VerificationError as e:
            row["verification"], row["verified"] = harness.one_line(str(e), 600), False
            report = inject_(model, example_inputs=inputs, verify=False, coverage=True)
        else:
            row["verification"], row["verified"] = report.verification, True
        row.update(_report_fields(report))
        if not task["speed"]:
            row["note"] = "speed not measured: " + ("interpreter" if _runtime.INTERPRET else "--no-speed")
        else:
            stage = "speed"
            cover = {k: row[k] for k in ("coverage_modules", "coverage_flops", "coverage_time")}
            rows = models.bench_rows(task["model"], original, model, inputs, grad=None, reference=reference,
                                     dtype=task["dtype"], batch=inputs[0].shape[0], cover=cover,
                                     warmup_ms=task["warmup_ms"], rep_ms=task["rep_ms"],
                                     no_graph=None if entry.image else TEXT_NO_GRAPH)
            dropin_errs = [r["rel_err_vs_fp64"] for r in rows
                           if r["provider"].startswith("dropin") and r["rel_err_vs_fp64"] is not None]
            row["err_vs_fp64"] = max([row["err_vs_fp64"], *dropin_errs])
            row.update(speed_fields(rows, row["err_limit"]))
    except zoo_models.Unavailable as e:
        row.update(status="skipped", error=str(e))
    except Exception as e:  # noqa: BLE001 (the row says why)
        row.update(status="failed", error=f"{stage}: {type(e).__name__}: {' '.join(str(e).split())[:2000]}")
    row["seconds"] = time.perf_counter() - start
    return row


def run_isolated(task: dict, limit_s: float) -> tuple[dict | None, bool]:
    """(the task's row from a process of its own, whether it ran out of limit_s); the row is None when it ran out
    or its process died, the process group killed at the limit."""
    import dropin

    # the worker imports the dropin that this process runs
    path = os.pathsep.join(filter(None, [str(Path(dropin.__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out, log = Path(tmp) / "row.json", Path(tmp) / "log"
        with log.open("w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "dropin.bench.zoo", json.dumps(task), str(out)],
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": path})
            try:
                proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return None, True
        if out.exists():
            return json.loads(out.read_text()), False
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-5:]
        return {"error": f"the process exited with code {proc.returncode}: " + " | ".join(tail)[-2000:]}, False


# --- the run --------------------------------------------------------------------------------------------------

def select(models: list[str] | None) -> tuple[list[zoo_models.ZooModel], list[str], list[str]]:
    """(the zoo models that `models` picks: names, their part after 'source/', or glob patterns of either;
    MODULE:FUNCTION specs added as they are; the catalog's notes; the patterns that matched nothing)."""
    zoo, notes = zoo_models.catalog()
    if not models:
        return zoo, notes, []
    picked, unmatched = {}, []
    for pattern in models:
        if ":" in pattern:
            picked[pattern] = zoo_models.entry(pattern)
            continue
        hits = [m for m in zoo if fnmatch.fnmatchcase(m.name, pattern)
                or fnmatch.fnmatchcase(m.name.partition("/")[2], pattern)]
        picked.update((m.name, m) for m in hits)
        if not hits:
            unmatched.append(pattern)
    return list(picked.values()), notes, unmatched


def load_rows(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"] if path.exists() else []


def save_row(path: Path, env: dict, row: dict) -> None:
    """Merges `row` into the result file (replacing the row of its key) as it is on disk now, under a lock, and
    writes it atomically (a temporary file beside it, then renamed): runs side by side (one a GPU, other models)
    share one file and lose none of each other's rows."""
    from . import harness

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = [r for r in load_rows(path) if row_key(r) != row_key(row)]
        scratch = path.with_name(path.name + ".partial")
        harness.write_json(scratch, {"env": env, "rows": rows + [row]})
        os.replace(scratch, path)


def result_path(args) -> Path:
    from .. import _runtime

    name = "zoo-tiny.json" if args.tiny else "zoo.json"
    return Path(args.file) if args.file else Path(args.results_dir) / _runtime.gpu_slug() / name


def progress(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status'].upper()}: {row['error']}"
    flops = row.get("coverage_flops")
    parts = [f"{row['replaced']} replaced, {row['left']} left", "-" if flops is None else f"FLOPs {flops:.1%}",
             f"err {row['err_vs_fp64']:.1e}" + ("" if row["verified"] else " (verification FAILED)"),
             f"first output {row['first_output_s']:.1f} s"]
    parts += [f"{k} {row[f'{k}_speedup']:.2f}x" for k in ("eager", "best") if row.get(f"{k}_speedup")]
    return ", ".join(parts)


def _shard(text: str) -> tuple[int, int] | None:
    """(I, N) from "I/N" with 0 <= I < N; None where the text is not that."""
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit()) or not int(index) < int(count):
        return None
    return int(index), int(count)


def run(args) -> int:
    """`dropin zoo` (see the CLI's help)."""
    from .. import _runtime
    from . import harness

    args.tiny = args.tiny or _runtime.INTERPRET
    path = result_path(args)
    if args.table:
        if not path.exists():
            print(f"dropin zoo: no result file {path}", file=sys.stderr)
            return 2
        table = format_table(load_rows(path))
        print(table)
        path.with_suffix(".md").write_text(table + "\n")
        print(f"dropin zoo: wrote {path.with_suffix('.md')}", file=sys.stderr)
        return 0
    chosen, notes, unmatched = select(args.models)
    for text in notes:
        print(f"dropin zoo: {text}", file=sys.stderr)
    if unmatched:
        print(f"dropin zoo: no model matches {', '.join(unmatched)} (see dropin zoo --list)", file=sys.stderr)
        return 2
    # text models: bfloat16, float32 only when asked for alone
    tasks = [(m.name, d) for m in chosen for d in DTYPES[args.dtype]
             if m.image or d == "bfloat16" or args.dtype == "float32"]
    stamp = versions()
    done = {row_key(r) for r in load_rows(path)}
    if args.shard:
        shard = _shard(args.shard)
        if shard is None:
            print(f"dropin zoo: --shard takes I/N with 0 <= I < N, got {args.shard!r}", file=sys.stderr)
            return 2
        index, count = shard  # (runs started together see the same rows: their shares do not overlap)
        tasks = [t for t in tasks if args.rerun or row_key(new_row(*t, stamp)) not in done][index::count]
    if args.list:
        print("\n".join(f"{name}  {dtype}" for name, dtype in tasks))
        return 0
    env = harness.environment("zoo", " ".join(["dropin", *args.argv]), {})
    deadline = time.monotonic() + args.budget if args.budget else None
    for i, (name, dtype) in enumerate(tasks, 1):
        label = f"[zoo {i}/{len(tasks)}] {name} {dtype}"
        key = row_key(new_row(name, dtype, stamp))
        if key in done and not args.rerun:
            print(f"{label}: has a row (--rerun runs it again)", file=sys.stderr)
            continue
        limit_s = args.time_limit
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < min(MIN_START_S, limit_s):
                print(f"dropin zoo: --budget spent; the next run goes on from {name} {dtype}", file=sys.stderr)
                break
            limit_s = min(limit_s, left)
        print(f"{label} ...", file=sys.stderr, flush=True)
        task = {"model": name, "dtype": dtype, "versions": stamp, "tiny": args.tiny,
                "speed": not (args.no_speed or _runtime.INTERPRET), "warmup_ms": args.warmup, "rep_ms": args.rep}
        started = time.perf_counter()
        row, ran_out = run_isolated(task, limit_s)
        if ran_out and limit_s < args.time_limit:
            print(f"{label}: stopped, --budget spent (no row: it runs again next time)", file=sys.stderr)
            break
        if row is None or "model" not in row:
            row = {**new_row(name, dtype, stamp), "status": "timeout" if ran_out else "crashed",
                   "error": f"ran out of its time limit ({limit_s:g} s)" if ran_out else row["error"],
                   "seconds": time.perf_counter() - started}
        save_row(path, env, row)
        print(f"{label}: {progress(row)} ({row['seconds']:.0f} s)", file=sys.stderr, flush=True)
    print(f"dropin zoo: {len(load_rows(path))} row(s) in {path}", file=sys.stderr)
    return 0


# --- the table ------------------------------------------------------------------------------------------------

def _share(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def note(row: dict) -> str:
    """The table's note: why a row failed, or what stays torch (types with counts) and a failed verification."""
    if row["status"] != "ok":
        return f"{row['status']}: {(row.get('error') or '')[:120]}"
    parts = [] if row.get("verified") else ["verification FAILED"]
    left = Counter(m["type"] for m in row.get("left_modules", []))
    if left:
        parts.append("left: " + ", ".join(f"{t} x{n}" if n > 1 else t for t, n in left.most_common()))
    return "; ".join(parts + ([row["note"]] if row.get("note") else []))


def summary(rows: list[dict]) -> list[str]:
    """Markdown lines: for all rows and for each dtype, the counts against the zoo's targets."""
    counted = [r for r in rows if r["status"] != "skipped"]
    groups = {"all": counted, **{d: [r for r in counted if r["dtype"] == d]
                                 for d in sorted({r["dtype"] for r in counted})}}
    checks = (("crashes (failed, timeout, crashed; bar: 0)", "crashes", lambda r: r["status"] != "ok"),
              (f">= {FLOPS_BAR:.0%} of FLOPs in dropin (bar: >= {BAR['flops']:.0%} of models)", "flops",
               lambda r: (r.get("coverage_flops") or 0) >= FLOPS_BAR),
              (f"verified within tolerance (bar: {BAR['verified']:.0%})", "verified",
               lambda r: r["status"] == "ok" and r.get("verified")),
              (f"best mode >= 1.0x the original's best (bar: >= {BAR['best']:.0%})", "best",
               lambda r: (r.get("best_speedup") or 0) >= 1.0),
              (f"eager >= 1.0x the original's eager (bar: >= {BAR['eager']:.0%})", "eager",
               lambda r: (r.get("eager_speedup") or 0) >= 1.0))
    lines = ["| | " + " | ".join(f"{g} ({len(rs)} rows)" for g, rs in groups.items()) + " |",
             "|---" * (len(groups) + 1) + "|"]
    for text, bar, test in checks:
        cells = []
        for rs in groups.values():
            n = sum(bool(test(r)) for r in rs)
            share = n / max(len(rs), 1)
            met = " (met)" if (share <= BAR[bar] if bar == "crashes" else share >= BAR[bar]) else " (not met)"
            cells.append(f"{n} ({n / len(rs):.0%}){met}" if rs else "-")
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    timed = sum(r.get("eager_speedup") is not None for r in counted)
    skipped = [r["model"] for r in rows if r["status"] == "skipped"]
    lines.append(f"\n{timed} of {len(counted)} rows timed (the others count as below 1.0x)."
                 + (f" Skipped (not buildable here, not counted): {', '.join(sorted(set(skipped)))}." if skipped
                    else ""))
    return lines


def format_table(rows: list[dict]) -> str:
    """The markdown zoo table, one line per row, then the summary against the bar."""
    lines = ["| model | dtype | FLOPs in dropin | err vs fp64 | eager | best mode | first output | torch.compile "
             "| note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["dtype"])):
        err = "-" if r.get("err_vs_fp64") is None else f"{r['err_vs_fp64']:.1e}"
        first = "-" if r.get("first_output_s") is None else f"{r['first_output_s']:.1f} s"
        compile_s = (r.get("compile_s") or {}).get("original")
        best = _x(r.get("best_speedup")) + (f" ({r['best_dropin']} / {r['best_original']})"
                                           if r.get("best_speedup") else "")
        lines.append(f"| {r['model']} | {r['dtype']} | {_share(r.get('coverage_flops'))} | {err} | "
                     f"{_x(r.get('eager_speedup'))} | {best} | {first} | "
                     f"{'-' if compile_s is None else f'{compile_s:.1f} s'} | {note(r).replace('|', '/')} |")
    return "\n".join(lines + ["", *summary(rows)])


def main(argv: list[str]) -> int:
    """The worker: `python -m dropin.bench.zoo TASK_JSON ROW_PATH` writes the task's row to ROW_PATH."""
    task, out = json.loads(argv[0]), Path(argv[1])
    out.write_text(json.dumps(measure(task)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
