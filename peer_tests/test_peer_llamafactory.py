"""LLaMA-Factory v1 (``llamafactory-kt==0.9.6.dev0``, a client nobody here wrote) trains on FSDPTurbo
through its own ``dist_config: {name: fsdpturbo, ep_size: 2, ep_dispatcher: eager}`` backend, which
imports FSDPTurbo's module-level expert-parallel API.

The client's v1 SFT command runs under a real ``torchrun`` (gloo, CPU) on a tiny random-init
Qwen3-MoE (2 layers, 4 experts, top-2) saved with ``save_pretrained``, the repo's sft_tiny tokenizer
and 16 of its chat samples: 3 AdamW steps (lr 3e-4) of a global batch of 8, float32, seed 42. Each
layout trains twice, with ``fsdpturbo`` and with the client's own ``fsdp2`` backend, on the same
ranks, data, seed and model:

* ep 2 x efsdp 2 on 4 ranks (``expert_parallelize_modules`` then ``expert_fully_shard_modules``),
* ep 2 on 2 ranks (efsdp 1: ``expert_parallelize_modules`` only).

Asserted: the step losses and grad norms the client prints are equal to the printed digits (its
``trainer_log.jsonl`` holds the full floats: equal when rounded the same way), and the weights it
saves are within 1e-5 of each other. The experts carry about a seventh of the squared gradient
norm, so an expert gradient divided by a wrong factor shows in the printed norm (AdamW's weights
would hardly show it). Measured, all four runs alike (the global batch is the same at 2 and 4 ranks):

    step  loss    grad_norm   (printed by the client, %.4f)
    1     7.8723  2.1661
    2     7.8024  1.9339
    3     7.7332  2.6999

fsdpturbo against fsdp2 in full floats: losses equal to 1 ulp (0 or 4.8e-7), grad norms within
2.4e-7; saved weights within 2.4e-7 (4 ranks) and 3.3e-7 (2 ranks), the largest in an expert's
``up_proj``, while training moved every weight by about 9e-4.

The checks of the client's own backend unit tests (tests_v1/.../test_fsdpturbo_ep.py upstream) run
against the real functions instead of monkeypatched ones: the registered model specs' patterns
through the real ``module_name_match`` on real models, the strict params, and, in the fsdpturbo
launches, the divide factor it sets and the expert mesh's shape and names (from its log and from
``lf_launch.py --probe``: the client's ``fsdpturbo`` plugin shards a second copy of the model in
bf16 in the client's own distributed state) and the bf16 storage dtype.

Only one call of the client is neutralized: ``torch.accelerator.synchronize`` on a CPU-only torch
(the client's gap; see ``llamafactory/lf_launch.py``). Four torchrun launches in all, about 80 s on
the 2-core machine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("llamafactory.v1")
sys.path.insert(0, str(Path(__file__).parent / "llamafactory"))
# peer_tests/llamafactory holds the launcher and its jobs; no package, so it never shadows the client.
import lf_jobs

pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("llamafactory")]

# layout -> (ranks, expected expert-mesh shape (edp, efsdp, ep, expert_cp))
LAYOUTS = {"ep2 x efsdp2, 4 ranks": (4, [1, 2, 2, 1]), "ep2, 2 ranks": (2, [1, 1, 2, 1])}
LAUNCH_TIMEOUT_S = 240
WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llamafactory")
    return {"root": root, "model": lf_jobs.write_model(root / "model"),
            "dataset": lf_jobs.write_dataset(root / "data.jsonl")}


@pytest.fixture(scope="module")
def run(inputs: dict[str, Path]) -> Callable[[str, str], lf_jobs.Launch]:
    """``run(layout, backend)``: one torchrun launch per (layout, backend), made by the first test
    that reads it and shared by the others."""
    launches: dict[tuple[str, str], lf_jobs.Launch] = {}

    def launched(layout: str, backend: str) -> lf_jobs.Launch:
        if (layout, backend) not in launches:
            ranks, _ = LAYOUTS[layout]
            name = f"{backend}_{ranks}"
            dist_config = lf_jobs.fsdpturbo(2) if backend == "fsdpturbo" else lf_jobs.FSDP2
            config = lf_jobs.write_config(inputs["root"] / f"{name}.yaml", model_dir=inputs["model"],
                                          dataset=inputs["dataset"], output_dir=inputs["root"] / name,
                                          dist_config=dist_config)
            probe = inputs["root"] / f"{name}_probe.json" if backend == "fsdpturbo" else None
            launches[layout, backend] = lf_jobs.launch(config, ranks, timeout=LAUNCH_TIMEOUT_S, probe=probe)
        return launches[layout, backend]

    return launched


# --- the client's backend unit checks, against the real functions (one process) -----------------


def _names_matching(model: torch.nn.Module, pattern: str) -> list[str]:
    from fsdp_turbo.utils.str_match import module_name_match

    return [name for name, _ in model.named_modules() if module_name_match(pattern, name)]


def _tiny_qwen3_5_moe() -> torch.nn.Module:
    """A tiny Qwen3.5-MoE (the client's other registered model type): a vision tower of one block
    and a language model of one linear-attention and one full-attention layer."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "linear_num_key_heads": 2, "linear_num_value_heads": 2, "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "layer_types": ["linear_attention", "full_attention"]}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision))


def test_qwen3_moe_spec_patterns_name_exactly_the_experts_and_their_blocks():
    """The client's qwen3_moe spec, through FSDPTurbo's real matcher on the real model: the EP
    pattern names each layer's expert container and nothing else, the EFSDP pattern its MoE block."""
    from llamafactory.v1.plugins.trainer_plugins.distributed.fsdpturbo import FSDPTurboEPModelSpec
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts, Qwen3MoeSparseMoeBlock

    model = Qwen3MoeForCausalLM(lf_jobs.tiny_qwen3_moe_config(64))
    spec = FSDPTurboEPModelSpec.get(model)
    assert (spec.ep_modules, spec.ep_fsdp_modules) == ([lf_jobs.EXPERT_PATTERN], [lf_jobs.EFSDP_PATTERN])
    experts = [name for name, module in model.named_modules() if isinstance(module, Qwen3MoeExperts)]
    blocks = [name for name, module in model.named_modules() if isinstance(module, Qwen3MoeSparseMoeBlock)]
    assert len(experts) == len(blocks) == lf_jobs.NUM_LAYERS
    assert _names_matching(model, spec.ep_modules[0]) == experts
    assert _names_matching(model, spec.ep_fsdp_modules[0]) == blocks


def test_qwen3_moe_prepare_gives_transformers_experts_the_hidden_size_our_dispatcher_reads():
    from llamafactory.v1.plugins.trainer_plugins.distributed.fsdpturbo import FSDPTurboEPModelSpec
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    model = Qwen3MoeForCausalLM(lf_jobs.tiny_qwen3_moe_config(64))
    prepared = FSDPTurboEPModelSpec.get(model).prepare(model)
    experts = [module for module in prepared.modules() if isinstance(module, Qwen3MoeExperts)]
    assert experts and all(module.hidden_size == module.hidden_dim == 32 for module in experts)


def test_qwen3_5_moe_spec_patterns_name_the_language_models_experts_not_the_vision_tower():
    from llamafactory.v1.plugins.trainer_plugins.distributed.fsdpturbo import (
        FSDPTurboEPModelSpec,
        FSDPTurboFSDP2Engine,
    )

    model = _tiny_qwen3_5_moe()
    spec = FSDPTurboEPModelSpec.get(model)
    assert spec.ep_modules == ["model.language_model.layers.{*}.mlp.experts"]
    assert FSDPTurboFSDP2Engine._get_ep_fsdp_modules(spec) == ["model.language_model.layers.{*}.mlp"]
    assert _names_matching(model, spec.ep_modules[0]) == [f"model.language_model.layers.{i}.mlp.experts"
                                                          for i in range(2)]
    assert _names_matching(model, spec.ep_fsdp_modules[0]) == [f"model.language_model.layers.{i}.mlp"
                                                               for i in range(2)]
    # a model type without a spec gets none (the client then refuses ep_size > 1)
    assert FSDPTurboEPModelSpec.get(model.model.visual) is None


def test_fsdpturbo_backend_params_are_strict():
    from llamafactory.v1.plugins.trainer_plugins.distributed.interface import DistributedPlugin, FSDPTurboParams

    plugin = DistributedPlugin("fsdpturbo")
    params = plugin.parse_params(lf_jobs.fsdpturbo(2), FSDPTurboParams)
    assert (params.ep_size, params.ep_dispatcher, params.fsdp_implementation) == (2, "eager", "native")
    assert callable(plugin.shard_model) and callable(plugin.clip_grad_norm)
    # the topology is the client's TrainingArguments', never a backend param; the EP patterns are the spec's
    for unknown in ({"cp_size": 2}, {"ep_modules": [lf_jobs.EXPERT_PATTERN]}):
        with pytest.raises(ValueError, match="Unknown params"):
            plugin.parse_params({"name": "fsdpturbo", **unknown}, FSDPTurboParams)
    with pytest.raises(ValueError, match="ep_size must be positive"):
        plugin.parse_params({"name": "fsdpturbo", "ep_size": 0}, FSDPTurboParams)


# --- the client's SFT command: fsdpturbo against fsdp2, and what the probe saw -----------------

LAYOUT_TIMEOUT_S = 2 * LAUNCH_TIMEOUT_S + 60  # the first test of a layout pays for both of its launches


@pytest.mark.timeout(LAYOUT_TIMEOUT_S)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdpturbo_prints_fsdp2s_step_losses_and_grad_norms(run, layout):
    turbo, fsdp2 = run(layout, "fsdpturbo"), run(layout, "fsdp2")
    printed = lf_jobs.printed_steps(turbo.stdout)
    assert [step for step, _, _ in printed] == list(range(1, lf_jobs.STEPS + 1))
    assert printed == lf_jobs.printed_steps(fsdp2.stdout)
    # its log file holds the same steps in full float digits: equal when rounded as printed
    ours, theirs = lf_jobs.logged_steps(turbo.output_dir), lf_jobs.logged_steps(fsdp2.output_dir)
    for key in ("loss", "grad_norm"):
        assert [f"{step[key]:.4f}" for step in ours] == [f"{step[key]:.4f}" for step in theirs]
        assert [f"{step[key]:.4f}" for step in ours] == [p[1 if key == "loss" else 2] for p in printed]


@pytest.mark.timeout(LAYOUT_TIMEOUT_S)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdpturbo_saves_fsdp2s_weights(run, inputs, layout):
    ours = lf_jobs.saved_weights(run(layout, "fsdpturbo").output_dir)
    theirs = lf_jobs.saved_weights(run(layout, "fsdp2").output_dir)
    initial = lf_jobs.saved_weights(inputs["model"])
    assert ours.keys() == theirs.keys() == initial.keys()
    for name, weight in ours.items():
        assert weight.dtype == torch.float32, name
        torch.testing.assert_close(weight, theirs[name], rtol=0, atol=WEIGHT_ATOL, msg=name)
    # training moved every weight tensor, each expert's too, well past the tolerance: the match means something
    moved = {name: (weight - initial[name]).abs().max().item() for name, weight in ours.items()}
    assert any(".experts." in name for name in moved) and min(moved.values()) > 50 * WEIGHT_ATOL, moved


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_client_expert_mesh_is_edp_efsdp_ep_expert_cp(run, layout):
    """The client's own FSDPTurboParallelState, built by its engine in a real gloo group: ep is the
    configured 2, efsdp the rest of the data-parallel ranks, edp and expert_cp 1."""
    ranks, shape = LAYOUTS[layout]
    probe = run(layout, "fsdpturbo").probe
    assert [record["rank"] for record in probe] == list(range(ranks))
    names = ["edp", "efsdp", "ep", "expert_cp"]
    for record in probe:
        assert record["sizes"] == {"dp": ranks, "ep": 2, "efsdp": ranks // 2, "edp": 1}
        assert record["expert_mesh"] == {"shape": shape, "names": names}
        assert record["sub_meshes"] == {name: {"shape": [size], "names": [name]} for name, size in zip(names, shape)}


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_client_stores_bf16_and_keeps_experts_on_the_expert_mesh(run, layout):
    """With ``bf16: true`` the client's fsdpturbo engine stores every parameter in bf16 (the FSDP2
    one keeps float32 masters): FSDPTurbo's expert parallel keeps that dtype. The experts are DTensors
    on the expert mesh (ep, and efsdp where it is over 1), everything else on the client's dp mesh:
    the client's ``clip_grad_norm_`` tells the two apart by those mesh names."""
    ranks, _ = LAYOUTS[layout]
    expert_dims = ["efsdp", "ep"] if ranks // 2 > 1 else ["ep"]
    for record in run(layout, "fsdpturbo").probe:
        params = record["params"]
        assert {facts["dtype"] for facts in params.values()} == {"bfloat16"}
        experts = {name for name in params if ".mlp.experts." in name}
        assert experts, sorted(params)
        for name, facts in params.items():
            assert facts["mesh"] == (expert_dims if name in experts else ["dp"]), (name, facts)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 60)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_client_divides_expert_gradients_by_ep_times_efsdp_and_keeps_experts_from_its_fsdp(run, layout):
    """What the client set on the real ``EPPlanConfig`` and handed to the real functions, from its
    own log (rank 0; once for the probe, once for training): the divide factor ep x efsdp (its dp
    size, the ranks whose tokens each expert's gradient sums) and the 2 x 2 expert parameters
    left out of its outer FSDP. That the factor took effect shows in the grad norms above."""
    ranks, _ = LAYOUTS[layout]
    stdout = run(layout, "fsdpturbo").stdout
    assert lf_jobs.client_log_values(stdout, "FSDPTurbo EP gradient divide factor") == [f"{float(ranks)}"] * 2
    assert stdout.count(f"Ignoring {2 * lf_jobs.NUM_LAYERS} EP parameters in outer FSDP") == 2
    efsdp_meshes = lf_jobs.client_log_values(stdout, "FSDPTurbo EFSDP device mesh")
    assert efsdp_meshes == (["DeviceMesh((efsdp=2),"] * 2 if ranks == 4 else [])
