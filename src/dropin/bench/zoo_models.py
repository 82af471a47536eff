"""The models of `dropin zoo`: every torchvision classification model, one common variant of each of the most-used
timm families, and HF transformers models built from their configs; each with random weights and its inputs.

A model's name says where it comes from: "torchvision/resnet18", "timm/resnet50", "hf/llama", or "MODULE:FUNCTION"
for a model of one's own (FUNCTION(tiny) returns (model, inputs); it may load a local weights file). Listing the
zoo instantiates nothing; `entry(name)` finds one model by its name alone (what a zoo worker process does).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable

# timm family -> its common small variant.
TIMM = {"resnet": "resnet50", "resnetv2": "resnetv2_50", "efficientnet": "efficientnet_b0",
        "mobilenetv3": "mobilenetv3_large_100", "convnext": "convnext_tiny", "regnet": "regnetx_016",
        "vit": "vit_small_patch16_224", "deit": "deit_small_patch16_224", "swin": "swin_tiny_patch4_window7_224",
        "mixer": "mixer_b16_224"}

# HF name -> (model_type for AutoConfig.for_model, text model, the config fields of the full zoo run, those of
# --tiny). Text models: 2 layers of their default config, AutoModel (the last hidden state); image models: their
# default config, AutoModelForImageClassification with 1000 labels.
_DECODER_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
                 "head_dim": 32, "vocab_size": 1000, "num_hidden_layers": 1}
HF = {
    "llama": ("llama", True, {"num_hidden_layers": 2}, _DECODER_TINY),
    "mistral": ("mistral", True, {"num_hidden_layers": 2}, _DECODER_TINY),
    "qwen2": ("qwen2", True, {"num_hidden_layers": 2}, _DECODER_TINY),
    "gemma": ("gemma", True, {"num_hidden_layers": 2}, _DECODER_TINY),
    "gpt2": ("gpt2", True, {"n_layer": 2}, {"n_embd": 64, "n_head": 2, "n_layer": 1, "n_positions": 64,
                                            "vocab_size": 1000, "bos_token_id": 0, "eos_token_id": 0}),
    "bert": ("bert", True, {"num_hidden_layers": 2}, {"hidden_size": 64, "intermediate_size": 128,
                                                      "num_attention_heads": 2, "num_hidden_layers": 1,
                                                      "vocab_size": 1000}),
    "vit": ("vit", False, {}, {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
                               "num_hidden_layers": 2, "image_size": 32, "patch_size": 8}),
    "cvt": ("cvt", False, {}, {"embed_dim": [8, 16, 32], "num_heads": [1, 2, 2], "depth": [1, 2, 3]}),
    "swin": ("swin", False, {}, {"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "image_size": 32,
                                 "patch_size": 4, "window_size": 4}),
    "convnext": ("convnext", False, {}, {"hidden_sizes": [8, 16], "depths": [1, 1], "num_stages": 2,
                                         "image_size": 32}),
}
# HF model types whose attention has an SDPA implementation (the others take no attn_implementation).
HF_SDPA = {"llama", "mistral", "qwen2", "gemma", "gpt2", "bert", "vit"}

# Inputs: images [batch, 3, size, size], token ids [batch, seq]; --tiny's in the second entry.
IMAGE_BATCH, IMAGE_SIZE, TEXT_BATCH, TEXT_SEQ = (8, 2), (224, 32), (2, 2), (512, 16)
# torchvision models whose expected image size is not 224, or whose smallest is above the tiny 32 (full, tiny):
# MaxViT's window and grid partitions of 7 at strides 4 to 32 take multiples of 224 only, the ViTs their
# image_size (224) alone.
TORCHVISION_SIZE = {"inception_v3": (299, 75), "alexnet": (224, 64), "maxvit_t": (224, 224),
                    **{vit: (224, 224) for vit in ("vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14")}}


class Unavailable(Exception):
    """The model cannot be built here (its library is not installed, or lacks the class): its row is skipped."""


@dataclass(frozen=True)
class ZooModel:
    """name: see the module docstring. image: an image classifier (its rows include float32), else a text model.
    build(tiny): (model with random weights, float32 on the CPU; its forward arguments on the CPU)."""
    name: str
    image: bool
    build: Callable[[bool], tuple]


def images(tiny: bool, size: int | None = None) -> tuple:
    """Random images [IMAGE_BATCH, 3, size, size] (default IMAGE_SIZE), as forward arguments."""
    import torch

    side = size or IMAGE_SIZE[tiny]
    return (torch.randn(IMAGE_BATCH[tiny], 3, side, side),)


def _torchvision(name: str) -> ZooModel:
    def build(tiny: bool):
        import torchvision

        size = TORCHVISION_SIZE.get(name, IMAGE_SIZE)[tiny]
        return torchvision.models.get_model(name, weights=None), images(tiny, size)
    return ZooModel(f"torchvision/{name}", True, build)


def _timm(name: str) -> ZooModel:
    def build(tiny: bool):
        if importlib.util.find_spec("timm") is None:
            raise Unavailable("timm is not installed (pip install timm)")
        import timm

        if not timm.is_model(name):
            raise Unavailable(f"timm {timm.__version__} has no model '{name}'")
        model = timm.create_model(name, pretrained=False)
        config = model.pretrained_cfg  # (its image size; ViTs, Swin and Mixer take that one alone: fixed_input_size)
        return model, images(tiny, None if tiny and not config.get("fixed_input_size") else config["input_size"][-1])
    return ZooModel(f"timm/{name}", True, build)


def _hf(name: str) -> ZooModel:
    model_type, text, full, tiny_fields = HF[name]

    def build(tiny: bool):
        import torch
        import transformers

        fields = tiny_fields if tiny else full
        try:
            config = transformers.AutoConfig.for_model(model_type, **fields, **(
                {"use_cache": False} if text else {"num_labels": 1000}))
        except (KeyError, ValueError) as e:
            raise Unavailable(f"transformers {transformers.__version__} has no config '{model_type}': {e}") from e
        auto = transformers.AutoModel if text else transformers.AutoModelForImageClassification
        sdpa = {"attn_implementation": "sdpa"} if model_type in HF_SDPA else {}
        model = auto.from_config(config, **sdpa)
        if text:
            return model, (torch.randint(0, config.vocab_size, (TEXT_BATCH[tiny], TEXT_SEQ[tiny])),)
        return model, images(tiny, None if tiny else getattr(config, "image_size", None))
    return ZooModel(f"hf/{name}", not text, build)


def _custom(spec: str) -> ZooModel:
    module, _, function = spec.partition(":")
    return ZooModel(spec, True, lambda tiny: getattr(importlib.import_module(module), function)(tiny))


def torchvision_names() -> list[str]:
    """Every classification model of torchvision (names only), or [] without torchvision."""
    if importlib.util.find_spec("torchvision") is None:
        return []
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def catalog() -> tuple[list[ZooModel], list[str]]:
    """(the zoo's models, notes on what is left out and why)."""
    notes = []
    tv = torchvision_names()
    if not tv:
        notes.append("torchvision is not installed: its models are left out")
    zoo = [_torchvision(n) for n in tv]
    if importlib.util.find_spec("timm") is None:
        notes.append(f"timm is not installed (pip install timm): its {len(TIMM)} families are left out "
                     f"({', '.join(TIMM.values())})")
    else:
        zoo += [_timm(n) for n in TIMM.values()]
    if importlib.util.find_spec("transformers") is None:
        notes.append("transformers is not installed: its models are left out")
    else:
        zoo += [_hf(n) for n in HF]
    return zoo, notes


def entry(name: str) -> ZooModel:
    """The zoo model of this name (see the module docstring), without listing the zoo."""
    source, _, short = name.partition("/")
    if ":" in name:
        return _custom(name)
    if source == "torchvision" and short:
        return _torchvision(short)
    if source == "timm" and short:
        return _timm(short)
    if source == "hf" and short in HF:
        return _hf(short)
    raise KeyError(f"no zoo model '{name}' (torchvision/NAME, timm/NAME, hf/{{{','.join(HF)}}} or MODULE:FUNCTION)")
