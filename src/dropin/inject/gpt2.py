"""Handlers for HF GPT-2 (transformers.models.gpt2) and the models built of transformers' Conv1D: Conv1D (a linear
whose weight is stored [in, out]) -> dropin linear on the weight's transposed view, the activation that follows it
in a chain fused into its epilogue; GPT2MLP's c_fc -> act -> c_proj -> dropout declared a chain (gelu_new, HF's
NewGELUActivation, fuses into c_fc). GPT2Attention: inject.sdpa_attention."""
from torch import nn

from .. import nn as dnn
from .generic import fused_activation
from .registry import chain, fusion_roles, register, when_imported


def conv1d(module: nn.Module, site):
    if dnn.sparse.pruned(module):
        return "pruned by torch.nn.utils.prune (a forward pre-hook masks its weight): dropin's Conv1D is dense"
    act, absorbs = fused_activation(site.following(), site.config)
    return dnn.TransposedLinear(module, act, absorbs)


@when_imported("transformers.pytorch_utils")
def _register_conv1d():
    from transformers.pytorch_utils import Conv1D

    register(Conv1D, op="linear")(conv1d)
    fusion_roles(heads=(Conv1D,))


@when_imported("transformers.models.gpt2.modeling_gpt2")
def _register_gpt2():
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    chain(GPT2MLP, "c_fc", "act", "c_proj", "dropout")
