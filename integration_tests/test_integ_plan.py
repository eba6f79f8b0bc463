"""``fsdp-turbo plan``: golden output, errors as ``train`` reports them, and a model-state
estimate within 10% of what MemTracker measures on real ranks after one step."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_jobs import measured_model_state

from fsdp_turbo.cli.job_config import JobConfig
from fsdp_turbo.cli.main import main
from fsdp_turbo.cli.names import compress_names
from fsdp_turbo.cli.plan import make_plan
from fsdp_turbo.core.testing import run_distributed

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "qwen3_moe_tiny.yaml"
GOLDEN = Path(__file__).parent / "golden" / "plan_qwen3_moe_tiny.txt"
TP = {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2,
      "tp_plan": {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj"], "rowwise_parallel": ["*.o_proj"]}}


def plan(*args):
    return subprocess.run([sys.executable, "-m", "fsdp_turbo.cli.main", "plan", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_plan_golden_output():
    result = plan(DEMO, "--world-size", 4)
    assert result.returncode == 0, result.stderr
    assert result.stdout == GOLDEN.read_text()


def test_plan_reports_config_errors_like_train(tmp_path):
    job = yaml.safe_load(DEMO.read_text())
    job["turbo"]["ep_plan"]["apply_modules"] = ["*.no_such_experts"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    for result in (plan(bad, "--world-size", 4),):
        assert result.returncode == 2
        assert "ep_plan.apply_modules='*.no_such_experts' is invalid: the pattern matches no module" in result.stderr


def _job_file(tmp_path, turbo):
    job = yaml.safe_load(DEMO.read_text())
    job["turbo"] = turbo
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _placement_block(output):
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("placement:"))
    end = next(i for i, line in enumerate(lines) if line.startswith("weights:"))
    return lines[start:end]


def test_plan_shows_where_each_mesh_group_lands_on_the_nodes(tmp_path, capsys):
    job = _job_file(tmp_path, {**TP, "context_parallel_size": 2})  # fsdp2 x cp2 x tp2
    assert main(["plan", str(job), "--nnodes", "2", "--nproc-per-node", "4"]) == 0
    output = capsys.readouterr().out
    assert "world size 8" in output
    assert _placement_block(output) == [
        "placement: 2 nodes x 4 ranks (node = rank // 4, as torchrun numbers them)",
        "  fsdp         groups of 2: across nodes 0-1",
        "               nodes 0-1: {0,4} {1,5} {2,6} {3,7}",
        "  cp           groups of 2: each inside one node",
        "               node 0: {0,2} {1,3}; node 1: {4,6} {5,7}",
        "  tp           groups of 2: each inside one node",
        "               node 0: {0,1} {2,3}; node 1: {4,5} {6,7}",
        "  fsdp_cp      groups of 4: across nodes 0-1",
        "               nodes 0-1: {0,2,4,6} {1,3,5,7}",
        "  efsdp        groups of 8: across nodes 0-1",
        "               nodes 0-1: {0-7}",
    ]


def test_plan_warns_when_tp_crosses_nodes(tmp_path, capsys):
    assert main(["plan", str(_job_file(tmp_path, TP)), "--nnodes", "4"]) == 0  # 4 ranks: one a node
    block = _placement_block(capsys.readouterr().out)
    assert block[0] == "placement: 4 nodes x 1 rank (node = rank // 1, as torchrun numbers them)"
    assert "  tp           groups of 2: each across 2 nodes" in block
    assert block[-1].startswith("  warning: tensor_parallel_size=2 spans 2 nodes of 1 rank")


def test_plan_node_flags_must_agree_with_the_world_size(capsys):
    assert main(["plan", str(DEMO), "--nnodes", "2", "--nproc-per-node", "4", "--world-size", "4"]) == 2
    assert ("--world-size=4 is invalid: 2 nodes of 4 ranks are 8. Fix: drop it, or make it --nnodes x "
            "--nproc-per-node = 8") in capsys.readouterr().err
    assert main(["plan", str(DEMO), "--nproc-per-node", "3", "--world-size", "4"]) == 2
    assert "--nproc-per-node=3 is invalid" in capsys.readouterr().err


def test_compress_names():
    names = [f"model.layers.{i}.mlp" for i in range(3)] + ["lm_head", "model.layers.5.x", "model.layers.7.x"]
    assert compress_names(names) == ["model.layers.{0-2}.mlp", "model.layers.{5,7}.x", "lm_head"]


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["demo: fsdp4 x ep2 + mx", "fsdp2 x tp2"])
def test_model_state_estimate_within_10_percent_of_memtracker(layout):
    job = yaml.safe_load(DEMO.read_text())
    if layout.startswith("fsdp2"):
        job["turbo"] = TP
    measured = run_distributed(measured_model_state, 4, job, timeout=300)
    _, estimate = make_plan(JobConfig.from_dict(job), 4)
    for bytes_on_rank in measured:
        assert abs(estimate.model_state / bytes_on_rank - 1) < 0.10, (estimate, measured)


def test_plan_counts_lora_frozen_bytes_and_qlora_mx_packed_bytes():
    """LoRA: gradients and AdamW states for the adapters only. QLoRA-MX: each frozen projection
    weight at 1 + 1/32 bytes per element instead of 4 (its shard, padded as FSDP pads dim 0)."""
    import math

    from test_integ_cli_lora import JOBS

    from fsdp_turbo.cli.model import build_model

    world = 2
    _, lora = make_plan(JobConfig.from_dict(JOBS["lora"]), world)
    qlora_lines, qlora = make_plan(JobConfig.from_dict(JOBS["qlora-mx"]), world)
    assert lora.gradients == qlora.gradients and lora.optimizer == qlora.optimizer
    assert any("trainable" in line and "frozen" in line for line in qlora_lines)
    job = JobConfig.from_dict(JOBS["lora"])
    expected = {"lora": 0.0, "qlora-mx": 0.0}
    for name, param in build_model(job.model, job.peft).named_parameters():
        if param.requires_grad:
            continue
        shard = math.ceil(param.shape[0] / world) * math.prod(param.shape[1:])
        packed = name.endswith("_proj.base_layer.weight")
        expected["lora"] += 4 * shard
        expected["qlora-mx"] += (1 + 1 / 32 if packed else 4) * shard
    assert lora.frozen == math.ceil(expected["lora"]) and qlora.frozen == math.ceil(expected["qlora-mx"])
    assert qlora.frozen < lora.frozen


def _facts(kind):
    from fsdp_turbo.core.model_facts import resolve_model_facts
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    return resolve_model_facts(tiny_hf_causal_lm(kind, device="meta"))


def _kinds(kind):
    facts = _facts(kind)
    kinds = {}
    for layer in facts.attention_layers:
        kinds.setdefault(layer.kind.value, []).append(layer.name)
    return kinds


def test_attention_kinds_of_gpt_oss_qwen3_next_and_llama():
    # gpt-oss: layer_types alternate sliding/full, and every attention holds learned sinks
    assert _kinds("gpt_oss") == {"softmax": ["model.layers.1.self_attn"], "sliding": ["model.layers.0.self_attn"]}
    assert [(p.module, p.parameter) for p in _facts("gpt_oss").head_parameters] == [
        ("model.layers.0.self_attn", "sinks"), ("model.layers.1.self_attn", "sinks")]
    # qwen3-next: a Gated DeltaNet (linear) layer, then a full softmax one
    assert _kinds("qwen3_next") == {"linear": ["model.layers.0.linear_attn"], "softmax": ["model.layers.1.self_attn"]}
    assert _kinds("llama") == {"softmax": ["model.layers.0.self_attn", "model.layers.1.self_attn"]}


def test_attention_lines_print_what_the_plans_say_of_each_kind():
    """The block lists each kind the facts name, then the plans' own rows about it (TP's and
    CP's ``describe()``): gpt-oss at FSDP=2 x TP=2 (the sinks split with the heads), then at
    CP=2 with the ring."""
    from fsdp_turbo.cli.attention_kinds import attention_lines
    from fsdp_turbo.core.parallel_state import ParallelState
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
    from fsdp_turbo.fsdp_turbo import model_facts, plan_transforms
    from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig

    def lines(**fields):
        config = FSDPTurboConfig.from_dict(fields)
        model = tiny_hf_causal_lm("gpt_oss", device="meta")
        state = ParallelState(config.validate(4), rank=0, device_type="cpu", distributed=True)
        facts = model_facts(config, model)
        return attention_lines(facts, [plan for _, plan in plan_transforms(config, model, state, facts=facts)])

    tp = lines(**TP)
    assert tp[0] == "attention kinds:"
    assert tp[1:] == ["  sliding: model.layers.{0}.self_attn (1, window 8)",
                      "    tp_plan (split by head): model.layers.{0}.self_attn",
                      "  softmax: model.layers.{1}.self_attn (1)",
                      "    tp_plan (split by head): model.layers.{1}.self_attn",
                      "  per-head parameters: model.layers.{0-1}.self_attn.sinks (2, attention sinks)",
                      "    tp_plan (split with the heads): model.layers.{0-1}.self_attn.sinks"]
    ring = lines(context_parallel_size=2, fully_shard_parallel_size=2, cp_plan={"mode": "ring"})
    assert ("    cp_plan (sliding window): layers [0]: masked by their window, unseen tiles skipped, cut ones computed "
            "in blocks of 64 query rows") in ring
    assert "    cp_plan (per-head tensors): joined once per row" in ring


def test_plan_counts_all_gather_bytes_in_what_each_gather_moves():
    """FSDP=2: every parameter's other shard (padded as FSDP pads dim 0), twice a step (once for
    the root's, which it keeps from forward to backward: embedding, final norm, head), in fp32,
    in ``param_dtype`` (bf16), or as MX bytes (``low_precision_all_gather``, 1 + 1/32 bytes per
    element) for the MX weights whose shards are whole blocks: q_proj and o_proj (64 output rows;
    k/v_proj's 32 rows split into 16 are not, and stay fp32) and the fused experts (4 of 8 a rank)."""
    import math

    from fsdp_turbo.cli.model import build_model

    mx = {"quant_format": "E4M3", "block_size": 32}
    turbos = {"fp32": {"quantization_plan": mx},
              "bf16": {"quantization_plan": mx, "fsdp_plan": {"param_dtype": "bf16"}},
              "mx bytes": {"quantization_plan": {**mx, "low_precision_all_gather": True}}}
    job = yaml.safe_load(DEMO.read_text())
    planned = {name: make_plan(JobConfig.from_dict({**job, "turbo": {"fully_shard_parallel_size": 2, **turbo}}), 2)
               for name, turbo in turbos.items()}
    # other shard's elements x gathers a step, per parameter
    moved = {name: math.ceil(p.shape[0] / 2) * math.prod(p.shape[1:]) * (2 if name.startswith("model.layers.") else 1)
             for name, p in build_model(JobConfig.from_dict(job).model).named_parameters()}
    gathered = {name for name in moved if name.endswith((".q_proj.weight", ".o_proj.weight", ".experts.gate_up_proj",
                                                        ".experts.down_proj"))}
    assert len(gathered) == 8
    expected = {"fp32": sum(n * 4 for n in moved.values()), "bf16": sum(n * 2 for n in moved.values()),
                "mx bytes": sum(n * ((1 + 1 / 32) if name in gathered else 4) for name, n in moved.items())}
    for name, (lines, memory) in planned.items():
        assert memory.gathered == math.ceil(expected[name]), name
        assert f"FSDP all-gathers per rank: {memory.gathered / 2**20:.2f} MiB received per step" in "\n".join(lines)
    assert any("low_precision_all_gather (MX bytes" in line for line in planned["mx bytes"][0])


def _llama_job(tmp_path, turbo=None):
    from memory_jobs import layout_job

    job = layout_job("FSDP=4")
    if turbo is not None:
        job["turbo"] = turbo
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_plan_json_holds_the_memory_parts_and_the_peak_the_text_shows(tmp_path, capsys):
    import json

    path = _llama_job(tmp_path)
    assert main(["plan", str(path), "--world-size", "4", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    memory = summary["memory"]
    assert summary["mesh"]["fsdp"] == 4 and summary["transforms"] == ["fully_shard"]
    assert memory["peak_bytes"] == max(memory["phases"].values())
    assert memory["peak_phase"] == "loss"
    assert set(memory["phases"]) == {"loss", "layer backward", "layer reduce-scatter", "root reduce-scatter",
                                     "optimizer"}
    assert {"gathered_root_unit", "prefetched_units", "loss", "layer_reduce_scatter",
            "optimizer_temporaries"} <= set(memory["transients"])
    assert memory["model_state"] == memory["parameters"] + memory["gradients"] + memory["optimizer_states"]
    assert main(["plan", str(path), "--world-size", "4"]) == 0
    text = capsys.readouterr().out
    assert f"  peak              {memory['peak_bytes'] / 2**20:10.2f} MiB at loss" in text
    assert f"loss {memory['phases']['loss'] / 2**20:.2f}" in text


def test_plan_auto_ranks_what_fits_and_writes_the_job(tmp_path, capsys):
    import json

    path = _llama_job(tmp_path)
    written = tmp_path / "auto.yaml"
    assert main(["plan", str(path), "--world-size", "4", "--auto", "--memory-per-rank", "100MiB",
                 "--write", str(written), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    auto = summary["auto"]
    assert auto["fitting"] >= len(auto["candidates"]) > 1 and auto["refused"] < auto["tried"]
    steps = [candidate["step_s"] for candidate in auto["candidates"]]
    assert steps == sorted(steps)
    assert all(candidate["peak_bytes"] <= 100 * 2**20 for candidate in auto["candidates"])
    for candidate in auto["candidates"]:
        terms = candidate["compute_s"] + candidate["communication_s"] + candidate["memory_traffic_s"]
        assert candidate["step_s"] == pytest.approx(terms)
    # the printed plan is the chosen job's: its peak is the best candidate's
    assert summary["memory"]["peak_bytes"] == auto["candidates"][0]["peak_bytes"]
    chosen = JobConfig.from_file(written)
    assert chosen.to_dict()["turbo"] == JobConfig.from_dict({**yaml.safe_load(path.read_text()),
                                                             "turbo": auto["turbo"]}).to_dict()["turbo"]
    _, estimate = make_plan(chosen, 4)
    assert estimate.peak == auto["candidates"][0]["peak_bytes"]
    assert main(["plan", str(path), "--world-size", "4", "--auto", "--memory-per-rank", "100MiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("auto: ") and "fit 100.0 MiB a rank" in lines[0]


def test_plan_auto_errors_name_the_flag(tmp_path, capsys):
    path = _llama_job(tmp_path)
    assert main(["plan", str(path), "--world-size", "4", "--auto"]) == 2
    assert "--memory-per-rank=None is invalid" in capsys.readouterr().err
    assert main(["plan", str(path), "--world-size", "4", "--auto", "--memory-per-rank", "lots"]) == 2
    assert "--memory-per-rank='lots' is invalid: it is not a size" in capsys.readouterr().err
    assert main(["plan", str(path), "--world-size", "4", "--auto", "--memory-per-rank", "1MiB"]) == 2
    error = capsys.readouterr().err
    assert "--memory-per-rank='1.0MiB' is invalid: none of the" in error and "the smallest predicted peak is" in error
    assert main(["plan", str(path), "--world-size", "4", "--auto", "--memory-per-rank", "1GiB",
                 "--write", str(tmp_path / "job.toml")]) == 2
    assert "--write=" in capsys.readouterr().err


def test_parse_size():
    from fsdp_turbo.cli.auto_plan import parse_size

    assert parse_size("80GiB") == 80 * 2**30 and parse_size("120 MiB") == 120 * 2**20
    assert parse_size("2e9") == 2 * 10**9 and parse_size("1.5GB") == 1_500_000_000


def test_train_auto_launches_the_layout_plan_auto_picks(tmp_path, capsys):
    """``train --auto`` resolves the job with the chosen layout before the launch (checked here
    without launching: the job it returns is the one plan --auto writes)."""
    from fsdp_turbo.cli.main import _parser, _train_auto

    path = _llama_job(tmp_path)
    args = _parser().parse_args(["train", str(path), "--nproc-per-node", "4", "--auto", "--memory-per-rank", "100MiB"])
    job = _train_auto(JobConfig.from_file(path), args)
    assert "--auto picked" in capsys.readouterr().err
    written = tmp_path / "auto.yaml"
    assert main(["plan", str(path), "--world-size", "4", "--auto", "--memory-per-rank", "100MiB",
                 "--write", str(written)]) == 0
    assert job.to_dict() == JobConfig.from_file(written).to_dict()
    args = _parser().parse_args(["train", str(path), "--nproc-per-node", "1:4", "--auto", "--memory-per-rank", "1GiB"])
    with pytest.raises(Exception, match="--auto=True is invalid"):
        _train_auto(JobConfig.from_file(path), args)
