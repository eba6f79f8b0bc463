"""What a run may never do, through the real command: lose another run's work, run code
from a checkpoint, or take a malformed fault-injection variable for a plan.

Two runs share one output folder; a checkpoint's ``.metadata`` is replaced by a pickle
that would create a file; the test hooks' variable is checked before anything starts.
The runs are one worker each: which run a checkpoint belongs to is rank 0's business (the
run id every rank saves under is broadcast from it, which every two-rank test of
``test_integ_cli.py`` goes through)."""

import pickle
import signal
from pathlib import Path

import pytest
import yaml
from test_integ_cli import fsdp_turbo, metrics, train, with_data_cache

from fsdp_turbo.cli import faults
from fsdp_turbo.core.errors import ConfigError

pytest.importorskip("transformers")
# one worker runs the whole module, so its module fixtures (launched runs) are built once
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_cli_trust")]

JOB = {
    "model": {"config": {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "max_position_embeddings": 64}},
    "data": {"files": ["stdlib:*.py"], "seq_len": 32, "max_bytes": 100_000},
    "run": {"steps": 4, "micro_batch": 2},
    "checkpoint": {"save_every": 2, "keep": 2},
    "logging": {"plot": False},  # drawn and checked in test_integ_cli
}


class _CreatesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def saved(output) -> dict[str, list[int]]:
    """run -> its complete checkpoints' steps."""
    runs: dict[str, list[int]] = {}
    for step in sorted((Path(output) / "checkpoints").glob("run-*/step-*")):
        if (step / "meta.json").is_file():
            runs.setdefault(step.parent.name, []).append(int(step.name.split("-")[1]))
    return {run: sorted(steps) for run, steps in runs.items()}


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("trust") / "job.yaml"
    path.write_text(yaml.safe_dump(with_data_cache(JOB, tmp_path_factory.mktemp("data-cache"))))
    return path


@pytest.fixture(scope="module")
def old_run(job_file, tmp_path_factory):
    """A finished 4-step run: its step-2 and step-4 checkpoints and final/."""
    output = tmp_path_factory.mktemp("old_run")
    train(job_file, output, 1)
    return output


def test_a_new_run_keeps_the_old_runs_checkpoints_and_resume_continues_the_newest(job_file, old_run, tmp_path):
    import shutil

    output = tmp_path / "out"
    shutil.copytree(old_run, output)
    (old,) = saved(output)
    # A new run into the folder (as `nox -s demo` starts one), stopped after its first save.
    new = train(job_file, output, 1, "--resume", "none", "--max-steps", 8, "--stop-at-step", 2)
    assert "holds 2 checkpoint(s) of 1 other run(s)" in new.stderr and old in new.stderr
    runs = saved(output)
    assert runs.pop(old) == [2, 4]  # keep=2 never deleted the other run's higher steps ...
    ((fresh, steps),) = runs.items()
    assert steps == [2]  # ... nor this run's own first save
    # --resume auto continues the run that saved last, and says which
    resumed = train(job_file, output, 1, "--max-steps", 8)
    assert f"run {fresh}: resumed from {output / 'checkpoints' / fresh / 'step-2'}" in resumed.stderr
    assert saved(output) == {old: [2, 4], fresh: [6, 8]}  # keep=2 of this run only
    assert [r["step"] for r in metrics(output)] == list(range(1, 9))
    assert (output / "final" / "model.safetensors").is_file() and not (output / "final.old").exists()


def test_a_resume_from_an_older_checkpoint_is_a_new_run(job_file, old_run, tmp_path):
    import shutil

    output = tmp_path / "out"
    shutil.copytree(old_run, output)
    (old,) = saved(output)
    branch = train(job_file, output, 1, "--resume", output / "checkpoints" / old / "step-2", "--max-steps", 6)
    assert "an older checkpoint of run" in branch.stderr and "so a new run" in branch.stderr
    runs = saved(output)
    assert runs.pop(old) == [2, 4]  # the timeline it branched from is intact
    assert list(runs.values()) == [[4, 6]]


def test_a_crafted_checkpoint_runs_no_code_on_resume(job_file, old_run, tmp_path):
    import shutil

    output = tmp_path / "out"
    shutil.copytree(old_run, output)
    (old,) = saved(output)
    checkpoint = output / "checkpoints" / old / "step-4"
    created = tmp_path / "created_by_the_checkpoint"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_CreatesAFile(created)))
    # --resume auto finds it (an explicit folder goes through the same reader: test_core_safe_dcp.py)
    result = fsdp_turbo("train", job_file, "--nproc-per-node", 1, "--output-dir", output, "--max-steps", 6,
                        check=False)
    assert result.returncode != 0
    assert "a checkpoint is data, never code" in result.stderr and "Path.touch" in result.stderr
    assert not created.exists()


@pytest.mark.parametrize("value", ["kill@5", "kill@x:1", "nan@3:1", "explode@2", "kill@5:1,", "stop@-1:0"])
def test_a_malformed_fault_variable_is_a_clear_error(value, monkeypatch):
    with pytest.raises(ConfigError, match=f"{faults.VARIABLE}=.*Fix: unset it"):
        faults.parse(value)
    monkeypatch.setenv(faults.VARIABLE, value)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ConfigError):  # checked on a restart too, though nothing fires there
        faults.arm()


def test_faults_fire_where_they_say_and_only_on_the_first_attempt(monkeypatch):
    monkeypatch.delenv(faults.VARIABLE, raising=False)
    assert faults.arm() is None  # unset: the loop never consults the module
    armed = faults.parse("kill@5:1,stop@3:*,nan@2,crash_save@4")
    assert armed.nan_loss(2) and not armed.nan_loss(3)
    assert armed.crash_during_save(4) and not armed.crash_during_save(2)
    assert faults._SIGNALS["kill"] == signal.SIGKILL
    assert [f for f in armed.faults if f.hits(5, 1)] == [faults.Fault("kill", 5, "1")]
    assert not any(f.hits(5, 0) for f in armed.faults)
    assert any(f.hits(3, 7) for f in armed.faults)  # "*": any rank
    monkeypatch.setenv(faults.VARIABLE, "nan@2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert faults.arm() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert faults.arm() == faults.parse("nan@2")
