"""Supervised fine-tuning with TRL's SFTTrainer on FSDPTurbo: a plain TRL script, two lines added (marked).

    torchrun --nproc-per-node 4 examples/trl_sft.py      # or: nox -s demo_trl

A tiny Qwen3-MoE (random init, nothing downloaded) learns the shipped chat examples (examples/sft_tiny:
conversations and a byte-level BPE tokenizer made locally), packed padding-free into 128-token rows, on 4
CPU ranks as context parallel 2 x FSDP 2 with expert parallel 2: the combination TRL's roadmap for 30B MoE
long-context SFT names (huggingface/trl#5713). TRL's defaults stand: bf16 mixed precision (here through
FSDP2's ``param_dtype``) and gradient checkpointing (applied as FSDPTurbo's recompute, with a warning).
"""

import json
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl import SFTConfig, SFTTrainer

from fsdp_turbo.integrations.transformers import with_fsdp_turbo  # added: 1 of 2

DATA = Path(__file__).parent / "sft_tiny"
TURBO = {
    "fully_shard_parallel_size": 2,
    "context_parallel_size": 2,
    "expert_parallel_size": 2,
    "ep_plan": {"apply_modules": ["*mlp.experts"]},
    "fsdp_plan": {"param_dtype": "bfloat16"},  # TRL's bf16=True
}


def main() -> None:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(DATA / "tokenizer")
    with open(DATA / "train.jsonl", encoding="utf-8") as lines:
        dataset = Dataset.from_list([{"messages": json.loads(line)["messages"]} for line in lines])
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False))
    args = SFTConfig(output_dir="trl_sft_output", per_device_train_batch_size=4, max_steps=20, learning_rate=3e-3,
                     lr_scheduler_type="cosine", warmup_steps=2, logging_steps=5, packing=True, max_length=128,
                     use_cpu=True, report_to=[], save_strategy="no")
    trainer = with_fsdp_turbo(SFTTrainer)(  # added: 2 of 2 (the class, and fsdp_turbo_config below)
        model=model, args=args, train_dataset=dataset, processing_class=tokenizer, fsdp_turbo_config=TURBO)
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
