"""``fsdp_turbo.checkpoint`` on 4 gloo ranks: a model built on the meta device, sharded by
``FSDPTurbo``, filled from a checkpoint transformers saved (several files and an index),
bit for bit; written back as transformers writes it, so transformers' ``from_pretrained``
reads it bit for bit; trained from a load as from the whole model; initialised the same
at every layout; and every bad checkpoint named on every rank."""

import json
import os
import shutil

import pytest
import torch
from checkpoint_jobs import (
    expert_list_round_trip,
    forward_before_loading,
    init_in_one_process,
    init_on_ranks,
    init_peak_memory,
    load_expecting_error,
    load_then_save,
    save_reference,
    train_loaded_and_materialized,
    train_save_resume,
)
from safetensors import safe_open
from safetensors.torch import save_file

from fsdp_turbo.core.errors import CheckpointError
from fsdp_turbo.core.testing import assert_parity, run_distributed

pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank

MODELS = ["llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3"]
MOE = {"qwen3_moe", "mixtral", "deepseek_v3"}
# Every model at every layout it has: EP needs experts; the TP plan names q/k/v_proj, which
# DeepSeek-V3's MLA attention does not have. Llama ties its embeddings, except under this
# TP plan (which shards the head but not the embedding, so a tie is a ConfigError).
ROUND_TRIPS = [
    (kind, layout, {"tie_word_embeddings": True} if kind == "llama" and layout != "fsdp2 x tp2" else {})
    for layout in ("fsdp4", "hsdp 2x2", "fsdp2 x tp2", "fsdp4, ep2 x efsdp2", "cp2 x fsdp2", "fsdp4 + mxfp8")
    for kind in MODELS
    if (layout != "fsdp4, ep2 x efsdp2" or kind in MOE) and (layout != "fsdp2 x tp2" or kind != "deepseek_v3")
] + [("qwen3_moe", "fsdp4, ep2 x efsdp2 + mxfp8", {}), ("llama", "hsdp 2x2 + mxfp8, 8-bit gathers", {})]


def _layout_of(directory):
    """Checkpoint tensor name -> shape, over every file."""
    shapes = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - a safetensors handle
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _assert_equal(expected, actual):
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor.float()), key


@pytest.mark.parametrize("kind,layout,model_kwargs", ROUND_TRIPS,
                         ids=[f"{kind}-{layout}" for kind, layout, _ in ROUND_TRIPS])
def test_round_trip_is_bit_exact(kind, layout, model_kwargs, tmp_path):
    from transformers import AutoModelForCausalLM

    state, buffers = save_reference(kind, tmp_path / "hf", **model_kwargs)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # several files
    results = run_distributed(load_then_save, 4, kind, layout, str(tmp_path / "hf"), str(tmp_path / "ours"),
                              model_kwargs, timeout=300)
    _assert_equal({**state, **buffers}, results[0]["state"])
    # Each rank read only its slices: with 4-way sharding, well under the whole checkpoint.
    for result in results:
        assert result["read"] < result["total"], result
    # Ours, written as transformers writes: the same names and shapes, read back bit for bit.
    assert _layout_of(tmp_path / "ours") == _layout_of(tmp_path / "hf")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(_layout_of(tmp_path / "ours"))
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    _assert_equal(state, {k: v.float() for k, v in back.state_dict().items()})


def test_expert_lists_under_expert_parallel_load_and_save(tmp_path):
    from transformers import AutoModelForCausalLM

    state, _ = save_reference("qwen3_moe", tmp_path / "hf")
    results = run_distributed(expert_list_round_trip, 4, str(tmp_path / "hf"), str(tmp_path / "ours"), timeout=300)
    first_half = [r["held"] for r in results if "model.layers.0.mlp.experts.0.gate_proj.weight" in r["held"]]
    assert len(first_half) == 2 and not any("experts.4." in k for k in first_half[0])  # 4 of 8 experts a rank
    assert _layout_of(tmp_path / "ours") == _layout_of(tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    _assert_equal(state, {k: v.float() for k, v in back.state_dict().items()})


def test_fsdp4_reads_a_quarter(tmp_path):
    save_reference("qwen3", tmp_path / "hf", max_shard_size="5GB")  # one file, no index
    results = run_distributed(load_then_save, 4, "qwen3", "fsdp4", str(tmp_path / "hf"), None, {}, timeout=300)
    for result in results:
        # dim-0 shards of every tensor, plus the norms every rank reads whole
        assert result["read"] / result["total"] < 0.27, result


@pytest.mark.parametrize("kind,layout", [("qwen3_moe", "fsdp4, ep2 x efsdp2"), ("qwen3_moe", "fsdp4, ep2 eager"),
                                         ("qwen3_moe", "fsdp4, ep2 mc2"), ("llama", "cp2 x fsdp2"),
                                         ("llama", "hsdp 2x2 + mxfp8, 8-bit gathers"),
                                         ("qwen3_moe", "every feature")])
def test_training_from_a_load_matches_training_the_whole_model(kind, layout, tmp_path):
    """The same weights and layout either way, so the same numbers to the last bit."""
    model_kwargs = {"num_hidden_layers": 3} if layout == "every feature" else {}
    save_reference(kind, tmp_path / "hf", **model_kwargs)
    for loaded, whole in run_distributed(train_loaded_and_materialized, 4, kind, layout, str(tmp_path / "hf"),
                                         model_kwargs, timeout=300):
        assert_parity(whole, loaded, loss_rtol=0, grad_rtol=0, grad_atol=0)


def test_export_after_training_is_the_trained_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    save_reference("qwen3_moe", tmp_path / "hf")
    (tmp_path / "ours").mkdir()  # an older export there is replaced, not merged
    (tmp_path / "ours" / "stale.safetensors").write_text("old")
    trained = run_distributed(train_save_resume, 4, "qwen3_moe", "fsdp2 x tp2", str(tmp_path / "hf"),
                              str(tmp_path / "ours"), {}, timeout=300)[0]
    assert not (tmp_path / "ours" / "stale.safetensors").exists()
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    _assert_equal({k: v for k, v in trained.items() if not k.startswith("buffer:")},
                  {k: v.float() for k, v in back.state_dict().items()})


@pytest.mark.parametrize("kind,layout", [("qwen3_moe", "fsdp4"), ("llama", "fsdp2 x tp2"),
                                         ("qwen3_moe", "fsdp4, ep2 x efsdp2")])
def test_init_weights_is_the_same_at_every_layout(kind, layout):
    from fsdp_turbo.core.testing import run_reference

    one = run_reference(init_in_one_process, kind, 7, {}, timeout=300)
    sharded = run_distributed(init_on_ranks, 4, kind, layout, 7, {}, timeout=300)[0]
    _assert_equal(one, sharded)
    assert one["model.norm.weight"].eq(1).all()  # the model's own scheme: norms at one
    assert 0.015 < one["model.embed_tokens.weight"].std() < 0.025  # initializer_range 0.02


def test_using_the_model_before_loading_is_a_clear_error():
    errors = run_distributed(forward_before_loading, 4, "llama", timeout=120, return_exceptions=True)
    assert all("built on the meta device and has no weights yet" in str(e) for e in errors), errors


def _rewrite(directory, change):
    """Rewrite the first file of a checkpoint with ``change(tensors)`` (and keep the index true)."""
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = sorted(set(index["weight_map"].values()))[0]
    with safe_open(directory / name, "pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118 - a safetensors handle
    tensors = change(tensors)
    save_file(tensors, directory / name, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != name}
    index["weight_map"].update(dict.fromkeys(tensors, name))
    index_path.write_text(json.dumps(index))
    return name


def _drop_one(tensors):
    tensors.pop(sorted(tensors)[0])
    return tensors


def _reshape_one(tensors):
    key = sorted(tensors)[0]
    tensors[key] = torch.zeros(3, 5)
    return tensors


BAD = {
    "missing tensor": (lambda d: _rewrite(d, _drop_one), "1 missing"),
    "unexpected tensor": (lambda d: _rewrite(d, lambda t: {**t, "model.extra.weight": torch.zeros(2)}),
                          "1 unexpected (['model.extra.weight'])"),
    "wrong shape": (lambda d: _rewrite(d, _reshape_one), "have another shape than the model's"),
    "truncated file": (lambda d: os.truncate(d / "model-00002-of-00005.safetensors", 1000), "damaged or truncated"),
    "missing file": (lambda d: os.remove(d / "model-00003-of-00005.safetensors"), "names it but it is not there"),
    "not a model": (lambda d: os.remove(d / "config.json"), "it has no config.json"),
    "no directory": (lambda d: shutil.rmtree(d), "no such directory"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_fail_on_every_rank(case, tmp_path):
    save_reference("llama", tmp_path / "hf", max_shard_size="100KB")  # five files
    spoil, message = BAD[case]
    spoil(tmp_path / "hf")
    errors = run_distributed(load_expecting_error, 4, "llama", str(tmp_path / "hf"), timeout=120,
                             return_exceptions=True)
    for error in errors:
        assert isinstance(error, CheckpointError), errors
        assert message in str(error), str(error)


@pytest.mark.parametrize("kind,layout", [("qwen3_moe", "fsdp4"), ("llama", "fsdp4"),
                                         ("qwen3_moe", "fsdp4, ep2 x efsdp2")])
def test_init_weights_peak_is_the_share_plus_the_largest_tensor(kind, layout):
    """MemTracker's CPU peak during init_weights. Measured: share + largest parameter + 64 B
    (Qwen3-MoE, whose fused gate_up_proj is the largest) and + 512 B (Llama); the bound
    allows 4 KiB for the small tensors allocated beside it."""
    for result in run_distributed(init_peak_memory, 4, kind, layout, {"num_hidden_layers": 4}, timeout=300):
        assert result["peak"] <= result["share"] + result["largest_param"] + 4096, result
