"""The trained default model that ships in the package: pd_ssm serves it exactly as transformers runs
it, and it has learned its data (held-out stdlib files score far below a random model's loss)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from pd_ssm import LLM, SamplingParams
from pd_ssm.default_model import TRAINED_DIR, default_model_dir
from tests.conftest import needs_reference_transformers
from tests.test_train_default_model import train_script

PROMPTS = ["def ", "import os\n", "class Stack:\n    def push(self, item):\n"]


def test_default_model_is_the_shipped_checkpoint() -> None:
    path = default_model_dir()
    assert path == TRAINED_DIR and (path / "config.json").is_file()
    assert (path / "model.safetensors").stat().st_size <= 20 * 10**6  # the budget


@needs_reference_transformers
def test_greedy_tokens_equal_transformers() -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM()  # no model: the embedded default
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        want = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == want, prompt
        assert out.outputs[0].text == tok.decode(want)


@needs_reference_transformers
def test_held_out_stdlib_loss_shows_training() -> None:
    """Cross-entropy per byte on held-out stdlib files (the training split's hash): the trained model
    scores about 1 nat/byte (docs/default_model.md); uniform over bytes is ln 256 = 5.5."""
    from transformers import AutoModelForCausalLM

    root = Path(sysconfig.get_paths()["stdlib"])
    # the training script's own file list and split: the same held-out files it evaluated on
    held = [p for p in train_script.stdlib_files(root) if train_script.is_heldout(p.relative_to(root).as_posix())]
    if not held:
        pytest.skip(f"no stdlib .py sources under {root} on this machine")
    data = b"".join(p.read_bytes()[:4096] for p in held[:4])
    ids = torch.tensor([[b + 3 for b in data[:2048]]])
    hf = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32).eval()
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss.item()
    assert loss < 2.0, f"held-out loss {loss:.3f} nats/byte: the shipped weights look untrained"
