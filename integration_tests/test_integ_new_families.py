"""The newest model families (issue 42) through every feature, against the single-process reference,
float32, 4 AdamW steps, in two launches, one of 2 ranks and one of 4 (on 2 cores a case at 4 ranks
costs about four times one at 2; each launch runs on one worker): GLM-4-MoE, MiniMax-M2 (q/k
norms over every head), Gemma 4 (sliding and global layers with their own head dim, keys doubling as
values, layers reusing earlier keys and values, per-layer token inputs, MoE beside the MLP), Llama 4
(chunked attention, temperature-tuned NoPE layers, experts called through the routed form); Kimi
Linear (KDA linear attention and MLA without rotary), DeepSeek-V3.2 and GLM-MoE-DSA (DeepSeek Sparse
Attention's indexer), DeepSeek-V4 (compressed attention, hash routing, hyper-connections). Each:
EP=2 under every dispatcher, FSDP2 x TP2 with sequence parallel, CP (Ulysses; ring and hybrid where
the attention allows), FSDP=2 with full recompute and the chunked loss, MXFP8 at EP=2 (see
``new_families_jobs.family_cases`` for which layouts run at 2 ranks and which at 4).

Each step's loss rtol 1e-5; the first step's gradients rtol 1e-4 / atol 1e-6 (Gemma 4: 4e-6, see
``GRAD_ATOL``; its float64 cases at 1e-6). MXFP8 is compared step by step (the one-process
emulated-MX model replays each step from the layout's own weights): each loss rtol 1e-5, expert
gradients at least 30 dB SQNR (their tokens are grouped differently on each rank), other gradients
as above."""

from dataclasses import replace

import pytest
import torch
from launch_groups import grouped_cases, launched, world_of
from new_families_jobs import (
    CASES,
    GRAD_ATOL,
    LAUNCHES,
    families_run,
    is_mx,
    mx_replay_runs,
    params_blob,
    reference_runs,
)

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference
from fsdp_turbo.core.testing.parity import sqnr_db

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def launches():
    """Each launch's results, made by the first test of that launch on this worker."""
    return {}


def _launch(group):
    """One launch (the group's ranks) for its cases; their one-process references; the MXFP8 replays."""
    names = LAUNCHES[group]
    references = run_reference(reference_runs, sorted({CASES[name][0] for name in names}), timeout=300)
    records = run_distributed(families_run, world_of(group), names, timeout=900)
    mx = [name for name in names if is_mx(name)]
    references.update(run_reference(mx_replay_runs, params_blob({name: records[0][name] for name in mx}),
                                    timeout=600))
    return references, records


def _cases(mx: bool):
    return grouped_cases(LAUNCHES, "integ_new_families", lambda name: is_mx(name) == mx)


def _merged(records, case):
    """Every rank's gradients of a case in one record (each rank's experts under expert parallel)."""
    grads = {name: grad for record in records for name, grad in record[case].grads.items()}
    return [replace(record[case], grads=grads) for record in records]


@pytest.mark.parametrize("group, case", _cases(mx=False))
def test_family_matches_one_process(launches, group, case):
    references, records = launched(launches, group, _launch)
    for candidate in _merged(records, case):
        assert_parity(references[CASES[case][0]], candidate, loss_rtol=1e-5, grad_rtol=1e-4,
                      grad_atol=GRAD_ATOL.get(CASES[case][0], 1e-6))


@pytest.mark.parametrize("group, case", _cases(mx=True))
def test_family_mxfp8_step_by_step(launches, group, case):
    references, records = launched(launches, group, _launch)
    reference = references[case]
    for candidate in _merged(records, case):
        torch.testing.assert_close(torch.tensor(candidate.losses), torch.tensor(reference.losses), rtol=1e-5, atol=0)
        assert candidate.grads.keys() == reference.grads.keys()
        for name, grad in candidate.grads.items():
            if ".experts." in name:
                assert sqnr_db(reference.grads[name], grad) >= 30, name
            else:
                torch.testing.assert_close(grad, reference.grads[name], rtol=1e-4,
                                           atol=GRAD_ATOL.get(CASES[case][0], 1e-6), msg=name)
