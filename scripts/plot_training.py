"""Loss curve of a `train_default_model.py` run: train_log.jsonl -> PNG.

    python scripts/plot_training.py /tmp/out/train_log.jsonl --out docs/default_model_loss.png

Train loss (mean over each logging interval) and held-out loss, in nats per byte, against bytes
seen; the title names the model size and the data.  Needs matplotlib (not a pd_ssm dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def read_log(path: Path) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not any(r.get("kind") == "train" for r in records):
        raise ValueError(f"{path} has no 'train' records: is it a train_default_model.py log?")
    return records


def plot(records: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on build machines
    import matplotlib.pyplot as plt

    config = next((r for r in records if r.get("kind") == "config"), {})
    train = [r for r in records if r.get("kind") == "train"]
    held = [r for r in records if r.get("kind") in ("eval", "final")]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot([r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], label="train", lw=1.2)
    if held:
        ax.plot([r["tokens"] / 1e6 for r in held], [r["heldout_loss"] for r in held], "o-", ms=3,
                label=f"held-out (final {held[-1]['heldout_loss']:.3f})")
    ax.set_xlabel("bytes seen (millions)")
    ax.set_ylabel("cross entropy (nats / byte)")
    params = config.get("params")
    size = f"{params / 1e6:.1f}M-param Bamba" if params else "Bamba"
    ax.set_title(f"{size} on Python stdlib sources ({config.get('device', '?')})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="train_log.jsonl written by train_default_model.py")
    p.add_argument("--out", type=Path, default=Path("docs/default_model_loss.png"))
    a = p.parse_args(argv)
    plot(read_log(a.log), a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
