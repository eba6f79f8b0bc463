"""The ``fsdp-turbo`` command end to end: real subprocesses, torchrun, 2 and 4 CPU ranks.

One tiny Qwen3-MoE job (FSDP x EP=2 with recompute and chunked loss) trains 6 steps with a
checkpoint every 2. An uninterrupted run is the reference; the other runs stop, crash or
lose a worker and must end with bit-identical weights (the exported safetensors).
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
# one worker runs the whole module, so its module fixtures (launched runs) are built once
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_cli")]

JOB = {
    "model": {"config": {
        "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
        "tie_word_embeddings": False}},
    "data": {"files": ["stdlib:*.py"], "seq_len": 32, "max_bytes": 200_000},
    "optimizer": {"lr": 0.003, "warmup_steps": 2},
    "run": {"steps": 6, "micro_batch": 2, "seed": 0},
    "checkpoint": {"save_every": 2, "keep": 3},
    # one replica slot per EP rank, placed at every forward (a placement that depends only on the
    # step's own load, so a resumed run repeats the uninterrupted one to the bit)
    "turbo": {"expert_parallel_size": 2, "ep_plan": {"apply_modules": ["*mlp.experts"], "redundant_experts": 1,
                                                     "rebalance_every": 1},
              "recompute": True, "chunk_loss": True},
}


# measured, so they differ from run to run
TIMING = ("tokens_per_s", "tflops_per_rank", "peak_memory_mib", "data_wait_s", "step_s")


def untimed(rows):
    """Metrics rows without their measured timings (what must repeat to the bit)."""
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def fsdp_turbo(*args, env=None, check=True, timeout=600):
    command = [sys.executable, "-m", "fsdp_turbo.cli.main", *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def train(job_file, output, nproc=2, *extra, **kwargs):
    return fsdp_turbo("train", job_file, "--nproc-per-node", nproc, "--output-dir", output, *extra, **kwargs)


def progress_steps(result, steps: int = 6) -> list[int]:
    """The steps of rank 0's progress lines: captured output is no terminal, so plain lines
    (step/steps and loss), never a bar redrawn with carriage returns."""
    assert "\r" not in result.stdout + result.stderr
    return [int(step) for step in re.findall(rf"step (\d+)/{steps} \| loss \d+\.\d+ \|", result.stderr)]


def checkpoint(output, step: int) -> Path:
    """The one complete checkpoint of ``step`` in ``output`` (``checkpoints/RUN/step-N``)."""
    (found,) = [p for p in (Path(output) / "checkpoints").glob(f"*/step-{step}") if (p / "meta.json").is_file()]
    return found


def weights(output) -> dict[str, torch.Tensor]:
    return safetensors.load_file(str(Path(output) / "final" / "model.safetensors"))


def metrics(output) -> list[dict]:
    from fsdp_turbo.cli.metrics import read_rows

    return read_rows(Path(output) / "metrics.jsonl")


def assert_same_weights(got, expected):
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def with_data_cache(job: dict, folder) -> dict:
    """``job`` keeping its tokenized data in ``folder``: every launch of a module's job finds the data its
    first launch prepared (the cache is keyed by what the data are: ``test_integ_data_cache``), instead of
    tokenizing them again into each run's own output folder."""
    return {**job, "data": {**job["data"], "cache_dir": str(folder)}}


@pytest.fixture(scope="module", autouse=True)
def _one_data_cache(tmp_path_factory):
    """This module's jobs (``JOB`` and the variants its tests make of it) share one data cache."""
    JOB["data"] = with_data_cache(JOB, tmp_path_factory.mktemp("data-cache"))["data"]
    yield
    del JOB["data"]["cache_dir"]


# The runs compared with the reference draw no loss plot: the reference's is checked, and matplotlib
# would add its import and drawing to the end of every run.
NO_PLOT = {"logging": {"plot": False}}


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("job") / "job.yaml"
    path.write_text(yaml.safe_dump({**JOB, **NO_PLOT}))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 6-step run (with the loss plot, the default)."""
    path = tmp_path_factory.mktemp("reference-job") / "job.yaml"
    path.write_text(yaml.safe_dump(JOB))
    output = tmp_path_factory.mktemp("reference")
    train(path, output)
    return output


def test_train_writes_metrics_plot_checkpoints_and_an_hf_model(reference):
    from transformers import AutoModelForCausalLM

    rows = metrics(reference)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mib"} <= set(rows[0])
    assert rows[-1]["loss"] < rows[0]["loss"]
    # MoE telemetry of every step (core.moe_telemetry): each layer's expert shares sum to 1, EP=2's two halves too
    for row in rows:
        for layer in ("model.layers.0.mlp", "model.layers.1.mlp"):
            assert math.isclose(sum(row[f"moe/{layer}/load"]), 1.0, abs_tol=1e-5)
            assert len(row[f"moe/{layer}/ep_rank_share"]) == 2 and row[f"moe/{layer}/dropped"] == 0.0
            # what the EP ranks computed once the replicas took their share: never less even
            assert math.isclose(sum(row[f"moe/{layer}/ep_rank_share_balanced"]), 1.0, abs_tol=1e-5)
            assert row[f"moe/{layer}/ep_imbalance_balanced"] <= row[f"moe/{layer}/ep_imbalance"] + 1e-9
            assert 0 < row[f"moe/{layer}/router_entropy"] <= 1
        assert row["moe/imbalance_max"] >= 1
    assert (reference / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = sorted(int(p.name.split("-")[1]) for p in (reference / "checkpoints").glob("run-*/step-*"))
    assert steps == [2, 4, 6]  # keep=3
    model = AutoModelForCausalLM.from_pretrained(reference / "final")
    exported = weights(reference)
    # transformers' own layout, every expert gathered: one tensor per expert and projection
    assert "model.layers.0.mlp.experts.gate_up_proj" not in exported
    assert exported["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (32, 32)
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(experts[3, 32:], exported["model.layers.0.mlp.experts.3.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, exported["lm_head.weight"])


@pytest.fixture(scope="module")
def stopped_and_resumed(job_file, reference, tmp_path_factory):
    """The job with ``model_name_or_path`` (meta build + load_pretrained) of the very weights ``init_weights`` gives
    the config-built job, stopped cleanly after step 3 and resumed: one run that two tests read."""
    from fsdp_turbo.checkpoint import init_weights
    from fsdp_turbo.cli.job_config import JobConfig
    from fsdp_turbo.cli.model import build_model

    root = tmp_path_factory.mktemp("stopped_and_resumed")
    start = init_weights(build_model(JobConfig.from_dict(JOB).model), seed=JOB["run"]["seed"])
    start.save_pretrained(root / "start")  # transformers' own save, in the checkpoint layout
    path_job = root / "path_job.yaml"
    path_job.write_text(yaml.safe_dump({**JOB, **NO_PLOT, "model": {"model_name_or_path": str(root / "start")}}))
    out = root / "out"
    plan = fsdp_turbo("plan", path_job, "--world-size", 2).stdout
    stopped = train(path_job, out, 2, "--stop-at-step", 3)
    at_stop = {"final": (out / "final").exists(), "checkpoint_3": checkpoint(out, 3).is_dir(),
               "metrics": (out / "metrics.jsonl").read_text()}
    resumed = train(path_job, out)
    return {"plan": plan, "stopped": stopped, "at_stop": at_stop, "resumed": resumed, "out": out}


def test_a_job_from_a_checkpoint_trains_as_the_job_from_its_config(stopped_and_resumed, reference):
    """The same run to the last bit, through a stop and a resume (so resume and export after a load are covered
    too)."""
    run = stopped_and_resumed
    assert "each rank reads about" in run["plan"]
    assert "this rank read" in run["stopped"].stderr
    assert metrics(run["out"]) == [{**row, **{k: r[k] for k in TIMING}} for row, r in
                                   zip(metrics(reference), metrics(run["out"]), strict=True)]
    assert_same_weights(weights(run["out"]), weights(reference))


def test_resume_after_a_clean_stop_continues_exactly(stopped_and_resumed, reference):
    run = stopped_and_resumed
    assert progress_steps(run["stopped"]) == [1, 2, 3]  # one line a step (logging.every: 1)
    assert not run["at_stop"]["final"] and run["at_stop"]["checkpoint_3"]
    assert progress_steps(run["resumed"]) == [4, 5, 6]
    assert (run["out"] / "metrics.jsonl").read_text().startswith(run["at_stop"]["metrics"])  # appended, never rewritten
    assert metrics(run["out"]) == [{**row, **{k: r[k] for k in TIMING}}
                                   for row, r in zip(metrics(reference), metrics(run["out"]), strict=True)]
    assert_same_weights(weights(run["out"]), weights(reference))


def test_a_four_rank_checkpoint_resumes_at_two_ranks(job_file, tmp_path):
    """EP=2 x FSDP=4 (experts over efsdp=2) saved; loaded at EP=2 x FSDP=2 (efsdp=1)."""
    four, two = tmp_path / "four", tmp_path / "two"
    train(job_file, four, 4, "--max-steps", 3)
    (two / "checkpoints").mkdir(parents=True)
    train(job_file, two, 2, "--max-steps", 3, "--resume", checkpoint(four, 3))
    # No step left to run: the 2-rank export is exactly the 4-rank model.
    assert_same_weights(weights(two), weights(four))
    train(job_file, two, 2, "--max-steps", 5, "--resume", checkpoint(four, 3))
    assert [r["step"] for r in metrics(two)] == [4, 5]


def test_kill_9_of_a_worker_recovers_bit_identically(job_file, reference, tmp_path):
    result = train(job_file, tmp_path, 2, "--max-restarts", 1, env={"FSDP_TURBO_FAULTS": "kill@5:1"})
    assert "exitcode: -9" in result.stderr  # torchrun saw the SIGKILL, restarted the group ...
    assert "resumed from" in result.stderr and "step-4 at step 4" in result.stderr  # ... which resumed
    assert_same_weights(weights(tmp_path), weights(reference))
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 7))
    assert not (tmp_path / "loss.png").exists()  # logging.plot: false


@pytest.mark.parametrize("saving", ["sync", "async"])
def test_a_crash_during_a_save_leaves_the_previous_checkpoint(saving, job_file, reference, tmp_path):
    """Every rank dies once its shards of step 4 are written, before the checkpoint is complete:
    with ``checkpoint.async_save`` while that write runs in the background and training has gone
    on. The step-2 checkpoint (written in the background too) is what ``--resume auto`` takes, and
    the run ends as the uninterrupted, synchronously saved one: its losses and weights to the bit."""
    if saving == "async":
        job_file = tmp_path / "async.yaml"
        job_file.write_text(yaml.safe_dump({**JOB, **NO_PLOT, "checkpoint": {**JOB["checkpoint"], "async_save": True}}))
    output = tmp_path / "out"
    crashed = train(job_file, output, 2, env={"FSDP_TURBO_FAULTS": "crash_save@4"}, check=False)
    assert crashed.returncode != 0
    run = checkpoint(output, 2).parent
    assert (run / "step-2" / "meta.json").is_file() and (run / "step-4.partial").is_dir()
    assert not (run / "step-4").exists()
    train(job_file, output)  # --resume auto takes step 2
    assert_same_weights(weights(output), weights(reference))
    assert untimed(metrics(output)) == untimed(metrics(reference))
    assert sorted(int(p.name.split("-")[1]) for p in run.glob("step-*") if (p / "meta.json").is_file()) == [2, 4, 6]


def test_a_preemption_signal_saves_the_step_and_the_next_run_repeats_the_uninterrupted_one(job_file, reference,
                                                                                           tmp_path):
    """SIGTERM to the command, as Kubernetes sends it to a pod's first process. So that it lands at a
    known step, both workers hold themselves after step 3 (the ``stop@3:*`` fault) until the command
    has passed the signal on to them; then they go on. Every rank agrees on step 3, saves it (not a
    ``save_every`` step), and the command exits with 75. The same command again resumes from step 3
    and ends as the uninterrupted run: its losses and weights to the bit."""
    import signal

    from processes import pending, tree, wait_for

    output = tmp_path / "out"
    command = [sys.executable, "-m", "fsdp_turbo.cli.main", "train", str(job_file), "--nproc-per-node", "2",
               "--output-dir", str(output)]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "FSDP_TURBO_FAULTS": "stop@3:*"})
    try:
        wait_for(lambda: list(tree(launcher.pid).values()).count("T") == 2 or launcher.poll() is not None,
                 "both workers held after step 3")
        # the workers: forked from the launcher's forkserver (``cli.main.run_agent``), its grandchildren
        workers = [pid for pid, state in tree(launcher.pid).items() if state == "T"]
        assert launcher.poll() is None and len(workers) == 2, launcher.communicate()
        launcher.send_signal(signal.SIGTERM)
        wait_for(lambda: all(pending(pid, signal.SIGTERM) for pid in workers), "the signal passed on to the workers")
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        _, stderr = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 75, stderr[-5000:]
    assert "preempted after step 3 (SIGTERM)" in stderr, stderr[-5000:]
    assert [r["step"] for r in metrics(output)] == [1, 2, 3] and not (output / "final").exists()
    assert checkpoint(output, 3).is_dir()
    resumed = train(job_file, output)
    assert "step-3 at step 3" in resumed.stderr
    assert untimed(metrics(output)) == untimed(metrics(reference))
    assert_same_weights(weights(output), weights(reference))


def test_config_errors_are_reported_before_launch(job_file, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**JOB, "turbo": {"expert_parallel_size": 3, "ep_plan": {}}}))
    result = fsdp_turbo("train", bad, "--nproc-per-node", 2, check=False)
    assert result.returncode == 2 and "expert_parallel_size=3" in result.stderr


def test_a_non_finite_step_stops_the_job_and_keeps_the_last_good_checkpoint(job_file, tmp_path):
    result = train(job_file, tmp_path, 2, env={"FSDP_TURBO_FAULTS": "nan@3"}, check=False)
    assert result.returncode != 0
    assert "step 3: loss nan" in result.stderr and "not finite; stopped" in result.stderr
    assert sorted(p.name for p in checkpoint(tmp_path, 2).parent.iterdir()) == ["step-2"]  # nothing of step 3 on
    assert not (tmp_path / "final").exists()


def test_run_nonfinite_skip_drops_the_step_counts_it_and_goes_on(tmp_path):
    path = tmp_path / "skip.yaml"
    path.write_text(yaml.safe_dump({**JOB, **NO_PLOT, "run": {**JOB["run"], "nonfinite": "skip", "max_skipped": 2}}))
    train(path, tmp_path / "out", 2, env={"FSDP_TURBO_FAULTS": "nan@3"})
    rows = metrics(tmp_path / "out")
    assert [r["step"] for r in rows] == list(range(1, 7)) and (tmp_path / "out" / "final").is_dir()
    assert rows[2]["skipped"] is True and rows[2]["skipped_steps"] == 1
    assert rows[3]["skipped"] is False and rows[-1]["skipped_steps"] == 1
    assert rows[3]["lr"] == rows[2]["lr"]  # the schedule did not move on the dropped step
