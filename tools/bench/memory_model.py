"""The memory model's error per layout: ``fsdp-turbo plan``'s predicted peak against the peak
MemTracker measures in one real training step on 4 gloo ranks (the largest rank's).

The baseline is the measurement itself; each row is predicted / measured (goal: within
10%, i.e. in [0.90, 1.10]). The layouts are the test's (``integration_tests/memory_jobs.py``:
a 4-layer Llama, hidden 256, vocab 8192, 2 x 256 tokens a data shard; Qwen3-MoE of the same
size with 8 experts, top-2). The peak moment each side names is printed too. The previous
formula (model state + activations) is printed beside it for comparison.

    python tools/bench/memory_model.py [--layouts NAME ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from report import result

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration_tests"))

from memory_jobs import LAYOUTS, layout_job, measured_step_peaks

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.plan import plan_job
from fsdp_turbo.core.testing import run_distributed

MIB = 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    per_rank = run_distributed(measured_step_peaks, 4, {name: layout_job(name) for name in args.layouts},
                               timeout=900)
    print("memory model: predicted / measured peak of one training step, 4 gloo ranks (MiB)")
    for name in args.layouts:
        measured = max(rank[name]["Total"] for rank in per_rank)
        where = max(per_rank, key=lambda rank: rank[name]["Total"])[name]["where"]
        estimate = plan_job(JobConfig.from_dict(layout_job(name)), 4).memory
        formula = (estimate.model_state + estimate.activations) / MIB
        print(f"  {name:42s} predicted {estimate.peak / MIB:8.2f} ({estimate.peak_phase}), measured "
              f"{measured / MIB:8.2f} ({where}); state + activations {formula:8.2f}")
        result(f"memory model {name}: predicted / measured peak", estimate.peak / measured, "0.90-1.10",
               f"{estimate.peak / MIB:.1f} / {measured / MIB:.1f} MiB, peak at {estimate.peak_phase}")


if __name__ == "__main__":
    main()
