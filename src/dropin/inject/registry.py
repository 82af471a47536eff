"""Handlers keyed by module type: each turns one torch module into a dropin module, or says why it cannot.

A handler is `fn(module, site) -> DropinModule | str` (the str is the reason the module stays torch), registered
for types with `@register(Type, ..., op="conv2d")` in the file of its model family. `op` names the dropin
op the handler uses (InjectConfig.ops can switch it off); op=None marks a handler that only explains why a type
stays torch. A subclass without a handler of its own is handled as its nearest registered base where it computes
as that base (`computes_as`: the same forward, whatever the class's name). A type with no registered base is
offered to the recognizers (`@recognizer`), which may find it a handler by what its code computes (`same_code`:
another library's class whose forward is a registered one's, written again), else it stays torch.
"""
import dis
import functools
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .. import _runtime
from ..nn import TracedBlock

HANDLERS: dict = {}  # type -> (op, fn)
CHAINS: dict = {}  # parent type -> [names of children that its forward runs one after the other, ...]


def register(*types, op: Optional[str]):
    def decorate(fn: Callable):
        for t in types:
            HANDLERS[t] = (op, fn)
        return fn
    return decorate


def chain(parent_type: type, *names: str) -> None:
    """Declares that `parent_type`'s forward runs these children in this order, each on the previous one's
    output alone (so they may fuse, as in an nn.Sequential)."""
    CHAINS.setdefault(parent_type, []).append(names)


def ops() -> set:
    """Names of the ops that the registered handlers use."""
    return {op for op, _ in [*HANDLERS.values(), *ROOT_HANDLERS.values()] if op is not None}


ROOT_HANDLERS: dict = {}  # model type -> (op, fn(model, config) -> a forward for the model instance, or the reason)


def register_root(kind: type, op: str, fn: Callable) -> None:
    """Registers fn for the models of type `kind` (and of types whose forward has its code, `same_code`) that
    inject_ is given as the root: fn returns the forward that inject_ sets on the instance (revert_ removes it)."""
    ROOT_HANDLERS[kind] = (op, fn)


def handle_root(model: torch.nn.Module, config):
    """The root handler's forward for `model`, or the reason it keeps its own; None where no root handler takes its
    type."""
    kind = type(model)
    reference = next((t for t in ROOT_HANDLERS if t is kind or same_code(kind, t)), None)
    if reference is None:
        return None
    op, fn = ROOT_HANDLERS[reference]
    if not config.uses(op):
        return f"op '{op}' is switched off by the config"
    return fn(model, config)


@dataclass
class Site:
    """Where a module sits: its parent, its name there, its dotted path in the model, and the config."""
    parent: torch.nn.Module
    name: str
    path: str
    config: "InjectConfig"  # noqa: F821  (api.InjectConfig)

    def following(self) -> list:
        """(name, module) of the siblings that run right after this module, each on the previous one's output
        alone: those after it in an nn.Sequential (one whose forward is nn.Sequential's), in a declared chain, or in
        a chain its parent's forward runs (`traced_chains`); [] elsewhere. nn.Identity siblings are passed over
        (they stay, computing nothing)."""
        parent = self.parent
        if isinstance(parent, torch.nn.Sequential) and type(parent).forward is torch.nn.Sequential.forward:
            names = list(parent._modules)
        else:
            declared = CHAINS.get(type(parent))
            chains = declared if declared is not None else traced_chains(parent)
            names = next((c for c in chains if self.name in c), [self.name])
        return [(n, parent._modules[n]) for n in names[names.index(self.name) + 1:]
                if not _is_identity(parent._modules[n])]


def _is_identity(module: Optional[torch.nn.Module]) -> bool:
    return module is not None and computes_as(module, torch.nn.Identity)


_TRACED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # parent module -> its traced chains
FUSION_HEADS: set = set()  # types whose drop-ins take the siblings that follow them (the handler files add them)
FUSION_FOLLOWERS: set = set()  # types that such a drop-in may take


def fusion_roles(heads=(), followers=()) -> None:
    """Declares module types whose calls may open (heads) or continue (followers) a fusion: only a parent with a
    child of each kind has its forward traced (`traced_chains`)."""
    FUSION_HEADS.update(heads)
    FUSION_FOLLOWERS.update(followers)


def traced_chains(parent: torch.nn.Module) -> list:
    """The chains of `parent`'s children that its forward runs one on another's output alone, found by tracing that
    forward one level deep (torch.fx, every child a leaf; arguments with defaults fixed to them): runs of child calls
    where each child after the first is called once in the forward, with the previous call's output as its only
    argument, and that output feeds nothing else (nn.Identity calls in between are passed through). This is how a
    block written with attributes (timm's, HF's, a user's: `x = self.act(self.bn(self.conv(x)))`) fuses as an
    nn.Sequential does. [] where the forward does not trace (data-dependent control flow, ...) or where no child
    could open and none continue a fusion: the children are then handled one by one. Made once per parent."""
    if isinstance(parent, TracedBlock):  # (its generated forward calls the children as the original's did)
        return traced_chains(parent.original)
    found = _TRACED.get(parent)
    if found is None:
        children = list(parent._modules.values())
        heads, followers = tuple(FUSION_HEADS), tuple(FUSION_FOLLOWERS)
        fusable = any(isinstance(c, heads) for c in children) and any(isinstance(c, followers) for c in children)
        found = _TRACED[parent] = _trace_chains(parent) if fusable else []
    return found


class OneLevelTrace:
    """A parent's forward traced one level deep (torch.fx, every child a leaf; arguments with defaults fixed to them),
    and what its graph says of the children's calls. `trace` returns None where the forward does not trace."""

    def __init__(self, parent: torch.nn.Module, graph, constants: dict):
        self.parent, self.graph, self.constants = parent, graph, constants
        self.modules = parent._modules
        self.calls = [n for n in graph.nodes if self.child(n) is not None and not _is_identity(self.module(n))]
        names = {self.child(n) for n in self.calls}
        self.count = {name: sum(self.child(n) == name for n in self.calls) for name in names}

    @staticmethod
    def trace(parent: torch.nn.Module) -> Optional["OneLevelTrace"]:
        """The trace, or None. The tensor constants of the forward, which torch.fx keeps as attributes of the module
        it traces, are taken off `parent` (into `constants`)."""
        from torch import fx

        class OneLevel(fx.Tracer):
            def is_leaf_module(self, module, qualified_name):
                return True

        attributes, constants = set(vars(parent)), {}
        try:
            parameters = inspect.signature(parent.forward).parameters.values()
            defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
            graph = OneLevel().trace(parent, concrete_args=defaults)
        except Exception:  # noqa: BLE001  (any failure of tracing user code: no traced fusion)
            return None
        finally:
            for name in set(vars(parent)) - attributes:  # (the forward's tensor constants)
                constants[name] = vars(parent)[name]
                delattr(parent, name)
        return OneLevelTrace(parent, graph, constants)

    def child(self, node) -> Optional[str]:
        """The name of the child that node calls, or None."""
        is_call = getattr(node, "op", None) == "call_module" and node.target in self.modules
        return node.target if is_call else None

    def module(self, node) -> torch.nn.Module:
        return self.modules[node.target]

    def through_identities(self, node):
        """node's value before the nn.Identity calls it went through."""
        while self.child(node) is not None and _is_identity(self.module(node)) and node.args:
            node = node.args[0]
        return node

    def users(self, node) -> list:
        """The nodes that read node's value, through nn.Identity calls."""
        found = []
        for user in node.users:
            identity = self.child(user) is not None and _is_identity(self.module(user))
            found += self.users(user) if identity else [user]
        return found

    def single_input(self, node):
        """The value a child call reads as its one argument (through nn.Identity calls), or None."""
        return self.through_identities(node.args[0]) if len(node.args) == 1 and not node.kwargs else None

    def once(self, node) -> bool:
        """Whether node calls a child that the forward calls only there."""
        return self.child(node) is not None and self.count.get(node.target) == 1


def _trace_chains(parent: torch.nn.Module) -> list:
    traced = OneLevelTrace.trace(parent)
    if traced is None:
        return []
    after = {}  # child -> the child that runs next, on its output alone
    for node in traced.calls:
        source = traced.single_input(node)
        if traced.once(node) and traced.once(source) and traced.users(source) == [node]:
            after[source.target] = node.target
    chains = []
    for head in [name for name in after if name not in after.values()]:
        chain = [head]
        while chain[-1] in after:
            chain.append(after[chain[-1]])
        chains.append(tuple(chain))
    return chains


def _tensor_reason(module: torch.nn.Module, config) -> Optional[str]:
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if not t.is_floating_point():
            continue
        if t.dtype not in config.dtypes:
            return f"'{name}' is {t.dtype}; the config allows {[str(d) for d in config.dtypes]}"
        if t.device.type != _runtime.KERNEL_DEVICE:
            return f"'{name}' is on {t.device}; dropin kernels run on {_runtime.KERNEL_DEVICE} tensors here"
    return None


_FORWARDS = ("forward", "_conv_forward")  # the methods through which torch.nn's layers compute


def computes_as(module: torch.nn.Module, base: type) -> bool:
    """Whether `module` is a `base` whose class keeps base's forward (and the helper it calls: Conv2d's
    _conv_forward), e.g. nn.MultiheadAttention's NonDynamicallyQuantizableLinear for nn.Linear; for nn.Linear and
    nn.LayerNorm also a forward of its own that makes base's one functional call alone (`_calls_as`)."""
    kind = type(module)
    if not isinstance(module, base):
        return False
    return all(getattr(kind, f, None) is getattr(base, f, None) for f in _FORWARDS) or (
        base in _FUNCTIONAL and _calls_as(module, *_FUNCTIONAL[base]))


# base -> (its functional form, that function's parameter names, the arguments base's forward passes it after the
# input, the shape of an input)
_FUNCTIONAL = {
    torch.nn.Linear: (torch.nn.functional.linear, ("input", "weight", "bias"), lambda m: (m.weight, m.bias),
                      lambda m: (2, m.in_features)),
    torch.nn.LayerNorm: (torch.nn.functional.layer_norm, ("input", "normalized_shape", "weight", "bias", "eps"),
                         lambda m: (tuple(m.normalized_shape), m.weight, m.bias, m.eps),
                         lambda m: (2, *m.normalized_shape)),
}


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """Records the torch functions called under it instead of running them (each returns an empty meta tensor)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return torch.empty(0, device="meta")


def _calls_as(module: torch.nn.Module, function, parameters: tuple, arguments, input_shape) -> bool:
    """Whether a subclass's own forward calls `function(input, *arguments(module))` and no other torch function
    (timm's Linear, which casts its weight only when TorchScript runs it; timm's LayerNorm off its fast path): its
    forward run once on a meta input with every torch call recorded, not run. Tensors must be the module's own,
    other arguments equal."""
    x = torch.empty(input_shape(module), device="meta")
    recorder = _TorchCalls()
    try:
        with recorder:
            module.forward(x)
    except Exception:  # noqa: BLE001 (a forward that cannot run so does not compute as its base's)
        return False
    if len(recorder.calls) != 1 or recorder.calls[0][0] is not function:
        return False
    _, args, kwargs = recorder.calls[0]
    if len(args) > len(parameters) or not set(kwargs) <= set(parameters[len(args):]):
        return False
    given = list(args) + [kwargs.get(name) for name in parameters[len(args):]]
    expected = (x, *arguments(module))
    return all(g is e if isinstance(e, torch.Tensor) or e is None else
               (tuple(g) if isinstance(g, (list, torch.Size)) else g) == e for g, e in zip(given, expected))


@functools.lru_cache(maxsize=None)
def _function_code(fn) -> tuple:
    """What a function computes as far as its code tells, wherever it was written: its instructions
    (`_code_fingerprint`), and the same of the functions of its own file that it names."""
    fn = inspect.unwrap(fn)  # (decorators that rename arguments: transformers' deprecate_kwarg)
    code = getattr(fn, "__code__", None)
    if code is None or fn in _VISITING:  # (a helper that calls back into its caller: its name alone)
        return (getattr(fn, "__qualname__", fn),)
    _VISITING.add(fn)
    try:
        helpers = [fn.__globals__.get(name) for name in code.co_names]
        return _code_fingerprint(code) + tuple(
            _function_code(h) for h in helpers if inspect.isfunction(h) and h.__module__ == fn.__module__)
    finally:
        _VISITING.discard(fn)


_VISITING: set = set()


_SAME_OP = {"LOAD_METHOD": "LOAD_ATTR"}  # how the compiler spells one attribute read depends on line breaks
_NOT_OPS = {"CACHE", "NOP", "RESUME", "EXTENDED_ARG"}
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


def _code_fingerprint(code) -> tuple:
    """The instructions of `code` by name and argument (constants, names; jump targets by instruction index,
    nested code by the same rule): not offsets nor line numbers."""
    instructions = [i for i in dis.get_instructions(code) if i.opname not in _NOT_OPS]
    index = {i.offset: n for n, i in enumerate(instructions)}
    return tuple((_SAME_OP.get(i.opname, i.opname),
                  index.get(i.argval) if i.opcode in _JUMPS else
                  _code_fingerprint(i.argval) if inspect.iscode(i.argval) else i.argval)
                 for i in instructions) + (code.co_argcount, code.co_kwonlyargcount)


def _class_code(kind: type) -> tuple:
    """_function_code of kind.forward, with that of the methods of kind that it names (GemmaRMSNorm's _norm)."""
    forward = getattr(kind, "forward", None)
    if not inspect.isfunction(inspect.unwrap(forward) if forward is not None else None):
        return (kind,)
    methods = [inspect.getattr_static(kind, name, None) for name in inspect.unwrap(forward).__code__.co_names]
    return _function_code(forward) + tuple(_function_code(m) for m in methods if inspect.isfunction(m))


def same_code(kind: type, reference: type) -> bool:
    """Whether `kind` computes as `reference` by its code: the same forward (and the helpers it calls) written again
    under another name, as transformers' generated modeling files copy one family's modules into another's."""
    return _class_code(kind) == _class_code(reference)


def code_names(kind: type) -> frozenset:
    """The names (attributes, globals) that kind's forward reads: what a recognizer may look for."""
    forward = getattr(kind, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return frozenset(code.co_names) if code is not None else frozenset()


RECOGNIZERS: list = []  # fn(kind) -> (op, handler) for a type that no registered type's handler takes, or None
_UNRECOGNIZED: set = set()  # types that every recognizer declined (cleared when handlers are registered)


def recognizer(fn: Callable) -> Callable:
    """Registers fn(kind) -> (op, handler) or None: a handler for types without a registered base, found by what they
    compute; the type is then registered with it (once per type)."""
    RECOGNIZERS.append(fn)
    _UNRECOGNIZED.clear()
    return fn


def _handler_type(kind: type) -> Optional[type]:
    """The registered type whose handler takes `kind`: its nearest registered base, else itself where a recognizer
    found it a handler, else None."""
    base = next((t for t in kind.__mro__ if t in HANDLERS), None)
    if base is None and kind not in _UNRECOGNIZED:
        found = next(filter(None, (r(kind) for r in RECOGNIZERS)), None)
        if found is None:
            _UNRECOGNIZED.add(kind)
        else:
            HANDLERS[kind], base = found, kind
    return base


def handle(module: torch.nn.Module, site: Site) -> Union[torch.nn.Module, str]:
    """The dropin module for `module` at `site`, or the reason it stays torch."""
    kind = type(module)
    base = _handler_type(kind)
    if base is None:
        return f"no dropin handler for {kind.__name__}"
    if not computes_as(module, base):
        return f"a subclass of {base.__name__} with a forward of its own: no handler for {kind.__name__} itself"
    op, fn = HANDLERS[base]
    if op is not None:
        if not site.config.uses(op):
            return f"op '{op}' is switched off by the config"
        reason = _tensor_reason(module, site.config)
        if reason:
            return reason
    return fn(module, site)


PASSIVE: dict = {}  # type -> fn(module) -> True while the module computes nothing (such modules are not reported)


def passive(*types, when: Callable = lambda module: True):
    for t in types:
        PASSIVE[t] = when


def _drop_path_idle(module: torch.nn.Module) -> bool:
    """A stochastic-depth module (timm's DropPath, torchvision's StochasticDepth, HF's *DropPath classes) in eval
    mode or with a drop probability of 0: the identity. (Its own forward still runs: passive only reports it so.)"""
    probability = getattr(module, "drop_prob", getattr(module, "p", None))
    return isinstance(probability, (int, float)) and (not module.training or probability == 0)


def is_passive(module: torch.nn.Module) -> bool:
    when = PASSIVE.get(type(module))
    if when is None:
        name = type(module).__name__
        when = _drop_path_idle if name.endswith("DropPath") or name == "StochasticDepth" else None
    return when is not None and when(module)


DEFERRED: dict = {}  # module name -> [functions that register handlers for that module's classes]


def unfollowed(module: torch.nn.Module, parameters: set, reads: tuple, follows: str) -> Optional[str]:
    """Why a library module whose forward a drop-in follows is not taken, or None: its forward takes parameters
    beyond `parameters` (a version of the library the drop-in does not follow; `follows` names those it does), or it
    lacks an attribute of `reads`, which the drop-in reads."""
    unknown = set(inspect.signature(type(module).forward).parameters) - parameters
    if unknown:
        return (f"its forward takes {', '.join(sorted(unknown))}: a version whose {type(module).__name__} dropin does "
                f"not follow (it follows {follows})")
    missing = [name for name in reads if not hasattr(module, name)]
    if missing:
        return f"it has no {', '.join(missing)}, which dropin's {type(module).__name__} reads"
    return None


def when_imported(module_name: str):
    """Defers a handler file's registrations for an optional library until inject_ runs after `module_name` was
    imported (a model of its classes has imported it): `import dropin` does not import transformers (seconds)."""
    def decorate(fn: Callable):
        DEFERRED.setdefault(module_name, []).append(fn)
        return fn
    return decorate


def load_deferred() -> None:
    """Runs the deferred registrations whose module has been imported (each once)."""
    for name in [n for n in DEFERRED if n in sys.modules]:
        for fn in DEFERRED.pop(name):
            fn()
        _UNRECOGNIZED.clear()
