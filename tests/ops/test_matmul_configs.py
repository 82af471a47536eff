"""Every candidate config of the matmul kernels is right, whatever the tuner picks.

The tuner is bypassed: each config of matmul_configs' `TMA_CONFIGS`, `TMA_NARROW_CONFIGS`, `PTR_CONFIGS`,
`SKINNY_CONFIGS` and `FMA_CONFIGS` (split-K ones included) is forced on operands with ragged edges, with bias,
activation and the saved pre-activation, in every operand layout.
Under the interpreter the TMA kernel runs too (tensor descriptors are emulated).
"""
import pytest
import torch

import _check
import dropin  # noqa: F401
from dropin.ops import _autotune, _gemm, matmul_configs
from dropin.ops.swiglu import swiglu_mlp_ref
from _tol import DEVICE, ON_GPU, assert_close, gpu, slow

mm = __import__("dropin.ops.matmul", fromlist=["_make_plan"])

_DTYPE = {2: torch.float16, 4: torch.float32}
CONFIGS = [pytest.param("tma", c, _DTYPE[size], id=f"tma-{size}B-{i}") for size, cs in mm.TMA_CONFIGS.items()
           for i, c in enumerate(cs)] + \
          [pytest.param("tma", c, _DTYPE[size], id=f"tma-narrow-{size}B-{i}")
           for size, cs in matmul_configs.TMA_NARROW_CONFIGS.items() for i, c in enumerate(cs)] + \
          [pytest.param("ptr", c, _DTYPE[size], id=f"ptr-{size}B-{i}") for size, cs in mm.PTR_CONFIGS.items()
           for i, c in enumerate(cs)] + \
          [pytest.param("skinny", c, torch.float16, id=f"skinny-{i}")
           for i, c in enumerate(matmul_configs.SKINNY_CONFIGS)] + \
          [pytest.param("fma", c, torch.float32, id=f"fma-{kind}-{i}") for kind, cs in mm.FMA_CONFIGS.items()
           for i, c in enumerate(cs)]  # the CUDA-core kernel in fp32, the strictest tolerance


@pytest.fixture
def forced(monkeypatch):
    """Makes the tuner return the given config for the next plans."""
    def force(cfg):
        monkeypatch.setattr(mm._autotune, "pick", lambda name, key, configs, run, **timing: cfg)
        _check.replan(mm)
    yield force
    _check.replan(mm)


@slow
@pytest.mark.parametrize("kernel,cfg,dtype", CONFIGS)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_every_config(kernel, cfg, dtype, layout, forced):
    if kernel == "tma" and not ON_GPU and cfg["BLOCK_M"] * cfg["BLOCK_N"] > 128 * 128:
        pytest.skip("large TMA tiles are slow under the interpreter; they run on the GPU")
    # every size a multiple of 8 (16-byte rows for TMA), none a multiple of a tile; the vector configs: M = 1;
    # the skinny kernel's: few rows, K long enough for its splits
    batch, M, N, K = 2, 1 if cfg["BLOCK_M"] == 1 else 88, 40, 72
    if kernel == "skinny":
        M, K = 13, 1048
    a = torch.randn(batch, M, K, dtype=dtype, device=DEVICE)
    b = torch.randn(batch, K, N, dtype=dtype, device=DEVICE)
    bias = torch.randn(N, dtype=dtype, device=DEVICE)
    aa = a.mT.contiguous().mT if layout[0] == "t" else a
    bb = b.mT.contiguous().mT if layout[1] == "t" else b
    forced(dict(cfg, KERNEL=kernel))
    c, z = mm.mm_impl(aa, bb, bias, "silu", True, tma=kernel == "tma")
    z_ref = torch.bmm(a.double(), b.double()) + bias.double()
    assert_close(z, z_ref, dtype, "fwd", what="pre-activation")
    assert_close(c, torch.nn.functional.silu(z_ref), dtype, "fwd", what="output")


def test_true_fp32_rule(monkeypatch):
    """Which true fp32 a product takes on the GPU: tf32x3 for reductions of at least TF32X3_MIN_K in products of at
    least TF32X3_MIN_MACS multiply-adds, FMAs otherwise (a [7, 7] weight gradient of 441 terms among them); tf32
    where torch allows it; the product's own sizes decide, batch included."""
    monkeypatch.setattr(_gemm._runtime, "INTERPRET", False)
    monkeypatch.setattr(_gemm._runtime, "tf32_allowed", lambda op: False)
    fp32, min_k, min_macs = torch.float32, _gemm.TF32X3_MIN_K, _gemm.TF32X3_MIN_MACS
    assert _gemm.precision(fp32, k=min_k, macs=min_macs) == "tf32x3" and _gemm.precision(fp32, k=min_k) == "tf32x3"
    assert _gemm.precision(fp32, k=min_k - 1, macs=1 << 40) == "ieee"
    assert _gemm.precision(fp32, k=441, macs=7 * 7 * 441) == "ieee"
    assert _gemm.precision(fp32, True, k=441, macs=7) == "tf32" and _gemm.precision(torch.bfloat16, k=441) == "ieee"
    chosen = [mm._operand_copies(torch.empty(batch, m, k), torch.empty(batch, k, n), False, False)[0]
              for batch, m, n, k in ((1, 7, 7, 441), (1, 256, 255, 256), (1, 256, 256, 256), (2, 128, 256, 256),
                                     (1, 50000, 10, 784))]
    assert chosen == ["ieee", "ieee", "tf32x3", "tf32x3", "tf32x3"]


def test_fma_chain(monkeypatch):
    """True fp32's FMA dots ("ieee": K under TF32X3_MIN_K) sum at most FMA_CHAIN terms in a chain: every candidate
    that fp32 products of matmul (wide and at most 16 columns, linear_cross_entropy's among them) and swiglu_mlp
    offer the tuner has BLOCK_K <= FMA_CHAIN (a fallback tile cut to it); one token's swiglu_mlp takes
    one-row tiles alone (their K tiles summed as trees: on constant rows, where a chain of FMAs went to 4x the fp32
    tolerance). The results match float64."""
    monkeypatch.setattr(_gemm._runtime, "tf32_allowed", lambda op: False)
    offered, pick = [], _autotune.pick
    monkeypatch.setattr(_autotune, "pick", lambda name, key, configs, prepare, **timing: (
        offered.append((name, configs)), pick(name, key, configs, prepare, **timing))[1])
    x = torch.randn(37, 67, device=DEVICE)
    for n in (29, 9):  # (9: the CUDA-core kernel's narrow candidates beside the tiles)
        w = torch.randn(n, 67, device=DEVICE)
        assert_close(dropin.ops.linear(x, w), x.double() @ w.double().T, torch.float32, "fwd", torch_out=x @ w.T)
    weights = [torch.randn(53, 67, device=DEVICE) / 8, torch.randn(53, 67, device=DEVICE) / 8,
               torch.randn(67, 53, device=DEVICE) / 8]
    assert_close(dropin.ops.swiglu_mlp(x, *weights), swiglu_mlp_ref(x.double(), *(w.double() for w in weights)),
                 torch.float32, "fwd", torch_out=swiglu_mlp_ref(x, *weights))
    hidden = torch.randn(11, 67, device=DEVICE, requires_grad=True)
    weight = torch.randn(41, 67, device=DEVICE, requires_grad=True)
    dropin.ops.linear_cross_entropy(hidden, weight, torch.randint(0, 41, (11,), device=DEVICE)).backward()
    assert weight.grad.isfinite().all()  # (its values: test_linear_cross_entropy)
    assert {name for name, _ in offered} >= {"matmul", "swiglu"}, offered
    long_k = [(name, c) for name, configs in offered for c in configs if c.get("BLOCK_K", 0) > _gemm.FMA_CHAIN
              and c.get("BLOCK_M") != 1]  # (the vector kernels' one-row tiles sum their K tile as a tree)
    assert not long_k, long_k
    assert _gemm.fits([_autotune.config(64, 64, 2 * _gemm.FMA_CHAIN, 4, 3)], 64, 64, 64, _gemm.FMA_CHAIN) == \
        [_autotune.config(64, 64, _gemm.FMA_CHAIN, 4, 3)]
    offered.clear()
    token = torch.randn(1, device=DEVICE).expand(33)  # (the fuzz suite's constant rows: one value each)
    weights = [torch.randn(1, 1, device=DEVICE).expand(33, 33) for _ in range(3)]
    torch_out = swiglu_mlp_ref(token, *weights, activation="gelu")
    out = dropin.ops.swiglu_mlp(token, *weights, activation="gelu")
    assert_close(out, swiglu_mlp_ref(token.double(), *(w.double() for w in weights), activation="gelu"),
                 torch.float32, "fwd", torch_out=torch_out)
    swiglu_tiles = [c for name, configs in offered if name == "swiglu" for c in configs]
    assert swiglu_tiles and all(c["BLOCK_M"] == 1 for c in swiglu_tiles), swiglu_tiles


ACCUMULATING = [  # (kernel, config, rows): each kernel's epilogue (split K's is the sum kernel's)
    pytest.param("tma", mm.TMA_CONFIGS[2][-1], 88, id="tma"),
    pytest.param("tma", dict(mm.TMA_CONFIGS[2][-1], EPILOGUE_SUBTILE=True), 88, id="tma-halves"),
    pytest.param("ptr", [c for c in mm.PTR_CONFIGS[2] if c.get("SPLIT_K", 1) == 1][-1], 13, id="ptr"),
    pytest.param("ptr", [c for c in mm.PTR_CONFIGS[2] if c.get("SPLIT_K", 1) > 1][-1], 88, id="ptr-split-k"),
    pytest.param("skinny", matmul_configs.SKINNY_CONFIGS[0], 13, id="skinny"),
    pytest.param("fma", mm.FMA_CONFIGS["narrow"][-1], 88, id="fma"),
] + [pytest.param("tma", c, 88, id=f"tma-{i}", marks=gpu)  # (every one the tuner times for the weight gradient)
     for i, c in enumerate(mm.TMA_CONFIGS[2] + mm.TMA_ROUNDED_CONFIGS[1:])
     if c["BLOCK_M"] * c["BLOCK_N"] <= mm.ACCUMULATE_MAX_TILE]


@pytest.mark.parametrize("kernel,cfg,rows", ACCUMULATING)
def test_accumulate_into(kernel, cfg, rows, forced):
    """mm_impl's accumulate_into (linear_cross_entropy's weight gradient over its chunks): C = what C held +
    act(A @ B + bias), rounded once, written into the given tensor, in each kernel's epilogue (forced), A
    transposed as the weight gradient reads it (rows a multiple of 8 where TMA reads it); a product into a new C of
    the same signature keeps its own plan. Against float64, and against torch's baddbmm of the same sum."""
    dtype, N, K = torch.float16, 16 if kernel == "fma" else 40, 1048 if kernel == "skinny" else 72
    a = torch.randn(2, K, rows, dtype=dtype, device=DEVICE).mT  # (A_T: K rows, unit stride along M)
    b = torch.randn(2, K, N, dtype=dtype, device=DEVICE)
    bias = torch.randn(N, dtype=dtype, device=DEVICE)
    old = torch.randn(2, rows, N, dtype=dtype, device=DEVICE)
    forced(dict(cfg, KERNEL=kernel))
    fresh = mm.mm_impl(a, b, bias, "silu", False, tma=kernel == "tma")[0]
    into = old.clone()
    c = mm.mm_impl(a, b, bias, "silu", False, tma=kernel == "tma", accumulate_into=into)[0]
    assert c is into
    product = torch.nn.functional.silu(torch.bmm(a.double(), b.double()) + bias.double())
    assert_close(fresh, product, dtype, "fwd", what="the product into a new C")
    assert_close(c, old.double() + product, dtype, "fwd", what="C accumulated",
                 torch_out=old + torch.nn.functional.silu(torch.baddbmm(bias, a, b)))


def test_accumulating_tiles_fit_shared_memory(monkeypatch):
    """An accumulating product (offered the TMA kernel, as on Hopper) is offered no tile past ACCUMULATE_MAX_TILE:
    the old tile's layout change takes shared memory, and 128 x 256 tiles then exceed sm_90's; the same product into
    a new C is offered them."""
    offered = {}
    monkeypatch.setattr(mm._runtime, "is_hopper", lambda index=0: True)
    monkeypatch.setattr(mm._autotune, "pick", lambda name, key, configs, prepare, **timing: offered.setdefault(
        "accumulate" in key, configs)[-1])
    _check.replan(mm)
    a = torch.randn(1, 512, 64, dtype=torch.float16, device=DEVICE)
    b = torch.randn(1, 64, 512, dtype=torch.float16, device=DEVICE)
    mm.mm_impl(a, b, None, "none", False)
    mm.mm_impl(a, b, None, "none", False, accumulate_into=torch.zeros(1, 512, 512, dtype=torch.float16,
                                                                      device=DEVICE))
    _check.replan(mm)
    tile = {k: max(c["BLOCK_M"] * c["BLOCK_N"] for c in configs if c["KERNEL"] == "tma")
            for k, configs in offered.items()}
    assert tile == {False: 128 * 256, True: mm.ACCUMULATE_MAX_TILE}, tile


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("layout", ["nn", "nt", "tn"])
def test_tma_split_k(dtype, layout, forced):
    """The TMA kernel with K split (SPLIT_K items per tile, fp32 partials summed by split_sum_kernel with the bias,
    activation and saved pre-activation), forced: 16 K tiles in 3 splits (6, 6, 4) and in 5 (4, 4, 4, 4 and one
    past the last K tile, whose partial is zeros); against float64, in each operand layout."""
    cfg = mm.TMA_CONFIGS[dtype.itemsize][5 if dtype == torch.float16 else 4]  # (64 x 64 tiles for the interpreter)
    batch, M, N = 2, 40, 24
    K = 16 * cfg["BLOCK_K"] - 24  # (the last K tile ragged)
    a = torch.randn(batch, M, K, dtype=dtype, device=DEVICE)
    b = torch.randn(batch, K, N, dtype=dtype, device=DEVICE)
    bias = torch.randn(N, dtype=dtype, device=DEVICE)
    aa = a.mT.contiguous().mT if layout[0] == "t" else a
    bb = b.mT.contiguous().mT if layout[1] == "t" else b
    z_ref = torch.bmm(a.double(), b.double()) + bias.double()
    for splits in (3, 5):
        forced(dict(cfg, KERNEL="tma", SPLIT_K=splits))
        c, z = mm.mm_impl(aa, bb, bias, "silu", True, tma=True)
        torch_z = torch.baddbmm(bias, a, b)
        assert_close(z, z_ref, dtype, "fwd", torch_out=torch_z, what=f"pre-activation, {splits} splits")
        assert_close(c, torch.nn.functional.silu(z_ref), dtype, "fwd", torch_out=torch.nn.functional.silu(torch_z),
                     what=f"output, {splits} splits")


def test_tma_split_candidates(monkeypatch):
    """Where the TMA kernel is offered K splits (`matmul_configs.tma_split_configs`): a product of fewer tiles than
    programs and a long K, about one and two (split, tile) items a program (64 SMs here: 128 x 256 tiles of a 1024 x
    1024 product, 32 of them, in 2 and 4 splits; the 128 x 128 tiles fill the SMs); a K past one accumulator's
    (ACC_K) split however many tiles there are, each split within it (16 x 16 @ 2^20 rows, narrow tiles: 64 and
    128 splits, over the 16 it needs); none for a short K."""
    monkeypatch.setattr(mm._runtime, "num_sms", lambda index=0: 64)
    fitting = _gemm.fits(mm.TMA_CONFIGS[2], 1024, 1024, 65536, 64, 64)
    wide = [c["SPLIT_K"] for c in matmul_configs.tma_split_configs(1, 1024, 1024, 65536, fitting, 0)]
    assert wide == [2, 4, 2, 4], wide
    fitting = _gemm.fits(matmul_configs.TMA_NARROW_CONFIGS[2], 16, 16, 2**20, 256, 64)
    deep = matmul_configs.tma_split_configs(1, 16, 16, 2**20, fitting, 0)
    assert [c["SPLIT_K"] for c in deep] == [64, 128] * 2 and all(c["KERNEL"] == "tma" for c in deep), deep
    cdiv = mm._runtime.cdiv
    assert all(cdiv(cdiv(2**20, c["BLOCK_K"]), c["SPLIT_K"]) * c["BLOCK_K"] <= _gemm.ACC_K.value for c in deep)
    assert not matmul_configs.tma_split_configs(1, 1024, 1024, 512, _gemm.fits(mm.TMA_CONFIGS[2], 1024, 1024, 512), 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_narrow_tma_tiles(dtype, monkeypatch):
    """A product of at most 16 columns is offered the TMA kernel's narrow tiles alone (`TMA_NARROW_CONFIGS`: 64 x
    16, where the others would multiply zero columns), K split where its tiles are fewer than the programs: the
    split candidate forced, 12 x 4104 @ 4104 x 16 on two SMs (A's rows past 12 and the last K tile ragged), against
    float64."""
    monkeypatch.setattr(mm._runtime, "num_sms", lambda index=0: 2)
    monkeypatch.setattr(mm._runtime, "is_hopper", lambda index=0: True)
    offered = []

    def pick(name, key, configs, prepare, **timing):
        offered.extend(configs)
        return next(c for c in configs if c["KERNEL"] == "tma" and c.get("SPLIT_K", 1) > 1)
    monkeypatch.setattr(mm._autotune, "pick", pick)
    a = torch.randn(1, 12, 4104, dtype=dtype, device=DEVICE)
    b = torch.randn(1, 4104, 16, dtype=dtype, device=DEVICE)
    _check.replan(mm)
    try:
        c = mm.mm_impl(a, b, None, "none", False)[0]
    finally:
        _check.replan(mm)
    tma = [c for c in offered if c["KERNEL"] == "tma"]
    assert tma and all(c["BLOCK_N"] == 16 for c in tma), tma
    assert_close(c, a.double() @ b.double(), dtype, "fwd", torch_out=a @ b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_matrix_vector_runs_transposed(dtype, monkeypatch):
    """A matrix-vector product (one column, A's rows K-contiguous, no bias) of at least VECTOR_MATRIX_MIN elements of
    A is planned as the vector-matrix product it transposes to (one row to the kernels), through the op and its
    eager shortcut; batched, with an activation and the saved pre-activation, against float64. With a bias, or A
    M-contiguous, it is planned as it comes."""
    monkeypatch.setattr(mm, "VECTOR_MATRIX_MIN", 70 * 40)
    planned, make_plan = [], mm._make_plan
    monkeypatch.setattr(mm, "_make_plan", lambda a, b, *rest: planned.append((a.shape[1], b.shape[2]))
                        or make_plan(a, b, *rest))
    a = torch.randn(2, 70, 40, dtype=dtype, device=DEVICE)
    b = torch.randn(2, 40, 1, dtype=dtype, device=DEVICE)
    z_ref = torch.bmm(a.double(), b.double())
    _check.replan(mm)
    try:
        c, z = mm.mm_impl(a, b, None, "silu", True)
        assert planned == [(1, 70)] and c.shape == (2, 70, 1) and c.is_contiguous()
        assert_close(z, z_ref, dtype, "fwd", torch_out=torch.bmm(a, b), what="pre-activation")
        assert_close(c, torch.nn.functional.silu(z_ref), dtype, "fwd", what="output")
        for _ in range(2):  # (the second call through the op's shortcut)
            y = dropin.ops.matmul(a[0], b[0])
            assert_close(y, z_ref[0], dtype, "fwd", torch_out=a[0] @ b[0], what="dropin.ops.matmul")
        assert all(shape == (1, 70) for shape in planned)
        planned.clear()
        mm.mm_impl(a, b, torch.randn(1, dtype=dtype, device=DEVICE), "none", False)
        mm.mm_impl(a.mT.contiguous().mT, b, None, "none", False)
        assert planned == [(70, 1)] * 2
    finally:
        _check.replan(mm)


@pytest.mark.parametrize("kernel", ["tma", "ptr"])
def test_tf32x3(kernel, monkeypatch):
    """True fp32 as three tf32 products (the GPU's default for fp32 without TF32): the split of each operand
    into rounded tf32 halves, with values across the exponent range, the largest finite ones, inf and nan."""
    monkeypatch.setattr(_gemm, "precision", lambda dtype, allow_tf32=None, k=None, macs=None: "tf32x3")
    _check.replan(mm)
    M, N, K = 40, 24, 72
    a = torch.randn(M, K, device=DEVICE) * torch.logspace(-30, 30, K, device=DEVICE)
    b = torch.randn(K, N, device=DEVICE) * torch.logspace(30, -30, K, device=DEVICE)[:, None]
    a[3, 5], a[7, 9], b[11, 2], b[4, 6] = 3.3e38, float("inf"), float("-inf"), float("nan")
    b[5, :], b[9, :] = 1e-30, 0.99999994  # inf * hi(1) + inf * lo(-2^-24): no nan from the small products
    c = mm.mm_impl(a[None], b[None], None, None, False, tma=kernel == "tma")[0][0]
    _check.replan(mm)
    assert_close(c, a.double() @ b.double(), torch.float32, "fwd", torch_out=a @ b)
