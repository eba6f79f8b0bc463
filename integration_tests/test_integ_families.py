"""Model families through the features (issue 32), against the single-process reference,
float32, 4 AdamW steps: Qwen3-Next and Qwen3.5-MoE (Gated DeltaNet and softmax layers; MoE
layers with a shared expert), DeepSeek-V3 (MLA: Ulysses and ring CP, EP, TP with sequence
parallel) and gpt-oss (sliding-window layers and sinks: Ulysses, ring with zig-zag and with
contiguous chunks, hybrid, KV all-gather alone and with EP, recompute, the chunked loss and
MXFP8; MXFP8 with FSDP and with EP under every dispatcher). The cases run
in two launches, one of 2 ranks (the layouts that need no more) and one of 4 (see
``families_jobs.WORLD``), each on one worker; each step's loss rtol 1e-5, the first step's
gradients rtol 1e-4 / atol 1e-6, unless a case states otherwise (MXFP8)."""

import pytest
import torch
from families_jobs import CASES, LAUNCHES, families_run, mx_converted, reference_runs
from launch_groups import grouped_cases, launched, world_of

from fsdp_turbo.cli.names import compress_names
from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference
from fsdp_turbo.core.testing.parity import sqnr_db

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

# MLA under TP: the latent modules stay whole (turbo-distributed test_dist_tp_gpt_oss.py plans them);
# the rotary key its kv_a_proj_with_mqa makes for every head gets its gradient summed over TP


@pytest.fixture(scope="module")
def launches():
    """Each launch's results, made by the first test of that launch on this worker."""
    return {}


def _launch(group):
    """One launch (the group's ranks) for its cases, and the one-process references."""
    names = LAUNCHES[group]
    references = run_reference(reference_runs, sorted({CASES[name][0] for name in names}), timeout=300)
    return references, run_distributed(families_run, world_of(group), names, timeout=600)


def _cases(mx: bool):
    return grouped_cases(LAUNCHES, "integ_families", lambda name: ("quantization_plan" in CASES[name][1]) == mx)


@pytest.mark.parametrize("group, case", _cases(mx=False))
def test_family_matches_one_process(launches, group, case):
    references, records = launched(launches, group, _launch)
    kind, _ = CASES[case]
    for record in records:
        assert_parity(references[kind], record[case], loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)


MX_CLASSES = {"qwen3_next": "MXQwen3NextExperts", "qwen3_5_moe": "MXQwen3_5MoeExperts", "gpt_oss": "MXGptOssExperts"}
SOFTMAX_LAYERS = {"qwen3_next": "{1}", "qwen3_5_moe": "{1}", "gpt_oss": "{0-1}"}  # the others: Gated DeltaNet


@pytest.mark.parametrize("kind", sorted(MX_CLASSES))
def test_family_mx_conversion(kind):
    """What MX_PLAN converts. Qwen3-Next / Qwen3.5-MoE: the Gated DeltaNet's wide projections, the
    softmax attention, the shared expert and the experts; left out by the converter: in_proj_b/a
    (Qwen3.5) and shared_expert_gate, whose outputs are not whole blocks of 32, and the output
    head. gpt-oss: the attention and the experts (transposed, biased, its clamped SwiGLU); its
    router is no Linear."""
    converted = mx_converted(kind)
    assert set(converted.values()) == {"MXLinear", MX_CLASSES[kind]}
    names = compress_names(list(converted))
    assert "model.layers.{0-1}.mlp.experts" in names
    assert f"model.layers.{SOFTMAX_LAYERS[kind]}.self_attn.q_proj" in names
    assert not any("shared_expert_gate" in name or "in_proj_b" in name or name == "lm_head" for name in converted)


@pytest.mark.parametrize("group, case", _cases(mx=True))
def test_family_mxfp8(launches, group, case):
    """MXFP8 Linear layers and experts, against the one-process emulated-MX model. As in the
    composition matrix: the first loss is exact (rtol 1e-5); expert gradients quantize each
    expert's tokens, grouped differently on each rank (at least 30 dB SQNR, measured 31.4 on
    Qwen3-Next); other gradients rtol 1e-4 / atol 1e-6; all four losses rtol 2e-3 (measured 3.6e-4).
    Under context parallel the MX Linear layers' weight gradients join the experts' rule: their
    GEMM sums over the tokens in MX blocks of 32, and CP puts each block's tokens on other ranks
    than one process does (gpt-oss KV all-gather x EP: measured at least 34.5 dB, losses 6.2e-4)."""
    kind, config = CASES[case]
    references, records = launched(launches, group, _launch)
    reference = references[f"{kind} mx"]
    token_blocked = set()
    if config.get("context_parallel_size", 1) > 1:
        token_blocked = {f"{module}.weight" for module, cls in mx_converted(kind).items() if cls == "MXLinear"}
    for record in records:
        candidate = record[case]
        torch.testing.assert_close(candidate.losses[0], reference.losses[0], rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(candidate.losses), torch.tensor(reference.losses), rtol=2e-3, atol=0)
        assert candidate.grads.keys() == reference.grads.keys()
        for name, grad in candidate.grads.items():
            if ".experts." in name or name in token_blocked:
                assert sqnr_db(reference.grads[name], grad) >= 30, name
            else:
                torch.testing.assert_close(grad, reference.grads[name], rtol=1e-4, atol=1e-6, msg=name)
