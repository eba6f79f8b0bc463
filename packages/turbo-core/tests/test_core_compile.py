"""Per-block compile (``compile=True``) in one process: the blocks' forwards are compiled,
their hooks stay eager, names and numerics are unchanged; bad input is a ConfigError.
(Composition with FSDP2, TP, recompute, swaps and MXFP8 on 4 ranks: integration_tests.)"""

import pytest
import torch

from fsdp_turbo.core.compile import compile_block
from fsdp_turbo.core.testing import make_token_batches, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import ConfigError, FSDPTurboConfig

pytest.importorskip("transformers")
BATCHES = make_token_batches(vocab_size=256, global_batch=4, seq_len=16, steps=3)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def test_compiled_blocks_train_like_eager_with_the_same_names():
    from torch._dynamo.utils import counters

    counters.clear()
    reference = train_steps(tiny_hf_causal_lm("llama"), BATCHES)
    model = tiny_hf_causal_lm("llama")
    keys = list(model.state_dict())
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    model = FSDPTurbo({"compile": True, "compile_backend": "aot_eager"}, model)
    record = train_steps(model, BATCHES)
    # aot_eager runs the same aten ops: bitwise.
    assert record.losses == reference.losses
    for name, grad in reference.grads.items():
        torch.testing.assert_close(record.grads[name], grad, rtol=0, atol=0)
    assert list(model.state_dict()) == keys
    assert len(calls) == len(BATCHES)  # the module's hooks still run, outside the graph
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] >= 1


def test_compile_plan_picks_modules():
    model = FSDPTurbo({"compile": True, "compile_backend": "aot_eager", "compile_plan": ["*.mlp"]},
                      tiny_hf_causal_lm("llama"))
    compiled = [name for name, module in model.named_modules() if getattr(module, "_fsdp_turbo_compiled", False)]
    assert compiled == ["model.layers.0.mlp", "model.layers.1.mlp"]


@pytest.mark.parametrize(("config", "field"), [
    ({"compile": True, "compile_backend": "no_such_backend"}, "compile_backend"),
    ({"compile": True, "compile_plan": ["*.nothing"]}, "compile_plan"),
    ({"compile": True, "compile_backend": ""}, "compile_backend"),
])
def test_bad_compile_config(config, field):
    with pytest.raises(ConfigError) as info:
        FSDPTurbo(FSDPTurboConfig.from_dict(config), tiny_hf_causal_lm("llama"))
    assert info.value.field == field


def test_compiling_a_block_twice_is_a_config_error():
    model = tiny_hf_causal_lm("llama")
    compile_block(model.model.layers[0], "aot_eager")
    with pytest.raises(ConfigError):
        compile_block(model.model.layers[0], "aot_eager")
    with pytest.raises(ConfigError):
        FSDPTurbo({"compile": True}, model)
