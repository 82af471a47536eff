"""Probe: the error of one tensor-core accumulator over a long reduction. A [64, 64] tile summed over K products
of randn bf16 operands in one program, the MMA accumulating in place (tl.dot(a, b, acc)) or each step's product
added to an fp32 total by the CUDA cores (acc += tl.dot(a, b)), against float64: relative error, and its bias
(mean of (out - ref) * sign(ref) over mean |ref|: negative where the sums shrink toward zero).
Usage: PYTHONPATH=src python3 benchmarks/probes/long_k.py"""
import torch
import triton
import triton.language as tl


@triton.jit
def _tile_kernel(a_ptr, b_ptr, c_ptr, K, PROMOTE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + (k0 + rk)[None, :])
        b = tl.load(b_ptr + (k0 + rk)[:, None].to(tl.int64) * BN + rn[None, :])
        if PROMOTE:
            acc += tl.dot(a, b)
        else:
            acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)


def main():
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    for dtype in (torch.bfloat16, torch.float16):
        for log_k in (10, 12, 14, 16, 18, 20, 22):
            K = 2**log_k
            a = torch.randn(64, K, device="cuda", dtype=dtype)
            b = torch.randn(K, 64, device="cuda", dtype=dtype)
            ref = a.double() @ b.double()
            row = [f"{str(dtype)[6:]:9} K=2^{log_k:<3}"]
            for promote in (False, True):
                c = torch.empty(64, 64, device="cuda", dtype=torch.float32)
                _tile_kernel[(1,)](a, b, c, K, PROMOTE=promote, BM=64, BN=64, BK=64)
                d = c.double() - ref
                err = (d.norm() / ref.norm()).item()
                bias = ((d * ref.sign()).mean() / ref.abs().mean()).item()
                row.append(f"{'promoted' if promote else 'in MMA'}: err {err:.2e} bias {bias:+.2e}")
            t = (a.float() @ b.float()).double() - ref
            row.append(f"torch fp32 mm of the upcast: err {(t.norm() / ref.norm()).item():.2e}")
            print("  ".join(row), flush=True)


if __name__ == "__main__":
    main()
