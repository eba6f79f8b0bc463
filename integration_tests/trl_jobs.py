"""Rank functions for TRL's ``SFTTrainer`` and ``DPOTrainer`` through ``with_fsdp_turbo`` (importable by spawned
ranks).

The same TRL script runs twice per case: in one process with a batch of ``PER_RANK * WORLD`` rows, and on
``WORLD`` ranks through ``with_fsdp_turbo`` with the rows of one data shard each. The data are the shipped chat
examples (examples/sft_tiny: conversations and a byte-level BPE tokenizer made locally), as conversations,
prompt-completion pairs and preference triples.
"""

from __future__ import annotations

import json
from pathlib import Path

from trainer_jobs import _as_a_plain_process

from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft_tiny"
WORLD, PER_RANK, STEPS = 4, 2, 3
VOCAB = 2048  # the example tokenizer's
# ChatML, as the example tokenizer's template, with the assistant turns marked for assistant_only_loss
CHAT_TEMPLATE_WITH_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def conversations(rows: int = 96) -> list[list[dict]]:
    with open(EXAMPLE / "train.jsonl", encoding="utf-8") as lines:
        return [json.loads(line)["messages"] for line, _ in zip(lines, range(rows), strict=False)]


def _turn(messages: list[dict], role: str) -> str:
    return next(m["content"] for m in messages if m["role"] == role)


def dataset(kind: str):
    from datasets import Dataset

    chats = conversations()
    if kind == "completion_only":  # prompt-completion pairs: TRL's completion_only_loss masks the prompt
        return Dataset.from_list([{"prompt": _turn(c, "user"), "completion": " " + _turn(c, "assistant")}
                                  for c in chats])
    if kind == "dpo":  # preference triples: the true answer, and another question's as the rejected one
        return Dataset.from_list([{"prompt": _turn(c, "user"), "chosen": " " + _turn(c, "assistant"),
                                   "rejected": " " + _turn(chats[i - 1], "assistant")} for i, c in enumerate(chats)])
    return Dataset.from_list([{"messages": c} for c in chats])


def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(EXAMPLE / "tokenizer")
    tok.chat_template = CHAT_TEMPLATE_WITH_GENERATION
    return tok


# Each case: the model, and the SFTConfig / DPOConfig fields beside the common ones.
CASES = {
    # packed conversations, padding-free (position_ids restart at each document), the MoE model
    "moe_packed": ("qwen3_moe", {"packing": True, "max_length": 64, "router_aux_loss_coef": 0.0}),
    "completion_only": ("llama", {"completion_only_loss": True, "max_length": 48}),
    "assistant_only": ("llama", {"assistant_only_loss": True, "max_length": 64}),
    "lora": ("llama", {"max_length": 48}),
    "dpo": ("llama", {"max_length": 48, "beta": 0.1}),
    # SFTConfig's default precision (bf16=True): the FSDPTurbo config leaves param_dtype unset, so it is adopted
    "moe_packed_bf16": ("qwen3_moe", {"packing": True, "max_length": 64, "router_aux_loss_coef": 0.0}),
}
TRL_DEFAULT_PRECISION = ("moe_packed_bf16",)


def run(output_dir: str, case: str, per_device: int, config: dict | None) -> dict:
    """``case`` for ``STEPS`` steps: the plain TRL trainer when ``config`` is None, else through ``with_fsdp_turbo``
    (in one process too, for the bf16 references). Returns the logged losses and grad norms, and what the trainer
    reported."""
    import torch.distributed as dist
    import trl

    if not dist.is_initialized():  # one process: python script.py has no launcher variables
        _as_a_plain_process()
    model_kind, fields = CASES[case]
    model = tiny_hf_causal_lm(model_kind, vocab_size=VOCAB)
    common = {"output_dir": output_dir, "per_device_train_batch_size": per_device, "max_steps": STEPS,
              "learning_rate": 1e-3, "logging_steps": 1, "seed": 0, "report_to": [], "max_grad_norm": 1.0,
              "use_cpu": True, "dataloader_num_workers": 0, "save_strategy": "no", "bf16": False}
    if case in TRL_DEFAULT_PRECISION:
        del common["bf16"]  # SFTConfig's own default: bf16=True
    extra = {}
    if case == "dpo":
        trainer_cls, args = trl.DPOTrainer, trl.DPOConfig(**common, **fields)
        extra["ref_model"] = tiny_hf_causal_lm(model_kind, vocab_size=VOCAB)
    else:
        trainer_cls, args = trl.SFTTrainer, trl.SFTConfig(**common, **fields)
    if case == "lora":
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                          lora_dropout=0.0)
    if config is not None:
        from fsdp_turbo.integrations.transformers import with_fsdp_turbo

        trainer_cls, extra["fsdp_turbo_config"] = with_fsdp_turbo(trainer_cls), config
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(case), processing_class=tokenizer(), **extra)
    trainer.train()
    if case == "lora":  # save_model of a PEFT model: its adapter, in PEFT's format
        trainer.save_model(f"{output_dir}/adapter")
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"loss": [entry["loss"] for entry in logs], "grad_norm": [entry["grad_norm"] for entry in logs],
            "logged": sorted({key for entry in logs for key in entry}),
            "param_dtype": str(trainer.fsdp_turbo_config.fsdp_plan.param_dtype) if config is not None else None,
            "trainable": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),  # global sizes
            "parameters": sum(p.numel() for p in trainer.model.parameters())}


FSDP4 = {"fully_shard_parallel_size": WORLD}
# The 4-rank runs: (case, rows a data shard, FSDPTurbo config)
LAYOUTS = {
    "moe_packed ep2 x fsdp4": ("moe_packed", PER_RANK, {**FSDP4, "expert_parallel_size": 2, "ep_plan": {}}),
    "moe_packed cp2 x fsdp2": ("moe_packed", PER_RANK * 2, {"fully_shard_parallel_size": 2,
                                                            "context_parallel_size": 2}),
    "completion_only fsdp4": ("completion_only", PER_RANK, FSDP4),
    "assistant_only fsdp4": ("assistant_only", PER_RANK, FSDP4),
    "lora fsdp4": ("lora", PER_RANK, FSDP4),
    "dpo fsdp4": ("dpo", PER_RANK, FSDP4),
    "moe_packed_bf16 fsdp4": ("moe_packed_bf16", PER_RANK, FSDP4),
    "moe_packed_bf16 ep2 x fsdp4": ("moe_packed_bf16", PER_RANK, {**FSDP4, "expert_parallel_size": 2, "ep_plan": {}}),
}


def one_process(output_dir: str) -> dict:
    """Each case's one-process run with the same global batch: the plain TRL script, in float32; the bf16 cases
    through ``with_fsdp_turbo`` in one process (the same precision: bf16 compute over float32 master weights,
    where the plain script would autocast instead)."""
    return {case: run(f"{output_dir}/{case}", case, PER_RANK * WORLD, {} if case in TRL_DEFAULT_PRECISION else None)
            for case in CASES}


def every_layout(output_dir: str) -> dict:
    return {name: run(f"{output_dir}/{name.replace(' ', '_')}", case, per_device, config)
            for name, (case, per_device, config) in LAYOUTS.items()}
