"""`pd-ssm bench engine`: floors and table (pure, CPU), the CPU refusal, the dummy 2.7B build (GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pd_ssm.bench.engine import BenchRow, format_table
from pd_ssm.bench.roofline import ModelBytes, decode_floor_bytes, model_bytes, prefill_floor
from pd_ssm.bench.shapes import MAMBA2_2_7B, SHAPES, write_shape
from pd_ssm.config import CacheConfig, ModelConfig
from pd_ssm.engine.memory_plan import kv_block_bytes, state_slot_bytes
from pd_ssm.kernels.dispatch import get_kernels
from pd_ssm.models.loader import build_model, load_model

COPY = 4.28e12  # bytes/s, TARGETS.md
MMA = 700e12  # FLOP/s


def meta_2_7b() -> tuple[torch.nn.Module, ModelBytes]:
    mc = ModelConfig.from_hf_dict(MAMBA2_2_7B)
    model = build_model(mc, device="meta", dtype=torch.bfloat16, kernels=get_kernels("torch", "cpu"))
    return model, model_bytes(model, state_slot_bytes(mc, CacheConfig(), torch.bfloat16), 0)


def test_2_7b_shape_and_floors() -> None:
    model, mb = meta_2_7b()
    params = sum(p.numel() for p in model.parameters())
    assert round(params / 1e9, 2) == 2.70  # TARGETS.md: 2.70 G params
    assert mb.untied_embedding == 0  # tied: the LM head reads the table once
    assert abs(mb.weights - 2 * params) < 1e6  # bf16, except A_log / D / dt_bias in fp32
    # TARGETS.md: weight-only floor 1.26 ms/step; the state adds 2 x 64 x 80*64*128 x 4 B per sequence
    assert 1.24e-3 < mb.weights / COPY < 1.28e-3
    one = decode_floor_bytes(mb, 1)
    assert one == mb.weights + 2 * mb.slot
    assert decode_floor_bytes(mb, 128) - one == 127 * 2 * mb.slot
    seconds, kind, _ = prefill_floor(mb, 2048, COPY, MMA)
    assert kind == "matmul" and 0.014 < seconds < 0.016  # 2 x 2048 x 2.57 G / 700 TFLOP/s


# parameter counts the model cards publish: Bamba-9B "9.78B", Nemotron-H-8B-Base-8K 8,100,852,736
@pytest.mark.parametrize("name, params, kinds", [
    ("bamba-9b", 9.78e9, {"mamba": 29, "attention": 3}),
    ("nemotron-h-8b", 8_100_852_736, {"mamba": 24, "attention": 4, "mlp": 24}),
])
def test_hybrid_shapes(name: str, params: float, kinds: dict[str, int]) -> None:
    mc = ModelConfig.from_hf_dict(SHAPES[name])
    model = build_model(mc, device="meta", dtype=torch.bfloat16, kernels=get_kernels("torch", "cpu"))
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - params) < 5e6
    assert {k: mc.layer_kinds.count(k) for k in set(mc.layer_kinds)} == kinds
    cc = CacheConfig()
    mb = model_bytes(model, state_slot_bytes(mc, cc, torch.bfloat16), kv_block_bytes(mc, cc, torch.bfloat16) // cc.block_size)
    # K and V of 8 heads of 128 in bf16, per attention layer
    assert mb.kv_token == kinds["attention"] * 2 * 8 * 128 * 2
    assert mb.untied_embedding == mc.vocab_size * 4096 * 2
    # a decode step at batch 4 over 1000 tokens of context: the KV read and the 4 new tokens' KV written
    assert decode_floor_bytes(mb, 4, 1000) - decode_floor_bytes(mb, 4) == 1000 * mb.kv_token


def test_untied_embedding_counts_only_rows_read() -> None:
    mc = ModelConfig.from_hf_dict({**MAMBA2_2_7B, "num_hidden_layers": 2, "tie_word_embeddings": False})
    model = build_model(mc, device="meta", dtype=torch.bfloat16, kernels=get_kernels("torch", "cpu"))
    mb = model_bytes(model, 1000, 0)
    table = 50288 * 2560 * 2
    assert mb.untied_embedding == table and mb.embedding_row == 2560 * 2
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert decode_floor_bytes(mb, 4) == total - table + 4 * 2560 * 2 + 2 * 4 * 1000


def test_format_table() -> None:
    rows = [BenchRow("prefill 2048 tok, batch 1", 25.0, 15.0, "matmul", "<= 30 ms", True, 10),
            BenchRow("decode batch 32", 5.0, 3.8, "memory", "<= 1.25 x floor", False, 10, "eager")]
    result = dict(device="GPU", model="m", params=2.7e9, load_format="dummy", dtype="bfloat16",
                  mamba_ssm_cache_dtype="float32", kernel_backend="torch", cuda_graphs=True, async_scheduling=True,
                  copy_gbps=4280.0,
                  matmul_tflops=700.0, rows=[{f: getattr(r, f) for f in r.__slots__} for r in rows])
    text = format_table(json.loads(json.dumps(result)))
    assert text.splitlines()[4].split()[-2:] == ["no", "eager"]
    result["rows"][0].update(target="-", met=None)  # a model without TARGETS.md's prefill target
    assert format_table(result).splitlines()[3].split()[-2:] == ["-", "-"]
    assert "copy 4280 GB/s" in text and "2.70 G params" in text and "async scheduling on" in text
    assert "1.32" in text and "yes" in text and "no" in text and "eager" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_engine_on_cpu_is_one_clear_line() -> None:
    out = subprocess.run([sys.executable, "-m", "pd_ssm.cli", "bench", "engine"], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 2
    assert "needs a CUDA device" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("args, says", [
    (["--model", "/nonexistent", "--shape", "bamba-9b"], "--model and --shape"),
    (["--shape", "bamba-9b", "--decode-context", "0"], "decode_context must be >= 1"),
])
def test_bench_engine_refuses_bad_options_in_one_line(args: list[str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "pd_ssm.cli", "bench", "engine", *args], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 2
    assert says in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("name", list(SHAPES))
def test_write_shape_makes_a_weightless_checkpoint_of_the_shape(name: str, tmp_path: Path) -> None:
    model_dir = write_shape(name, tmp_path / "nested" / name)
    assert sorted(p.name for p in Path(model_dir).iterdir()) == ["config.json"]
    assert json.loads((Path(model_dir) / "config.json").read_text()) == SHAPES[name]
    mc = ModelConfig.from_pretrained(model_dir)
    assert mc.vocab_size == SHAPES[name]["vocab_size"] and mc.num_layers == ModelConfig.from_hf_dict(SHAPES[name]).num_layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dummy_2_7b_builds_on_gpu_quickly(tmp_path: Path) -> None:
    write_shape("mamba2-2.7b", tmp_path)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = load_model(tmp_path, device="cuda", dtype=torch.bfloat16, kernels=get_kernels("torch", "cuda"),
                       load_format="dummy")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    params = list(model.parameters())
    assert all(p.is_cuda for p in params)
    assert round(sum(p.numel() for p in params) / 1e9, 2) == 2.70
    assert {p.dtype for p in params} == {torch.bfloat16, torch.float32}
    assert all(torch.isfinite(p).all() for p in params[:8])
    assert seconds < 20, f"building 2.7B dummy weights on the GPU took {seconds:.1f} s"
    del model, params
    torch.cuda.empty_cache()
