"""The registry of expert forms: the README's user-defined form is found and used (EP=1 and
EP=2, against the unsharded container), torchtitan's form (a stand-in, no torchtitan) runs
under every dispatcher, and a module no form matches is a ConfigError naming the fix."""

import copy

import pytest
import torch
from expert_form_jobs import NUM_EXPERTS, Block, SortedRowExperts, TanhMoE, ep2_against_whole, readme_form, routing
from torch import nn

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import resolve_model_facts
from fsdp_turbo.distributed.expert_parallel import (
    DISPATCHERS,
    CountedExperts,
    ExpertAdapter,
    ExpertGroup,
    FusedExperts,
    expert_adapter,
    expert_forms,
    make_expert_parallel,
    register_expert_form,
    resolve_ep_plan,
)
from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _ep1(module: nn.Module, dispatcher: str) -> nn.Module:
    converted = copy.deepcopy(module)
    experts = ExpertGroup(expert_adapter(converted), NUM_EXPERTS, ep_size=1, group=None, num_chunks=3)
    return make_expert_parallel(converted, experts, ep_rank=0, dispatcher=dispatcher)


def _assert_same_training_step(reference: nn.Module, converted: nn.Module, *inputs: torch.Tensor) -> None:
    ours = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    theirs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    expected, got = reference(*theirs), converted(*ours)
    torch.testing.assert_close(got, expected, **TOLERANCE)
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(7))
    (expected * probe).sum().backward()
    (got * probe).sum().backward()
    for mine, other in zip(ours, theirs, strict=True):
        if other.grad is not None:
            torch.testing.assert_close(mine.grad, other.grad, **TOLERANCE)
    for (name, p), (_, q) in zip(reference.named_parameters(), converted.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TOLERANCE, msg=lambda m, n=name: f"{n}: {m}")


def test_the_readme_form_is_registered_first_and_picked_by_the_plan():
    with readme_form() as form:
        assert expert_forms()[0] is form
        plan = resolve_ep_plan(Block(), EPPlanConfig(apply_modules=["experts"]), 2, resolve_model_facts(Block()))
        assert plan.containers == (("experts", form(num_experts=NUM_EXPERTS)),)
    assert form not in expert_forms()


@pytest.mark.parametrize("dispatcher", list(DISPATCHERS))
def test_the_readme_form_matches_its_container_at_ep1(dispatcher):
    torch.manual_seed(0)
    reference = TanhMoE()
    with readme_form():
        _assert_same_training_step(reference, _ep1(reference, dispatcher), *routing(tokens=13))


@pytest.mark.multirank
def test_the_readme_form_matches_its_container_at_ep2():
    from fsdp_turbo.core.testing import run_distributed

    for worst in run_distributed(ep2_against_whole, 2, list(DISPATCHERS), timeout=120):
        assert set(worst) == set(DISPATCHERS) and max(worst.values()) < 1e-5, worst


def test_torchtitan_form_is_recognised_by_structure():
    assert expert_adapter(SortedRowExperts()) == CountedExperts(NUM_EXPERTS)

    class OtherCall(SortedRowExperts):  # the same weights, called another way
        def forward(self, x, counts):
            return super().forward(x, counts)

    assert expert_adapter(OtherCall()) is None


@pytest.mark.parametrize("dispatcher", list(DISPATCHERS))
def test_torchtitan_form_matches_its_container_at_ep1(dispatcher):
    torch.manual_seed(0)
    reference = SortedRowExperts()
    counts = torch.tensor([3, 0, 5, 2, 1, 4, 0, 2])
    rows = torch.randn(int(counts.sum()) + 3, reference.w1.shape[-1])  # 3 padding rows: zeros out
    converted = _ep1(reference, dispatcher)
    _assert_same_training_step(reference, converted, rows, counts)
    assert not converted(rows, counts)[-3:].any()


def test_a_module_no_form_matches_is_a_config_error_naming_field_and_fix():
    model = nn.Sequential(nn.Linear(4, 4))
    with readme_form(), pytest.raises(ConfigError) as caught:
        resolve_ep_plan(model, EPPlanConfig(apply_modules=["0"]), 2, resolve_model_facts(model))
    error = caught.value
    assert error.field == "ep_plan.apply_modules" and error.value == "0"
    assert "register_expert_form" in error.fix and "Linear is not an expert container" in error.reason
    for form in (FusedExperts, CountedExperts):
        assert form.form in error.reason
    assert "3-D weight [E, H, H]" in error.reason  # the user's form is listed too


def test_register_expert_form_refuses_what_cannot_serve():
    class Unnamed(ExpertAdapter):
        detect = classmethod(lambda cls, module: None)
        keep_local_experts = eager = lambda self, *args: None

    class Incomplete(ExpertAdapter):
        form = "no eager"
        detect = classmethod(lambda cls, module: None)

    for bad in (Unnamed, Incomplete, nn.Linear):
        with pytest.raises(TypeError):
            register_expert_form(bad)
    assert not {Unnamed, Incomplete} & set(expert_forms())
