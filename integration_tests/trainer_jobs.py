"""Rank functions for transformers' ``Trainer`` through ``with_fsdp_turbo`` (importable by spawned ranks).

One script, two launches: the plain ``Trainer`` in one process with a batch of
``PER_RANK * WORLD`` rows, and ``with_fsdp_turbo(Trainer)`` on ``WORLD`` ranks with ``PER_RANK``
rows each. The rows' label masks differ in length, so the ranks hold different token counts and
only the global token mean (``num_items_in_batch``) gives the one-process loss.
"""

from __future__ import annotations

import torch

from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

WORLD = 4
PER_RANK = 2
STEPS = 4
ROWS, SEQ_LEN, VOCAB = 64, 16, 256
FSDP4 = {"fully_shard_parallel_size": WORLD}


def token_dataset():
    """Fixed-length rows of token ids; each row's first ``i % 7`` labels are masked (-100)."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ_LEN), generator=generator)
    labels = ids.clone()
    for row in range(ROWS):
        labels[row, : row % 7] = -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def training_arguments(output_dir: str, per_device: int, **overrides):
    from transformers import TrainingArguments

    fields = {"output_dir": output_dir, "per_device_train_batch_size": per_device, "max_steps": STEPS,
              "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "report_to": [], "max_grad_norm": 1.0,
              "use_cpu": True, "dataloader_num_workers": 0, "save_strategy": "no"}
    return TrainingArguments(**{**fields, **overrides})


def _record_inputs(model) -> list[torch.Tensor]:
    """The input_ids of every forward, in order: which rows each step trained on."""
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda _module, _args, kwargs: seen.append(kwargs["input_ids"].clone()),
                                    with_kwargs=True)
    return seen


def train(output_dir: str, per_device: int, config: dict | None) -> dict:
    """Train the tiny Llama for ``STEPS`` steps: the plain Trainer when ``config`` is None, else through
    ``with_fsdp_turbo``. Returns the logged losses and grad norms, and the rows each step saw."""
    from transformers import Trainer

    model = tiny_hf_causal_lm("llama")
    seen = _record_inputs(model)
    if config is None:
        trainer = Trainer(model=model, args=training_arguments(output_dir, per_device), train_dataset=token_dataset())
    else:
        from fsdp_turbo.integrations.transformers import with_fsdp_turbo

        trainer = with_fsdp_turbo(Trainer)(model=model, args=training_arguments(output_dir, per_device),
                                           train_dataset=token_dataset(), fsdp_turbo_config=config)
    trainer.train()
    trainer.save_model(f"{output_dir}/model")
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "loss": [entry["loss"] for entry in logs],
        "grad_norm": [entry["grad_norm"] for entry in logs],
        "inputs": seen,
        "wrapped_is_model": trainer.model_wrapped is trainer.model,
        "model_type": type(trainer.model_wrapped).__name__,
        "dtensor_params": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
        "dp": (trainer.model.parallel_state.dp_rank, trainer.model.parallel_state.dp_size)
        if config is not None else (0, 1),
    }


def train_bf16_one_rank(output_dir: str) -> dict:
    """``bf16=True`` with ``fsdp_plan.param_dtype='bfloat16'`` on one rank: FSDP2 computes in bf16 and accelerate
    adds no autocast of its own (which would cast the model's outputs back to float32)."""
    from transformers import Trainer

    from fsdp_turbo.integrations.transformers import with_fsdp_turbo

    model = tiny_hf_causal_lm("llama")
    output_dtypes: list[torch.dtype] = []
    model.register_forward_hook(lambda _module, _args, output: output_dtypes.append(output.logits.dtype))
    trainer = with_fsdp_turbo(Trainer)(model=model, args=training_arguments(output_dir, PER_RANK, bf16=True,
                                                                            max_steps=2),
                                       train_dataset=token_dataset(),
                                       fsdp_turbo_config={"fsdp_plan": {"param_dtype": "bfloat16"}})
    trainer.train()
    return {"output_dtypes": output_dtypes, "mixed_precision": trainer.accelerator.mixed_precision,
            "autocast_wrapped": hasattr(trainer.model, "_original_forward"),
            "master_dtypes": {p.dtype for p in trainer.model.parameters()},
            "loss": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}
