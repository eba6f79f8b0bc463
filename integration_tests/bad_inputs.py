"""The bad-input suite's cases (importable by spawned ranks): each is a name, what it
feeds, and the words the error must say. Every case runs on every rank and must raise
the same clear error there, with no collective left waiting (the suite has a timeout)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

QKV = ["*.q_proj", "*.k_proj", "*.v_proj"]


@dataclass(frozen=True)
class Case:
    category: str  # config, job file, data, checkpoint, runtime
    run: Callable[[dict], Any]  # raises the error; gets the shared inputs (paths)
    says: str  # a part of the message every rank must give
    error: str = "ConfigError"  # the error's class name (CheckpointError is a ConfigError)


def _facade(config: dict, kind: str = "llama", **model: Any):
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    return FSDPTurbo(config, tiny_hf_causal_lm(kind, **model))


def _config(config: dict, **model: Any) -> Case:
    return Case("config", lambda _inputs: _facade(config, **model), next(iter(config)))


def _moe(config: dict) -> Case:
    return Case("config", lambda _inputs: _facade(config, "qwen3_moe"), next(iter(config)))


def _job(job: dict, says: str) -> Case:
    from fsdp_turbo.cli.job_config import JobConfig

    model = {"config": {"model_type": "llama", "vocab_size": 256, "hidden_size": 32}}
    return Case("job file", lambda _inputs: JobConfig.from_dict({"model": model, **job}), says)


def _global_batch_on(world: int) -> None:
    """``run.global_batch`` 12 of micro-batches of 2 on 4 data shards (what the worker
    derives before any process group)."""
    from fsdp_turbo.cli.job_config import JobConfig

    job = JobConfig.from_dict({"model": {"config": {"model_type": "llama"}},
                               "run": {"micro_batch": 2, "global_batch": 12}})
    job.run.accumulation(job.turbo.validate(world).dp_replicate_x_fsdp)


def _pipeline_rows_on(world: int) -> None:
    """PP=2 x FSDP=2: 2 rows a step on each data shard, which 4 pipeline micro-batches cannot
    split (what the worker derives before any process group)."""
    from fsdp_turbo.cli.job_config import JobConfig
    from fsdp_turbo.cli.sizes import job_sizes

    job_sizes(JobConfig.from_dict({"model": {"config": {"model_type": "llama"}},
                                   "run": {"micro_batch": 2, "global_batch": 4},
                                   "turbo": {"pipeline_parallel_size": 2, "pipeline_microbatches": 4}}), world)


def _unknown_model_type(_inputs: dict) -> None:
    """The HF config built from ``model.config`` (as the launcher does before any worker)."""
    from fsdp_turbo.cli.job_config import JobConfig
    from fsdp_turbo.cli.model import hf_config

    hf_config(JobConfig.from_dict({"model": {"config": {"model_type": "no_such_model"}}}).model)


def _job_without_model() -> None:
    from fsdp_turbo.cli.job_config import JobConfig

    JobConfig.from_dict({"run": {}})


def _load(path_key: str, says: str) -> Case:
    def run(inputs: dict) -> None:
        from fsdp_turbo.checkpoint import load_pretrained

        load_pretrained(_facade({}, device="meta"), inputs[path_key])

    return Case("checkpoint", run, says, "CheckpointError")


def _resume_from(path_key: str, says: str) -> Case:
    """``--resume auto`` in an output folder whose training checkpoint is crafted (the worker's call)."""
    def run(inputs: dict) -> None:
        from fsdp_turbo.cli.checkpoint import resolve_resume

        resolve_resume("auto", inputs[path_key], "run-fresh")

    return Case("checkpoint", run, says, "CheckpointError")


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft_tiny"


def _data(sources: list[dict] | None = None, says: str = "", *, vocab: int = 4096, **data: Any) -> Case:
    """``load_data`` of a data section over the suite's data files (``{d}`` is their folder)."""
    def run(inputs: dict) -> None:
        from fsdp_turbo.cli.data import load_data
        from fsdp_turbo.cli.job_config import DataSection

        folder = inputs["data"]
        fields = {"tokenizer": str(EXAMPLE / "tokenizer"), **data}
        fields = {k: v.format(d=folder) if isinstance(v, str) else v for k, v in fields.items()}
        if sources is not None:
            fields["sources"] = [{k: v.format(d=folder) if isinstance(v, str) else v for k, v in s.items()}
                                 for s in sources]
        section = DataSection.from_dict(fields)
        load_data(section, Path(folder) / "out", seed=0, vocab_size=vocab)

    return Case("data", run, says)


def _other_data(inputs: dict) -> None:
    from fsdp_turbo.cli.data import load_data
    from fsdp_turbo.cli.job_config import DataSection

    section = DataSection.from_dict({"files": [str(Path(inputs["data"]) / "text.txt")], "seq_len": 16})
    loader = load_data(section, Path(inputs["data"]) / "out", seed=0, vocab_size=256).train
    loader.load_state_dict({"consumed": 4, "seed": 1, "sources": ["another"]})


def _eval_too_small(inputs: dict) -> None:
    from fsdp_turbo.cli.data import load_data
    from fsdp_turbo.cli.job_config import DataSection

    text = str(Path(inputs["data"]) / "text.txt")
    section = DataSection.from_dict({"files": [text], "seq_len": 16,
                                     "eval": {"sources": [{"path": text, "text_field": "text"}], "batches": 50}})
    load_data(section, Path(inputs["data"]) / "out", seed=0, vocab_size=256).eval.batches(2, 0, 4, 50)


CHAT = "{d}/chat.jsonl"


def _job_file_suffix(inputs: dict) -> None:
    from fsdp_turbo.cli.job_config import JobConfig

    JobConfig.from_file(Path(inputs["tmp"]) / "job.json")


def _meta_forward(_inputs: dict) -> None:
    model = _facade({}, device="meta")
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def _meta_save(inputs: dict) -> None:
    from fsdp_turbo.checkpoint import save_pretrained

    save_pretrained(_facade({}, device="meta"), Path(inputs["tmp"]) / "never")


def _twice(_inputs: dict) -> None:
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    FSDPTurbo({}, _facade({}))


def _cp_call(**call: Any) -> Callable[[dict], None]:
    def run(_inputs: dict) -> None:
        model = _facade({"context_parallel_size": 2})
        ids = torch.zeros(2, 8, dtype=torch.long)
        if call.get("no_tokens"):  # positional calls are read by name; a call without the tokens is not
            model(labels=ids)
        else:
            model(input_ids=ids, labels=ids, **call)

    return run


CASES: dict[str, Case] = {
    # configs, through FSDPTurbo on 4 ranks
    "fsdp size is not the world": _config({"fully_shard_parallel_size": 3}),
    "dp does not divide the world": _config({"data_parallel_size": 3}),
    "tp without a plan": _config({"tensor_parallel_size": 2}),
    "pipeline size does not divide the world": _config({"pipeline_parallel_size": 3}),
    "pipeline layers do not split into the stages": _config({"pipeline_parallel_size": 2,
                                                              "pipeline_schedule": "interleaved_1f1b"}),
    "pipeline micro-batches below the stages": _config({"pipeline_microbatches": 1, "pipeline_parallel_size": 2}),
    "pipeline micro-batches do not split a step's rows": Case(
        "job file", lambda _i: _pipeline_rows_on(world=4), "turbo.pipeline_microbatches"),
    "tp pattern matches nothing": Case("config", lambda _i: _facade(
        {"tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": ["*.nothing"]}}), "tp_plan.colwise_parallel"),
    "tp on a non-Linear": Case("config", lambda _i: _facade(
        {"tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": ["model.layers.*.mlp"]}}), "cannot shard"),
    "loss parallel head not colwise": Case("config", lambda _i: _facade(
        {"tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": QKV, "loss_parallel": True}}),
        "tp_plan.loss_parallel"),
    "sequence parallel misses norms": Case("config", lambda _i: _facade(
        {"tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": QKV, "rowwise_parallel": ["*.o_proj"],
                                                "sequence_parallel": ["*layernorm"]}}), "every norm"),
    "tied weights sharded differently": Case("config", lambda _i: _facade(
        {"tensor_parallel_size": 2, "tp_plan": {"colwise_parallel": ["lm_head"]}}, tie_word_embeddings=True),
        "share one parameter"),
    "kv heads do not split over tp": Case("config", lambda _i: _facade(
        {"tensor_parallel_size": 4, "tp_plan": {"colwise_parallel": QKV}}), "num_key_value_heads=2"),
    "heads do not split over tp x cp": Case("config", lambda _i: _facade(
        {"tensor_parallel_size": 2, "context_parallel_size": 2,
         "tp_plan": {"colwise_parallel": QKV, "rowwise_parallel": ["*.o_proj"]}},
        num_attention_heads=6, hidden_size=96), "num_attention_heads=6"),
    "ep without a plan": _moe({"expert_parallel_size": 2}),
    "ep pattern is not experts": Case("config", lambda _i: _facade(
        {"expert_parallel_size": 2, "ep_plan": {"apply_modules": ["*.q_proj"]}}, "qwen3_moe"),
        "is not an expert container"),
    "ep does not divide the world": _moe({"expert_parallel_size": 3, "ep_plan": {}}),
    "ep beside tp without sequence parallel": Case("config", lambda _i: _facade(
        {"expert_parallel_size": 2, "ep_plan": {}, "tensor_parallel_size": 2,
         "tp_plan": {"colwise_parallel": QKV, "rowwise_parallel": ["*.o_proj"]}}, "qwen3_moe"),
        "tp_plan.sequence_parallel"),
    "efsdp does not divide the world": _moe({"expert_parallel_size": 2, "ep_plan": {},
                                             "expert_fully_shard_parallel_size": 3}),
    "cp attention function does not import": Case("config", lambda _i: _facade(
        {"context_parallel_size": 2, "model_facts": {"attention_function": "no_such.attention"}}), "does not import"),
    "cp attention function not a path": _config({"model_facts": {"attention_function": "sdpa"}}),
    "recompute plan matches nothing": Case("config", lambda _i: _facade(
        {"recompute": True, "recompute_plan": ["*.nothing"]}), "recompute_plan"),
    "recompute policy names no op": Case("config", lambda _i: _facade(
        {"recompute": True, "recompute_policy": ["aten.no_such_op"]}), "no such operator"),
    "compile backend unknown": Case("config", lambda _i: _facade(
        {"compile": True, "compile_backend": "no_such_backend"}), "compile_backend"),
    "swap plan matches nothing": Case("config", lambda _i: _facade(
        {"swap_activation": True, "swap_activation_plan": ["*.nothing"]}), "swap_activation_plan"),
    "chunk loss head missing": Case("config", lambda _i: _facade(
        {"chunk_loss": True, "model_facts": {"head_module": "no_head"}}), "model_facts.head_module"),
    "quantization converter unknown": _config({"quantization_plan": {"converters": ["fp4_magic"]}}),
    # turbo-quant's own format table, published under fsdp_turbo.choices, checks it when the config is built
    "quantization format unknown": Case("config", lambda _i: _facade(
        {"quantization_plan": {"quant_format": "E3M4"}}), "quantization_plan.quant_format"),
    "quantization of the output head": Case("config", lambda _i: _facade(
        {"quantization_plan": {"apply_modules": ["lm_head"]}}), "output head"),
    "quantization converts nothing": Case("config", lambda _i: _facade(
        {"quantization_plan": {"block_size": 1024}}), "converts nothing"),
    "ignored module contains a unit": Case("config", lambda _i: _facade(
        {"fsdp_plan": {"ignored_modules": ["model.layers.0"]}}), "fsdp_plan.ignored_modules"),
    "module patch target not a member path": _config({"module_patches": [{"target": "LlamaAttention.forward",
                                                                           "replacement": "math.sqrt"}]}),
    "module patch target does not import": Case("config", lambda _i: _facade(
        {"module_patches": [{"target": "no_such_pkg.module.Class.forward", "replacement": "math.sqrt"}]}),
        "module_patches[0].target"),
    "module patch class not in the model": Case("config", lambda _i: _facade(
        {"module_patches": [{"target": "torch.nn.modules.conv.Conv2d.forward", "replacement": "math.sqrt"}]}),
        "holds no Conv2d"),
    "module patch pattern picks no instance": Case("config", lambda _i: _facade(
        {"module_patches": [{"target": "torch.nn.modules.linear.Linear.forward", "replacement": "math.sqrt",
                             "modules": ["*.input_layernorm"]}]}), "module_patches[0].modules"),
    "module patch replacement not callable": Case("config", lambda _i: _facade(
        {"module_patches": [{"target": "torch.nn.modules.linear.Linear.forward", "replacement": "math.pi"}]}),
        "module_patches[0].replacement"),
    "model facts head parameter missing": Case("config", lambda _i: _facade(
        {"model_facts": {"head_parameters": ["model.layers.*.self_attn.sinks"]}}), "holds no parameter 'sinks'"),
    "unknown config field": _config({"fsdp_plans": {}}),
    "unknown dtype": _config({"fsdp_plan": {"param_dtype": "bfloat17"}}),
    "unknown device": _config({"device_type": "tpu"}),
    # job files
    "job: unknown section": _job({"trainer": {}}, "trainer"),
    "job: no model": Case("job file", lambda _i: _job_without_model(), "add a model section"),
    "job: model twice over": _job({"model": {"config": {"model_type": "llama"}, "model_name_or_path": "x"}},
                                  "exactly one"),
    "job: model without model_type": _job({"model": {"config": {"hidden_size": 32}}}, "model.config.model_type"),
    "job: negative learning rate": _job({"optimizer": {"lr": -1.0}}, "optimizer.lr"),
    "job: zero steps": _job({"run": {"steps": 0}}, "run.steps"),
    "job: unknown nonfinite policy": _job({"run": {"nonfinite": "ignore"}}, "run.nonfinite"),
    "job: grad_accum beside global_batch": _job({"run": {"global_batch": 8, "grad_accum": 2}}, "run.grad_accum"),
    "job: collective timeout under a second": _job({"run": {"collective_timeout_s": 0}}, "run.collective_timeout_s"),
    "job: global batch not whole micro-batches": Case("job file", lambda _i: _global_batch_on(world=4),
                                                      "use a multiple of micro_batch x data shards = 2 x 4 = 8"),
    "job: source without a field": _job({"data": {"sources": [{"path": "a.jsonl"}]}}, "data.sources[0]"),
    "job: files and sources": _job({"data": {"files": ["a"], "sources": [{"path": "a", "text_field": "t"}]}},
                                   "not both"),
    "job: unknown overflow policy": _job({"data": {"overflow": "wrap"}}, "data.overflow"),
    "job: keep no checkpoint": _job({"checkpoint": {"keep": 0}}, "checkpoint.keep"),
    "job: unknown turbo field": _job({"turbo": {"tensor_parallel": 2}}, "turbo.tensor_parallel"),
    "job: not yaml or toml": Case("job file", _job_file_suffix, "use a .yaml, .yml or .toml file"),
    "job: learning rate NaN": _job({"optimizer": {"lr": float("nan")}}, "optimizer.lr=nan"),
    "job: min_lr_ratio NaN": _job({"optimizer": {"min_lr_ratio": float("nan")}}, "optimizer.min_lr_ratio=nan"),
    "job: collective timeout infinite": _job({"run": {"collective_timeout_s": float("inf")}},
                                             "run.collective_timeout_s=inf"),
    "job: source weight infinite": _job({"data": {"sources": [{"path": "a.jsonl", "text_field": "text",
                                                               "weight": float("inf")}]}},
                                        "data.sources[0].weight=inf"),
    "job: model config a string": _job({"model": {"config": "config.json"}}, "model.config='config.json'"),
    "job: model path a number": _job({"model": {"model_name_or_path": 123}}, "model.model_name_or_path=123"),
    "job: model path not a local folder": _job({"model": {"model_name_or_path": "Qwen/Qwen3-0.6B"}},
                                               "hf download ID --local-dir DIR"),
    "job: unknown model dtype": _job({"model": {"config": {"model_type": "llama"}, "dtype": "float17"}},
                                     "model.dtype='float17'"),
    "job: unknown model type": Case("job file", _unknown_model_type, "model.config.model_type='no_such_model'"),
    "job: int and str keys in a section": _job({"run": {"steps": 5, 1: 2}}, "run.1=2"),
    # data
    "data: no file matches": _data([{"path": "{d}/nothing*.jsonl", "text_field": "text"}], "no file matches"),
    "data: missing field": _data([{"path": "{d}/rows.jsonl", "text_field": "body"}], "data.sources[0].text_field"),
    "data: empty source": _data([{"path": "{d}/empty.jsonl", "text_field": "text"}], "data.sources[0].path"),
    "data: corrupt jsonl line": _data([{"path": "{d}/corrupt.jsonl", "text_field": "text"}], "corrupt.jsonl:3"),
    "data: sft without a chat template": _data([{"path": CHAT, "messages_field": "messages"}], "no chat template",
                                               tokenizer="{d}/plain_tokenizer"),
    "data: document longer than seq_len": _data([{"path": "{d}/rows.jsonl", "text_field": "text"}], "row 1 has",
                                                overflow="error", seq_len=8),
    "data: not a tokenizer": _data(None, "no tokenizer there", tokenizer="{d}"),
    "data: tokenizer larger than the model": _data([{"path": "{d}/rows.jsonl", "text_field": "text"}],
                                                   "vocab_size is 256", vocab=256),
    "data: mixed formats in one source": _data([{"path": "{d}/mixed/*", "text_field": "text"}], "mixes"),
    "data: text column of numbers": _data([{"path": "{d}/numbers.jsonl", "text_field": "text"}], "row 0 holds"),
    "data: conversation without an assistant turn": _data([{"path": "{d}/no_answer.jsonl",
                                                            "messages_field": "messages"}], "assistant turn"),
    "data: resumed on other data": Case("data", _other_data, "written for other data"),
    "data: eval set smaller than its batches": Case("data", _eval_too_small, "data.eval.batches"),
    # checkpoints
    "checkpoint: no directory": _load("missing", "no such directory"),
    "checkpoint: not a model": _load("not_a_model", "no config.json"),
    "checkpoint: truncated file": _load("truncated", "damaged or truncated"),
    "checkpoint: missing tensor": _load("missing_tensor", "1 missing"),
    "checkpoint: index names a file above the folder": _load("index_up", "'../outside.safetensors' is invalid"),
    "checkpoint: index names an absolute path": _load("index_absolute", "outside.safetensors' is invalid"),
    "checkpoint: run name climbs out of the output": _resume_from("run_up", "meta.json run='../..'"),
    "checkpoint: run name is an absolute path": _resume_from("run_absolute", "never a path"),
    # runtime misuse
    "runtime: meta model used before loading": Case("runtime", _meta_forward, "has no weights yet",
                                                    "NotMaterializedError"),
    "runtime: meta model saved": Case("runtime", _meta_save, "still on the meta device", "CheckpointError"),
    "runtime: FSDPTurbo twice": Case("runtime", _twice, "already been through FSDPTurbo"),
    "runtime: output_attentions under cp": Case("runtime", _cp_call(output_attentions=True), "output_attentions"),
    "runtime: no input_ids under cp": Case("runtime", _cp_call(no_tokens=True), "call the model with input_ids="),
    "runtime: 3-d attention mask under cp": Case("runtime", _cp_call(attention_mask=torch.ones(2, 1, 8)),
                                                  "2-D padding mask"),
}


def run_cases(names: list[str], inputs: dict) -> dict[str, tuple[str, str]]:
    """Each case on this rank: (the error's class, its message), or ("none", "") if it ran."""
    results = {}
    for name in names:
        try:
            CASES[name].run(inputs)
        except Exception as error:  # a test records what every rank raised
            results[name] = (type(error).__name__, str(error))
        else:
            results[name] = ("none", "")
    return results


def prepare_checkpoints(root: Path) -> dict[str, str]:
    """The damaged checkpoints the checkpoint cases read (transformers saves a good one first)."""
    import json
    import os
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    good = root / "good"
    tiny_hf_causal_lm("llama").save_pretrained(good, max_shard_size="100KB")
    paths = {"missing": str(root / "nothing_here"), "tmp": str(root)}
    for name in ("not_a_model", "truncated", "missing_tensor"):
        shutil.copytree(good, root / name)
        paths[name] = str(root / name)
    os.remove(root / "not_a_model" / "config.json")
    os.truncate(root / "truncated" / "model-00002-of-00005.safetensors", 1000)
    first = root / "missing_tensor" / "model-00001-of-00005.safetensors"
    with safe_open(first, "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - a safetensors handle
    dropped = sorted(tensors)[0]
    tensors.pop(dropped)
    save_file(tensors, first, metadata={"format": "pt"})
    index_path = root / "missing_tensor" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][dropped]
    index_path.write_text(json.dumps(index))
    outside = root / "outside.safetensors"
    paths["index_up"] = str(_index_escapes(good, root / "index_up", outside, "../outside.safetensors"))
    paths["index_absolute"] = str(_index_escapes(good, root / "index_absolute", outside, str(outside)))
    paths["run_up"] = str(_crafted_run(root / "run_up", "../.."))
    paths["run_absolute"] = str(_crafted_run(root / "run_absolute", str(root / "elsewhere")))
    (root / "job.json").write_text("{}")
    paths["data"] = str(prepare_data(root / "data"))
    return paths


def _crafted_run(output: Path, run: str) -> Path:
    """An output folder whose one training checkpoint says, in its meta.json, that it belongs to ``run``."""
    import json

    step = output / "checkpoints" / "run-20260101-000000-abcdef" / "step-4"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"run": run, "step": 4, "saved_at": 0.0}))
    return output


def _index_escapes(good: Path, folder: Path, outside: Path, entry: str) -> Path:
    """A copy of ``good`` whose last shard lies at ``outside`` (beside the folder) and whose
    index names it by ``entry``: it would load whole if the index were followed out of the folder."""
    import json
    import shutil

    shutil.copytree(good, folder)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = max(index["weight_map"].values())
    shutil.move(folder / last, outside)  # the same bytes each time: both cases point at this file
    index["weight_map"] = {k: entry if v == last else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return folder


def prepare_data(folder: Path) -> Path:
    """The data files the data cases read: good, empty, corrupt and odd ones."""
    import json
    import shutil

    folder.mkdir()
    rows = [{"text": "short"}, {"text": "a document of more than eight tokens, surely"}]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "empty.jsonl").write_text("")
    (folder / "corrupt.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n{"text": "d"}\n')
    (folder / "numbers.jsonl").write_text('{"text": 1}\n{"text": 2}\n')
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (folder / "chat.jsonl").write_text(json.dumps(chat) + "\n")
    (folder / "no_answer.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (folder / "mixed").mkdir()
    (folder / "mixed" / "a.jsonl").write_text('{"text": "a"}\n')
    (folder / "mixed" / "b.csv").write_text("text\nb\n")
    (folder / "text.txt").write_text("plain text, one document, several windows long. " * 4)
    plain = folder / "plain_tokenizer"
    shutil.copytree(EXAMPLE / "tokenizer", plain)
    (plain / "chat_template.jinja").unlink()
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
