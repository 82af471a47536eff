"""Probe (GPU): which part of an injected ResNet-18 torch.compile fails on, and how. Compiles (default mode) the
smallest units first: the pooled head, the stem, an identity block, a downsampling block, then the whole model,
each alone on the input it meets in the model, planned without timing (no tuning). For the first failing unit it
prints the post-grad graph (TORCH_LOGS=post_grad_graphs) to stderr.
Usage: PYTHONPATH=src python3 benchmarks/probes/resnet_compile.py [float32|bfloat16]"""
import sys
import traceback

import torch
import torchvision

import dropin
from dropin.ops import _autotune

DTYPE = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")


def main():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().cuda().eval().to(DTYPE).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64, device="cuda", dtype=DTYPE).to(memory_format=torch.channels_last)
    dropin.inject_(model, verify=False)
    units = {"head": torch.nn.Sequential(model.avgpool, torch.nn.Flatten(1), model.fc),
             "stem": torch.nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool),
             "layer1.0": model.layer1[0], "layer2.0": model.layer2[0], "model": model}
    inputs = {"stem": x, "model": x}
    hooks = [model.avgpool.register_forward_pre_hook(lambda m, args: inputs.setdefault("head", args[0].clone())),
             model.layer1[0].register_forward_pre_hook(lambda m, args: inputs.setdefault("layer1.0", args[0].clone())),
             model.layer2[0].register_forward_pre_hook(lambda m, args: inputs.setdefault("layer2.0", args[0].clone()))]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    failing = None
    for name, unit in units.items():
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                got = torch.compile(unit)(inputs[name])
                want = unit(inputs[name])
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            result = f"ok, rel_err vs eager {err:.2e}"
        except Exception as error:  # noqa: BLE001
            result = f"FAILED {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            failing = failing or name
        print(f"{name:9s} {result}", flush=True)
    if failing:
        print(f"== post-grad graph of {failing}", file=sys.stderr, flush=True)
        torch._logging.set_logs(post_grad_graphs=True)
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                torch.compile(units[failing])(inputs[failing])
        except Exception:  # noqa: BLE001
            traceback.print_exc()


if __name__ == "__main__":
    with _autotune.untimed():
        main()
