"""Rank functions for transformers' ``Trainer`` through ``with_fsdp_turbo`` (importable by spawned ranks).

One script, two launches: the plain ``Trainer`` in one process with a batch of
``PER_RANK * WORLD`` rows, and ``with_fsdp_turbo(Trainer)`` on ``WORLD`` ranks with ``PER_RANK``
rows each. The rows' label masks differ in length, so the ranks hold different token counts and
only the global token mean (``num_items_in_batch``) gives the one-process loss.
"""

from __future__ import annotations

import os
from pathlib import Path

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


def train(output_dir: str, per_device: int, config: dict | None, *, resume: str | bool | None = None,
          trainer_cls: type | None = None, async_save: bool = False, expected_errors: tuple = (), **overrides) -> dict:
    """Train the tiny Llama for ``STEPS`` steps: the plain Trainer when ``config`` is None, else through
    ``with_fsdp_turbo`` (``trainer_cls``: a subclass of its class); from ``resume`` (a checkpoint-N folder, or True)
    when given. Returns the logged losses and grad norms, and the rows each step saw; if ``train`` raises one of
    ``expected_errors``, that error (and no saved model)."""
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

        trainer_cls = trainer_cls or with_fsdp_turbo(Trainer)
        trainer = trainer_cls(model=model, args=args, **data, fsdp_turbo_config=config,
                              fsdp_turbo_async_save=async_save)
    error = None
    try:
        trainer.train(resume_from_checkpoint=resume)
    except expected_errors as raised:  # the test asserts which
        error = raised
    if error is None:
        trainer.save_model(f"{output_dir}/model")
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    state = trainer.model.parallel_state if config is not None else None
    return {
        "loss": [entry["loss"] for entry in logs],
        "grad_norm": [entry["grad_norm"] for entry in logs],
        "eval_loss": [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry],
        "inputs": seen,
        "wrapped_is_model": trainer.model_wrapped is trainer.model,
        "model_type": type(trainer.model_wrapped).__name__,
        "dtensor_params": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
        "dp": (state.dp_rank, state.dp_size) if state is not None else (0, 1),
        "saved": sorted(path.name for path in Path(output_dir).glob("checkpoint-*")),
        "error": error,
    }


def _fail_on_rank_1() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise OSError("injected: rank 1 could not finish writing its shards")


def _failing_at_checkpoint_4():
    """``with_fsdp_turbo(Trainer)`` whose background save of checkpoint-4 fails on rank 1 once every rank's shards
    are written (as a full disk or a lost file system would), while training goes on."""
    from transformers import Trainer

    from fsdp_turbo.checkpoint import TrainingCheckpointer
    from fsdp_turbo.integrations.transformers import with_fsdp_turbo

    class FailingSaves(TrainingCheckpointer):
        def save(self, folder, *args, **kwargs):
            if Path(folder).parent.name == "checkpoint-4":
                kwargs["before_complete"] = _fail_on_rank_1
            super().save(folder, *args, **kwargs)

    class FailingTrainer(with_fsdp_turbo(Trainer)):
        def fsdp_turbo_checkpointer(self):
            if self._checkpointer is None:
                self._checkpointer = FailingSaves(async_save=True)
            return self._checkpointer

    return FailingTrainer


class TinyLogitsLM(torch.nn.Module):
    """A model that is not HF's: its forward takes ``tokens`` and returns logits (no labels, no loss)."""

    def __init__(self, hidden: int = 32, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
            torch.nn.Linear(2 * hidden, hidden)) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return self.head(hidden)


LOGITS_FACTS = {"model_facts": {"blocks": ["layers.*"], "head_module": "head", "token_input": "tokens"}}


def logits_dataset():
    """``token_dataset`` as the logits model names it, every row's first label ignored (the one-process script
    counts its labels unshifted; then both counts agree)."""
    rows = token_dataset().rename_column("input_ids", "tokens")
    return rows.map(lambda row: {"labels": [-100, *row["labels"][1:]]})


def shifted_cross_entropy(logits, labels, num_items_in_batch=None):
    """The one-process script's own loss for the logits model (``Trainer(compute_loss_func=...)``)."""
    import torch.nn.functional as F  # noqa: N812 - the torch idiom

    targets = labels[:, 1:].flatten()
    total = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets, ignore_index=-100, reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum())


def train_logits(output_dir: str, per_device: int, config: dict | None) -> dict:
    """The logits model for ``STEPS`` steps: in one process with its own loss function, else through
    ``with_fsdp_turbo``, which computes the loss with ``core.lm_loss``."""
    from transformers import Trainer

    if config is None:
        _as_a_plain_process()
    args = training_arguments(output_dir, per_device, label_names=["labels"])
    data = {"model": TinyLogitsLM(), "args": args, "train_dataset": logits_dataset()}
    if config is None:
        trainer = Trainer(**data, compute_loss_func=shifted_cross_entropy)
    else:
        from fsdp_turbo.integrations.transformers import with_fsdp_turbo

        trainer = with_fsdp_turbo(Trainer)(**data, fsdp_turbo_config={**config, **LOGITS_FACTS})
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"loss": [entry["loss"] for entry in logs], "grad_norm": [entry["grad_norm"] for entry in logs]}


def one_process(output_dir: str) -> dict:
    """The one-process references: the tiny Llama's Trainer script and the logits model's."""
    return {"llama": train(f"{output_dir}/one", PER_RANK * WORLD, None),
            "logits": train_logits(f"{output_dir}/one_logits", PER_RANK * WORLD, None)}


# The layouts of one launch, each with the one-process Trainer's global batch of PER_RANK x WORLD rows.
DP2 = PER_RANK * WORLD // 2  # rows a data shard at two data shards
LAYOUTS = {
    "fsdp4": (PER_RANK, FSDP4, {"save_strategy": "steps", "save_steps": 2}),
    # one row a rank over two accumulated micro-batches
    "accumulated": (PER_RANK // 2, FSDP4, {"gradient_accumulation_steps": 2}),
    # TP peers share a batch: two data shards of DP2 rows
    "fsdp2_tp2": (DP2, {"fully_shard_parallel_size": 2, "tensor_parallel_size": 2, "tp_plan": {
        "colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj", "lm_head"],
        "rowwise_parallel": ["*.o_proj", "*.down_proj"],
        "sequence_parallel": ["*layernorm", "model.norm"], "loss_parallel": True}}, {}),
    # CP peers share a batch too, each computing its half of every sequence; the loss in chunks (no logits built)
    "cp2_fsdp2": (DP2, {"fully_shard_parallel_size": 2, "context_parallel_size": 2, "chunk_loss": True}, {}),
}


def train_layouts(output_dir: str) -> dict:
    """One launch: the Trainer at each layout of ``LAYOUTS``; then, from fsdp4's checkpoint-2, a resume at the
    same layout and one at two data shards (FSDP2 x TP2); the logits model; fsdp4 with its checkpoints written in
    the background, where the save of checkpoint-4 fails, then resumed with ``resume_from_checkpoint=True``."""
    runs = {name: train(f"{output_dir}/{name}", per_device, config, **overrides)
            for name, (per_device, config, overrides) in LAYOUTS.items()}
    checkpoint = f"{output_dir}/fsdp4/checkpoint-2"
    runs["resumed"] = train(f"{output_dir}/resumed", PER_RANK, FSDP4, resume=checkpoint)
    per_device, config, _ = LAYOUTS["fsdp2_tp2"]
    runs["resumed_at_dp2"] = train(f"{output_dir}/resumed_at_dp2", per_device, config, resume=checkpoint)
    runs["logits_fsdp4"] = train_logits(f"{output_dir}/logits_fsdp4", PER_RANK, FSDP4)
    # fsdp4's checkpoints written in the background, the last one failing; then resume_from_checkpoint=True
    saves = LAYOUTS["fsdp4"][2]
    from fsdp_turbo.core.agreement import PeerFailure

    runs["async"] = train(f"{output_dir}/async", PER_RANK, FSDP4, async_save=True,
                          trainer_cls=_failing_at_checkpoint_4(), expected_errors=(OSError, PeerFailure), **saves)
    runs["async"]["left_in_checkpoint_4"] = sorted(p.name for p in Path(f"{output_dir}/async/checkpoint-4").iterdir())
    runs["async_resumed"] = train(f"{output_dir}/async", PER_RANK, FSDP4, resume=True, async_save=True, **saves)
    return runs


def train_bf16_one_rank(output_dir: str, config: dict) -> dict:
    """``bf16=True`` with the FSDPTurbo ``config`` (``fsdp_plan.param_dtype='bfloat16'``, or unset: adopted) on one
    rank: FSDP2 computes in bf16 and accelerate adds no autocast of its own (which would cast the model's outputs
    back to float32)."""
    from transformers import Trainer

    from fsdp_turbo.integrations.transformers import with_fsdp_turbo

    _as_a_plain_process()  # FSDPTurbo makes its own one-rank group (no port)
    model = tiny_hf_causal_lm("llama")
    output_dtypes: list[torch.dtype] = []
    model.register_forward_hook(lambda _module, _args, output: output_dtypes.append(output.logits.dtype))
    trainer = with_fsdp_turbo(Trainer)(model=model, args=training_arguments(output_dir, PER_RANK, bf16=True,
                                                                            max_steps=2),
                                       train_dataset=token_dataset(),
                                       fsdp_turbo_config=config)
    trainer.train()
    return {"output_dtypes": output_dtypes, "mixed_precision": trainer.accelerator.mixed_precision,
            "param_dtype": trainer.fsdp_turbo_config.fsdp_plan.param_dtype,
            "autocast_wrapped": hasattr(trainer.model, "_original_forward"),
            "master_dtypes": {p.dtype for p in trainer.model.parameters()},
            "loss": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}
