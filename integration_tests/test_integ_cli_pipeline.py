"""Pipeline parallel through ``fsdp-turbo train``: every layout of issue 47 on 4 CPU ranks
against the one-process run of the same job (3 AdamW steps of a tiny Llama of 8 layers, or
Qwen3-MoE of 4; global batch 8 rows). Each step's loss (rtol 2e-5) and gradient norm
(rtol 1e-4), the evaluation loss where the data shards match the reference's, the MoE
telemetry, the FLOPs per token behind tokens/s and MFU, and the exported model in
transformers' layout (atol 2e-5) all match; a checkpoint of one pipeline resumes at another
PP size and without a pipeline, and repeats the uninterrupted run."""

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("integ_cli_pipeline")]

from test_integ_cli import checkpoint, train  # noqa: E402 - after the skips, as that module's own

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 64, "tie_word_embeddings": False}
QWEN3_MOE = {**LLAMA, "model_type": "qwen3_moe", "num_hidden_layers": 4, "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2}
TP_SP = {"colwise_parallel": ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj"],
         "rowwise_parallel": ["*.o_proj", "*.down_proj"], "sequence_parallel": ["*layernorm", "model.norm"]}
PP2_FSDP2 = {"pipeline_parallel_size": 2, "fully_shard_parallel_size": 2}
# name: (the turbo section, the model, evaluated: the layout has one data shard, as the reference)
LAYOUTS = {
    "PP=2 x FSDP=2 1f1b": (PP2_FSDP2, LLAMA, False),
    "PP=2 x TP=2 with SP, gpipe": ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2,
                                    "pipeline_schedule": "gpipe", "tp_plan": TP_SP}, LLAMA, True),
    "PP=2 x FSDP=2 interleaved 1f1b": ({**PP2_FSDP2, "pipeline_schedule": "interleaved_1f1b"}, LLAMA, False),
    "PP=4 zbv": ({"pipeline_parallel_size": 4, "pipeline_schedule": "zbv"}, LLAMA, False),
    "PP=2 x EP=2 on Qwen3-MoE": ({"pipeline_parallel_size": 2, "expert_parallel_size": 2,
                                  "ep_plan": {"apply_modules": ["*mlp.experts"]}}, QWEN3_MOE, False),
    "PP=2 x CP=2": ({"pipeline_parallel_size": 2, "context_parallel_size": 2}, LLAMA, True),
}
TIMED = ("tokens_per_s", "tflops_per_rank")


def _eval_file(folder: Path) -> str:
    path = folder / "eval.jsonl"
    words = ["pipelines", "send", "hidden", "states", "between", "their", "stages", "while", "the", "schedule",
             "keeps", "every", "rank", "busy"]
    path.write_text("".join(json.dumps({"text": " ".join(words[i % 7:i % 7 + 4 + i % 9])}) + "\n" for i in range(32)))
    return str(path)


def _job(folder: Path, turbo: dict, model: dict, evaluated: bool, **sections) -> Path:
    data = {"files": ["stdlib:*.py"], "seq_len": 32, "max_bytes": 200_000, "cache_dir": str(folder.parent / "cache")}
    if evaluated:
        data["eval"] = {"sources": [{"path": _eval_file(folder), "text_field": "text"}], "every": 1, "batches": 2}
    job = {"model": {"config": model}, "data": data, "optimizer": {"lr": 0.003, "warmup_steps": 1},
           "run": {"steps": 3, "micro_batch": 2, "global_batch": 8, "seed": 0}, "logging": {"plot": False},
           "turbo": turbo, **sections}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _rows(output: Path) -> list[dict]:
    from fsdp_turbo.cli.metrics import read_rows

    return read_rows(output / "metrics.jsonl")


def _weights(output: Path) -> dict:
    return safetensors.load_file(str(output / "final" / "model.safetensors"))


def _assert_same_run(got: Path, expected: Path, *, evaluated: bool = False, steps=(1, 2, 3)) -> None:
    import torch

    rows, reference = _rows(got), [row for row in _rows(expected) if row["step"] in steps]
    assert [row["step"] for row in rows] == list(steps)
    for row, ref in zip(rows, reference, strict=True):
        assert row["loss"] == pytest.approx(ref["loss"], rel=2e-5), row["step"]
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), row["step"]
        if evaluated:
            assert row["eval_loss"] == pytest.approx(ref["eval_loss"], rel=2e-5), row["step"]
        for key in (k for k in ref if k.startswith("moe/") and k.endswith("/load")):
            assert row[key] == pytest.approx(ref[key], abs=1e-6), key
        # the FLOPs each token costs (behind tokens/s and MFU) are the whole model's, at any layout
        flops = [r["tflops_per_rank"] * r["world_size"] / r["tokens_per_s"] for r in (row, ref)]
        assert flops[0] == pytest.approx(flops[1], rel=1e-9)
    weights, expected_weights = _weights(got), _weights(expected)
    assert weights.keys() == expected_weights.keys()
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=2e-5, msg=name)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    """The one-process runs: Llama (saving at step 2, evaluated) and Qwen3-MoE."""
    runs = {}
    for name, model in (("llama", LLAMA), ("qwen3_moe", QWEN3_MOE)):
        folder = tmp_path_factory.mktemp(f"reference-{name}")
        job = _job(folder, {}, model, name == "llama", checkpoint={"save_every": 2})
        train(job, folder / "out", 1)
        runs[name] = folder / "out"
    return runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_pipeline_layout_trains_as_one_process(layout, references, tmp_path_factory):
    turbo, model, evaluated = LAYOUTS[layout]
    folder = tmp_path_factory.mktemp("layout")
    train(_job(folder, turbo, model, evaluated, checkpoint={"save_every": 2}), folder / "out", 4)
    reference = references["qwen3_moe" if model is QWEN3_MOE else "llama"]
    _assert_same_run(folder / "out", reference, evaluated=evaluated)


@pytest.fixture(scope="module")
def interleaved_checkpoint(tmp_path_factory) -> Path:
    """PP=2 x FSDP=2 interleaved (two stages a rank), stopped after step 2 with its checkpoint."""
    saved = tmp_path_factory.mktemp("interleaved")
    job = _job(saved, {**PP2_FSDP2, "pipeline_schedule": "interleaved_1f1b"}, LLAMA, False)
    train(job, saved / "out", 4, "--stop-at-step", 2)
    return checkpoint(saved / "out", 2)


@pytest.mark.parametrize("turbo", [{"pipeline_parallel_size": 4, "pipeline_schedule": "zbv"},
                                   {"fully_shard_parallel_size": 4}], ids=["at PP=4 zbv", "without a pipeline"])
def test_an_interleaved_pipelines_checkpoint_resumes_at_another_layout(turbo, interleaved_checkpoint, references,
                                                                         tmp_path_factory):
    """Step 3 from the interleaved pipeline's checkpoint, at another layout, repeats the
    uninterrupted one-process run."""
    folder = tmp_path_factory.mktemp("resumed")
    train(_job(folder, turbo, LLAMA, False), folder / "out", 4, "--resume", interleaved_checkpoint)
    _assert_same_run(folder / "out", references["llama"], steps=(3,))


def test_a_one_process_checkpoint_resumes_in_a_pipeline(references, tmp_path_factory):
    folder = tmp_path_factory.mktemp("resumed-in-a-pipeline")
    train(_job(folder, PP2_FSDP2, LLAMA, False), folder / "out", 4, "--resume", checkpoint(references["llama"], 2))
    _assert_same_run(folder / "out", references["llama"], steps=(3,))
