"""inject_ on a tiny HF LlamaForCausalLM called with labels: the loss from dropin's fused linear + cross-entropy
(HF's shift, ignore_index, mean or num_items_in_batch), no logits on that path; without labels logits as before."""
import copy

import pytest
import torch

import dropin
import dropin.nn as dnn
from _tol import DEVICE, assert_close

from _models import assert_same_state, snapshot

transformers = pytest.importorskip("transformers")
VOCAB = 96


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB)
    return transformers.LlamaForCausalLM(config).to(DEVICE)


def batch():
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=g).to(DEVICE)
    labels = input_ids.clone()
    labels[0, :3] = -100
    return input_ids, labels


@pytest.fixture(scope="module")
def injected():
    model = tiny_llama()
    original = copy.deepcopy(model)
    report = dropin.inject_(model)
    return model, original, report


def test_loss_and_gradients_match_float64(injected):
    model, original, report = injected
    assert isinstance(model.__dict__["forward"], dnn.CausalLMForward)
    assert any(r.name == "" and "linear_cross_entropy" in r.kernel for r in report.replaced)
    input_ids, labels = batch()
    model.zero_grad()
    out = model(input_ids=input_ids, labels=labels)
    assert out.logits is None and out.loss.dtype == torch.float32
    out.loss.backward()
    reference = copy.deepcopy(original).double()
    ref = reference(input_ids=input_ids, labels=labels)
    ref.loss.backward()
    assert_close(out.loss.detach(), ref.loss.detach().float().double(), torch.float32, "fwd")
    for name in ("lm_head.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight",
                 "model.embed_tokens.weight"):
        grad = dict(model.named_parameters())[name].grad
        grad_64 = dict(reference.named_parameters())[name].grad
        assert_close(grad, grad_64, torch.float32, "bwd", what=name)


def test_num_items_in_batch_and_shift_labels(injected):
    model, original, _ = injected
    input_ids, labels = batch()
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    with torch.no_grad():
        for kwargs in (dict(labels=labels, num_items_in_batch=torch.tensor(5)),
                       dict(labels=labels, shift_labels=shift.flip(1))):
            out = model(input_ids=input_ids, **kwargs)
            ref = copy.deepcopy(original).double()(input_ids=input_ids, **kwargs)
            assert out.logits is None
            assert_close(out.loss, ref.loss.float().double(), torch.float32, "fwd")


def test_without_labels_and_unserved_calls_return_logits(injected):
    model, original, _ = injected
    input_ids, labels = batch()
    with torch.no_grad():
        ref = copy.deepcopy(original).double()(input_ids=input_ids, labels=labels)
        plain = model(input_ids=input_ids)
        as_tuple = model(input_ids=input_ids, labels=labels, return_dict=False)
        with pytest.raises(ValueError, match="batch_size"):  # HF's own path, which refuses logits_to_keep with labels
            model(input_ids=input_ids, labels=labels, logits_to_keep=3)
    assert plain.loss is None and plain.logits.shape == (2, 7, VOCAB)
    assert_close(plain.logits, ref.logits, torch.float32, "fwd")
    assert isinstance(as_tuple, tuple) and as_tuple[1].shape == (2, 7, VOCAB)
    assert_close(as_tuple[0], ref.loss, torch.float32, "fwd")


def test_revert_and_state_dict():
    model = tiny_llama()
    state = snapshot(model)
    dropin.inject_(model)
    assert set(model.state_dict()) == set(state)
    assert_same_state(model, state)
    dropin.revert_(model)
    assert "forward" not in model.__dict__
    assert_same_state(model, state)
    input_ids, labels = batch()
    with torch.no_grad():
        assert model(input_ids=input_ids, labels=labels).logits is not None


def test_op_switched_off():
    model = tiny_llama()
    report = dropin.inject_(model, dropin.InjectConfig(ops=frozenset({"linear"})))
    assert "forward" not in model.__dict__
    assert any("linear_cross_entropy" in n.reason for n in report.notes)
