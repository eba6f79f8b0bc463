"""Progress on rank 0: a tqdm bar, ``metrics.jsonl`` (a row per step), ``loss.png`` and,
when asked, TensorBoard event files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
PLOT = "loss.png"

# Dense bf16 peak TFLOP/s of known accelerators, for MFU (CPU and unknown devices: none).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0, "Ascend910B": 313.0}


def peak_tflops(device_name: str | None) -> float | None:
    if not device_name:
        return None
    return next((peak for key, peak in PEAK_TFLOPS.items() if key.lower() in device_name.lower()), None)


RESUMED = "resumed_at_step"


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The training curve: one row per step. The file is only ever appended to; a resume
    appends ``{"resumed_at_step": N}``, after which the rows past step N written before it
    (by the run that was interrupted) no longer count."""
    curve: list[dict[str, Any]] = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if RESUMED in row:
            curve = [r for r in curve if r["step"] <= row[RESUMED]]
        else:
            curve.append(row)
    return curve


class MetricsLog:
    """Appends one JSON row per step, and a marker when a run resumes (see ``read_rows``).
    Never rewritten, so a crash cannot lose what was written before it."""

    def __init__(self, output_dir: str | Path, resumed_step: int) -> None:
        self.path = Path(output_dir) / METRICS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._append({RESUMED: resumed_step})  # also a fresh start (0) over an old file
        else:
            self.path.touch()

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.path)

    def write(self, row: dict[str, Any]) -> None:
        self._append(row)

    def _append(self, row: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


# metrics.jsonl name -> TensorBoard tag
TENSORBOARD_TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                    "tokens_per_s": "train/tokens_per_s", "peak_memory_mib": "train/peak_memory_mib",
                    "eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity"}
TENSORBOARD = "tensorboard"


class TensorBoardLog:
    """The same rows, as scalars, through ``torch.utils.tensorboard`` into ``OUTPUT/tensorboard``."""

    def __init__(self, output_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(output_dir) / TENSORBOARD))

    def write(self, row: dict[str, Any]) -> None:
        for name, tag in TENSORBOARD_TAGS.items():
            if name in row:
                self.writer.add_scalar(tag, row[name], global_step=row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def plot_loss(output_dir: str | Path) -> Path:
    """``loss.png``: the loss (and eval loss, where measured) and the learning rate against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(Path(output_dir) / METRICS)
    steps = [r["step"] for r in rows]
    figure, loss_axis = plt.subplots(figsize=(7, 4))
    loss_axis.plot(steps, [r["loss"] for r in rows], color="tab:blue", label="loss")
    evaluated = [r for r in rows if "eval_loss" in r]
    if evaluated:
        loss_axis.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o-", color="tab:green",
                       label="eval loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    lr_axis = loss_axis.twinx()
    lr_axis.plot(steps, [r["lr"] for r in rows], color="tab:orange", label="lr")
    lr_axis.set_ylabel("learning rate")
    figure.legend(loc="upper right")
    figure.tight_layout()
    path = Path(output_dir) / PLOT
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, unit="step")
