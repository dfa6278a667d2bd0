"""Checkpoint loading: single file and shards, HF name variants, and every error naming its tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import StepRunner, hf_logits, load_pd, make_hf_model, rel_err, save_checkpoint
from safetensors.torch import load_file, save_file

from pd_ssm.config import ConfigError
from pd_ssm.kernels.dispatch import get_kernels
from pd_ssm.models import (
    MissingWeightsError,
    UnexpectedWeightsError,
    UnsupportedArchitectureError,
    WeightShapeError,
    get_model_class,
    load_model,
    supported_architectures,
)

FAMILIES = ["mamba2-g1", "bamba-attn-first-last", "nemotron-h"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    for name in FAMILIES:
        hf = make_hf_model(name)
        out[name] = (hf, save_checkpoint(hf, tmp_path_factory.mktemp(name)))
    return out


def _copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _prefill_logits(model, prompt: list[int]) -> torch.Tensor:
    runner = StepRunner(model)
    runner.add("x", slot=1)
    return runner.step([("x", prompt, False)])[0]


def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedArchitectureError) as e:
        get_model_class(["LlamaForCausalLM"])
    for arch in supported_architectures():
        assert arch in str(e.value)
    assert "LlamaForCausalLM" in str(e.value)
    assert set(supported_architectures()) == {"Mamba2ForCausalLM", "BambaForCausalLM", "NemotronHForCausalLM"}

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 8}))
    with pytest.raises(ConfigError) as e2:
        load_model(tmp_path, device="cpu", dtype=torch.float32, kernels=get_kernels("torch", "cpu"))
    for arch in supported_architectures():
        assert arch in str(e2.value)


@pytest.mark.parametrize("name", FAMILIES)
def test_missing_tensor_is_named(name: str, checkpoints, tmp_path: Path) -> None:
    _, path = checkpoints[name]
    tensors = load_file(str(path / "model.safetensors"))
    dropped = sorted(k for k in tensors if k.endswith("mixer.D") or k.endswith("mamba.D"))[-1]
    dropped2 = sorted(k for k in tensors if "conv1d.weight" in k)[0]
    del tensors[dropped], tensors[dropped2]
    with pytest.raises(MissingWeightsError) as e:
        load_pd(_copy_with(path, tmp_path / "ckpt", tensors))
    # the message names the parameters (for these checkpoints they carry the HF names)
    assert dropped in str(e.value) and dropped2 in str(e.value)
    assert len(e.value.missing) == 2


def test_shape_mismatch_names_tensor_and_shapes(checkpoints, tmp_path: Path) -> None:
    _, path = checkpoints["bamba-attn-first-last"]
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.mamba.in_proj.weight"
    good = tuple(tensors[name].shape)
    tensors[name] = torch.zeros(good[0] + 6, good[1])  # e.g. an in_proj with extra (d_mlp) columns
    with pytest.raises(WeightShapeError) as e:
        load_pd(_copy_with(path, tmp_path / "ckpt", tensors))
    msg = str(e.value)
    assert name in msg and str((good[0] + 6, good[1])) in msg and str(good) in msg


def test_stacked_halves_each_checked_and_both_required(checkpoints, tmp_path: Path) -> None:
    """Bamba's gate_proj and up_proj fill the halves of one gate_up_proj: a half of the wrong shape
    is named with the half's shape, and a checkpoint with only one half leaves the stack missing."""
    hf, path = checkpoints["bamba-attn-first-last"]
    tensors = load_file(str(path / "model.safetensors"))
    up = "model.layers.1.feed_forward.up_proj.weight"
    good = tuple(tensors[up].shape)
    model = load_pd(_copy_with(path, tmp_path / "ok", tensors))
    stacked = model.get_parameter("model.layers.1.feed_forward.gate_up_proj.weight")
    assert tuple(stacked.shape) == (2 * good[0], good[1])
    assert torch.equal(stacked[good[0]:], tensors[up]) and torch.equal(
        stacked[:good[0]], tensors["model.layers.1.feed_forward.gate_proj.weight"])
    bad = dict(tensors)
    bad[up] = torch.randn(good[0] + 2, good[1])
    with pytest.raises(WeightShapeError) as e:
        load_pd(_copy_with(path, tmp_path / "bad", bad))
    assert up in str(e.value) and str(good) in str(e.value)
    del tensors[up]
    with pytest.raises(MissingWeightsError) as e2:
        load_pd(_copy_with(path, tmp_path / "half", tensors))
    assert e2.value.missing == ["model.layers.1.feed_forward.gate_up_proj.weight"]


def test_unexpected_tensor_raises_harmless_ones_skipped(checkpoints, tmp_path: Path) -> None:
    _, path = checkpoints["mamba2-g1"]
    tensors = load_file(str(path / "model.safetensors"))
    tensors["backbone.layers.0.mixer.rotary_emb.inv_freq"] = torch.ones(4)  # harmless
    load_pd(_copy_with(path, tmp_path / "ok", tensors))
    tensors["backbone.layers.9.mixer.D"] = torch.ones(8)
    tensors["backbone.layers.0.mixer.extra_thing"] = torch.ones(8)
    with pytest.raises(UnexpectedWeightsError) as e:
        load_pd(_copy_with(path, tmp_path / "bad", tensors))
    assert "backbone.layers.9.mixer.D" in str(e.value) and "backbone.layers.0.mixer.extra_thing" in str(e.value)


def test_name_variants_load_the_same_model(checkpoints, tmp_path: Path) -> None:
    """mamba_ssm's `backbone.embedding`, NemotronH's `model.` trunk and its `mtp.` heads."""
    prompt = list(range(5, 30))
    hf, path = checkpoints["mamba2-g1"]
    tensors = load_file(str(path / "model.safetensors"))
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    got = _prefill_logits(load_pd(_copy_with(path, tmp_path / "m2", tensors)), prompt)
    assert rel_err(got, hf_logits(hf, prompt)).max() < 1e-4

    hf, path = checkpoints["nemotron-h"]
    tensors = load_file(str(path / "model.safetensors"))
    renamed = {("model." + k.removeprefix("backbone.")) if k.startswith("backbone.") else k: v for k, v in tensors.items()}
    renamed["mtp.layers.0.norm.weight"] = torch.ones(64)
    got = _prefill_logits(load_pd(_copy_with(path, tmp_path / "nh", renamed)), prompt)
    assert rel_err(got, hf_logits(hf, prompt)).max() < 1e-4


def test_missing_files_are_reported(checkpoints, tmp_path: Path) -> None:
    _, path = checkpoints["mamba2-g1"]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pd(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"backbone.norm_f.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        load_pd(tmp_path)


@pytest.mark.parametrize("name", FAMILIES)
def test_dummy_load_reads_only_config_and_is_finite(name: str, checkpoints, tmp_path: Path) -> None:
    _, path = checkpoints[name]
    (tmp_path / "config.json").write_text((path / "config.json").read_text())  # nothing else on disk
    kw = dict(device="cpu", dtype=torch.float32, kernels=get_kernels("torch", "cpu"), load_format="dummy")
    a = load_model(tmp_path, seed=3, **kw)
    b = load_model(tmp_path, seed=3, **kw)
    c = load_model(tmp_path, seed=4, **kw)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True):
        assert torch.equal(pa, pb), n
        if pa.dim() == 2:
            assert not torch.equal(pa, pc), n
    logits = _prefill_logits(a, list(range(1, 40)))
    assert logits.shape == (39, a.config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_bf16_load_keeps_ssm_params_fp32_and_tracks_fp32(name: str, checkpoints) -> None:
    _, path = checkpoints[name]
    model = load_pd(path, dtype=torch.bfloat16)
    for n, p in model.named_parameters():
        want = torch.float32 if n.rsplit(".", 1)[-1] in ("A_log", "D", "dt_bias") else torch.bfloat16
        assert p.dtype == want, n
    prompt = list(range(7, 47))
    got = _prefill_logits(model, prompt)
    ref = _prefill_logits(load_pd(path), prompt)
    assert torch.isfinite(got).all()
    # bf16 has ~3 significant digits; 20 layers of rounding stay well inside this
    assert rel_err(got, ref).max() < 0.1


def test_stacked_name_maps_weights_and_biases_of_the_stack_only() -> None:
    from pd_ssm.models.bamba import GATE_UP_STACK
    from pd_ssm.models.weights import Shard, stacked_name

    assert stacked_name("model.layers.3.feed_forward.up_proj.bias", GATE_UP_STACK) == Shard(
        "model.layers.3.feed_forward.gate_up_proj.bias", 1, 2)
    assert stacked_name("gate_proj.weight", GATE_UP_STACK) == Shard("gate_up_proj.weight", 0, 2)
    for name in ("model.layers.3.feed_forward.down_proj.weight", "lm_head.weight", "model.norm_up_proj"):
        assert stacked_name(name, GATE_UP_STACK) == name


def test_gated_mlp_with_biases_loads_both_halves() -> None:
    from pd_ssm.layers import GatedMLP
    from pd_ssm.models.bamba import GATE_UP_STACK
    from pd_ssm.models.weights import load_named_weights, stacked_name

    g = torch.Generator().manual_seed(12)
    ckpt = {f"{m}.{leaf}": torch.randn(*shape, generator=g)
            for m, rows in (("gate_proj", 6), ("up_proj", 6), ("down_proj", 4))
            for leaf, shape in (("weight", (rows, 4 if m != "down_proj" else 6)), ("bias", (rows,)))}
    mlp = GatedMLP(4, 6, get_kernels("torch", "cpu"), bias=True)
    filled = load_named_weights(mlp, ckpt.items(), lambda n: stacked_name(n, GATE_UP_STACK), "test")
    assert filled == {"gate_up_proj.weight", "gate_up_proj.bias", "down_proj.weight", "down_proj.bias"}
    assert torch.equal(mlp.gate_up_proj.bias, torch.cat([ckpt["gate_proj.bias"], ckpt["up_proj.bias"]]))
    x = torch.randn(3, 4, generator=g)
    want = torch.nn.functional.linear(
        torch.nn.functional.silu(torch.nn.functional.linear(x, ckpt["gate_proj.weight"], ckpt["gate_proj.bias"]))
        * torch.nn.functional.linear(x, ckpt["up_proj.weight"], ckpt["up_proj.bias"]),
        ckpt["down_proj.weight"], ckpt["down_proj.bias"])
    torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)
