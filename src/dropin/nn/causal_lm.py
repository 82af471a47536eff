"""The forward that inject_ sets on a HF causal language model (LlamaForCausalLM and the classes of the same code):
called with `labels`, the loss comes from dropin's fused linear + cross-entropy on the final hidden states, and the
logits are never materialised (the output's `logits` is None); called without, the model's own forward runs.

The model's own forward still runs (its decoder, its handling of caches, masks and outputs, whatever the transformers
version): with labels=None and its lm_head read through a stand-in that keeps the hidden states and returns None. The
loss is then HF's ForCausalLMLoss: labels shifted left (the last position ignore_index), or `shift_labels` as given,
ignore_index (default -100), the mean over the tokens not ignored or the sum over `num_items_in_batch`, in float32.
A call that this path does not serve runs the model's own forward unchanged: logits_to_keep other than 0, a tuple
output (return_dict=False), a custom loss function, an lm_head that is no Linear of vocab_size rows or has hooks.
The forward is an attribute of the model instance (state_dict and the class untouched); revert_ removes it."""
import inspect

import torch
from torch import nn

from ..ops import linear_cross_entropy


class _HeadCapture:
    """The model as its forward sees it, but for lm_head: a stand-in that keeps the hidden states, returns None."""

    def __init__(self, model):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "hidden", None)

    def lm_head(self, hidden):
        object.__setattr__(self, "hidden", hidden)

    def __getattr__(self, name):
        return getattr(self._model, name)


class CausalLMForward:
    """model.forward while injected (see the module's docstring)."""

    kernel = "linear_cross_entropy (with labels)"

    def __init__(self, model: nn.Module, loss_reference):
        self.model, self.loss_reference = model, loss_reference
        self.signature = inspect.signature(type(model).forward)
        names = list(self.signature.parameters)[1:]
        # how many positional arguments a call has before its labels (binding costs host time and, under
        # torch.compile, guards: a call without labels skips it)
        self.before_labels = names.index("labels") if "labels" in names else len(names)

    def __call__(self, *args, **kwargs):
        model, forward = self.model, type(self.model).forward
        if len(args) <= self.before_labels and kwargs.get("labels") is None:
            return forward(model, *args, **kwargs)
        bound = self._fused_call(args, kwargs)
        if bound is None:
            return forward(model, *args, **kwargs)
        labels = bound.arguments["labels"]
        extra = bound.arguments.get("kwargs", {})
        bound.arguments["labels"] = None
        capture = _HeadCapture(model)
        bound.arguments["self"] = capture
        output = forward(*bound.args, **bound.kwargs)
        hidden, head = capture.hidden, model.lm_head
        ignore_index = extra.get("ignore_index", -100)
        target = extra.get("shift_labels")
        if target is None:
            target = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        output.loss = linear_cross_entropy(
            hidden, head.weight, target.to(hidden.device).reshape(hidden.shape[:-1]), head.bias,
            ignore_index=ignore_index, num_items_in_batch=extra.get("num_items_in_batch"),
            loss_dtype=torch.float32)
        return output

    def _fused_call(self, args, kwargs):
        """The call's bound arguments where the fused loss serves it, else None."""
        model = self.model
        try:
            bound = self.signature.bind(model, *args, **kwargs)
        except TypeError:
            return None  # (the model's own forward says what is wrong)
        arguments = bound.arguments
        extra = arguments.get("kwargs", {})
        keep = arguments.get("logits_to_keep", 0)
        head = model.lm_head
        linear = getattr(head, "original", head)
        return_dict = extra.get("return_dict", model.config.return_dict)
        if (arguments.get("labels") is None or type(keep) is not int or keep != 0 or return_dict is False
                or model.loss_function is not self.loss_reference or not isinstance(linear, nn.Linear)
                or head.weight.shape[0] != model.config.vocab_size or head._forward_hooks
                or head._forward_pre_hooks or not isinstance(extra.get("ignore_index", -100), int)):
            return None
        return bound
