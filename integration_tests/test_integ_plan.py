"""``fsdp-turbo plan``: golden output, errors as ``train`` reports them, and a model-state
estimate within 10% of what MemTracker measures on real ranks after one step."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_jobs import measured_model_state

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.plan import compress_names, make_plan
from fsdp_turbo.core.testing import run_distributed

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "qwen3_moe_tiny.yaml"
GOLDEN = Path(__file__).parent / "golden" / "plan_qwen3_moe_tiny.txt"
TP = {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
      "tp_plan": {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj"], "rowwise_parallel": ["*.o_proj"]}}


def plan(*args):
    return subprocess.run([sys.executable, "-m", "fsdp_turbo.cli.main", "plan", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_plan_golden_output():
    result = plan(DEMO, "--world-size", 4)
    assert result.returncode == 0, result.stderr
    assert result.stdout == GOLDEN.read_text()


def test_plan_reports_config_errors_like_train(tmp_path):
    job = yaml.safe_load(DEMO.read_text())
    job["turbo"]["ep_plan"]["apply_modules"] = ["*.no_such_experts"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    for result in (plan(bad, "--world-size", 4),):
        assert result.returncode == 2
        assert "ep_plan.apply_modules='*.no_such_experts' is invalid: the pattern matches no module" in result.stderr


def test_compress_names():
    names = [f"model.layers.{i}.mlp" for i in range(3)] + ["lm_head", "model.layers.5.x", "model.layers.7.x"]
    assert compress_names(names) == ["model.layers.{0-2}.mlp", "model.layers.{5,7}.x", "lm_head"]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["demo: fsdp4 x ep2 + mx", "fsdp2 x tp2"])
def test_model_state_estimate_within_10_percent_of_memtracker(layout):
    job = yaml.safe_load(DEMO.read_text())
    if layout.startswith("fsdp2"):
        job["turbo"] = TP
    measured = run_distributed(measured_model_state, 4, job, timeout=300)
    _, estimate = make_plan(JobConfig.from_dict(job), 4)
    for bytes_on_rank in measured:
        assert abs(estimate.model_state / bytes_on_rank - 1) < 0.10, (estimate, measured)
