"""Which tensors Inductor takes each dropin kernel to write: the machinery that tests/test_kernel_writes.py and
benchmarks/probes/mutation_analysis.py share.

Inductor reads a wrap_triton kernel's TTIR to find the tensors it writes (torch's triton_kernel_wrap,
`identify_accessed_tensors`). A tensor it wrongly takes as written is functionalized: an input of a registered op
then gets cloned around the kernel (slow), and under autograd a leaf that requires grad fails as "used in an
in-place operation". Where the analysis raises, Inductor takes every tensor argument as written.

`setup()` (before triton or dropin is imported: the kernels must be compiled ones, not interpreted) makes Triton
compile for a pretend sm_90 where there is no GPU, and replaces dropin's `wrap_triton` with a recorder. Inside
`traced()` every public function calls its registered op (torch.compiler.is_compiling() is True), whose body
runs with traced=True: its launches are recorded, never run (outputs hold garbage), each with the registered op
call it belongs to. `analyse` runs torch's analysis on a launch; `check` names what is wrong with it.

As a script (`python tests/_kernel_writes.py`) it runs `_cases`, each public op of dropin.ops forward and
backward, and prints a JSON report: `{"skip": reason}` where TTIR cannot be generated here."""
import contextlib
import inspect
import json
import os
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16
# Public names of dropin.ops that launch no kernel of their own.
NOT_OPS = {"fold_batchnorm", "sparsify", "SparseWeight"}
# Public names of dropin.ops registered as opaque ops (`_dispatch.opaque_op`): Inductor calls them whole, never
# reading their kernels.
OPAQUE = {"linear_cross_entropy"}

launches: list = []  # (op call or None, kernel, {argument name: value}) per recorded launch
_calls: list = []  # the registered op calls now running, innermost last


class OpCall:
    """One call of a registered dropin op: its name, its tensor arguments by name, the arguments it declares
    written (mutates_args) and the case that made it."""

    def __init__(self, func, args, kwargs, case):
        self.name, self.case = func._schema.name, case
        schema = func._schema.arguments
        bound = dict(zip((a.name for a in schema), args), **kwargs)
        self.inputs = [(n, t) for n, v in bound.items() for t in (v if isinstance(v, (list, tuple)) else [v])
                       if isinstance(t, torch.Tensor)]
        self.mutated = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class Recorder:
    """Stands in for torch.library.wrap_triton: `Recorder(kernel)[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            launches.append((_calls[-1] if _calls else None, self.kernel,
                             dict(zip(self.kernel.arg_names, args), **kwargs)))
        return record


def setup(record: bool = True) -> None:
    """Triton compiling (for a pretend H100 where there is no GPU), dropin imported, its launches recorded (record
    False: its launches left to torch's wrap_triton, for torch.compile's tracing). Raises RuntimeError where this
    environment cannot generate TTIR."""
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    from triton.backends.compiler import GPUTarget

    if "dropin" in sys.modules and sys.modules["dropin"]._runtime.INTERPRET:
        raise RuntimeError("dropin was imported with the Triton interpreter on")

    class PretendDriver:
        """Enough of a Triton driver for TTIR generation: an sm_90 target."""

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    if DEVICE == "cpu":
        triton.runtime.driver.set_active(PretendDriver())

    @triton.jit
    def _store(x_ptr):
        triton.language.store(x_ptr, 1.0)

    try:
        wrap.ttir_to_functions(wrap.generate_ttir(_store, {"x_ptr": torch.empty(1, device=DEVICE)}, {})[0])
    except Exception as error:  # noqa: BLE001  (any failure means: no TTIR here)
        raise RuntimeError(f"no TTIR here: {type(error).__name__}: {error}") from error

    from dropin import _runtime
    from dropin.ops import _dispatch

    if DEVICE == "cpu":  # CPU tensors stand in for CUDA ones on a pretend H100
        _runtime.num_sms = lambda device_index=0: 132
        _runtime.is_hopper = lambda device_index=0: True
        _runtime.check_kernel_device = lambda *args, **kwargs: None
        _runtime.KERNEL_DEVICE = "cpu"
    if record:
        _dispatch.wrap_triton = Recorder


@contextlib.contextmanager
def traced(case: str = ""):
    """Public functions call their registered ops, whose launches are recorded with the op call they belong to."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "namespace", None) != "dropin":
                return func(*args, **kwargs)
            _calls.append(OpCall(func, args, kwargs, case))
            try:
                return func(*args, **kwargs)
            finally:
                _calls.pop()

    compiling = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        with Calls():
            yield
    finally:
        torch.compiler.is_compiling = compiling


_analysed: dict = {}
_ttirs: dict = {}  # the TTIR text that `analyse` generated, by its key


def analyse(kernel, kwargs: dict):
    """(the tensor arguments Inductor takes as written, None) or (None, the error that made it take them all), as
    torch's identify_accessed_tensors decides (identify_mutated_tensors in older torch, which takes them all
    itself). Kept per kernel and specialization (dtypes, alignment, scalars)."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    key = (kernel, tuple((n, str(v.dtype), v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor) else (n, v)
                         for n, v in kwargs.items()))
    if key in _analysed:
        return _analysed[key]
    try:
        if hasattr(wrap, "identify_accessed_tensors"):  # its own steps, without its catch-all fallback
            ttir, names = wrap.generate_ttir(kernel, kwargs, {})
            _ttirs[key] = str(ttir)
            functions = wrap.ttir_to_functions(ttir)
            name = next(iter(functions))
            if kernel.fn.__name__ not in name:
                raise AssertionError(f"kernel {kernel.fn.__name__} not found in TTIR kernel {name}")
            wrap.analyze_kernel_access.reset()
            wrap.get_tma_stores.reset()
            index = frozenset(i for i, n in enumerate(names) if isinstance(kwargs.get(n), torch.Tensor))
            access = wrap.analyze_kernel_access(functions, name, len(names), tuple(names), index)
            written = [d.name for d in access.read_writes.writes]
        else:
            identify = wrap.identify_mutated_tensors
            written = identify(kernel, kwargs, *([{}] if len(inspect.signature(identify).parameters) > 2 else []))
        result = sorted(n for n in set(written) if isinstance(kwargs.get(n), torch.Tensor)), None
    except Exception as error:  # noqa: BLE001  (Inductor's fallback: every tensor written)
        result = None, f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    _analysed[key] = result
    return result


def shared(kwargs: dict) -> list:
    """The arguments that pass a tensor already passed in an earlier slot."""
    tensors = [(n, v) for n, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return [n for i, (n, v) in enumerate(tensors) if any(v is u for _, u in tensors[:i])]


def check(call, kernel, kwargs: dict) -> dict:
    """One launch's report: its op call, kernel, tensor arguments, what Inductor takes as written and what is
    wrong: `error` (the analysis raised: every tensor taken as written), `inputs_written` (slot: the op's input that
    a written tensor is, or shares storage with, where the op does not declare it written), `shared`."""
    written, error = analyse(kernel, kwargs)
    tensors = [n for n, v in kwargs.items() if isinstance(v, torch.Tensor)]
    bad = {}
    if call is not None:
        for slot in tensors if error else written:
            for name, t in call.inputs:
                if name not in call.mutated and _storage(t) == _storage(kwargs[slot]):
                    bad[slot] = name
    return {"case": call.case if call else "", "op": call.name if call else None, "kernel": kernel.fn.__name__,
            "tensors": tensors, "written": written, "error": error, "inputs_written": bad, "shared": shared(kwargs)}


# --- The cases: each public op of dropin.ops, forward and backward ---------------------------------------

def _t(*shape, grad=True, dtype=DTYPE):
    return torch.randn(*shape, dtype=dtype, device=DEVICE).requires_grad_(grad)


def _cases(ops) -> list:
    """(public name, case label, function that calls it)."""
    x4, w4 = (lambda: _t(2, 16, 8, 8)), (lambda: _t(32, 16, 3, 3))
    mask = torch.rand(64, 64, device=DEVICE) > 0.5
    rope_args = (lambda: (_t(2, 4, 16, 32), _t(2, 2, 16, 32), _t(2, 16, 32, grad=False), _t(2, 16, 32, grad=False)))
    sparse_w = torch.randn(48, 64, dtype=DTYPE, device=DEVICE) * (torch.rand(48, 64, device=DEVICE) > 0.9)
    sparse_wide = torch.randn(16, 2048, dtype=DTYPE, device=DEVICE) * (torch.rand(16, 2048, device=DEVICE) > 0.5)
    sparse_w4 = torch.randn(16, 8, 3, 3, dtype=DTYPE, device=DEVICE) * (torch.rand(16, 8, 3, 3, device=DEVICE) > 0.9)
    return [
        ("matmul", "2d", lambda: ops.matmul(_t(64, 32), _t(32, 48))),
        ("matmul", "broadcast", lambda: ops.matmul(_t(2, 64, 32), _t(32, 48))),
        ("matmul", "vector", lambda: ops.matmul(_t(64, 32), _t(32))),
        ("matmul", "fp32", lambda: ops.matmul(_t(64, 32, dtype=torch.float32), _t(32, 48, dtype=torch.float32))),
        ("matmul", "fp32-row", lambda: ops.matmul(_t(32, dtype=torch.float32), _t(32, 48, dtype=torch.float32))),
        ("bmm", "bmm", lambda: ops.bmm(_t(2, 64, 32), _t(2, 32, 48))),
        ("linear", "bias", lambda: ops.linear(_t(2, 32, 64), _t(48, 64), _t(48))),
        ("linear", "skinny", lambda: ops.linear(_t(2, 64), _t(48, 64), _t(48))),
        ("linear", "skinny-gelu", lambda: ops.linear(_t(2, 1024), _t(48, 1024), _t(48), activation="gelu")),
        *[("linear", act, lambda act=act: ops.linear(_t(64, 64), _t(48, 64), _t(48), activation=act))
          for act in ("relu", "gelu", "gelu_tanh", "silu")],
        ("conv1d", "conv1d", lambda: ops.conv1d(_t(2, 8, 16), _t(16, 8, 3), _t(16), padding=1)),
        ("conv1d", "grouped", lambda: ops.conv1d(_t(2, 8, 16), _t(16, 2, 3), groups=4, activation="relu")),
        ("conv2d", "epilogue", lambda: ops.conv2d(x4(), w4(), _t(32), padding=1, activation="relu",
                                                  residual=_t(2, 32, 8, 8))),
        ("conv2d", "channels-last", lambda: ops.conv2d(
            x4().detach().to(memory_format=torch.channels_last).requires_grad_(), w4(), None, stride=2, padding=1)),
        ("conv2d", "channels-last-tma", lambda: ops.conv2d(
            *[t.detach().to(memory_format=torch.channels_last).requires_grad_() for t in (x4(), w4())], _t(32),
            padding=1)),
        ("conv2d", "1x1", lambda: ops.conv2d(x4(), _t(32, 16, 1, 1), _t(32), activation="silu")),
        ("conv2d", "depthwise", lambda: ops.conv2d(x4(), _t(16, 1, 3, 3), _t(16), padding=1, groups=16)),
        ("conv2d", "depthwise-5x5", lambda: ops.conv2d(x4(), _t(16, 1, 5, 5), padding=2, groups=16)),
        ("conv2d", "grouped", lambda: ops.conv2d(x4(), _t(32, 4, 3, 3), padding=1, groups=4, activation="gelu")),
        ("conv2d", "out", lambda: ops.conv2d(_t(2, 16, 8, 8, grad=False), _t(32, 16, 3, 3, grad=False), padding=1,
                                             out=torch.empty(2, 32, 8, 8, dtype=DTYPE, device=DEVICE))),
        ("attention", "causal", lambda: ops.attention(_t(2, 4, 64, 32), _t(2, 4, 64, 32), _t(2, 4, 64, 32),
                                                      is_causal=True)),
        ("attention", "mask-gqa", lambda: ops.attention(_t(2, 4, 64, 32), _t(2, 2, 64, 32), _t(2, 2, 64, 32),
                                                        attn_mask=mask, enable_gqa=True)),
        ("attention", "float-mask", lambda: ops.attention(_t(2, 4, 64, 32), _t(2, 4, 64, 32), _t(2, 4, 64, 32),
                                                          attn_mask=_t(64, 64, grad=False))),
        ("attention", "decode", lambda: ops.attention(_t(2, 4, 1, 64, grad=False), _t(2, 2, 256, 64, grad=False),
                                                      _t(2, 2, 256, 64, grad=False), enable_gqa=True)),
        ("rms_norm", "llama", lambda: ops.rms_norm(_t(2, 16, 64), _t(64))),
        ("rms_norm", "residual", lambda: ops.rms_norm(_t(2, 16, 64), _t(64), residual=_t(2, 16, 64))),
        ("rms_norm", "gemma", lambda: ops.rms_norm(_t(2, 16, 64), _t(64), form="gemma")),
        ("layer_norm", "affine", lambda: ops.layer_norm(_t(2, 16, 64), (64,), _t(64), _t(64))),
        ("layer_norm", "plain", lambda: ops.layer_norm(_t(2, 16, 64), (16, 64))),
        ("group_norm", "affine-silu", lambda: ops.group_norm(_t(2, 8, 4, 4), 4, _t(8), _t(8), activation="silu")),
        ("group_norm", "plain", lambda: ops.group_norm(_t(2, 8, 64), 2)),
        ("batch_norm", "training", lambda: ops.batch_norm(
            _t(4, 8, 4, 4), torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE), _t(8), _t(8), True)),
        ("batch_norm", "eval", lambda: ops.batch_norm(
            _t(4, 8, 4, 4), torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE), _t(8), _t(8), False)),
        ("batch_norm", "inference", lambda: ops.batch_norm(
            _t(4, 8, 4, 4, grad=False), torch.zeros(8, device=DEVICE), torch.ones(8, device=DEVICE))),
        ("softmax", "last", lambda: ops.softmax(_t(4, 64))),
        ("softmax", "dim0", lambda: ops.softmax(_t(64, 4), dim=0)),
        ("log_softmax", "last", lambda: ops.log_softmax(_t(4, 64))),
        ("rope", "rope", lambda: ops.rope(*rope_args())),
        ("rope", "position-ids", lambda: ops.rope(*rope_args()[:2], _t(64, 32, grad=False), _t(64, 32, grad=False),
                                                  position_ids=torch.arange(16, device=DEVICE).expand(2, 16))),
        ("rope", "inplace", lambda: ops.rope(*[t.detach() for t in rope_args()], inplace=True)),
        ("max_pool2d", "max", lambda: ops.max_pool2d(x4(), 3, 2, 1)),
        ("avg_pool2d", "avg", lambda: ops.avg_pool2d(x4(), 3, 2, 1)),
        ("adaptive_avg_pool2d", "global", lambda: ops.adaptive_avg_pool2d(x4(), 1)),
        ("adaptive_avg_pool2d", "2x3", lambda: ops.adaptive_avg_pool2d(x4(), (2, 3))),
        ("activation", "gelu_tanh", lambda: ops.activation(_t(4, 64), "gelu_tanh")),
        ("relu", "relu", lambda: ops.relu(_t(4, 64))),
        ("gelu", "gelu", lambda: ops.gelu(_t(4, 64))),
        ("silu", "silu", lambda: ops.silu(_t(4, 64))),
        ("sparse_linear", "bias", lambda: ops.sparse_linear(_t(4, 64), ops.sparsify(sparse_w), _t(48))),
        ("sparse_linear", "split", lambda: ops.sparse_linear(_t(1, 2048), ops.sparsify(sparse_wide, block_k=16))),
        ("sparse_linear", "dense", lambda: ops.sparse_linear(_t(64, 64), ops.sparsify(sparse_w))),
        ("sparse_conv2d", "conv", lambda: ops.sparse_conv2d(_t(2, 8, 8, 8), ops.sparsify(sparse_w4), _t(16),
                                                           padding=1)),
        ("swiglu_mlp", "silu", lambda: ops.swiglu_mlp(_t(2, 8, 64), _t(128, 64), _t(128, 64), _t(64, 128))),
        ("swiglu_mlp", "recompute-gelu_tanh", lambda: ops.swiglu_mlp(
            _t(2, 8, 64), _t(128, 64), _t(128, 64), _t(64, 128), recompute=True, activation="gelu_tanh")),
    ]


def run_case(fn, case: str) -> None:
    """fn()'s forward and, where it has one, backward, traced."""
    with traced(case):
        out = fn()
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])


# The settings each case runs under, which pick the kernels: Hopper's TMA kernels or the pointer ones, and
# float32 products in tf32 (rounded copies of the operands) or in true fp32.
PASSES = {"tma": (True, False), "no-tma": (False, False), "tf32": (True, True)}


def report() -> dict:
    """Every case run in every pass: the launches' reports, the cases that failed to run, the public names
    without a case and the registered ops that no case called."""
    from dropin import _runtime, ops

    cases, failed, records = _cases(ops), {}, []
    hopper, tf32 = _runtime.is_hopper, torch.backends.cuda.matmul.allow_tf32
    for name, (tma, allow_tf32) in PASSES.items():
        _runtime.is_hopper = hopper if tma else (lambda device_index=0: False)
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        for public, label, fn in cases:
            case = f"{public}/{label}/{name}"
            start = len(launches)
            try:
                run_case(fn, case)
            except Exception as error:  # noqa: BLE001  (reported per case)
                failed[case] = f"{type(error).__name__}: {error}"
            records += [dict(check(*launch), public=public) for launch in launches[start:]]
    _runtime.is_hopper, torch.backends.cuda.matmul.allow_tf32 = hopper, tf32
    registered = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("dropin::")}
    called = {r["op"].split("::")[1] for r in records if r["op"]}
    return {"records": records, "failed": failed, "uncalled": sorted(registered - called - OPAQUE),
            "without_case": sorted(set(ops.__all__) - NOT_OPS - OPAQUE - {c[0] for c in cases}),
            "memo": memo_report(), "source_memo": source_memo_report()}


def memo_report() -> dict:
    """torch's launch analysis as dropin memoizes it (`_runtime.memoize_launch_analysis`) on every recorded launch,
    against torch's own steps (`analyse`): the launches whose written tensors differ, the kernels whose repeated
    call returned the first call's object (not a copy), and, of the specializations that the memo's key takes as
    one, how many joined another (`shared`) and the kernels whose joined ones generated different TTIR (`split`)."""
    import triton
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    from dropin import _runtime

    name = next((n for n in _runtime._LAUNCH_ANALYSES if hasattr(wrap, n)), None)
    analysis = getattr(wrap, name) if name else None
    if analysis is None or not hasattr(analysis, "__wrapped__"):
        return {"installed": False}
    extra = [{}] if len(inspect.signature(analysis.__wrapped__).parameters) > 2 else []
    seen, mismatched, same_object = set(), [], []
    before = analysis.cache_info()
    for _, kernel, kwargs in launches:
        # as torch.compile passes it: num_warps and num_stages in the one config of an Autotuner of its own
        special = {n: kwargs[n] for n in ("num_warps", "num_stages", "num_ctas") if n in kwargs}
        arguments = {n: v for n, v in kwargs.items() if n not in special}
        wrapped = triton.autotune(configs=[triton.Config({}, **special)], key=[])(kernel) if special else kernel
        result = analysis(wrapped, arguments, *extra)
        names = [d.name for d in result.read_writes.writes] if hasattr(result, "read_writes") else result
        written = sorted(n for n in set(names) if isinstance(kwargs.get(n), torch.Tensor))
        if written != analyse(kernel, kwargs)[0]:
            mismatched.append(f"{kernel.fn.__name__}: {written} against {analyse(kernel, kwargs)[0]}")
        if kernel not in seen and analysis(wrapped, dict(arguments), *extra) is result:
            same_object.append(kernel.fn.__name__)
        seen.add(kernel)
    after = analysis.cache_info()
    # the specializations that the memo's key takes as one (integers that are no constexprs by what Triton
    # specializes them on) and the distinct TTIRs they generated: one a group
    groups: dict = {}
    for (kernel, arguments), text in _ttirs.items():
        constexpr = {p.name: p.is_constexpr for p in kernel.params}
        key = (kernel, tuple(a if len(a) == 3 else (a[0], _runtime._argument_key(a[1], constexpr.get(a[0], True)))
                             for a in arguments))
        groups.setdefault(key, []).append(text)
    return {"installed": True, "launches": len(launches), "kernels": len(seen), "mismatched": mismatched,
            "same_object": same_object, "misses": after["misses"] - before["misses"],
            "hits": after["hits"] - before["hits"], "specializations": len(_analysed),
            "shared": sum(len(texts) - 1 for texts in groups.values()),
            "split": sorted(k[0].fn.__name__ for k, texts in groups.items() if len(set(texts)) > 1)}


def source_memo_report() -> dict:
    """Inductor's collection of a kernel's source code as dropin memoizes it (`_runtime.memoize_kernel_source`), on
    every Triton kernel of dropin's modules, against torch's own: the kernels whose source differs, the memo's
    misses and hits over two calls a kernel, and whether a kernel whose helper Triton function is replaced in its
    module (a global it reads) gets the new source."""
    import triton
    from torch._inductor.codegen import wrapper

    from dropin import _runtime

    _runtime.memoize_kernel_source()
    memo = getattr(wrapper, _runtime._KERNEL_SOURCE, None)
    if memo is None or not hasattr(memo, "__wrapped__"):
        return {"installed": False}
    own = memo.__wrapped__
    kernels = {id(v): v for name, module in list(sys.modules.items()) if name.startswith("dropin.")
               for v in vars(module).values() if isinstance(v, triton.runtime.JITFunction)}.values()
    before = memo.cache_info()
    mismatched = sorted({k.fn.__name__ for k in kernels for _ in range(2) if memo(k) != own(k)})
    after = memo.cache_info()
    kernel, name = next((k, n) for k in kernels for n in k.fn.__code__.co_names
                        if isinstance(k.fn.__globals__.get(n), triton.runtime.JITFunction))
    def stand_in(x):
        return x

    helper, old = kernel.fn.__globals__[name], memo(kernel)
    kernel.fn.__globals__[name] = triton.jit(stand_in)
    try:
        replaced = memo(kernel) == own(kernel) != old
    finally:
        kernel.fn.__globals__[name] = helper
    return {"installed": True, "kernels": len(kernels), "mismatched": mismatched,
            "misses": after["misses"] - before["misses"], "hits": after["hits"] - before["hits"],
            "replaced": replaced, "restored": memo(kernel) == old}


if __name__ == "__main__":
    try:
        setup()
    except RuntimeError as error:
        print(json.dumps({"skip": str(error)}))
        sys.exit(0)
    print(json.dumps(report()))
