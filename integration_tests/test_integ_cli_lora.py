"""``fsdp-turbo train`` with a ``peft`` section (LoRA), end to end: real torchrun, 2 CPU ranks.

A tiny Qwen3 job (LoRA r=4 on the attention and MLP projections, FSDP with recompute) trains 6
steps with a checkpoint every 2, as plain LoRA and as QLoRA-MX (the frozen projections stored in
E4M3, ``quantization_plan.store_frozen_weights``, on a model built on the meta device). An
uninterrupted run is the reference; a run whose worker is killed (SIGKILL) at step 5 restarts
from the step-4 checkpoint and must end with a bit-identical adapter. Checkpoints hold the
adapters and their optimizer state only; ``final/`` is the adapter in PEFT's format,
``final_merged/`` the merged model in transformers' layout, and the two give the same logits
(over the same quantized base, for QLoRA-MX).
"""

from pathlib import Path

import pytest
import torch
import yaml
from peft_jobs import over_quantized_bases
from test_integ_cli import assert_same_weights, checkpoint, metrics, train, with_data_cache

pytest.importorskip("peft")
safetensors = pytest.importorskip("safetensors.torch")
# one worker runs the whole module, so its module fixtures (launched runs) are built once
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_cli_lora")]

PROJECTIONS = ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj", "*.gate_proj", "*.up_proj", "*.down_proj"]
JOB = {
    "model": {"config": {
        "model_type": "qwen3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "max_position_embeddings": 64, "tie_word_embeddings": False}},
    "peft": {"r": 4, "alpha": 8, "target_modules": PROJECTIONS, "export_merged": True},
    "data": {"files": ["stdlib:*.py"], "seq_len": 32, "max_bytes": 200_000},
    "optimizer": {"lr": 0.003, "warmup_steps": 2},
    "run": {"steps": 6, "micro_batch": 2, "seed": 0},
    "checkpoint": {"save_every": 2, "keep": 3},
    "turbo": {"recompute": True},
    "logging": {"plot": False},  # drawn and checked in test_integ_cli
}
QLORA_PLAN = {"quant_format": "E4M3", "apply_modules": ["*_proj"], "store_frozen_weights": True}
JOBS = {"lora": JOB, "qlora-mx": {**JOB, "turbo": {**JOB["turbo"], "quantization_plan": QLORA_PLAN}}}


def adapter(output) -> dict[str, torch.Tensor]:
    return safetensors.load_file(str(Path(output) / "final" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")  # both jobs read the same data


@pytest.fixture(scope="module", params=list(JOBS))
def job_file(request, tmp_path_factory, data_cache):
    path = tmp_path_factory.mktemp(f"{request.param}_job") / "job.yaml"
    path.write_text(yaml.safe_dump(with_data_cache(JOBS[request.param], data_cache)))
    return path


@pytest.fixture(scope="module")
def reference(job_file, tmp_path_factory):
    output = tmp_path_factory.mktemp("lora_reference")
    train(job_file, output)
    return output


def _job_base(job: dict) -> torch.nn.Module:
    """The job's base model (init_weights(seed)) in one process; for QLoRA-MX each frozen projection
    holds the values its MX bytes stand for (quantized, then dequantized, by the same function)."""
    from fsdp_turbo.checkpoint import init_weights
    from fsdp_turbo.cli.job_config import JobConfig
    from fsdp_turbo.cli.model import build_model

    base = init_weights(build_model(JobConfig.from_dict(job).model), seed=job["run"]["seed"])
    plan = job["turbo"].get("quantization_plan")
    return base if plan is None else over_quantized_bases(base, plan, suffix="_proj")


def test_lora_job_writes_an_adapter_a_merged_model_and_adapter_only_checkpoints(reference, job_file):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdp_turbo.checkpoint.safe_dcp import read_metadata

    final = Path(reference) / "final"
    assert {p.name for p in final.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    saved = adapter(reference)
    assert saved and all(".lora_A." in name or ".lora_B." in name for name in saved)
    assert len(saved) == 2 * len(PROJECTIONS) * 2  # lora_A and lora_B, 7 projections, 2 layers
    # a training checkpoint holds the adapters and their optimizer state, nothing of the base
    keys = read_metadata(checkpoint(reference, 4)).state_dict_metadata
    model_keys = [key for key in keys if key.startswith("model.")]
    assert model_keys and all("lora_" in key for key in model_keys)
    # the adapter over the job's base (rebuilt here in one process) and the merged export are the same model
    tuned = PeftModel.from_pretrained(_job_base(yaml.safe_load(job_file.read_text())), final)
    merged = AutoModelForCausalLM.from_pretrained(Path(reference) / "final_merged")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(tuned(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert [r["step"] for r in metrics(reference)] == list(range(1, 7))


def test_kill_9_of_a_lora_worker_recovers_bit_identically(job_file, reference, tmp_path):
    result = train(job_file, tmp_path, 2, "--max-restarts", 1, env={"FSDP_TURBO_FAULTS": "kill@5:1"})
    assert "exitcode: -9" in result.stderr
    assert "resumed from" in result.stderr and "step-4 at step 4" in result.stderr
    assert_same_weights(adapter(tmp_path), adapter(reference))
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 7))


def test_lora_experts_under_ep_resume_from_the_commands_checkpoint_bit_identically(tmp_path):
    """EP=2 x efsdp 2, LoRA on the attention and the experts: the command's checkpoint holds the
    experts' strided lora_B shards (as plain-sharded views, ``checkpoint.strided``), and a step after
    resuming gives the same bits as the step the uninterrupted model took. The adapter folder the
    trained model saves loads back (``load_pretrained(..., adapter=)``) into a meta-built model at the
    same layout, each rank reading its strided blocks."""
    from lora_resume_jobs import ep_lora_resume

    from fsdp_turbo.core.testing import run_distributed
    from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

    tiny_hf_causal_lm("qwen3_moe").save_pretrained(tmp_path / "base")
    for result in run_distributed(ep_lora_resume, 4, str(tmp_path), str(tmp_path / "base"), timeout=300):
        assert any("_StridedShard" in p for p in result["lora_B placements"])
        assert result["trained"].keys() == result["resumed"].keys()
        assert any("experts.lora_B" in n for n in result["trained"])
        for name, tensor in result["trained"].items():
            assert torch.equal(result["resumed"][name], tensor), name
            assert torch.equal(result["loaded"][name], tensor), name
