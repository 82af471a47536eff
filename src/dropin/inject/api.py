"""inject_, revert_ and the report: swap dropin modules into a model in place, verify them, undo it."""
import copy
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch.utils import _pytree as pytree

from .._tolerance import default_dtype, limit, rel_err, to_float64
from ..nn import CausalLMForward, DropinModule, Folded
from ..ops._autotune import can_compile_ahead, compile_ahead
from . import registry, report_text, traced
from .coverage import Coverage, measure

# Progress of the slow stages (verification's first calls tune and compile kernels; coverage profiles a forward):
# INFO records that `dropin inject` shows on a terminal; a library user turns them on with logging.
progress = logging.getLogger("dropin.progress")


@contextmanager
def _stage(what: str):
    progress.info("%s ...", what)
    start = time.perf_counter()
    yield
    progress.info("%s: done in %.1f s", what, time.perf_counter() - start)


class InjectError(RuntimeError):
    """inject_ could not do what was asked (strict mode, a model already sharded); the model is left as it was."""


class VerificationError(InjectError):
    """The injected model's output diverged from the original's, or one of verification's runs raised (the
    exception is the cause); the model is reverted. `module`: the path of the first replaced module (in execution
    order) whose own output diverged, or of the innermost module running when one raised, or None."""

    def __init__(self, message: str, module: Optional[str]):
        super().__init__(message)
        self.module = module


# The sparsity at or above which InjectConfig(sparse=True) runs a Linear or Conv2d on the sparse kernels. Measured
# on the H200 (docs/perf-notes.md, benchmarks/results/h200/sparse.json): for one token (decoding) the sparse
# linear breaks even with cuBLAS at ~80% and wins 1.3x at 90%; with 16 or more tokens it does not break even, nor
# do batch-64 convs. 0.9 keeps a margin for the one-token case; models run with many tokens should leave it off.
SPARSE_THRESHOLD = 0.9


@dataclass
class InjectConfig:
    """What inject_ may do.

    ops: the dropin ops to use, e.g. {"linear"}; None: every op a handler knows ("linear", "conv2d", ...).
    fusions: fuse neighbours (Conv2d + BatchNorm2d + activation, Linear + activation, ResNet blocks).
    dtypes: a module with a floating tensor of another dtype stays torch.
    input_shape: without example_inputs, verification feeds one random tensor of this shape (the dtype and
      device of the model's first floating parameter).
    sparse: None / False (default): Linears and Conv2ds stay dense. A threshold in [0, 1]: an nn.Linear /
      nn.Conv2d whose weight has at least that fraction of zeros (plain zeros or a torch.nn.utils.prune mask)
      runs the sparse kernels (nn.SparsifiedLinear / nn.SparsifiedConv2d, weight frozen, not fused with its
      neighbours) unless it is in training mode with a weight that requires grad; the report gives each one's
      sparsity and the choice. True: SPARSE_THRESHOLD.
    compile_ahead: with example inputs (or input_shape) on a GPU, one forward first compiles the kernels of the
      injected model's forward side by side (`dropin.ops._autotune.compile_ahead`), so that the first real forward
      of those inputs' shapes (verification's, or the user's) compiles nothing: the compiles take about as long as
      the slowest of them rather than their sum (a cold ResNet-50: 106 s of first output, compiled one by one).
    """
    ops: Optional[frozenset] = None
    fusions: bool = True
    dtypes: tuple = (torch.float32, torch.float16, torch.bfloat16)
    input_shape: Optional[tuple] = None
    sparse: Union[None, bool, float] = None
    compile_ahead: bool = True

    def __post_init__(self):
        self.sparse_threshold  # noqa: B018  (raises on an invalid `sparse`)

    def uses(self, op: str) -> bool:
        return self.ops is None or op in self.ops

    @property
    def sparse_threshold(self) -> Optional[float]:
        """The sparsity at or above which a Linear goes sparse, or None (off)."""
        if self.sparse is None or self.sparse is False:
            return None
        if self.sparse is True:
            return SPARSE_THRESHOLD
        if not isinstance(self.sparse, (int, float)) or not 0 <= self.sparse <= 1:
            raise ValueError(f"InjectConfig.sparse: expected None, True or a sparsity threshold in [0, 1], "
                             f"got {self.sparse!r}")
        return float(self.sparse)


@dataclass
class Replaced:
    name: str      # path of the dropin module in the model
    original: str  # type of the module it replaced
    kernel: str
    fused: tuple = ()  # paths of the following siblings it computes too (their slots hold Folded stand-ins)
    covers: int = 1    # torch modules without children whose work it does (0 where that work is no module's, as
                       # CvT's attention products: a module that walks its children reports them one by one)

    @property
    def output_name(self) -> str:
        """The original module whose output this module's output is."""
        return self.fused[-1] if self.fused else self.name


@dataclass
class Left:
    name: str
    type: str
    reason: str


@dataclass
class InjectReport:
    replaced: list = field(default_factory=list)  # [Replaced]
    left: list = field(default_factory=list)      # [Left]: modules that compute and stay torch
    notes: list = field(default_factory=list)     # [Left]: modules with children whose handler declined
                                                  # (the children were handled one by one)
    verification: str = "not verified"
    coverage: Optional[Coverage] = None           # inject_(coverage=True): measured on the example inputs

    @property
    def summary(self) -> str:
        covered = sum(r.covers for r in self.replaced)
        return (f"{len(self.replaced)} module(s) replaced ({covered} torch module(s) covered), "
                f"{len(self.left)} left to torch; {self.verification}")

    def __str__(self) -> str:
        """The summary and the module tables (repeated blocks on one row; fitted to the terminal's width)."""
        tables = [("replaced", "original", "kernel", [(r.name or "<root>", r.original, r.kernel + (
                      f"  (also {report_text.relative(r.name, r.fused)})" if r.fused else "")) for r in self.replaced]),
                  ("left to torch", "type", "reason", [(e.name or "<root>", e.type, e.reason) for e in self.left]),
                  ("not fused", "type", "reason", [(e.name or "<root>", e.type, e.reason) for e in self.notes])]
        lines = [f"dropin inject_: {self.summary}", *report_text.render(tables, report_text.terminal_width())]
        if self.coverage is not None:
            lines.append(str(self.coverage))
        return "\n".join(lines)


def _walk(module: torch.nn.Module, prefix: str, config: InjectConfig, report: InjectReport) -> None:
    fused = set()
    for name, child in list(module._modules.items()):
        path = prefix + name
        if child is None or name in fused or isinstance(child, Folded):  # (a Folded's work: its drop-in's)
            continue
        site = registry.Site(module, name, path, config)
        # (a DropinModule: injected before, kept as it is)
        new = child if isinstance(child, DropinModule) else registry.handle(child, site)
        if isinstance(new, str) and child._modules:  # (no handler: a residual block whose forward traces?)
            new = traced.residual_block(child, site) or new
        if isinstance(new, str):
            if child._modules:
                if type(child) in registry.HANDLERS:
                    report.notes.append(Left(path, type(child).__name__, new))
                _walk(child, path + ".", config, report)
            elif not registry.is_passive(child):
                report.left.append(Left(path, type(child).__name__, new))
            continue
        if new is not child:
            setattr(module, name, new)
            for sibling in new.absorbs:
                setattr(module, sibling, Folded(module._modules[sibling], into=path))
        fused.update(new.absorbs)
        leaves = 0 if new.walks_children else sum(not m._modules for m in new.original.modules())
        report.replaced.append(Replaced(path, type(new.original).__name__, new.kernel,
                                        tuple(prefix + s for s in new.absorbs), leaves + len(new.absorbs)))
        if new.walks_children:
            _walk(new, path + ".", config, report)


def _inject_root(model: torch.nn.Module, config: InjectConfig, report: InjectReport) -> None:
    """Sets the root handler's forward on the model instance (`registry.handle_root`), once."""
    if isinstance(model.__dict__.get("forward"), CausalLMForward):
        return
    forward = registry.handle_root(model, config)
    if isinstance(forward, str):
        report.notes.append(Left("", type(model).__name__, forward))
    elif forward is not None:
        model.__dict__["forward"] = forward
        report.replaced.append(Replaced("", type(model).__name__, forward.kernel, covers=0))


def refresh_(model: torch.nn.Module) -> torch.nn.Module:
    """Recomputes what the drop-ins in `model` derive from its tensors (BatchNorms folded into convs), in place, so
    that torch.compile'd code and captured CUDA graphs read current values: call it after changing the model's
    weights or BatchNorm statistics in place. (Eager calls notice such changes themselves; load_state_dict on the
    injected model refreshes too.) Returns `model`."""
    for module in model.modules():
        if isinstance(module, DropinModule):
            module.refresh_()
    return model


_REFRESH_HOOK = "_dropin_refresh_hook"


def _refresh_after_load(model: torch.nn.Module, incompatible_keys) -> None:
    refresh_(model)  # after every tensor of the model loaded: a drop-in's own hook may run before a sibling's load


def revert_(model: torch.nn.Module) -> torch.nn.Module:
    """Puts back every original module that inject_ replaced (the same objects); returns `model`."""
    hook = model.__dict__.pop(_REFRESH_HOOK, None)
    if hook is not None:
        hook.remove()
    if isinstance(model.__dict__.get("forward"), CausalLMForward):
        del model.__dict__["forward"]
    for name, child in list(model._modules.items()):
        if isinstance(child, DropinModule):
            setattr(model, name, child.original)
            if child.walks_children:  # it shares the original's children, injected inside
                revert_(child.original)
        elif child is not None:
            revert_(child)
    return model


# --- verification ------------------------------------------------------------------------------------------

def _divergence(out, out_torch, out_64) -> Optional[str]:
    """None where every floating tensor of `out` is within its limit, else what exceeded it."""
    for got, theirs, ref in zip(*(pytree.tree_leaves(o) for o in (out, out_torch, out_64))):
        if isinstance(got, torch.Tensor) and got.is_floating_point():
            if any(isinstance(t, torch.Tensor) and t.is_nested for t in (got, theirs, ref)):
                continue  # a nested tensor (what nn.TransformerEncoder's layers get in torch): not comparable here
            torch_err = rel_err(theirs, ref)
            err, bound = rel_err(got, ref), limit(got.dtype, torch_err)
            if not err <= bound:
                return (f"relative error {err:.2e} > limit {bound:.2e} ({got.dtype}, against float64; "
                        f"PyTorch's own error {torch_err:.2e})")
    return None


def _run(model: torch.nn.Module, inputs: tuple, names: list, seed: int, run: str):
    """model(*inputs) and the outputs of the named modules (copies), with the names in the order they ran. An
    exception raises VerificationError naming `run` and the innermost module that was running."""
    seen, order, running = {}, [], []

    def keep(name):
        def hook(module, args, output):
            seen[name] = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, output)
            order.append(name)
        return hook

    def enter(name):
        def hook(module, args):
            running.append(name)
        return hook

    def leave(module, args, output):
        running.pop()

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in names]
    for name, module in model.named_modules():
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):  # the same dropout masks in every run
            torch.manual_seed(seed)
            return model(*inputs), seen, order
    except Exception as e:
        module = running[-1] if running else None
        where = f"in module '{module or '<root>'}'" if running else "outside the model's modules"
        raise VerificationError(f"inject_: verification's run of the {run} raised {where}, the model is reverted: "
                                f"{type(e).__name__}: {e}", module) from e
    finally:
        for h in handles:
            h.remove()


@contextmanager
def _buffers_kept(model: torch.nn.Module):
    """Restores the model's buffers (BatchNorm statistics that a training-mode forward updates)."""
    saved = [(b, b.clone()) for b in model.buffers()] if any(m.training for m in model.modules()) else []
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _compile_ahead(model: torch.nn.Module, inputs) -> None:
    """One forward on the inputs whose dropin launches compile their kernels instead of running them (see
    InjectConfig.compile_ahead). What it computes is garbage: no gradient, the buffers and the random state as
    they were after it."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.no_grad(), _buffers_kept(model), torch.random.fork_rng(devices=devices):
        compile_ahead(lambda: model(*inputs))


def _example(model: torch.nn.Module, config: InjectConfig, example_inputs):
    if example_inputs is not None:
        return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    if config.input_shape is None:
        return None
    p = next(t for t in model.parameters() if t.is_floating_point())
    return (torch.randn(config.input_shape, dtype=p.dtype, device=p.device),)


def _deepcopy(model: torch.nn.Module) -> torch.nn.Module:
    """copy.deepcopy, with the tensors of module attributes that are not graph leaves copied detached (deepcopy
    refuses them): the weight that a torch.nn.utils.prune hook computes again before each forward."""
    modules = [*model.modules()]
    modules += [o for m in modules if isinstance(m, DropinModule) for o in m.original.modules()]
    return copy.deepcopy(model, {id(t): t.detach().clone() for m in modules for t in vars(m).values()
                                 if isinstance(t, torch.Tensor) and not t.is_leaf})


def _verify(model: torch.nn.Module, inputs: tuple, report: InjectReport) -> None:
    names = {r.name: r.output_name for r in report.replaced}
    reference = revert_(_deepcopy(model))
    seed = int(torch.randint(2**31, ()))
    with torch.no_grad(), _buffers_kept(model):
        out, seen, order = _run(model, inputs, list(names), seed, "injected model")
        out_t, seen_t, _ = _run(reference, inputs, list(names.values()), seed, "original model")
        with default_dtype(torch.float64):  # tensors the forward creates match the reference's
            out_64, seen_64, _ = _run(reference.double(), pytree.tree_map(to_float64, inputs), list(names.values()),
                                      seed, "float64 reference (the original model in float64)")
    problem = _divergence(out, out_t, out_64)
    if problem is None:
        report.verification = "verified: output within tolerance of PyTorch's (float64 reference)"
        return
    culprit = next(((name, why) for name in order
                    if (why := _divergence(seen[name], seen_t[names[name]], seen_64[names[name]]))), None)
    where = ("no replaced module's own output diverged" if culprit is None else
             f"first replaced module whose output diverged: '{culprit[0]}' ({culprit[1]})")
    raise VerificationError(f"inject_: verification failed, the model is reverted. Model output: {problem}; "
                            f"{where}", culprit and culprit[0])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unsupported_dtype(model: torch.nn.Module, inputs: Optional[tuple], config: InjectConfig) -> Optional[str]:
    """Why no part of `model` can run on dropin's kernels (its floating tensors, or its example inputs', all of
    dtypes outside config.dtypes: the modules without tensors would get them too), or None."""
    for what, tensors in (("parameters and buffers", [*model.parameters(), *model.buffers()]),
                          ("example inputs", pytree.tree_leaves(inputs))):
        dtypes = {t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()}
        if dtypes and not dtypes & set(config.dtypes):
            return (f"its floating {what} are {', '.join(sorted(map(_dtype_name, dtypes)))}; dropin runs "
                    f"{', '.join(map(_dtype_name, config.dtypes))} (InjectConfig.dtypes): the model is left whole")
    return None


def _sharded(model: torch.nn.Module) -> Optional[str]:
    """Where `model` is already sharded (FSDP2's fully_shard, FSDP, parameters that are DTensors), what says so;
    else None."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    for name, module in model.named_modules():
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            return f"module '{name or '<root>'}' is a {type(module).__name__}"
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            return f"parameter '{name}' is a DTensor"
    return None


def _ddp_inner(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DistributedDataParallel wrapper (`.module`), else `model`."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def inject_(model: torch.nn.Module, config: Optional[InjectConfig] = None, *, example_inputs=None,
            verify: bool = True, strict: bool = False, coverage: bool = False) -> InjectReport:
    """Swaps dropin modules into `model` in place (setattr on the parent of each module replaced); returns the
    report of what was replaced (with its kernel) and what stays torch (with the reason).

    Handlers are found by exact module type (dropin.inject.registry); torch classes are never changed.
    `example_inputs` (a tensor or a tuple of forward arguments) or `config.input_shape`: with verify, the
    injected model and a reverted copy run on them (and the copy in float64 as the reference) under no_grad, with
    the same random seed and the model's buffers restored after (the float64 run with torch's default dtype
    float64, so that tensors the forward creates match; the caller's is restored); a divergence beyond the dtype's
    tolerance raises VerificationError naming the first replaced module whose output diverged, and an exception
    in any of these runs raises VerificationError naming the module that raised. On a GPU, with inputs, one
    forward first compiles the injected forward's kernels side by side (InjectConfig.compile_ahead). Any exception
    inside inject_ leaves the model reverted. A model whose floating tensors (or example inputs) are all of dtypes
    outside config.dtypes (float64) is left whole, the report saying why. Without inputs nothing is verified (the
    report says so). coverage (with inputs): the report gives the share of the FLOPs and of the GPU kernel time in
    dropin kernels on one forward, and the torch kernels that still ran (dropin.inject.coverage, measured with the
    torch profiler). strict: raise InjectError (model reverted) when any
    module that computes stays torch. Injecting an injected model again keeps its dropin modules (idempotent)
    and handles what a new config now allows; revert_ undoes all of it.

    Distributed training: inject_ first, then wrap (DistributedDataParallel, FSDP2's fully_shard). The drop-ins
    keep the original parameters (the same nn.Parameter objects), which DDP's buckets and FSDP2's sharding then
    see, and read them at each call (FSDP2's unsharded parameters). A model wrapped in DistributedDataParallel is
    injected inside its `.module`, keeping those parameters. A model already sharded (an FSDP2 / FSDP module in
    it, or DTensor parameters) raises InjectError: the drop-ins and their verification need whole tensors.
    """
    sharded = _sharded(model)
    if sharded is not None:
        raise InjectError(f"inject_: the model is already sharded ({sharded}): call dropin.inject_(model) first, "
                          f"then fully_shard(...) (FSDP2) or DistributedDataParallel(model)")
    model = _ddp_inner(model)
    config = InjectConfig() if config is None else config
    registry.load_deferred()  # handlers for the classes of optional libraries imported by now (transformers)
    config.sparse_threshold  # noqa: B018  (raises on an invalid `sparse`, set after the config was made)
    unknown = set(config.ops or ()) - registry.ops()
    if unknown:
        raise ValueError(f"InjectConfig.ops: unknown op(s) {sorted(unknown)}; known: {sorted(registry.ops())}")
    inputs = _example(model, config, example_inputs)
    if coverage and inputs is None:
        raise ValueError("inject_(coverage=True) measures one forward: pass example_inputs or "
                         "InjectConfig(input_shape=...)")
    report = InjectReport()
    unsupported = _unsupported_dtype(model, inputs, config)
    try:  # whatever raises in here leaves the model reverted
        if unsupported:
            report.left.append(Left("", type(model).__name__, unsupported))
        elif model._modules:
            _walk(model, "", config, report)
            _inject_root(model, config, report)
        elif not isinstance(model, DropinModule) and not registry.is_passive(model):
            report.left.append(Left("", type(model).__name__, "inject_ replaces children in place, not the root "
                                                              "module itself: wrap it in an nn.Sequential"))
        progress.info("inject_: %d module(s) replaced, %d left to torch", len(report.replaced), len(report.left))
        if report.replaced and _REFRESH_HOOK not in model.__dict__:
            model.__dict__[_REFRESH_HOOK] = model.register_load_state_dict_post_hook(_refresh_after_load)
        if strict and report.left:
            raise InjectError("inject_(strict=True): these modules would stay torch (the model is reverted):\n" +
                              "\n".join(f"  {e.name or '<root>'} ({e.type}): {e.reason}" for e in report.left))
        if inputs is not None and config.compile_ahead and report.replaced and can_compile_ahead():
            with _stage("compiling the forward's kernels side by side"):
                _compile_ahead(model, inputs)
        if verify and inputs is not None:
            with _stage("verifying against float64 (a new shape's first call tunes and compiles kernels)"):
                _verify(model, inputs, report)
        elif verify:
            report.verification = "NOT verified (pass example_inputs or InjectConfig(input_shape=...))"
        else:
            report.verification = "not verified (verify=False)"
        if coverage:
            with _stage("measuring coverage (profiling a forward)"), torch.no_grad(), _buffers_kept(model):
                report.coverage = measure(model, revert_(_deepcopy(model)), lambda m: m(*inputs))
    except BaseException:
        revert_(model)
        raise
    return report
