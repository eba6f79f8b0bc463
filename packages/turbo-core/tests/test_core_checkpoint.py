"""``fsdp_turbo.checkpoint`` in one process: the checkpoint layout transformers writes, a
meta-built model loaded and saved bit for bit, ``init_weights`` by seed, and the guard on
a model that has no weights yet. The sharded layouts are in integration_tests."""

import pickle

import pytest
import torch

from fsdp_turbo.checkpoint import init_weights, load_pretrained, save_pretrained
from fsdp_turbo.checkpoint.layout import checkpoint_layout
from fsdp_turbo.core.blueprint import NotMaterializedError
from fsdp_turbo.core.errors import CheckpointError
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo

pytest.importorskip("transformers")
KINDS = ["llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3"]


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_fused_experts_are_one_checkpoint_tensor_per_expert(kind):
    layout = checkpoint_layout(tiny_hf_causal_lm(kind, device="meta"))
    experts = next(k for k in layout.pieces if k.endswith("experts.gate_up_proj"))
    pieces = layout.pieces[experts]
    assert len(pieces) == 16  # 8 experts x (gate, up)
    gate, up = pieces[0], pieces[8]
    assert gate.shape == up.shape == (32, 64)
    assert gate.start == (0, 0, 0) and up.start == (0, 32, 0)  # up is the second half of dim 1
    assert ("w1" in gate.key) == (kind == "mixtral")  # Mixtral keeps its own names


@pytest.mark.parametrize("kind", KINDS)
def test_load_and_save_round_trip(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    reference = tiny_hf_causal_lm(kind, seed=1)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    model = FSDPTurbo({}, tiny_hf_causal_lm(kind, device="meta"))
    report = load_pretrained(model, tmp_path / "hf")
    expected = reference.state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert all(torch.equal(b, dict(reference.named_buffers())[n]) for n, b in model.named_buffers())
    assert 0 < report.read_bytes <= report.checkpoint_bytes
    save_pretrained(model, tmp_path / "ours", dtype=torch.bfloat16, max_shard_size="100KB")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert back.config.dtype == torch.bfloat16
    assert all(torch.equal(back.state_dict()[k], v.to(torch.bfloat16)) for k, v in expected.items())


def test_values_are_converted_to_the_models_dtype(tmp_path):
    reference = tiny_hf_causal_lm("qwen3_moe", seed=1).to(torch.bfloat16)
    reference.save_pretrained(tmp_path)
    model = tiny_hf_causal_lm("qwen3_moe", device="meta")  # float32
    load_pretrained(model, tmp_path)
    for key, value in reference.state_dict().items():
        assert model.state_dict()[key].dtype == torch.float32
        assert torch.equal(model.state_dict()[key], value.float()), key


def test_init_weights_follows_the_seed_and_the_models_scheme():
    first = init_weights(tiny_hf_causal_lm("qwen3_moe", device="meta"), seed=3).state_dict()
    again = init_weights(tiny_hf_causal_lm("qwen3_moe", device="meta"), seed=3).state_dict()
    other = init_weights(tiny_hf_causal_lm("qwen3_moe", device="meta"), seed=4).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert first["model.layers.0.input_layernorm.weight"].eq(1).all()
    assert abs(first["model.layers.0.mlp.experts.gate_up_proj"].std() - 0.02) < 0.002


def test_a_meta_model_refuses_to_run_until_it_has_weights():
    model = FSDPTurbo({}, tiny_hf_causal_lm("llama", device="meta"))
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(NotMaterializedError, match="load_pretrained"):
        model(input_ids=ids)
    init_weights(model)
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_checkpoint_errors_cross_processes_intact(tmp_path):
    with pytest.raises(CheckpointError) as info:
        load_pretrained(tiny_hf_causal_lm("llama", device="meta"), tmp_path)
    error = pickle.loads(pickle.dumps(info.value))
    assert isinstance(error, CheckpointError) and "no config.json" in str(error)


def test_a_checkpoint_in_the_models_own_layout_loads(tmp_path):
    """Fused experts under the model's own names, as earlier exports wrote them."""
    from safetensors.torch import save_file

    reference = tiny_hf_causal_lm("qwen3_moe", seed=2)
    reference.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, tmp_path / "model.safetensors")
    model = tiny_hf_causal_lm("qwen3_moe", device="meta")
    load_pretrained(model, tmp_path)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.state_dict().items())


def test_strict_false_initialises_what_is_missing_and_names_it(tmp_path, caplog):
    import logging

    from safetensors.torch import save_file

    reference = tiny_hf_causal_lm("llama", seed=2)
    reference.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in reference.state_dict().items() if k != "model.norm.weight"}
    save_file({**state, "model.extra": torch.zeros(3)}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="1 missing"):
        load_pretrained(tiny_hf_causal_lm("llama", device="meta"), tmp_path)
    model = tiny_hf_causal_lm("llama", device="meta")
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        report = load_pretrained(model, tmp_path, strict=False)
    assert report.missing == ("model.norm.weight",) and report.unexpected == ("model.extra",)
    assert model.model.norm.weight.eq(1).all()  # initialised as init_weights would
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert any("model.norm.weight" in r.getMessage() and "model.extra" in r.getMessage() for r in caplog.records)
