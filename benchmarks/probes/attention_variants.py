"""Probe: the attention fuzz findings that only the GPU showed (forwards ~0.9 off, CUDA illegal addresses in the
backward), each case run in variants, each variant in a process of its own (an illegal address poisons its
process): which change of dtype, layout, mask or launch config makes the failure go. Found (H200, Triton 3.6): every
case has q, k or v whose head dim is not unit-stride; attention now reads such tensors from copies
(`attention._readable`), so `asis` runs the fix and the other variants run without it (`raw`: no copies, as found);
the live question is whether a newer Triton still fails `raw` (then the copies can go).

Answers per (case, variant): the relative errors (float64 reference) of the forward and of dq / dk / dv beside
torch's own in the same dtype, or the error raised; and the launches the variant built (kernel, tiles, warps,
stages). Variants: asis (with the copies); raw; fp16 / bf16 (the other 16-bit dtype); dense (q, k, v and the mask
as contiguous copies); nomask; short0 (attention.SHORT_KEYS = 0: no DELTA pass); fwd_s1 / fwd_s2 / fwd_w4 / fwd_w8
(the forward launch's num_stages / num_warps); delta_w4 / delta_w8 / delta_m16 (the DELTA launch's warps, BLOCK_M
16).

Usage: PYTHONPATH=src python3 benchmarks/probes/attention_variants.py [CASE ...] [--variants V,V,...] [--jobs N]
       (N children at once, default 8; one child: ... --one CASE VARIANT)
"""
import concurrent.futures
import os
import pathlib
import subprocess
import sys

os.environ.setdefault("DROPIN_AUTOTUNE", "0")  # (as the tests: the first candidate config)
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "fuzz")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _fuzz import Layout  # noqa: E402

C, T = Layout("contiguous"), lambda perm: Layout("transposed", perm=perm)  # noqa: E731
S, X = (lambda dim: Layout("sliced", dim=dim)), (lambda *dims: Layout("expanded", dims=dims))  # noqa: E731
# name: (dtype, q shape, kv shape, mask dtype ("q": q's) or None, mask shape, mask layout, scale, gqa,
#        layouts of q / k / v, backward)
CASES = {
    "f1": (torch.bfloat16, (1, 4, 53, 18), (1, 1, 49, 18), torch.bool, (53, 49), T((1, 0)), None, True,
           (C, X(2, 3), C), False),
    "f58": (torch.bfloat16, (3, 33, 28), (3, 33, 28), "q", (1, 1, 33), X(0, 2), -0.8231994479537883, False,
            (C, T((1, 2, 0)), C), True),
    "d57": (torch.float16, (5, 1, 27, 53), (5, 1, 21, 53), "q", (1, 1, 21), X(0, 1, 2), -0.1662214227179195, False,
            (S(1), C, T((1, 2, 3, 0))), True),
    "d2": (torch.float16, (4, 33, 37), (4, 56, 37), "q", (4, 33, 1), T((1, 2, 0)), None, False,
           (S(1), S(1), S(2)), True),
    "d61": (torch.float16, (1, 2, 2, 56), (1, 1, 33, 56), None, None, C, None, True,
            (C, T((2, 3, 0, 1)), X(3)), True),
    "d62": (torch.bfloat16, (4, 6, 38), (4, 6, 38), "q", (6, 1), C, -0.8453484047775788, False,
            (S(1), T((0, 1, 2)), T((1, 2, 0))), True),
}
VARIANTS = ["asis", "raw", "other16", "dense", "nomask", "short0", "fwd_s1", "fwd_s2", "fwd_w4", "fwd_w8",
            "delta_w4", "delta_w8", "delta_m16"]
OVERRIDES = {"fwd_s1": ("fwd_kernel", dict(num_stages=1)), "fwd_s2": ("fwd_kernel", dict(num_stages=2)),
             "fwd_w4": ("fwd_kernel", dict(num_warps=4)), "fwd_w8": ("fwd_kernel", dict(num_warps=8)),
             "delta_w4": ("DELTA", dict(num_warps=4)), "delta_w8": ("DELTA", dict(num_warps=8)),
             "delta_m16": ("DELTA", dict(BLOCK_M=16))}


def patch_launches(attention, variant):
    """attention.Launch wrapped: each launch built is printed, and the variant's override applied to its kind."""
    original = attention.Launch
    kind, override = OVERRIDES.get(variant, (None, {}))

    def launch(kernel, grid, meta, **kw):
        name = kernel.fn.__name__ + (" DELTA" if meta.get("DELTA") else "")
        if (kind == "DELTA" and meta.get("DELTA")) or kind == kernel.fn.__name__:
            meta = dict(meta, **override)
            if "BLOCK_M" in override:  # (the DELTA grid over query tiles of the new size)
                grid = (-(-attention_lq[0] // override["BLOCK_M"]), grid[1])
        shown = {k: v for k, v in meta.items() if k.startswith(("BLOCK", "num_", "TMA", "CHUNK", "PRECISION"))}
        print(f"  launch {name} grid {grid} {shown}", flush=True)
        return original(kernel, grid, meta, **kw)
    attention.Launch = launch


attention_lq = [0]


def one(case: str, variant: str) -> None:
    import importlib

    import dropin
    attention_module = importlib.import_module("dropin.ops.attention")  # (dropin.ops.attention is the function)
    dtype, q_shape, kv_shape, mask_dtype, mask_shape, mask_layout, scale, gqa, layouts, backward = CASES[case]
    if variant == "other16":
        dtype = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    if variant == "short0":
        attention_module.SHORT_KEYS = 0
    if variant != "asis":  # (every variant but asis without the copies: the fault as found)
        attention_module._readable = lambda *tensors: tensors
    attention_lq[0] = q_shape[-2]
    patch_launches(attention_module, variant)
    torch.manual_seed(0)
    q, k, v = (lay.tensor(shape, dtype) for lay, shape in zip(layouts, (q_shape, kv_shape, kv_shape)))
    mask = None
    if mask_dtype is not None and variant != "nomask":
        mask = mask_layout.tensor(mask_shape, dtype if mask_dtype == "q" else mask_dtype)
    if variant == "dense":
        q, k, v = (t.contiguous() for t in (q, k, v))
        mask = None if mask is None else mask.contiguous()
    kw = dict(attn_mask=mask, scale=scale, enable_gqa=gqa)
    leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    doubles = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    torch_leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*doubles, **dict(kw, attn_mask=None if mask is None else
                                                          (mask if mask.dtype == torch.bool else mask.double())))
    out = dropin.ops.attention(*leaves, **kw)
    own = F.scaled_dot_product_attention(*torch_leaves, **kw)

    def err(a, b):
        return (float(torch.linalg.vector_norm(a.double() - b) / torch.linalg.vector_norm(b))
                if torch.isfinite(a).all() else float("nan"))
    rows = [("out", err(out, ref), err(own, ref))]
    if backward:
        g = torch.randn_like(ref)
        grads = torch.autograd.grad(out, leaves, g.to(dtype))
        torch_grads = torch.autograd.grad(own, torch_leaves, g.to(dtype))
        ref_grads = torch.autograd.grad(ref, doubles, g)
        rows += [(f"d{n}", err(a, r), err(b, r)) for n, a, b, r in zip("qkv", grads, torch_grads, ref_grads)]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print("  " + "  ".join(f"{n} {e:.2e} (torch {t:.2e})" for n, e, t in rows), flush=True)


def child(case: str, variant: str) -> str:
    r = subprocess.run([sys.executable, __file__, "--one", case, variant], capture_output=True, text=True,
                       timeout=300)
    lines = [f"{case} {variant}:"] + [ln for ln in r.stdout.splitlines() if ln.strip()]
    if r.returncode:
        lines.append("  RAISED: " + (r.stderr.strip().splitlines() or ["?"])[-1][:300])
    return "\n".join(lines)


def option(argv: list, name: str, default: str) -> tuple:
    if name not in argv:
        return default, argv
    i = argv.index(name)
    return argv[i + 1], argv[:i] + argv[i + 2:]


def main(argv):
    if argv[:1] == ["--one"]:
        return one(argv[1], argv[2])
    variants, argv = option(argv, "--variants", ",".join(VARIANTS))
    jobs, argv = option(argv, "--jobs", "8")
    runs = [(case, variant) for case in argv or list(CASES) for variant in variants.split(",")]
    with concurrent.futures.ThreadPoolExecutor(int(jobs)) as pool:
        for text in pool.map(lambda run: child(*run), runs):
            print(text, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
