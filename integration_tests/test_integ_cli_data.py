"""``fsdp-turbo train`` on real data: a local HF tokenizer, an SFT chat source mixed with a
text source by weight, packing, a held-out eval set and TensorBoard, on 2 and 4 CPU ranks
(torchrun). An uninterrupted run is the reference; a killed worker must recover to the
same bits, and a 4-rank checkpoint must go on at 2 ranks from exactly where it stopped."""

import json
from pathlib import Path

import pytest
import yaml
from test_integ_cli import TIMING, assert_same_weights, checkpoint, fsdp_turbo, metrics, train, weights

pytest.importorskip("datasets")
# one worker runs the whole module, so its module fixtures (launched runs) are built once
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_cli_data")]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft_tiny"
MICRO_BATCH = 2


def _job(text_source: Path) -> dict:
    return {
        "model": {"config": {"model_type": "llama", "vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 128, "tie_word_embeddings": False}},
        "data": {"tokenizer": str(EXAMPLE / "tokenizer"), "seq_len": 64,
                 "sources": [{"path": str(EXAMPLE / "train.jsonl"), "messages_field": "messages", "weight": 3},
                             {"path": str(text_source), "text_field": "body", "weight": 1}],
                 "eval": {"sources": [{"path": str(EXAMPLE / "valid.jsonl"), "messages_field": "messages"}],
                          "every": 2, "batches": 1}},
        # the reference run draws the loss plot (checked); the runs compared with it need none
        "logging": {"tensorboard": True, "plot": False},
        "optimizer": {"lr": 0.003, "warmup_steps": 2},
        "run": {"steps": 6, "micro_batch": MICRO_BATCH, "seed": 0},
        "checkpoint": {"save_every": 2, "keep": 3},
        "turbo": {"chunk_loss": True, "chunk_loss_plan": {"chunk_size": 32}},
    }


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("data_job")
    text = root / "notes.jsonl"
    text.write_text("".join(json.dumps({"body": f"note {i}: " + "the quick brown fox " * (i % 7 + 1)}) + "\n"
                            for i in range(300)))
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(_job(text)))
    return path


@pytest.fixture(scope="module")
def reference(job_file, tmp_path_factory):
    job = yaml.safe_load(job_file.read_text())
    job["logging"]["plot"] = True
    plotted = job_file.with_name("plotted.yaml")
    plotted.write_text(yaml.safe_dump(job))
    output = tmp_path_factory.mktemp("data_reference")
    train(plotted, output)
    return output


def test_eval_rows_the_plot_and_tensorboard(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = metrics(reference)
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4, 6]
    evaluated = [r for r in rows if "eval_loss" in r]
    assert all(abs(r["eval_perplexity"] - 2.718281828 ** r["eval_loss"]) < 1e-6 * r["eval_perplexity"]
               for r in evaluated)
    assert evaluated[-1]["eval_loss"] < evaluated[0]["eval_loss"]
    assert (reference / "loss.png").is_file()
    events = EventAccumulator(str(reference / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/peak_memory_mib",
            "eval/loss", "eval/perplexity"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 7))
    assert [e.value for e in events.Scalars("eval/loss")] == pytest.approx([r["eval_loss"] for r in evaluated])


def test_kill_9_recovers_bit_identically_with_mixed_sources(job_file, reference, tmp_path):
    result = train(job_file, tmp_path, 2, "--max-restarts", 1, env={"FSDP_TURBO_FAULTS": "kill@5:1"})
    assert "exitcode: -9" in result.stderr and "step-4 at step 4" in result.stderr
    assert_same_weights(weights(tmp_path), weights(reference))
    assert metrics(tmp_path) == [{**row, **{k: r[k] for k in TIMING}}
                                 for row, r in zip(metrics(reference), metrics(tmp_path), strict=True)]


def test_a_four_rank_checkpoint_goes_on_at_two_ranks_from_the_next_window(job_file, tmp_path):
    four, two = tmp_path / "four", tmp_path / "two"
    train(job_file, four, 4, "--max-steps", 3)
    meta = json.loads((checkpoint(four, 3) / "meta.json").read_text())
    assert meta["data"]["consumed"] == 3 * MICRO_BATCH * 4
    (two / "checkpoints").mkdir(parents=True)
    train(job_file, two, 2, "--resume", checkpoint(four, 3))
    meta = json.loads((checkpoint(two, 6) / "meta.json").read_text())
    assert meta["data"]["consumed"] == 3 * MICRO_BATCH * 4 + 3 * MICRO_BATCH * 2
    assert [r["step"] for r in metrics(two)] == [4, 5, 6]


def test_a_bad_source_fails_before_launch_naming_the_line(job_file, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"body": "fine"}\n{"body": \n')
    job = yaml.safe_load(job_file.read_text())
    job["data"]["sources"][1]["path"] = str(broken)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = fsdp_turbo("train", path, "--nproc-per-node", 2, "--output-dir", tmp_path / "out", check=False)
    assert result.returncode == 2 and f"{broken}:2" in result.stderr and "data.sources[1].path" in result.stderr
    assert "torch.distributed" not in result.stderr  # nothing was launched


def test_fsdp_turbo_data_shows_the_first_sequences_and_statistics(job_file, tmp_path):
    out = fsdp_turbo("data", job_file, "--show", 3, "--output-dir", tmp_path).stdout
    assert "train data.sources[0]:" in out and "train data.sources[1]:" in out and "eval data.eval.sources[0]" in out
    assert "623 documents" in out and "padding" in out and "truncated" in out
    assert out.count("--- sequence") == 3
    assert "⟦" in out and "<|im_start|>assistant\n⟦" in out  # SFT: the answer carries loss, the prompt not
    assert (tmp_path / "data_cache").is_dir()  # the cache train will use
