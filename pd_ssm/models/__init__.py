"""Model families (one file each), the architecture registry and the checkpoint loader."""

from pd_ssm.models.base import CausalLM
from pd_ssm.models.loader import build_model, init_dummy_weights, iter_safetensors, load_model
from pd_ssm.models.registry import UnsupportedArchitectureError, get_model_class, supported_architectures
from pd_ssm.models.weights import (
    MissingWeightsError,
    UnexpectedWeightsError,
    WeightLoadError,
    WeightShapeError,
)

__all__ = [
    "CausalLM",
    "MissingWeightsError",
    "UnexpectedWeightsError",
    "UnsupportedArchitectureError",
    "WeightLoadError",
    "WeightShapeError",
    "build_model",
    "get_model_class",
    "init_dummy_weights",
    "iter_safetensors",
    "load_model",
    "supported_architectures",
]
