"""Rank functions for transformers' ``Trainer`` through ``with_fsdp_turbo`` (importable by spawned ranks).

One script, two launches: the plain ``Trainer`` in one process with a batch of
``PER_RANK * WORLD`` rows, and ``with_fsdp_turbo(Trainer)`` on ``WORLD`` ranks with ``PER_RANK``
rows each. The rows' label masks differ in length, so the ranks hold different token counts and
only the global token mean (``num_items_in_batch``) gives the one-process loss.
"""

from __future__ import annotations

import os

import torch

from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

WORLD = 4
PER_RANK = 2
STEPS = 4
ROWS, SEQ_LEN, VOCAB = 64, 16, 256
FSDP4 = {"fully_shard_parallel_size": WORLD}


def token_dataset(rows: int = ROWS, *, masked: bool = True, seed: int = 1234):
    """Fixed-length rows of token ids; with ``masked``, each row's first ``i % 7`` labels are -100."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ_LEN), generator=generator)
    labels = ids.clone()
    for row in range(rows if masked else 0):
        labels[row, : row % 7] = -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def eval_dataset():
    # Unmasked rows: the Trainer's eval_loss is a mean of per-batch means, which equals the token mean (the same
    # at any batch size) only when every row has as many labels.
    return token_dataset(16, masked=False, seed=4321)


def training_arguments(output_dir: str, per_device: int, **overrides):
    from transformers import TrainingArguments

    fields = {"output_dir": output_dir, "per_device_train_batch_size": per_device, "max_steps": STEPS,
              "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "report_to": [], "max_grad_norm": 1.0,
              "use_cpu": True, "dataloader_num_workers": 0, "save_strategy": "no"}
    return TrainingArguments(**{**fields, **overrides})


def _as_a_plain_process() -> None:
    """Drop the launcher's variables that ``run_reference`` sets for its one rank: with ``LOCAL_RANK`` set, accelerate
    starts a one-rank gloo group on the default port 29500, which concurrent tests may hold. ``python script.py``
    has none of them."""
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(variable, None)


def _record_inputs(model) -> list[torch.Tensor]:
    """The input_ids of every forward, in order: which rows each step trained on."""
    seen: list[torch.Tensor] = []

    def record(module, _args, kwargs):
        if module.training:  # not the evaluations between steps
            seen.append(kwargs["input_ids"].clone())

    model.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def train(output_dir: str, per_device: int, config: dict | None, **overrides) -> dict:
    """Train the tiny Llama for ``STEPS`` steps: the plain Trainer when ``config`` is None, else through
    ``with_fsdp_turbo``. Returns the logged losses and grad norms, and the rows each step saw."""
    from transformers import Trainer

    if config is None:
        _as_a_plain_process()
    model = tiny_hf_causal_lm("llama")
    seen = _record_inputs(model)
    args = training_arguments(output_dir, per_device, per_device_eval_batch_size=per_device, eval_strategy="steps",
                              eval_steps=2, **overrides)
    data = {"train_dataset": token_dataset(), "eval_dataset": eval_dataset()}
    if config is None:
        trainer = Trainer(model=model, args=args, **data)
    else:
        from fsdp_turbo.integrations.transformers import with_fsdp_turbo

        trainer = with_fsdp_turbo(Trainer)(model=model, args=args, **data, fsdp_turbo_config=config)
    trainer.train()
    trainer.save_model(f"{output_dir}/model")
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "loss": [entry["loss"] for entry in logs],
        "grad_norm": [entry["grad_norm"] for entry in logs],
        "eval_loss": [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
        "inputs": seen,
        "wrapped_is_model": trainer.model_wrapped is trainer.model,
        "model_type": type(trainer.model_wrapped).__name__,
        "dtensor_params": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
        "dp": (trainer.model.parallel_state.dp_rank, trainer.model.parallel_state.dp_size)
        if config is not None else (0, 1),
    }


def train_fsdp4(output_dir: str) -> dict:
    """One launch, two runs at FSDP=4 with the same global batch: ``PER_RANK`` rows a rank, and one row a rank
    over two accumulated micro-batches; and the layout the Trainer cannot feed yet (CP peers share a batch)."""
    per_micro_batch = PER_RANK // 2
    return {"plain": train(f"{output_dir}/fsdp4", PER_RANK, FSDP4),
            "accumulated": train(f"{output_dir}/accumulated", per_micro_batch, FSDP4, gradient_accumulation_steps=2),
            "cp_refusal": _context_parallel_refusal(output_dir)}


def _context_parallel_refusal(output_dir: str) -> str | None:
    from transformers import Trainer

    from fsdp_turbo.core.errors import ConfigError
    from fsdp_turbo.integrations.transformers import with_fsdp_turbo

    model = tiny_hf_causal_lm("llama")
    try:
        with_fsdp_turbo(Trainer)(model=model, args=training_arguments(f"{output_dir}/cp", PER_RANK),
                                 train_dataset=token_dataset(),
                                 fsdp_turbo_config={"fully_shard_parallel_size": 2, "context_parallel_size": 2})
    except ConfigError as error:
        assert not hasattr(model, "parallel_state")  # refused before FSDPTurbo touched it
        return str(error)
    return None


def train_bf16_one_rank(output_dir: str) -> dict:
    """``bf16=True`` with ``fsdp_plan.param_dtype='bfloat16'`` on one rank: FSDP2 computes in bf16 and accelerate
    adds no autocast of its own (which would cast the model's outputs back to float32)."""
    from transformers import Trainer

    from fsdp_turbo.integrations.transformers import with_fsdp_turbo

    _as_a_plain_process()  # FSDPTurbo makes its own one-rank group (no port)
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
