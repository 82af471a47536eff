"""Probe (GPU): host cost of one decoding step under HF generate()'s reduce-overhead compile, original against
injected. HF's compiled call (`get_compiled_call`) is wrapped so that each step's host time (the call's return,
no synchronisation: a CUDA graph replay is asynchronous) is recorded; then one generate() per model under the
torch profiler (CPU only) gives the guard evaluation's time a compiled call and lists the host ops by self time.
Usage: PYTHONPATH=src python3 benchmarks/probes/decode_host.py [--batch 1] (the 4-layer 7B-shaped Llama, 512-token
prompt, 64 new tokens)"""
import copy
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import dropin
from dropin import cli
from dropin.bench import decode


def _timed_compiled_call(model, host_us: list):
    compiled_call = model.get_compiled_call

    def get_compiled_call(config):
        call = compiled_call(config)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = call(*args, **kwargs)
            host_us.append((time.perf_counter() - start) * 1e6)
            return out
        return timed
    model.get_compiled_call = get_compiled_call


def main():
    batch = sys.argv[sys.argv.index("--batch") + 1] if "--batch" in sys.argv else "1"
    args = cli.build_parser().parse_args(
        ["inject", "llama", "--layers", "4", "--hidden", "4096", "--heads", "32", "--intermediate", "11008",
         "--seq", "512", "--batch", batch, "--dtype", "bfloat16", "--bench", "--generate", "64"])
    args.argv = []
    assert cli._check_inject_args(args) is None
    original = cli.MODELS["llama"](args).eval().to("cuda", torch.bfloat16)
    ids = cli._inputs(args, original)[0]
    injected = copy.deepcopy(original)
    dropin.inject_(injected, example_inputs=(ids,))
    models = {"original": original, "injected": injected}
    host = {name: [] for name in models}
    for name, model in models.items():
        _timed_compiled_call(model, host[name])
    with torch.no_grad():
        for name, model in models.items():
            decode._generate(model, ids, 64, True)
            decode._generate(model, ids, 64, True)
        for name in host:
            host[name].clear()
        walls = {name: [] for name in models}
        for _ in range(4):
            for name, model in models.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                decode._generate(model, ids, 64, True)
                torch.cuda.synchronize()
                walls[name].append((time.perf_counter() - start) * 1e3)
        for name in models:
            steps = sorted(host[name])
            print(f"{name}: generate {statistics.median(walls[name]):.1f} ms (64 tokens), compiled step host "
                  f"median {statistics.median(steps):.1f} us, p10 {steps[len(steps) // 10]:.1f}, "
                  f"p90 {steps[len(steps) * 9 // 10]:.1f} ({len(steps)} steps)")
        for name, model in models.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                decode._generate(model, ids, 64, True)
            events = prof.key_averages()
            guards = [e for e in events if e.key == "TorchDynamo Cache Lookup"]  # (guard evaluation)
            print(f"\n{name}: guard evaluation {guards[0].cpu_time_total / guards[0].count:.1f} us a compiled call"
                  if guards else f"\n{name}: no guard evaluation recorded")
            print(f"{name}: host ops by self time, one generate() of 64 tokens")
            print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main()
