"""`LLM`: the offline API, in vLLM's shape.

    from pd_ssm import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", device="cpu")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pd_ssm.config import CacheConfig, EngineConfig, SchedulerConfig
from pd_ssm.engine.engine import Engine
from pd_ssm.outputs import RequestOutput
from pd_ssm.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int = 1024,
        num_state_slots: int | None = None,
        mamba_ssm_cache_dtype: str = "float32",
        enable_chunked_prefill: bool = True,
        kernel_backend: str = "auto",
        load_format: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        prefill_cuda_graphs: bool = True,
        async_scheduling: bool | None = None,
    ) -> None:
        if model is None:
            from pd_ssm.default_model import default_model_dir

            model = str(default_model_dir())
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            load_format=load_format,
            kernel_backend=kernel_backend,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            prefill_cuda_graphs=prefill_cuda_graphs,
            async_scheduling=async_scheduling,
            cache=CacheConfig(
                num_state_slots=num_state_slots or max_num_seqs,
                num_kv_blocks=num_kv_blocks,
                block_size=block_size,
                mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,  # type: ignore[arg-type]
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=enable_chunked_prefill,
            ),
        )
        self.engine = Engine(config)

    def get_tokenizer(self):  # noqa: ANN201 - the engine's Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in the order given."""
        batch: list[Prompt] = (
            [prompts]  # type: ignore[list-item]
            if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
            else list(prompts)  # type: ignore[arg-type]
        )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(batch)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                # NOTE: only the final output is kept: the engine builds no per-step outputs (vLLM's LLM
                # does the same)
                final_only = dataclasses.replace(p, output_kind="final_only")
                ids.append(self.engine.add_request(prompt, final_only).req_id)
        except Exception:
            for req_id in ids:  # nothing half-admitted stays behind
                self.engine.abort(req_id)
            raise
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
