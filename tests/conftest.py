"""Shared fixtures: tiny random HF checkpoints built by transformers and saved to disk.

Every numeric comparison in the suite is against transformers' own models (nobody here wrote
them).  Weights are random and the parameters HF initializes to constants (A_log, dt_bias, D,
norm weights) are perturbed so that no code path is tested on a trivial value.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(4, os.cpu_count() or 1))
# Without a GPU, Triton kernels run in Triton's interpreter (tiny shapes only). It is read when a
# kernel is decorated, so it must be set before any pd_ssm Triton module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def verify_direct_launches() -> Iterator[None]:
    """On a GPU, every launch whose caller hands FastKernel a compiled kernel (the SSD launcher's
    plans) is checked against Triton's own specialization of its arguments (FastKernel.verify):
    a wrong kernel would raise, not run. Without CUDA every launch is interpreted."""
    if not torch.cuda.is_available():
        yield
        return
    try:
        from pd_ssm.kernels.launch import FastKernel
    except ImportError:  # no Triton: no Triton launches to check
        yield
        return
    FastKernel.verify = True
    yield
    FastKernel.verify = False


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded tiny hybrid's random checkpoint on disk (default_model.write_checkpoint), once per
    module: the worker and role tests build their engines from it."""
    from pd_ssm.default_model import write_checkpoint

    path = tmp_path_factory.mktemp("tiny")
    write_checkpoint(path)
    return path


CHUNK = 16

# name -> (HF class name, config kwargs).  Chunk size 16 so that prompts of a few dozen tokens
# span several chunks; n_groups 1 and 2; attention first / middle / last for the hybrids.
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2-g1": ("Mamba2", dict(num_heads=8, head_dim=16, hidden_size=64, state_size=16, num_hidden_layers=3,
                                 n_groups=1, chunk_size=CHUNK, vocab_size=384)),
    "mamba2-g2-tied": ("Mamba2", dict(num_heads=8, head_dim=16, hidden_size=64, state_size=16, num_hidden_layers=2,
                                      n_groups=2, chunk_size=CHUNK, vocab_size=384, tie_word_embeddings=True,
                                      time_step_limit=(0.01, 0.08))),
    "bamba-attn-first": ("Bamba", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[0],
                                       mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2,
                                       mamba_chunk_size=CHUNK, vocab_size=384)),
    "bamba-attn-middle": ("Bamba", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=4, attn_layer_indices=[1],
                                        mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=1,
                                        mamba_chunk_size=CHUNK, vocab_size=384)),
    "bamba-attn-last": ("Bamba", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=1, attn_layer_indices=[2],
                                      mamba_n_heads=4, mamba_d_state=16, mamba_n_groups=2,
                                      mamba_chunk_size=CHUNK, vocab_size=384)),
    "nemotron-h": ("NemotronH", dict(hidden_size=64, layers_block_type=["mamba", "attention", "mlp", "mamba", "mlp"],
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16,
                                     ssm_state_size=16, n_groups=2, chunk_size=CHUNK, vocab_size=384)),
    "nemotron-h-attn-first": ("NemotronH", dict(hidden_size=64, layers_block_type=["attention", "mamba", "mlp", "mamba"],
                                                num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                                intermediate_size=96, mamba_num_heads=4, mamba_head_dim=32,
                                                ssm_state_size=16, n_groups=1, chunk_size=CHUNK, vocab_size=384)),
    "nemotron-h-attn-last": ("NemotronH", dict(hidden_size=64, layers_block_type=["mamba", "mlp", "mamba", "attention"],
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                               intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16,
                                               ssm_state_size=16, n_groups=4, chunk_size=CHUNK, vocab_size=384)),
}


def _transformers_version() -> tuple[int, ...]:
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())


# The numerics every test compares against are those of transformers >= 5.24 (its Mamba2 / Bamba
# gated norm is grouped; 5.17, the GPU machine's version, normalizes over all of d_inner).
needs_reference_transformers = pytest.mark.skipif(
    _transformers_version() < (5, 24),
    reason="compares against transformers >= 5.24 reference numerics (older gated norm differs)",
)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def record_logits(llm: Any) -> dict[str, list[torch.Tensor]]:
    """Wrap an LLM's runner so every sampled row's logits are kept, per request, in order."""
    seen: dict[str, list[torch.Tensor]] = {}
    runner = llm.engine.runner
    inner = runner.forward_logits

    def wrapped(sched: Any, *args: Any) -> Any:
        logits, reqs = inner(sched, *args)
        for row, req in zip(logits, reqs, strict=True):
            seen.setdefault(req.req_id, []).append(row.detach().clone())
        return logits, reqs

    runner.forward_logits = wrapped
    return seen


def build_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    import transformers

    family, kwargs = TINY[name]
    config = getattr(transformers, f"{family}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 8.0, generator=g)))
            elif pname.endswith("dt_bias"):
                p.copy_(torch.empty_like(p).uniform_(-4.0, -1.0, generator=g))
            elif pname.endswith(".D"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
            elif "norm" in pname and pname.endswith("weight"):
                p.copy_(torch.empty_like(p).uniform_(0.8, 1.2, generator=g))
            elif p.dim() >= 2:  # make logits spread out so greedy ties are practically impossible
                p.mul_(2.0)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """name -> (directory written by save_pretrained, the transformers model itself)."""
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in made:
            model = build_hf_model(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            made[name] = (path, model)
        return made[name]

    return get


@pytest.fixture(autouse=True)
def pool_invariants_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine step in every test ends with `free + used == total` on both pools."""
    from pd_ssm.engine.engine import Engine

    inner = Engine.step

    def checked(self: Engine) -> Any:
        out = inner(self)
        self.cache.check()
        held = {r.req_id for r in self.requests.values() if self.cache.holds(r.req_id)}
        held |= {rid for rid in self.reserved if self.cache.holds(rid)}
        held |= {r.req_id for r in self.in_flight if self.cache.holds(r.req_id)}  # read next step
        assert self.cache.num_used_slots == len(held), "a slot is held by no live request or reservation"
        return out

    monkeypatch.setattr(Engine, "step", checked)


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
