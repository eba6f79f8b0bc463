"""transformers' ``Trainer`` through ``with_fsdp_turbo`` at FSDP=4 against the plain ``Trainer`` in one
process with the same global batch (``PER_RANK x 4`` rows), float32: every logged step loss and
eval loss within rtol 1e-5, every logged grad norm within 1e-4, each step on the same rows, and
``save_model``'s folder read back by ``from_pretrained`` as the one-process Trainer's own.

The refusals run in this process: they are checked before ``FSDPTurbo`` shards the model, so
before any collective.
"""

from __future__ import annotations

import math

import pytest
import torch
from trainer_jobs import (
    PER_RANK,
    STEPS,
    WORLD,
    token_dataset,
    train,
    train_bf16_one_rank,
    train_fsdp4,
    training_arguments,
)

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing import run_distributed, run_reference
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

transformers = pytest.importorskip("transformers")
from fsdp_turbo.integrations.transformers import with_fsdp_turbo  # noqa: E402 - after the importorskip


@pytest.mark.multirank
def test_trainer_at_fsdp4_matches_the_one_process_trainer(tmp_path):
    reference = run_reference(train, str(tmp_path / "one"), PER_RANK * WORLD, None, timeout=300)
    runs = run_distributed(train_fsdp4, WORLD, str(tmp_path), timeout=300)
    assert len(reference["loss"]) == len(reference["grad_norm"]) == STEPS
    _assert_matches(reference, [run["plain"] for run in runs])
    # with gradient accumulation (2 micro-batches of 1 row a rank): the same steps
    _assert_matches(reference, [run["accumulated"] for run in runs])
    _assert_same_saved_model(tmp_path / "fsdp4" / "model", tmp_path / "one" / "model")
    for run in runs:  # every rank refuses CP (its peers would need one batch), itself, before sharding
        refusal = run["cp_refusal"]
        assert refusal.startswith("context_parallel_size=2 is invalid"), refusal
        assert "Fix: set context_parallel_size=1" in refusal, refusal


def _assert_matches(reference, ranks):
    for rank, result in enumerate(ranks):
        # the model was sharded once, by FSDPTurbo, and not wrapped again (no DDP, no second FSDP)
        assert result["wrapped_is_model"] and result["model_type"] == "FSDPLlamaForCausalLM"
        assert result["dtensor_params"] and result["dp"] == (rank, WORLD)
        torch.testing.assert_close(result["loss"], reference["loss"], rtol=1e-5, atol=0)
        for ours, theirs in zip(result["grad_norm"], reference["grad_norm"], strict=True):
            assert math.isclose(ours, theirs, rel_tol=0, abs_tol=1e-4), (ours, theirs)
    assert max(reference["grad_norm"]) > 1.0  # max_grad_norm=1.0 clipped: the clipped steps match too
    assert len(reference["eval_loss"]) == STEPS // 2  # evaluations at steps 2 and 4, on the sharded model too
    for result in ranks:
        torch.testing.assert_close(result["eval_loss"], reference["eval_loss"], rtol=1e-5, atol=0)
    # each global step: the ranks' rows, in rank order, are the one-process step's rows
    micro_batches = len(ranks[0]["inputs"]) // STEPS
    for step in range(STEPS):
        rows = torch.cat([result["inputs"][step * micro_batches + micro] for micro in range(micro_batches)
                          for result in ranks])
        assert torch.equal(rows, reference["inputs"][step]), step


def _assert_same_saved_model(ours, theirs):
    """save_model's folder: the files the plain Trainer writes, loaded by from_pretrained to the same weights."""
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    mine, expected = (transformers.AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (ours, theirs))
    assert sorted(mine) == sorted(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(mine[key], tensor, rtol=0, atol=1e-5, msg=key)
    # it trained: the saved weights are not the initial ones
    initial = tiny_hf_causal_lm("llama").state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(mine["model.layers.0.self_attn.q_proj.weight"], initial, atol=1e-4)


def test_bf16_is_fsdp_plans_mixed_precision_without_accelerates_autocast(tmp_path):
    result = run_reference(train_bf16_one_rank, str(tmp_path), timeout=300)
    assert result["mixed_precision"] == "no" and not result["autocast_wrapped"]
    # FSDP2 gathers and computes in bf16 (the logits leave the model in bf16: no autocast casts them back) ...
    assert result["output_dtypes"] == [torch.bfloat16] * 2
    # ... over float32 master parameters, and it trains
    assert result["master_dtypes"] == {torch.float32}
    assert len(result["loss"]) == 2 and all(math.isfinite(loss) for loss in result["loss"])


# ----- refusals, each before any collective -----------------------------------------------------------
def _construct(tmp_path, config=None, **arguments):
    trainer_cls = with_fsdp_turbo(transformers.Trainer)
    args = training_arguments(str(tmp_path), PER_RANK, **arguments)
    return trainer_cls(model=tiny_hf_causal_lm("llama"), args=args, train_dataset=token_dataset(),
                       fsdp_turbo_config={} if config is None else config)


REFUSED_ARGUMENTS = {
    "gradient_checkpointing": ({"gradient_checkpointing": True}, "TrainingArguments.gradient_checkpointing",
                               "recompute=True"),
    # transformers sets gradient_checkpointing too, the field named first; the fix names both
    "activation_checkpointing": ({"activation_checkpointing": True}, "TrainingArguments.gradient_checkpointing",
                                 "activation_checkpointing=False) and turn on the FSDPTurbo config's recompute=True"),
    "torch_compile": ({"torch_compile": True}, "TrainingArguments.torch_compile", "compile=True"),
    "fsdp": ({"fsdp": "full_shard"}, "TrainingArguments.fsdp", "drop fsdp"),
    "bf16 without param_dtype": ({"bf16": True}, "TrainingArguments.bf16", "fsdp_plan.param_dtype='bfloat16'"),
    "fp16": ({"fp16": True}, "TrainingArguments.fp16", "use bf16=True"),
    "checkpoints": ({"save_strategy": "steps"}, "TrainingArguments.save_strategy", "save_strategy='no'"),
}


@pytest.mark.parametrize("case", list(REFUSED_ARGUMENTS))
def test_training_arguments_it_cannot_honour_are_refused(tmp_path, monkeypatch, case):
    arguments, field, fix = REFUSED_ARGUMENTS[case]
    # TrainingArguments(fsdp=...) writes this variable; set here, it is taken away again after the test
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    with pytest.raises(ConfigError) as error:
        _construct(tmp_path, **arguments)
    assert error.value.field.startswith(field), error.value
    assert fix in error.value.fix and "Fix: " in str(error.value)


def test_parallelism_config_is_refused(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ConfigError, match=r"TrainingArguments.parallelism_config=.*Fix: drop parallelism_config"):
        _construct(tmp_path, parallelism_config=ParallelismConfig(dp_shard_size=1))


def test_deepspeed_is_refused(tmp_path):
    trainer_cls = with_fsdp_turbo(transformers.Trainer)
    args = training_arguments(str(tmp_path), PER_RANK)
    # TrainingArguments(deepspeed=...) imports deepspeed, not installed here: the field is set as it would read
    args.deepspeed = {"zero_optimization": {"stage": 3}}
    with pytest.raises(ConfigError, match=r"TrainingArguments.deepspeed=.*Fix: drop deepspeed"):
        trainer_cls(model=tiny_hf_causal_lm("llama"), args=args, train_dataset=token_dataset(),
                    fsdp_turbo_config={})


def test_param_dtype_without_bf16_is_refused_from_a_yaml_config(tmp_path):
    path = tmp_path / "turbo.yaml"
    path.write_text("fsdp_plan:\n  param_dtype: bfloat16\n")
    with pytest.raises(ConfigError, match=r"fsdp_plan.param_dtype='bfloat16'.*Fix: set bf16=True"):
        _construct(tmp_path, config=str(path))


def test_the_model_stays_unsharded_when_refused(tmp_path):
    model = tiny_hf_causal_lm("llama")
    with pytest.raises(ConfigError):
        with_fsdp_turbo(transformers.Trainer)(model=model, args=training_arguments(str(tmp_path), 2, bf16=True),
                                              fsdp_turbo_config={})
    assert not hasattr(model, "parallel_state")
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_what_with_fsdp_turbo_takes(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer_cls='Module'.*transformers.Trainer or a subclass"):
        with_fsdp_turbo(torch.nn.Module)
    trainer_cls = with_fsdp_turbo(transformers.Trainer)
    assert issubclass(trainer_cls, transformers.Trainer) and trainer_cls.__name__ == "FSDPTurboTrainer"
    with pytest.raises(ConfigError, match=r"already comes from with_fsdp_turbo"):
        with_fsdp_turbo(trainer_cls)
    args = training_arguments(str(tmp_path), PER_RANK)
    with pytest.raises(ConfigError, match=r"fsdp_turbo_config=None.*Fix: pass fsdp_turbo_config="):
        trainer_cls(model=tiny_hf_causal_lm("llama"), args=args)
    with pytest.raises(ConfigError, match=r"model='tiny-llama'.*load the model yourself"):
        trainer_cls(model="tiny-llama", args=args, fsdp_turbo_config={})
    with pytest.raises(ConfigError, match=r"args=None.*pass args=TrainingArguments"):
        trainer_cls(model=tiny_hf_causal_lm("llama"), fsdp_turbo_config={})
    model = tiny_hf_causal_lm("llama")  # an optimizer over the parameters FSDPTurbo would replace
    with pytest.raises(ConfigError, match=r"optimizers='\(AdamW, ...\)'.*optimizer_cls_and_kwargs"):
        trainer_cls(model=model, args=args, optimizers=(torch.optim.AdamW(model.parameters()), None),
                    fsdp_turbo_config={})


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("ACCELERATE_MIXED_PRECISION", "bf16", r"\$ACCELERATE_MIXED_PRECISION='bf16'.*Fix: set fsdp_plan.param_dtype"),
    ("ACCELERATE_USE_FSDP", "true", r"\$ACCELERATE_USE_FSDP='true'.*Fix: launch with torchrun"),
])
def test_accelerate_launch_options_are_refused_too(tmp_path, monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)  # what `accelerate launch --mixed_precision bf16` / `--use_fsdp` set
    with pytest.raises(ConfigError, match=expected):
        _construct(tmp_path)
