"""Training under torch.distributed: a CvT-13 and a Llama under DDP and under FSDP2 (fully_shard), the original model
(eager) against the injected one (dropin.inject_ before wrapping), from the same initial weights on the same seeded
synthetic batches, with torch's fused AdamW.

    torchrun --nproc_per_node N benchmarks/distributed.py [--model cvt-13 llama] [--mode ddp fsdp2] [--steps 20]
    python benchmarks/distributed.py ...          # world size 1 without torchrun
    python benchmarks/distributed.py --device cpu --tiny --steps 2   # gloo, tiny configs, Triton interpreter

Precision (--dtype, bfloat16 on CUDA): DDP trains the model in that dtype (parameters, gradients, optimizer state);
FSDP2 keeps float32 parameters, sharded, and computes in that dtype (MixedPrecisionPolicy: param_dtype, float32
reduce). FSDP2 shards each block (a Llama decoder layer, a CvT layer), then the root.

One row per (model, mode, provider) in `rows`: per step losses (the mean over ranks), and for the dropin row their
relative difference to the original's (loss_rel_diff, max_loss_rel_diff); throughput (images/s or tokens/s over
all ranks, the steps after --warmup, each step timed between device synchronizations, the slowest rank's time);
peak memory per rank during the training (torch.cuda.max_memory_allocated after inject_, MiB; None on the CPU);
`error` where a run raised. Per rank: Llama 4 sequences of 1024 tokens, CvT-13 64 images of 224x224 (LLAMA, CVT).
Written as JSON to --out (default benchmarks/results/<gpu>x<N>/distributed.json) with `env` (versions, GPU, world
size, command); each row has the `command` that measured it, and rows of other (model, mode) pairs already in the
file from the same GPU and world size are kept (`--model llama`, then `--model cvt-13`, fill one file).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODELS = ("cvt-13", "llama")
MODES = ("ddp", "fsdp2")
# Llama: 7B-shaped layers, 4 of them; 1024-token sequences. Tiny: the cli's interpreter config.
LLAMA = {"layers": 4, "hidden": 4096, "heads": 32, "kv_heads": 32, "intermediate": 11008, "seq": 1024, "batch": 4,
         "vocab": 32000}
LLAMA_TINY = {"layers": 1, "hidden": 64, "heads": 2, "kv_heads": 2, "intermediate": 128, "seq": 8, "batch": 2,
              "vocab": 128}
# CvT-13 on 224x224 images, 1000 classes (under the interpreter the cli reduces its widths and depths).
CVT = {"batch": 64, "image": 224, "classes": 1000}
CVT_TINY = {"batch": 2, "image": 32, "classes": 1000}
RESULTS = Path(__file__).resolve().parent / "results"


def init_distributed(device_type: str) -> torch.device:
    """The process group (torchrun's env:// rendezvous, or a world of one without torchrun: nccl on CUDA, gloo on
    the CPU); returns this rank's device."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def sizes(name: str, tiny: bool) -> dict:
    return {"llama": (LLAMA, LLAMA_TINY), "cvt-13": (CVT, CVT_TINY)}[name][tiny]


def build(name: str, tiny: bool, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The model in training mode with float32 weights drawn from `seed` (the same weights on every call): HF's
    LlamaForCausalLM (use_cache off, the sdpa attention), or the cli's CvT-13 (stochastic depth off)."""
    import transformers

    from dropin import cli

    torch.manual_seed(seed)
    with torch.device(device):
        if name == "cvt-13":
            return cli.MODELS[name](argparse.Namespace(train=True, weights=None)).train()
        s = sizes(name, tiny)
        fields = {field: s[flag] for flag, field in cli.LLAMA.items() if field}
        config = transformers.LlamaConfig(max_position_embeddings=max(2048, s["seq"]),
                                          use_cache=False, attn_implementation="sdpa", **fields)
        return transformers.LlamaForCausalLM(config).train()


def batches(name: str, tiny: bool, steps: int, dtype: torch.dtype, device: torch.device, rank: int = 0,
            seed: int = 0) -> list:
    """`steps` synthetic batches (keyword arguments of the HF forward, labels included) for `rank`: the same on
    every call with the same seed and rank, different between ranks."""
    s = sizes(name, tiny)
    generator = torch.Generator(device).manual_seed(seed * 1_000_003 + rank)
    if name == "llama":
        ids = [torch.randint(s["vocab"], (s["batch"], s["seq"]), generator=generator, device=device)
               for _ in range(steps)]
        return [{"input_ids": t, "labels": t} for t in ids]
    return [{"pixel_values": torch.randn(s["batch"], 3, s["image"], s["image"], generator=generator, device=device,
                                         dtype=dtype),
             "labels": torch.randint(s["classes"], (s["batch"],), generator=generator, device=device)}
            for _ in range(steps)]


def blocks(model: torch.nn.Module) -> list:
    """The modules FSDP2 shards one by one before the root: Llama's decoder layers, CvT's layers."""
    if hasattr(model, "cvt"):
        return [layer for stage in model.cvt.encoder.stages for layer in stage.layers]
    return list(model.model.layers)


def wrap(model: torch.nn.Module, mode: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """DDP, or FSDP2 computing in `dtype`."""
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in blocks(model):
        fully_shard(block, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model: torch.nn.Module, data: list, lr: float, device: torch.device) -> tuple[list, list]:
    """A step per batch (forward, the HF loss, backward, fused AdamW): (the losses averaged over ranks, each step's
    milliseconds on the slowest rank)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses, times = [], []
    for batch in data:
        synchronize(device)
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.detach().float())
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    step_ms = torch.tensor(times, device=device)
    dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)
    return (losses / dist.get_world_size()).tolist(), step_ms.tolist()


def peak_memory_mib(device: torch.device) -> list | None:
    """Each rank's peak allocated device memory since the last reset (MiB), None on the CPU."""
    if device.type != "cuda":
        return None
    peaks = [torch.zeros((), device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor(torch.cuda.max_memory_allocated(device) / 2**20, device=device))
    return [p.item() for p in peaks]


def run(name: str, mode: str, provider: str, args, device: torch.device) -> dict:
    """One training run (see the module docstring): its row."""
    import dropin

    s = sizes(name, args.tiny)
    row = {"model": name, "mode": mode, "provider": provider, "dtype": str(args.dtype).removeprefix("torch."),
           "world_size": dist.get_world_size(), "batch_per_rank": s["batch"], "steps": args.steps,
           "warmup": args.warmup, **{k: s[k] for k in ("seq", "image", "layers") if k in s}}
    gc.collect()  # the previous run's model and optimizer (FSDP2's hooks hold references in cycles)
    stages, start = {}, time.perf_counter()
    model = build(name, args.tiny, device)
    if mode == "ddp":
        model.to(args.dtype)  # (FSDP2 keeps float32 parameters and casts them at each unshard)
    data = batches(name, args.tiny, args.steps, args.dtype, device, dist.get_rank())
    stages["build"] = time.perf_counter() - start
    if provider == "dropin":
        # verified on two samples (a training-mode BatchNorm needs more than one value per channel), images in the
        # parameters' dtype (FSDP2's model stays float32 until its mixed-precision policy casts at each unshard)
        example = next(iter(data[0].values()))[:2]
        example = example.to(next(model.parameters()).dtype) if example.is_floating_point() else example
        row["inject"] = dropin.inject_(model, example_inputs=example).summary
        stages["inject"] = time.perf_counter() - start - stages["build"]
    if device.type == "cuda":  # the training's peak (inject_'s verification held float64 copies of the model)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_ms = train(wrap(model, mode, args.dtype, device), data, args.lr, device)
    stages["train"] = time.perf_counter() - start - sum(stages.values())
    # wall seconds: the model and its batches built, inject_ (its verification, first-use tuning), the training
    row["stage_s"] = stages
    progress(f"{name} {mode} {provider}: " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))
    timed = sum(step_ms[args.warmup:])
    per_step = s["batch"] * (s["seq"] if name == "llama" else 1) * dist.get_world_size()
    row.update(losses=losses, median_step_ms=statistics.median(step_ms[args.warmup:]),
               throughput=per_step * (args.steps - args.warmup) / timed * 1e3 if timed else None,
               unit="tokens/s" if name == "llama" else "images/s", peak_memory_mib=peak_memory_mib(device))
    return row


def progress(line: str) -> None:
    """A progress line on stderr from rank 0 (a run on a cold GPU tunes and compiles for minutes)."""
    if dist.get_rank() == 0:
        print(f"distributed: {line}", file=sys.stderr, flush=True)


def compare(original: dict, injected: dict) -> None:
    """Adds to the injected row its per step loss difference to the original's and the throughput ratio."""
    if "losses" not in original or "losses" not in injected:
        return
    diffs = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(injected["losses"], original["losses"])]
    injected.update(loss_rel_diff=diffs, max_loss_rel_diff=max(diffs))
    if original["throughput"] and injected["throughput"]:
        injected["speedup_vs_original"] = injected["throughput"] / original["throughput"]


def table(rows: list) -> str:
    lines = [f"{'model':<8}{'mode':<7}{'provider':<10}{'throughput':>16}{'speed-up':>10}{'max loss diff':>15}"
             f"{'peak MiB (per rank)':>22}  note"]
    for r in rows:
        rate = f"{r['throughput']:.1f} {r['unit'].split('/')[0]}/s" if r.get("throughput") else "-"
        speedup = f"{r['speedup_vs_original']:.3f}x" if r.get("speedup_vs_original") else "-"
        diff = f"{r['max_loss_rel_diff']:.2e}" if r.get("max_loss_rel_diff") is not None else "-"
        peak = "/".join(f"{m:.0f}" for m in r["peak_memory_mib"]) if r.get("peak_memory_mib") else "-"
        lines.append(f"{r['model']:<8}{r['mode']:<7}{r['provider']:<10}{rate:>16}{speedup:>10}{diff:>15}{peak:>22}"
                     f"  {r.get('error') or r.get('inject', '')}")
    return "\n".join(lines)


def merged(out: Path, env: dict, rows: list) -> dict:
    """The result to write to `out`: these rows, after the rows of other (model, mode) pairs that `out` holds from a
    run on the same GPU and world size (one invocation per model stays within a time limit)."""
    if out.exists():
        old = json.loads(out.read_text())
        if (old["env"]["gpu"], old["env"]["world_size"]) == (env["gpu"], env["world_size"]):
            ran = {(r["model"], r["mode"]) for r in rows}
            rows = [r for r in old["rows"] if (r["model"], r["mode"]) not in ran] + rows
    return {"env": env, "rows": rows}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the throughput")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU (the interpreter has no bf16 products)")
    p.add_argument("--tiny", action="store_true", help="tiny configs (a smoke run, e.g. on the CPU)")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/<gpu>x<N>/"
                   "distributed.json); rows of other models and modes already there are kept")
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    args.warmup = min(args.warmup, args.steps - 1)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before dropin imports triton: CPU tensors need the interpreter
    from dropin import _runtime
    from dropin.bench import harness

    device = init_distributed(args.device)
    world = dist.get_world_size()
    command = " ".join(([f"torchrun --nproc_per_node {world}"] if "RANK" in os.environ else ["python"]) + sys.argv)
    out = args.out or RESULTS / f"{_runtime.gpu_slug()}x{world}" / "distributed.json"
    rows = []
    for name in args.model:
        for mode in args.mode:
            pair = []
            for provider in ("original", "dropin"):
                row = {"model": name, "mode": mode, "provider": provider, "command": command}
                pair.append(harness.attempt(row, lambda: run(name, mode, provider, args, device)) or row)
            compare(*pair)
            rows += pair
            if dist.get_rank() == 0:  # written after each pair: a run cut short keeps what it measured
                env = harness.environment("distributed", command, {})
                env.update(world_size=world, backend=dist.get_backend(), dtype=str(args.dtype),
                           timing="per step: perf_counter between device synchronizations, the slowest rank's time")
                harness.write_json(out, merged(out, env, pair))
    if dist.get_rank() == 0:
        print(table(rows))
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
