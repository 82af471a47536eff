"""conv2d's tensor-descriptor (TMA, Hopper) kernels for one group, x and w dense channels_last: the forward
`_conv_fwd_tma_kernel` (a tile of TH x TW output pixels of one image x output channels, one box of x per tap
and channel block, read through a view of x by stride phase so that the padding reads as zeros), the weight
gradient `_conv_wgrad_tma_kernel` (fp32 partials per split of the pixel tiles, summed), and the input gradient
of a stride-1 conv as the TMA forward of dz by the flipped weight (`dgrad_as_conv`)."""
import torch
import triton
import triton.language as tl

from ... import _runtime
from .. import _gemm
from .._dispatch import Launch, aligned, launch
from .._gemm import ACC_K, dot_acc, split_range
from .planning import WORKSPACE, conv_meta, geometry_meta, spatial_tiles, staged
from .tiles import epilogue
from .weights import derived


@triton.jit
def _tma_tile(tile, tiles_n, tiles_hw, tiles_w, TH: tl.constexpr, TW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Image, first output row and column, first output channel of the TMA kernels' tile `tile` (channel tiles
    innermost: programs running together share their x boxes through L2)."""
    pix = tile // tiles_n
    return pix // tiles_hw, (pix % tiles_hw) // tiles_w * TH, (pix % tiles_w) * TW, (tile % tiles_n) * BLOCK_N


@triton.jit
def _phase_desc(x_ptr, N, C, H, W, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, TH: tl.constexpr,
                TW: tl.constexpr, BLOCK_C: tl.constexpr):
    """A TMA descriptor of dense channels_last x viewed by stride phase, [N, H / STRIDE_H, STRIDE_H, W / STRIDE_W,
    STRIDE_W * C] (the caller checks that the strides divide H and W), boxes [1, TH, 1, TW, BLOCK_C]."""
    return tl.make_tensor_descriptor(x_ptr, shape=[N, H // STRIDE_H, STRIDE_H, W // STRIDE_W, STRIDE_W * C],
                                     strides=[tl.cast(H, tl.int64) * W * C, STRIDE_H * W * C, W * C, STRIDE_W * C, 1],
                                     block_shape=[1, TH, 1, TW, BLOCK_C])


@triton.jit
def _tap_box(x_desc, n, oh0, ow0, kh, kw, c0, C, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
             PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
             TH: tl.constexpr, TW: tl.constexpr, BLOCK_C: tl.constexpr):
    """[TH * TW, BLOCK_C]: what tap (kh, kw) reads for output pixels (oh0.., ow0..) of image n, channels c0..,
    through _phase_desc: input row STRIDE_H * oh + d is row oh + d // STRIDE_H of phase d % STRIDE_H, so the
    tap's pixels are one box of consecutive rows and columns of one phase; its parts outside the image read as
    zeros (the padding, without masks). d is shifted by STRIDE * PAD to stay >= 0 (integer division truncates)."""
    dh = kh * DIL_H + STRIDE_H * PAD_H - PAD_H
    dw = kw * DIL_W + STRIDE_W * PAD_W - PAD_W
    box = x_desc.load([n, oh0 + dh // STRIDE_H - PAD_H, dh % STRIDE_H, ow0 + dw // STRIDE_W - PAD_W,
                       dw % STRIDE_W * C + c0])
    return box.reshape(TH * TW, BLOCK_C)


@triton.jit
def _conv_fwd_tma_kernel(x_ptr, w_ptr, y_ptr, bias_ptr, z_ptr, r_ptr,
                         N, C, H, W, COUT, OH, OW, syn, syc, syh, syw, srn, src, srh, srw, programs,
                         STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr, PAD_W: tl.constexpr,
                         DIL_H: tl.constexpr, DIL_W: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr,
                         PRECISION: tl.constexpr,
                         TH: tl.constexpr, TW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SPLIT_K: tl.constexpr = 1):
    """_conv_fwd_kernel's result for one group, x and w dense channels_last (Hopper TMA): a tile is TH x TW
    output pixels of one image x BLOCK_N output channels; per (tap, channel block) one box of x and one
    [BLOCK_N, BLOCK_K] box of w viewed as [COUT, KH*KW*C] (_tap_box: the x box, by stride phase, the padding
    read as zeros). Channels past C read zeros where STRIDE_W is 1, so the w columns there (the next tap's) add
    nothing; with a larger STRIDE_W the caller takes BLOCK_K dividing C. `programs` programs walk the (image,
    pixel tile, channel tile) tiles in one flattened loop: persistent, as matmul's TMA kernel, where they are
    fewer than the tiles (a tile's loads start while the previous tile's epilogue runs), one tile each where
    they are as many (more programs resident per SM: measured faster on small images).
    SPLIT_K > 1 (fewer tiles than half the SMs: a small batch's late stages): the programs walk (split, tile)
    items, split s summing its share of the (tap, channel block) steps into fp32 partials, y_ptr then being
    [SPLIT_K, N, OH, OW, COUT] dense, that `_conv_split_sum_kernel` adds with the epilogue (none here)."""
    x_desc = _phase_desc(x_ptr, N, C, H, W, STRIDE_H, STRIDE_W, TH, TW, BLOCK_K)
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[COUT, KH * KW * C], strides=[KH * KW * C, 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    tiles_w = tl.cdiv(OW, TW)
    tiles_hw = tl.cdiv(OH, TH) * tiles_w
    tiles_n = tl.cdiv(COUT, BLOCK_N)
    c_blocks = tl.cdiv(C, BLOCK_K)
    steps = KH * KW * c_blocks
    tiles = N * tiles_hw * tiles_n
    tile_c = tl.program_id(0) - programs  # the epilogue's own counter keeps it out of the load pipeline
    for item in tl.range(tl.program_id(0), SPLIT_K * tiles, programs, flatten=True):
        if SPLIT_K == 1:
            tile = item
            first = 0
            last = steps
        else:
            tile = item % tiles
            first, last = split_range(item // tiles, SPLIT_K, steps)
        n, oh0, ow0, co0 = _tma_tile(tile, tiles_n, tiles_hw, tiles_w, TH, TW, BLOCK_N)
        acc = tl.zeros((TH * TW, BLOCK_N), dtype=tl.float32)
        for step in range(first, last):
            tap = step // c_blocks
            c0 = (step - tap * c_blocks) * BLOCK_K
            kh = tap // KW
            a = _tap_box(x_desc, n, oh0, ow0, kh, tap - kh * KW, c0, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H,
                         DIL_W, TH, TW, BLOCK_K)
            b = w_desc.load([co0, tap * C + c0])
            acc = dot_acc(acc, a, tl.trans(b), PRECISION)
        tile_c += programs
        if SPLIT_K == 1:
            n, oh0, ow0, co0 = _tma_tile(tile_c, tiles_n, tiles_hw, tiles_w, TH, TW, BLOCK_N)
        else:
            n, oh0, ow0, co0 = _tma_tile(tile_c % tiles, tiles_n, tiles_hw, tiles_w, TH, TW, BLOCK_N)
        offs = tl.arange(0, TH * TW)
        oh = oh0 + offs // TW
        ow = ow0 + offs % TW
        co = co0 + tl.arange(0, BLOCK_N)
        n = n.to(tl.int64)
        if SPLIT_K == 1:
            epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, n * syn + oh * syh + ow * syw,
                     n * srn + oh * srh + ow * srw, co, (oh < OH) & (ow < OW), co < COUT, syc, src, HAS_BIAS,
                     HAS_RES, ACT, STORE_Z)
        else:
            pixel = ((tile_c // tiles * N + n) * OH + oh) * OW + ow
            tl.store(y_ptr + pixel[:, None] * COUT + co[None, :], acc,
                     mask=((oh < OH) & (ow < OW))[:, None] & (co < COUT)[None, :])


@triton.jit
def _conv_split_sum_kernel(part_ptr, y_ptr, bias_ptr, z_ptr, r_ptr, P, COUT, OH, OW,
                           syn, syc, syh, syw, srn, src, srh, srw,
                           SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
                           STORE_Z: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """The epilogue of a forward split along K: y = act(sum_s part[s] + bias + residual) over [P = N * OH * OW
    pixels, COUT] tiles, part [SPLITS, P, COUT] dense fp32 (`_conv_fwd_tma_kernel`'s SPLIT_K)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    co = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_ok, co_ok = p < P, co < COUT
    offs = p[:, None] * COUT + co[None, :]
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * P * COUT + offs, mask=p_ok[:, None] & co_ok[None, :], other=0.0)
    n, oh, ow = p // (OH * OW), p // OW % OH, p % OW
    epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, n * syn + oh * syh + ow * syw, n * srn + oh * srh + ow * srw, co,
             p_ok, co_ok, syc, src, HAS_BIAS, HAS_RES, ACT, STORE_Z)


@triton.jit
def _conv_wgrad_tma_kernel(dz_ptr, x_ptr, part_ptr,
                           N, C, H, W, COUT, OH, OW, tiles_per_split,
                           STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr, PAD_H: tl.constexpr,
                           PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
                           KH: tl.constexpr, KW: tl.constexpr, PRECISION: tl.constexpr,
                           TH: tl.constexpr, TW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight gradient for one group, x and dz dense channels_last (Hopper TMA), one split's share:
    part[split, co, kh, kw, c] = sum over this split's output pixel tiles of dz[n, oh, ow, co] * x at the pixel
    tap (kh, kw) reads, in fp32. Per TH x TW pixel tile one box of dz [1, TH, TW, BLOCK_M] (zeros past the
    image) and the tap's box of x (_tap_box): acc[BLOCK_M, BLOCK_N] += dz^T @ x. Grid (taps * output-channel
    tiles * input-channel tiles, splits of the N * pixel tiles)."""
    x_desc = _phase_desc(x_ptr, N, C, H, W, STRIDE_H, STRIDE_W, TH, TW, BLOCK_N)
    dz_desc = tl.make_tensor_descriptor(dz_ptr, shape=[N, OH, OW, COUT],
                                        strides=[tl.cast(OH, tl.int64) * OW * COUT, OW * COUT, COUT, 1],
                                        block_shape=[1, TH, TW, BLOCK_M])
    m_blocks = tl.cdiv(COUT, BLOCK_M)
    n_blocks = tl.cdiv(C, BLOCK_N)
    pid = tl.program_id(0)
    tap = pid // (m_blocks * n_blocks)
    co0 = pid // n_blocks % m_blocks * BLOCK_M
    c0 = pid % n_blocks * BLOCK_N
    kh = tap // KW
    tiles_w = tl.cdiv(OW, TW)
    tiles_hw = tl.cdiv(OH, TH) * tiles_w
    first = tl.program_id(1) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, N * tiles_hw)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for share in range(first, last, ACC_K // (TH * TW)):  # (ACC_K: one MMA accumulator's reduction at most)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(share, tl.minimum(share + ACC_K // (TH * TW), last)):
            n, oh0, ow0, _ = _tma_tile(t, 1, tiles_hw, tiles_w, TH, TW, 1)
            a = dz_desc.load([n, oh0, ow0, co0]).reshape(TH * TW, BLOCK_M)
            b = _tap_box(x_desc, n, oh0, ow0, kh, tap - kh * KW, c0, C, STRIDE_H, STRIDE_W, PAD_H, PAD_W, DIL_H,
                         DIL_W, TH, TW, BLOCK_N)
            part = dot_acc(part, tl.trans(a), b, PRECISION)
        acc += part
    co = co0 + tl.arange(0, BLOCK_M)
    c = c0 + tl.arange(0, BLOCK_N)
    offs = ((tl.program_id(1).to(tl.int64) * COUT + co[:, None]) * (KH * KW) + tap) * C + c[None, :]
    tl.store(part_ptr + offs, acc, mask=(co < COUT)[:, None] & (c < C)[None, :])


# The TMA forward (_conv_fwd_tma_kernel): TH x TW output pixels, BLOCK_N channels, BLOCK_K input channels a
# step, OCC programs per SM (0: one per tile, at most _MAX_PROGRAMS); on Hopper the untuned default where it
# applies (0.64-0.73x cuDNN on ResNet's stride-1 3x3 convs, where the pointer kernel gives 0.42-0.56x). The 8-warp
# tile gives cuDNN's error on all four ResNet shapes (scratch/probe_tma8.py, fp16 2.1e-4) and is the fastest there
# (41 us vs 45); test_tma_forward_resnet_shapes holds every config to the 2x rule.
FWD_CONFIGS = [
    dict(TH=8, TW=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, OCC=0),
    dict(TH=8, TW=8, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, OCC=0),
    dict(TH=8, TW=8, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, OCC=0),
    dict(TH=8, TW=16, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, OCC=0),
    dict(TH=8, TW=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=3, OCC=0),
    dict(TH=8, TW=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, OCC=1),
    dict(TH=8, TW=8, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4, OCC=1),
    dict(TH=8, TW=8, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4, OCC=2),
]
# The TMA weight gradient (_conv_wgrad_tma_kernel): BLOCK_M output x BLOCK_N input channels of one tap, TH x TW
# pixels a step; the N * pixel tiles split so that about OCC programs per SM run.
WGRAD_CONFIGS = [
    dict(TH=8, TW=16, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, OCC=2),
    dict(TH=8, TW=16, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, OCC=2),
    dict(TH=8, TW=8, BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4, OCC=2),
    dict(TH=8, TW=16, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4, OCC=4),
    dict(TH=8, TW=16, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, OCC=1),
]


# A program's two tensor descriptors take 256 bytes of global scratch (Triton allocates it per program): past
# this many programs the forward's programs loop over tiles (persistent), so that the scratch stays in WORKSPACE
# (one per tile of a 2^31-element output: 256 MiB and more).
_MAX_PROGRAMS = WORKSPACE // 256


def flipped(w: torch.Tensor, traced: bool) -> torch.Tensor:
    """The weight of the convolution that is the input gradient of a stride-1 one: [C, COUT, KH, KW], the taps
    mirrored, channels_last (the TMA forward's layout)."""
    return derived(w, "flipped", lambda w: w.flip(2, 3).transpose(0, 1).contiguous(memory_format=torch.channels_last),
                   traced)


def _fwd_fits(x, stride, groups: int) -> bool:
    """Whether the TMA forward takes x's problem once x and w are dense channels_last: Hopper, one group, at least
    16 channels in 16-byte rows, strides dividing H and W (its view of x by stride phase)."""
    size, C, H, W = x.element_size(), *x.shape[1:]
    return (_runtime.is_hopper(x.device.index or 0) and groups == 1 and C >= 16 and C * size % 16 == 0
            and H % stride[0] == 0 and W % stride[1] == 0)


def rows(configs: list, x) -> list:
    """configs' TH x TW pixel tiles as rows of TH * TW pixels (TH 1) where x is one pixel high (conv1d's views:
    a tile of TH rows would compute TH - 1 rows of padding), unchanged elsewhere."""
    return configs if x.shape[2] > 1 else [dict(c, TH=1, TW=c["TH"] * c["TW"]) for c in configs]


def _fwd_tiles(x, stride, kernel: str) -> list:
    """FWD_CONFIGS as `kernel`'s candidates: with a column stride over 1 only channel blocks that divide C (a box
    never reaches into the next phase's channels), stages cut to the shared memory; `rows` of one-pixel-high x."""
    size, C = x.element_size(), x.shape[1]
    return staged([dict(c, KERNEL=kernel) for c in rows(FWD_CONFIGS, x) if stride[1] == 1 or C % c["BLOCK_K"] == 0],
                  lambda c: (c["TH"] * c["TW"] + c["BLOCK_N"]) * c["BLOCK_K"] * size)


def fwd_configs(x, w, stride, groups: int, traced: bool) -> list:
    """_conv_fwd_tma_kernel's candidates for this forward, none where it does not apply (`_fwd_fits`, and x and w
    dense channels_last with 16-byte aligned pointers)."""
    if not (_fwd_fits(x, stride, groups)
            and all(t.is_contiguous(memory_format=torch.channels_last) and aligned(t, traced) for t in (x, w))):
        return []
    return _fwd_tiles(x, stride, "tma")


def staged_fwd_configs(x, stride, groups: int, precision: str, direct: bool) -> list:
    """The candidates of the TMA forward over channels_last copies of x and w (`staged_fwd_launcher`), where the
    direct one does not apply (`direct`: fwd_configs offers it) or takes tf32 (rounding every tile in registers,
    where a copy rounds once): x with its rows dense (H and W merge: NCHW, channels_last) that `_fwd_fits`, whose
    copy fits in WORKSPACE."""
    if not _fwd_fits(x, stride, groups) or x.shape[2] > 1 and x.stride(2) != x.shape[3] * x.stride(3) or (
            precision != "tf32" and direct) or _runtime.size_hint(x.numel()) * x.element_size() > WORKSPACE:
        return []
    return _fwd_tiles(x, stride, "tma-staged")


def wgrad_configs(dz, x, stride, groups: int, precision: str, traced: bool) -> list:
    """_conv_wgrad_tma_kernel's candidates, none where it does not apply: the TMA forward's conditions on x
    (fwd_configs), and dz dense channels_last with at least 16 channels in 16-byte rows. A pixel tile is
    one MMA chain, whose every step truncates in true fp32: there at most _gemm.max_k pixels (TH cut, then TW), as
    the GEMMs' BLOCK_K (with 128-pixel tiles a short reduction reached 2x cuDNN's error; 64 keep it at 0.7x that)."""
    size, cout = dz.element_size(), dz.shape[1]  # (dz's layout checked in w's place)
    if not (fwd_configs(x, dz, stride, groups, traced) and cout >= 16 and cout * size % 16 == 0):
        return []
    pixels = _gemm.max_k(precision, size, chain=64)
    fitting = [dict(c, KERNEL="tma", TH=min(c["TH"], max(1, pixels // c["TW"])), TW=min(c["TW"], pixels))
               for c in rows(WGRAD_CONFIGS, x) if stride[1] == 1 or x.shape[1] % c["BLOCK_N"] == 0]
    return staged(fitting, lambda c: c["TH"] * c["TW"] * (c["BLOCK_M"] + c["BLOCK_N"]) * size)


def dgrad_as_conv(dz, x, w, stride, padding, dilation, groups: int, traced: bool):
    """(weight, padding) of the stride-1 convolution of dz that gives the input gradient: flipped(w), padded by
    dilation * (K - 1) - the forward's padding (top, bottom, left, right), where the TMA forward takes it: one
    group, stride 1, channels_last x and dz, the forward's padding at most the kernel's reach. None elsewhere."""
    if tuple(stride) != (1, 1) or groups != 1 or not x.is_contiguous(memory_format=torch.channels_last):
        return None
    reach = [dilation[0] * (w.shape[2] - 1)] * 2 + [dilation[1] * (w.shape[3] - 1)] * 2
    if any(p > r for p, r in zip(padding, reach)):
        return None
    if not fwd_configs(dz, dz, (1, 1), 1, traced):  # (dz in the weight's place: the copy is dense channels_last)
        return None
    return flipped(w, traced), tuple(r - p for p, r in zip(padding, reach))


SPLIT_TILES = 3  # K splits are offered for the first this many TMA forward candidates


def split_configs(configs: list, dims: tuple, device_index: int) -> list:
    """K-split variants of the first SPLIT_TILES of the TMA forward's candidates `configs`, for a problem whose
    tiles fill fewer than half the SMs (a small batch's late stages: ResNet-50's 7 x 7 x 512 convs at batch 8 make
    32-64 tiles on 132 SMs): about one and two (split, tile) items an SM, each split at least 4 (tap, channel
    block) steps, the fp32 partials within WORKSPACE."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = (_runtime.size_hint(v) for v in dims)
    sms, out = _runtime.num_sms(device_index), []
    for cfg in configs[:SPLIT_TILES]:
        tiles = N * spatial_tiles(OH, OW, cfg) * _runtime.cdiv(COUT_G, cfg["BLOCK_N"])
        steps = KH * KW * _runtime.cdiv(C_G, cfg["BLOCK_K"])
        if 2 * tiles <= sms:
            out += [dict(cfg, SPLIT_K=splits) for splits in _gemm.split_counts(tiles, sms, steps, 4)
                    if splits * N * OH * OW * COUT_G * 4 <= WORKSPACE]
    return out


def fwd_launcher(cfg: dict, dims: tuple, x, y, r, stride, padding, dilation, precision: str, epilogue_meta: dict,
                 traced: bool):
    """_conv_fwd_tma_kernel's launch for cfg (KERNEL taken out): run(x, w, y, bias, z, r); with SPLIT_K, fp32
    partials summed with the epilogue by `_conv_split_sum_kernel`."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    splits = cfg.pop("SPLIT_K", 1)
    tiles = N * spatial_tiles(OH, OW, cfg) * _runtime.cdiv(COUT_G, cfg["BLOCK_N"])
    occupancy = cfg.pop("OCC")  # programs per SM; 0: one program per (split, tile) item
    programs = min(splits * tiles, occupancy * _runtime.num_sms(x.device.index or 0) if occupancy else _MAX_PROGRAMS)
    meta = dict(geometry_meta(stride, padding, dilation), KH=KH, KW=KW, PRECISION=precision, **cfg)
    if splits == 1:
        meta.update(epilogue_meta)
    else:
        meta.update(HAS_BIAS=False, HAS_RES=False, ACT="none", STORE_Z=False, SPLIT_K=splits)
    launch = Launch(_conv_fwd_tma_kernel, (programs,), meta, scratch=True, traced=traced)
    scalars = (N, C_G, H, W, COUT_G, OH, OW, *y.stride(), *r.stride(), programs)
    if splits == 1:
        return lambda *tensors: launch(*tensors, *scalars)
    pixels = N * OH * OW
    launch_sum = Launch(_conv_split_sum_kernel, (_runtime.cdiv(pixels, 64), _runtime.cdiv(COUT_G, 64)),
                        dict(SPLITS=splits, **epilogue_meta, BLOCK_P=64, BLOCK_N=64), traced=traced)
    sum_scalars = (pixels, COUT_G, OH, OW, *y.stride(), *r.stride())

    def run(x, w, y, bias, z, r):
        part = torch.empty((splits, pixels, COUT_G), device=x.device, dtype=torch.float32)
        launch(x, w, part, bias, z, r, *scalars)
        launch_sum(part, y, bias, z, r, *sum_scalars)
    return run


def staged_fwd_launcher(cfg: dict, dims: tuple, x, y, r, stride, padding, dilation, precision: str,
                        epilogue_meta: dict, traced: bool):
    """The TMA forward over a dense channels_last copy of x and one of w (`staged_weight`), both rounded to tf32
    where precision is "tf32" (the MMAs read them as they are): run(x, w, y, bias, z, r), cfg as fwd_launcher's."""
    N, C, H, W = x.shape
    rounded = precision == "tf32"
    forward = fwd_launcher(cfg, dims, x, y, r, stride, padding, dilation, "tf32_rounded" if rounded else precision,
                           epilogue_meta, traced)
    copy = Launch(_gemm.operand_copy_kernel, *_gemm.operand_copy_launch(C, H * W, N, rounded), traced=traced)
    strides = (x.stride(0), x.stride(1), x.stride(3), H * W * C, 1, C)  # [N, C, H * W] views of x and the copy

    def run(x, w, y, bias, z, r):
        staged_x = torch.empty_strided((N, C, H, W), (H * W * C, 1, W * C, C), dtype=x.dtype, device=x.device)
        copy(x, staged_x, C, H * W, *strides, 0)
        forward(staged_x, staged_weight(w, rounded, traced), y, bias, z, r)
    return run


def staged_weight(w: torch.Tensor, rounded: bool, traced: bool) -> torch.Tensor:
    """w as the staged TMA forward reads it: dense channels_last, rounded to tf32 where `rounded` (`derived`: kept
    per version of a parameter's data)."""
    if not rounded and w.is_contiguous(memory_format=torch.channels_last):
        return w

    def make(w):
        w = w.contiguous(memory_format=torch.channels_last)
        if not rounded:
            return w
        rows, cols = w.shape[0], w[0].numel()  # (channels_last rows: [COUT, KH * KW * C])
        out = torch.empty_like(w)
        grid, meta = _gemm.operand_copy_launch(rows, cols, 1, True)
        launch(_gemm.operand_copy_kernel, grid, w, out, rows, cols, 0, cols, 1, 0, cols, 1, 0, traced=traced,
               **meta)
        return out
    return derived(w, "tma-tf32" if rounded else "tma", make, traced)


def wgrad_launcher(cfg: dict, dims: tuple, x, stride, padding, dilation, precision: str, traced: bool):
    """_conv_wgrad_tma_kernel's launch for cfg (KERNEL taken out): run(dz, x, dw), fp32 partials per split
    [splits, COUT, KH, KW, C], summed."""
    N, C_G, H, W, COUT_G, OH, OW, KH, KW = dims
    out_tiles = KH * KW * _runtime.cdiv(COUT_G, cfg["BLOCK_M"]) * _runtime.cdiv(C_G, cfg["BLOCK_N"])
    pixel_tiles = N * spatial_tiles(OH, OW, cfg)
    programs = cfg.pop("OCC") * _runtime.num_sms(x.device.index or 0)
    per_split = _runtime.cdiv(pixel_tiles, max(1, min(pixel_tiles, programs // out_tiles)))
    splits = _runtime.cdiv(pixel_tiles, per_split)
    launch = Launch(_conv_wgrad_tma_kernel, (out_tiles, splits),
                    dict(conv_meta(stride, padding, dilation, precision), KH=KH, KW=KW, **cfg), scratch=True,
                    traced=traced)
    scalars = (N, C_G, H, W, COUT_G, OH, OW, per_split)

    def run(dz, x, dw):
        part = torch.empty((splits, COUT_G, KH, KW, C_G), device=dz.device, dtype=torch.float32)
        launch(dz, x, part, *scalars)
        dw.copy_(part.sum(0).permute(0, 3, 1, 2))
    return run
