"""Progress on rank 0: a tqdm bar on a terminal, else a plain log line per logging interval;
``metrics.jsonl`` (a row per step), ``loss.png`` and, when asked, TensorBoard event files."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.logging import get_logger
from fsdp_turbo.core.moe_telemetry import scalars

_log = get_logger("fsdp_turbo.cli.metrics")

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
    (by the run that was interrupted) no longer count.

    A row cut short by a crash mid-append is skipped with a warning: on the last line (the
    run crashed), or followed by a resume marker (it crashed and a resumed run appended after
    it; before ``MetricsLog`` ended such a line first, the marker went onto the end of it).
    Any other unreadable line means the file was damaged otherwise (edited by hand, two jobs
    writing one output_dir): a ``ConfigError`` names the file and the line."""
    path = Path(path)
    lines = [(number, line) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if line.strip()]
    curve: list[dict[str, Any]] = []
    for index, (number, line) in enumerate(lines):
        row = _parse_row(line)
        if row is None:
            row = _skip_torn_row(path, number, line, lines[index + 1][1] if index + 1 < len(lines) else None)
        if row is None:
            continue
        if RESUMED in row:
            curve = [r for r in curve if r["step"] <= row[RESUMED]]
        else:
            curve.append(row)
    return curve


def _parse_row(line: str) -> dict[str, Any] | None:
    """A step row or a resume marker, else ``None`` (a torn or foreign line)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) and ("step" in row or RESUMED in row) else None


def _skip_torn_row(path: Path, number: int, line: str, following: str | None) -> dict[str, Any] | None:
    """For the unreadable line ``number``: warn and give the resume marker glued to its end, or
    warn and give ``None`` (skip it) where a crash explains it; else raise (see ``read_rows``)."""
    torn = f"{path} line {number} is a row cut short by a crash"
    marker_at = line.rfind(json.dumps({RESUMED: 0})[:-2])  # where '{"resumed_at_step":' starts
    glued = _parse_row(line[marker_at:]) if marker_at > 0 else None
    if glued is not None and RESUMED in glued:
        _log.warning(f"{torn}, with the resumed run's marker written onto its end; the row is skipped")
        return glued
    if following is None:
        _log.warning(f"{torn} (the run stopped while writing it); skipped")
        return None
    after = _parse_row(following)
    if after is not None and RESUMED in after:
        _log.warning(f"{torn} (the run stopped while writing it, and a later run resumed); skipped")
        return None
    raise ConfigError("output_dir", str(path.parent), f"repair or delete line {number} of {path} (each line must "
                      "be one JSON row), or use a fresh output_dir",
                      reason=f"line {number} of {path.name} is not a metrics row, and no crash explains it")


class MetricsLog:
    """Appends one JSON row per step, and a marker when a run resumes (see ``read_rows``).
    Never rewritten, so a crash cannot lose what was written before it."""

    def __init__(self, output_dir: str | Path, resumed_step: int) -> None:
        self.path = Path(output_dir) / METRICS
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._end_torn_line()
            self._append({RESUMED: resumed_step})  # also a fresh start (0) over an old file
        else:
            self.path.touch()

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.path)

    def write(self, row: dict[str, Any]) -> None:
        self._append(row)

    def _end_torn_line(self) -> None:
        """A crash mid-append leaves a last line with no newline: end it, so the marker that
        follows starts its own line (``read_rows`` then skips the torn one, not the marker)."""
        with self.path.open("rb") as handle:
            if handle.seek(0, os.SEEK_END) == 0:
                return
            handle.seek(-1, os.SEEK_END)
            torn = handle.read(1) != b"\n"
        if torn:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write("\n")

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
        for name, value in scalars(row).items():  # MoE telemetry's (its per-expert lists stay in metrics.jsonl)
            if name.startswith("moe/"):
                self.writer.add_scalar(name, value, global_step=row["step"])
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


def _shown(row: dict[str, Any]) -> dict[str, str]:
    """The figures a progress display shows of a metrics row, formatted, in order."""
    shown = {"loss": f"{row['loss']:.4f}"}
    if "eval_loss" in row:
        shown["eval"] = f"{row['eval_loss']:.4f}"
    if "mfu" in row:
        shown["mfu"] = f"{row['mfu']:.1%}"
    shown.update(tok_s=f"{row['tokens_per_s']:,.0f}", tflops=f"{row['tflops_per_rank']:.3f}",
                 peak_mem=f"{row['peak_memory_mib']:,.0f}MiB")
    return shown


def progress_line(row: dict[str, Any], total: int) -> str:
    """One step's plain progress line: ``step 3/100 | loss 5.4321 | eval 5.1234 | tok/s 1,234 | ...``."""
    shown = _shown(row)
    names = {"tok_s": "tok/s", "tflops": "TFLOPS/rank", "peak_mem": "peak mem"}
    parts = [f"step {row['step']}/{total}", *(f"{names.get(k, k)} {v}" for k, v in shown.items())]
    if row.get("skipped"):
        parts.append("skipped (not finite)")
    return " | ".join(parts)


class ProgressBar:
    """tqdm's bar, for a terminal: one line redrawn in place."""

    def __init__(self, total: int, initial: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, unit="step")

    def show(self, row: dict[str, Any]) -> None:
        self.bar.set_postfix(**_shown(row))
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class ProgressLines:
    """Plain lines through the library's logger, for a log file (Slurm, Kubernetes, CI): a
    redrawn bar there is one line of carriage returns that grows by the step."""

    def __init__(self, total: int, last: int, every: int) -> None:
        self.total, self.last, self.every = total, last, every

    def show(self, row: dict[str, Any]) -> None:
        if row["step"] % self.every == 0 or row["step"] == self.last:
            _log.info(progress_line(row, self.total))

    def close(self) -> None:
        return None


Progress = ProgressBar | ProgressLines


def progress(total: int, initial: int, last: int, *, enabled: bool, every: int = 1,
             stream: TextIO | None = None) -> Progress:
    """Rank 0's progress display: the bar when ``stream`` (the bar's and the logger's,
    stderr by default) is a terminal, else a line every ``every`` steps and at ``last``.
    Other ranks (``enabled`` false) get the lines, which the rank-0 logger keeps quiet."""
    stream = sys.stderr if stream is None else stream
    if enabled and stream.isatty():
        return ProgressBar(total, initial)
    return ProgressLines(total, last, every)
