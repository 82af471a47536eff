"""Probe: an injected torchvision ResNet-18 (bf16, channels_last, eval) captured in a CUDA graph and compiled with
mode="reduce-overhead"; what fails and where. Usage: PYTHONPATH=src python3 <this file>"""
import traceback

import torch
import torchvision

import dropin


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def main():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().cuda().eval().to(torch.bfloat16, memory_format=torch.channels_last)
    x = torch.randn(8, 3, 64, 64, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = model(x)
        dropin.inject_(model, example_inputs=x)
        print("eager", rel(model(x), ref))
        try:
            static = x.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    model(static)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = model(static)
            x2 = torch.randn_like(x)
            static.copy_(x2)
            g.replay()
            dropin.revert_(model)
            ref2 = model(x2)
            dropin.inject_(model, example_inputs=x)
            print("cuda graph replay on new data", rel(out, ref2))
        except Exception:
            traceback.print_exc(limit=6)
        for mode in ("default", "reduce-overhead"):
            try:
                torch._dynamo.reset()
                f = torch.compile(model, mode=mode)
                for _ in range(3):
                    y = f(x)
                print(mode, rel(y, ref))
            except Exception as e:
                print(mode, "FAILED", type(e).__name__, str(e)[:2000])
                traceback.print_exc(limit=8)


if __name__ == "__main__":
    main()
