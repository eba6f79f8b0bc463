"""MXFP8 (E4M3, blocks of 32) through the facade, composed with FSDP=2 x TP=2 (sequence parallel,
loss-parallel head) and with the memory features, against the single-process MX model
(emulated quantization, float32 master weights). Tolerances as for the memory features:
loss rtol 1e-5, first-step gradients rtol 1e-4 / atol 1e-6, parameters per tensor relative
L2 1e-4 and per element 1e-4.
"""

import pytest
from memory_jobs import mx_composed_run, mx_reference_run
from test_integ_memory import _assert_params_close

from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

CASES = {
    "mx": {},
    "mx+memory": {"recompute": True, "recompute_policy": "selective", "chunk_loss": True},
}


@pytest.fixture(scope="module")
def reference():
    return run_reference(mx_reference_run, "llama", timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_mxfp8_with_fsdp2_x_tp2(case, reference):
    ref_record, ref_params = reference
    for record, params in run_distributed(mx_composed_run, 4, "llama", CASES[case], timeout=600):
        assert_parity(ref_record, record, loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
        _assert_params_close(params, ref_params)


def test_tensor_parallel_shards_must_hold_whole_blocks():
    # k_proj has 32 out features: 16 per TP rank. The default plan leaves it high precision;
    # asking for it explicitly is a ConfigError on every rank, before any collective.
    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig
    from fsdp_turbo.quantization.transform import QuantizeTransform

    base = {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
            "tp_plan": {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj"], "rowwise_parallel": ["*.o_proj"]}}
    state = ParallelState.create(FSDPTurboConfig(**base).validate(4), 0, "cpu")
    QuantizeTransform().validate(FSDPTurboConfig(**base, quantization_plan={}), tiny_hf_causal_lm(), state)
    explicit = FSDPTurboConfig(**base, quantization_plan={"apply_modules": ["*.k_proj"]})
    with pytest.raises(ConfigError, match="each rank holds out_features=16"):
        QuantizeTransform().validate(explicit, tiny_hf_causal_lm(), state)
