"""Fuzzing the convolutions and poolings against torch: conv2d, conv1d, sparse_conv2d, conv2d with fold_batchnorm's
weights, max_pool2d, avg_pool2d and adaptive_avg_pool2d, forward and backward (or forward alone) vs float64 and
the 2x rule (`_check.check`)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

import dropin
from _fuzz import CONTIGUOUS, FUZZ, SEEDS, compare, kink_mask, layouts, sizes, start
from _tol import DEVICE, DTYPES, ON_GPU
from dropin.ops.activations import ACTIVATIONS
from dropin.ops.conv1d import conv1d_ref
from dropin.ops.conv2d import conv2d_ref
from dropin.ops.sparse import sparsify

pytestmark = [pytest.mark.fuzz, pytest.mark.usefixtures("true_fp32")]

BACKWARD = st.booleans()  # False: forward alone, without autograd (the ops' inference paths)


@st.composite
def conv_geometry(draw, dims: int):
    """Channels, groups (one, several, depthwise), kernel, stride, padding (ints, pairs, 'valid', and 'same',
    which torch takes for stride 1 only), dilation and an input size that holds the dilated kernel (torch
    refuses a smaller padded input), for a conv of `dims` (1 or 2) spatial dims."""
    groups = draw(st.sampled_from(("one", "grouped", "depthwise")))
    G = 1 if groups == "one" else draw(sizes(2, 6))
    cin = G * (1 if groups == "depthwise" else draw(sizes(1, 4)))
    cout = G * draw(sizes(1, 4))
    kernel = tuple(draw(st.integers(1, 5)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    padding = draw(st.sampled_from(("ints", "valid", "same") if stride == (1,) * dims else ("ints", "valid")))
    pads = tuple(draw(st.integers(0, 3)) for _ in range(dims)) if padding == "ints" else padding
    total = [2 * p for p in pads] if padding == "ints" else [0] * dims if padding == "valid" else \
        [d * (k - 1) for k, d in zip(kernel, dilation)]
    spatial = tuple(max(1, d * (k - 1) + 1 - t) + draw(st.integers(0, 9)) for k, d, t in
                    zip(kernel, dilation, total))
    one = draw(st.booleans())  # an int for each argument where the dims agree, as torch takes either
    scalar = lambda v: v[0] if one and len(set(v)) == 1 and not isinstance(v, str) else v  # noqa: E731
    return dict(n=draw(st.sampled_from((None, 1, 2, 3))), cin=cin, cout=cout, groups=G, kernel=kernel,
                stride=scalar(stride), padding=pads if isinstance(pads, str) else scalar(pads),
                dilation=scalar(dilation), spatial=spatial)


def torch_cpu_crashes(case, dtype) -> bool:
    """Whether torch's own conv (the peer) of the case crashes the process: on the CPU, an fp16 conv whose every
    window along some dim lies in the padding (segmentation fault, torch 2.14.1: conv1d of a [4, 1] input, kernel
    1, stride 2, padding 1, groups 4; conv2d of [3, 4, 8, 2], kernel 2x1, stride (2, 3), padding (2, 1), dilation
    (1, 3)). float32 runs, and so does fp16 where a window reads the input."""
    if ON_GPU or dtype != torch.float16 or isinstance(case["padding"], str):
        return False  # ('valid' and 'same' windows all read the input)
    dims = len(case["kernel"])
    per_dim = [v if isinstance(v, tuple) else (v,) * dims for v in (case["stride"], case["padding"], case["dilation"])]
    for L, K, s, p, d in zip(case["spatial"], case["kernel"], *per_dim):
        outputs = (L + 2 * p - d * (K - 1) - 1) // s + 1
        if not any(0 <= o * s - p + t * d < L for o in range(outputs) for t in range(K)):
            return True
    return False


def out_shape(case, ref_fn):
    """The conv's output shape, from torch on meta tensors."""
    x = torch.empty(*([case["n"]] if case["n"] else []), case["cin"], *case["spatial"], device="meta")
    w = torch.empty(case["cout"], case["cin"] // case["groups"], *case["kernel"], device="meta")
    return tuple(ref_fn(x, w, None, case["stride"], case["padding"], case["dilation"], case["groups"]).shape)


@st.composite
def conv2d_cases(draw):
    """conv2d's geometry, unbatched or batched input in any layout (channels_last among them), bias, a fused
    activation and a residual of the output's size."""
    case = draw(conv_geometry(2))
    rank = 3 if case["n"] is None else 4
    return dict(case, bias=draw(st.booleans()), activation=draw(st.sampled_from((None, *ACTIVATIONS))),
                residual=draw(st.booleans()), x_layout=draw(layouts(rank, channels_last=True)),
                w_layout=draw(layouts(4, channels_last=True)), r_layout=draw(layouts(rank, channels_last=True)),
                backward=draw(BACKWARD))


def conv_leaves(case, dtype, ref_fn) -> dict:
    n = [case["n"]] if case["n"] else []
    fan_in = case["cin"] // case["groups"] * torch.Size(case["kernel"]).numel()
    leaves = {"x": case["x_layout"].tensor((*n, case["cin"], *case["spatial"]), dtype),
              "w": case["w_layout"].tensor((case["cout"], case["cin"] // case["groups"], *case["kernel"]), dtype,
                                           scale=fan_in ** -0.5)}
    if case["bias"]:
        leaves["b"] = CONTIGUOUS.tensor((case["cout"],), dtype)
    if case.get("residual"):
        leaves["r"] = case["r_layout"].tensor(out_shape(case, ref_fn), dtype)
    return leaves


def conv_call(fn, case):
    """fn(x, w, b, stride, padding, dilation, groups, activation, residual) on a dict of a check's leaves."""
    args = (case["stride"], case["padding"], case["dilation"], case["groups"], case["activation"])
    return lambda t: fn(t["x"], t["w"], t.get("b"), *args, t.get("r"))


def conv_kinks(case, dtype, ref_fn):
    """The check's `ambiguous` mask for the case's activation (`kink_mask`): its pre-activation is conv + bias +
    residual."""
    args = (case["stride"], case["padding"], case["dilation"], case["groups"])

    def preact(t, f):
        z = ref_fn(f(t["x"]), f(t["w"]), f(t["b"]) if "b" in t else None, *args)
        return z + f(t["r"]) if "r" in t else z
    return kink_mask(case["activation"], preact, dtype)


def as_dict(**leaves):
    """A check's `build`: the op gets its leaves as one dict (optional ones absent)."""
    return (leaves,)


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=conv2d_cases(), seed=SEEDS)
def test_conv2d(dtype, case, seed):
    assume(not torch_cpu_crashes(case, dtype))
    start("conv2d", seed)
    # each gradient in its input's layout; a residual's in torch's memory format (the strides of its size-1 dims
    # are free: an unbatched conv's output rows of one pixel)
    compare(conv_call(dropin.ops.conv2d, case), conv_call(conv2d_ref, case), conv_leaves(case, dtype, F.conv2d),
            build=as_dict, upstream_contiguous=True, backward=case["backward"],
            ambiguous=conv_kinks(case, dtype, F.conv2d),
            grad_layout={"x": "input", "w": "input", "b": "input", "r": "format"})


@st.composite
def conv1d_cases(draw):
    case = draw(conv_geometry(1))
    rank = 2 if case["n"] is None else 3
    return dict(case, bias=draw(st.booleans()), activation=draw(st.sampled_from((None, *ACTIVATIONS))),
                residual=draw(st.booleans()), x_layout=draw(layouts(rank)), w_layout=draw(layouts(3)),
                r_layout=draw(layouts(rank)), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=conv1d_cases(), seed=SEEDS)
def test_conv1d(dtype, case, seed):
    assume(not torch_cpu_crashes(case, dtype))
    start("conv1d", seed)
    compare(conv_call(dropin.ops.conv1d, case), conv_call(conv1d_ref, case), conv_leaves(case, dtype, F.conv1d),
            build=as_dict, upstream_contiguous=True, backward=case["backward"],
            ambiguous=conv_kinks(case, dtype, F.conv1d))


@st.composite
def sparse_conv2d_cases(draw):
    """conv2d's geometry with a pruned weight (a drawn fraction of zeros); its transpose compressed too unless the
    case is inference only (the gradient of the input needs it)."""
    case = draw(conv_geometry(2))
    backward = draw(BACKWARD)
    return dict(case, bias=draw(st.booleans()), x_layout=draw(layouts(3 if case["n"] is None else 4,
                                                                      channels_last=True)),
                w_layout=CONTIGUOUS, sparsity=draw(st.sampled_from((0.0, 0.5, 0.9, 1.0))),
                block_k=draw(st.one_of(st.sampled_from((1, 16, 64, 256)), st.integers(1, 256))),
                transpose=backward or draw(st.booleans()), backward=backward)


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=sparse_conv2d_cases(), seed=SEEDS)
def test_sparse_conv2d(dtype, case, seed):
    assume(not torch_cpu_crashes(case, dtype))
    start("sparse_conv2d", seed)
    leaves = conv_leaves(case, dtype, F.conv2d)
    leaves["w"] = leaves["w"] * (torch.rand(leaves["w"].shape, device=DEVICE) >= case["sparsity"])
    geometry = case["stride"], case["padding"], case["dilation"], case["groups"]
    sparse = dict(block_k=case["block_k"], transpose=case["transpose"], groups=case["groups"])
    compare(lambda x, w, b=None: dropin.ops.sparse_conv2d(x, sparsify(w, **sparse), b, *geometry),
            lambda x, w, b=None: F.conv2d(x, w, b, *geometry), leaves, constant=("w",),
            backward=case["backward"])


@st.composite
def fold_batchnorm_cases(draw):
    """conv2d (one group, batched NCHW or channels_last) then an inference BatchNorm (affine or not), folded."""
    case = draw(conv_geometry(2).filter(lambda c: c["groups"] == 1 and c["n"]))
    return dict(case, bias=draw(st.booleans()), affine=draw(st.booleans()),
                eps=draw(st.sampled_from((1e-5, 1e-3, 0.1))), x_layout=draw(layouts(4, channels_last=True)),
                w_layout=draw(layouts(4, channels_last=True)), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=fold_batchnorm_cases(), seed=SEEDS)
def test_fold_batchnorm(dtype, case, seed):
    assume(not torch_cpu_crashes(case, dtype))
    start("fold_batchnorm", seed)
    C = case["cout"]
    leaves = conv_leaves(case, dtype, F.conv2d)
    stats = {"mean": torch.randn(C, device=DEVICE), "var": torch.rand(C, device=DEVICE) + 0.5,
             "gamma": torch.randn(C, device=DEVICE), "beta": torch.randn(C, device=DEVICE)}
    leaves.update({k: v.to(dtype) for k, v in stats.items()})
    geometry = case["stride"], case["padding"], case["dilation"]
    eps, affine = case["eps"], case["affine"]

    def folded(conv):
        def call(t):
            bn = torch.nn.BatchNorm2d(C, eps=eps, affine=affine, device=DEVICE, dtype=dtype).eval()
            with torch.no_grad():
                bn.running_mean.copy_(t["mean"])
                bn.running_var.copy_(t["var"])
                if affine:
                    bn.weight.copy_(t["gamma"])
                    bn.bias.copy_(t["beta"])
            return conv(t["x"], *dropin.ops.fold_batchnorm(t["w"], t.get("b"), bn), *geometry)
        return call

    def unfolded(t):
        y = F.conv2d(t["x"], t["w"], t.get("b"), *geometry)
        return F.batch_norm(y, t["mean"], t["var"], t["gamma"] if affine else None, t["beta"] if affine else None,
                            False, 0.0, eps)
    # PyTorch's own error: F.conv2d on the same folded weights (folding rounds them once more than conv -> bn)
    compare(folded(dropin.ops.conv2d), unfolded, leaves, peer=folded(F.conv2d), build=as_dict,
            constant=("mean", "var", "gamma", "beta"), upstream_contiguous=True, grad_layout=None,
            backward=case["backward"])


@st.composite
def window_cases(draw, op: str):
    """A pooling window: kernel, stride (None: the kernel), padding (torch takes at most half the kernel),
    dilation (max_pool2d only), ceil_mode; for avg_pool2d count_include_pad and divisor_override; ints or pairs;
    an input [N, C, H, W] or [C, H, W] that holds one window (torch refuses an empty output)."""
    kernel = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    stride = draw(st.one_of(st.none(), st.tuples(st.integers(1, 3), st.integers(1, 3))))
    padding = tuple(draw(st.integers(0, k // 2)) for k in kernel)
    dilation = (draw(st.integers(1, 3)), draw(st.integers(1, 3))) if op == "max_pool2d" else (1, 1)
    hw = tuple(max(1, d * (k - 1) + 1 - 2 * p) + draw(st.integers(0, 9)) for k, d, p in zip(kernel, dilation,
                                                                                           padding))
    one = draw(st.booleans())  # an int where both dims agree, as torch takes either
    scalar = lambda v: v[0] if one and v is not None and v[0] == v[1] else v  # noqa: E731
    kw = dict(kernel_size=scalar(kernel), stride=scalar(stride), padding=scalar(padding),
              ceil_mode=draw(st.booleans()))
    if op == "max_pool2d":
        kw["dilation"] = scalar(dilation)
    else:
        kw.update(count_include_pad=draw(st.booleans()),
                  divisor_override=draw(st.one_of(st.none(), st.integers(1, 9))))
    shape = (*draw(st.sampled_from(((), (1,), (2,), (3,)))), draw(sizes(1, 5)), *hw)
    # a window wholly in the padding (dilation skips the input) is -inf, its gradient undefined: torch routes it
    # to an element outside the window, dropin to none (max_pool2d's docstring)
    assume(op != "max_pool2d" or not F.max_pool2d(torch.zeros(shape), **kw).isinf().any())
    return dict(op=op, kw=kw, shape=shape, layout=draw(layouts(len(shape), channels_last=True)),
                backward=draw(BACKWARD))


@st.composite
def adaptive_cases(draw):
    """output_size an int or a pair, an entry None (the input's size); larger than the input too (overlapping
    windows, as torch allows)."""
    shape = (*draw(st.sampled_from(((), (1,), (2,), (3,)))), draw(sizes(1, 5)), draw(sizes(1, 12)),
             draw(sizes(1, 12)))
    size = draw(st.one_of(sizes(1, 9), st.tuples(st.one_of(st.none(), sizes(1, 9)), st.one_of(st.none(),
                                                                                               sizes(1, 9)))))
    return dict(op="adaptive_avg_pool2d", kw=dict(output_size=size), shape=shape,
                layout=draw(layouts(len(shape), channels_last=True)), backward=draw(BACKWARD))


@pytest.mark.parametrize("dtype", DTYPES)
@FUZZ
@given(case=st.one_of(window_cases("max_pool2d"), window_cases("avg_pool2d"), adaptive_cases()), seed=SEEDS)
def test_pooling(dtype, case, seed):
    op, kw = case["op"], case["kw"]
    start(op, seed)
    # adaptive pooling: torch's gradient of a channels_last input may be NCHW (a broadcast view)
    compare(lambda x: getattr(dropin.ops, op)(x, **kw), lambda x: getattr(F, op)(x, **kw),
            {"x": case["layout"].tensor(case["shape"], dtype)},
            grad_layout=None if op == "adaptive_avg_pool2d" else "format", backward=case["backward"])
