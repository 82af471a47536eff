"""Probe: do dropin's kernels compile for Hopper (sm_90), and with how much shared memory, on a machine without a
GPU? Triton compiles for a named target with the ptxas its wheel bundles; the kernels are not run.

Answers, for matmul's TMA kernel in each layout and precision and every config of `TMA_CONFIGS` /
`TMA_ROUNDED_CONFIGS` / `TMA_SPLIT_CONFIGS` (matmul_configs) and its K splits, for the depthwise walk and input
gradient, conv2d's TMA forward whole and split along K, the attention kernels and swiglu's fp32 FMA tiles (one
token's one-row tiles among them): compiles or not, the shared memory the compiled kernel takes (over 232,448 bytes
a launch fails: the tuner times such a config as infinite), the waits for MMA results in the PTX
(`wgmma.wait_group`: where a sum reads them in registers), and reads back from shared memory (`ld.shared` in the
PTX: operand tiles taken into registers, as tf32x3's split in registers does (8 at 128 x 128 x 32, none from split
copies), or the epilogue's layout conversion of C (16-32 in the 16-bit configs with 128-256 columns)).

Caveat: the CPU's Triton (3.8 here) is not the GPU's (3.6): a kernel that compiles here may still fail there,
and the shared memory can differ; a first check before a GPU session, not a substitute.

Usage: PYTHONPATH=src python benchmarks/probes/compile_sm90.py [--quick] [--match "fp32 tf32x3_split"]   (~2 min;
--quick: first configs only; --match: those matmul cases alone)
"""
import argparse
import importlib
import itertools
import os
import time

os.environ["TRITON_INTERPRET"] = "0"  # (before dropin: its kernels must be compiled ones, not interpreted)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

matmul = importlib.import_module("dropin.ops.matmul")  # (dropin.ops.matmul is also the function)
matmul_kernels = importlib.import_module("dropin.ops.matmul_kernels")
matmul_configs = importlib.import_module("dropin.ops.matmul_configs")
depthwise = importlib.import_module("dropin.ops.conv2d.depthwise")
conv_tma = importlib.import_module("dropin.ops.conv2d.tma")
attention_kernels = importlib.import_module("dropin.ops.attention_kernels")
attention_decode = importlib.import_module("dropin.ops.attention_decode")
swiglu = importlib.import_module("dropin.ops.swiglu")

TARGET = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory a block may take on sm_90


def compiled(kernel, pointers: dict, constexprs: dict, launch: dict, floats=()):
    """triton.compile of kernel for sm_90: pointers maps each pointer parameter to its element type ('bf16',
    'fp32', ...), constexprs the constexpr parameters (their defaults where not given), the parameters named in
    floats fp32, every other parameter an i32."""
    constexprs = dict({p.name: p.default for p in kernel.params if p.is_constexpr and p.name not in constexprs},
                      **constexprs)
    signature = {p.name: (f"*{pointers[p.name]}" if p.name in pointers else
                          "constexpr" if p.name in constexprs else "fp32" if p.name in floats else "i32")
                 for p in kernel.params}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=TARGET,
                          options={k: launch[k] for k in ("num_warps", "num_stages") if k in launch})


def report(name: str, make) -> None:
    start = time.perf_counter()
    try:
        k = make()
    except Exception as e:  # noqa: BLE001 (a probe: every failure is a finding)
        print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return
    shared, ptx, ttgir = k.metadata.shared, k.asm.get("ptx", ""), k.asm.get("ttgir", "")
    print(f"{'ok  ' if shared <= SHARED_LIMIT else 'SMEM'} {name}: shared {shared} B, wgmma {ptx.count('wgmma.mma_async')}"
          f", waits {ptx.count('wgmma.wait_group')}"
          f", ld.shared {ptx.count('ld.shared')}, local_store {ttgir.count('ttg.local_store')} "
          f"({time.perf_counter() - start:.1f} s)")


def matmul_cases(quick: bool, match: str = ""):
    def config_name(c):
        return "x".join(str(c[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + \
            f" w{c['num_warps']} s{c['num_stages']}" + (" ws" if c.get("WARP_SPECIALIZE") else "") + \
            (" halves" if c.get("EPILOGUE_SUBTILE") else "") + (" chain" if c.get("CORRECTION_CHAIN") else "")
    cases = [("bf16", "ieee", a_t, b_t, cfg) for a_t, b_t in itertools.product((False, True), repeat=2)
             for cfg in matmul.TMA_CONFIGS[2][:1 if quick else None]]
    cases += [("fp32", p, False, True, cfg) for p in ("tf32x3", "tf32_rounded")
              for cfg in matmul.TMA_CONFIGS[4][:1 if quick else None]]
    cases += [("fp32", p, False, True, cfg) for p in ("tf32_rounded", "tf32_rounded_b")
              for cfg in matmul.TMA_ROUNDED_CONFIGS[:1 if quick else None]]
    cases += [("fp32", "tf32_rounded_b", False, True, cfg) for cfg in matmul.TMA_CONFIGS[4][:1 if quick else None]]
    cases += [("fp32", p, False, True, cfg) for p in ("tf32x3_split", "tf32x3_split_b")
              for cfg in matmul.TMA_SPLIT_CONFIGS[:1 if quick else None]]
    cases += [("bf16", "ieee narrow", a_t, b_t, cfg) for a_t, b_t in ((False, False), (True, True))
              for cfg in matmul.TMA_NARROW_CONFIGS[2][:1 if quick else None]]
    cases += [("fp32", p + " narrow", False, True, dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], k_max)))
              for p, k_max in (("tf32x3", 32), ("tf32_rounded", 256))
              for cfg in matmul.TMA_NARROW_CONFIGS[4][:1 if quick else None]]
    for dtype, precision, a_t, b_t, cfg in cases:
        if match and match not in f"{dtype} {precision}":
            continue
        tiles = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages", "OCC")}
        constexprs = dict(A_T=a_t, B_T=b_t, HAS_BIAS=True, ACT="gelu", STORE_Z=True, PRECISION=precision.split()[0],
                          GROUP_M=8, NUM_PROGRAMS=132, C_PTR=False, **tiles)
        pointers = dict.fromkeys(("a_ptr", "b_ptr", "c_ptr", "bias_ptr", "z_ptr"), dtype)
        report(f"mm_tma {dtype} {precision} A_T={a_t} B_T={b_t} {config_name(cfg)}",
               lambda: compiled(matmul_kernels.mm_tma_kernel, pointers, constexprs, cfg))
    # K split (`matmul_configs.tma_split_configs`: the first TMA_SPLIT_TILES tiles): fp32 partials through pointers
    split_cases = [("bf16", "ieee", cfg) for cfg in matmul.TMA_CONFIGS[2][:matmul_configs.TMA_SPLIT_TILES]]
    split_cases += [("fp32", p, cfg) for p, configs in (("tf32_rounded", matmul.TMA_CONFIGS[4]),
                                                        ("tf32x3_split", matmul.TMA_SPLIT_CONFIGS))
                    for cfg in configs[:matmul_configs.TMA_SPLIT_TILES]]
    split_cases += [("bf16", "ieee", cfg) for cfg in matmul.TMA_NARROW_CONFIGS[2]]
    for dtype, precision, cfg in split_cases[:: 3 if quick else 1]:
        if match and match not in f"{dtype} {precision} split":
            continue
        tiles = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages", "OCC")}
        constexprs = dict(A_T=False, B_T=True, HAS_BIAS=False, ACT="none", STORE_Z=False, PRECISION=precision,
                          GROUP_M=8, NUM_PROGRAMS=132, C_PTR=True, SPLIT_K=4, **tiles)
        pointers = dict.fromkeys(("a_ptr", "b_ptr", "bias_ptr", "z_ptr"), dtype) | {"c_ptr": "fp32"}
        report(f"mm_tma {dtype} {precision} split 4 {config_name(cfg)}",
               lambda: compiled(matmul_kernels.mm_tma_kernel, pointers, constexprs, cfg))


def depthwise_cases(quick: bool):
    pointers = dict.fromkeys(("x_ptr", "w_ptr", "y_ptr", "bias_ptr", "z_ptr", "r_ptr"), "bf16")
    for stride, cfg in itertools.product((1, 2), depthwise.WALK_FWD_CONFIGS[:1 if quick else None]):
        tiles = {k: v for k, v in cfg.items() if k != "num_warps"}
        constexprs = dict(STRIDE_H=stride, STRIDE_W=stride, PAD_H=1, PAD_W=1, HAS_BIAS=True, HAS_RES=False,
                          ACT="none", STORE_Z=False, **tiles)
        report(f"dw3 walk bf16 stride {stride} {tiles}",
               lambda: compiled(depthwise._conv_dw3_fwd_kernel, pointers, constexprs, cfg))
    pointers = dict.fromkeys(("dz_ptr", "w_ptr", "dx_ptr"), "bf16")
    for cfg in depthwise.DGRAD_CONFIGS[:1 if quick else None]:
        tiles = {k: v for k, v in cfg.items() if k != "num_warps"}
        constexprs = dict(STRIDE_H=2, STRIDE_W=2, PAD_H=1, PAD_W=1, DIL_H=1, DIL_W=1, KH=3, KW=3, **tiles)
        report(f"dw dgrad bf16 stride 2 {tiles}",
               lambda: compiled(depthwise._conv_dw_dgrad_kernel, pointers, constexprs, cfg))


def conv_tma_cases(quick: bool):
    """conv2d's TMA forward (a 3x3 of stride 1, bias and ReLU) whole and split along K (`tma.split_configs`:
    fp32 partials by pointers), and the split's sum with the epilogue."""
    pointers = dict.fromkeys(("x_ptr", "w_ptr", "y_ptr", "bias_ptr", "z_ptr", "r_ptr"), "bf16")
    for cfg, splits in itertools.product(conv_tma.FWD_CONFIGS[:1 if quick else conv_tma.SPLIT_TILES], (1, 4)):
        tiles = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages", "OCC")}
        constexprs = dict(STRIDE_H=1, STRIDE_W=1, PAD_H=1, PAD_W=1, DIL_H=1, DIL_W=1, KH=3, KW=3, PRECISION="ieee",
                          HAS_BIAS=splits == 1, HAS_RES=False, ACT="relu" if splits == 1 else "none", STORE_Z=False,
                          SPLIT_K=splits, **tiles)
        report(f"conv tma fwd bf16 split {splits} {tiles}",
               lambda: compiled(conv_tma._conv_fwd_tma_kernel, dict(pointers, y_ptr="fp32" if splits > 1 else "bf16"),
                                constexprs, cfg))
    report("conv tma split sum bf16", lambda: compiled(
        conv_tma._conv_split_sum_kernel, dict(pointers, part_ptr="fp32"),
        dict(SPLITS=4, HAS_BIAS=True, HAS_RES=True, ACT="relu", STORE_Z=False, BLOCK_P=64, BLOCK_N=64),
        dict(num_warps=4)))


def attention_cases():
    """The attention kernels with a float mask (natural units: fp32 takes `natural_exp`'s corrected exponent)."""
    for dtype, precision in (("fp32", "tf32x3"), ("fp32", "ieee"), ("bf16", "ieee")):
        pointers = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr"), dtype)
        pointers.update(mask_ptr=dtype, ranges_ptr="i32", stats_ptr="fp32", delta_ptr="fp32")
        common = dict(MASK="float", CAUSAL=False, PRECISION=precision, TMA=False, HEAD_DIM=64, BLOCK_D=64,
                      BLOCK_M=64, BLOCK_N=64, CHUNK=32 if precision == "tf32x3" else 0, RANGE_ROWS=64)
        floats = ("qk_scale", "sm_scale")
        for kernel, extra in ((attention_kernels.fwd_kernel, dict(FOLD=True)), (attention_kernels.dkdv_kernel, {}),
                              (attention_kernels.dq_kernel, {}), (attention_kernels.dq_kernel, dict(DELTA=True))):
            report(f"attention {kernel.fn.__name__} {dtype} {precision} float mask {extra}",
                   lambda: compiled(kernel, pointers, dict(common, **extra), dict(num_warps=4, num_stages=2), floats))
        for head_dim in (64, 256):  # (the chunked fp32 sums' loop unrolled took 290-377 KB at 256)
            decode = dict(GROUP=4, HEAD_DIM=head_dim, MASK="float", PRECISION=precision, BLOCK_G=16, BLOCK_N=64,
                          BLOCK_D=head_dim, CHUNK=32 if dtype == "fp32" else 0)
            report(f"attention decode split {dtype} {precision} float mask head dim {head_dim}",
                   lambda: compiled(attention_decode._split_kernel, dict(pointers, part_ptr="fp32"), decode,
                                    dict(num_warps=4 if head_dim <= 64 else 8), ("scale",)))
    report("attention decode combine fp32", lambda: compiled(
        attention_decode._combine_kernel, dict(part_ptr="fp32", stats_ptr="fp32", o_ptr="fp32"),
        dict(HEAD_DIM=64, BLOCK_S=16, BLOCK_D=64), dict(num_warps=4)))


def swiglu_cases():
    """_swiglu_kernel in true fp32's FMAs, forward and backward: one token's one-row tiles (VECTOR_CONFIGS: tree
    sums over each K tile) and the first 16-row tile."""
    pointers = dict.fromkeys(("x_ptr", "g_ptr", "u_ptr", "h_ptr", "dh_ptr", "du_ptr", "zg_ptr", "zu_ptr"), "fp32")
    for cfg, backward in itertools.product(swiglu.VECTOR_CONFIGS + swiglu._CONFIGS[4][:1], (False, True)):
        tiles = {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}
        constexprs = dict(BACKWARD=backward, SAVE=False, SAVED=False, ACT="silu", PRECISION="ieee", SWAP=False,
                          GROUP_M=8, **tiles)
        report(f"swiglu fp32 ieee {'bwd' if backward else 'fwd'} {tiles}",
               lambda: compiled(swiglu._swiglu_kernel, pointers, constexprs, cfg))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--match", default="", help="only the matmul cases whose dtype and precision contain this")
    args = parser.parse_args()
    matmul_cases(args.quick, args.match)
    depthwise_cases(args.quick)
    conv_tma_cases(args.quick)
    attention_cases()
    swiglu_cases()


if __name__ == "__main__":
    main()
