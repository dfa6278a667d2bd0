"""`pd-ssm bench transfer` on the CPU at tiny sizes: every part runs, checks its bytes, reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pd_ssm.bench.transfer import PageShape, TransferBenchOptions, format_table, make_pages
from pd_ssm.cli import main


def test_cli_runs_every_part_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "transfer.json"
    rc = main(["bench", "transfer", "--tiny", "--repeats", "1", "--dtypes", "bfloat16", "--stream-tokens", "24",
               "--connectors", "zmq,nccl,stream,stream-nccl", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    rows = {(r["connector"], r["pages"]) for r in result["rows"]}
    assert rows == {("zmq", "mamba2"), ("zmq", "hybrid"), ("nccl", "mamba2"), ("nccl", "hybrid"),
                    ("nccl-stream", "mamba2"), ("nccl-stream", "hybrid")}
    for r in result["rows"]:
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["ratio"] == pytest.approx(r["gbps"] / r["baseline_gbps"])
        assert r["state_dtype"] == "bfloat16" and r["nbytes"] > 0
        if r["connector"] == "nccl":  # the row is the loaded figure; one request alone comes beside it
            assert r["in_flight"] == 8 and r["one_gbps"] > 0 and r["one_ratio"] == pytest.approx(r["one_gbps"] / r["baseline_gbps"])
    for key, via in (("stream", "zmq"), ("stream_nccl", "nccl")):
        s = result[key]
        assert s["connector"] == via and s["tokens"] == 24
        assert s["transfer_ms"] > 0 and 0 <= s["overlap_ms"] <= s["transfer_ms"]
        assert s["prefill_ms"] > 0 and s["streamed_total_ms"] > 0 and 0.0 <= s["hidden"] <= 1.0
        assert s["whole_send_ms"] > 0 and 0 <= s["exposed_ms"] <= s["transfer_ms"]
    table = capsys.readouterr().out
    assert "tcp socket" in table and "dist send/recv" in table
    assert "layer-wise streaming over zmq" in table and "layer-wise streaming over nccl" in table
    assert table == format_table(result) + "\n"


def test_pages_have_the_shapes_asked_for() -> None:
    shape = PageShape.tiny()
    mamba = make_pages("m", "mamba2", torch.float32, shape)
    hybrid = make_pages("h", "hybrid", torch.bfloat16, shape)
    assert sorted(mamba.layers) == list(range(shape.layers)) and {p.kind for p in mamba.layers.values()} == {"ssm"}
    attn = [i for i, p in hybrid.layers.items() if p.kind == "attention"]
    assert attn == [i for i in range(shape.layers) if i % shape.attn_every == shape.attn_every - 1] and attn
    assert mamba.layers[0].tensors["ssm"].shape == shape.ssm and mamba.layers[0].tensors["ssm"].dtype == torch.float32
    assert hybrid.layers[attn[0]].tensors["k"].shape == shape.kv
    assert all((t != 0).all() for p in mamba.layers.values() for t in p.tensors.values())


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown"):
        TransferBenchOptions(connectors=["carrier-pigeon"])
    with pytest.raises(ValueError, match="unknown"):
        TransferBenchOptions(dtypes=["float8"])
    with pytest.raises(ValueError, match="repeats"):
        TransferBenchOptions(repeats=0)
