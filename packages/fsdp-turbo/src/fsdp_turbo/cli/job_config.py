"""The ``fsdp-turbo`` job file: model, data, optimizer, run, checkpoint and turbo sections.

Loaded with safe YAML or TOML only (no object construction); every field is checked when
the file is read, so a bad job fails the same way on every rank before any process group.
``turbo`` is the whole ``FSDPTurboConfig`` in its own field names.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig


def _section(cls, data: Any, name: str):
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ConfigError(name, data, f"use a mapping of {cls.__name__} fields")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{name}.{unknown[0]}", data[unknown[0]], f"remove it; known fields are {sorted(known)}",
                          reason="unknown field")
    return cls(**data)


def _positive(value: Any, name: str, *, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if zero else 1):
        raise ConfigError(name, value, f"use an integer >= {0 if zero else 1}")


@dataclass
class ModelSection:
    """``config``: an HF config dict with ``model_type`` (random init); or ``model_name_or_path``."""

    config: dict[str, Any] | None = None
    model_name_or_path: str | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if (self.config is None) == (self.model_name_or_path is None):
            raise ConfigError("model", "config / model_name_or_path", "give exactly one of the two")
        if self.config is not None and "model_type" not in self.config:
            raise ConfigError("model.config.model_type", None, "name the HF model type, e.g. 'qwen3_moe'")


@dataclass
class DataSection:
    """Local text files (globs; ``stdlib:`` means this Python's standard library folder),
    byte-level tokens packed into ``seq_len`` windows."""

    files: list[str] = field(default_factory=lambda: ["stdlib:*.py"])
    seq_len: int = 128
    max_bytes: int = 4_000_000
    tokenizer: str = "byte"

    def __post_init__(self) -> None:
        _positive(self.seq_len, "data.seq_len")
        _positive(self.max_bytes, "data.max_bytes")
        if self.tokenizer != "byte":
            raise ConfigError("data.tokenizer", self.tokenizer, "use 'byte' (vocab 256)")
        if not self.files or not all(isinstance(f, str) for f in self.files):
            raise ConfigError("data.files", self.files, "give a list of glob patterns")


@dataclass
class OptimizerSection:
    """AdamW with linear warmup, then cosine decay to ``min_lr_ratio * lr``; gradient clipping."""

    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if not (isinstance(self.lr, int | float) and self.lr > 0):
            raise ConfigError("optimizer.lr", self.lr, "use a positive learning rate")
        _positive(self.warmup_steps, "optimizer.warmup_steps", zero=True)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("optimizer.min_lr_ratio", self.min_lr_ratio, "use a value in [0, 1]")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError("optimizer.grad_clip", self.grad_clip, "use a positive norm, or null for none")


@dataclass
class RunSection:
    steps: int = 100
    micro_batch: int = 4
    grad_accum: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batch", "grad_accum"):
            _positive(getattr(self, name), f"run.{name}")
        _positive(self.seed, "run.seed", zero=True)


@dataclass
class CheckpointSection:
    save_every: int = 0  # 0: only at the end
    keep: int = 3

    def __post_init__(self) -> None:
        _positive(self.save_every, "checkpoint.save_every", zero=True)
        _positive(self.keep, "checkpoint.keep")


@dataclass
class JobConfig:
    model: ModelSection
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    run: RunSection = field(default_factory=RunSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    turbo: FSDPTurboConfig = field(default_factory=FSDPTurboConfig)
    output_dir: str = "fsdp_turbo_output"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobConfig:
        if not isinstance(data, dict):
            raise ConfigError("job", type(data).__name__, "the file must hold a mapping of sections")
        sections = {"model", "data", "optimizer", "run", "checkpoint", "turbo", "output_dir"}
        unknown = sorted(set(data) - sections)
        if unknown:
            raise ConfigError(unknown[0], data[unknown[0]], f"remove it; sections are {sorted(sections)}",
                              reason="unknown section")
        if "model" not in data:
            raise ConfigError("model", None, "add a model section (an HF config dict or model_name_or_path)")
        return cls(
            model=_section(ModelSection, data["model"], "model"),
            data=_section(DataSection, data.get("data"), "data"),
            optimizer=_section(OptimizerSection, data.get("optimizer"), "optimizer"),
            run=_section(RunSection, data.get("run"), "run"),
            checkpoint=_section(CheckpointSection, data.get("checkpoint"), "checkpoint"),
            turbo=FSDPTurboConfig.from_dict(data.get("turbo") or {}),
            output_dir=str(data.get("output_dir", "fsdp_turbo_output")),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> JobConfig:
        path = Path(path)
        if path.suffix.lower() in (".yaml", ".yml"):
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        elif path.suffix.lower() == ".toml":
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        else:
            raise ConfigError("config", str(path), "use a .yaml, .yml or .toml file")
        return cls.from_dict(data)

    def with_overrides(self, *, max_steps: int | None = None, output_dir: str | None = None,
                       save_every: int | None = None) -> JobConfig:
        """Command-line flags win over the file."""
        if max_steps is not None:
            self.run = dataclasses.replace(self.run, steps=max_steps)
        if save_every is not None:
            self.checkpoint = dataclasses.replace(self.checkpoint, save_every=save_every)
        if output_dir is not None:
            self.output_dir = output_dir
        return self
