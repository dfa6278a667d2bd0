"""Copying HF-named checkpoint tensors into a model's parameters, and the errors that can say why not.

A model's `load_weights` supplies only its renaming rule (HF name -> parameter name, or None for a
tensor that is known to be harmless to skip); the loop here does the rest: layout conversion
(a parameter may carry a `weight_converter`, e.g. conv1d [dim, 1, width] -> [dim, width]), the
shape check, the copy, and the collection of names it cannot place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


class WeightLoadError(ValueError):
    """A checkpoint does not fit the model; the message names the tensors."""


class MissingWeightsError(WeightLoadError):
    def __init__(self, missing: Iterable[str], where: str = "the checkpoint") -> None:
        self.missing = sorted(missing)
        listing = "\n  ".join(self.missing)
        super().__init__(
            f"{len(self.missing)} parameter(s) not found in {where}:\n  {listing}\n"
            "is the checkpoint complete (all shards present) and of the architecture in config.json?"
        )


class UnexpectedWeightsError(WeightLoadError):
    def __init__(self, unexpected: Iterable[str], architecture: str) -> None:
        self.unexpected = sorted(unexpected)
        listing = "\n  ".join(self.unexpected)
        super().__init__(
            f"{len(self.unexpected)} checkpoint tensor(s) have no place in {architecture}:\n  {listing}\n"
            "the checkpoint holds layers this model does not build (wrong config.json?)"
        )


class WeightShapeError(WeightLoadError):
    def __init__(self, hf_name: str, ckpt_shape: tuple[int, ...], param_name: str, param_shape: tuple[int, ...]) -> None:
        super().__init__(
            f"checkpoint tensor {hf_name} has shape {ckpt_shape} but parameter {param_name} expects "
            f"{param_shape}; config.json and the weights disagree"
        )


# tensors some exporters write that carry nothing a model needs
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)

Rename = Callable[[str], str | None]


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Rename, architecture: str
) -> set[str]:
    """Copy every tensor to the parameter `rename(hf_name)`; return the parameter names filled.

    Raises WeightShapeError at the first misfit and UnexpectedWeightsError (naming all of them)
    for tensors with no parameter, after the rest have been copied.
    """
    params = dict(model.named_parameters())  # NOTE: tied parameters appear once, under the first name
    filled: set[str] = set()
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        if hf_name.endswith(HARMLESS_SUFFIXES):
            continue
        name = rename(hf_name)
        if name is None:
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        convert = getattr(param, "weight_converter", None)
        src = convert(tensor) if convert is not None else tensor
        if tuple(src.shape) != tuple(param.shape):
            raise WeightShapeError(hf_name, tuple(tensor.shape), name, tuple(param.shape))
        with torch.no_grad():
            param.copy_(src)
        filled.add(name)
    if unexpected:
        raise UnexpectedWeightsError(unexpected, architecture)
    return filled
