"""Fusions that need a block's forward rewritten: `x = act(bn(conv(x)) + residual)` written with the block's own
attributes (timm's and users' residual blocks; torchvision's have a handler of their own) becomes one conv call that
takes the residual, BatchNorm folded and activation in its epilogue. The block is swapped for a TracedBlock that
runs its traced forward with that call in place; its other children are then injected as usual."""
import inspect
import operator
from typing import Optional

import torch
from torch import nn

from .. import nn as dnn
from ..nn.traced import call_child
from .generic import activation_name, conv_reason, fold_reason
from .registry import OneLevelTrace, code_names, computes_as

_ADDS = (operator.add, operator.iadd, torch.add)


def _addends(node) -> Optional[tuple]:
    """The two values a node adds (a + b, a += b, torch.add(a, b), a.add(b)), or None."""
    is_add = (node.op == "call_function" and node.target in _ADDS
              or node.op == "call_method" and node.target in ("add", "add_"))
    return tuple(node.args) if is_add and len(node.args) == 2 and not node.kwargs else None


def _tails(traced: OneLevelTrace) -> list:
    """(conv, bn, act, activation name, residual) nodes for each act(bn(conv(x)) + residual) of the forward: each
    child called once, each value read by the next step alone, the BatchNorm foldable into the conv."""
    tails = []
    for act in traced.calls:
        name = activation_name(traced.module(act)) if traced.once(act) else None
        total = traced.single_input(act) if name else None
        addends = _addends(total) if total is not None and traced.users(total) == [act] else None
        for last, residual in (addends, addends[::-1]) if addends else ():
            bn = traced.through_identities(last)
            conv = traced.single_input(bn) if traced.once(bn) else None
            if not (traced.once(conv) and traced.users(conv) == [bn] and traced.users(bn) == [total]
                    and len(conv.args) == 1 and not conv.kwargs):
                continue
            conv_module, bn_module = traced.module(conv), traced.module(bn)
            if computes_as(conv_module, nn.Conv2d) and not conv_reason(conv_module) and \
                    not fold_reason(bn_module, conv_module):
                tails.append((conv, bn, act, name, residual))
                break
    return tails


def residual_block(block: nn.Module, site) -> Optional[dnn.TracedBlock]:
    """A TracedBlock for `block` where its forward has act(bn(conv(x)) + residual) runs to fuse (fusions and conv2d
    on in the config; a forward of positional inputs without defaults, which traces, with no tensor constant), the
    fused convs, BatchNorms and activations put in place in it; else None."""
    config = site.config
    if not (config.fusions and config.uses("conv2d")):
        return None
    children = block._modules.values()
    if not (any(isinstance(c, nn.Conv2d) for c in children) and any(isinstance(c, nn.BatchNorm2d) for c in children)):
        return None
    parameters = inspect.signature(block.forward).parameters.values()
    if any(p.default is not p.empty or p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters):
        return None  # (fx fixes defaulted arguments to their defaults: a call with another value would be wrong)
    traced = OneLevelTrace.trace(block)
    if traced is None or traced.constants:
        return None  # (constants would be plain attributes, which .to() does not move)
    tails = _tails(traced)
    if not tails:
        return None
    graph = traced.graph
    for conv, bn, act, name, residual in tails:
        with graph.inserting_before(act):
            fused = graph.call_module(conv.target, (conv.args[0], residual))
        act.replace_all_uses_with(fused)
    module = torch.fx.GraphModule(block, graph)  # (its children: the block's, for the purity checks)
    graph = module.graph
    graph.eliminate_dead_code()  # the replaced calls, adds and nn.Identity calls
    with graph.inserting_before(next(iter(graph.nodes))):
        children = graph.placeholder("children")
    for node in [n for n in graph.nodes if n.op == "call_module"]:  # children called from the dict
        with graph.inserting_before(node):
            call = graph.call_function(call_child, (children, node.target, *node.args), dict(node.kwargs))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    graph.lint()
    module.recompile()
    code = type(module).forward
    kernels = ", ".join(f"{conv.target}: conv2d+bn+residual+{name}" for conv, _, _, name, _ in tails)
    mode = block.training if "training" in code_names(type(block)) else None
    new = dnn.TracedBlock(block, code, f"traced forward ({kernels})", mode)
    for conv, bn, act, name, _ in tails:
        fused = dnn.ConvBNAct(traced.module(conv), traced.module(bn), name, (bn.target, act.target))
        fused.kernel = f"conv2d+bn+residual+{name}"
        setattr(new, conv.target, fused)
        for absorbed in (bn.target, act.target):
            setattr(new, absorbed, dnn.Folded(block._modules[absorbed], into=f"{site.path}.{conv.target}"))
    return new
