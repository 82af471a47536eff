"""dropin: fast, correct, drop-in Triton kernels for PyTorch.

The names below load on first use, so that `dropin --help` and `dropin --version` need not import torch. Whatever
loads dropin's kernels imports dropin._runtime first, which switches the Triton interpreter on without a GPU.
"""
import importlib

__version__ = "0.1.0"

# Public name -> the submodule that defines it (a submodule names itself).
_SOURCES = {"ops": ".ops", "nn": ".nn", "inject": ".inject", "route": ".route",
            **dict.fromkeys(["inject_", "revert_", "refresh_", "InjectConfig"], ".inject"),
            **dict.fromkeys(["enable", "disable", "use", "route_report"], ".route"),
            **dict.fromkeys(["matmul", "bmm", "linear", "conv1d", "conv2d", "attention", "rms_norm", "group_norm",
                             "rope", "swiglu_mlp", "linear_cross_entropy"], ".ops")}

__all__ = ["ops", "nn", "route", "matmul", "bmm", "linear", "conv1d", "conv2d", "attention", "rms_norm", "group_norm",
           "rope", "swiglu_mlp", "linear_cross_entropy",
           "inject_", "revert_", "refresh_", "InjectConfig", "enable", "disable", "use", "route_report", "__version__"]


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    importlib.import_module("._runtime", __name__)  # the interpreter switch, before any kernel is defined
    module = importlib.import_module(_SOURCES[name], __name__)
    value = module if _SOURCES[name] == f".{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_SOURCES})
