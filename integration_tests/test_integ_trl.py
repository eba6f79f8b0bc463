"""TRL's ``SFTTrainer`` and ``DPOTrainer`` through ``with_fsdp_turbo`` on 4 ranks, against the same TRL script
in one process with the same global batch, float32 (``trl_jobs``): every logged step loss within rtol 1e-5 and
grad norm within 1e-4.

- ``SFTTrainer`` on the tiny Qwen3-MoE with packed, padding-free conversations (``position_ids`` restart at
  each document): at EP=2 x FSDP=4 (TRL's fused LM head) and at CP=2 x FSDP=2 (the model's own loss);
- the same with ``SFTConfig``'s default precision (``bf16=True``, adopted as ``fsdp_plan.param_dtype``) at FSDP=4
  and at EP=2 x FSDP=4, against one process through ``with_fsdp_turbo`` with the same precision (tolerances
  in ``TOLERANCE``);
- ``SFTTrainer`` with ``completion_only_loss`` and with ``assistant_only_loss`` (their masks kept), and with
  ``peft_config=`` (a LoRA model, applied before sharding), at FSDP=4;
- ``DPOTrainer`` at FSDP=4 with its reference model sharded like the policy.

The refusals run in this process, before any collective.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")
import trl
from trl_jobs import (
    LAYOUTS,
    PER_RANK,
    STEPS,
    TRL_DEFAULT_PRECISION,
    WORLD,
    dataset,
    every_layout,
    one_process,
    tokenizer,
)

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing import run_distributed, run_reference
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.integrations.transformers import with_fsdp_turbo

# SFTConfig's defaults (bf16=True) against one process through with_fsdp_turbo with the same precision:
# measured within 1.3e-5 (losses, relative) and 5.6e-4 (grad norms of about 1.5)
BF16_LOSS_RTOL, BF16_GRAD_NORM_ATOL = 1e-4, 2e-3


# (loss rtol, grad norm atol): float32, and bf16 compute (SFTConfig's default precision) over float32 master
# weights, where each step's reduction order differs and bf16 rounds it
TOLERANCE = {"float32": (1e-5, 1e-4), "bf16": (BF16_LOSS_RTOL, BF16_GRAD_NORM_ATOL)}


@pytest.mark.multirank
def test_trl_trainers_match_the_one_process_script(tmp_path):
    reference = run_reference(one_process, str(tmp_path / "one"), timeout=600)
    ranks = run_distributed(every_layout, WORLD, str(tmp_path), timeout=900)
    for name, (case, _, _) in LAYOUTS.items():
        expected = reference[case]
        assert len(expected["loss"]) == STEPS, case
        loss_rtol, norm_atol = TOLERANCE["bf16" if case in TRL_DEFAULT_PRECISION else "float32"]
        if case in TRL_DEFAULT_PRECISION:  # the Trainer's bf16 adopted, in both runs
            assert expected["param_dtype"] == "torch.bfloat16", case
        for result in (rank[name] for rank in ranks):
            if case in TRL_DEFAULT_PRECISION:
                assert result["param_dtype"] == "torch.bfloat16", name
            torch.testing.assert_close(result["loss"], expected["loss"], rtol=loss_rtol, atol=0, msg=name)
            for ours, theirs in zip(result["grad_norm"], expected["grad_norm"], strict=True):
                assert math.isclose(ours, theirs, rel_tol=0, abs_tol=norm_atol), (name, ours, theirs)
    first = ranks[0]
    # TRL's fused LM head ran where it reads nothing around FSDPTurbo (its metrics are logged) ...
    assert {"entropy", "mean_token_accuracy"} <= set(first["moe_packed ep2 x fsdp4"]["logged"])
    # MoE telemetry (core.moe_telemetry) joins the Trainer's training logs
    assert {"moe/imbalance_max", "moe/router_entropy_mean", "moe/model.layers.0.mlp/ep_imbalance"} <= set(
        first["moe_packed ep2 x fsdp4"]["logged"])
    # ... and under context parallel the model's own loss trained (those metrics are not logged: one warning says so)
    assert "entropy" not in first["moe_packed cp2 x fsdp2"]["logged"]
    # peft_config=: only the adapters train, as in the one-process script
    lora = first["lora fsdp4"]
    assert lora["trainable"] == reference["lora"]["trainable"] < lora["parameters"] // 20
    _assert_same_adapter(tmp_path / "lora_fsdp4" / "adapter", tmp_path / "one" / "lora" / "adapter")
    assert max(reference["dpo"]["grad_norm"]) > 1.0  # max_grad_norm clipped DPO's steps, and they match


def _assert_same_adapter(ours, theirs):
    """save_model of the sharded PEFT model: the adapter files PEFT writes, holding the one-process run's adapter."""
    from safetensors.torch import load_file

    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in ours.iterdir()}
    mine, expected = (load_file(str(d / "adapter_model.safetensors")) for d in (ours, theirs))
    assert sorted(mine) == sorted(expected) and any("lora_B" in key for key in mine)
    for key, tensor in expected.items():
        torch.testing.assert_close(mine[key], tensor, rtol=0, atol=1e-5, msg=key)


# ----- refusals, each before any collective -----------------------------------------------------------
def _dpo(tmp_path, config, **extra):
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=PER_RANK, max_steps=1,
                         report_to=[], use_cpu=True, max_length=48, bf16=False)
    return with_fsdp_turbo(trl.DPOTrainer)(model=tiny_hf_causal_lm("llama", vocab_size=2048), args=args,
                                           train_dataset=dataset("dpo"), processing_class=tokenizer(),
                                           fsdp_turbo_config=config, **extra)


def test_dpo_without_a_reference_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"ref_model=None.*Fix: pass ref_model="):
        _dpo(tmp_path, {})


def test_dpo_under_context_parallel_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"context_parallel_size=2.*DPOTrainer computes sequence log-probabilities"):
        _dpo(tmp_path, {"context_parallel_size": 2}, ref_model=tiny_hf_causal_lm("llama", vocab_size=2048))


def test_sft_loss_types_that_read_the_whole_logits_are_refused_under_context_parallel(tmp_path):
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=PER_RANK, max_steps=1, report_to=[],
                         use_cpu=True, loss_type="dft", bf16=False)
    model = tiny_hf_causal_lm("llama", vocab_size=2048)
    with pytest.raises(ConfigError, match=r"SFTConfig.loss_type='dft'.*Fix: use loss_type='nll'"):
        with_fsdp_turbo(trl.SFTTrainer)(model=model, args=args, train_dataset=dataset("sft"),
                                        processing_class=tokenizer(), fsdp_turbo_config={"context_parallel_size": 2})
    assert not hasattr(model, "parallel_state")  # refused before FSDPTurbo touched it
