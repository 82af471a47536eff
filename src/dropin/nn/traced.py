"""A block whose forward dropin runs from its traced graph, rewritten where a fusion needs other calls than the
block's own (a conv that takes the residual its block adds after the conv's BatchNorm)."""
from .module import DropinModule


def call_child(children: dict, path: str, *args, **kwargs):
    """The call of a child by its dotted path, read from the modules' dicts: the generated code's calls, which read
    no attribute (torch.compile traces DropinModule's __getattr__ and guards each lookup through it)."""
    head, *rest = path.split(".")
    module = children[head]
    for part in rest:
        module = module._modules[part]
    return module(*args, **kwargs)


class TracedBlock(DropinModule):
    """The block's forward as torch.fx traced it one level deep, with inject_'s rewrites: generated code of (the
    module, its children dict, its inputs) that calls the block's children, adopted under their names (inject_ then
    injects them, and the fused ones are put in place), and reads its parameters and buffers (shared)."""

    walks_children = True

    def __init__(self, original, code, kernel: str, traced_mode=None):
        """traced_mode: the training flag the trace was made in, where the block's forward reads `self.training`
        (the trace fixed that branch): in the other mode the original block runs, its own children unchanged."""
        super().__init__(original)
        self._code = code  # the generated forward
        self.kernel = kernel
        self.traced_mode = traced_mode

    def forward(self, *inputs):
        if self.traced_mode is not None and self.training != self.traced_mode:
            return self.original(*inputs)
        return self._code(self, self._modules, *inputs)
