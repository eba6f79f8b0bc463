"""Numbers ``fsdp-turbo train`` reports, checked against independent counts: FLOPs per token
(``FlopCounterMode`` on dense models, an active-parameter count on MoE), the eval loss when a
micro-batch carries no loss, and ``metrics.jsonl`` after a crash mid-append. Single process."""

import json
import logging
import math
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.flop_counter import FlopCounterMode

from fsdp_turbo.cli.data import Batch
from fsdp_turbo.cli.data.loader import IGNORE, make_batch
from fsdp_turbo.cli.evaluation import evaluate
from fsdp_turbo.cli.flops import flops_per_token
from fsdp_turbo.cli.job_config import ModelSection
from fsdp_turbo.cli.metrics import METRICS, PLOT, MetricsLog, plot_loss, read_rows
from fsdp_turbo.cli.model import build_model
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm, to_expert_lists

pytest.importorskip("transformers")
DEMO = Path(__file__).resolve().parents[1] / "examples" / "qwen3_moe_tiny.yaml"
# The demo model's FLOPs per token before they counted active parameters: 6 x every parameter
# (all 8 experts, the embedding, the norms) + 12 L hidden seq_len.
OLD_DEMO_FLOPS_PER_TOKEN = 1_728_768


# ----- FLOPs per token ------------------------------------------------------------------------
DENSE = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),  # the head still a GEMM, once
    # MLA, every layer dense: query/key heads 16 deep (nope 8 + rope 8), values 8 wide.
    "deepseek_v3-mla": ("deepseek_v3", {"first_k_dense_replace": 2, "num_key_value_heads": 4, "v_head_dim": 8}),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_dense_flops_per_token_match_flop_counter(name):
    kind, overrides = DENSE[name]
    model = tiny_hf_causal_lm(kind, attn_implementation="eager", **overrides)
    batch, seq_len = 2, 64
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    counted = counter.get_total_flops() / (batch * seq_len)
    assert _flops(model, seq_len) == pytest.approx(counted, rel=0.05)


def _flops(model, seq_len: int) -> float:
    return flops_per_token(model, resolve_model_facts(model), seq_len)


def _active_weights(model) -> float:
    """Independently of ``flops.py``: parameters by name, of two or more dims (no norms, no
    biases), no embedding table, routed experts scaled by the share a token visits."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or \
        config.n_routed_experts
    share = config.num_experts_per_tok / experts
    total = 0.0
    for name, param in model.named_parameters():
        if param.dim() < 2 or "embed_tokens" in name:
            continue
        total += param.numel() * (share if ".mlp.experts." in name else 1.0)
    return total


def _attention(model, seq_len: int) -> float:
    config = model.config
    qk = getattr(config, "qk_head_dim", None) or config.head_dim
    v = getattr(config, "v_head_dim", None) or config.head_dim
    # Q K^T and the values, 2 FLOPs a multiply-add, forward + backward x3, the full matrix (as eager).
    return 3 * 2 * config.num_hidden_layers * config.num_attention_heads * (qk + v) * seq_len


def _demo_model():
    job = yaml.safe_load(DEMO.read_text())
    return build_model(ModelSection(**job["model"])), job["data"]["seq_len"]


def test_demo_model_flops_count_active_experts():
    model, seq_len = _demo_model()
    expected = 6 * _active_weights(model) + _attention(model, seq_len)
    got = _flops(model, seq_len)
    assert got == pytest.approx(expected, rel=1e-9)
    assert got < 0.5 * OLD_DEMO_FLOPS_PER_TOKEN


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_flops_count_active_experts(kind):
    # qwen2_moe: a shared expert and its gate, whole; deepseek_v3: a dense first layer, shared experts, MLA.
    model = tiny_hf_causal_lm(kind, device="meta")
    expected = 6 * _active_weights(model) + _attention(model, 64)
    assert _flops(model, 64) == pytest.approx(expected, rel=1e-9)


# Linear attention by hand, from the config: (value heads, key dim, value dim) of the state
LINEAR_STATE = {"qwen3_next": ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"),
                "kimi_linear": ("linear_num_heads", "linear_head_dim", "linear_head_dim")}


@pytest.mark.parametrize("kind", sorted(LINEAR_STATE))
def test_linear_attention_layers_count_their_recurrence_not_a_seq_len_square(kind):
    """Layer 0 is linear attention (Gated DeltaNet; KDA), layer 1 softmax (MLA for Kimi Linear). The
    linear layer's projections and convolution are weights; its recurrence is 3 multiply-adds of a
    d_k x d_v state per token and value head, x3 with the backward, whatever the sequence length.
    The softmax layer keeps the PaLM term."""
    model = tiny_hf_causal_lm(kind, device="meta")
    config = model.config
    assert config.layer_types == ["linear_attention", "full_attention"]
    heads, d_k, d_v = (getattr(config, name) for name in LINEAR_STATE[kind])
    qk = getattr(config, "qk_head_dim", None) or config.head_dim
    v = getattr(config, "v_head_dim", None) or config.head_dim
    for seq_len in (64, 4096):
        by_hand = (6 * _active_weights(model) + 3 * 2 * 3 * heads * d_k * d_v
                   + 3 * 2 * config.num_attention_heads * (qk + v) * seq_len)
        assert _flops(model, seq_len) == pytest.approx(by_hand, rel=1e-9)
    # counted as two softmax layers (as before), the 4096-token figure was 1.85x this (Kimi Linear: 1.87x)
    assert _flops(model, 4096) < 0.6 * (6 * _active_weights(model) + _attention(model, 4096))


def test_expert_lists_count_like_fused_experts():
    fused = tiny_hf_causal_lm("qwen3_moe", device="meta")
    listed = to_expert_lists(tiny_hf_causal_lm("qwen3_moe", device="meta"))
    assert _flops(listed, 64) == _flops(fused, 64)


# ----- eval loss with a micro-batch that carries no loss --------------------------------------
SEQ_LEN = 16


class HandMadeEvalSet:
    """Held-out micro-batches given row by row, through the loader's own ``make_batch``: what
    ``evaluate`` reads of an ``EvalSet`` (its ``batches``), without preparing files."""

    def __init__(self, documents: list[list[int]], labels: list[list[int]]) -> None:
        # As ``window_row`` gives a one-document window: its first label is ignored.
        self.rows = [(ids, [IGNORE, *targets[1:]], list(range(len(ids))), [1] * len(ids))
                     for ids, targets in zip(documents, labels, strict=True)]

    def batches(self, micro_batch: int, dp_rank: int, dp_size: int, count: int) -> list[Batch]:
        assert dp_size == 1 and len(self.rows) == micro_batch * count
        return [make_batch(self.rows[b * micro_batch:(b + 1) * micro_batch], packing=False) for b in range(count)]


def test_eval_micro_batch_without_loss_tokens_adds_nothing():
    model = tiny_hf_causal_lm("llama")
    generator = torch.Generator().manual_seed(0)
    documents = torch.randint(1, 256, (3, SEQ_LEN), generator=generator).tolist()
    labels = [documents[0], [IGNORE] * SEQ_LEN, documents[2]]  # the middle micro-batch carries no loss
    got = evaluate(model, HandMadeEvalSet(documents, labels), micro_batch=1, batches=3, dp_rank=0, dp_size=1,
                   device=torch.device("cpu"))
    # The reference: the two documents that carry loss in one batch, HF's mean over all their tokens.
    ids = torch.tensor([documents[0], documents[2]])
    targets = ids.clone()
    targets[:, 0] = IGNORE  # as the loader labels a document's first token
    with torch.no_grad():
        expected = float(model(input_ids=ids, labels=targets, use_cache=False).loss)
    assert math.isfinite(got["eval_loss"])
    assert got["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert got["eval_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)


def test_eval_without_any_loss_tokens_is_an_error():
    model = tiny_hf_causal_lm("llama")
    documents = [[5] * SEQ_LEN, [7] * SEQ_LEN]
    held_out = HandMadeEvalSet(documents, [[IGNORE] * SEQ_LEN] * 2)
    with pytest.raises(ConfigError, match=r"data.eval.batches=2 is invalid: the eval batches hold no loss tokens"):
        evaluate(model, held_out, micro_batch=1, batches=2, dp_rank=0, dp_size=1, device=torch.device("cpu"))


# ----- metrics.jsonl after a crash mid-append -------------------------------------------------
def _rows(steps) -> list[dict]:
    return [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3} for s in steps]


def _log_steps(output: Path, resumed_step: int, steps) -> None:
    log = MetricsLog(output, resumed_step)
    for row in _rows(steps):
        log.write(row)


def _tear(output: Path) -> None:
    """What a crash in the middle of an append leaves: a row's first bytes, no newline."""
    with (output / METRICS).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(_rows([9])[0])[:15])


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name.endswith(".metrics")]


def test_torn_last_line_is_skipped_with_one_warning(tmp_path, caplog):
    _log_steps(tmp_path, 0, [1, 2, 3])
    _tear(tmp_path)
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        assert read_rows(tmp_path / METRICS) == _rows([1, 2, 3])
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and f"{tmp_path / METRICS} line 4 is a row cut short by a crash" in warnings[0]


def test_resume_after_a_torn_line_starts_a_new_line(tmp_path, caplog):
    _log_steps(tmp_path, 0, [1, 2, 3])
    _tear(tmp_path)  # the crash; the last checkpoint was at step 2
    _log_steps(tmp_path, 2, [3, 4])
    lines = (tmp_path / METRICS).read_text().splitlines()
    assert lines[4] == json.dumps({"resumed_at_step": 2})  # on its own line, after the torn one
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        assert read_rows(tmp_path / METRICS) == _rows([1, 2, 3, 4])
    assert len(_warnings(caplog)) == 1 and "line 4" in _warnings(caplog)[0]


def test_marker_glued_to_a_torn_line_still_counts(tmp_path):
    # As MetricsLog wrote it before it ended a torn line first: rows 3 and 4 of the crashed
    # run must give way to the resumed run's.
    _log_steps(tmp_path, 0, [1, 2, 3, 4])
    _tear(tmp_path)
    with (tmp_path / METRICS).open("a", encoding="utf-8") as handle:
        handle.write(json.dumps({"resumed_at_step": 2}) + "\n")
        handle.writelines(json.dumps(row) + "\n" for row in [*_rows([3]), {"step": 4, "loss": 0.1, "lr": 1e-3}])
    steps = read_rows(tmp_path / METRICS)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[-1]["loss"] == 0.1


def test_unexplained_bad_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / METRICS
    path.write_text("\n".join([json.dumps(_rows([1])[0]), "not json", json.dumps(_rows([2])[0])]) + "\n")
    with pytest.raises(ConfigError, match=rf"repair or delete line 2 of {path}"):
        read_rows(path)


def test_plot_loss_after_torn_lines(tmp_path):
    _log_steps(tmp_path, 0, [1, 2, 3])
    _tear(tmp_path)
    _log_steps(tmp_path, 2, [3, 4, 5])
    _tear(tmp_path)
    png = plot_loss(tmp_path)
    assert png == tmp_path / PLOT
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
