"""inject_ / revert_: put dropin modules into a torch model in place. One handler file per model family."""
from . import (cvt, generic, gpt2, hf, hf_decoder, sdpa_attention, timm, torchvision,  # noqa: F401  (their handlers)
               transformer)
from .api import (SPARSE_THRESHOLD, InjectConfig, InjectError, InjectReport, VerificationError, inject_, refresh_,
                  revert_)
