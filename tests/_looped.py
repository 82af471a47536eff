"""`loop_rows`: the row-wise ops' looped kernels (rows longer than `_common.MAX_ROW`) on rows short enough for the
interpreter."""
import importlib

from dropin.ops import _common, _dispatch

SHORT = 64  # the longest whole row, and the chunk, while `loop_rows` holds


def loop_rows(monkeypatch, module_name: str, short: int = SHORT) -> list:
    """From here to the end of the test, rows longer than `short` elements take the looped kernels of the op module
    `module_name` (e.g. "dropin.ops.softmax"), in chunks of `short`, its plans and shortcuts made afresh; returns
    the list of the kernels its launches are made for (in order)."""
    module = importlib.import_module(module_name)  # (`dropin.ops.softmax` names the function)
    monkeypatch.setattr(_common, "MAX_ROW", short)
    monkeypatch.setattr(_common, "CHUNK", short)
    monkeypatch.setattr(module, "_plans", {})
    monkeypatch.setattr(module, "_shortcuts", _dispatch.Shortcuts(differentiable=True))
    kernels = []

    class Spy(_dispatch.Launch):
        def __init__(self, kernel, *args, **kwargs):
            kernels.append(kernel)
            super().__init__(kernel, *args, **kwargs)
    monkeypatch.setattr(module, "Launch", Spy)
    return kernels
