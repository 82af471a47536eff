"""Probe: what torch.compile generates around dropin's kernels. For the original and the injected model it counts, in
Inductor's generated code for one inference forward, the kernel launches (Inductor's own Triton kernels, dropin's
user kernels, extern kernels such as cuBLAS) and the layout copies (clone / copy kernels, as_strided copies), and it
writes the code to $OUT/<model>-<which>.py for reading. Usage: PYTHONPATH=src python3 <this file> [model ...]
(models: resnet18 cvt llama)."""
import copy
import os
import re
import sys

import torch
from torch._inductor.utils import run_and_get_code

import dropin


def _resnet18():
    import torchvision
    model = torchvision.models.resnet18().cuda().eval().to(torch.bfloat16, memory_format=torch.channels_last)
    x = torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    return model, (x,)


def _cvt():
    import transformers
    model = transformers.CvtForImageClassification(transformers.CvtConfig()).cuda().eval().to(torch.bfloat16)
    return model, (torch.randn(8, 3, 224, 224, device="cuda", dtype=torch.bfloat16),)


def _llama():
    import transformers
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=1024, num_attention_heads=8,
                                      intermediate_size=2816, vocab_size=32000, use_cache=False)
    model = transformers.LlamaModel(config).cuda().eval().to(torch.bfloat16)
    return model, (torch.randint(0, 32000, (2, 256), device="cuda"),)


MODELS = {"resnet18": _resnet18, "cvt": _cvt, "llama": _llama}


def count(code: str) -> dict:
    launches = re.findall(r"^\s*(\w+)\.run\(", code, re.M)
    user = [k for k in launches if not k.startswith("triton_")]
    copies = [k for k in launches if re.search(r"clone|copy", k)]
    return {"inductor kernels": len(launches) - len(user), "dropin/user kernels": len(user),
            "extern kernels": len(re.findall(r"extern_kernels\.\w+\(", code)),
            "copy kernels": len(copies), "as_strided copies": len(re.findall(r"empty_strided.*\n.*copy_", code))}


def main():
    out = os.environ.get("OUT", ".")
    for name in sys.argv[1:] or list(MODELS):
        model, inputs = MODELS[name]()
        injected = copy.deepcopy(model)
        dropin.inject_(injected, example_inputs=inputs)
        for which, m in (("original", model), ("injected", injected)):
            torch._dynamo.reset()
            with torch.no_grad():
                _, codes = run_and_get_code(torch.compile(m), *inputs)
            code = "\n".join(codes)
            with open(f"{out}/{name}-{which}.py", "w") as f:
                f.write(code)
            print(f"{name:9s} {which:9s} " + "  ".join(f"{k} {v}" for k, v in count(code).items()))


if __name__ == "__main__":
    main()
