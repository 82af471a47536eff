"""What inject_ and revert_ do to a user's tensors: nothing. The same parameter and buffer objects with the same
values, the same state_dict, and an injected model that saves and loads like the original."""
import copy

import pytest
import torch

import dropin
from dropin.nn import DropinModule
from _models import assert_same_state, cnn, mlp, snapshot
from _tol import DEVICE

MODELS = {"cnn": (cnn, (2, 3, 8, 8)), "mlp": (mlp, (4, 16))}


def tensors(model: torch.nn.Module) -> dict:
    """Every parameter and buffer by name (the objects themselves)."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def injected(name: str, train: bool = False):
    """(an injected model, its input, an uninjected copy of the same weights)."""
    make, shape = MODELS[name]
    model = make().train(train)
    original = copy.deepcopy(model)
    x = torch.randn(shape, device=DEVICE)
    report = dropin.inject_(model, example_inputs=x)
    assert report.replaced and any(isinstance(m, DropinModule) for m in model.modules())
    return model, x, original


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(MODELS))
def test_inject_and_revert_keep_the_same_tensors(name, train):
    """inject_ (which verifies: a training-mode forward updates BatchNorm statistics) and revert_ leave every
    parameter and buffer the same object with the same value and flags; revert_ puts back the same modules. The
    injected model adds no parameter (an optimizer sees the user's alone); the only tensors it adds are buffers
    outside the state_dict (values derived from the user's, as BatchNorms folded into convs)."""
    make, shape = MODELS[name]
    model = make().train(train)
    children, objects, state = list(model.children()), tensors(model), snapshot(model)
    flags = {k: t.requires_grad for k, t in objects.items()}
    dropin.inject_(model, example_inputs=torch.randn(shape, device=DEVICE))
    assert all(tensors(model)[k] is t for k, t in objects.items())
    assert dict(model.named_parameters()).keys() == dict(make().named_parameters()).keys()
    assert_same_state(model, state)
    dropin.revert_(model)
    assert all(a is b for a, b in zip(model.children(), children)) and len(list(model.children())) == len(children)
    assert all(t is objects[k] and t.requires_grad == flags[k] for k, t in tensors(model).items())
    assert_same_state(model, state)


@pytest.mark.parametrize("name", list(MODELS))
def test_state_dict_round_trips_both_ways(name):
    model, x, original = injected(name)
    assert_same_state(model, snapshot(original))  # the original's keys, in its order, and values
    other = MODELS[name][0]().eval()  # other weights
    with torch.no_grad():
        model.load_state_dict(other.state_dict())  # into the injected model: it computes with them
        torch.testing.assert_close(model(x), other(x), atol=1e-4, rtol=1e-4)
    plain = MODELS[name][0]().eval()
    plain.load_state_dict(model.state_dict())  # out of it, strict, into a plain model
    assert_same_state(plain, snapshot(other))
    assert_same_state(dropin.revert_(model), snapshot(other))


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_save_and_load_the_state_dict(name, tmp_path):
    model, x, original = injected(name)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    plain = MODELS[name][0]().eval()
    plain.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert_same_state(plain, snapshot(original))
    fresh, _, _ = injected(name)
    fresh.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))  # into an injected model
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_save_and_load_the_whole_model(name, tmp_path):
    """torch.save / torch.load(weights_only=False) of the injected model: the same output, and it reverts."""
    model, x, original = injected(name)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert_same_state(dropin.revert_(loaded), snapshot(original))
    assert not any(isinstance(m, DropinModule) for m in loaded.modules())


@pytest.mark.parametrize("name", list(MODELS))
def test_safetensors_save_and_load(name, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")
    model, x, original = injected(name)
    safetensors_torch.save_model(model, tmp_path / "model.safetensors")
    plain = MODELS[name][0]().eval()
    safetensors_torch.load_model(plain, tmp_path / "model.safetensors")
    assert_same_state(plain, snapshot(original))
    fresh, _, _ = injected(name)
    safetensors_torch.load_model(fresh, tmp_path / "model.safetensors")  # into an injected model
    assert_same_state(fresh, snapshot(original))
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))
