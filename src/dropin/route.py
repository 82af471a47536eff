"""The route for functional code: torch functions called under `use()` (or between `enable()` and `disable()`) run
dropin's ops where dropin supports the call, and torch's own otherwise; every call is counted (`route_report`).

`inject_` swaps modules; code that calls F.conv2d, torch.matmul, `x @ w` or F.scaled_dot_product_attention in its
own forward reaches dropin only through this route. Module forwards that call those functions (nn.Linear's F.linear,
nn.Conv2d's F.conv2d, ...) are routed too.

Mechanism: a `torch.overrides.TorchFunctionMode`. Every torch function call made on the thread reaches its
`__torch_function__`, which looks the function up in `ROUTES`: functions not there go straight to torch; a routed
function's arguments are checked (tensors on the kernels' device: CUDA, or the CPU under the Triton interpreter;
float32 / float16 / bfloat16; supported arguments), then dropin's public op runs, which raises for what its own
checks refuse: that call, too, falls back to torch (which then raises torch's own error for a wrong call).
- Re-entrancy: torch pops the mode while its `__torch_function__` runs, so dropin's ops (and torch, in a fallback)
  run their own torch calls unrouted. A backward started under the route (`loss.backward()`, `autograd.grad`) runs
  unrouted for the same reason: dropin's ops are differentiable, so gradients flow through routed calls.
- Threads: torch keeps function modes per thread; `enable()` and `use()` route the calling thread's calls only.
  The counters are shared by all threads.
- torch.compile: dynamo traces through the mode; the route decides at trace time, and the graph holds dropin's
  custom ops where it routed. Calls decided while tracing are not counted (a compiled call runs no Python per op).
"""
import contextlib
import dataclasses
import threading
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import _runtime, ops

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# What dropin's ops raise for a call they do not support (their checks' error types, as torch's peers raise).
_REFUSALS = (TypeError, ValueError, RuntimeError, NotImplementedError)


# --- Checks: each returns why the call stays with torch, or None ---------------------------------------------

def _unsupported(*tensors) -> Optional[str]:
    """Why dropin's kernels cannot take these float operands (None entries skipped), or None."""
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"{type(t).__name__} operand"
        if type(t) not in _PLAIN_TENSORS:
            return f"tensor subclass {type(t).__name__}"
        if t.device.type != _runtime.KERNEL_DEVICE:
            return f"{t.device.type} tensor"
        if t.dtype not in _FLOAT_DTYPES:
            return f"dtype {str(t.dtype).removeprefix('torch.')} unsupported"
    return None


def _argument(name: str, value, supported: bool) -> Optional[str]:
    """None where `supported`, else why `name=value` stays with torch."""
    return None if supported else f"argument {name}={value!r} unsupported"


# --- Routes: the torch function's own signature; dropin's result, or a string saying why the call stays with torch

def _linear(input, weight, bias=None):
    return _unsupported(input, weight, bias) or ops.linear(input, weight, bias)


def _matmul(input, other):
    return _unsupported(input, other) or ops.matmul(input, other)


def _mm(input, mat2):
    return (_unsupported(input, mat2) or _argument("dims", (input.dim(), mat2.dim()), input.dim() == mat2.dim() == 2)
            or ops.matmul(input, mat2))


def _bmm(input, mat2):
    return _unsupported(input, mat2) or ops.bmm(input, mat2)


def _conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _unsupported(input, weight, bias) or ops.conv2d(input, weight, bias, stride, padding, dilation, groups)


def _conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _unsupported(input, weight, bias) or ops.conv1d(input, weight, bias, stride, padding, dilation, groups)


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    mask_device = _runtime.KERNEL_DEVICE if attn_mask is None else attn_mask.device.type
    return (_unsupported(query, key, value) or _argument("dropout_p", dropout_p, dropout_p == 0)
            or _argument("attn_mask device", mask_device, mask_device == _runtime.KERNEL_DEVICE)
            or ops.attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa))


def _layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    return _unsupported(input, weight, bias) or ops.layer_norm(input, normalized_shape, weight, bias, eps)


def _group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    return _unsupported(input, weight, bias) or ops.group_norm(input, num_groups, weight, bias, eps)


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    """dropin's rms_norm is HF's (over the last dim, a weight, the promoted dtype): F.rms_norm with a weight of
    the input's dtype over the last dim."""
    reason = _unsupported(input, weight) or _argument("weight", weight, weight is not None)
    if reason:
        return reason
    dims = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    return (_argument("normalized_shape", dims, len(dims) == 1)
            or _argument("weight dtype", weight.dtype, weight.dtype == input.dtype)
            or ops.rms_norm(input, weight, eps))


def _along(op: Callable, input, dim, dtype):
    """op(input.to(dtype), dim) for softmax and log_softmax (torch casts before the op, too)."""
    if dtype is not None and isinstance(input, torch.Tensor):
        input = input.to(dtype)
    return _unsupported(input) or _argument("dim", dim, isinstance(dim, int)) or op(input, dim)


def _softmax(input, dim, dtype=None):  # torch.softmax, Tensor.softmax
    return _along(ops.softmax, input, dim, dtype)


def _log_softmax(input, dim, dtype=None):  # torch.log_softmax, Tensor.log_softmax
    return _along(ops.log_softmax, input, dim, dtype)


def _f_softmax(input, dim=None, _stacklevel=3, dtype=None):  # F.softmax
    return _along(ops.softmax, input, dim, dtype)


def _f_log_softmax(input, dim=None, _stacklevel=3, dtype=None):  # F.log_softmax
    return _along(ops.log_softmax, input, dim, dtype)


def _activation(kind: str):
    """The route of an activation F.<kind>(input, inplace=False) (also torch.<kind>, Tensor.<kind>)."""
    def route(input, inplace=False):
        return _unsupported(input) or _argument("inplace", inplace, not inplace) or ops.activation(input, kind)
    return route


def _gelu(input, approximate="none"):
    return (_unsupported(input) or _argument("approximate", approximate, approximate in ("none", "tanh"))
            or ops.gelu(input, approximate))


def _max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    return (_unsupported(input) or _argument("return_indices", return_indices, not return_indices)
            or ops.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode))


def _avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    return _unsupported(input) or ops.avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad,
                                                 divisor_override)


def _adaptive_avg_pool2d(input, output_size):
    return _unsupported(input) or ops.adaptive_avg_pool2d(input, output_size)


def _batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    return (_unsupported(input, running_mean, running_var, weight, bias)
            or ops.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps))


@dataclasses.dataclass(frozen=True)
class Route:
    """A torch function's way to dropin: `name` (as the report shows it), `to_dropin` (its route) and the keyword
    arguments that route takes (any other keyword, e.g. out=, stays with torch)."""
    name: str
    to_dropin: Callable
    keywords: frozenset


def _routes(*entries) -> dict:
    table = {}
    for functions, name, to_dropin in entries:
        keywords = frozenset(to_dropin.__code__.co_varnames[:to_dropin.__code__.co_argcount])
        for function in functions:
            table[function] = Route(name, to_dropin, keywords)
    return table


# The torch functions routed: torch function -> Route. (F.conv2d is torch.conv2d; `x @ w` calls Tensor.matmul.)
ROUTES = _routes(
    ([F.linear], "F.linear", _linear),
    ([torch.matmul, torch.Tensor.matmul], "matmul / @", _matmul),
    ([torch.mm, torch.Tensor.mm], "mm", _mm),
    ([torch.bmm, torch.Tensor.bmm], "bmm", _bmm),
    ([F.conv2d], "F.conv2d", _conv2d),
    ([F.conv1d], "F.conv1d", _conv1d),
    ([F.scaled_dot_product_attention], "F.scaled_dot_product_attention", _attention),
    ([F.layer_norm], "F.layer_norm", _layer_norm),
    ([F.group_norm], "F.group_norm", _group_norm),
    ([F.rms_norm], "F.rms_norm", _rms_norm),
    ([torch.softmax, torch.Tensor.softmax], "softmax", _softmax),
    ([F.softmax], "F.softmax", _f_softmax),
    ([torch.log_softmax, torch.Tensor.log_softmax], "log_softmax", _log_softmax),
    ([F.log_softmax], "F.log_softmax", _f_log_softmax),
    ([F.relu, torch.relu, torch.Tensor.relu], "relu", _activation("relu")),
    ([F.relu6], "F.relu6", _activation("relu6")),
    ([F.silu], "F.silu", _activation("silu")),
    ([F.gelu], "F.gelu", _gelu),
    ([F.max_pool2d], "F.max_pool2d", _max_pool2d),
    ([F.avg_pool2d], "F.avg_pool2d", _avg_pool2d),
    ([F.adaptive_avg_pool2d], "F.adaptive_avg_pool2d", _adaptive_avg_pool2d),
    ([F.batch_norm], "F.batch_norm", _batch_norm),
)


# --- Counters ---------------------------------------------------------------------------------------------------

_ROUTED = "routed"
_counts: dict = {}  # (route name, _ROUTED or the reason of a fallback) -> calls
_counts_lock = threading.Lock()


def _count(name: str, outcome: str) -> None:
    if torch.compiler.is_compiling():  # (a count read while tracing would become a guard: a recompile per call)
        return
    with _counts_lock:
        _counts[name, outcome] = _counts.get((name, outcome), 0) + 1


@dataclasses.dataclass
class RouteReport:
    """Calls seen by the route: `routed` (name -> calls that ran dropin's op) and `fallbacks` ((name, reason) ->
    calls left to torch); `print(report)` shows them as a table."""
    routed: dict
    fallbacks: dict

    def __str__(self) -> str:
        lines = [f"dropin route: {sum(self.routed.values())} calls routed to dropin, "
                 f"{sum(self.fallbacks.values())} left to torch"]
        width = max((len(name) for name in [*self.routed, *(n for n, _ in self.fallbacks)]), default=0)
        lines += [f"  {name:{width}s}  routed    {n:8d}" for name, n in sorted(self.routed.items())]
        lines += [f"  {name:{width}s}  fallback  {n:8d}  {reason}"
                  for (name, reason), n in sorted(self.fallbacks.items())]
        return "\n".join(lines)


def route_report(reset: bool = False) -> RouteReport:
    """The route's counts since the process started (or the last reset); reset=True clears them after reading."""
    with _counts_lock:
        counts = dict(_counts)
        if reset:
            _counts.clear()
    return RouteReport(routed={name: n for (name, outcome), n in counts.items() if outcome == _ROUTED},
                       fallbacks={key: n for key, n in counts.items() if key[1] != _ROUTED})


# --- The mode and its switches ----------------------------------------------------------------------------------

class RouteMode(TorchFunctionMode):
    """Sends each torch function in ROUTES to dropin where the call is supported, to torch otherwise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = ROUTES.get(func)
        if route is None:
            return func(*args, **kwargs)
        extra = sorted(k for k in kwargs if k not in route.keywords)  # (dynamo traces no set difference of keys)
        if extra:
            outcome = f"kwarg {extra[0]}"
        else:
            try:
                outcome = route.to_dropin(*args, **kwargs)
            except _REFUSALS as e:
                outcome = f"dropin: {str(e).splitlines()[0][:160]}"
        if not isinstance(outcome, str):
            _count(route.name, _ROUTED)
            return outcome
        _count(route.name, outcome)
        return func(*args, **kwargs)


_thread = threading.local()  # .mode: the RouteMode this thread entered through enable(), or None


def enabled() -> bool:
    """Whether the route is on for the calling thread."""
    return getattr(_thread, "mode", None) is not None


def enable() -> None:
    """Routes the calling thread's torch function calls to dropin where supported, until `disable()`. Calling it
    again while on does nothing (one route, not a stack of them)."""
    if enabled():
        return
    mode = RouteMode()
    mode.__enter__()
    _thread.mode = mode


def disable() -> None:
    """Turns the calling thread's route off (nothing while it is off). RuntimeError where another
    TorchFunctionMode entered after `enable()` is still active: torch's modes leave in the order they came."""
    if not enabled():
        return
    stack = torch.overrides._get_current_function_mode_stack()
    if not stack or stack[-1] is not _thread.mode:
        raise RuntimeError("dropin.disable(): a TorchFunctionMode entered after dropin.enable() is still active; "
                           "exit it first")
    _thread.mode.__exit__(None, None, None)
    _thread.mode = None


@contextlib.contextmanager
def use():
    """`with dropin.use(): ...`: the route on for the block (see `enable`), then as it was before it (also when
    the block raises); nested blocks share one route."""
    was_enabled = enabled()
    enable()
    try:
        yield
    finally:
        if not was_enabled:
            disable()
