"""The memory model is measured, not guessed: every layout kind runs one real training step
on 4 gloo ranks under torch's MemTracker (the step ``fsdp-turbo train`` runs: forward with
the loss, backward, clipping, AdamW; the second step is measured), and ``fsdp-turbo plan``'s
predicted peak must be within 10% of the largest rank's measured peak. Then ``plan --auto``,
given a budget 20% below plain FSDP=4's measured peak, must pick a layout whose measured
peak fits it."""

import pytest
from memory_jobs import LAYOUTS, layout_job, measured_step_peaks

from fsdp_turbo.cli.auto_plan import search
from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.plan import plan_job
from fsdp_turbo.core.testing import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("peft")
WORLD = 4
TOLERANCE = 0.10
# both tests read the one launch of ``measured``: on one worker it runs once (else each worker ran it)
pytestmark = pytest.mark.xdist_group("memory_model")


@pytest.fixture(scope="module")
def measured():
    """Every layout's peak on each rank, measured in one launch."""
    per_rank = run_distributed(measured_step_peaks, WORLD, {name: layout_job(name) for name in LAYOUTS}, timeout=600)
    return {name: max(rank[name]["Total"] for rank in per_rank) for name in LAYOUTS}, per_rank


@pytest.mark.multirank
def test_predicted_peak_within_10_percent_of_the_measured_peak_for_every_layout_kind(measured):
    peaks, per_rank = measured
    misses = []
    for name in LAYOUTS:
        estimate = plan_job(JobConfig.from_dict(layout_job(name)), WORLD).memory
        error = estimate.peak / peaks[name] - 1
        if abs(error) > TOLERANCE:
            misses.append(f"{name}: predicted {estimate.peak:,} at {estimate.peak_phase} {estimate.phases}, measured "
                          f"{peaks[name]:,} ({per_rank[0][name]}): {error:+.1%}")
    assert not misses, "\n".join(misses)


@pytest.mark.multirank
def test_auto_picks_a_layout_whose_measured_peak_fits_a_budget_below_plain_fsdp(measured):
    peaks, _ = measured
    budget = int(0.8 * peaks["FSDP=4"])
    result = search(JobConfig.from_dict(layout_job("FSDP=4")), WORLD, budget)
    best = result.best
    assert best.peak <= budget and result.fitting == sorted(result.fitting, key=lambda c: (c.step_s, c.peak))
    job = {**layout_job("FSDP=4"), "turbo": best.turbo, "run": best.run}
    measured_best = run_distributed(measured_step_peaks, WORLD, {"auto": job}, timeout=300)
    largest = max(rank["auto"]["Total"] for rank in measured_best)
    assert largest <= budget, (best.choice.describe(), largest, budget)
