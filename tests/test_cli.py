"""`pd-ssm generate` as a user runs it: a real process, on the default model and on a saved one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_cli(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PD_SSM_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "pd_ssm.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_generate_on_embedded_default(tmp_path: Path) -> None:
    first = run_cli(["generate", "--prompt", "def ", "--max-tokens", "8"], tmp_path)
    assert first.returncode == 0, first.stderr
    assert "output:" in first.stdout and "finish:" in first.stdout
    assert not any(tmp_path.iterdir())  # the trained model ships in the package: nothing is written
    again = run_cli(["generate", "--prompt", "def ", "--max-tokens", "8"], tmp_path)
    assert again.stdout == first.stdout  # greedy decoding of a fixed checkpoint


def test_generate_on_transformers_checkpoint(hf_checkpoint: Any, tmp_path: Path) -> None:
    path, _ = hf_checkpoint("nemotron-h")
    out = run_cli(["generate", "--model", str(path), "--prompt", "abc", "--prompt", "xyz",
                   "--max-tokens", "5", "--temperature", "0.7", "--seed", "3"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("output:") == 2


def test_bad_model_dir_is_one_clear_line(tmp_path: Path) -> None:
    out = run_cli(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"], tmp_path)
    assert out.returncode == 2
    assert "error" in out.stderr and "Traceback" not in out.stderr
