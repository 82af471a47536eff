"""The injection tests compare models in true fp32: TF32 off for convolutions and matmuls (torch's cuDNN
default is on, which the GPU would otherwise apply to both the model and dropin's kernels)."""
import pytest


@pytest.fixture(autouse=True)
def _true_fp32(true_fp32):
    yield
