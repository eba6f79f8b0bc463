"""PEFT (LoRA) models through the facade, against single-process PEFT on the same base, data and
seed, float32: losses rtol 1e-5, adapter gradients rtol 1e-4 / atol 1e-6 (only adapters train).

The config is the one written for the base model: patterns see through PEFT's prefix and
``base_layer`` (``core.patterns``).
"""

import json

import pytest
import torch
from peft_jobs import (
    ATTENTION,
    BATCHES,
    EVAL_IDS,
    LAYOUTS,
    QLORA_FORMATS,
    SAVE_LAYOUTS,
    facade_run,
    load_bad_adapters,
    load_base_and_adapter,
    peft_model,
    qlora_facade_runs,
    qlora_reference_runs,
    reference_run,
    train_then_save,
)
from safetensors import safe_open
from safetensors.torch import save_file

from fsdp_turbo.core.patterns import match_modules
from fsdp_turbo.core.testing import assert_parity, run_distributed, run_reference

pytest.importorskip("peft")
pytestmark = pytest.mark.xdist_group("integ_peft")  # its module fixtures (the references) built once
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


# ----- fsdp_turbo.checkpoint for PEFT models: adapters, merged models, base + adapter loads -------------
# adapter_config.json fields that say what the adapter is (peft_version and the like may differ)
CONFIG_FIELDS = ("peft_type", "task_type", "r", "lora_alpha", "target_modules", "use_rslora", "use_dora",
                 "fan_in_fan_out", "bias", "lora_bias", "rank_pattern", "alpha_pattern", "base_model_name_or_path",
                 "inference_mode", "auto_mapping", "modules_to_save")


def _tensors(folder, name="adapter_model.safetensors"):
    with safe_open(folder / name, "pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - a safetensors handle


def _eval_logits(model):
    with torch.no_grad():
        return model.eval()(input_ids=EVAL_IDS).logits


def _assert_same_adapter_files(ours, theirs):
    """The files PEFT wrote for one process against ours: names, shapes, values, config."""
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    mine, reference = _tensors(ours), _tensors(theirs)
    assert sorted(mine) == sorted(reference)
    assert all(k.startswith("base_model.model.") and ".default." not in k for k in mine)  # PEFT's naming
    for key, tensor in reference.items():
        assert mine[key].shape == tensor.shape and mine[key].dtype == tensor.dtype, key
        assert torch.equal(mine[key], tensor), key
    config, expected = (json.loads((d / "adapter_config.json").read_text()) for d in (ours, theirs))
    for field in CONFIG_FIELDS:  # PEFT writes a set (target_modules) in the process's hash order
        mine_value, their_value = config.get(field), expected.get(field)
        if isinstance(their_value, list):
            mine_value, their_value = sorted(mine_value), sorted(their_value)
        assert mine_value == their_value, field


@pytest.mark.multirank
@pytest.mark.parametrize("layout", SAVE_LAYOUTS)
def test_save_pretrained_of_a_trained_sharded_lora_model(layout, tmp_path):
    """A LoRA model trained on the layout, its adapter saved (what PEFT writes from one
    process with the same weights; PeftModel.from_pretrained gives the trained model's
    logits) and its merged model saved (transformers' from_pretrained, the same logits)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    kind, lora, _ = SAVE_LAYOUTS[layout]
    trained = run_distributed(train_then_save, 4, layout, str(tmp_path), timeout=300)[0]
    one_process = peft_model(kind, **lora)
    one_process.load_state_dict(trained["state"])
    one_process.save_pretrained(tmp_path / "peft")
    _assert_same_adapter_files(tmp_path / "adapter", tmp_path / "peft")
    expected = _eval_logits(one_process)
    if trained["logits"] is not None:  # the sharded model's own forward
        torch.testing.assert_close(trained["logits"], expected, rtol=0, atol=1e-5)
    loaded = PeftModel.from_pretrained(tiny_hf_causal_lm(kind), tmp_path / "adapter")
    torch.testing.assert_close(_eval_logits(loaded), expected, rtol=0, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k or "base_layer" in k for k in merged.state_dict())
    torch.testing.assert_close(_eval_logits(merged), expected, rtol=0, atol=1e-5)
    # the adapters trained: the merged weights are not the base model's
    base = tiny_hf_causal_lm(kind).state_dict()
    assert not torch.equal(merged.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])
    frozen = "model.embed_tokens.weight"  # not a target: the base weight as it was
    assert torch.equal(merged.state_dict()[frozen], base[frozen])
    for name in lora.get("target_parameters", ()):  # LoRA on the experts' fused weights, merged too
        key = f"model.layers.0.{name}"
        assert not torch.allclose(merged.state_dict()[key], base[key], atol=1e-4), key


@pytest.fixture()
def base_and_adapter(tmp_path):
    """A base checkpoint transformers wrote and an adapter PEFT wrote from one process."""
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    tiny_hf_causal_lm("llama").save_pretrained(tmp_path / "base")
    model = peft_model()  # lora_B non-zero, so the adapter changes the logits
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "base", tmp_path / "adapter"


@pytest.mark.multirank
def test_load_pretrained_base_and_adapter_into_a_meta_peft_model_at_fsdp4(base_and_adapter, tmp_path):
    from peft import PeftModel

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    base, adapter = base_and_adapter
    results = run_distributed(load_base_and_adapter, 4, LAYOUTS["fsdp4"], str(base), str(adapter),
                              str(tmp_path / "again"), timeout=300)
    expected = _eval_logits(PeftModel.from_pretrained(tiny_hf_causal_lm("llama"), adapter))
    base_logits = _eval_logits(tiny_hf_causal_lm("llama"))
    assert not torch.allclose(expected, base_logits, atol=1e-3)  # the adapter matters
    for result in results:
        torch.testing.assert_close(result["logits"], expected, rtol=0, atol=1e-5)
        assert result["read"] < result["total"]  # each rank read its shards only
        # without an adapter folder: PEFT's init (lora_B zero, lora_A drawn), so the base model's logits
        torch.testing.assert_close(result["fresh_logits"], base_logits, rtol=0, atol=1e-5)
        lora_a = [v for k, v in result["fresh_adapters"].items() if "lora_A" in k]
        lora_b = [v for k, v in result["fresh_adapters"].items() if "lora_B" in k]
        assert len(lora_a) == len(lora_b) == 8
        assert all(a.std() > 0 for a in lora_a) and all(b.eq(0).all() for b in lora_b)
    # loaded and saved again: the same files, bit for bit
    _assert_same_adapter_files(tmp_path / "again", adapter)


@pytest.mark.multirank
def test_an_adapter_that_does_not_fit_fails_on_every_rank(base_and_adapter, tmp_path):
    from peft import LoraConfig, get_peft_model

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    base, adapter = base_and_adapter
    wider = get_peft_model(tiny_hf_causal_lm("llama"), LoraConfig(r=8, lora_alpha=8, target_modules=ATTENTION))
    wider.save_pretrained(tmp_path / "wrong_r")
    short = tmp_path / "missing_key"
    short.mkdir()
    (short / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    tensors = _tensors(adapter)
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, short / "adapter_model.safetensors")
    cases = {str(tmp_path / "wrong_r"): "adapter_config.json: r=8 is invalid: the model's LoraConfig has r=4",
             str(short): f"adapter_model.safetensors: {dropped}="}
    per_rank = run_distributed(load_bad_adapters, 4, LAYOUTS["fsdp4"], str(base), list(cases), timeout=300)
    for errors in per_rank:
        for error, expected in zip(errors, cases.values(), strict=True):
            # each rank found it itself (not a PeerFailure relayed from another rank), naming file, key and fix
            assert error.startswith("CheckpointError: ") and expected in error and "Fix: " in error, error


# ----- expert parallel: LoRA on the experts' fused weights (target_parameters) and on the attention -----
def _moe_router_inputs(rows: int = 12):
    import torch

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 64, generator=generator, requires_grad=True)
    index = torch.randint(0, 8, (rows, 2), generator=generator)
    return x, index, torch.rand(rows, 2, generator=generator)


def test_lora_wrapped_experts_are_one_container_named_by_the_base_model_pattern():
    """The model facts and ep_plan.apply_modules both find the outermost PEFT wrapper (it holds
    the adapters the experts shard with); naming the wrapped module itself is refused."""
    import torch
    from peft_jobs import moe_peft_model

    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.core.model_facts import resolve_model_facts
    from fsdp_turbo.distributed.expert_parallel import LoraExperts, resolve_ep_plan
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

    model = moe_peft_model()
    wrappers = [f"base_model.model.model.layers.{i}.mlp.experts" for i in (0, 1)]
    facts = resolve_model_facts(model)
    assert [(e.name, e.form) for e in facts.experts] == [(name, "LoraExperts") for name in wrappers]
    plan = resolve_ep_plan(model, EPPlanConfig(apply_modules=("*mlp.experts",)), 2, facts)
    assert plan.container_names == tuple(wrappers)
    adapter = plan.containers[0][1]
    wrapped = (("", "down_proj"), ("base_layer", "gate_up_proj"))  # PEFT nests one wrapper per parameter
    assert adapter == LoraExperts(8, False, wrapped, "base_layer.base_layer")
    assert type(model.get_submodule(wrappers[0])).__name__ == "ParamWrapper"  # nothing changed by planning
    with pytest.raises(ConfigError, match=r"ep_plan.apply_modules=.*layers.0.mlp.experts.base_layer.base_layer.* "
                                          r"Fix: point the pattern at '.*layers.0.mlp.experts'"):
        resolve_ep_plan(model, EPPlanConfig(apply_modules=("*.experts.base_layer.base_layer",)), 2, facts)
    # what the fold cannot replay is refused before anything is sent (PEFT itself refuses dropout
    # on a ParamWrapper; a dropout put there afterwards is caught too)
    model.get_submodule(wrappers[1]).lora_dropout["default"] = torch.nn.Dropout(0.1)
    with pytest.raises(ConfigError, match=r"LoraConfig.lora_dropout=.*layers.1.mlp.experts.down_proj .*"
                                          r"Fix: set lora_dropout=0"):
        resolve_ep_plan(model, EPPlanConfig(), 2, facts)


def test_lora_experts_need_whole_experts_per_expert_fsdp_rank():
    """2 experts over EP=2 leave 1 per rank for efsdp 2: expert FSDP would shard dim 1, lora_B's
    strided expert dim, whose shards FSDP2 then describes wrongly. Refused at plan time."""
    from peft import LoraConfig, get_peft_model
    from peft_jobs import EXPERT_PARAMETERS

    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.core.model_facts import resolve_model_facts
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.distributed.expert_parallel import resolve_ep_plan
    from fsdp_turbo.distributed.expert_parallel.transform import check_lora_expert_fsdp
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

    model = get_peft_model(tiny_hf_causal_lm("qwen3_moe", num_experts=2),
                           LoraConfig(r=4, target_modules=["q_proj"], target_parameters=EXPERT_PARAMETERS))
    plan = resolve_ep_plan(model, EPPlanConfig(), 2, resolve_model_facts(model))
    check_lora_expert_fsdp(plan, 1)  # efsdp 1: whole experts, nothing to refuse
    with pytest.raises(ConfigError, match=r"expert_fully_shard_parallel_size=2 is invalid: .*layers.0.mlp.experts "
                                          r"has LoRA on its experts and 1 experts per EP rank. Fix: .* at most 1"):
        check_lora_expert_fsdp(plan, 2)


@pytest.mark.parametrize("dispatcher", ["eager", "fused", "mc2", "domino"])
def test_lora_experts_form_is_peft_math_on_all_and_on_local_experts(dispatcher):
    """One process: each dispatcher through the LoRA form gives PEFT's own forward and adapter
    gradients; keeping experts 4..7 (EP rank 1 of 2) keeps exactly their adapter rows/columns."""
    import copy

    import torch
    from peft_jobs import moe_peft_model

    from fsdp_turbo.distributed.expert_parallel import DISPATCHERS, ExpertGroup, expert_adapter

    model = moe_peft_model()
    wrapper = model.get_submodule("base_model.model.model.layers.0.mlp.experts")
    adapter = expert_adapter(wrapper)
    x, index, weights = _moe_router_inputs()
    adapters = lambda m: [m.lora_A.default.weight, m.lora_B.default.weight,  # noqa: E731
                          m.base_layer.lora_A.default.weight, m.base_layer.lora_B.default.weight]
    expected = wrapper(x, index, weights)  # PEFT: parametrized base weights
    expected_grads = torch.autograd.grad(expected.square().sum(), adapters(wrapper))
    ours = copy.deepcopy(wrapper)
    out = DISPATCHERS[dispatcher](ours, ExpertGroup(adapter, 8, 1, None, 2), x, index, weights)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out.square().sum(), adapters(ours)), expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    local = copy.deepcopy(wrapper)
    adapter.keep_local_experts(local, 4, 4, None)
    rows = (index >= 4).all(1)  # tokens routed to experts 4..7 only
    run = lambda m, first: adapter.eager(m, x[rows], index[rows, 0] - first)  # noqa: E731
    torch.testing.assert_close(run(local, 4), run(wrapper, 0), rtol=0, atol=0)
    a, b = local.lora_A.default.weight, local.lora_B.default.weight
    assert a.shape == (16, 32) and b.shape == (64, 16)  # r * 4 local experts
    torch.testing.assert_close(a, wrapper.lora_A.default.weight[16:], rtol=0, atol=0)
    torch.testing.assert_close(b, wrapper.lora_B.default.weight.view(64, 4, 8)[:, :, 4:].reshape(64, 16),
                               rtol=0, atol=0)
    # PEFT's disable_adapter() reaches the fold: the experts' own (HF) output
    with model.disable_adapter(), torch.no_grad():
        plain = wrapper.base_layer.base_layer(x, index, weights)
        out = DISPATCHERS[dispatcher](wrapper, ExpertGroup(adapter, 8, 1, None, 2), x, index, weights)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(out, expected, atol=1e-3)


def test_lora_on_gpt_oss_experts_matches_peft():
    """PEFT LoRA on gpt-oss's transposed, biased experts (``target_parameters``): the fused
    dispatcher's folded weights give PEFT's own output and adapter gradients (EP=1, one process)."""
    import copy

    import peft
    import torch

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.distributed.expert_parallel import ExpertGroup, expert_adapter, make_expert_parallel

    model = peft.get_peft_model(tiny_hf_causal_lm("gpt_oss"), peft.LoraConfig(
        r=2, target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False))
    experts = model.base_model.model.model.layers[0].mlp.experts
    adapter = expert_adapter(experts)
    assert type(adapter).__name__ == "LoraExperts" and adapter.transposed
    generator = torch.Generator().manual_seed(2)  # 48 tokens, each to 2 distinct of the 8 experts
    x = torch.randn(48, 64, generator=generator)
    index = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(48)])
    weights = torch.rand(48, 2, generator=generator).softmax(-1)

    def forward_backward(module):
        inputs, routing = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(inputs, index, routing)
        (out * torch.linspace(-1.0, 1.0, out.shape[-1])).sum().backward()
        grads = {f"grad {n}": p.grad for n, p in module.named_parameters() if p.requires_grad}
        return {"out": out.detach(), "grad x": inputs.grad, "grad weights": routing.grad, **grads}

    expected = forward_backward(copy.deepcopy(experts))
    got = forward_backward(make_expert_parallel(copy.deepcopy(experts), ExpertGroup(adapter, 8, 1, None), 0, "fused"))
    assert any("lora_A" in name for name in expected) and set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6 * float(value.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.multirank
def test_lora_on_attention_and_experts_at_ep2_x_efsdp2_every_dispatcher():
    """Qwen3-MoE at EP=2 x efsdp 2 (4 ranks), LoRA on the attention and on every expert's fused
    weights, each dispatcher in one launch (and fused with redundant experts, whose replicas
    copy the folded weights), against single-process PEFT. The adapters' expert
    dimension shards with the experts: DTensors on (efsdp, ep) of PEFT's global shapes."""
    from peft_jobs import EP_PLANS, ep_facade_runs, moe_reference_run

    reference = run_reference(moe_reference_run, timeout=300)
    # 4 attention projections + 2 expert weights, lora_A and lora_B each, in 2 layers: adapters only
    assert len(reference.grads) == 2 * (4 + 2) * 2
    for results in run_distributed(ep_facade_runs, 4, timeout=600):
        assert list(results) == list(EP_PLANS)
        for dispatcher, (record, frozen_grads, layouts) in results.items():
            assert_parity(reference, record, **TOL)
            assert frozen_grads == [], dispatcher
            # 8 experts / ep 2 = 4 local, r = 4: lora_A keeps rows [e*r, (e+1)*r) of its 4 experts
            # (Shard(0) on ep), lora_B their strided columns (_StridedShard(1, split_factor=r));
            # then expert FSDP halves dim 0 over efsdp 2
            assert layouts["experts.lora_A.default.weight"] == (
                (8, 32), "(_StridedShard(dim=0, sf=2), Shard(dim=0))"), dispatcher
            assert layouts["experts.lora_B.default.weight"] == (
                (32, 16), "(Shard(dim=0), _StridedShard(dim=1, sf=4))"), dispatcher
            assert layouts["experts.base_layer.base_layer.gate_up_proj"][0] == (2, 64, 64)


# ----- tensor parallel: a LoRA layer is split with its base layer --------------------------------------
LAYER = "base_model.model.model.layers.0"


def _lora_tp_plan(model, **plan):
    from fsdp_turbo.core.model_facts import resolve_model_facts
    from fsdp_turbo.distributed.tensor_parallel import resolve_tp_plan
    from fsdp_turbo.fsdp_turbo_config import TPPlanConfig

    return resolve_tp_plan(model, TPPlanConfig(**plan), 2, resolve_model_facts(model))


def _usual_tp_plan(sequence_parallel=True):
    from composed_jobs import FSDP_TP

    return {k: v for k, v in FSDP_TP["tp_plan"].items() if sequence_parallel or k != "sequence_parallel"}


def test_tp_plan_splits_lora_layers_with_their_base_layers():
    """Colwise: base and lora_B colwise, lora_A replicated on the input the parent prepares.
    Rowwise: base and lora_A rowwise, lora_B replicated (sequence-local, its gradients summed
    over TP, under sequence parallel). r=3 does not divide TP=2: only the replicated factor has it."""
    from peft_jobs import PROJECTIONS

    plan = _lora_tp_plan(peft_model(targets=PROJECTIONS, rank_pattern={"q_proj": 3}), **_usual_tp_plan())
    kinds = plan.kinds
    assert kinds[f"{LAYER}.self_attn"] == "prepare_input" and f"{LAYER}.self_attn.q_proj" not in kinds
    # the head's parent holds the blocks: the model itself, not a module whose input is prepared
    assert "base_model.model" not in kinds
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert [kinds[f"{LAYER}.{proj}.{piece}"] for piece in ("base_layer", "lora_A.default", "lora_B.default")] \
            == ["colwise", "replicate_prepared", "colwise"], proj
    for proj in ("self_attn.o_proj", "mlp.down_proj"):
        assert [kinds[f"{LAYER}.{proj}.{piece}"] for piece in ("base_layer", "lora_A.default", "lora_B.default")] \
            == ["rowwise", "rowwise", "replicate_sequence_local"], proj
    styles = dict(plan.styles)
    assert styles[f"{LAYER}.self_attn.o_proj.lora_A.default"].sequence_sharded  # reduce-scattered, as the base
    assert not styles[f"{LAYER}.self_attn.q_proj.lora_B.default"].sequence_sharded  # the prepared input
    dims = dict(plan.shard_dims)
    q, o = f"{LAYER}.self_attn.q_proj", f"{LAYER}.self_attn.o_proj"
    assert (dims[f"{q}.base_layer.weight"], dims[f"{q}.lora_B.default.weight"]) == (0, 0)
    assert (dims[f"{o}.base_layer.weight"], dims[f"{o}.lora_A.default.weight"]) == (1, 1)
    assert f"{q}.lora_A.default.weight" not in dims and f"{o}.lora_B.default.weight" not in dims
    assert plan.local_shape(f"{q}.lora_B.default.weight", (64, 3)) == (32, 3)
    rows = {row.label: row.names for row in plan.describe()}
    assert f"{q}.lora_A.default" in rows["tp_plan (replicate_prepared)"]
    assert f"{o}.lora_B.default" in rows["tp_plan (replicate_sequence_local)"]
    # without sequence parallel the rowwise LoRA path ends replicated, as the base's does
    kinds = _lora_tp_plan(peft_model(targets=PROJECTIONS), **_usual_tp_plan(sequence_parallel=False)).kinds
    assert kinds[f"{o}.lora_B.default"] == "replicate" and kinds[f"{o}.lora_A.default"] == "rowwise"


def test_tp_plan_of_a_lora_output_head_keeps_both_terms_vocab_sharded():
    from peft_jobs import PROJECTIONS

    plan = _lora_tp_plan(peft_model(targets=[*PROJECTIONS, "lm_head"]), **_usual_tp_plan())
    styles, head = dict(plan.styles), "base_model.model.lm_head"
    assert plan.loss_head == head
    # no parent prepares the head's (sequence-sharded) input: the LoRA layer gathers it once itself
    assert styles[head].kind == "prepare_input" and styles[head].sequence_sharded
    for piece in ("base_layer", "lora_B.default"):
        assert styles[f"{head}.{piece}"].kind == "colwise" and styles[f"{head}.{piece}"].vocab_shards
    assert styles[f"{head}.lora_A.default"].kind == "replicate_prepared"


def _loha_model():
    from peft import LoHaConfig, get_peft_model
    from peft_jobs import ATTENTION

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    return get_peft_model(tiny_hf_causal_lm("llama"), LoHaConfig(r=4, target_modules=ATTENTION))


@pytest.mark.parametrize("build,plan,message", [
    (lambda: peft_model(lora_dropout=0.1), {}, rf"tp_plan.colwise_parallel='{LAYER}.self_attn.q_proj' is invalid: "
     r".*Dropout\(p=0.1\).* Fix: set lora_dropout=0 in the LoraConfig or leave .*q_proj out of"),
    (lambda: peft_model(use_dora=True), {}, rf"'{LAYER}.self_attn.q_proj' is invalid: .*LoRA variants "
     r"\['default: Dora.*Fix: train plain LoRA"),
    (_loha_model, {}, r"self_attn.q_proj' is invalid: .*loha.* tuner layer \(base_layer: Linear\)"),
    (peft_model, {"colwise_parallel": ["*.q_proj.base_layer"], "rowwise_parallel": []},
     rf"'{LAYER}.self_attn.q_proj.base_layer' is invalid: .*inside the LoRA layer .*Fix: pick the LoRA layer"),
])
def test_tp_plan_refuses_what_it_cannot_split_by_name(build, plan, message):
    from fsdp_turbo.core.errors import ConfigError

    tp_plan = {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj"], "rowwise_parallel": ["*.o_proj"], **plan}
    with pytest.raises(ConfigError, match=message):
        _lora_tp_plan(build(), **tp_plan)


@pytest.fixture(scope="module")
def tp_reference():
    from peft_jobs import tp_reference_runs

    return run_reference(tp_reference_runs, timeout=300)


@pytest.mark.multirank
def test_lora_parity_under_fsdp2_x_tp2(tp_reference, tmp_path):
    """FSDP=2 x TP=2, LoRA on every projection: with sequence parallel and loss parallel, without
    sequence parallel, with the output head a LoRA layer too, and QLoRA-MX (every projection's frozen
    base stored as packed E4M3 bytes) with sequence and loss parallel (one launch)."""
    from peft_jobs import QLORA_TP, TP_LAYOUTS, tp_facade_runs
    from torch.distributed.tensor import Replicate, Shard

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    colwise, rowwise, replicated = str(Shard(0)), str(Shard(1)), str(Replicate())
    expected = {"self_attn.q_proj.base_layer.weight": colwise, "self_attn.q_proj.lora_A.default.weight": replicated,
                "self_attn.q_proj.lora_B.default.weight": colwise, "self_attn.o_proj.base_layer.weight": rowwise,
                "self_attn.o_proj.lora_A.default.weight": rowwise, "self_attn.o_proj.lora_B.default.weight": replicated}
    tiny_hf_causal_lm("llama").save_pretrained(tmp_path / "base")  # for a meta-built QLoRA-MX model to load
    per_rank = run_distributed(tp_facade_runs, 4, str(tmp_path), str(tmp_path / "base"), timeout=600)
    for results in per_rank:
        for name, (targets, _) in TP_LAYOUTS.items():
            record, frozen_grads, placements, qlora = results[name]
            reference = tp_reference[name]
            assert len(reference.grads) == 2 * 2 * len(targets) - 2 * ("lm_head" in targets)  # adapters only
            try:
                assert_parity(reference, record, **TOL)
            except AssertionError as error:
                raise AssertionError(f"{name}: {error}") from error
            assert frozen_grads == [], name
            assert placements == expected, name
            assert bool(qlora) == (name == QLORA_TP)
        _assert_qlora_under_tp(results[QLORA_TP][3])
    _assert_qlora_merged_save(tmp_path / "merged", per_rank[0][QLORA_TP][3]["logits"])


def _assert_qlora_under_tp(checks):
    """The frozen bases are packed MX bytes on (fsdp, tp): a colwise one cut in rows by TP and again by FSDP,
    a rowwise one cut by TP into whole blocks of packed columns (64 in_features -> 2 blocks of 32 + 1 scale
    byte each, one block a rank); the all-gathers move those bytes; TP first, then converting, packs the
    same bytes each rank's piece of the whole weight's packing holds, and a meta-built model loads its base
    into the same bytes."""
    from peft_jobs import PROJECTIONS

    assert checks["weights"] == {"self_attn.q_proj.base_layer.weight": ("torch.uint8", (64, 66), (16, 66)),
                                 "self_attn.o_proj.base_layer.weight": ("torch.uint8", (64, 66), (32, 33))}
    elements = sum(module.base_layer.weight.numel() for name, module in peft_model(targets=PROJECTIONS).named_modules()
                   if name.endswith("_proj") and hasattr(module, "base_layer"))
    stored, gathered, _ = checks["bytes"]
    assert stored == elements * (1 + 1 / 32) / 4  # of 2 x 2 ranks: 0.26x of bf16
    assert gathered == 2 * stored  # FSDP's all-gather over 2 ranks moves the stored bytes
    tp_first = checks["tp first"]
    refused = tp_first.pop("o_proj, block 64")
    assert tp_first == {"q_proj": (True, "(Shard(dim=0),)", (64, 66), pytest.approx(0, abs=1e-5)),
                        "o_proj": (True, "(Shard(dim=1),)", (64, 66), pytest.approx(0, abs=1e-5))}
    assert refused.startswith("quantization_plan.block_size=64 is invalid: in_features=64 is split 2 ways") \
        and "Fix: leave this Linear out of quantization_plan" in refused, refused
    assert checks["meta-built shards that differ"] == []


def _assert_qlora_merged_save(folder, logits):
    """The merged save of the TP QLoRA-MX model (gathered packed bytes, decoded, the adapters merged in)
    loads in transformers and gives the sharded model's logits."""
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert merged.model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=EVAL_IDS).logits, logits, rtol=1e-5, atol=1e-5)


def _qlora_tp_plan(model, **quantization):
    from peft_jobs import QLORA_TP, TP_LAYOUTS

    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.fsdp_turbo import plan_transforms
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

    config = FSDPTurboConfig.from_dict({**TP_LAYOUTS[QLORA_TP][1], "quantization_plan": {
        "store_frozen_weights": True, **quantization}})
    state = ParallelState(config.validate(4), 0, "cpu", distributed=False)  # rank 0 of FSDP=2 x TP=2, planning only
    return {transform.name: (transform, plan, state) for transform, plan in plan_transforms(config, model, state)}


def test_qlora_mx_under_tp_needs_whole_blocks_of_in_features_per_rank(caplog):
    """Under TP each rank holds its shard of a frozen weight, packed: a rowwise shard must hold whole
    blocks of in_features; a colwise one cuts rows, so k_proj's 16 rows a rank are fine. Block 64 leaves
    o_proj 32 in_features a rank: left high precision with a rank-0 warning naming it, or a
    ConfigError when apply_modules picks it."""
    from peft_jobs import PROJECTIONS

    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.quantization.frozen import MXFrozenLinear

    model = peft_model(targets=PROJECTIONS)
    transform, plan, state = _qlora_tp_plan(model, block_size=64)["quantize"]
    converted = {c.name.removeprefix(f"{LAYER}.") for c in plan.conversions if c.name.startswith(LAYER)}
    assert converted == {f"{p}.base_layer" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    left_out = dict(plan.skipped)
    assert left_out[f"{LAYER}.self_attn.o_proj.base_layer"] == ("tensor parallel leaves each rank in_features=32, "
                                                                "not a multiple of block_size=64")
    with caplog.at_level("WARNING", logger="fsdp_turbo"):
        transform.apply(model, plan, state)
    assert f"{LAYER}.self_attn.o_proj.base_layer (tensor parallel leaves each rank in_features=32" in caplog.text
    o_proj, k_proj = (model.get_submodule(f"{LAYER}.self_attn.{p}.base_layer") for p in ("o_proj", "k_proj"))
    assert not isinstance(o_proj, MXFrozenLinear) and o_proj.weight.dtype == torch.float32
    assert isinstance(k_proj, MXFrozenLinear) and k_proj.weight.dtype == torch.uint8
    with pytest.raises(ConfigError, match=rf"quantization_plan.apply_modules='{LAYER}.self_attn.o_proj.base_layer' "
                                          r"is invalid: .*tensor parallel leaves each rank in_features=32"):
        _qlora_tp_plan(peft_model(targets=PROJECTIONS), block_size=64, apply_modules=["*.o_proj"])
    # block 32: every projection converts, k_proj and v_proj (16 rows a rank) and o_proj (one block a rank)
    plan = _qlora_tp_plan(peft_model(targets=PROJECTIONS), apply_modules=[f"*.{p}" for p in PROJECTIONS])["quantize"][1]
    assert len(plan.conversions) == 2 * len(PROJECTIONS) and plan.skipped == ()


def test_peft_arguments_on_a_model_without_adapters_are_config_errors(tmp_path):
    from fsdp_turbo.checkpoint import load_pretrained, save_pretrained
    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    model = tiny_hf_causal_lm("llama")
    with pytest.raises(ConfigError, match="merge_adapters=True is invalid: LlamaForCausalLM has no adapters"):
        save_pretrained(model, tmp_path / "merged", merge_adapters=True)
    model.save_pretrained(tmp_path / "base")
    with pytest.raises(ConfigError, match=r"adapter=.* is invalid: LlamaForCausalLM has no adapters"):
        load_pretrained(tiny_hf_causal_lm("llama", device="meta"), tmp_path / "base", adapter=tmp_path / "base")


def test_a_lora_job_with_expert_adapters_under_ep_is_read():
    """Its checkpoints save the strided expert adapters (test_integ_cli_lora's resume test), so the
    job is accepted with and without expert parallel."""
    from fsdp_turbo.cli.job_config import JobConfig

    job = {"model": {"config": {"model_type": "qwen3_moe"}},
           "peft": {"target_modules": ["*.q_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]},
           "turbo": {"expert_parallel_size": 2, "ep_plan": {}}}
    for turbo in (job["turbo"], {}):
        read = JobConfig.from_dict({**job, "turbo": turbo})
        assert read.peft.target_parameters == ("mlp.experts.gate_up_proj",)


# ----- QLoRA-MX: frozen base weights stored and all-gathered in MX ---------------------------------------
@pytest.mark.multirank
def test_qlora_mx_at_fsdp4_matches_peft_over_the_same_quantized_base(tmp_path):
    """E4M3 and HIF8 frozen bases at FSDP=4 against one-process PEFT over the base the same function
    quantized; each rank stores, and the all-gathers move, (1 + 1/32) bytes per frozen element. A merged
    save writes the dequantized base with the adapters merged; a meta-built model loads its base into
    the same packed bytes."""
    from transformers import AutoModelForCausalLM

    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    tiny_hf_causal_lm("llama").save_pretrained(tmp_path / "base")
    reference = run_reference(qlora_reference_runs, timeout=300)
    for rank, runs in enumerate(run_distributed(qlora_facade_runs, 4, str(tmp_path), str(tmp_path / "base"),
                                                timeout=600)):
        assert runs.pop("meta-built shards that differ") == []
        logits = runs.pop("logits")
        assert set(runs) == set(QLORA_FORMATS)
        for quant_format, (record, dtypes, (stored, gathered, bf16)) in runs.items():
            assert_parity(reference[quant_format], record, **TOL)
            assert len(record.grads) == 2 * 4 * 2  # adapters only
            assert dtypes == ["torch.uint8"]  # codes and E8M0 scales, interleaved per block
            assert stored * 4 == gathered  # the all-gather moves exactly the stored bytes, MX
            assert stored / bf16 == pytest.approx((1 + 1 / 32) / 2)  # 0.52x of bf16
        if rank == 0:
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
            assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
            with torch.no_grad():
                torch.testing.assert_close(merged(input_ids=EVAL_IDS).logits, logits, rtol=1e-5, atol=1e-5)


