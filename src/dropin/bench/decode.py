"""Decoding with HF `generate()` (`dropin inject llama --generate NEW_TOKENS`): a causal LM with a static KV cache,
greedy, one token per step, original vs injected, eager and torch.compile(mode="reduce-overhead") (HF compiles the
decoding step itself when the cache is static and `disable_compile` is off: the prefill stays eager, each step
after it replays a CUDA graph).

Providers (PROVIDERS): `original`, `original_compile_ro`, `dropin`, `dropin_compile_ro`. Row keys: model, provider,
batch, prompt, new_tokens, median_ms (one whole generate() call: prefill + new_tokens steps), spread_ms ([min, max]
of the timed calls), prefill_ms (generate() of one new token), tokens_per_s (batch * new_tokens / median_ms),
decode_tokens_per_s (batch * (new_tokens - 1) / (median_ms - prefill_ms): the steps after the prefill),
speedup_vs_original (decode tokens/s over the original eager's at the same batch), rel_err_vs_original (the first
step's logits against the original eager's), tokens_match (share of generated tokens equal to the original eager's:
random weights make near-ties, so greedy paths may part after a rounding-level difference), note, error.
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import _runtime
from .._tolerance import rel_err
from . import harness

PROVIDERS = ("original", "original_compile_ro", "dropin", "dropin_compile_ro")


def _generate(model, ids: torch.Tensor, new_tokens: int, compiled: bool):
    from transformers import CompileConfig

    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                         disable_compile=not compiled, compile_config=CompileConfig(mode="reduce-overhead"),
                         return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences[:, ids.shape[1]:], out.logits[0]


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, calls: int) -> list[float]:
    """Wall-clock ms of each of `calls` calls (synchronized: a generate() call ends on the host anyway)."""
    times = []
    for _ in range(calls):
        _synchronize()
        start = time.perf_counter()
        fn()
        _synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def generate_rows(name: str, original, injected, batches: list[int], prompt: int, new_tokens: int,
                  calls: int = 5) -> list[dict]:
    """One row per (batch, provider) (see the module docstring); random prompt token ids. A provider that cannot
    run gets its `error` (or `note`) and the others still run. Every provider is warmed up first, then the timed
    calls go round the providers `calls` times: a decoding step is host-bound, and the host's speed drifts over
    a run, which one provider's calls in a row would take for its own."""
    rows = []
    vocab = original.config.vocab_size
    for batch in batches:
        ids = torch.randint(0, vocab, (batch, prompt), device=_runtime.KERNEL_DEVICE)
        batch_rows, outputs, times, prefill = {}, {}, {}, {}
        for provider in PROVIDERS:
            batch_rows[provider] = {
                "model": name, "provider": provider, "batch": batch, "prompt": prompt, "new_tokens": new_tokens,
                "median_ms": None, "spread_ms": None, "prefill_ms": None, "tokens_per_s": None,
                "decode_tokens_per_s": None, "speedup_vs_original": None, "rel_err_vs_original": None,
                "tokens_match": None}
            rows.append(batch_rows[provider])
        generate = {p: _generator(original if p.startswith("original") else injected, ids, p) for p in PROVIDERS}
        try:
            with torch.no_grad():
                for provider in PROVIDERS:  # compiles, records the CUDA graphs, fills the plan caches
                    warmed = harness.attempt(batch_rows[provider], lambda: generate[provider](new_tokens, 2),
                                             reset=False)
                    if warmed is not None:
                        outputs[provider], times[provider], prefill[provider] = warmed, [], []
                for _ in range(calls):
                    for provider in list(outputs):
                        timed = harness.attempt(batch_rows[provider], lambda: (
                            _timed(lambda: generate[provider](new_tokens, 1), 1)[0],
                            _timed(lambda: generate[provider](1, 1), 1)[0]), reset=False)
                        if timed is None:
                            del outputs[provider]
                        else:
                            times[provider].append(timed[0])
                            prefill[provider].append(timed[1])
        finally:
            torch._dynamo.reset()
        base = outputs.get(PROVIDERS[0])
        for provider, (tokens, logits) in outputs.items():
            row = batch_rows[provider]
            median, first = statistics.median(times[provider]), statistics.median(prefill[provider])
            row.update(median_ms=median, spread_ms=[min(times[provider]), max(times[provider])], prefill_ms=first,
                       tokens_per_s=batch * new_tokens / median * 1e3,
                       decode_tokens_per_s=batch * (new_tokens - 1) / max(median - first, 1e-9) * 1e3)
            if base is not None:
                row["rel_err_vs_original"] = rel_err(logits.float(), base[1].float())
                row["tokens_match"] = (tokens == base[0]).float().mean().item()
        if base is not None:
            for row in batch_rows.values():
                if row["decode_tokens_per_s"] is not None:
                    row["speedup_vs_original"] = (row["decode_tokens_per_s"]
                                                  / batch_rows[PROVIDERS[0]]["decode_tokens_per_s"])
    return rows


def _generator(model, ids: torch.Tensor, provider: str):
    """generate(new_tokens, repeats): `repeats` generate() calls of the provider; the last one's (tokens, logits)."""
    compiled = provider.endswith("_compile_ro")

    def generate(new_tokens: int, repeats: int):
        if compiled and _runtime.INTERPRET:
            raise harness.Skipped("skipped: torch.compile does not run interpreted kernels")
        for _ in range(repeats):
            out = _generate(model, ids, new_tokens, compiled)
        return out
    return generate


def format_rows(rows: list[dict]) -> str:
    """The terminal table of generate_rows."""
    lines = [f"{'batch':>5}  {'provider':<20}{'generate ms':>12}{'prefill ms':>11}{'tokens/s':>10}"
             f"{'decode tok/s':>13}{'speed-up':>9}{'logits err':>11}{'same tokens':>12}  note"]
    for r in rows:
        def cell(key, fmt, width):
            return f"{'-' if r[key] is None else format(r[key], fmt):>{width}}"
        lines.append(f"{r['batch']:>5}  {r['provider']:<20}" + cell("median_ms", ".1f", 12)
                     + cell("prefill_ms", ".1f", 11) + cell("tokens_per_s", ".0f", 10)
                     + cell("decode_tokens_per_s", ".0f", 13) + cell("speedup_vs_original", ".2f", 9)
                     + cell("rel_err_vs_original", ".1e", 11) + cell("tokens_match", ".0%", 12)
                     + f"  {r.get('error') or r.get('note', '')}")
    lines.append("decode tok/s: tokens of the steps after the prefill per second; speed-up: of decode tok/s over the "
                 "original eager at the same batch; logits err: the first step's logits against the original eager's")
    return "\n".join(lines)
