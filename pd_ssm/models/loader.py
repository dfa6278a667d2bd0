"""Build a model from an HF checkpoint directory: config.json + safetensors (single or sharded).

    model = load_model(path, device="cuda", dtype=torch.bfloat16, kernels=get_kernels("auto", "cuda"))

The model is constructed directly on `device` in `dtype` (no fp32 copy on the host), then filled
tensor by tensor from the safetensors files; every parameter must be filled (MissingWeightsError
names each one that is not), every tensor must fit (WeightShapeError) and have a place
(UnexpectedWeightsError).  `load_format="dummy"` skips the weight files: random weights of the
real sizes, seeded, with the SSM parameters at their HF initial values so outputs are finite —
for benchmarks and tests that need the shapes, not the knowledge.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from pd_ssm.config import ModelConfig, parse_dtype
from pd_ssm.kernels.dispatch import Kernels
from pd_ssm.models.base import CausalLM
from pd_ssm.models.registry import get_model_class
from pd_ssm.models.weights import MissingWeightsError

LoadFormat = Literal["auto", "safetensors", "dummy"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards in order, or the single file."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        absent = [str(p) for p in files if not p.is_file()]
        if absent:
            raise FileNotFoundError(f"{INDEX_FILE} names shard(s) that are not there: {', '.join(absent)}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}; pd_ssm reads safetensors checkpoints only "
        "(convert .bin files with transformers' save_pretrained)"
    )


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, on the CPU, one at a time."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config: ModelConfig, *, device: torch.device | str, dtype: torch.dtype, kernels: Kernels) -> CausalLM:
    """An instance of the config's architecture on `device`, parameters in `dtype` (SSM A_log, D,
    dt_bias stay fp32), weights not loaded."""
    cls = get_model_class(config.architecture)
    device = torch.device(device)
    with _default_dtype(dtype), device:
        model = cls(config, kernels)
    # buffers computed on the host at construction (rotary inv_freq) follow the parameters
    return model.to(device)


def load_model(
    model_dir: str | Path,
    *,
    device: torch.device | str,
    dtype: torch.dtype | str | None,
    kernels: Kernels,
    load_format: LoadFormat | str = "auto",
    seed: int = 0,
) -> CausalLM:
    """Config, construction and weights of the checkpoint at `model_dir`, in eval mode, no grads.

    dtype None: the dtype config.json records.  load_format "auto"/"safetensors": read the weights;
    "dummy": random weights (`seed`), no file but config.json is read.
    """
    config = ModelConfig.from_pretrained(model_dir)
    model = build_model(
        config, device=device, dtype=config.dtype if dtype is None else parse_dtype(dtype), kernels=kernels
    )
    if load_format == "dummy":
        init_dummy_weights(model, seed=seed)
    elif load_format in ("auto", "safetensors"):
        filled = model.load_weights(iter_safetensors(model_dir))
        missing = {name for name, _ in model.named_parameters()} - filled
        if missing:
            raise MissingWeightsError(missing, where=str(model_dir))
    else:
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: CausalLM, *, seed: int = 0) -> None:
    """Seeded random weights of the real sizes; the SSM parameters as transformers initializes them
    (A = -[1..nheads], D = 1, dt = softplus(dt_bias) log-uniform in [time_step_min, time_step_max]),
    norms 1, biases 0, matrices N(0, 0.02), conv weights U(+-1/sqrt(width)), so logits are finite."""
    hf = model.config.hf
    dt_min = float(hf.get("time_step_min", 1e-3))
    dt_max = float(hf.get("time_step_max", 0.1))
    dt_floor = float(hf.get("time_step_floor", 1e-4))
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(seed + _stable_hash(name))
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            p.copy_(torch.log(torch.arange(1, p.numel() + 1, dtype=torch.float32)))
        elif leaf == "D":
            p.fill_(1.0)
        elif leaf == "dt_bias":
            u = torch.rand(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif leaf == "bias":
            p.zero_()
        elif p.dim() == 1:  # every other vector is a norm weight
            p.fill_(1.0)
        elif name.endswith("conv1d.weight"):
            bound = 1.0 / math.sqrt(p.shape[-1])
            p.uniform_(-bound, bound, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def _stable_hash(name: str) -> int:
    # NOTE: Python's hash() of a str changes per process; the dummy weights must not
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % (2**31)
