"""HF `architectures` name -> model class."""

from __future__ import annotations

from collections.abc import Sequence

from pd_ssm.models.bamba import BambaForCausalLM
from pd_ssm.models.base import CausalLM
from pd_ssm.models.mamba2 import Mamba2ForCausalLM
from pd_ssm.models.nemotron_h import NemotronHForCausalLM

_MODELS: dict[str, type[CausalLM]] = {
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
}


class UnsupportedArchitectureError(ValueError):
    """No model class for any of the checkpoint's architectures."""


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: str | Sequence[str]) -> type[CausalLM]:
    """The class of the first supported name in `architectures` (config.json's list, or one name)."""
    names = [architectures] if isinstance(architectures, str) else list(architectures)
    for name in names:
        if name in _MODELS:
            return _MODELS[name]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {names}; pd_ssm supports {', '.join(supported_architectures())}"
    )
