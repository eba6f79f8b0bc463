"""The real torchrun: FSDPTurbo under torchrun matches the single-process reference.

Tolerances as in the package parity tests: loss rtol 1e-5 per step for 4 AdamW
steps, first-step gradients rtol 1e-4 / atol 1e-6.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_turbo.core.testing import TrainRecord, assert_parity, make_token_batches, run_reference, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from torchrun_fsdp_job import BATCH_SPEC  # noqa: E402


def reference_run(kind):
    return train_steps(tiny_hf_causal_lm(kind), make_token_batches(**BATCH_SPEC))


def torchrun(script, nproc, *args, timeout=300):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


@pytest.mark.parametrize("nproc,config", [
    (2, {"fully_shard_parallel_size": 2}),
    (4, {"data_parallel_size": 2, "fsdp_plan": {"num_to_forward_prefetch": 1, "num_to_backward_prefetch": 1}}),
])
def test_torchrun_job_matches_reference(tmp_path, nproc, config):
    out = tmp_path / "record.pt"
    torchrun(HERE / "torchrun_fsdp_job.py", nproc, "--config", json.dumps(config), "--out", str(out))
    saved = torch.load(out, weights_only=True)
    assert saved["world"] == nproc
    got = TrainRecord(saved["losses"], saved["grads"])
    assert_parity(run_reference(reference_run, "llama"), got, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)


def test_demo_trains_and_the_loss_falls():
    demo = HERE.parent / "examples" / "train_tiny_llama.py"
    result = torchrun(demo, 4, "--steps", "40")
    losses = [float(line.split("loss")[1]) for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
