"""A model class the library has never seen (``novel_model_jobs.NovelLM``: attention with sinks
and a key/value latent every head reads, an MoE router named ``selector``) trains under TP and
EP once its facts are declared: in the config's ``model_facts`` section, or by registering a
family in code; never by editing library source. Against one process, float32, 3 AdamW steps:
losses rtol 1e-5, first-step gradients rtol 1e-4 / atol 1e-6."""

from dataclasses import replace

import pytest
from novel_model_jobs import EP, FACTS, TP, novel_model, novel_run, reference_run

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.parallel_state import ParallelState
from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference
from fsdp_turbo.fsdp_turbo import plan_transforms
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_novel_model")]  # the launch runs once
CASES = {"tp (config)": (TP, "config"), "tp (family)": (TP, "family"), "ep (config)": (EP, "config")}


def _each(cases):
    return {name: novel_run(*CASES[name]) for name in cases}


@pytest.fixture(scope="module")
def launch():
    return run_reference(reference_run, timeout=300), run_distributed(_each, 4, list(CASES), timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_a_novel_model_trains_once_its_facts_are_declared(launch, case):
    reference, results = launch
    records = [rank[case][0] for rank in results]
    merged = {name: grad for record in records for name, grad in record.grads.items()}  # EP: each rank its experts
    for record, head_parameters, latents, routers in (rank[case] for rank in results):
        assert_parity(reference, replace(record, grads=merged), loss_rtol=1e-5, grad_rtol=1e-4, grad_atol=1e-6)
        assert head_parameters == [("blocks.0.attn", "sinks"), ("blocks.1.attn", "sinks")]
        assert sorted(latents) == sorted(f"blocks.{i}.attn.{m}" for m in ("kv_latent", "latent_norm") for i in (0, 1))
        assert routers == ["blocks.0.moe.selector", "blocks.1.moe.selector"]


def _plan(model_facts: dict):
    config = FSDPTurboConfig.from_dict({**TP, "model_facts": model_facts})
    state = ParallelState(config.validate(4), rank=0, device_type="cpu", distributed=True)
    return plan_transforms(config, novel_model(), state)


def test_undeclared_sinks_and_latent_are_refused_by_name():
    """Without the declarations TP would read the sinks whole beside a rank's heads and hold one
    rank's heads in the latent's gradient: each is a ConfigError naming the model_facts field."""
    base = {k: v for k, v in FACTS.items() if k not in ("head_parameters", "latent_modules")}
    with pytest.raises(ConfigError, match=r"not per head") as caught:
        _plan(base)
    assert caught.value.value == "blocks.0.attn" and "model_facts.latent_modules" in caught.value.fix
    with pytest.raises(ConfigError, match=r"model_facts\.head_parameters") as caught:
        _plan({**base, "latent_modules": FACTS["latent_modules"]})
    assert caught.value.value == "blocks.0.attn.sinks"
    plans = {transform.name: plan for transform, plan in _plan(FACTS)}
    assert plans["tensor_parallel"].kinds["blocks.0.attn.kv_latent"] == "replicate_prepared"


def test_a_declared_fact_that_names_nothing_is_refused():
    with pytest.raises(ConfigError, match="holds no parameter 'sink'") as caught:
        _plan({**FACTS, "head_parameters": ["blocks.*.attn.sink"]})
    assert caught.value.field == "model_facts.head_parameters"
