"""Probe (CPU, no GPU needed): which tensors Inductor believes each dropin kernel writes. Inductor analyses a
wrap_triton kernel's TTIR to find its stores; where the analysis fails it assumes every tensor argument is written,
clones them around the kernel and may copy them back (slow, and a source of scheduler errors). This runs injected
models through the registered ops' traced bodies with Triton compiling for a pretend sm_90 (no interpreter), records
every wrap_triton launch and runs torch's analysis on it (tests/_kernel_writes.py's machinery, which
tests/test_kernel_writes.py runs on every public op). Flags: INPUTS WRITTEN, a tensor taken as written that is an
input of the registered op (Inductor clones it; a leaf that requires grad fails); SHARED, a tensor in two slots
(Inductor constrains each slot's layout apart: a written one then gets copied onto itself, `KeyError` in the
scheduler on torch 2.11); SIZE-1 DIMS, a tensor with a dim of size 1, whose stride Inductor may fix differently.
On a GPU machine it uses the GPU and its torch instead.
Usage: PYTHONPATH=src python3 benchmarks/probes/mutation_analysis.py [resnet18|llama|cvt|all]"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
import _kernel_writes  # noqa: E402  (the machinery tests/test_kernel_writes.py uses)

_kernel_writes.setup()
import dropin  # noqa: E402

DEVICE = _kernel_writes.DEVICE
DTYPE = getattr(torch, os.environ.get("DTYPE", "bfloat16"))


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
        with torch.no_grad(), _kernel_writes.traced(name):
            model(*inputs)
    lines = set()
    for call, kernel, kwargs in _kernel_writes.launches:
        r = _kernel_writes.check(call, kernel, kwargs)
        unit_dims = [n for n in r["tensors"] if kwargs[n].numel() > 1 and 1 in kwargs[n].shape]
        flags = "".join(f" {flag} {names}" for flag, names in (("INPUTS WRITTEN", r["inputs_written"]),
                        ("SHARED", r["shared"]), ("SIZE-1 DIMS", unit_dims)) if names)
        lines.add(f"{'FALLBACK' if r['error'] else 'ok      '} {r['kernel']} ({r['op']}): tensors {r['tensors']} "
                  f"written {r['error'] or r['written']}{flags}")
    print("\n".join(sorted(lines, key=lambda line: line[9:])))


if __name__ == "__main__":
    main(["resnet18", "llama", "cvt"] if sys.argv[1:] in ([], ["all"]) else sys.argv[1:])
