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
    LAYOUTS,
    PER_RANK,
    STEPS,
    WORLD,
    one_process,
    token_dataset,
    train_bf16_one_rank,
    train_layouts,
    training_arguments,
)

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.testing import run_distributed, run_reference
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

transformers = pytest.importorskip("transformers")
from fsdp_turbo.integrations.transformers import with_fsdp_turbo  # noqa: E402 - after the importorskip


@pytest.mark.multirank
def test_trainer_at_every_layout_matches_the_one_process_trainer(tmp_path):
    references = run_reference(one_process, str(tmp_path), timeout=300)
    reference = references["llama"]
    ranks = run_distributed(train_layouts, WORLD, str(tmp_path), timeout=600)
    assert len(reference["loss"]) == len(reference["grad_norm"]) == STEPS
    for name in LAYOUTS:  # FSDP=4, with accumulation, FSDP2 x TP2 (SP, loss parallel), CP2 x FSDP2
        _assert_matches(reference, [run[name] for run in ranks], name)
        _assert_same_saved_model(tmp_path / name / "model", tmp_path / "one" / "model")
    # save_steps=2: DCP-sharded checkpoints beside the Trainer's own files
    assert ranks[0]["fsdp4"]["saved"] == ["checkpoint-2", "checkpoint-4"]
    checkpoint = tmp_path / "fsdp4" / "checkpoint-2"
    assert {"fsdp_turbo_state", "scheduler.pt", "trainer_state.json", "rng_state_3.pth"} <= {
        p.name for p in checkpoint.iterdir()}
    assert not list(checkpoint.glob("*.safetensors"))  # the model is in the sharded state, with its optimizer
    # resumed at the same layout: steps 3 and 4 and the final model, bit-identical
    for run in ranks:
        resumed, whole = run["resumed"], run["fsdp4"]
        assert resumed["loss"] == whole["loss"] and resumed["grad_norm"] == whole["grad_norm"]
        # it trained steps 3 and 4 only, on their rows
        assert all(torch.equal(a, b) for a, b in zip(resumed["inputs"], whole["inputs"][2:], strict=True))
    _assert_same_saved_model(tmp_path / "resumed" / "model", tmp_path / "fsdp4" / "model", atol=0)
    # resumed at two data shards (FSDP2 x TP2) from the four-shard checkpoint: the one-process run's steps 3 and 4
    for run in ranks:
        torch.testing.assert_close(run["resumed_at_dp2"]["loss"], reference["loss"], rtol=1e-5, atol=0)
    _assert_same_saved_model(tmp_path / "resumed_at_dp2" / "model", tmp_path / "one" / "model")
    _assert_background_saves(ranks, tmp_path / "async")
    # a model that returns logits: its loss is core.lm_loss's, the global token mean as the script's own loss function
    for run in ranks:
        torch.testing.assert_close(run["logits_fsdp4"]["loss"], references["logits"]["loss"], rtol=1e-5, atol=0)
        for ours, theirs in zip(run["logits_fsdp4"]["grad_norm"], references["logits"]["grad_norm"], strict=True):
            assert math.isclose(ours, theirs, rel_tol=0, abs_tol=1e-4), (ours, theirs)


def _assert_background_saves(ranks, output):
    """fsdp4 with fsdp_turbo_async_save=True: the same steps, bit for bit. The save of checkpoint-4 failed on rank 1
    in the background (once every rank's shards were written); train() raised it on every rank with rank 1's message,
    and checkpoint-4 has no sharded state, only the partial folder. resume_from_checkpoint=True then passed over it:
    steps 3 and 4 from checkpoint-2 (written in the background) on fsdp4's rows, and fsdp4's final model, bit for
    bit; its own checkpoint-4 is complete."""
    for rank, run in enumerate(ranks):
        failed, resumed, whole = run["async"], run["async_resumed"], run["fsdp4"]
        assert failed["loss"] == whole["loss"] and failed["grad_norm"] == whole["grad_norm"]
        assert "injected: rank 1 could not finish writing its shards" in str(failed["error"])
        if rank != 1:  # the others' PeerFailure names what failed
            assert "the shards of checkpoint-4/fsdp_turbo_state: rank 1 failed" in str(failed["error"])
        assert resumed["error"] is None
        assert resumed["loss"] == whole["loss"] and resumed["grad_norm"] == whole["grad_norm"]
        assert all(torch.equal(a, b) for a, b in zip(resumed["inputs"], whole["inputs"][2:], strict=True))
    assert type(ranks[1]["async"]["error"]) is OSError  # the others raise PeerFailure, naming it
    left = ranks[0]["async"]["left_in_checkpoint_4"]
    assert "fsdp_turbo_state.partial" in left and "fsdp_turbo_state" not in left and "trainer_state.json" in left
    _assert_same_saved_model(output / "model", output.parent / "fsdp4" / "model", atol=0)
    for step in (2, 4):
        assert (output / f"checkpoint-{step}" / "fsdp_turbo_state" / "meta.json").is_file()
    assert not (output / "checkpoint-4" / "fsdp_turbo_state.partial").exists()


def _assert_matches(reference, ranks, name):
    for result in ranks:
        # the model was sharded once, by FSDPTurbo, and not wrapped again (no DDP, no second FSDP)
        assert result["wrapped_is_model"] and result["model_type"] == "FSDPLlamaForCausalLM", name
        assert result["dtensor_params"], name
        torch.testing.assert_close(result["loss"], reference["loss"], rtol=1e-5, atol=0, msg=name)
        for ours, theirs in zip(result["grad_norm"], reference["grad_norm"], strict=True):
            assert math.isclose(ours, theirs, rel_tol=0, abs_tol=1e-4), (name, ours, theirs)
    assert max(reference["grad_norm"]) > 1.0  # max_grad_norm=1.0 clipped: the clipped steps match too
    assert len(reference["eval_loss"]) == STEPS // 2  # evaluations at steps 2 and 4, on the sharded model too
    for result in ranks:
        torch.testing.assert_close(result["eval_loss"], reference["eval_loss"], rtol=1e-5, atol=0, msg=name)
    # each global step: the data shards' rows, in data-shard order, are the one-process step's rows; the ranks of
    # one data shard (CP and TP peers) saw the same rows
    dp_size = ranks[0]["dp"][1]
    shards = {dp: [r for r in ranks if r["dp"] == (dp, dp_size)] for dp in range(dp_size)}
    assert all(len(peers) == WORLD // dp_size for peers in shards.values()), name
    micro_batches = len(ranks[0]["inputs"]) // STEPS
    for step in range(STEPS):
        def rows(result, micro, step=step):
            return result["inputs"][step * micro_batches + micro]

        for peers in shards.values():
            assert all(torch.equal(rows(peer, m), rows(peers[0], m)) for peer in peers for m in range(micro_batches))
        # micro-batch by micro-batch, each in data-shard order (accelerate's order)
        step_rows = torch.cat([rows(shards[dp][0], m) for m in range(micro_batches) for dp in range(dp_size)])
        assert torch.equal(step_rows, reference["inputs"][step]), (name, step)


def _assert_same_saved_model(ours, theirs, atol=1e-5):
    """save_model's folder: the files the plain Trainer writes, loaded by from_pretrained to the same weights."""
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    mine, expected = (transformers.AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (ours, theirs))
    assert sorted(mine) == sorted(expected)
    for key, tensor in expected.items():
        torch.testing.assert_close(mine[key], tensor, rtol=0, atol=atol, msg=key)
    # it trained: the saved weights are not the initial ones
    initial = tiny_hf_causal_lm("llama").state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(mine["model.layers.0.self_attn.q_proj.weight"], initial, atol=1e-4)


@pytest.mark.parametrize("config", [{"fsdp_plan": {"param_dtype": "bfloat16"}}, {}], ids=["given", "adopted"])
def test_bf16_is_fsdp_plans_mixed_precision_without_accelerates_autocast(tmp_path, config):
    """bf16=True with fsdp_plan.param_dtype='bfloat16', or with param_dtype unset: then the Trainer's bf16 is
    adopted as that param_dtype (gradients reduced in float32), as TRL's default configs need."""
    result = run_reference(train_bf16_one_rank, str(tmp_path), config, timeout=300)
    assert result["mixed_precision"] == "no" and not result["autocast_wrapped"]
    assert result["param_dtype"] == torch.bfloat16
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


REFUSED_ARGUMENTS = {  # (TrainingArguments fields, FSDPTurbo config, the field named, part of the fix)
    "gradient_checkpointing beside recompute": ({"gradient_checkpointing": True}, {"recompute": True},
                                                "TrainingArguments.gradient_checkpointing",
                                                "keep the FSDPTurbo config's recompute=True"),
    # transformers sets gradient_checkpointing too, the field named first
    "activation_checkpointing beside recompute": ({"activation_checkpointing": True}, {"recompute": True},
                                                  "TrainingArguments.gradient_checkpointing", "recompute=True"),
    "torch_compile beside compile": ({"torch_compile": True}, {"compile": True}, "TrainingArguments.torch_compile",
                                     "keep the FSDPTurbo config's compile=True"),
    "fsdp": ({"fsdp": "full_shard"}, {}, "TrainingArguments.fsdp", "drop fsdp"),
    "bf16 beside param_dtype float32": ({"bf16": True}, {"fsdp_plan": {"param_dtype": "float32"}},
                                        "TrainingArguments.bf16", "fsdp_plan.param_dtype='bfloat16'"),
    "fp16": ({"fp16": True}, {}, "TrainingArguments.fp16", "use bf16=True"),
}


@pytest.mark.parametrize("case", list(REFUSED_ARGUMENTS))
def test_training_arguments_it_cannot_honour_are_refused(tmp_path, monkeypatch, case):
    arguments, config, field, fix = REFUSED_ARGUMENTS[case]
    # TrainingArguments(fsdp=...) writes this variable; set here, it is taken away again after the test
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    with pytest.raises(ConfigError) as error:
        _construct(tmp_path, config, **arguments)
    assert error.value.field.startswith(field), error.value
    assert fix in error.value.fix and "Fix: " in str(error.value)


@pytest.mark.parametrize("async_save, arguments, field, fix", [
    (True, {"save_total_limit": 1}, "save_total_limit", "set save_total_limit to 2 or more"),
    ("yes", {}, "fsdp_turbo_async_save", "pass True or False")], ids=["one checkpoint kept", "not a bool"])
def test_background_saves_that_could_leave_no_checkpoint_are_refused(tmp_path, async_save, arguments, field, fix):
    """With save_total_limit=1 the Trainer deletes the previous checkpoint as the next begins: while that one is
    written in the background, no complete checkpoint would exist."""
    trainer_cls = with_fsdp_turbo(transformers.Trainer)
    args = training_arguments(str(tmp_path), PER_RANK, save_strategy="steps", save_steps=2, **arguments)
    with pytest.raises(ConfigError) as error:
        trainer_cls(model=tiny_hf_causal_lm("llama"), args=args, train_dataset=token_dataset(),
                    fsdp_turbo_config={}, fsdp_turbo_async_save=async_save)
    assert error.value.field == field and fix in error.value.fix


def test_resume_from_the_last_complete_checkpoint_and_none_if_none_is(tmp_path):
    from fsdp_turbo.core.errors import CheckpointError
    from fsdp_turbo.integrations.transformers import last_complete_checkpoint

    for name, state in [("checkpoint-2", "fsdp_turbo_state"), ("checkpoint-10", "fsdp_turbo_state"),
                        ("checkpoint-12", "fsdp_turbo_state.partial"), ("checkpoint-x", "fsdp_turbo_state")]:
        (tmp_path / name / state).mkdir(parents=True)
        (tmp_path / name / state / ".metadata").write_bytes(b"")
    assert last_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-10"  # by step, not by name; 12 cut short
    with pytest.raises(CheckpointError, match="has no checkpoint-N folder whose fsdp_turbo_state/ is complete"):
        last_complete_checkpoint(tmp_path / "checkpoint-12")


def test_gradient_checkpointing_alone_becomes_fsdp_turbos_recompute(tmp_path):
    """TRL's configs turn gradient_checkpointing on by default: it is applied once, as the config's recompute."""
    trainer = _construct(tmp_path, {}, gradient_checkpointing=True)
    assert trainer.fsdp_turbo_config.recompute and not trainer.args.gradient_checkpointing
    assert not trainer.args.activation_checkpointing  # so the Trainer does not checkpoint the layers again
    assert not trainer.model.is_gradient_checkpointing


def test_parallelism_config_is_refused(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ConfigError, match=r"TrainingArguments.parallelism_config=.*Fix: drop parallelism_config"):
        _construct(tmp_path, parallelism_config=ParallelismConfig(dp_shard_size=1))


def test_a_pipeline_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2 is invalid: the Trainer calls the model's "
                                          r"forward.*Fix: train a pipelined model through"):
        _construct(tmp_path, config={"pipeline_parallel_size": 2})


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
                                              fsdp_turbo_config={"fsdp_plan": {"param_dtype": "float32"}})
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


@pytest.mark.parametrize(("variable", "value", "config", "expected"), [
    ("ACCELERATE_MIXED_PRECISION", "bf16", {"fsdp_plan": {"param_dtype": "float32"}},
     r"\$ACCELERATE_MIXED_PRECISION='bf16'.*Fix: set fsdp_plan.param_dtype"),
    ("ACCELERATE_USE_FSDP", "true", {}, r"\$ACCELERATE_USE_FSDP='true'.*Fix: launch with torchrun"),
])
def test_accelerate_launch_options_are_refused_too(tmp_path, monkeypatch, variable, value, config, expected):
    monkeypatch.setenv(variable, value)  # what `accelerate launch --mixed_precision bf16` / `--use_fsdp` set
    with pytest.raises(ConfigError, match=expected):
        _construct(tmp_path, config)


def test_an_eval_set_the_peers_would_trim_unevenly_is_refused():
    from fsdp_turbo.integrations.trainer_data import check_even_eval_batches

    # 2 data shards on 4 ranks (CP or TP peers), 4 rows a shard: 16 rows divide, 10 do not
    check_even_eval_batches(list(range(16)), 4, 2, 4)
    check_even_eval_batches(list(range(10)), 4, 4, 4)  # no peers: accelerate trims the last batch right
    with pytest.raises(ConfigError, match=r"eval_dataset='10 rows'.*Fix: evaluate a multiple of .* = 8 rows"):
        check_even_eval_batches(list(range(10)), 4, 2, 4)
