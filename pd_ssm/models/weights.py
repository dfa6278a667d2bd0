"""Copying HF-named checkpoint tensors into a model's parameters, and the errors that can say why not.

A model's `load_weights` supplies only its renaming rule (HF name -> parameter name, a Shard of a
stacked parameter, or None for a tensor that is known to be harmless to skip); the loop here does the
rest: layout conversion (a parameter may carry a `weight_converter`, e.g. conv1d [dim, 1, width] ->
[dim, width]), the shape check, the copy, and the collection of names it cannot place.

Stacked parameters: one matmul where the checkpoint has several with the same input (an MLP's
gate_proj and up_proj as one gate_up_proj): each checkpoint tensor fills one block of rows, and the
parameter counts as loaded once every block has arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

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


class Shard(NamedTuple):
    """A checkpoint tensor that fills block `block` of `blocks` equal blocks of rows (dim 0) of `name`."""

    name: str
    block: int
    blocks: int


Rename = Callable[[str], "str | Shard | None"]


def stacked_name(name: str, stacks: Mapping[str, Shard]) -> str | Shard:
    """`name` as a Shard where its module is one of a stack: stacks maps a checkpoint module name
    (e.g. "gate_proj") to the Shard of the stacked module it goes to (name: "gate_up_proj")."""
    head, _, leaf = name.rpartition(".")  # leaf: weight / bias
    prefix, _, module = head.rpartition(".")
    to = stacks.get(module)
    if to is None or not leaf:
        return name
    return to._replace(name=f"{prefix}.{to.name}.{leaf}" if prefix else f"{to.name}.{leaf}")


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rename: Rename, architecture: str
) -> set[str]:
    """Copy every tensor to the parameter `rename(hf_name)`; return the parameter names filled.

    Raises WeightShapeError at the first misfit and UnexpectedWeightsError (naming all of them)
    for tensors with no parameter, after the rest have been copied.
    """
    params = dict(model.named_parameters())  # NOTE: tied parameters appear once, under the first name
    filled: set[str] = set()
    shards: dict[str, set[int]] = {}  # stacked parameter -> the blocks loaded so far
    unexpected: list[str] = []
    for hf_name, tensor in weights:
        if hf_name.endswith(HARMLESS_SUFFIXES):
            continue
        to = rename(hf_name)
        if to is None:
            continue
        name = to.name if isinstance(to, Shard) else to
        param = params.get(name)
        if param is None:
            unexpected.append(hf_name)
            continue
        convert = getattr(param, "weight_converter", None)
        src = convert(tensor) if convert is not None else tensor
        dst: torch.Tensor = param
        if isinstance(to, Shard):
            rows = param.shape[0] // to.blocks
            if param.shape[0] % to.blocks or not 0 <= to.block < to.blocks:
                raise ValueError(f"{name} [{param.shape[0]} rows] has no block {to.block} of {to.blocks}")
            dst = param[to.block * rows:(to.block + 1) * rows]
        if tuple(src.shape) != tuple(dst.shape):
            raise WeightShapeError(hf_name, tuple(tensor.shape), name, tuple(dst.shape))
        with torch.no_grad():
            dst.copy_(src)
        if isinstance(to, Shard):
            done = shards.setdefault(name, set())
            done.add(to.block)
            if len(done) < to.blocks:
                continue  # a block still missing leaves the parameter unloaded: it is reported as missing
        filled.add(name)
    if unexpected:
        raise UnexpectedWeightsError(unexpected, architecture)
    return filled
