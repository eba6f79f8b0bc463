"""PEFT (LoRA) models through the facade, against single-process PEFT on the same base, data and
seed, float32: losses rtol 1e-5, adapter gradients rtol 1e-4 / atol 1e-6 (only adapters train).

The config is the one written for the base model: patterns see through PEFT's prefix and
``base_layer`` (``core.patterns``).
"""

import pytest
from peft_jobs import BATCHES, LAYOUTS, facade_run, peft_model, reference_run

from fsdp_turbo.core.patterns import match_modules
from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("peft")
TOL = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}


def test_patterns_for_the_base_model_pick_the_same_modules_of_the_peft_model():
    model = peft_model()
    blocks = match_modules(model, ["model.layers.*"], field="fsdp_plan.apply_modules", outermost=True)
    assert list(blocks) == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    # the LoRA layer answers to the projection's name; its base_layer is not picked apart from it
    picked = match_modules(model, ["*.q_proj", "*.down_proj"], field="tp_plan.colwise_parallel")
    assert list(picked) == [f"base_model.model.model.layers.{i}.{m}" for i in (0, 1)
                            for m in ("self_attn.q_proj", "mlp.down_proj")]
    assert type(picked["base_model.model.model.layers.0.self_attn.q_proj"]).__module__.startswith("peft.")
    assert list(match_modules(model, ["lm_head"], field="x")) == ["base_model.model.lm_head"]
    # full names still match
    assert next(iter(match_modules(model, ["*.q_proj.base_layer"], field="x"))).endswith("q_proj.base_layer")


@pytest.fixture(scope="module")
def reference():
    return run_reference(reference_run, "llama", timeout=300)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_parity(reference, layout):
    assert len(reference.grads) == 2 * 4 * 2  # lora_A and lora_B of 4 projections in 2 layers: adapters only
    for record, frozen_grads, _ in run_distributed(facade_run, 4, "llama", LAYOUTS[layout], timeout=300):
        assert_parity(reference, record, **TOL)
        assert frozen_grads == []
        assert len(record.losses) == len(BATCHES)
