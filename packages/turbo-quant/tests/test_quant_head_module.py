"""``model_facts.head_module``: the output head of a model HF's API does not describe (no
``get_output_embeddings()``, blocks in a ``ModuleDict``, logits returned, as torchtitan's
models) is left in high precision by the default plan once the model facts name it."""

import pytest
import torch
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import ModelFactsConfig, resolve_model_facts
from fsdp_turbo.fsdp_turbo import FSDPTurbo
from fsdp_turbo.fsdp_turbo_config import FSDPTurboConfig, QuantizeConfig
from fsdp_turbo.quantization.converter import convert_model, plan_conversion
from fsdp_turbo.quantization.training import MXLinear


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(64, 64, bias=False)
        self.w2 = nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.wq(x)))


class LogitsModel(nn.Module):
    """Token embedding, a ModuleDict of blocks, and a head named ``output``; returns logits."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(256, 64)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.output = nn.Linear(64, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(h)


BLOCK_LINEARS = {f"layers.{i}.{leaf}" for i in range(2) for leaf in ("wq", "w2")}


def test_without_a_name_the_default_plan_cannot_tell_the_head():
    assert set(convert_model(LogitsModel(), QuantizeConfig())) == BLOCK_LINEARS | {"output"}


def _facts(model, **config):
    return resolve_model_facts(model, ModelFactsConfig(**config))


def test_the_named_head_stays_high_precision_and_the_model_trains():
    model = LogitsModel()
    plan = QuantizeConfig()
    conversions, skipped = plan_conversion(model, plan, _facts(model, head_module="output"))
    assert {c.name for c in conversions} == BLOCK_LINEARS
    assert skipped == [("output", "it is the output head (its error lands directly on the loss)")]
    convert_model(model, plan, _facts(model, head_module="output"))
    assert type(model.output) is nn.Linear and isinstance(model.layers["0"].wq, MXLinear)
    tokens = torch.randint(0, 256, (2, 32))
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert model.layers["0"].wq.weight.grad.abs().sum() > 0


def test_asking_for_the_named_head_explicitly_is_refused():
    model = LogitsModel()
    with pytest.raises(ConfigError, match="output head") as error:
        convert_model(model, QuantizeConfig(apply_modules=["output"]), _facts(model, head_module="output"))
    assert error.value.field == "quantization_plan.apply_modules" and error.value.value == "output"


def test_the_facade_reads_the_head_from_the_model_facts():
    config = FSDPTurboConfig.from_dict({"quantization_plan": {}, "model_facts": {"head_module": "output"}})
    model = FSDPTurbo(config, LogitsModel())
    assert type(model.output) is nn.Linear and isinstance(model.layers["0"].wq, MXLinear)
    with pytest.raises(ConfigError) as error:
        FSDPTurboConfig.from_dict({"quantization_plan": {"head_module": "output"}})
    assert error.value.field == "quantization_plan.head_module" and "model_facts.head_module" in error.value.fix


def test_a_head_that_is_not_there_names_field_value_and_fix():
    with pytest.raises(ConfigError, match="no such module") as error:
        _facts(LogitsModel(), head_module="lm_head")
    assert error.value.field == "model_facts.head_module" and error.value.value == "lm_head"
