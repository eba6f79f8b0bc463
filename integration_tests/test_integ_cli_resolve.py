"""The ``fsdp-turbo`` command resolves a job once: single-process checks.

The launcher reads the job file, applies the command-line overrides and writes the result
(``cli.resolved_job``); workers build the same ``JobConfig`` from it and apply nothing again.
Sizes (parallel sizes, accumulation, the default world) come from ``cli.sizes`` alone; the
progress display is plain lines off a terminal. (No function in ``cli/`` over 60 lines, and
every job-file field documented: ``test_integ_architecture.py``, ``tools/gen_config_docs.py``.)
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fsdp_turbo.cli import job_config
from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.main import _parser, resolve, torchrun_args
from fsdp_turbo.cli.metrics import ProgressBar, ProgressLines, progress, read_rows
from fsdp_turbo.cli.plan import make_plan
from fsdp_turbo.cli.resolved_job import VARIABLE, load_job, read_resolved, write_resolved
from fsdp_turbo.cli.sizes import default_world_size, job_sizes
from fsdp_turbo.core.errors import ConfigError

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}

# Every field of every job section away from its default, and the turbo section's plans set.
EVERY_SECTION = {
    "model": {"config": {**LLAMA, "rope_scaling": None, "rms_norm_eps": 1e-5}, "dtype": "bf16"},
    "data": {"tokenizer": "tokenizers/chat", "files": None, "max_bytes": 1234,
             "sources": [{"path": "train/*.jsonl", "text_field": "text", "weight": 2.5},
                         {"path": "chat.jsonl", "messages_field": "messages", "weight": 0.5}],
             "seq_len": 64, "packing": False, "overflow": "truncate", "cache_dir": "cache",
             "cache_lock_timeout_s": 12.5,
             "eval": {"sources": [{"path": "eval.jsonl", "text_field": "body", "weight": 3.0}], "every": 3,
                      "batches": 2}},
    "optimizer": {"lr": 1e-4, "weight_decay": 0.1, "betas": [0.8, 0.99], "eps": 1e-6, "warmup_steps": 5,
                  "min_lr_ratio": 0.25, "grad_clip": None},
    "run": {"steps": 12, "micro_batch": 3, "grad_accum": 1, "global_batch": 24, "seed": 7, "nonfinite": "skip",
            "max_skipped": 3, "collective_timeout_s": 120.5, "preemption_signals": ["SIGUSR2"]},
    "checkpoint": {"save_every": 4, "keep": 1, "async_save": True},
    "logging": {"plot": False, "tensorboard": True, "every": 5},
    "peft": {"r": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": ["*q_proj"], "export_merged": True},
    "turbo": {
        "data_parallel_size": 2, "fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
        "fsdp_plan": {"apply_modules": ["model.layers.*"], "ignored_modules": ["model.rotary_emb"],
                      "param_dtype": "bf16", "reduce_dtype": "float32", "output_dtype": "bf16",
                      "cast_forward_inputs": False, "reshard_after_forward": True, "keep_after_forward": ["lm_head"],
                      "unit_groups": [["model.norm", "lm_head"]], "num_to_forward_prefetch": 1,
                      "num_to_backward_prefetch": 2},
        "tp_plan": {"colwise_parallel": ["*q_proj"], "rowwise_parallel": ["*o_proj"], "sequence_parallel": ["*norm"],
                    "loss_parallel": True},
        "expert_parallel_size": 2, "expert_fully_shard_parallel_size": 2,
        "ep_plan": {"apply_modules": ["*experts"], "dispatcher": "eager", "num_chunks": 4},
        "context_parallel_size": 2, "cp_plan": {"mode": "hybrid", "ulysses_size": 2, "load_balance": False},
        "recompute": True, "recompute_plan": ["model.layers.*"],
        "chunk_loss": True, "chunk_loss_plan": {"chunk_size": 256, "z_loss_weight": 1e-4, "logit_softcap": 30.0},
        "swap_activation": True, "swap_activation_plan": ["model.layers.*"],
        "quantization_plan": {"quant_format": "E5M2", "block_size": 64, "scale_mode": "rceil",
                              "apply_modules": ["*mlp*"], "ignored_modules": ["lm_head"], "emax_elem": 15},
        "compile": True, "compile_plan": ["model.layers.*"], "device_type": "cpu"},
    "output_dir": "elsewhere",
}


def _fields_set(section, path: str) -> list[str]:
    """The job-file fields of ``section`` (not turbo's) left at their default."""
    left = []
    for field in dataclasses.fields(section):
        value, name = getattr(section, field.name), f"{path}{field.name}"
        if isinstance(value, job_config.ConfigSection) and not isinstance(value, job_config.FSDPTurboConfig):
            left += _fields_set(value, f"{name}.")
        elif isinstance(value, tuple) and value and isinstance(value[0], job_config.ConfigSection):
            for item in value:
                left += _fields_set(item, f"{name}[].")
        elif field.default is not dataclasses.MISSING and value == field.default and name not in (
                "data.files", "data.sources[].messages_field", "data.sources[].text_field", "run.grad_accum",
                "model.model_name_or_path", "data.eval.sources[].messages_field",  # exclusive with a set one
                "peft.method",  # one choice: "lora"
                "peft.target_parameters"):  # LoRA experts are refused with this job's expert parallel
            left.append(name)
    return left


def test_a_job_with_every_section_set_round_trips_through_the_resolved_file_exactly(tmp_path):
    job = JobConfig.from_dict(EVERY_SECTION)
    assert _fields_set(job, "") == []
    assert JobConfig.from_dict(json.loads(json.dumps(job.to_dict()))) == job
    source = tmp_path / "job.yaml"
    source.write_text(yaml.safe_dump(EVERY_SECTION))
    path = write_resolved(job, source, tmp_path)
    assert read_resolved(path, source) == job
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.resolved.json", "job.yaml"]  # no partial file left


def test_a_model_folder_job_round_trips_too(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA))
    job = JobConfig.from_dict({"model": {"model_name_or_path": str(folder)}})
    assert read_resolved(write_resolved(job, "job.yaml", tmp_path), "job.yaml") == job


def test_the_launcher_applies_the_overrides_and_the_worker_takes_its_file_as_written(tmp_path, monkeypatch):
    source = tmp_path / "job.yaml"
    source.write_text(yaml.safe_dump({"model": {"config": LLAMA}, "run": {"steps": 40}}))
    args = _parser().parse_args(["train", str(source), "--max-steps", "3", "--output-dir", str(tmp_path / "out"),
                                 "--save-every", "1", "--stop-at-step", "2"])
    job = resolve(args)
    assert (job.run.steps, job.output_dir, job.checkpoint.save_every) == (3, str(tmp_path / "out"), 1)
    worker = torchrun_args(args)[torchrun_args(args).index("-m"):]
    assert worker == ["-m", "fsdp_turbo.cli.worker", str(source), "--resume", "auto", "--stop-at-step", "2"]
    monkeypatch.setenv(VARIABLE, str(write_resolved(job, source, tmp_path)))
    source.write_text(yaml.safe_dump({"model": {"config": LLAMA}, "run": {"steps": 99}}))  # edited mid-run
    assert load_job(source) == job
    monkeypatch.delenv(VARIABLE)
    assert load_job(source).run.steps == 99  # a worker torchrun started directly reads the file


def test_a_resolved_file_that_does_not_fit_is_refused_naming_the_variable(tmp_path):
    job = JobConfig.from_dict({"model": {"config": LLAMA}})
    path = write_resolved(job, tmp_path / "job.yaml", tmp_path)
    with pytest.raises(ConfigError, match=f"{VARIABLE}=.*resolved from .*job.yaml, not from .*other.yaml"):
        read_resolved(path, tmp_path / "other.yaml")
    with pytest.raises(ConfigError, match=f"{VARIABLE}=.*no such file"):
        read_resolved(tmp_path / "gone.json", tmp_path / "job.yaml")
    path.write_text('{"format": 0, "job": {}}')
    with pytest.raises(ConfigError, match="not a format-1 resolved job"):
        read_resolved(path, tmp_path / "job.yaml")


def test_a_value_json_cannot_hold_is_a_config_error_before_launch(tmp_path):
    import datetime

    job = JobConfig.from_dict({"model": {"config": {**LLAMA, "created": datetime.date(2024, 1, 1)}}})
    with pytest.raises(ConfigError, match=r"model\.config=.*only text, numbers"):
        write_resolved(job, "job.yaml", tmp_path)


def test_a_worker_runs_the_resolved_job_not_the_job_file(tmp_path):
    """One real worker process (no torchrun: world size 1): the file says 40 steps into
    ``ignored``, the resolved job 2 steps into ``out``."""
    source = tmp_path / "job.yaml"
    written = {"model": {"config": LLAMA}, "data": {"files": ["stdlib:json/*.py"], "seq_len": 16, "max_bytes": 20_000},
               "run": {"steps": 40, "micro_batch": 2}, "output_dir": str(tmp_path / "ignored")}
    source.write_text(yaml.safe_dump(written))
    job = JobConfig.from_dict({**written, "run": {"steps": 2, "micro_batch": 2}, "output_dir": str(tmp_path / "out")})
    env = {**os.environ, VARIABLE: str(write_resolved(job, source, tmp_path)), "OMP_NUM_THREADS": "1"}
    for name in ("WORLD_SIZE", "RANK", "FSDP_TURBO_FAULTS"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "fsdp_turbo.cli.worker", str(source), "--resume", "none"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["step"] for r in read_rows(tmp_path / "out" / "metrics.jsonl")] == [1, 2]
    assert not (tmp_path / "ignored").exists()
    assert "\r" not in result.stderr and "step 2/2 | loss " in result.stderr


# ----- sizes -----------------------------------------------------------------------------------


def test_sizes_come_from_the_library_resolution_and_the_run_section():
    job = JobConfig.from_dict({"model": {"config": LLAMA}, "run": {"micro_batch": 2, "global_batch": 32},
                               "turbo": {"data_parallel_size": 2, "fully_shard_parallel_size": -1}})
    sizes = job_sizes(job, 8)
    assert (sizes.parallel.dp_replicate, sizes.parallel.fsdp) == (2, 4)
    assert sizes.accumulation == 32 // (2 * 8) and sizes.rows_per_step == 32
    assert default_world_size(job) == 2  # fsdp inferred: the product of the others
    with pytest.raises(ConfigError, match=r"run\.global_batch=32.*micro_batch x data shards = 2 x 6"):
        job_sizes(JobConfig.from_dict({**job.to_dict(), "turbo": {"data_parallel_size": 3}}), 6)


def test_plan_takes_its_world_and_sizes_from_the_same_functions():
    job = JobConfig.from_dict({"model": {"config": LLAMA},
                               "turbo": {"fully_shard_parallel_size": 2, "data_parallel_size": 2}})
    assert default_world_size(job) == 4
    lines, _ = make_plan(job)
    assert "world size 4" in lines[0]
    uneven = JobConfig.from_dict({**job.to_dict(), "run": {"micro_batch": 2, "global_batch": 6}})
    with pytest.raises(ConfigError, match=r"run\.global_batch=6"):  # as train would refuse it
        make_plan(uneven)


# ----- progress ---------------------------------------------------------------------------------


def _row(step: int, **extra) -> dict:
    return {"step": step, "loss": 5.0 - step / 10, "tokens_per_s": 1234.5, "tflops_per_rank": 0.0123,
            "peak_memory_mib": 321.0, **extra}


def test_off_a_terminal_progress_is_a_plain_logged_line_per_interval(caplog):
    display = progress(10, 2, 7, enabled=True, every=2, stream=io.StringIO())
    assert isinstance(display, ProgressLines)
    with caplog.at_level(logging.INFO, logger="fsdp_turbo"):
        for step in range(3, 8):
            display.show(_row(step, eval_loss=4.25) if step == 6 else _row(step))
    lines = [r.getMessage() for r in caplog.records if "step " in r.getMessage()]
    assert [line.split(" | ")[0].split()[-1] for line in lines] == ["4/10", "6/10", "7/10"]  # every 2, and the last
    assert lines[1].endswith("step 6/10 | loss 4.4000 | eval 4.2500 | tok/s 1,234 | TFLOPS/rank 0.012 | "
                             "peak mem 321MiB")
    assert all("\r" not in line for line in lines)


def test_on_a_terminal_progress_is_the_bar():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = progress(10, 0, 10, enabled=True, stream=Terminal())
    assert isinstance(bar, ProgressBar)
    bar.close()
    assert isinstance(progress(10, 0, 10, enabled=False, stream=Terminal()), ProgressLines)  # not rank 0


def test_logging_every_is_checked():
    with pytest.raises(ConfigError, match=r"logging\.every=0"):
        JobConfig.from_dict({"model": {"config": LLAMA}, "logging": {"every": 0}})


# ----- the job's ignore index --------------------------------------------------------------------


def test_the_jobs_ignore_index_labels_the_data_and_keys_the_sft_cache(tmp_path):
    """``turbo.model_facts.ignore_index`` reaches the data the launcher prepares (and the
    workers load): SFT labels, piece starts and padding carry it; an SFT source whose cached
    labels hold it is prepared again under another key; a text source keeps its entry."""
    from fsdp_turbo.cli.main import _prepare_data
    from fsdp_turbo.core.model_facts import IGNORE_INDEX

    tokenizer = Path(__file__).resolve().parents[1] / "examples" / "sft_tiny" / "tokenizer"
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": messages}) for _ in range(4)) + "\n")
    (tmp_path / "text.jsonl").write_text("\n".join(json.dumps({"text": "word " * 40}) for _ in range(4)) + "\n")
    job = {"model": {"config": {**LLAMA, "vocab_size": 4096}}, "output_dir": str(tmp_path / "out"),
           "data": {"tokenizer": str(tokenizer), "seq_len": 64, "packing": False,
                    "sources": [{"path": str(tmp_path / "chat.jsonl"), "messages_field": "messages"},
                                {"path": str(tmp_path / "text.jsonl"), "text_field": "text"}]}}
    default = _prepare_data(JobConfig.from_dict(job))
    other = _prepare_data(JobConfig.from_dict({**job, "turbo": {"model_facts": {"ignore_index": -7}}}))
    sft, text = other.train_sources
    assert [s.built for s in other.train_sources] == [True, False]  # only the SFT labels depend on it
    assert sft.key != default.train_sources[0].key and sft.identity != default.train_sources[0].identity
    assert text.key == default.train_sources[1].key
    labels = set(_flat(sft.tokens.column("labels").to_pylist()))
    assert -7 in labels and IGNORE_INDEX not in labels
    assert sft.stats["loss_tokens"] == default.train_sources[0].stats["loss_tokens"]
    batch = other.train.batch_at(0, 4)
    assert batch.ignore_index == -7 and IGNORE_INDEX not in batch.labels.tolist()[0]
    reference = default.train.batch_at(0, 4)
    assert torch.equal(batch.labels == -7, reference.labels == IGNORE_INDEX)  # the same positions carry no loss
    assert batch.loss_tokens() == reference.loss_tokens() > 0


def _flat(rows) -> list[int]:
    return [value for row in rows for value in row]


def test_the_launchers_vocab_check_reads_the_size_the_job_states(tmp_path):
    """Before launch, the data's tokenizer is checked against the model's vocab_size as the job's
    ``model.config`` or the folder's config.json states it (read without building the config);
    unstated, the model type's default (from the built config). A model smaller than the byte
    tokenizer's 256 tokens fails with the fix, each way."""
    from fsdp_turbo.cli.job_config import ModelSection
    from fsdp_turbo.cli.main import _prepare_data
    from fsdp_turbo.cli.model import stated_vocab_size

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": 100}))
    unstated = {key: value for key, value in LLAMA.items() if key != "vocab_size"}
    assert stated_vocab_size(ModelSection(config={**LLAMA, "vocab_size": 100})) == 100
    assert stated_vocab_size(ModelSection(model_name_or_path=str(folder))) == 100
    assert stated_vocab_size(ModelSection(config=unstated)) is None  # LlamaConfig's default, 32000: it fits
    (tmp_path / "text.txt").write_text("a few words of text " * 100)
    data = {"files": [str(tmp_path / "text.txt")], "seq_len": 32}
    for model in ({"config": {**LLAMA, "vocab_size": 100}}, {"model_name_or_path": str(folder)}):
        job = JobConfig.from_dict({"model": model, "output_dir": str(tmp_path / "out"), "data": data})
        with pytest.raises(ConfigError, match="use a model with vocab_size >= "):
            _prepare_data(job)
    assert _prepare_data(JobConfig.from_dict({"model": {"config": unstated}, "output_dir": str(tmp_path / "out"),
                                              "data": data})).train_sources
