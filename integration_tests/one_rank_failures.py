"""The bad-input suite's one-rank cases (importable by spawned ranks): inputs that only some
ranks find bad, the way a real job meets them (a file one node's disk lacks, a rank-0-only
write that fails, a checkpoint file gone). Each case runs the command's own training
function (``fsdp_turbo.cli.worker.train``) on every rank of one process group; the ranks
that find the fault raise its error, and every other rank must stop too, at once, with
that rank's message, not at the collective timeout (here gloo's default, 30 minutes)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORLD = 4
MODEL = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}


@dataclass(frozen=True)
class OneRankCase:
    failing: tuple[int, ...]  # the ranks that meet the fault themselves
    error: str  # the failing ranks' error class
    says: str  # words of their message, which every other rank must repeat
    job: Callable[[dict, int], dict]  # (inputs, rank) -> the job this rank runs
    prepare: Callable[[dict], None] = lambda inputs: None  # before the run, on rank 0, between barriers


def base_job(inputs: dict, output: str, **sections: Any) -> dict:
    job = {"model": {"config": MODEL},
           "data": {"sources": [{"path": f"{inputs['data']}/train.jsonl", "text_field": "text"}], "seq_len": 32},
           "run": {"steps": 2, "micro_batch": 2},
           "checkpoint": {"save_every": 1},
           "logging": {"plot": False},  # drawn and checked in test_integ_cli
           "output_dir": str(Path(inputs["root"]) / output)}
    for name, section in sections.items():
        job[name] = {**job.get(name, {}), **section}
    return job


def _data_missing_on_node_1(inputs: dict, rank: int) -> dict:
    # Node 1 (ranks 2 and 3) has its own disk, where the file was never copied.
    node = rank // 2
    return base_job(inputs, "node_data", data={
        "sources": [{"path": f"{inputs['data']}/node{node}/train.jsonl", "text_field": "text"}],
        "cache_dir": str(Path(inputs["root"]) / f"node_data/cache-node{node}")})


def _metrics_file_is_a_folder(inputs: dict) -> None:
    (Path(inputs["root"]) / "metrics_folder" / "metrics.jsonl").mkdir(parents=True)


def _checkpoints_is_a_file(inputs: dict) -> None:
    (Path(inputs["root"]) / "checkpoints_file").mkdir(parents=True)
    (Path(inputs["root"]) / "checkpoints_file" / "checkpoints").write_text("not a folder")


def _resume_from(name: str) -> Callable[[dict, int], dict]:
    def job(inputs: dict, rank: int) -> dict:
        return base_job(inputs, name, run={"steps": 3})

    return job


def _rng_of_rank_2_gone(inputs: dict) -> None:
    _copy_saved(inputs, "rng_missing").joinpath("rng-rank2.pt").unlink()


def _shard_of_rank_1_gone(inputs: dict) -> None:
    _copy_saved(inputs, "shard_missing").joinpath("__1_0.distcp").unlink()


def _copy_saved(inputs: dict, name: str) -> Path:
    """The saved 2-step run's checkpoints, copied into output folder ``name``; its step-2 folder."""
    target = Path(inputs["root"]) / name
    shutil.copytree(Path(inputs["root"]) / "saved", target)
    (step,) = target.glob("checkpoints/*/step-2")
    return step


CASES: dict[str, OneRankCase] = {
    "one rank: a data file missing on one node's disk": OneRankCase(
        (2, 3), "ConfigError", "no file matches", _data_missing_on_node_1),
    "one rank: rank 0 cannot write its metrics": OneRankCase(
        (0,), "IsADirectoryError", "metrics.jsonl", lambda inputs, rank: base_job(inputs, "metrics_folder"),
        _metrics_file_is_a_folder),
    "one rank: rank 0 cannot write the checkpoint": OneRankCase(
        (0,), "NotADirectoryError", "checkpoints", lambda inputs, rank: base_job(inputs, "checkpoints_file"),
        _checkpoints_is_a_file),
    "one rank: a checkpoint's RNG file missing": OneRankCase(
        (2,), "CheckpointError", "rank 2's RNG states are missing", _resume_from("rng_missing"), _rng_of_rank_2_gone),
    "one rank: a checkpoint shard missing": OneRankCase(
        (0, 1, 2, 3), "CheckpointError", "__1_0.distcp", _resume_from("shard_missing"), _shard_of_rank_1_gone),
    "one rank: an eval set too small, found before step 1": OneRankCase(
        (0, 1, 2, 3), "ConfigError", "data.eval.batches", lambda inputs, rank: base_job(inputs, "small_eval", data={
            "eval": {"sources": [{"path": f"{inputs['data']}/eval.jsonl", "text_field": "text"}], "batches": 50}})),
}


def prepare_data(root: Path) -> dict[str, str]:
    """Documents for training and eval; node 0's copy of the training file (node 1 has none)."""
    data = root / "data"
    (data / "node0").mkdir(parents=True)
    (data / "node1").mkdir()
    rows = [json.dumps({"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 5 + 1)})
            for i in range(64)]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    (data / "node0" / "train.jsonl").write_text("\n".join(rows) + "\n")
    (data / "eval.jsonl").write_text("\n".join(rows[:4]) + "\n")
    return {"root": str(root), "data": str(data)}


def run_cases(names: list[str], inputs: dict) -> dict[str, tuple[str, str, float]]:
    """On every rank, each case: (its error class, its message, the time it ended)."""
    import torch.distributed as dist

    from fsdp_turbo.cli.job_config import JobConfig
    from fsdp_turbo.cli.worker import train

    rank = dist.get_rank()
    train(JobConfig.from_dict(base_job(inputs, "saved")), resume="none")  # what the checkpoint cases resume
    results = {}
    for name in names:
        case = CASES[name]
        if rank == 0:
            case.prepare(inputs)
        dist.barrier()
        job = JobConfig.from_dict(case.job(inputs, rank))
        try:
            train(job, resume="auto")
        except Exception as error:  # the outcome is what the test checks (a BaseException would be a defect)
            results[name] = (type(error).__name__, str(error), time.time())
        else:
            results[name] = ("none", "", time.time())
        dist.barrier()
    return results
