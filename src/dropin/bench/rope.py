"""Suite "rope": dropin.ops.rope vs HF's apply_rotary_pos_emb in eager mode, torch.compile and Liger-Kernel
(liger_rotary_pos_emb).

q and k are laid out as HF's attention makes them (the projections viewed [batch, seq, heads, head_dim] and
transposed), cos / sin [batch, seq, head_dim] as HF's rotary embedding returns them. Full cases (GPU): seed
002's model (batch 2, seq 1024, 4 heads of 256, fp32), Llama-7B (4096 tokens, 32 heads of 128, bf16) and
Llama-3-8B (8192 tokens, 32 query and 8 key heads of 128, bf16), forward and forward + backward. Memory
bound: the roofline is the copy bandwidth over the bytes that must move. Quick cases: tiny shapes.
Without transformers the eager row runs rope_ref, the same computation (tests check it against HF).
"""
from dropin.ops import rope
from dropin.ops.rope import rope_ref

from .harness import TORCH_DTYPES, Case, compiled, optional, optional_provider, randn, with_backward


def rope_case(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: str, label: str,
              backward: bool) -> Case:
    size = TORCH_DTYPES[dtype].itemsize

    def make_inputs():
        q = randn(batch, seq, heads, head_dim, dtype=dtype).transpose(1, 2)
        k = randn(batch, seq, kv_heads, head_dim, dtype=dtype).transpose(1, 2)
        angles = randn(batch, seq, head_dim // 2, dtype="fp32") * 100
        cos, sin = (angles.cos().repeat(1, 1, 2).to(q.dtype), angles.sin().repeat(1, 1, 2).to(q.dtype))
        return (q, k, cos, sin) + ((randn(*q.shape, dtype=dtype), randn(*k.shape, dtype=dtype)) if backward else ())

    providers = {"dropin": rope, "torch": optional("transformers.models.llama.modeling_llama",
                                                    "apply_rotary_pos_emb") or rope_ref,
                 "torch_compile": compiled(rope_ref),
                 "liger": optional_provider("liger_kernel.transformers.rope", "liger_rotary_pos_emb")}
    reference = rope_ref
    if backward:
        providers = {name: with_backward(fn, 4, 2) for name, fn in providers.items()}
        reference = with_backward(reference, 4, 2)
    qk = batch * seq * (heads + kv_heads) * head_dim
    table = 2 * batch * seq * head_dim
    return Case(
        name=f"{label} {dtype} b{batch} s{seq} h{heads}/{kv_heads} d{head_dim} {'fwd+bwd' if backward else 'fwd'}",
        dtype=dtype, make_inputs=make_inputs, providers=providers, reference=reference, backward=backward,
        bytes=size * (2 * qk + table) * (2 if backward else 1))


def rope_cases(quick: bool) -> list[Case]:
    """Suite "rope"."""
    if quick:
        shapes = [(2, 8, 4, 2, 16, "fp32", "tiny"), (1, 16, 3, 1, 32, "fp16", "tiny")]
    else:
        shapes = [(2, 1024, 4, 4, 256, "fp32", "seed002"), (1, 4096, 32, 32, 128, "bf16", "llama-7b"),
                  (1, 8192, 32, 8, 128, "bf16", "llama3-8b")]
    return [rope_case(*shape, backward=backward) for shape in shapes for backward in (False, True)]
