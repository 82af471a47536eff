"""Probe: where dropin's Python host time goes in one CvT-13 training step (forward, cross-entropy loss, backward; no
optimizer step) of the injected model, kernels excluded, measurable without a GPU.

Answers: how many ms of host time an injected CvT-13 training step costs with every kernel launch a no-op; how many
launches (by kernel), autograd Function applies, module calls and autograd nodes a step makes (the original's
nodes and module calls beside); how that time splits over functions and files, by a sampling profile (SIGALRM
every 0.2 ms: unbiased, no per-call overhead) and by cProfile (call counts, own / cumulative us per step and per
call, inflated several times for small Python functions), and the output allocations per step by caller; what
Launch.__call__'s own Python adds per launch (its GPU fast path emulated); a what-if (trainable depthwise weights'
derived copies cached); and, per op in a loop on tiny tensors in grad mode (forward + backward), dropin's host us
against torch's own op and against a bare autograd.Function floor.

How: a small CvT-13 (HF CvtForImageClassification with CvT-13's depths 1/2/10 and heads 1/3/6, embed dims scaled
down, stochastic depth off), injected (`dropin.inject_`, verify=False); the bench's training step
(bench.models.train_step) runs `--warmup` times with real kernels (on the CPU Triton's interpreter: ~40 s, but every
plan, Launch and shortcut is then made as on the GPU, so later steps take the repeat path; nothing in the repeat
path reads data: stubbed steps run as real ones do); then `_dispatch.Launch.__call__` becomes a no-op that counts
itself (the module-level `_dispatch.launch` keeps its key and look-up and calls it). Outputs are then uninitialised
torch.empty tensors: only the time counts. --stub-first stubs before the warm-up (seconds; plans made alike, no
kernel ever runs). Timed and profiled: forward + loss + backward alone (grads set to None; the bench step also
reads the state_dict and forks and seeds the RNG, ~1.4 ms here, timed apart). On a GPU (`run` device) it takes
the real sizes (--batch 64 --image 224 --embed 64 192 384 --dtype bfloat16) and, without --stub-first, first
times real launches (host time until the last step returned, and wall).

Caveats: under the interpreter the plans are those of a CPU "device" (`_runtime.INTERPRET` branches, 4 SMs, no
TMA), so the kernels chosen and the launch count can differ from the GPU's (there: 982 launches, 203 Functions a
step; here 857 and 203); CPU tensors are cheaper to allocate than CUDA ones (the caching allocator), and the CPU
autograd engine runs the backward on the calling thread (on CUDA a device thread does: neither profile sees the
backward's Python there). The sampler charges a C function's time to the frame that called it, except where no
call instruction follows it (a tensor index `dwb[0]`, the autograd engine's C++ between two Python backwards),
whose time goes to the next Python frame entered (`_dispatch.shaped`, torch/autograd/function.py's apply).

Usage: PYTHONPATH=src python3 benchmarks/probes/host_stub.py [--batch 2] [--image 64] [--embed 16 48 96]
[--dtype float32] [--steps 20] [--profile-steps 5] [--sample-steps 200] [--top 40] [--warmup 1] [--stub-first]
[--emulate-launch] [--no-ops] [--original] (~1 min on the CPU, 15 s with --stub-first; --emulate-launch: the
profiles with Launch.__call__'s fast-path Python; --original: the un-injected model's step too, whose torch ops
compute: on the CPU a bound only)."""
import argparse
import collections
import copy
import cProfile
import os
import pstats
import sys
import time

import torch

import dropin
from dropin import _runtime
from dropin.bench import models
from dropin.ops import _dispatch

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src", "dropin")

launches = collections.Counter()  # Launch -> calls
applies = collections.Counter()  # autograd Function class -> applies


def _kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", repr(kernel))


def stub_launches(emulate: bool) -> None:
    """Every Triton launch (`_dispatch.Launch.__call__`) a no-op that counts itself; with emulate, one that runs the
    Python of its GPU fast path around a do-nothing raw launcher. The module-level `_dispatch.launch` (launches that
    no plan holds) keeps its own key building and Launch look-up, then calls the stubbed Launch."""
    import triton

    def raw(stream, metadata, enter, leave, *args):
        pass

    def emulated(self, *args):
        launches[self] += 1
        # _dispatch.Launch.__call__'s fast path; the CUDA stream look-up and the C launcher stood in for
        stream = _stream(0)
        hooks = triton.knobs.runtime
        enter, leave = _dispatch._active(hooks.launch_enter_hook), _dispatch._active(hooks.launch_exit_hook)
        metadata = None if enter is None and leave is None else None
        tail = getattr(self, "tail", None)
        if tail is None:
            self.tail = tail = tuple(self.constexprs.get(p.name, p.default)
                                     for p in getattr(self.kernel, "params", ())[len(args):])
        raw(stream, metadata, enter, leave, *args, *tail)

    def counted(self, *args):
        launches[self] += 1

    _dispatch.Launch.__call__ = emulated if emulate else counted


def by_kernel() -> collections.Counter:
    """The launches counted, by kernel name."""
    out = collections.Counter()
    for launch, n in launches.items():
        out[_kernel_name(launch.kernel)] += n
    return out


def _stream(device):
    """Stands in for torch._C._cuda_getCurrentRawStream."""
    return 0


def count_applies():
    """Counts autograd Function applies by class (torch.autograd.Function.apply wrapped); returns the undo."""
    original = torch.autograd.Function.__dict__["apply"]  # (torch 2.14: _FunctionBase's C classmethod)

    def apply(cls, *args, **kwargs):
        applies[cls.__qualname__] += 1
        return original.__get__(None, cls)(*args, **kwargs)
    torch.autograd.Function.apply = classmethod(apply)
    return lambda: setattr(torch.autograd.Function, "apply", original)


def build(batch: int, image: int, embed: list, dtype=torch.float32):
    from transformers import CvtConfig, CvtForImageClassification

    # CvT-13's structure (depths 1/2/10, heads 1/3/6, cls token in stage 3); the embed dims scaled down
    config = CvtConfig(num_labels=1000, embed_dim=embed, num_heads=[1, 3, 6], depth=[1, 2, 10],
                       drop_path_rate=[0.0, 0.0, 0.0])
    torch.manual_seed(0)
    model = CvtForImageClassification(config).eval().to(_runtime.KERNEL_DEVICE, dtype)
    inputs = (torch.randn(batch, 3, image, image, device=_runtime.KERNEL_DEVICE, dtype=dtype),)
    labels = models.training_labels(model, inputs)
    original = models.TrainingLoss(model.train(), labels)
    grad = models.upstream_gradient(original, inputs)
    return original, inputs, grad


def step_of(model, inputs, grad):
    return lambda: models.train_step(model, model, inputs, grad)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step, n: int, wall: bool = False):
    """ms per step, the fastest of 3 loops of n steps (host time: until the last step returned); with wall, (host,
    wall): wall until the device finished too."""
    best, best_wall = float("inf"), float("inf")
    for _ in range(3):
        _sync()
        start = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, (time.perf_counter() - start) / n * 1e3)
        _sync()
        best_wall = min(best_wall, (time.perf_counter() - start) / n * 1e3)
    return (best, best_wall) if wall else best


def _where(key) -> str:
    filename, line, name = key
    if filename.startswith(SRC):
        return f"dropin/{os.path.relpath(filename, SRC)}:{line}({name})"
    if "site-packages" in filename:
        return f"{filename.split('site-packages/')[1]}:{line}({name})"
    return f"{filename}:{line}({name})" if line else name


_ALLOCATORS = ("<built-in method torch.empty>", "<built-in method torch.empty_strided>",
               "<built-in method torch.empty_like>", "<method 'new_empty' of 'torch._C.TensorBase' objects>",
               "<built-in method torch.zeros>", "<method 'new_zeros' of 'torch._C.TensorBase' objects>")


def print_profile(profile, steps: int, top: int) -> None:
    stats = pstats.Stats(profile).stats  # key -> (primitive calls, calls, own s, cumulative s, callers)
    rows = [(key, calls, own, cum) for key, (_, calls, own, cum, _) in stats.items()]
    total = sum(own for _, _, own, _ in rows)
    print(f"\nprofiled: {total / steps * 1e3:.2f} ms own time per step (cProfile's overhead included)")

    def table(title, chosen, sort):
        print(f"\n{title}\n{'calls/step':>10s} {'own us/step':>11s} {'cum us/step':>11s} {'own us/call':>11s} "
              f"{'cum us/call':>11s}  function")
        for key, calls, own, cum in sorted(chosen, key=sort, reverse=True)[:top]:
            print(f"{calls / steps:10.1f} {own / steps * 1e6:11.1f} {cum / steps * 1e6:11.1f} "
                  f"{own / calls * 1e6:11.2f} {cum / calls * 1e6:11.2f}  {_where(key)}")

    dropin_rows = [r for r in rows if r[0][0].startswith(SRC)]
    other = [r for r in rows if not r[0][0].startswith(SRC)]
    print(f"dropin's own functions: {sum(r[2] for r in dropin_rows) / steps * 1e3:.2f} ms own time per step; "
          f"everything else (torch, C builtins, HF, the probe): {sum(r[2] for r in other) / steps * 1e3:.2f}")
    table("dropin's functions by own time", dropin_rows, lambda r: r[2])
    table("dropin's functions by cumulative time", dropin_rows, lambda r: r[3])
    table("the rest (torch, builtins, HF) by own time", other, lambda r: r[2])

    allocations = collections.Counter()
    for key, (_, _, _, _, callers) in stats.items():
        if key[2] in _ALLOCATORS:
            for caller, (_, calls, _, _) in callers.items():
                allocations[(key[2], caller)] += calls
    total = sum(allocations.values())
    print(f"\nallocations ({', '.join(sorted(_ALLOCATORS))}): {total / steps:.0f} per step, by caller")
    for (name, caller), calls in allocations.most_common(top):
        short = name.split("'")[1] if "'" in name else name.rstrip(">").split(".")[-1]
        print(f"{calls / steps:8.1f}  {short} in {_where(caller)}")


# --- a sampling profile (no per-call overhead: cProfile inflates small Python functions several times) ----------

class Sampler:
    """Samples the main thread's Python stack every `interval` s of wall time (SIGALRM from ITIMER_REAL; ITIMER_PROF
    ticks at the kernel's HZ, 4 ms). A sample's leaf is the Python frame running (a C function's time, torch.empty's
    say, goes to the frame that called it; time inside the autograd engine's C++ between two Python backwards goes
    to the next Python frame it enters)."""

    def __init__(self, interval: float = 2e-4):
        self.interval, self.samples = interval, 0
        self.own, self.inclusive = collections.Counter(), collections.Counter()

    def _handler(self, signum, frame):
        self.samples += 1
        seen = set()
        leaf = True
        while frame is not None:
            code = frame.f_code
            key = (code.co_filename, code.co_firstlineno, code.co_name)
            if leaf:
                self.own[key] += 1
                leaf = False
            if key not in seen:
                seen.add(key)
                self.inclusive[key] += 1
            frame = frame.f_back

    def run(self, fn):
        import signal
        previous = signal.signal(signal.SIGALRM, self._handler)
        signal.setitimer(signal.ITIMER_REAL, self.interval, self.interval)
        try:
            fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            signal.signal(signal.SIGALRM, previous)


def print_samples(sampler: Sampler, ms_per_step: float, top: int) -> None:
    """Own and inclusive shares of the samples, as us per step of the unprofiled step time."""
    n = max(sampler.samples, 1)
    us = ms_per_step * 1e3 / n
    print(f"\nsampled: {sampler.samples} samples; us per step = share x {ms_per_step:.2f} ms (the unprofiled step)")

    def table(title, counter, keep):
        print(f"\n{title}\n{'us/step':>9s} {'share':>6s}  function")
        for key, count in [kc for kc in counter.most_common() if keep(kc[0])][:top]:
            print(f"{count * us:9.1f} {count / n:6.1%}  {_where(key)}")

    table("own time (leaf Python frame, with the C functions it calls), all code", sampler.own, lambda k: True)
    table("inclusive time, dropin's functions", sampler.inclusive, lambda k: k[0].startswith(SRC))
    files = collections.Counter()
    for key, count in sampler.own.items():
        files[_where((key[0], 0, "")).split(":")[0] if key[0].startswith(SRC) or "site-packages" in key[0]
              else key[0]] += count
    print(f"\nown time by file\n{'us/step':>9s} {'share':>6s}  file")
    for name, count in files.most_common(25):
        print(f"{count * us:9.1f} {count / n:6.1%}  {name}")


def graph_census(model, inputs, grad) -> tuple:
    """(autograd nodes by type, module calls) of one forward + loss: the backward's nodes that the engine runs (each
    costs engine C++ time, a Python one a call too) and the nn.Module calls (each costs torch's _call_impl)."""
    calls = [0]

    def count(module, args):
        calls[0] += 1
    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        loss = (model(*inputs) * grad).sum()
    finally:
        handle.remove()
    nodes, seen, stack = collections.Counter(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes[type(node).__name__] += 1
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return nodes, calls[0]


def bare_step_of(model, inputs, grad):
    """Forward, loss, backward alone (the bench's train_step also reads the state_dict and seeds the RNG)."""
    params = [p for p in model.parameters()]

    def step():
        for p in params:
            p.grad = None
        (model(*inputs) * grad).sum().backward()
    return step


def cache_trainable_derived() -> None:
    """What-if: `conv2d.weights.derived` keeps a trainable weight's copy per version as it does a frozen one's (it
    makes it anew every call, for FSDP2's sake: the mirrored weight of the depthwise walk's input gradient, the
    direct forward's channel-major copy, the TMA paths' layouts)."""
    from dropin.ops.conv2d import weights

    original = weights.derived

    def derived(w, kind, make, traced):
        if isinstance(w, torch.nn.Parameter) and w.requires_grad and not traced:
            key = (id(w), kind)
            hit = weights._DERIVED.get(key)
            if hit is not None and hit[1] == w._version:
                return hit[2]
            out = make(w)
            weights._DERIVED[key] = (None, w._version, out)
            return out
        return original(w, kind, make, traced)
    for module in list(sys.modules.values()):
        if getattr(module, "derived", None) is original:
            module.derived = derived


# --- single ops in a loop --------------------------------------------------------------------------------------

def _op_cases():
    import torch.nn.functional as F

    from dropin import ops

    def t(*shape, grad=True):
        return torch.randn(*shape, device=_runtime.KERNEL_DEVICE, requires_grad=grad)

    cases = []

    def case(name, make, dropin_fn, torch_fn):
        cases.append((name, make, dropin_fn, torch_fn))

    case("layer_norm [2*64,48]", lambda: (t(128, 48), t(48), t(48)),
         lambda x, w, b: ops.layer_norm(x, (48,), w, b, 1e-5), lambda x, w, b: F.layer_norm(x, (48,), w, b, 1e-5))
    case("linear [2,64,48]x[48,48]", lambda: (t(2, 64, 48), t(48, 48), t(48)), ops.linear, F.linear)
    case("linear+gelu [2,64,48]x[192,48]", lambda: (t(2, 64, 48), t(192, 48), t(192)),
         lambda x, w, b: ops.linear(x, w, b, activation="gelu"), lambda x, w, b: F.gelu(F.linear(x, w, b)))
    return cases


class _Bare(torch.autograd.Function):
    """The floor: one output and gradients allocated (empty_like), nothing else."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.inputs = tensors
        return torch.empty_like(tensors[0])

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.empty_like(t) if need else None for t, need in zip(ctx.inputs, ctx.needs_input_grad))


def op_us(make, fn, calls: int = 300) -> float:
    """us per forward + backward (grad mode, upstream gradient given), the fastest of 5 loops."""
    inputs = make()

    def call():
        out = fn(*inputs)
        out.backward(grad)
    with torch.no_grad():
        grad = torch.ones_like(fn(*inputs))
    for _ in range(20):
        call()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def op_table(profile_top: int) -> None:
    print("\nsingle ops, grad mode, forward + backward, us of host time per call (launches stubbed; torch computes "
          "on the CPU, a bound only)")
    print(f"{'op':34s} {'dropin':>8s} {'floor':>8s} {'excess':>8s} {'torch':>8s} {'launches':>8s} {'applies':>8s}")
    for name, make, dropin_fn, torch_fn in _op_cases():
        try:
            ours = op_us(make, dropin_fn)
            floor = op_us(make, lambda *ts: _Bare.apply(*ts))
            peer = op_us(make, torch_fn)
            inputs = make()
            launches.clear()
            applies.clear()
            restore = count_applies()
            dropin_fn(*inputs).sum().backward()
            restore()
        except Exception as e:  # noqa: BLE001 (a line with the error; the others still run)
            print(f"{name:34s} error {type(e).__name__}: {e}")
            continue
        n_launch = sum(launches.values())
        print(f"{name:34s} {ours:8.1f} {floor:8.1f} {ours - floor:8.1f} {peer:8.1f} {n_launch:8d} "
              f"{sum(applies.values()):8d}")
        if profile_top:
            inputs = make()
            with torch.no_grad():
                grad = torch.ones_like(dropin_fn(*inputs))
            profile = cProfile.Profile()
            profile.runcall(lambda: [dropin_fn(*inputs).backward(grad) for _ in range(200)])
            stats = pstats.Stats(profile).stats
            rows = sorted(((k, v[1], v[2], v[3]) for k, v in stats.items()), key=lambda r: r[2], reverse=True)
            print("  top by own time (us per op call, cProfile): " + "; ".join(
                f"{_where(k)} x{c / 200:.0f} {own / 200 * 1e6:.1f}" for k, c, own, _ in rows[:profile_top]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--embed", type=int, nargs=3, default=[16, 48, 96])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--sample-steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=1, help="steps with real (interpreted) kernels")
    parser.add_argument("--stub-first", action="store_true", help="stub launches before the warm-up")
    parser.add_argument("--emulate-launch", action="store_true")
    parser.add_argument("--no-ops", action="store_true", help="skip the single-op table")
    parser.add_argument("--original", action="store_true", help="also time the un-injected model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    torch.set_num_threads(1)  # (tiny CPU ops: threads add noise, not speed)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, interpreter {_runtime.INTERPRET}, CvT-13 structure, embed {args.embed}, "
          f"batch {args.batch}, image {args.image}x{args.image}, {args.dtype} on {device}")

    original, inputs, grad = build(args.batch, args.image, args.embed, getattr(torch, args.dtype))
    injected = copy.deepcopy(original)
    dropin.inject_(injected, verify=False)
    replaced = sum(1 for m in injected.modules() if isinstance(m, dropin.nn.DropinModule))
    print(f"injected: {replaced} dropin modules")
    step = step_of(injected, inputs, grad)

    if args.stub_first:
        stub_launches(args.emulate_launch)
    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _sync()
    print(f"warm-up: {args.warmup} step(s) in {time.perf_counter() - start:.1f} s "
          f"({'stubbed' if args.stub_first else 'real kernels'})")
    if not args.stub_first:
        if torch.cuda.is_available():  # the real thing first: kernels launched
            host, wall = timed(bare_step_of(injected, inputs, grad), args.steps, wall=True)
            print(f"real launches, forward + loss + backward: {wall:.2f} ms per step, host until the last step "
                  f"returned {host:.2f}")
            if args.original:
                host, wall = timed(bare_step_of(original, inputs, grad), args.steps, wall=True)
                print(f"original model, forward + loss + backward: {wall:.2f} ms per step, host until the last step "
                      f"returned {host:.2f}")
        stub_launches(args.emulate_launch)
    for _ in range(2):  # (anything made on a stubbed step's first sight)
        step()

    launches.clear()
    restore = count_applies()
    step()
    restore()
    n_launch, n_apply = sum(launches.values()), sum(applies.values())
    print(f"\nper step: {n_launch} launches, {n_apply} autograd Function applies")
    print("  launches by kernel: " + ", ".join(f"{k} {v}" for k, v in by_kernel().most_common()))
    print(f"  distinct Launch objects: {len(launches)}; module-level `_dispatch.launch` cache: "
          f"{len(_dispatch._launches)} entries")
    print("  applies by class: " + ", ".join(f"{k} {v}" for k, v in applies.most_common()))
    for name, model in (("dropin", injected), ("original", original)):
        nodes, calls = graph_census(model, inputs, grad)
        print(f"  {name}: {calls} module calls, {sum(nodes.values())} autograd nodes: "
              + ", ".join(f"{k} {v}" for k, v in nodes.most_common(14)))

    ms = timed(step, args.steps)
    print(f"\nstubbed bench step (bench.models.train_step, no-op launches): {ms:.2f} ms per step (fastest of 3 loops "
          f"of {args.steps}); {ms / max(n_launch, 1) * 1e3:.1f} us per launch, {ms / max(n_apply, 1) * 1e3:.1f} us "
          f"per Function apply")
    bare = bare_step_of(injected, inputs, grad)
    bare_ms = timed(bare, args.steps)
    print(f"forward + loss + backward alone (no state_dict, no RNG fork/seed): {bare_ms:.2f} ms per step")
    stub_launches(emulate=True)
    emulated_ms = timed(bare, args.steps)
    stub_launches(emulate=args.emulate_launch)
    print(f"  with Launch.__call__'s GPU fast-path Python emulated: {emulated_ms:.2f} ms per step "
          f"(+{(emulated_ms - bare_ms) / max(n_launch, 1) * 1e3:.2f} us per launch; the C launcher not counted)")
    with torch.no_grad():
        forward_ms = timed(lambda: injected(*inputs), args.steps)
    print(f"  no_grad forward alone: {forward_ms:.2f} ms")
    if args.original:
        host, wall = timed(bare_step_of(original, inputs, grad), args.steps, wall=True)
        print(f"original model, forward + loss + backward (its kernels run: on the CPU a bound only): "
              f"{wall:.2f} ms per step (host {host:.2f})")

    sampler = Sampler()
    sampler.run(lambda: [bare() for _ in range(args.sample_steps)])
    print_samples(sampler, bare_ms, args.top)

    profile = cProfile.Profile()
    profile.runcall(lambda: [bare() for _ in range(args.profile_steps)])
    print_profile(profile, args.profile_steps, args.top)

    cache_trainable_derived()
    bare()
    print(f"\nwhat-if, trainable depthwise weights' derived copies cached per version: {timed(bare, args.steps):.2f} "
          f"ms per step (against {bare_ms:.2f})")

    if not args.no_ops:
        op_table(8)


if __name__ == "__main__":
    main()
