"""The README's "Add an expert form" example, run as written, and the toy containers it and
torchtitan's built-in form fit (importable by the spawned ranks)."""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from fsdp_turbo.distributed.expert_parallel import unregister_expert_form

README = Path(__file__).resolve().parents[1] / "README.md"
NUM_EXPERTS, HIDDEN, TOP_K = 8, 16, 2


@contextlib.contextmanager
def readme_form() -> Iterator[type]:
    """Run the README's example block (which registers ``TanhExperts``); unregister it after."""
    section = README.read_text(encoding="utf-8").split("### Add an expert form", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    namespace = {"__name__": "readme_expert_form"}
    exec(compile(code, f"{README}:Add an expert form", "exec"), namespace)  # the README block, as written
    form = namespace["TanhExperts"]
    try:
        yield form
    finally:
        unregister_expert_form(form)


class TanhMoE(nn.Module):
    """A container the README form fits: expert ``e`` is ``tanh(x @ weight[e].T)``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN) / HIDDEN**0.5)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            mapped = torch.tanh(torch.einsum("th,tgh->tg", hidden_states, self.weight[top_k_index[:, k]]))
            out = out + top_k_weights[:, k, None] * mapped
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = TanhMoE()


class SortedRowExperts(nn.Module):
    """Stands in for torchtitan's ``GroupedExperts`` (no torchtitan import): its for-loop path,
    padding rows included."""

    def __init__(self, hidden: int = HIDDEN, inter: int = 24) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(NUM_EXPERTS, inter, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(NUM_EXPERTS, hidden, inter) / inter**0.5)
        self.w3 = nn.Parameter(torch.randn(NUM_EXPERTS, inter, hidden) / hidden**0.5)

    def forward(self, x, num_tokens_per_expert):
        counts = num_tokens_per_expert.tolist()
        parts = x[: sum(counts)].split(counts)
        out = [(nn.functional.silu(p @ self.w1[e].T) * (p @ self.w3[e].T)) @ self.w2[e].T for e, p in enumerate(parts)]
        return torch.vstack([*out, x.new_zeros(x.shape[0] - sum(counts), x.shape[1])])


def routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
    states = torch.randn(tokens, HIDDEN, generator=generator)
    return states, index, torch.rand(tokens, TOP_K, generator=generator)


def ep2_against_whole(dispatchers: list[str]) -> dict[str, float]:
    """Per dispatcher, the README form at EP=2 (through ``apply_expert_parallel``) against the
    whole container on all ranks' tokens: the largest difference of outputs and gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_turbo.distributed.expert_parallel import apply_expert_parallel
    from fsdp_turbo.fsdp_turbo_config import EPPlanConfig

    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    whole = Block()
    states, index, weights = routing(tokens=18)
    probe = torch.randn(18, HIDDEN, generator=torch.Generator().manual_seed(1))
    mine = slice(9 * rank, 9 * (rank + 1))
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in (states, index, weights)]
    (whole.experts(*inputs) * probe).sum().backward()
    worst = {}
    with readme_form():
        for dispatcher in dispatchers:
            model = copy.deepcopy(whole)
            model.zero_grad(set_to_none=True)
            apply_expert_parallel(model, EPPlanConfig(apply_modules=["experts"], dispatcher=dispatcher), mesh)
            local = [t[mine].clone().requires_grad_(t.is_floating_point()) for t in (states, index, weights)]
            out = model.experts(*local)
            (out * probe[mine]).sum().backward()
            with torch.no_grad():
                expected_out = whole.experts(*[t[mine] for t in (states, index, weights)])
            held = slice(4 * rank, 4 * (rank + 1))  # rank r holds experts [4r, 4r + 4)
            worst[dispatcher] = max(float((out.detach() - expected_out).abs().max()),
                                    float((local[0].grad - inputs[0].grad[mine]).abs().max()),
                                    float((local[2].grad - inputs[2].grad[mine]).abs().max()),
                                    float((model.experts.weight.grad.to_local() - whole.experts.weight.grad[held])
                                          .abs().max()))
    return worst
