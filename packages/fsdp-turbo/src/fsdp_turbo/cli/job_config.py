"""The ``fsdp-turbo`` job file: model, data, optimizer, run, checkpoint and turbo sections.

Loaded with safe YAML or TOML only (no object construction); every field is checked when
the file is read, so a bad job fails the same way on every rank before any process group.
``turbo`` is the whole ``FSDPTurboConfig`` in its own field names. The sections are built
on the library config's own base (``core.validation.ConfigSection``) and checks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fsdp_turbo.core.dtypes import dtype_name, parse_dtype
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.validation import (
    ConfigSection,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_keys,
    check_patterns,
    check_sections,
)
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen sections normalise their fields once


DOWNLOAD_FIX = ("download the model first, e.g. `hf download ID --local-dir DIR`, and give that folder "
                "(the job never downloads)")


@dataclass(frozen=True)
class ModelSection(ConfigSection):
    """``config``: a mapping, an HF config with ``model_type`` (random init); or
    ``model_name_or_path``: a local Hugging Face model folder (``config.json`` and its
    ``*.safetensors``). Nothing is downloaded: a hub ID is refused with how to fetch it.
    ``dtype``: the parameters' torch dtype (``float32``, ``bfloat16``, ``bf16``, ...)."""

    _prefix: ClassVar[str] = "model"

    config: dict[str, Any] | None = None
    """A Hugging Face model config as a mapping (the arguments of ``AutoConfig.for_model``),
    with ``model_type`` naming the architecture, e.g. ``{model_type: llama, hidden_size: 64}``;
    the weights are initialised from ``run.seed``. Give exactly one of ``config`` and
    ``model_name_or_path``; unset (the default) means the model comes from a folder."""
    model_name_or_path: str | None = None
    """The path of a local Hugging Face model folder (``config.json`` and its
    ``*.safetensors``), whose weights the job starts from; ``~`` is expanded. A hub ID is
    refused (nothing is downloaded). Give exactly one of ``config`` and ``model_name_or_path``."""
    dtype: str = "float32"
    """The torch dtype the model's parameters are built in, by name (``float32``,
    ``bfloat16``/``bf16``, ``float16``/``fp16``, ...); stored as the canonical name. Default
    ``float32``."""

    def __post_init__(self) -> None:
        if (self.config is None) == (self.model_name_or_path is None):
            raise ConfigError("model", "config / model_name_or_path", "give exactly one of the two")
        if self.config is not None:
            _check_hf_config(self.config)
        else:
            _set(self, "model_name_or_path", _local_model_folder(self.model_name_or_path))
        _set(self, "dtype", _dtype_name(self.dtype))


def _check_hf_config(config: Any) -> None:
    """A mapping of string keys, with ``model_type`` a string (``AutoConfig.for_model``'s
    arguments). A path to a config.json is not taken: ``model_name_or_path`` is for folders."""
    if not isinstance(config, dict):
        raise ConfigError("model.config", config, "give the HF config as a mapping, e.g. {model_type: llama, "
                          "hidden_size: 64}, or a local model folder as model.model_name_or_path")
    check_keys(config, "model.config", "use the HF config's field names (text) as keys")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError("model.config.model_type", model_type, "name the HF model type, e.g. 'qwen3_moe'")


def _local_model_folder(path: Any) -> str:
    """The folder at ``path`` (``~`` expanded), once it is a local folder with a config.json."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError("model.model_name_or_path", path, "give the path of a local model folder as text")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError("model.model_name_or_path", path, DOWNLOAD_FIX, reason="there is no such local folder")
    if not (folder / "config.json").is_file():
        raise ConfigError("model.model_name_or_path", path, "give a Hugging Face model folder: config.json plus "
                          "model*.safetensors", reason="the folder has no config.json")
    return str(folder)


def _dtype_name(value: Any) -> str:
    """A dtype name ``parse_dtype`` takes, normalised (``bf16`` -> ``bfloat16``)."""
    if value is None:  # parse_dtype passes None through: the model needs a dtype
        raise ConfigError("model.dtype", value, "name a torch dtype, e.g. 'bfloat16' or 'float32'")
    return dtype_name(parse_dtype(value, "model.dtype"))


@dataclass(frozen=True)
class SourceSection(ConfigSection):
    """One dataset: files by glob (``.jsonl .json .parquet .csv .txt .arrow``) or a
    ``datasets`` ``save_to_disk`` folder. ``text_field``: pretraining, loss on every token
    (``.txt`` files: each file is one document, field ``text``). ``messages_field``: SFT,
    rendered with the tokenizer's chat template, loss on the assistant turns only."""

    _prefix: ClassVar[str] = "data.sources[]"

    path: str = ""
    """Where the source's data is: a file glob (``data/*.jsonl``; ``.jsonl .json .parquet .csv
    .txt .arrow``) or a ``datasets`` ``save_to_disk`` folder. Relative paths are read from the
    folder the command runs in. Required."""
    text_field: str | None = None
    """The column holding plain text, for pretraining: every token carries loss. ``.txt``
    files have one column, ``text``. Give exactly one of ``text_field`` and ``messages_field``."""
    messages_field: str | None = None
    """The column holding conversations (lists of ``{role, content}``), for SFT: rendered with
    the tokenizer's chat template, with loss on the assistant turns only. Give exactly one of
    ``text_field`` and ``messages_field``."""
    weight: float = 1.0
    """The source's share of the training mixture, relative to the other sources' weights
    (a number > 0; default 1, all sources alike). Ignored for eval sources, read in order."""

    def __post_init__(self) -> None:
        where = self._prefix
        if not isinstance(self.path, str) or not self.path:
            raise ConfigError(f"{where}.path", self.path, "give a file glob or a dataset folder")
        if (self.text_field is None) == (self.messages_field is None):
            raise ConfigError(where, {"text_field": self.text_field, "messages_field": self.messages_field},
                              "give exactly one of text_field (pretraining) and messages_field (SFT)")
        for name in ("text_field", "messages_field"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{where}.{name}", value, "give a column name")
        _set(self, "weight", check_float(self.weight, f"{where}.weight", minimum=0.0, strict=True))

    @property
    def sft(self) -> bool:
        return self.messages_field is not None


@dataclass(frozen=True)
class EvalSection(ConfigSection):
    """A held-out set: every ``every`` steps, ``batches`` micro-batches per data shard, from
    the start of ``sources`` in order; the loss is token-weighted over them."""

    _prefix: ClassVar[str] = "data.eval"

    sources: tuple[SourceSection, ...] = ()
    """The held-out sources, a list of mappings with the fields of ``data.sources``, read from
    their start in order (``weight`` is not used). Required, at least one."""
    every: int = 100
    """Evaluate every this many optimizer steps (an integer >= 1; default 100): after steps
    ``every``, ``2 x every``, ... The result is the ``eval_loss`` of that step's metrics row."""
    batches: int = 8
    """Micro-batches each data shard evaluates (an integer >= 1; default 8). The held-out set
    must hold ``batches x run.micro_batch x data shards`` sequences, checked before step 1."""

    def __post_init__(self) -> None:
        _set(self, "sources", _sources(self.sources, "data.eval.sources"))
        check_int(self.every, "data.eval.every", minimum=1)
        check_int(self.batches, "data.eval.batches", minimum=1)


def _sources(value: Any, field_name: str) -> tuple[SourceSection, ...]:
    return check_sections(value, SourceSection, field_name, example="[{path: train.jsonl, text_field: text}]")


OVERFLOW = ("split", "truncate", "error")


@dataclass(frozen=True)
class DataSection(ConfigSection):
    """The training data. ``sources`` (mixed by ``weight``) or the shorthand ``files``: text
    file globs (``stdlib:`` means this Python's standard library folder), each file one
    document, at most ``max_bytes`` of them. ``tokenizer``: a local HF tokenizer folder, or
    ``byte`` (vocab 256, the zero-download demo).

    ``packing``: documents share ``seq_len`` windows, positions restart at each document and
    no token attends to or predicts across a boundary; ``false``: one document per row,
    padded, with an attention mask. ``overflow``: a document longer than ``seq_len`` is
    ``split`` into pieces (each its own document), ``truncate``d to its start, or an ``error``.
    ``cache_dir`` (default ``OUTPUT/data_cache``) keeps the tokenized data for the next run.
    ``cache_lock_timeout_s``: how long a process waits for another one that is preparing
    the same data (it holds the cache's lock) before it fails, naming the lock."""

    _prefix: ClassVar[str] = "data"
    _nested: ClassVar[dict[str, type[ConfigSection]]] = {"eval": EvalSection}

    tokenizer: str = "byte"
    """The tokenizer: the path of a local Hugging Face tokenizer folder (what
    ``AutoTokenizer.from_pretrained`` reads, with a chat template for SFT), or ``byte`` (the
    default: one token a byte, vocabulary 256, nothing to download). Its vocabulary must not
    exceed the model's ``vocab_size``."""
    files: tuple[str, ...] | None = None
    """Shorthand for one pretraining source: a list of text-file globs, each file one
    document, the first ``max_bytes`` bytes of them; ``stdlib:*.py`` means this Python's
    standard library folder. Unset with ``sources`` unset means ``[stdlib:*.py]`` (the demo).
    Give ``files`` or ``sources``, not both."""
    sources: tuple[SourceSection, ...] | None = None
    """The training sources, a list of mappings (``path``, ``text_field`` or
    ``messages_field``, ``weight``), mixed by weight in a seeded order. Unset (the default):
    ``files`` is used. Give ``files`` or ``sources``, not both."""
    seq_len: int = 128
    """Tokens per training sequence (a row of a micro-batch), an integer >= 2; default 128."""
    max_bytes: int = 4_000_000
    """The most bytes of text the ``files`` shorthand reads, over all its files in order, the
    last one cut (an integer >= 1; default 4,000,000). Not used with ``sources``."""
    packing: bool = True
    """``true`` (the default): documents share ``seq_len`` windows back to back; positions
    restart at each document and no token attends to or predicts across a boundary.
    ``false``: one document per row, padded, with an attention mask."""
    overflow: str = "split"
    """What becomes of a document longer than ``seq_len``: ``split`` (the default) into
    pieces, each its own document; ``truncate`` to its first ``seq_len`` tokens; or ``error``."""
    eval: EvalSection | None = None
    """A held-out set evaluated during training (a mapping with ``sources``, ``every`` and
    ``batches``). Unset (the default): no evaluation."""
    cache_dir: str | None = None
    """The folder that keeps the tokenized and packed data for the next run and for every
    rank. Unset (the default): ``OUTPUT/data_cache``, in ``output_dir``."""
    cache_lock_timeout_s: float = 3600.0
    """Seconds a process waits for another one preparing the same data (it holds the cache
    entry's lock) before it fails, naming the lock; a number > 0, default 3600 (an hour)."""

    def __post_init__(self) -> None:
        check_int(self.seq_len, "data.seq_len", minimum=2)
        _set(self, "cache_lock_timeout_s", check_float(self.cache_lock_timeout_s, "data.cache_lock_timeout_s",
                                                       minimum=0.0, strict=True))
        check_int(self.max_bytes, "data.max_bytes", minimum=1)
        check_bool(self.packing, "data.packing")
        _set(self, "overflow", check_choice(self.overflow, "data.overflow", OVERFLOW))
        if not isinstance(self.tokenizer, str) or not self.tokenizer:
            raise ConfigError("data.tokenizer", self.tokenizer, "give a local tokenizer folder or 'byte'")
        if self.files is not None and self.sources is not None:
            raise ConfigError("data", "files and sources", "give sources, or files as their shorthand, not both")
        if self.sources is None:
            files = ("stdlib:*.py",) if self.files is None else self.files
            if isinstance(files, str):
                files = [files]
            if not isinstance(files, list | tuple) or not files or not all(isinstance(f, str) and f for f in files):
                raise ConfigError("data.files", self.files, "give a list of glob patterns")
            _set(self, "files", tuple(files))
        else:
            _set(self, "sources", _sources(self.sources, "data.sources"))
        if self.eval is not None and not isinstance(self.eval, EvalSection):
            raise ConfigError("data.eval", self.eval, "use a mapping with sources, every and batches")
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise ConfigError("data.cache_dir", self.cache_dir, "give a directory path")


@dataclass(frozen=True)
class LoggingSection(ConfigSection):
    """What rank 0 reports besides ``metrics.jsonl``: the loss plot, TensorBoard scalars
    (``torch.utils.tensorboard``), and how often a plain progress line is logged."""

    _prefix: ClassVar[str] = "logging"

    plot: bool = True
    """``true`` (the default): once the run ends, rank 0 draws ``OUTPUT/loss.png`` (loss, eval
    loss and learning rate against the step, with matplotlib). ``false``: no plot, and the run
    ends a few seconds sooner (matplotlib's import and drawing, while the other ranks wait);
    ``metrics.jsonl`` holds the same figures."""
    tensorboard: bool = False
    """``true``: rank 0 also writes loss, eval loss, learning rate, gradient norm, tokens/s and
    peak memory as TensorBoard scalars into ``OUTPUT/tensorboard/``. Default ``false``."""
    every: int = 1
    """Where the output is not a terminal (a log file: Slurm, Kubernetes, CI), rank 0 logs one
    plain progress line every this many steps, and at the run's last step (an integer >= 1;
    default 1, every step). On a terminal a progress bar is redrawn every step instead.
    ``metrics.jsonl`` has a row for every step either way."""

    def __post_init__(self) -> None:
        check_bool(self.plot, "logging.plot")
        check_bool(self.tensorboard, "logging.tensorboard")
        check_int(self.every, "logging.every", minimum=1)


@dataclass(frozen=True)
class OptimizerSection(ConfigSection):
    """AdamW with linear warmup, then cosine decay to ``min_lr_ratio * lr``; gradient clipping."""

    _prefix: ClassVar[str] = "optimizer"

    lr: float = 3e-3
    """The peak learning rate, reached at the end of the warmup (a number > 0; default 3e-3)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay, applied to every parameter (a number >= 0; default 0.01)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's two moment decay rates, each in [0, 1); default ``[0.9, 0.95]``."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the denominator for numerical stability (a number > 0;
    default 1e-8)."""
    warmup_steps: int = 20
    """Optimizer steps over which the learning rate rises linearly from 0 to ``lr`` (an
    integer >= 0; default 20; 0 starts at ``lr``)."""
    min_lr_ratio: float = 0.1
    """Where the cosine decay ends, as a fraction of ``lr``, reached at ``run.steps`` (a number
    in [0, 1]; default 0.1; 1 keeps ``lr`` constant after the warmup)."""
    grad_clip: float | None = 1.0
    """The largest global gradient norm (over all parameters and ranks); larger gradients are
    scaled down to it before the step (a number > 0; default 1.0). ``null``: no clipping (the
    norm is still measured and logged)."""

    def __post_init__(self) -> None:
        _set(self, "lr", check_float(self.lr, "optimizer.lr", minimum=0.0, strict=True))
        _set(self, "weight_decay", check_float(self.weight_decay, "optimizer.weight_decay", minimum=0.0))
        _set(self, "betas", _betas(self.betas))
        _set(self, "eps", check_float(self.eps, "optimizer.eps", minimum=0.0, strict=True))
        check_int(self.warmup_steps, "optimizer.warmup_steps", minimum=0)
        _set(self, "min_lr_ratio", check_float(self.min_lr_ratio, "optimizer.min_lr_ratio", minimum=0.0, maximum=1.0))
        if self.grad_clip is not None:
            _set(self, "grad_clip", check_float(self.grad_clip, "optimizer.grad_clip", minimum=0.0, strict=True))


def _betas(value: Any) -> tuple[float, float]:
    """AdamW's two betas, each in [0, 1): torch's AdamW refuses 1 and above, but only when
    the optimizer is built, after the model is."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ConfigError("optimizer.betas", value, "give two numbers, e.g. [0.9, 0.95]")
    betas = tuple(check_float(b, f"optimizer.betas[{i}]", minimum=0.0) for i, b in enumerate(value))
    for i, beta in enumerate(betas):
        if beta >= 1.0:
            raise ConfigError(f"optimizer.betas[{i}]", beta, "use a number in [0, 1), e.g. [0.9, 0.95]")
    return betas  # type: ignore[return-value]


# gloo refuses a timeout near 1e13 s (its clock overflows: "Invalid timeout"); 1e9 s is ~31 years.
MAX_TIMEOUT_S = 1e9


PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")  # catchable, and sent to stop jobs


def _check_signals(value: Any) -> tuple[str, ...]:
    field_name = "run.preemption_signals"
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ConfigError(field_name, value, f"give a list of signal names, e.g. [SIGTERM, SIGUSR1] (from "
                          f"{list(PREEMPTION_SIGNALS)}), or [] for none")
    names = tuple(str(name).strip().upper() for name in value)
    for name in names:
        if name not in PREEMPTION_SIGNALS:
            raise ConfigError(field_name, list(value), f"use names from {list(PREEMPTION_SIGNALS)}",
                              reason=f"{name} is not a signal a cluster sends before it stops a job")
    return names


@dataclass(frozen=True)
class RunSection(ConfigSection):
    """``micro_batch``: rows per forward on each data shard. ``global_batch``: rows per
    optimizer step over all shards; when set, gradient accumulation is derived from it
    (``global_batch / (micro_batch x data shards)``), so a job that resumes on fewer nodes
    keeps its batch and its data order; else ``grad_accum`` micro-batches a step.

    ``nonfinite``: on a non-finite loss or gradient norm, ``stop`` (the job fails, naming the
    step; no checkpoint of that step is written) or ``skip`` the step (no update; counted in
    the metrics; the job fails after ``max_skipped`` of them).

    ``collective_timeout_s``: how long a collective waits for its peers before it fails, so
    that a dead or stopped peer becomes an error (and a torchrun restart), not a stall."""

    _prefix: ClassVar[str] = "run"

    steps: int = 100
    """Optimizer steps in the whole run (an integer >= 1; default 100); the learning-rate
    schedule spans them. ``--max-steps`` overrides it."""
    micro_batch: int = 4
    """Sequences per forward and backward on each data shard (an integer >= 1; default 4)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step on each data shard (an integer >= 1;
    default 1). Leave it out when ``global_batch`` is set: the accumulation is then derived."""
    global_batch: int | None = None
    """Sequences per optimizer step over all data shards. When set, the accumulation is
    ``global_batch / (micro_batch x data shards)`` at the world the job runs at, which must
    be a whole number, so a job resumed on fewer nodes keeps its batch and its data order.
    Unset (the default): ``grad_accum`` micro-batches a step, whatever the world."""
    seed: int = 0
    """The seed of the weights' initialisation (``model.config`` jobs) and of the data
    mixture's order (an integer >= 0; default 0)."""
    nonfinite: str = "stop"
    """What a step with a non-finite loss or gradient norm does: ``stop`` (the default; the job
    fails, naming the step, and writes no checkpoint of it) or ``skip`` (no update; the step
    is counted in the metrics and the job fails after ``max_skipped`` of them)."""
    max_skipped: int = 10
    """With ``nonfinite: skip``, the job fails once this many steps were skipped (an integer
    >= 1; default 10)."""
    collective_timeout_s: float = 600.0  # NCCL's own default; gloo's (30 min) is too long to notice a lost node
    """Seconds a collective waits for its peers before it fails, so that a dead or stopped
    peer becomes an error (and a torchrun restart), not a stall: a number in [1, 1e9];
    default 600 (NCCL's own default)."""

    preemption_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    """The signals that mean "this job is about to be stopped" (Kubernetes sends SIGTERM before
    its grace period ends; Slurm sends what ``--signal`` names): every rank agrees on a step,
    saves a checkpoint of it, and the command exits with code 75, to be resumed with ``--resume
    auto``. Names from SIGTERM, SIGUSR1, SIGUSR2, SIGHUP and SIGINT; ``[]`` turns this off (a
    signal then stops the job as it would any program). Default ``[SIGTERM, SIGUSR1]``."""

    def __post_init__(self) -> None:
        _set(self, "preemption_signals", _check_signals(self.preemption_signals))
        for name in ("steps", "micro_batch", "grad_accum"):
            check_int(getattr(self, name), f"run.{name}", minimum=1)
        if self.global_batch is not None:
            check_int(self.global_batch, "run.global_batch", minimum=1)
            if self.grad_accum != 1:
                raise ConfigError("run.grad_accum", self.grad_accum, "leave grad_accum out when global_batch is set",
                                  reason="with run.global_batch the accumulation is derived from the world size")
        check_int(self.seed, "run.seed", minimum=0)
        _set(self, "nonfinite", check_choice(self.nonfinite, "run.nonfinite", ("stop", "skip")))
        check_int(self.max_skipped, "run.max_skipped", minimum=1)
        _set(self, "collective_timeout_s", check_float(self.collective_timeout_s, "run.collective_timeout_s",
                                                       minimum=1.0, maximum=MAX_TIMEOUT_S))

    def accumulation(self, data_shards: int) -> int:
        """Micro-batches per optimizer step on ``data_shards`` shards (``ConfigError`` when
        ``global_batch`` does not split into whole micro-batches)."""
        if self.global_batch is None:
            return self.grad_accum
        per_step = self.micro_batch * data_shards
        if self.global_batch % per_step:
            raise ConfigError("run.global_batch", self.global_batch, f"use a multiple of micro_batch x data shards "
                              f"= {self.micro_batch} x {data_shards} = {per_step}",
                              reason="every shard runs the same number of whole micro-batches a step")
        return self.global_batch // per_step


@dataclass(frozen=True)
class CheckpointSection(ConfigSection):
    """Training checkpoints (DCP folders, with the optimizer, scheduler, data position and RNG
    states) that ``--resume`` continues from."""

    _prefix: ClassVar[str] = "checkpoint"

    save_every: int = 0  # 0: only at the end
    """Write a training checkpoint every this many optimizer steps, into
    ``OUTPUT/checkpoints/RUN/step-N`` (an integer >= 0; default 0: only at the last step).
    ``--save-every`` overrides it. A checkpoint is also written at ``--stop-at-step``."""
    keep: int = 3
    """The most checkpoints of this run kept; older ones of the same run are deleted once a
    new one is complete; other runs' are never touched (an integer >= 1; default 3)."""
    async_save: bool = False
    """Write each checkpoint in the background while training goes on: a save returns once every
    rank has copied its shards to host memory (pinned on GPUs), at most one save is in flight, the
    step's folder appears complete only once written, and the job waits for the last one before
    it ends (default false: the loop waits for each save)."""

    def __post_init__(self) -> None:
        check_int(self.save_every, "checkpoint.save_every", minimum=0)
        check_int(self.keep, "checkpoint.keep", minimum=1)
        check_bool(self.async_save, "checkpoint.async_save")


@dataclass(frozen=True)
class PeftSection(ConfigSection):
    """LoRA fine-tuning with PEFT (``pip install fsdp-turbo[peft]``): the model is wrapped by
    ``peft.get_peft_model`` on the meta device before FSDPTurbo shards it; only the adapters
    train. Checkpoints then hold the adapters and their optimizer state only (the base is read
    again from ``model.model_name_or_path`` on resume); ``final/`` holds the adapter in PEFT's
    format (``adapter_config.json``, ``adapter_model.safetensors``)."""

    _prefix: ClassVar[str] = "peft"

    method: str = "lora"
    """The PEFT method: ``"lora"``, the only one."""
    r: int = 8
    """The LoRA rank (an integer >= 1)."""
    alpha: float = 16.0
    """LoRA's ``lora_alpha``: the adapters' output is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """LoRA's dropout on the adapters' input, in [0, 1)."""
    target_modules: tuple[str, ...] = ()
    """Patterns of the modules that get adapters, in the library's wildcard syntax and the base
    model's names, e.g. ``["*.q_proj", "*.v_proj"]`` (resolved to PEFT's exact module names)."""
    target_parameters: tuple[str, ...] = ()
    """PEFT's ``target_parameters``: parameters (not modules) that get adapters, e.g. MoE expert
    weights ``["mlp.experts.gate_up_proj"]``, in PEFT's own suffix syntax."""
    export_merged: bool = False
    """Whether the run also writes ``final_merged/``: the base with the adapters folded in, in
    transformers' layout."""

    def __post_init__(self) -> None:
        _set(self, "method", check_choice(self.method, "peft.method", ("lora",)))
        check_int(self.r, "peft.r", minimum=1)
        check_float(self.alpha, "peft.alpha", minimum=0.0, strict=True)
        check_float(self.dropout, "peft.dropout", minimum=0.0, maximum=0.999)
        _set(self, "target_modules", check_patterns(self.target_modules, "peft.target_modules"))
        _set(self, "target_parameters", check_patterns(self.target_parameters, "peft.target_parameters"))
        if not self.target_modules and not self.target_parameters:
            raise ConfigError("peft.target_modules", [], "name the modules that get adapters, e.g. "
                              "['*.q_proj', '*.v_proj'] (or peft.target_parameters)")
        check_bool(self.export_merged, "peft.export_merged")


@dataclass(frozen=True)
class JobConfig(ConfigSection):
    """A whole job file: each section, and where the run writes."""

    _nested: ClassVar[dict[str, type[ConfigSection]]] = {
        "model": ModelSection,
        "data": DataSection,
        "optimizer": OptimizerSection,
        "run": RunSection,
        "checkpoint": CheckpointSection,
        "logging": LoggingSection,
        "peft": PeftSection,
        "turbo": FSDPTurboConfig,
    }
    _prefix: ClassVar[str] = ""  # sections are named as they stand in the file

    model: ModelSection | None = None
    """The model to train: a Hugging Face config (random initialisation) or a local model
    folder (its weights). Required."""
    data: DataSection = field(default_factory=DataSection)
    """The training (and held-out) data, its tokenizer, sequence length and packing. Default:
    the byte tokenizer over this Python's standard library (the zero-download demo)."""
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    """AdamW, its warmup and cosine learning-rate schedule, and gradient clipping. Default:
    the section's defaults."""
    run: RunSection = field(default_factory=RunSection)
    """Steps, batch sizes, seed, what a non-finite step does, and the collective timeout.
    Default: the section's defaults."""
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """How often training checkpoints are written and how many are kept. Default: one at the
    end, three kept."""
    logging: LoggingSection = field(default_factory=LoggingSection)
    """The loss plot, TensorBoard and the plain progress lines' interval. Default: the plot, no
    TensorBoard, a line every step."""
    peft: PeftSection | None = None
    """LoRA fine-tuning (``peft.method``, ``r``, ``alpha``, ``dropout``, ``target_modules``,
    ``target_parameters``). Unset: full fine-tuning."""
    turbo: FSDPTurboConfig = field(default_factory=FSDPTurboConfig)
    """The whole ``FSDPTurboConfig`` (parallel sizes, FSDP/TP/EP/CP plans, recompute, chunked
    loss, swapping, quantization, compile), in its own field names. Default: FSDP over every
    rank, nothing else."""
    output_dir: str = "fsdp_turbo_output"
    """The folder the run writes to: ``metrics.jsonl``, ``loss.png`` (``logging.plot``), ``checkpoints/``,
    ``final/`` (the model in transformers' layout), ``tensorboard/`` and, by default, the
    data cache. Relative to the folder the command runs in; default ``fsdp_turbo_output``.
    ``--output-dir`` overrides it."""

    def __post_init__(self) -> None:
        if self.model is None:
            raise ConfigError("model", None, "add a model section (an HF config dict or model_name_or_path)")
        for name, kind in self._nested.items():
            value = getattr(self, name)
            if value is None and name in ("model", "peft"):
                continue  # required (model) or optional (peft): None is checked or kept
            if value is None:
                _set(self, name, kind())  # an empty section in the file: its defaults
            elif not isinstance(getattr(self, name), kind):
                raise ConfigError(name, value, f"use a mapping of {kind.__name__} fields")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ConfigError("output_dir", self.output_dir, "give a directory path")

    def with_overrides(self, *, max_steps: int | None = None, output_dir: str | None = None,
                       save_every: int | None = None) -> JobConfig:
        """Command-line flags win over the file."""
        job = self
        if max_steps is not None:
            job = dataclasses.replace(job, run=dataclasses.replace(job.run, steps=max_steps))
        if save_every is not None:
            job = dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, save_every=save_every))
        if output_dir is not None:
            job = dataclasses.replace(job, output_dir=output_dir)
        return job


