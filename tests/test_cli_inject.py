"""`dropin inject MODEL`: the report printed, the exit code of a failed verification, the HF models at tiny sizes,
--train, --bench with its files, --weights and bad arguments."""
import copy
import json
import re

import pytest
import torch
from torch import nn

import dropin
import dropin.nn as dnn
from dropin.bench.peers import LIGER_MISSING
from dropin.cli import MODELS, main
from dropin.inject import registry
from _tol import DEVICE, ON_GPU, TOLERANCES, gpu, slow


def _tiny_cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 3))


@pytest.mark.parametrize("flags", [["--verify"], ["--channels-last", "--batch", "2"]])
def test_inject_prints_the_report(capsys, monkeypatch, flags):
    monkeypatch.setitem(MODELS, "resnet18", lambda args: _tiny_cnn())
    assert main(["inject", "resnet18", "--image-size", "8", *flags]) == 0
    out = capsys.readouterr().out
    assert "conv2d+bn+relu" in out and "AdaptiveAvgPool2d" in out
    assert ("verified: output within" in out) == ("--verify" in flags)
    assert ("channels_last" in out) == ("--channels-last" in flags)


class _OffByOne(dnn.Linear):
    def forward(self, x):
        return super().forward(x) + 1.0


def test_inject_verification_failure_exits_1(capsys, monkeypatch):
    monkeypatch.setitem(MODELS, "resnet18", lambda args: _tiny_cnn())
    monkeypatch.setitem(registry.HANDLERS, nn.Linear, ("linear", lambda module, site: _OffByOne(module)))
    assert main(["inject", "resnet18", "--image-size", "8", "--verify"]) == 1
    assert "first replaced module whose output diverged: '5'" in capsys.readouterr().err


@gpu
@pytest.mark.parametrize("model", ["resnet18", "resnet50"])
def test_inject_torchvision_resnet(capsys, model):
    assert main(["inject", model, "--batch", "2", "--verify", "--channels-last"]) == 0
    assert ("BasicBlock" if model == "resnet18" else "Bottleneck") in capsys.readouterr().out


TINY_LLAMA = ["--layers", "1", "--hidden", "64", "--heads", "2", "--intermediate", "128", "--seq", "8"]
FAST = ["--warmup", "1", "--rep", "1"]


@pytest.mark.parametrize("model, flags, kernel", [("llama", TINY_LLAMA, "swiglu_mlp"),
                                                  ("cvt-13", ["--image-size", "16"], "conv2d+bn")])
def test_inject_hf_models_verified(capsys, model, flags, kernel):
    pytest.importorskip("transformers")
    assert main(["inject", model, "--verify", *flags]) == 0
    out = capsys.readouterr().out
    assert kernel in out and "verified: output within" in out


@pytest.mark.parametrize("model, flags", [("llama", TINY_LLAMA),
                                          pytest.param("cvt-13", ["--image-size", "32", "--batch", "2"], marks=slow)])
def test_inject_train_step_within_limits(capsys, true_fp32, model, flags):
    """Output and every gradient against the original in float64: within the backward tolerance or 2x PyTorch's
    own error (in true fp32; TF32 would only widen the limit). CvT-13 at 32 pixels: at 16 its second stage attends
    to a single key, whose gradients are exactly 0 (HF's softmax backward gives 0 exactly; a flash backward, ours
    or SDPA's, leaves the rounding of dP - rowsum(dO * O), up to 1.8e-4 on the GPU, which BatchNorm amplifies)."""
    pytest.importorskip("transformers")
    assert main(["inject", model, "--train", *flags]) == 0
    out = capsys.readouterr().out
    assert "train mode" in out and "within the limit" in out
    assert ("stochastic depth off" in out) == (model == "cvt-13")


class _WrongGradient(dnn.Linear):
    """The right output, a gradient 1% too large."""
    def forward(self, x):
        y = super().forward(x)
        return y + 0.01 * (y - y.detach())


def test_inject_train_step_wrong_gradient_exits_1(capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(dnn.attention, "Linear", _WrongGradient)  # LlamaAttention's q/k/v/o projections
    assert main(["inject", "llama", "--train", "--verify", *TINY_LLAMA]) == 1
    out = capsys.readouterr().out
    assert "verified: output within" in out and "BEYOND the limit" in out


ROW_KEYS = {"model", "provider", "mode", "dtype", "batch", "median_ms", "mean_ms", "min_ms", "max_ms", "first_call_ms",
            "graph_ms", "peak_memory_mib", "saved_mib", "speedup_vs_original", "rel_err_vs_fp64", "coverage_modules",
            "coverage_flops", "coverage_time"}


def test_inject_bench_writes_rows(capsys, tmp_path):
    """Every provider's row; the injected Llama keeps less for its backward than the original. 64 tokens: more
    tokens than hidden units, as in any real model (the fused linear + cross-entropy keeps the weight's gradient
    [vocab, hidden] from its forward where torch keeps the logits [tokens, vocab])."""
    pytest.importorskip("transformers")
    paths = {"json": tmp_path / "r.json", "csv": tmp_path / "r.csv"}
    assert TINY_LLAMA[-2] == "--seq"
    assert main(["inject", "llama", "--bench", "--train", *TINY_LLAMA[:-1], "64", *FAST, "--json",
                 str(paths["json"]), "--csv", str(paths["csv"])]) == 0
    out = capsys.readouterr().out
    assert "err vs fp64" in out and "speed-up" in out
    result = json.loads(paths["json"].read_text())
    rows = {r["provider"]: r for r in result["rows"]}
    assert list(rows) == ["original", "original_graph", "original_compile", "original_compile_ro",
                          "dropin", "dropin_graph", "dropin_compile", "dropin_compile_ro", "liger"]
    assert all(ROW_KEYS <= set(r) for r in rows.values()) and result["env"]["command"].startswith("dropin inject")
    assert rows["liger"].get("note") in (LIGER_MISSING, "skipped: interpreter") or rows["liger"]["median_ms"] > 0
    assert (rows["dropin"]["peak_memory_mib"] is None) == (not ON_GPU)
    assert 0 < rows["dropin"]["saved_mib"] <= rows["original"]["saved_mib"]
    assert rows["dropin_compile"]["saved_mib"] is None
    assert rows["original"]["speedup_vs_original"] == 1.0 and rows["original"]["coverage_flops"] is None
    assert rows["dropin"]["mode"] == "train" and 0 < rows["dropin"]["rel_err_vs_fp64"] < TOLERANCES[torch.float32][1]
    # the residual adds stay torch (FLOPs), the embedding too (modules)
    assert 0.99 < rows["dropin"]["coverage_flops"] < 1 and 0 < rows["dropin"]["coverage_modules"] < 1
    assert ("aten::add" in out) == (rows["dropin"]["coverage_time"] is None)  # the interpreter lists torch's ops
    assert rows["dropin"]["coverage_time"] is None or 0 < rows["dropin"]["coverage_time"] < 1
    for provider in ("dropin_compile", "dropin_compile_ro"):
        assert (rows[provider].get("note") == "skipped: interpreter") == (rows[provider]["median_ms"] is None)
    assert "no plain CUDA graph" in rows["dropin_graph"]["note"] and rows["dropin_graph"]["median_ms"] is None
    if ON_GPU:
        assert "fastest here: dropin" in out or "no recommendation" in out
    else:  # (interpreted kernels' CPU times: no speed to compare)
        assert out.count("say nothing of their speed on a GPU") == 2 and "fastest here" not in out
    assert paths["csv"].read_text().splitlines()[0].startswith("model,provider,mode")


def test_inject_bench_llama_has_no_plain_graph_rows(capsys, tmp_path):
    """HF Llama's forward cannot be captured in one plain CUDA graph: both _graph rows say why, untimed; the other
    providers still run."""
    pytest.importorskip("transformers")
    path = tmp_path / "r.json"
    assert main(["inject", "llama", "--bench", *TINY_LLAMA, *FAST, "--json", str(path)]) == 0
    rows = {r["provider"]: r for r in json.loads(path.read_text())["rows"]}
    for provider in ("original_graph", "dropin_graph"):
        assert "cannot be captured in one plain CUDA graph" in rows[provider]["note"], rows[provider]
        assert rows[provider]["median_ms"] is None
    assert rows["original"]["median_ms"] > 0 and rows["dropin"]["median_ms"] > 0


@gpu
def test_inject_bench_every_mode_runs(capsys, tmp_path):
    """Inference of an injected ResNet-18 in every mode: eager, one CUDA graph, torch.compile default and
    reduce-overhead, each checked against the original in float64 (a mode that fails has an `error`)."""
    path = tmp_path / "r.json"
    assert main(["inject", "resnet18", "--bench", "--batch", "2", "--image-size", "64", "--dtype", "bfloat16",
                 "--channels-last", *FAST, "--json", str(path)]) == 0
    rows = {r["provider"]: r for r in json.loads(path.read_text())["rows"]}
    for provider, row in rows.items():
        assert "error" not in row and row["median_ms"] > 0, (provider, row)
        assert row["rel_err_vs_fp64"] <= TOLERANCES[torch.bfloat16][0], (provider, row["rel_err_vs_fp64"])


def test_inject_weights_loaded(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=100)
    transformers.LlamaModel(config).save_pretrained(tmp_path)
    assert main(["inject", "llama", "--weights", str(tmp_path), "--seq", "4", "--verify"]) == 0
    assert "hidden 32, 2 heads" in capsys.readouterr().out


def test_inject_resnet_weights_loaded(monkeypatch, tmp_path):
    """--weights: a state_dict file through load_state_dict (strict: a checkpoint of another model raises)."""
    torchvision = pytest.importorskip("torchvision")
    monkeypatch.setattr(torchvision.models, "resnet18", _tiny_cnn)
    torch.save(_tiny_cnn().state_dict(), tmp_path / "w.pt")
    assert main(["inject", "resnet18", "--image-size", "8", "--weights", str(tmp_path / "w.pt")]) == 0


@pytest.mark.parametrize("contents", ["another model's state_dict", "not a checkpoint"])
def test_inject_resnet_weights_that_do_not_load(capsys, monkeypatch, tmp_path, contents):
    """A --weights file that is not this model's state_dict: one line naming it, exit code 2."""
    torchvision = pytest.importorskip("torchvision")
    monkeypatch.setattr(torchvision.models, "resnet18", _tiny_cnn)
    path = tmp_path / "w.pt"
    if contents == "not a checkpoint":
        path.write_text(contents)
    else:
        torch.save(nn.Linear(2, 2).state_dict(), path)
    assert main(["inject", "resnet18", "--image-size", "8", "--weights", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dropin inject: --weights {path}: cannot load it into resnet18: ") and err.count("\n") == 1


def test_inject_llama_weights_directory_without_a_model(capsys, tmp_path):
    pytest.importorskip("transformers")
    assert main(["inject", "llama", "--weights", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dropin inject: --weights {tmp_path}: cannot load it into llama: ") and err.count("\n") == 1


def test_inject_pruned_llama_runs_sparse(capsys):
    """--prune 0.9 zeros 90% of the MLP projections' weights; --sparse 0.5 puts them on sparse_linear."""
    assert main(["inject", "llama", "--prune", "0.9", "--sparse", "0.5", "--verify"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"mlp\.(gate|up|down)_proj\s+Linear\s+sparse_linear \(", out)) == 3, out  # (any width)
    assert "verified" in out and "swiglu_mlp" not in out


@pytest.mark.parametrize("argv, message", [
    (["resnet18", "--weights", "/no/such/checkpoint.pt"], "--weights /no/such/checkpoint.pt: no such file"),
    (["llama", "--weights", "/no/such/dir"], "--weights /no/such/dir: no such file"),
    (["resnet18", "--hidden", "64"], "--hidden is a llama option"),
    (["llama", "--hidden", "65", "--heads", "2"], "--hidden 65 must be a multiple of --heads 2"),
    (["llama", "--image-size", "16"], "--image-size and --channels-last are for image models"),
    (["llama", "--seq", "0"], "--seq 0: must be positive"),
    (["llama", "--weights", "/tmp", "--layers", "2"], "--layers cannot be combined with --weights"),
    (["resnet18", "--weights", "/tmp"], "--weights /tmp: resnet18 loads a state_dict file"),
    (["llama", "--json", "r.json"], "add --bench"),
    (["resnet18", "--prune", "1.5"], "--prune 1.5: must be in [0, 1]"),
    (["llama", "--sparse", "-0.1"], "--sparse -0.1: must be in [0, 1]"),
    (["resnet18", "--processes", "3"], "--processes 3: must be at least 1, and more than 1 only with --bench"),
    (["resnet18", "--providers", "dropin"], "--providers chooses the --bench rows: add --bench"),
    (["llama", "--generate", "8", "--bench", "--providers", "dropin"], "--generate is a llama --bench option"),
    (["resnet18", "--generate", "8", "--bench"], "--generate is a llama --bench option"),
    (["llama", "--generate", "8"], "--generate is a llama --bench option"),
    (["llama", "--generate", "1", "--bench"], "--generate 1: at least 2 new tokens"),
    (["llama", "--batch", "1,8"], "--batch 1,8: several batch sizes only with --generate"),
    (["llama", "--batch", "2,0", "--generate", "4", "--bench"], "--batch 0: must be positive"),
])
def test_inject_bad_arguments(capsys, argv, message):
    assert main(["inject", *argv]) == 2
    assert message in capsys.readouterr().err


def test_generate_rows_eager():
    """generate_rows on a tiny causal LM: the eager rows timed and equal to the original's tokens, the compiled
    ones (interpreter) or their errors say why they did not run."""
    transformers = pytest.importorskip("transformers")
    from dropin.bench import decode

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, attn_implementation="sdpa")
    original = transformers.LlamaForCausalLM(config).to(DEVICE).eval()
    model = copy.deepcopy(original)
    dropin.inject_(model, example_inputs=(torch.randint(0, 64, (1, 4), device=DEVICE),), verify=False)
    rows = {r["provider"]: r for r in decode.generate_rows("llama", original, model, [2], 3, 2, calls=1)}
    for provider in ("original", "dropin"):
        assert "error" not in rows[provider] and rows[provider]["decode_tokens_per_s"] > 0, rows[provider]
    # (logits after several decoding steps: the backward column, for errors that compound)
    assert rows["dropin"]["tokens_match"] == 1.0
    assert rows["dropin"]["rel_err_vs_original"] < TOLERANCES[torch.float32][1]
    for provider in ("original_compile_ro", "dropin_compile_ro"):
        assert ON_GPU or "interpreted" in rows[provider]["note"]


@gpu
def test_inject_generate_rows(capsys, tmp_path):
    """--generate: HF generate() with a static cache, batch sizes 1 and 3, eager and reduce-overhead, original and
    injected: every row timed, the injected model's first logits close to the original's."""
    pytest.importorskip("transformers")
    path = tmp_path / "r.json"
    assert main(["inject", "llama", "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
                 "--intermediate", "512", "--seq", "40", "--batch", "1,3", "--dtype", "bfloat16", "--generate", "6",
                 "--bench", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["batch"], r["provider"]) for r in rows] == [
        (b, p) for b in (1, 3) for p in ("original", "original_compile_ro", "dropin", "dropin_compile_ro")]
    for row in rows:
        assert "error" not in row and row["decode_tokens_per_s"] > 0, row
        assert row["rel_err_vs_original"] < TOLERANCES[torch.bfloat16][1] and row["tokens_match"] > 0, row
    assert "decode tok/s" in capsys.readouterr().out


@gpu
@pytest.mark.parametrize("argv", [["llama", "--verify", "--bench", "--rep", "20"],  # seed 002's config
                                  pytest.param(["llama", "--train", "--bench", "--dtype", "bfloat16", "--rep", "20"],
                                               marks=slow),
                                  pytest.param(["cvt-13", "--verify", "--bench", "--batch", "4", "--rep", "20"],
                                               marks=slow)])
def test_inject_hf_models_full_size(capsys, argv):
    """Full-size defaults on the GPU: verified (or a training step compared) and timed, compile rows included."""
    pytest.importorskip("transformers")
    assert main(["inject", *argv]) == 0
    out = capsys.readouterr().out
    assert "dropin_compile" in out and "skipped" not in out


def test_bench_rows_merged_over_processes():
    """--processes: per provider the median of the processes' medians, their spread, the worst error; a provider
    that failed in one process keeps its error."""
    from dropin.bench.models import merge_processes

    def row(provider, median, err=1e-3, **extra):
        return {"provider": provider, "median_ms": median, "mean_ms": median, "min_ms": median * 0.9,
                "max_ms": median * 1.1, "graph_ms": None, "rel_err_vs_fp64": err, **extra}
    runs = [[row("original", 2.0), row("dropin", 1.0, 2e-3)], [row("original", 4.0), row("dropin", 1.2)],
            [row("original", 3.0), {"provider": "dropin", "median_ms": None, "error": "RuntimeError: boom"}]]
    merged = merge_processes(runs)
    assert merged[0]["median_ms"] == 3.0 and merged[0]["spread_ms"] == [2.0, 4.0]
    assert merged[0]["process_median_ms"] == [2.0, 4.0, 3.0] and merged[0]["speedup_vs_original"] == 1.0
    assert merged[1]["error"] == "RuntimeError: boom"
    merged = merge_processes(runs[:2])
    assert merged[1]["median_ms"] == 1.1 and merged[1]["rel_err_vs_fp64"] == 2e-3
    assert abs(merged[1]["speedup_vs_original"] - 3.0 / 1.1) < 1e-12
    # The later processes time the host-bound providers only: the others keep the first process's figures.
    first = [row("original", 2.0), row("dropin_graph", 0.5), row("dropin", 1.0)]
    merged = merge_processes([first, [row("original", 4.0), row("dropin", 1.4)], [row("original", 3.0)]])
    assert [r["provider"] for r in merged] == ["original", "dropin_graph", "dropin"]
    assert merged[1]["process_median_ms"] == [0.5] and merged[1]["speedup_vs_original"] == 6.0
    assert merged[2]["process_median_ms"] == [1.0, 1.4] and merged[2]["median_ms"] == 1.2


def test_bench_processes_rerun_the_timing_alone(monkeypatch, capsys):
    """--processes N: the later processes run the same command for the host-bound providers of the first's rows,
    without the files, the loss curves or their plot (the first process writes and trains those) and without the
    training step's check (the first made it); a later process that fails shows the end of its output."""
    import subprocess
    import sys

    from dropin import cli

    argv = ["inject", "llama", "--train", "--bench", "--processes", "2", "--json", "r.json", "--curve", "50",
            "--plot", "c.png", "--quiet"]
    args = cli.build_parser().parse_args(argv)
    args.argv = argv
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        path = command[command.index("--json") + 1]
        with open(path, "w") as f:
            json.dump({"rows": [{"provider": "original"}]}, f)
        return subprocess.CompletedProcess(command, 0, "")
    monkeypatch.setattr(subprocess, "run", run)
    assert cli._bench_process(args, ["original", "original_compile", "dropin"], 2) == [{"provider": "original"}]
    (command,) = calls
    assert command[:3] == [sys.executable, "-m", "dropin.cli"]
    assert command[3:-5] == ["inject", "llama", "--train", "--bench", "--quiet"]
    assert command[-5:-2] == ["--providers", "original,dropin", "--timing-only"] and command[-2] == "--json"
    assert cli.build_parser().parse_args(command[3:]).timing_only

    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, "".join(f"line {i}\n" for i in range(30)) + "BEYOND the limit\n"))
    with pytest.raises(subprocess.CalledProcessError):
        cli._bench_process(args, ["original", "dropin"], 2)
    err = capsys.readouterr().err
    assert "exited with 1" in err and "BEYOND the limit" in err and "line 11" in err and "line 10\n" not in err


def _later_bench_processes(monkeypatch, source, seen=None):
    """subprocess.run with dropin's later bench processes replaced: each writes the dropin rows of the file at
    `source`, twice as slow (the file as read appended to `seen`); other commands (Triton's ptxas, when a kernel
    compiles on a GPU) run."""
    import subprocess
    real = subprocess.run

    def run(command, *args, **kwargs):
        if "dropin.cli" not in command:
            return real(command, *args, **kwargs)
        read = json.loads(source.read_text())
        if seen is not None:
            seen.append(read)
        rows = [dict(r, median_ms=r["median_ms"] * 2) for r in read["rows"] if r["provider"] == "dropin"]
        with open(command[command.index("--json") + 1], "w") as f:
            json.dump({"rows": rows}, f)
        return subprocess.CompletedProcess(command, 0, "")
    monkeypatch.setattr(subprocess, "run", run)


def test_bench_processes_write_what_they_measured(monkeypatch, tmp_path, capsys):
    """--processes N --json: before each later process the file holds the rows of those run so far, marked
    partial (a run cut short keeps them), and the first process's table is printed; the final file has no mark."""
    path = tmp_path / "rows.json"
    seen = []
    _later_bench_processes(monkeypatch, path, seen)
    assert main(["inject", "llama", *TINY_LLAMA, "--train", "--bench", "--processes", "3", "--providers",
                 "original,dropin", "--json", str(path), "--quiet"]) == 0
    assert [s["partial"] for s in seen] == ["not run (the command did not finish): 2 of 3 bench processes",
                                            "not run (the command did not finish): 1 of 3 bench processes"]
    assert [len(s["rows"][1]["process_median_ms"]) for s in seen] == [1, 2]
    final = json.loads(path.read_text())
    assert "partial" not in final and len(final["rows"][1]["process_median_ms"]) == 3
    assert capsys.readouterr().out.count("provider ") == 2  # process 1's table, then the medians'


def test_update_merges_a_bench_measured_in_parts(tmp_path, capsys, monkeypatch):
    """--update: a run's providers and loss curve replace the --json file's, the other rows stay (PROVIDERS' order),
    env.parts lists each run once (its partial writes, one per bench process, merge into the file as the run found
    it); a file of another model config and a missing --json are refused before any work."""
    path = tmp_path / "r.json"
    base = ["inject", "llama", *TINY_LLAMA, "--train", "--json", str(path), "--quiet"]
    assert main(base + ["--bench", "--providers", "original,dropin"]) == 0
    first = json.loads(path.read_text())
    _later_bench_processes(monkeypatch, path)  # the second bench process: process 1's dropin row, twice as slow
    assert main(base + ["--bench", "--providers", "dropin", "--update", "--processes", "2"]) == 0
    assert main(base + ["--curve", "2", "--update"]) == 0
    saved = json.loads(path.read_text())
    assert [r["provider"] for r in saved["rows"]] == ["original", "dropin"]
    assert saved["rows"][0] == first["rows"][0] and saved["rows"][1]["median_ms"] != first["rows"][1]["median_ms"]
    assert len(saved["env"]["parts"]) == 3 and len(saved["curve"]["dropin"]) == 2
    capsys.readouterr()
    assert main(["inject", "llama", "--bench", "--json", str(path), "--update"]) == 2
    assert f"--update: {path} holds rows of llama/train/" in capsys.readouterr().err
    assert main(["inject", "llama", "--bench", "--update"]) == 2
    assert "add --json FILE" in capsys.readouterr().err
    assert main(base + ["--bench", "--update", "--processes", "0"]) == 2  # (the other checks still run)
    assert "--processes 0: must be at least 1" in capsys.readouterr().err


def test_progress_lines_without_a_terminal(capsys):
    """--progress: the bench rows' progress lines reach stderr where it is no terminal (a log file); --quiet wins."""
    import logging

    from dropin import cli
    from dropin.bench import models

    logger = logging.getLogger("dropin.progress")
    before, logger.handlers = logger.handlers, []
    try:
        cli._show_progress(quiet=True, always=True)
        assert logger.handlers == []
        cli._show_progress(quiet=False, always=True)
        models.progress.info("bench %s: %.1f s", "dropin", 1.25)
        assert "dropin: bench dropin: 1.2 s" in capsys.readouterr().err
    finally:
        logger.handlers = before


def test_providers_argument():
    """--providers: names of PROVIDERS in its order, whatever order given; an unknown name is refused."""
    from dropin.cli import build_parser

    args = build_parser().parse_args(["inject", "resnet18", "--bench", "--providers", "dropin,original"])
    assert args.providers == ("original", "dropin")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["inject", "resnet18", "--bench", "--providers", "dropin,eager"])


def test_inject_train_curve_writes_the_losses(capsys, tmp_path):
    """--curve N: the original, the injected model and a float64 copy trained N steps on one batch; the losses match
    at every step within the limit, and the file holds them."""
    path, plot = tmp_path / "curve.json", tmp_path / "curve.png"
    assert main(["inject", "llama", "--train", "--curve", "3", "--json", str(path), "--plot", str(plot),
                 "--quiet"]) == 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "within the limit" in capsys.readouterr().out.split("loss curves")[1]
    curve = json.loads(path.read_text())["curve"]
    assert len(curve["original"]) == len(curve["dropin"]) == len(curve["float64"]) == 3 and curve["within"]
    assert curve["original"][-1] < curve["original"][0]  # it trains
    assert main(["inject", "llama", "--curve", "3"]) == 2  # (--train needed)
    assert "--curve 3: a number of steps" in capsys.readouterr().err
    assert main(["inject", "llama", "--train", "--plot", str(plot)]) == 2
    assert "--plot draws the --curve" in capsys.readouterr().err


def test_failed_curve_still_writes_the_rows(capsys, tmp_path, monkeypatch):
    """A loss curve that fails (after a fatal CUDA error of one row, every later call does) leaves the rows and
    the error in the JSON, and the command fails."""
    from dropin.bench import models

    def fail(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(models, "loss_curve", fail)
    path = tmp_path / "r.json"
    assert main(["inject", "llama", "--train", "--bench", "--providers", "original,dropin", "--curve", "2",
                 "--json", str(path), "--plot", str(tmp_path / "c.png")]) == 1
    assert "the loss curves failed: RuntimeError: CUDA error" in capsys.readouterr().err
    result = json.loads(path.read_text())
    assert [r["provider"] for r in result["rows"]] == ["original", "dropin"] and "curve" not in result
    assert result["curve_error"].startswith("RuntimeError: CUDA error") and not (tmp_path / "c.png").exists()


def test_rows_after_a_device_error_run_in_a_fresh_process(capsys, tmp_path, monkeypatch):
    """A row whose device error leaves the process's CUDA context unusable (every later call would fail there):
    the later rows and the loss curves run again in a fresh process, and the result has them."""
    from dropin.bench import models

    provider_step = models._provider_step

    def faulty(name, provider, *args):
        if provider == "original":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return provider_step(name, provider, *args)

    monkeypatch.setattr(models, "_provider_step", faulty)
    path = tmp_path / "r.json"
    assert main(["inject", "llama", *TINY_LLAMA, "--train", "--bench", "--providers", "original,dropin", "--curve",
                 "2", "--json", str(path)]) == 0  # (the fresh process gets the same model flags)
    assert "unusable; dropin, the loss curves run again in a fresh process" in capsys.readouterr().err
    result = json.loads(path.read_text())
    original, dropin_row = result["rows"]
    assert original["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert dropin_row["provider"] == "dropin" and dropin_row["median_ms"] > 0 and "note" not in dropin_row
    assert len(result["curve"]["dropin"]) == 2 and result["curve"]["within"]


def test_loss_curve_finds_a_model_that_trains_apart():
    """A model that computes something else (one class's logit raised by 8: its loss is near 0 or far above the
    original's, whatever the random inputs and labels; a change of a weight by 1% left the loss within 1e-4 of the
    original's in about 7% of draws): its losses leave the limit. The same model stays within it."""
    from dropin.bench import models

    original = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))
    other = copy.deepcopy(original)
    with torch.no_grad():
        other[2].bias[0] += 8.0
    curve = models.loss_curve(original, other, (torch.randn(4, 8),), steps=2)
    assert not curve["within"] and curve["max_rel_diff"] > 0.5
    same = models.loss_curve(copy.deepcopy(original), copy.deepcopy(original), (torch.randn(4, 8),), steps=2)
    assert same["within"] and same["max_rel_diff"] == 0.0
