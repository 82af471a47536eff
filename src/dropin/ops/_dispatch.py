"""The one way an op checks its arguments, plans, caches and launches its kernels, in each execution mode (DESIGN.md,
"three contracts").

An op's work is one function, its impl: it allocates the outputs and launches the kernels of a plan (kernels, grids,
constexprs) made for the call's signature. The impl takes `traced`:
- Eager (traced=False): the public function checks its arguments once per signature (`Checks`) and calls the
  impl directly, without torch.library's dispatch. `plan` makes a signature's plan once (tuning then) and returns it
  on later calls; its `Launch`es re-launch the compiled kernel directly after their first call. A repeat call
  takes its signature's `Shortcuts` entry (allocate and launch; where autograd records the call a `Differentiable`,
  one autograd node whose forward and backward run kept plans).
- Captured (torch.cuda.graph, cudagraph trees): no launch keeps memory past the call (global scratch is allocated
  per launch), and a signature first met during a capture is planned without timing and not kept.
- Compiled: the op is registered with `torch.library.triton_op`, whose body is the impl with traced=True: the plan is
  made from the signature alone (remembered or shipped choices, never timing fake tensors) and its launches are
  `wrap_triton` calls, which Inductor turns into kernel launches in its generated code (no Python launcher per call).
  `switch` calls the registered op while torch.compile traces and the impl otherwise.
"""
import inspect
import weakref

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import triton_op, wrap_triton

from .. import _runtime
from . import _autotune


def torch_op(name: str, mutates_args=()):
    """Registers an impl's traced form, fn (annotated as for torch.library.custom_op), as the torch op `name`:
    a `triton_op`, which torch.compile decomposes into its kernel launches. Under the Triton interpreter an opaque
    custom op instead, with fn as its fake: there a kernel is a plain Python function that tracing would run on
    tensors without data (wrap_triton does not wrap it), and torch.compile does not run interpreted kernels."""
    def register(fn):
        if not _runtime.INTERPRET:
            _runtime.memoize_launch_analysis()
            return triton_op(name, fn, mutates_args=mutates_args)
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fn)
        return op
    return register


def opaque_op(name: str, mutates_args=()):
    """Registers fn, an impl's eager form, as the opaque torch op `name` (torch.library.custom_op; its fake is
    registered apart, `op.register_fake`): torch.compile calls it as one extern call that runs the eager plans.
    For an op called once per step whose kernels outweigh a Python launcher per call and write their outputs piece
    by piece over several passes (linear_cross_entropy's chunks): compiled graphs run exactly the eager code."""
    return lambda fn: torch.library.custom_op(name, fn, mutates_args=mutates_args)


def tracing() -> bool:
    """Whether torch.compile is tracing this call (Dynamo)."""
    return torch.compiler.is_compiling()


def switch(op, impl):
    """The registered op while torch.compile traces; the impl itself in eager mode (no dispatch cost)."""
    return lambda *args: (op if torch.compiler.is_compiling() else impl)(*args)


def absent(like: torch.Tensor, traced: bool = False) -> torch.Tensor:
    """The pointer argument for a tensor that a kernel leaves alone (its flag is off): `like` itself in eager (no
    allocation), an empty tensor of its dtype under tracing, where Inductor fixes each argument's layout apart and
    copies back what a kernel writes: a tensor passed again in an unused slot can be copied onto itself (a
    self-dependency, KeyError in its scheduler on torch 2.11). benchmarks/probes/mutation_analysis.py lists the
    launches that pass one tensor in two slots."""
    return like.new_empty(0) if traced else like


def aligned(t: torch.Tensor, traced: bool = False) -> bool:
    """Whether t's first element sits on a 16-byte boundary (what Triton specializes pointers on, and what tensor
    descriptors need). traced: from its storage offset (a traced tensor has no address): storages start aligned,
    and Inductor copies a misaligned input of a compiled graph."""
    if traced:
        return t.storage_offset() * t.element_size() % 16 == 0
    return t.data_ptr() % 16 == 0


# --- Argument checks, once per signature ---------------------------------------------------------------

_KEYABLE = (type(None), int, float, bool, str)


def signature(tensors: tuple, args: tuple = ()):
    """A key for a call's argument checks (`Checks`): each tensor's shape, dtype and device, and the other
    arguments with their types (as keys True == 1 == 1.0, which the checks tell apart); None where a check cannot
    be keyed: a tensor argument that is no Tensor, an argument that is not None, a bool, an int, a float, a str or a
    tuple of ints."""
    key = []
    for t in tensors:
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key.append((t.shape, t.dtype, t.device))
        else:
            return None
    for a in args:
        kind = type(a)
        if not (kind in _KEYABLE or kind is tuple and all(type(v) is int for v in a)):
            return None
        key.append((kind, a))
    return tuple(key)


class Checks:
    """A public function's argument checks, whose outcome depends on nothing but the tensors' shapes, dtypes and
    devices and the other arguments: `once` runs them once per signature. An object, not a dict that the function
    names: Dynamo guards on a dict that traced code passes around (its length: every new eager signature would
    recompile a compiled model, torch 2.11), never on this object's."""

    def __init__(self):
        self._results: dict = {}

    def once(self, tensors: tuple, args: tuple, check):
        """check()'s result (None too), reused on a repeat call; run on every call that has no signature
        (`signature`) and while torch.compile traces (once per graph; shapes may be symbolic)."""
        if torch.compiler.is_compiling():
            return check()
        key = signature(tensors, args)
        if key is None:
            return check()
        return plan(self._results, key, lambda: (check(),))[0]


# --- Plans, once per signature --------------------------------------------------------------------------

MAX_PLANS = 4096


def plan(plans: dict, key, make, traced: bool = False):
    """plans[key], made by make() on first use (tuning then) and reused: a small op's launch costs about as much CPU
    time as its kernel takes GPU time. traced: made anew without timing (the key may hold symbolic sizes). During a
    CUDA graph capture, and while launches warm up (`_autotune.warming_launches`), a missing plan is made
    without timing and not kept, so that a later eager call tunes. The cache is emptied past MAX_PLANS signatures
    (ever-new shapes)."""
    if traced:
        with _autotune.untimed():
            return make()
    found = plans.get(key)
    if found is None:
        if _runtime.capturing() or _autotune.warming_up():
            return make()
        if len(plans) > MAX_PLANS:
            plans.clear()
        found = plans[key] = make()
    return found


# --- Shortcuts: an eager call, once per signature ------------------------------------------------------

def _typed(a):
    """a with its type, and a tuple's elements with theirs (as keys True == 1 == 1.0, which checks tell apart)."""
    return (tuple, *map(_typed, a)) if type(a) is tuple else (type(a), a)


# every live Shortcuts (`forget_shortcuts`): an op's, and those a test puts in its place for a while
_SHORTCUTS: weakref.WeakSet = weakref.WeakSet()


def forget_shortcuts() -> None:
    """Drops every op's kept shortcuts: each signature's next call goes through its op's path and finds its plan
    again (a shortcut holds its plan's run, which emptying the op's plans alone leaves in use: a test that forces
    another config for a signature called before)."""
    for shortcuts in _SHORTCUTS:
        shortcuts._runs.clear()


class Shortcuts:
    """A public function's eager calls, each signature's reduced to one function of the call's tensors (its
    shortcut) that allocates the outputs and runs the signature's plan: a repeat call skips the argument checks,
    the argument processing and the plan's look-up, most of an op's host cost. Where autograd records the call
    the shortcut is a `Differentiable`: one autograd node whose forward and backward run plans kept for the
    signature (and for the incoming gradients' layout).

    The public function first `find`s (key, shortcut) and returns shortcut(*tensors) where there is one; else it
    runs its own path and `keep`s the shortcut that this call's path allows (the op's `*_shortcut` maker: None
    where a call does more than allocate and launch, e.g. a copy of an operand or a check of values). The key:
    whether autograd records the call, with each tensor's requires_grad then; each tensor's layout (what a plan is
    made for: shape, strides, dtype, device, 16-byte alignment); the other
    arguments with their types. No key (no shortcut, none kept) while torch.compile traces, under autocast (it
    casts operands), or where autograd records the call of an op that keeps no `Differentiable`; none is kept
    during a CUDA graph capture or while launches warm up (its plan is untimed); past MAX_PLANS signatures the cache
    is emptied.

    A plan's launches read their tensors' addresses alone (a kernel argument is a pointer; the plan fixed the
    strides and dtypes): a shortcut may pass a tensor in place of a view of it that starts at the same address
    (a 1x1 convolution's input as the GEMM operand [1, N*H*W, C])."""

    def __init__(self, differentiable: bool = False):
        """differentiable: the op keeps `Differentiable`s; without, a call that autograd records gets no key."""
        self._runs: dict = {}
        self.differentiable = differentiable
        _SHORTCUTS.add(self)

    def find(self, tensors: tuple, args: tuple):
        """(key, shortcut or None) for this call; key None where no shortcut may serve it."""
        if torch.compiler.is_compiling() or torch.is_autocast_enabled(_runtime.KERNEL_DEVICE):
            return None, None
        try:
            grads = None
            if torch.is_grad_enabled():
                grads = tuple([t is not None and t.requires_grad for t in tensors])
                if True not in grads:
                    grads = None
                elif not self.differentiable:
                    return None, None
            key = (grads, *[None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)
                            for t in tensors], *map(_typed, args))
            return key, self._runs.get(key)
        except (AttributeError, TypeError, RuntimeError):  # no tensor, no key (unhashable, no strides or address):
            return None, None  # the op's own path says

    def keep(self, key, make, grad: bool = False) -> None:
        """Keeps make()'s shortcut (None: none, which `find` then returns at once) under key (from `find`; None:
        nothing), where autograd records the call with grad (a `Differentiable`) and does not without; a key kept
        before is not made again."""
        if key is None or key in self._runs or (key[0] is not None) != grad or _runtime.capturing() \
                or _autotune.warming_up():
            return
        if len(self._runs) > MAX_PLANS:
            self._runs.clear()
        self._runs[key] = make()  # (None too: a signature that keeps no shortcut is not asked again)


class _Node(torch.autograd.Function):
    """The autograd node of a `Differentiable`'s call."""

    @staticmethod
    def forward(ctx, differentiable, *tensors):
        ctx.differentiable = differentiable
        return differentiable.forward(ctx, *tensors)

    @staticmethod
    def backward(ctx, *grads):
        return None, *ctx.differentiable.backward(ctx, *grads)


class Differentiable:
    """A shortcut where autograd records the call (`Shortcuts`): `forward(ctx, *tensors)` allocates and launches
    one signature's forward plan and saves what the backward reads (ctx.save_for_backward), `backward(ctx, *grads)`
    returns a gradient (or None) per tensor, through the plans `backward_plan` keeps by the gradients' layouts
    (`plan`: bounded, none kept during a capture). ctx.needs_input_grad[1:] are the tensors' flags."""

    def __init__(self):
        self._backward_plans: dict = {}

    def __call__(self, *tensors):
        return _Node.apply(self, *tensors)

    def backward_plan(self, grads: tuple, make):
        """make()'s backward plan for gradients of these layouts, made once (None, none: asked again each call)."""
        key = tuple([None if g is None else (g.shape, g.stride(), g.dtype, g.device, g.data_ptr() & 15)
                     for g in grads])  # (layouts as `find`'s; plan's look-up inlined: every backward builds it)
        found = self._backward_plans.get(key)
        return plan(self._backward_plans, key, make) if found is None else found


def shaped(t: torch.Tensor, shape) -> torch.Tensor:
    """t viewed as shape; t itself for None (a gradient already in its parameter's shape: no view's cost)."""
    return t if shape is None else t.view(shape)


class Unary(Differentiable):
    """A `Differentiable` of one tensor in and one out whose backward reads one saved tensor, the input or (with
    save_output) the output: forward_run(x) -> y; backward_run(dy, saved) -> run(dy, saved) -> dx, the backward's plan
    for dy's layout, None where it does more than allocate and launch, then backward(dy, saved) -> dx instead."""

    def __init__(self, forward_run, save_output: bool, backward_run, backward):
        super().__init__()
        self.forward_run, self.save_output, self.backward_run, self.backward_impl = \
            forward_run, save_output, backward_run, backward

    def forward(self, ctx, x):
        y = self.forward_run(x)
        ctx.save_for_backward(y if self.save_output else x)
        return y

    def backward(self, ctx, dy):
        (saved,) = ctx.saved_tensors
        run = self.backward_plan((dy,), lambda: self.backward_run(dy, saved))
        return (self.backward_impl(dy, saved) if run is None else run(dy, saved),)


def writing(like: torch.Tensor, run):
    """A shortcut that allocates an output laid out as `like` (shape, strides, dtype, device), runs
    run(out, *tensors) and returns out."""
    shape, strides, dtype, device = like.shape, like.stride(), like.dtype, like.device

    def shortcut(*tensors):
        out = torch.empty_strided(shape, strides, dtype=dtype, device=device)
        run(out, *tensors)
        return out
    return shortcut


# --- Launches ---------------------------------------------------------------------------------------------

def _fresh_scratch(size: int, alignment: int, stream):
    """Global scratch for one launch (Triton's allocator hook, for kernels that build tensor descriptors on the
    device): a new buffer from torch's caching allocator, freed after the launch in stream order. Nothing is kept:
    a kept buffer made during a CUDA graph capture or a cudagraph-tree warm-up would outlive its pool's outputs."""
    return torch.empty(size, dtype=torch.int8, device=_runtime.KERNEL_DEVICE)


def _active(hook):
    """A launch hook, or None where there is none to call. Triton's knobs hold a HookChain, never None, even
    when empty: passed on, the launcher calls it on every launch and needs the launch metadata built for it."""
    return None if hook is None or getattr(hook, "calls", None) == [] else hook


class Launch:
    """One Triton kernel on one grid with fixed constexprs: `Launch(kernel, grid, constexprs)(*args)` runs
    `kernel[grid](*args, **constexprs)`.

    A launch runs on its tensors' GPU (the first tensor argument's), made current for it where another is, on that
    GPU's current stream. Eager: after the first launch on a GPU, later calls re-launch the compiled kernel
    directly, skipping Triton's per-call argument binding and cache look-up (about 6 us of CPU time instead of 12;
    on Triton 3.6 through the compiled kernel's C launcher, `_runtime.raw_launcher`, which allocates the global
    scratch itself). The plan that holds the Launch guarantees that later `args` specialize as the first ones did
    (same dtypes, 16-byte alignment, integers).
    traced: a `wrap_triton` launch that torch.compile records in its graph (grid entries may be symbolic).
    `scratch`: the kernel builds tensor descriptors on the device, which take global scratch memory from Triton's
    allocator; that setting is per thread (autograd runs backward in threads of its own), so it is made before
    each launch.
    """

    def __init__(self, kernel, grid, constexprs: dict, scratch: bool = False, traced: bool = False):
        self.kernel, self.grid, self.constexprs = kernel, tuple(grid) + (1,) * (3 - len(grid)), constexprs
        self.scratch, self.traced = scratch, traced
        self.compiled = self.raw = None

    def __call__(self, *args):
        compiled = self.compiled
        if compiled is None or _autotune.warm_threads and _autotune.warming_up():
            self._first(*args)  # (a warm-up launches nothing: its inputs may be garbage, `compile_ahead`)
            return
        if self.device != torch._C._cuda_getDevice():  # (tensors on another GPU than the current one)
            with torch.cuda.device(self.device):
                self(*args)
            return
        stream = torch._C._cuda_getCurrentRawStream(self.device)
        hooks = triton.knobs.runtime
        enter, leave = _active(hooks.launch_enter_hook), _active(hooks.launch_exit_hook)
        metadata = None if enter is None and leave is None else compiled.launch_metadata(self.grid, stream, *args)
        if self.raw is not None:  # (the compiled kernel's C launcher, `_runtime.raw_launcher`)
            self.raw(stream, metadata, enter, leave, *args, *self.tail)
            return
        if self.scratch:
            triton.set_allocator(_fresh_scratch)
        compiled.run(*self.grid, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave,
                     *args, *self.tail)

    def _first(self, *args):
        """A traced launch, a warm-up (compiled, not launched), or the first eager launch (which keeps the compiled
        kernel where a direct launch applies)."""
        if self.scratch:
            triton.set_allocator(_fresh_scratch)
        if self.traced:
            if _runtime.INTERPRET and any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
                return  # the fake of an op (`torch_op`): only the outputs' metadata counts
            _runtime.memoize_kernel_source()  # (Inductor's collection of kernel sources: once a process)
            # Inductor's launcher of a wrap_triton kernel takes every parameter: the defaults spelled out
            defaults = {p.name: p.default for p in getattr(self.kernel, "params", ())[len(args):]
                        if p.name not in self.constexprs and p.default is not inspect.Parameter.empty}
            wrap_triton(self.kernel)[self.grid](*args, **defaults, **self.constexprs)
            return
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is not None and device.type == "cuda" and device.index != torch._C._cuda_getDevice():
            with torch.cuda.device(device):  # (Triton compiles for, and launches on, the current GPU)
                self._first(*args)
            return
        if _autotune.warming_up():  # (compiles side by side: `_autotune.warming_launches`)
            self.kernel.warmup(*args, grid=self.grid, **self.constexprs)
            return
        compiled = self.kernel[self.grid](*args, **self.constexprs)
        if _runtime.DIRECT_LAUNCH and not _runtime.INTERPRET:
            self.tail = tuple(self.constexprs.get(p.name, p.default) for p in self.kernel.params[len(args):])
            self.device = torch.cuda.current_device()
            self.compiled = compiled
            self.raw = _runtime.raw_launcher(compiled, self.grid)


_launches: dict = {}


def launch(kernel, grid, *args, scratch: bool = False, traced: bool = False, **meta) -> None:
    """`kernel[grid](*args, **meta)` for a launch that no plan holds: through a `Launch` cached by everything Triton
    specializes on (dtypes, 16-byte alignment, scalar values) and by the device (args[0]'s), whose stream the direct
    launch uses; traced: a `wrap_triton` launch. `scratch`: as for `Launch`."""
    if traced:
        Launch(kernel, grid, meta, scratch, traced=True)(*args)
        return
    key = (kernel, grid, args[0].device, *meta.items(),
           *[(a.dtype, a.data_ptr() & 15) if isinstance(a, torch.Tensor) else a for a in args])
    found = _launches.get(key)  # (plan's look-up inlined: this runs on every call of a small op)
    if found is None:
        found = plan(_launches, key, lambda: Launch(kernel, grid, meta, scratch))
    found(*args)
