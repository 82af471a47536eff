"""@triton.jit helpers the conv2d kernel families share: the output tile's epilogue and one axis's tap addressing."""
import triton
import triton.language as tl

from ..activations import apply_activation


@triton.jit
def epilogue(acc, y_ptr, z_ptr, bias_ptr, r_ptr, pix_y, pix_r, co, m_ok, n_ok, syc, src,
             HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, STORE_Z: tl.constexpr):
    """Adds the bias and the residual (pixel offsets pix_y / pix_r, channel strides syc / src), keeps the
    pre-activation in z for the backward, stores act(.) in y."""
    mask = m_ok[:, None] & n_ok[None, :]
    co = co.to(tl.int64)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + co, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        acc = acc + tl.load(r_ptr + pix_r[:, None] + co[None, :] * src, mask=mask, other=0.0).to(tl.float32)
    offs_y = pix_y[:, None] + co[None, :] * syc
    if STORE_Z:
        tl.store(z_ptr + offs_y, acc.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + offs_y, apply_activation(acc, ACT).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def conv_tap(pos, k, size, STRIDE: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Along one axis, where tap k of position pos reads and whether that is inside [0, size): the forward
    reads pos*STRIDE - PAD + k*DIL; TRANSPOSED (the input gradient) the output position (pos + PAD - k*DIL)
    / STRIDE, where that divides."""
    if TRANSPOSED:
        t = pos + PAD - k * DIL
        src = tl.maximum(t, 0) // STRIDE
        return src, (t >= 0) & (t % STRIDE == 0) & (src < size)
    src = pos * STRIDE - PAD + k * DIL
    return src, (src >= 0) & (src < size)
