"""What the LLaMA-Factory peer test runs: a tiny random-init Qwen3-MoE saved with ``save_pretrained``
beside the repo's sft_tiny tokenizer, a small chat data file in the client's own v1 format, one
SFT config per run, the real ``torchrun`` launch of ``lf_launch.py``, and the readers of what the
client wrote (its ``trainer_log.jsonl``, its printed step lines, its saved safetensors).

Everything is built locally; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).resolve().with_name("lf_launch.py")
TOKENIZER = ROOT / "examples" / "sft_tiny" / "tokenizer"
CHAT_DATA = ROOT / "examples" / "sft_tiny" / "train.jsonl"

NUM_EXPERTS = 4
NUM_LAYERS = 2
SEED = 42
STEPS = 3
# One global batch of 8 samples: 2 micro batches a rank on 4 ranks, 4 on 2 ranks.
GLOBAL_BATCH = 8
EXPERT_PATTERN = "model.layers.{*}.mlp.experts"
EFSDP_PATTERN = "model.layers.{*}.mlp"


def tiny_qwen3_moe_config(vocab_size: int):
    """Experts wide enough and an init wide enough (std 0.1, not 0.02) that the experts carry about
    a seventh of the squared gradient norm (0.07% at the defaults): the client prints one norm for
    the whole model, and AdamW's steps hardly move with a gradient's scale, so that norm is what
    shows whether the experts' gradients were divided right."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=NUM_EXPERTS, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1,
    )


def write_model(model_dir: Path) -> Path:
    """A random-init tiny Qwen3-MoE (float32) and the repo's tokenizer, in one folder the client
    loads with ``AutoProcessor`` / ``AutoModelForCausalLM.from_pretrained``."""
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_qwen3_moe_config(len(tokenizer)))
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def _text(value: str) -> list[dict[str, str]]:
    return [{"type": "text", "value": value}]


def write_dataset(path: Path, rows: int = 16) -> Path:
    """The first ``rows`` conversations of the repo's sft_tiny chat data, in the client's own v1
    sample format (content blocks, a loss weight per message: only the answers are trained)."""
    with CHAT_DATA.open() as source, path.open("w") as out:
        for line, _ in zip(source, range(rows)):
            messages = [{"role": m["role"], "content": _text(m["content"]),
                         "loss_weight": 1.0 if m["role"] == "assistant" else 0.0}
                        for m in json.loads(line)["messages"]]
            out.write(json.dumps({"messages": messages}) + "\n")
    return path


def fsdpturbo(ep_size: int) -> dict:
    return {"name": "fsdpturbo", "ep_size": ep_size, "ep_dispatcher": "eager"}


FSDP2 = {"name": "fsdp2"}


def write_config(path: Path, *, model_dir: Path, dataset: Path, output_dir: Path, dist_config: dict) -> Path:
    """One v1 SFT config: float32 (``bf16: false``) so that two backends can agree to the last digits,
    no activation checkpointing, the client's AdamW at 3e-4. AdamW moves each weight by about the
    learning rate a step, whatever the gradient's size, and turns the backends' last-bit gradient
    differences into weight differences of about 2e-3 of that move (measured: 5.5e-6 at 1e-3, the
    embedding's rows): 3e-4 moves every weight about 9e-4 and keeps the differences ~6x below 1e-5."""
    config = {
        "model": str(model_dir), "train_dataset": str(dataset), "output_dir": str(output_dir),
        "dist_config": dist_config, "bf16": False, "enable_activation_checkpointing": False,
        "micro_batch_size": 1, "global_batch_size": GLOBAL_BATCH, "cutoff_len": 96, "batching_workers": 0,
        "learning_rate": 3e-4, "max_steps": STEPS, "max_grad_norm": 1.0, "seed": SEED, "logging_steps": 1,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Launch:
    """What one torchrun launch left: the client's output, its output folder and, with ``--probe``,
    each rank's record of the probe (``lf_launch.py``)."""

    stdout: str
    output_dir: Path
    probe: list[dict] | None


def launch(config: Path, nproc: int, *, timeout: float, probe: Path | None = None) -> Launch:
    """``torchrun --nproc-per-node nproc lf_launch.py config`` on gloo/CPU; its output on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(LAUNCHER), str(config)]
    if probe is not None:
        cmd += ["--probe", str(probe)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # its own session, so that a launch past its time is ended with its workers, not only torchrun
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} ran past {timeout} s:\n{stdout[-6000:]}\n{stderr[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stdout[-6000:]}\n{stderr[-6000:]}")
    output_dir = Path(yaml.safe_load(config.read_text())["output_dir"])
    probed = json.loads(probe.read_text()) if probe is not None else None
    return Launch(stdout + stderr, output_dir, probed)


def logged_steps(output_dir: Path) -> list[dict]:
    """The client's per-step log (``trainer_log.jsonl``: its LoggingCallback, full float digits)."""
    lines = (output_dir / "trainer_log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


_PRINTED = re.compile(r"step: (\d+), loss: ([0-9.]+), grad_norm: ([0-9.]+)")


def printed_steps(stdout: str) -> list[tuple[int, str, str]]:
    """The step lines the client printed on rank 0 (``loss: %.4f, grad_norm: %.4f``), as printed."""
    return [(int(step), loss, norm) for step, loss, norm in _PRINTED.findall(stdout)]


def client_log_values(stdout: str, label: str) -> list[str]:
    """Every value the client logged after ``label: `` (e.g. its EP gradient divide factor)."""
    return re.findall(rf"{re.escape(label)}: (\S+)", stdout)


def saved_weights(output_dir: Path) -> dict[str, torch.Tensor]:
    """The weights the client saved (``save_pretrained``, one or more safetensors files)."""
    weights = {}
    for file in sorted(output_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights
