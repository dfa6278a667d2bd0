"""pd_ssm: prefill-decode disaggregated serving for Mamba2 / SSM / hybrid language models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from pd_ssm.engine.llm import LLM
    from pd_ssm.outputs import CompletionOutput, RequestOutput
    from pd_ssm.sampling_params import SamplingParams

# Imported on first use, so `import pd_ssm.cache.manager` (pure bookkeeping) does not load the
# whole engine.
_LAZY = {
    "LLM": "pd_ssm.engine.llm",
    "SamplingParams": "pd_ssm.sampling_params",
    "RequestOutput": "pd_ssm.outputs",
    "CompletionOutput": "pd_ssm.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pd_ssm' has no attribute {name!r}")
