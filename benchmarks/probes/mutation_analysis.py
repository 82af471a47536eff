"""Probe (CPU, no GPU needed): which tensors Inductor believes each dropin kernel writes. Inductor analyses a
wrap_triton kernel's TTIR to find its stores; where the analysis fails it assumes every tensor argument is written,
clones them around the kernel and may copy them back (slow, and a source of scheduler errors). This runs injected
models through the registered ops' traced bodies with Triton compiling for a pretend sm_90 (no interpreter), records
every wrap_triton launch and runs torch's analysis on it. Flags: SHARED, a tensor passed in two slots (Inductor
constrains each slot's layout apart: a written one then gets copied onto itself, `KeyError` in the scheduler on
torch 2.11); SIZE-1 DIMS, a tensor with a dim of size 1, whose stride Inductor may fix differently.
On a GPU machine it uses the GPU and its torch instead.
Usage: PYTHONPATH=src python3 benchmarks/probes/mutation_analysis.py [resnet18|llama|cvt|all]"""
import inspect
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from torch._higher_order_ops import triton_kernel_wrap as wrap  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class PretendDriver:
    """Enough of a Triton driver for TTIR generation: an sm_90 target."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


if DEVICE == "cpu":
    triton.runtime.driver.set_active(PretendDriver())

import dropin  # noqa: E402
from dropin import _runtime  # noqa: E402
from dropin.ops import _dispatch  # noqa: E402

if DEVICE == "cpu":  # CPU tensors stand in for CUDA ones on a pretend H100
    _runtime.num_sms = lambda device_index=0: 132
    _runtime.is_hopper = lambda device_index=0: True
    _runtime.check_kernel_device = lambda *args, **kwargs: None
    _runtime.KERNEL_DEVICE = "cpu"

launches = {}
DTYPE = getattr(torch, os.environ.get("DTYPE", "bfloat16"))


class Recorder:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            names = self.kernel.arg_names
            bound = dict(zip(names, args), **kwargs)
            key = (self.kernel.fn.__name__, tuple((n, str(v.dtype)) if isinstance(v, torch.Tensor) else (n, v)
                                                  for n, v in bound.items()))
            tensors = [(n, v) for n, v in bound.items() if isinstance(v, torch.Tensor)]
            shared = [n for i, (n, v) in enumerate(tensors) if any(v is u for _, u in tensors[:i])]
            unit_dims = [n for n, v in tensors if v.numel() > 1 and 1 in v.shape]
            launches.setdefault(key, (self.kernel, bound, shared, unit_dims))
        return record


_dispatch.wrap_triton = Recorder


def analyse(kernel, kwargs):
    """(written tensor names, whether the analysis fell back to 'every input written')."""
    tensors = [n for n, v in kwargs.items() if isinstance(v, torch.Tensor)]
    try:
        if hasattr(wrap, "identify_accessed_tensors"):
            ttir, names = wrap.generate_ttir(kernel, kwargs, {})
            functions = wrap.ttir_to_functions(ttir)
            name = next(iter(functions))
            wrap.analyze_kernel_access.reset()
            wrap.get_tma_stores.reset()
            index = frozenset(i for i, n in enumerate(names) if isinstance(kwargs.get(n), torch.Tensor))
            access = wrap.analyze_kernel_access(functions, name, len(names), tuple(names), index)
            written = sorted({d.name for d in access.read_writes.writes})
        else:
            identify = wrap.identify_mutated_tensors
            extra = ({},) if len(inspect.signature(identify).parameters) > 2 else ()
            written = sorted(identify(kernel, kwargs, *extra))
        return written, False
    except Exception as error:  # noqa: BLE001  (the probe reports every failure)
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}", True


def resnet18():
    import torchvision
    model = torchvision.models.resnet18().eval().to(DTYPE).to(memory_format=torch.channels_last)
    return model, (torch.randn(2, 3, 64, 64, dtype=DTYPE).to(memory_format=torch.channels_last),)


def llama():
    from transformers import LlamaConfig, LlamaModel
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)
    return LlamaModel(config).eval().to(DTYPE), (torch.randint(0, 128, (2, 64)),)


def cvt():
    from transformers import CvtConfig, CvtModel
    config = CvtConfig(depth=[1, 2, 3], embed_dim=[16, 32, 48], num_heads=[1, 2, 2])
    return CvtModel(config).eval().to(DTYPE), (torch.randn(2, 3, 64, 64, dtype=DTYPE),)


def main(names):
    for name in names:
        model, inputs = globals()[name]()
        model, inputs = model.to(DEVICE), tuple(t.to(DEVICE) for t in inputs)
        report = dropin.inject_(model, verify=False)
        print(f"== {name}: {len(report.replaced)} modules replaced")
        compiling = torch.compiler.is_compiling
        torch.compiler.is_compiling = lambda: True  # every public function calls its registered op
        try:
            with torch.no_grad():
                model(*inputs)
        finally:
            torch.compiler.is_compiling = compiling
    for (kernel_name, _), (kernel, kwargs, shared, unit_dims) in sorted(launches.items(), key=lambda item: item[0][0]):
        written, failed = analyse(kernel, kwargs)
        tensors = [n for n, v in kwargs.items() if isinstance(v, torch.Tensor)]
        flags = (f" SHARED {shared}" if shared else "") + (f" SIZE-1 DIMS {unit_dims}" if unit_dims else "")
        print(f"{'FALLBACK' if failed else 'ok      '} {kernel_name}: tensors {tensors} written {written}{flags}")


if __name__ == "__main__":
    main(["resnet18", "llama", "cvt"] if sys.argv[1:] in ([], ["all"]) else sys.argv[1:])
