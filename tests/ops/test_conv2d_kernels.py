"""dropin.ops.conv2d's kernels one by one: every config of every kernel forced through the planner, the candidates
each plan offers (depthwise's direct and walk kernels, the TMA kernels' passes), and the large GPU shapes; against
F.conv2d in float64 as test_conv2d.py checks."""
import pytest
import torch
import torch.nn.functional as F

import _check
import dropin
from _conv2d import check, dropin_conv, leaves, randn, torch_conv
from _tol import DEVICE, DTYPES, ON_GPU, assert_close, gpu, slow

from dropin import _runtime
from dropin.ops import _autotune
from dropin.ops.conv2d import depthwise, implicit_gemm, tma

cv = __import__("dropin.ops.conv2d", fromlist=["_plans"])

pytestmark = pytest.mark.usefixtures("true_fp32")  # conftest: cuDNN's TF32 default off; tests set it themselves


# ----------------------------------------------------------------------------------------- every config
def _configs():
    for name, cfgs in (("fwd", implicit_gemm.FWD_CONFIGS), ("dgrad", implicit_gemm.DGRAD_CONFIGS),
                       ("wgrad", implicit_gemm.WGRAD_CONFIGS)):
        for i, c in enumerate(cfgs):
            yield pytest.param(name, dict(c, KERNEL="gemm"), id=f"{name}-{i}")
    for name, cfgs in (("fwd", depthwise.FWD_CONFIGS), ("dgrad", depthwise.DGRAD_CONFIGS),
                       ("wgrad", depthwise.WGRAD_CONFIGS)):
        for i, c in enumerate(cfgs):
            yield pytest.param(name, dict(c, KERNEL="direct"), id=f"{name}-direct-{i}")
    for name, cfgs in (("fwd", tma.FWD_CONFIGS), ("wgrad", tma.WGRAD_CONFIGS)):
        for i, c in enumerate(cfgs):
            yield pytest.param(name, dict(c, KERNEL="tma"), id=f"{name}-tma-{i}")
    for i, c in enumerate(implicit_gemm.ROWS_CONFIGS):
        yield pytest.param("fwd", dict(c, KERNEL="rows"), id=f"fwd-rows-{i}")
    for name, cfgs in (("fwd", depthwise.WALK_FWD_CONFIGS), ("wgrad", depthwise.WALK_WGRAD_CONFIGS)):
        for i, c in enumerate(cfgs):
            yield pytest.param(name, dict(c, KERNEL="walk"), id=f"{name}-walk-{i}")


@gpu
@pytest.mark.parametrize("cfg", tma.FWD_CONFIGS, ids=lambda c: f"{c['TH']}x{c['TW']}x{c['BLOCK_N']}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_tma_forward_resnet_shapes(dtype, cfg, monkeypatch):
    """Each TMA tile on ResNet-50's 3x3 shapes (8 images): vs float64 and the 2x rule."""
    monkeypatch.setattr(_autotune, "pick", lambda name, key, configs, prepare, **timing: dict(cfg, KERNEL="tma"))
    _check.replan(cv)
    try:
        for c, hw, s in ((64, 56, 1), (256, 14, 1), (512, 7, 1), (128, 56, 2)):
            x = torch.randn(8, c, hw, hw, device=DEVICE, dtype=dtype).to(memory_format=torch.channels_last)
            w = (torch.randn(c, c, 3, 3, device=DEVICE, dtype=dtype) / (9 * c) ** 0.5).to(
                memory_format=torch.channels_last)
            b = torch.randn(c, device=DEVICE, dtype=dtype)
            ref = F.conv2d(x.cpu().double(), w.cpu().double(), b.cpu().double(), s, 1).to(DEVICE)
            assert_close(dropin.conv2d(x, w, b, s, 1), ref, dtype, "fwd", torch_out=F.conv2d(x, w, b, s, 1),
                         what=f"{c} channels at {hw}x{hw}, stride {s}")
    finally:
        _check.replan(cv)


def _forced_tile(which: str, cfg: dict):
    """A pick that takes, for the `which` pass, the TMA candidate of cfg's tile (as offered: its stages cut to the
    shared memory), and the first candidate elsewhere."""
    def pick(name, key, configs, prepare, **timing):
        if key[0] != which:
            return configs[0]
        return next(c for c in configs if c["KERNEL"].startswith("tma")
                    and dict(c, num_stages=0, KERNEL=0) == dict(cfg, num_stages=0, KERNEL=0))
    return pick


@pytest.mark.parametrize("splits", [3, 4])
def test_tma_split_forward(splits, monkeypatch):
    """The TMA forward with K split (`tma.split_configs`' variants, forced; the interpreter runs it on the CPU):
    6 (tap, channel block) steps in 3 splits and in 4 (the last past every step: zeros), fp32 partials summed with
    the bias, an NCHW residual and ReLU by `_conv_split_sum_kernel`; strides 1 and 2, fp16, channels_last x (the
    direct TMA forward) and NCHW x (the staged one, over a channels_last copy); the output and the gradients
    against float64 (the backward's passes as tuned)."""
    cfg, real_pick = tma.FWD_CONFIGS[2], _autotune.pick  # (8 x 8 pixels, 64 channels a tile and a step)

    def pick(name, key, configs, prepare, **timing):
        if key[0] != "fwd":
            return real_pick(name, key, configs, prepare, **timing)
        base = next(c for c in configs if c["KERNEL"].startswith("tma")
                    and dict(c, num_stages=0, KERNEL=0) == dict(cfg, num_stages=0, KERNEL=0))
        return dict(base, SPLIT_K=splits)
    monkeypatch.setattr(_autotune, "pick", pick)
    monkeypatch.setattr(_runtime, "is_hopper", lambda index=0: True)
    _check.replan(cv)
    try:
        for x_shape, stride, channels_last in (((2, 64, 9, 11), 1, True), ((2, 64, 10, 12), (2, 2), True),
                                               ((2, 64, 9, 11), 1, False)):
            kw = dict(stride=stride, padding=(1, 0))
            inputs = leaves(x_shape, (24, 64, 3, 2), dtype=torch.float16, channels_last=channels_last,
                            weight_channels_last=channels_last)
            inputs["r"] = torch.randn(F.conv2d(inputs["x"], inputs["w"], **kw).shape, device=DEVICE,
                                      dtype=torch.float16)
            check(lambda x, w, b, r: dropin.conv2d(x, w, b, activation="relu", residual=r, **kw),
                  lambda x, w, b, r: F.relu(F.conv2d(x, w, b, **kw) + r), inputs)
    finally:
        _check.replan(cv)


def test_tma_split_candidates(monkeypatch):
    """K splits are offered (`tma.split_configs`) where the TMA forward's tiles fill fewer than half the SMs:
    ResNet-50's 3x3 of 512 channels at 7 x 7, batch 8 (64 tiles of 64 channels: 2 and 4 splits; 32 of 128: 4
    and 8; the first three candidates' tiles), not at batch 64."""
    monkeypatch.setattr(_runtime, "num_sms", lambda index=0: 132)
    configs = [dict(c, KERNEL="tma") for c in tma.FWD_CONFIGS]
    small = tma.split_configs(configs, (8, 512, 7, 7, 512, 7, 7, 3, 3), 0)
    assert [(c["TH"] * c["TW"], c["BLOCK_N"], c["SPLIT_K"]) for c in small] == [
        (128, 64, 2), (128, 64, 4), (64, 128, 4), (64, 128, 8), (64, 64, 2), (64, 64, 4)], small
    assert all(c["KERNEL"] == "tma" for c in small)
    assert not tma.split_configs(configs, (64, 512, 7, 7, 512, 7, 7, 3, 3), 0)


ROW_IDS = lambda c: f"1x{c['TW']}-{c.get('BLOCK_N')}-{c['num_warps']}w-occ{c['OCC']}"  # noqa: E731


@gpu
@pytest.mark.parametrize("cfg", tma.rows(tma.FWD_CONFIGS, torch.empty(1, 1, 1, 1)), ids=ROW_IDS)
def test_tma_row_tiles_forward_of_conv1d(cfg, monkeypatch):
    """An input one pixel high (conv1d's views) takes rows of TH * TW pixels (`tma.rows`): each forward row tile on
    Whisper's second conv (kernel 3, stride 2, padding 1, GELU; 64 channels, 600 -> 300 positions), bf16, the input
    NCL and NLC, against float64 and the 2x rule."""
    monkeypatch.setattr(_autotune, "pick", _forced_tile("fwd", cfg))
    w = torch.randn(64, 64, 3, device=DEVICE, dtype=torch.bfloat16) / 192 ** 0.5
    b = torch.randn(64, device=DEVICE, dtype=torch.bfloat16)
    try:
        for x in (torch.randn(2, 64, 600, device=DEVICE, dtype=torch.bfloat16),
                  torch.randn(2, 600, 64, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)):
            _check.replan(cv)
            ref = F.gelu(F.conv1d(x.cpu().double(), w.cpu().double(), b.cpu().double(), 2, 1)).to(DEVICE)
            assert_close(dropin.ops.conv1d(x, w, b, 2, 1, activation="gelu"), ref, torch.bfloat16, "fwd",
                         torch_out=F.gelu(F.conv1d(x, w, b, 2, 1)), what=f"x strides {x.stride()}")
    finally:
        _check.replan(cv)


@gpu
@pytest.mark.parametrize("cfg", tma.rows(tma.WGRAD_CONFIGS, torch.empty(1, 1, 1, 1)), ids=ROW_IDS)
def test_tma_row_tiles_weight_gradient_of_conv1d(cfg, monkeypatch):
    """Each weight-gradient row tile (`tma.rows`; bf16 keeps its 128 pixels) on an NLC conv1d (kernel 3, stride 2,
    padding 1; 128 channels, that every tile's channel block divides, as a column stride over 1 asks; 600 -> 300
    positions), whose output and gradient are channels_last too, bf16, against float64 and the 2x rule."""
    monkeypatch.setattr(_autotune, "pick", _forced_tile("wgrad", cfg))
    x = torch.randn(2, 600, 128, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
    w = torch.randn(128, 128, 3, device=DEVICE, dtype=torch.bfloat16) / 384 ** 0.5
    _check.replan(cv)
    try:
        leaf = w.clone().requires_grad_()
        y = dropin.ops.conv1d(x, leaf, None, 2, 1)
        grad = torch.randn_like(y)
        (dw,) = torch.autograd.grad(y, leaf, grad)
    finally:
        _check.replan(cv)
    w64 = w.cpu().double().requires_grad_()
    (ref,) = torch.autograd.grad(F.conv1d(x.cpu().double(), w64, None, 2, 1), w64, grad.cpu().double())
    torch_leaf = w.clone().requires_grad_()
    (torch_dw,) = torch.autograd.grad(F.conv1d(x, torch_leaf, None, 2, 1), torch_leaf, grad)
    assert_close(dw, ref.to(DEVICE), torch.bfloat16, "bwd", torch_out=torch_dw, what="weight gradient")


@slow
@pytest.mark.parametrize("which,cfg", list(_configs()))
def test_every_config(which, cfg, monkeypatch):
    """The tuner is bypassed: each candidate (clamped to the problem as the plan clamps it) runs on ragged
    edges with stride, padding, dilation, groups, bias and activation."""
    real_pick = _autotune.pick

    def pick(name, key, configs, prepare, **timing):
        if key[0] == which and cfg["KERNEL"] == "tma":  # as offered: stages cut to the shared memory (planning.staged)
            return next(c for c in configs if dict(c, num_stages=0) == dict(cfg, num_stages=0))
        if key[0] == which and cfg["KERNEL"] == "gemm":  # unclamped (tiles larger than the problem are masked),
            return implicit_gemm.gemm_staged([cfg], 4)[0]  # stages cut to the shared memory as offered (fp32 leaves)
        if key[0] == which:
            return dict(cfg)
        return real_pick(name, key, configs, prepare, **timing)

    monkeypatch.setattr(_autotune, "pick", pick)
    if cfg["KERNEL"] == "tma":  # offered on any device: the interpreter runs it on the CPU
        monkeypatch.setattr(_runtime, "is_hopper", lambda index=0: True)
    _check.replan(cv)
    try:
        if cfg.get("KERNEL") == "tma":  # one group, channels_last x and w; an NCHW residual (fwd or wgrad)
            # stride 1 with channels past C in a box (32 of 64), then strides 2 and 3 (x viewed by phase)
            for x_shape, stride in (((2, 32, 9, 11), 1), ((2, 64, 10, 12), (2, 2)), ((1, 64, 9, 8), (3, 2))):
                if stride != 1 and x_shape[1] % cfg.get("BLOCK_K", cfg["BLOCK_N"]):
                    continue  # tma.fwd_configs / tma.wgrad_configs offer no such config there
                kw = dict(stride=stride, padding=(1, 2), dilation=(1, 2))
                inputs = leaves(x_shape, (24, x_shape[1], 3, 2), dtype=torch.float16, channels_last=True,
                                weight_channels_last=True)  # (fp32 cuts the 128 x 128 weight-gradient tiles)
                inputs["r"] = torch.randn(F.conv2d(inputs["x"], inputs["w"], **kw).shape, device=DEVICE,
                                          dtype=torch.float16)
                check(lambda x, w, b, r: dropin.conv2d(x, w, b, activation="relu", residual=r, **kw),
                      lambda x, w, b, r: F.relu(F.conv2d(x, w, b, **kw) + r), inputs)
            return
        if cfg.get("KERNEL") == "rows":  # fewer than 16 channels a group, over a padded copy of x
            # a stem (3 channels, 7x7, stride 2, channels_last: 28-column rows padded to 32, ragged last tile);
            # 2 groups of 3 channels, NCHW, dilation and asymmetric padding with a residual; 9 channels a group
            # in a 1x9 row (9 x 16 columns: chunked where BLOCK_K is shorter)
            for x_shape, w_shape, kw, channels_last in (
                    ((2, 3, 19, 17), (16, 3, 7, 7), dict(stride=2, padding=3), True),
                    ((2, 6, 11, 13), (10, 3, 3, 2), dict(stride=(1, 2), padding=(2, 1), dilation=(2, 3), groups=2),
                     False),
                    ((1, 9, 5, 12), (4, 9, 1, 9), dict(padding=(0, 4)), True)):
                inputs = leaves(x_shape, w_shape, channels_last=channels_last, dtype=torch.float16)  # (fp32: stages
                inputs["r"] = torch.randn(F.conv2d(inputs["x"], inputs["w"], **kw).shape, device=DEVICE,  # are cut)
                                          dtype=torch.float16)
                check(lambda x, w, b, r: dropin.conv2d(x, w, b, activation="relu", residual=r, **kw),
                      lambda x, w, b, r: F.relu(F.conv2d(x, w, b, **kw) + r), inputs)
            return
        if cfg.get("KERNEL") == "walk":  # depthwise 3x3, the forward's or the weight gradient's walk forced:
            # multiplier 2, strides (2, 1), padding past the kernel's reach across, silu; strides (1, 2),
            # channels_last, 13 rows (ragged row tiles), relu (whose gradient keeps the output's layout in torch,
            # silu's the upstream's); both with an NCHW residual
            for x_shape, w_shape, kw, act, channels_last in (
                    ((2, 40, 17, 9), (80, 1, 3, 3), dict(stride=(2, 1), padding=(1, 3), groups=40), "silu", False),
                    ((1, 24, 13, 10), (24, 1, 3, 3), dict(stride=(1, 2), padding=(2, 0), groups=24), "relu", True)):
                inputs = leaves(x_shape, w_shape, channels_last=channels_last)
                inputs["r"] = torch.randn(F.conv2d(inputs["x"], inputs["w"], **kw).shape, device=DEVICE)
                check(lambda x, w, b, r: dropin.conv2d(x, w, b, activation=act, residual=r, **kw),
                      lambda x, w, b, r: getattr(F, act)(F.conv2d(x, w, b, **kw) + r), inputs)
            return
        if cfg.get("KERNEL") == "direct":  # depthwise, channel multiplier 2: 40 channels, 80 outputs
            kw = dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=40)
            check(dropin_conv("silu", **kw), torch_conv("silu", **kw), leaves((2, 40, 17, 9), (80, 1, 3, 2)))
            return
        # 40 input and 36 output channels over 2 groups: 20 / 18 per group, neither a multiple of 16;
        # wgrad reduces over 2*9*7 = 126 pixels, split up to 64 ways by the split configs; NCHW and
        # channels_last (whose wgrad columns run over channels first), there also 64 channels a group (a
        # column tile of 64 within one tap); the input gradient's phases: strides 3 x 2 with dilations 2 x 3
        # (taps a stride apart), and a 2x2 kernel at stride 3 (pixels that no tap reaches: zeros)
        kw = dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)
        for x_shape, w_shape, channels_last, kw in (
                ((2, 40, 17, 9), (36, 20, 3, 2), False, kw),
                ((2, 40, 17, 9), (36, 20, 3, 2), True, kw),
                ((2, 128, 17, 9), (36, 64, 3, 2), True, kw),
                ((2, 40, 16, 11), (36, 20, 3, 2), False, dict(stride=(3, 2), padding=(2, 0), dilation=(2, 3),
                                                              groups=2)),
                ((1, 20, 11, 10), (18, 20, 2, 2), True, dict(stride=3))):
            check(dropin_conv("silu", **kw), torch_conv("silu", **kw),
                  leaves(x_shape, w_shape, channels_last=channels_last))
    finally:
        _check.replan(cv)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [((64, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1),
                                   ((32, 256, 14, 14), (256, 1, 3, 3), 1, 1, 256),
                                   ((16, 3, 224, 224), (64, 3, 7, 7), 2, 3, 1)],
                         ids=["resnet-3x3", "depthwise-3x3", "stem-7x7"])
def test_large_gpu(shape, dtype):
    x_shape, w_shape, stride, padding, groups = shape
    kw = dict(stride=stride, padding=padding, groups=groups)
    check(dropin_conv(**kw), torch_conv(**kw), leaves(x_shape, w_shape, dtype=dtype, channels_last=True))


def _seen_candidates(monkeypatch, first=False) -> dict:
    """pass name -> the kernels of its candidates, in order, for each plan made from now on; with `first`,
    each plan takes its first candidate (the untuned default) on the GPU too."""
    seen = {}
    real_pick = _autotune.pick

    def pick(name, key, configs, prepare, **timing):
        seen[key[0]] = [c["KERNEL"] for c in configs]
        return configs[0] if first else real_pick(name, key, configs, prepare, **timing)

    monkeypatch.setattr(_autotune, "pick", pick)
    _check.replan(cv)
    return seen


def test_depthwise_plan_offers_direct_kernel(monkeypatch):
    """One input channel per group: in every pass (forward, input and weight gradient) the direct kernel leads
    the candidates (the untuned default), the implicit GEMM follows, and in a 3x3 forward or weight gradient of
    dilation 1 and row stride 1 or 2 the walk comes first; a 3x3 of stride 1 takes its input gradient as a
    forward (the walk's), no input gradient plan of its own. With several input channels per group only the
    implicit GEMM is offered (in the forward, few channels a group: the rows kernel's GEMM)."""
    try:
        for w_shape, groups, dilation, fwd, dgrad, wgrad in (
                ((4, 1, 3, 3), 4, 1, ["walk", "direct", "rows"], None, ["walk", "direct", "gemm"]),
                ((4, 1, 3, 3), 4, 2, ["direct", "rows"], ["direct", "gemm"], ["direct", "gemm"]),
                ((4, 1, 3, 2), 4, 1, ["direct", "rows"], ["direct", "gemm"], ["direct", "gemm"]),
                ((4, 2, 3, 3), 2, 1, ["rows"], ["gemm"], ["gemm"])):
            seen = _seen_candidates(monkeypatch)
            x, w = randn(1, 4, 6, 6).requires_grad_(), randn(*w_shape).requires_grad_()
            dropin.conv2d(x, w, groups=groups, dilation=dilation).sum().backward()
            passes = {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad}
            assert {k: sorted(set(v), key=v.index) for k, v in seen.items()} == \
                {k: v for k, v in passes.items() if v is not None}
    finally:
        _check.replan(cv)


DEPTHWISE = {  # id: (x shape, multiplier, kernel, stride, padding, dilation, channels_last, dtype)
    "m1-s1-cl-fp32": ((2, 24, 9, 7), 1, (3, 3), 1, 1, 1, True, torch.float32),
    "m2-s2-nchw-fp16": ((2, 12, 11, 9), 2, (3, 3), 2, 1, 1, False, torch.float16),
    "m1-s2-d2-cl-fp16": ((1, 20, 13, 10), 1, (3, 3), 2, 2, 2, True, torch.float16),
    "m2-s21-d12-k35-cl-fp32": ((2, 10, 9, 11), 2, (3, 5), (2, 1), (1, 2), (1, 2), True, torch.float32),
    "m1-s1-nchw-bf16": ((2, 16, 7, 9), 1, (3, 3), 1, 1, 1, False, torch.bfloat16),
    "m3-s1-cl-fp32": ((2, 3, 12, 10), 3, (3, 3), 1, 1, 1, True, torch.float32),
    "m1-s1-wide-cl-fp16": ((1, 8, 5, 37), 1, (3, 3), 1, 1, 1, True, torch.float16),  # 3 tile columns, ragged
}  # long fp32 weight-gradient sums (20000 pixels) through the direct kernel: test_seed003_single_channel_3x3


@pytest.mark.parametrize("case", list(DEPTHWISE))
def test_depthwise_direct(case, monkeypatch):
    """The direct depthwise kernels (the untuned default of every pass, forced; in the forward and the weight
    gradient of a 3x3 of dilation 1 and row stride 1 or 2, the walks) against torch: channel multipliers, strides,
    dilations, odd sizes, NCHW and channels_last, each dtype."""
    x_shape, mult, kernel, stride, padding, dilation, channels_last, dtype = DEPTHWISE[case]
    c = x_shape[1]
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=c)
    seen = _seen_candidates(monkeypatch, first=True)
    try:
        check(dropin_conv(**kw), torch_conv(**kw), leaves(x_shape, (c * mult, 1, *kernel), dtype=dtype,
                                                          channels_last=channels_last))
        walk = kernel == (3, 3) and dilation == 1 and stride in (1, 2, (2, 1))
        first = {"fwd": "walk" if walk else "direct", "dgrad": "direct", "wgrad": "walk" if walk else "direct"}
        if walk and stride == 1 and mult == 1:  # the input gradient as the walk's forward over dz
            del first["dgrad"]
        assert {k: v[0] for k, v in seen.items()} == first
    finally:
        _check.replan(cv)


@pytest.mark.parametrize("padding", [0, 2, (2, 0)], ids=["p0", "p2", "p20"])
def test_depthwise_3x3_input_gradient_as_walk(padding):
    """A stride-1 depthwise 3x3 takes its input gradient as the walk over dz with the taps mirrored and padding
    2 - padding: each padding it takes; x channels_last, and x NCHW under a channels_last weight with the
    upstream gradient in the output's layout (dz channels_last: the gradient comes back in x's layout)."""
    kw = dict(padding=padding, groups=16)
    for channels_last in (True, False):
        inputs = leaves((2, 16, 7, 9), (16, 1, 3, 3), channels_last=channels_last,
                        weight_channels_last=not channels_last)
        _check.check(dropin_conv(**kw), torch_conv(**kw), inputs, grad_layout="input")


@pytest.mark.parametrize("stride", [1, 2])
def test_depthwise_3x3_weight_gradient_inf_rows(stride):
    """The walk's weight gradient adds no dz row past the output (its zeros times an input row: 0 * inf): an inf
    in one of the last input rows, which only some taps reach, leaves the other taps finite (stride 1, no padding:
    row H - 2 in channel 0 is no tap 0's, row H - 1 in channel 1 no tap 0's or 1's; stride 2, even H: row H - 1 is
    no tap's). OH is 17 at both strides: two tiles of 9 rows (_walk_rows), the second reaching past it."""
    inputs = leaves((2, 8, 19 if stride == 1 else 36, 6), (8, 1, 3, 3), bias=False, channels_last=True)
    if stride == 1:
        inputs["x"][:, 0, -2, 4] = inputs["x"][:, 1, -1, 4] = float("inf")
    else:
        inputs["x"][:, :, -1, 4] = float("inf")
    kw = dict(stride=stride, groups=8)
    _check.check(dropin_conv(**kw), torch_conv(**kw), inputs, upstream_contiguous=True)


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_depthwise_weight_changed(trainable, monkeypatch):
    """The direct forward reads a frozen weight (requires_grad off) as a copy with the output channel innermost
    (_co_major), kept while the weight lives: an in-place change of the weight, or new data under it, must reach
    the next call. A trainable one (whose copy would be made on every call) it reads where it lies, no copy: in a
    channels_last layout too."""
    made = []
    real_derived = depthwise.derived
    monkeypatch.setattr(depthwise, "derived", lambda w, kind, make, traced: real_derived(
        w, kind, lambda w: made.append(kind) or make(w), traced))
    x = torch.randn(2, 16, 9, 7, device=DEVICE).to(memory_format=torch.channels_last)
    w = torch.nn.Parameter(torch.randn(16, 1, 3, 5, device=DEVICE), requires_grad=trainable)  # (3x5: the direct)
    if trainable:
        w.data = w.data.to(memory_format=torch.channels_last)
    for change in (lambda: w.mul_(-0.5).add_(1.0), lambda: setattr(w, "data", torch.randn_like(w)), None):
        ref = F.conv2d(x.double(), w.double(), padding=(1, 2), groups=16)
        with torch.no_grad():
            assert_close(dropin.conv2d(x, w, padding=(1, 2), groups=16), ref, torch.float32, "fwd",
                         what="depthwise")
            if change:
                change()
    assert made == ([] if trainable else ["co_major"] * 3), made


def test_direct_kernel_needs_int32_offsets():
    """The direct depthwise kernels address one image with int32 offsets: a tensor whose image spans 2^31
    elements or more is left to the implicit GEMM."""
    small = torch.empty((2, 8, 5, 5), device="meta")
    huge = torch.empty((2, 8, 5, 5), device="meta").as_strided((2, 8, 5, 5), (2**33, 1, 2**29, 8))
    assert depthwise.direct_fits(small, small) and not depthwise.direct_fits(small, huge)


@pytest.mark.parametrize("layout", ["nchw", "channels_last-tf32"])
def test_staged_tma_forward(layout, allow_tf32, monkeypatch):
    """The TMA forward over channels_last copies (tma.staged_fwd_launcher), forced on any device (the interpreter
    runs it on the CPU): x in NCHW with an NCHW weight, stride and dilation, bias, residual and activation, the
    last and the first staged config the plans offer; and on the GPU with TF32 allowed, where it takes
    channels_last x too and rounds both copies (the tf32 tolerance, the 2x rule against cuDNN's TF32). A
    parameter's copied weight is made once per version of its data."""
    tf32 = layout.endswith("tf32")
    if tf32 and not ON_GPU:
        pytest.skip("tf32 runs on the GPU only (the interpreter takes true fp32)")
    torch.backends.cudnn.allow_tf32 = tf32
    allow_tf32(tf32)
    monkeypatch.setattr(_runtime, "is_hopper", lambda index=0: True)
    made = []
    real_derived = tma.derived
    monkeypatch.setattr(tma, "derived", lambda w, kind, make, traced: real_derived(
        w, kind, lambda w: made.append(kind) or make(w), traced))
    offered = []

    def pick(name, key, candidates, prepare, **timing):  # the last staged config, then the first (a shape each)
        staged = [c for c in candidates if c["KERNEL"] == "tma-staged"]
        offered.append(len(staged))
        return staged[-(len(offered) % 2)]

    monkeypatch.setattr(_autotune, "pick", pick)
    _check.replan(cv)
    try:
        for x_shape, kw in (((2, 32, 9, 11), dict(padding=(1, 2), dilation=(1, 2))),
                            ((1, 64, 10, 12), dict(stride=2, padding=1))):
            x = torch.randn(x_shape, device=DEVICE)
            x = x.contiguous(memory_format=torch.channels_last) if tf32 else x
            w = torch.nn.Parameter(torch.randn(24, x_shape[1], 3, 2, device=DEVICE) / (6 * x_shape[1]) ** 0.5,
                                   requires_grad=False)
            b = torch.randn(24, device=DEVICE)
            r = torch.randn(F.conv2d(x, w, **kw).shape, device=DEVICE)
            ref = F.relu(F.conv2d(x.double(), w.double(), b.double(), **kw) + r.double())
            for _ in range(2):  # (the second call runs the plan the first made)
                with torch.no_grad():
                    out = dropin.conv2d(x, w, b, activation="relu", residual=r, **kw)
                assert_close(out, ref, torch.float32, "fwd", torch_out=F.relu(F.conv2d(x, w, b, **kw) + r),
                             what=f"{layout} {x_shape} {kw}")
                assert out.is_contiguous() == (not tf32)  # in x's layout
    finally:
        _check.replan(cv)
    assert len(offered) == 2 and min(offered) > 0, "the plan offered no staged TMA config"
    assert made == ["tma-tf32" if tf32 else "tma"] * 2  # once per weight, not per call


@pytest.mark.parametrize("kw", [dict(padding=1), dict(padding="same", dilation=2), dict(padding=(0, 2)),
                                dict(stride=2, padding=(1, 2))], ids=["p1", "same-d2", "p02", "s2"])
def test_backward_through_tma_kernels(kw, monkeypatch):
    """One group, channels_last, the TMA kernels forced on any device (the interpreter runs them on the CPU): the
    weight gradient by _conv_wgrad_tma_kernel (any stride dividing the image), and at stride 1 the input gradient
    as the stride-1 convolution of dz by the mirrored, transposed weight (tma.dgrad_as_conv); even kernel widths
    ('same' pads them asymmetrically), dilation. In true fp32 the weight gradient's pixel tiles (one truncating
    MMA chain each) hold at most 64 pixels: 128 gave 2x cuDNN's error on this short reduction (seed 266315595)."""
    monkeypatch.setattr(_runtime, "is_hopper", lambda index=0: True)
    kernels, tiles = [], []
    real_pick = _autotune.pick

    def pick(name, key, configs, prepare, **timing):
        kernels.append((key[0], configs[0]["KERNEL"]))
        tiles.extend(c["TH"] * c["TW"] for c in configs if key[0] == "wgrad" and c["KERNEL"] == "tma")
        return real_pick(name, key, configs, prepare, **timing)

    monkeypatch.setattr(_autotune, "pick", pick)
    _check.replan(cv)
    try:
        c = 64 if "stride" in kw else 16  # a column stride over 1 takes channel blocks (of 64) that divide C
        check(dropin_conv(**kw), torch_conv(**kw),
              leaves((2, c, 8, 10), (32, c, 3, 4), channels_last=True, weight_channels_last=True))
    finally:
        _check.replan(cv)
    dgrad = ("fwd", "tma") if "stride" not in kw else ("dgrad", "gemm")  # the input gradient's plan
    assert set(kernels) == {("fwd", "tma"), ("wgrad", "tma"), dgrad}
    assert tiles and max(tiles) <= 64
