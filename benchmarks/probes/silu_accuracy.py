"""Probe (GPU): is fp32 silu / gelu_tanh, as dropin's kernels compute it (tl.sigmoid: exp through ex2.approx),
less accurate than torch's (expf)? fuzz_repro 47 (fp32 swiglu_mlp, one token, 69 hidden units) has dropin's error
1.6-3.3x torch's, and the MLP's output error follows its hidden activations' when the down product has few terms.
Per input scale: the relative error against float64 of dropin.ops.activations.silu and F.silu (and of the gelu_tanh pair), and the
worst elementwise error in ulps. Usage: PYTHONPATH=src python3 benchmarks/probes/silu_accuracy.py"""
import torch
import torch.nn.functional as F

from dropin.ops import activations


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple:
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    ulp = (got.double() - ref).abs() / torch.finfo(torch.float32).eps / ref.abs().clamp_min(1e-30)
    return rel, ulp.max().item()


def main():
    torch.manual_seed(0)
    for scale in (0.5, 1.0, 3.0, 10.0):
        x = torch.randn(1 << 20, device="cuda") * scale
        ref_silu = F.silu(x.double())
        ref_gelu = F.gelu(x.double(), approximate="tanh")
        rows = {"silu dropin": _errors(activations.silu(x), ref_silu), "silu torch": _errors(F.silu(x), ref_silu),
                "gelu_tanh dropin": _errors(activations.activation(x, "gelu_tanh"), ref_gelu),
                "gelu_tanh torch": _errors(F.gelu(x, approximate="tanh"), ref_gelu)}
        for name, (rel, ulp) in rows.items():
            print(f"scale {scale:5.1f}  {name:18s} rel {rel:.2e}  worst {ulp:8.1f} ulp")


if __name__ == "__main__":
    main()
