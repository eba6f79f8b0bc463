"""``fsdp_turbo.ops.fla``: the gated delta rule ops against transformers' own references, and
in place of a real (tiny, random) Qwen3-Next / Qwen3.5 model's, the way LLaMA-Factory installs them."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from functools import partial

import pytest
import torch
from torch.nn.functional import logsigmoid

import fsdp_turbo.ops.fla  # registers the ops, as clients import it
from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.ops import LazyKernel, library_available
from fsdp_turbo.ops.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from fsdp_turbo.ops.registry import get_op
from fsdp_turbo.utils.patch import patch_model_members

qwen3_next = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
# The torch references themselves: transformers wraps them to call fla where it is installed
REF_CHUNK = getattr(qwen3_next.torch_chunk_gated_delta_rule, "__wrapped__", qwen3_next.torch_chunk_gated_delta_rule)
REF_RECURRENT = getattr(qwen3_next.torch_recurrent_gated_delta_rule, "__wrapped__",
                        qwen3_next.torch_recurrent_gated_delta_rule)
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _inputs(seed, batch=2, length=37, heads=2, value_heads=2, head_dim=8, value_dim=6, with_state=True):
    """Leaf tensors q, k, v, g, beta, h0 in fla's layout. Keys of norm ~1 keep the un-normalized
    delta rule stable (|beta k.k| < 2), so the float32 comparison is about the algorithm."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, head_dim, generator=gen)
    k = torch.randn(batch, length, heads, head_dim, generator=gen) * head_dim ** -0.5
    v = torch.randn(batch, length, value_heads, value_dim, generator=gen)
    g = logsigmoid(torch.randn(batch, length, value_heads, generator=gen))  # log-decays <= 0
    beta = torch.rand(batch, length, value_heads, generator=gen)
    h0 = torch.randn(batch, value_heads, head_dim, value_dim, generator=gen) if with_state else None
    return [x.requires_grad_() if x is not None else None for x in (q, k, v, g, beta, h0)]


def _loss_and_grads(outputs, leaves, seed=0):
    """A random linear functional of (o, final state) and its gradients w.r.t. every leaf."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((x * torch.randn(x.shape, generator=gen)).sum() for x in outputs if x is not None)
    grads = torch.autograd.grad(loss, [x for x in leaves if x is not None])
    return [x.detach() for x in outputs if x is not None], list(grads)


def _assert_same(ours, theirs):
    for mine, ref in zip(ours[0] + ours[1], theirs[0] + theirs[1], strict=True):
        torch.testing.assert_close(mine, ref, **TOL)


@pytest.mark.parametrize(("chunk_size", "l2norm", "length"), [
    *itertools.product((16, 32, 64), (True, False), (37,)),  # 37: not a multiple of any chunk size
    (16, True, 64), (64, True, 5),  # whole chunks; shorter than one chunk
])
@pytest.mark.parametrize("with_state", [True, False])
def test_chunk_op_matches_transformers_reference(chunk_size, l2norm, length, with_state):
    leaves = _inputs(1, length=length, with_state=with_state)
    q, k, v, g, beta, h0 = leaves
    ours = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=l2norm, chunk_size=chunk_size)
    ref = REF_CHUNK(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                    use_qk_l2norm_in_kernel=l2norm, chunk_size=chunk_size)
    assert ours[0].shape == v.shape and ours[1].dtype == torch.float32
    _assert_same(_loss_and_grads(ours, leaves), _loss_and_grads(ref, leaves))


@pytest.mark.parametrize(("l2norm", "with_state"), list(itertools.product((True, False), (True, False))))
def test_recurrent_op_matches_transformers_reference(l2norm, with_state):
    leaves = _inputs(2, length=13, with_state=with_state)
    q, k, v, g, beta, h0 = leaves
    ours = fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=l2norm)
    ref = REF_RECURRENT(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=l2norm)
    _assert_same(_loss_and_grads(ours, leaves), _loss_and_grads(ref, leaves))


@pytest.mark.parametrize("op", [partial(chunk_gated_delta_rule, chunk_size=16), fused_recurrent_gated_delta_rule])
def test_scale_multiplies_the_queries(op):
    """transformers' references always scale by 1/sqrt(K); fla's ``scale`` replaces that factor."""
    leaves = _inputs(3, length=21)
    q, k, v, g, beta, h0 = leaves
    scale, head_dim = 0.3, q.shape[-1]
    ours = op(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    ref = REF_CHUNK(q * (scale * head_dim ** 0.5), k, v, g=g, beta=beta, initial_state=h0, output_final_state=True)
    _assert_same(_loss_and_grads(ours, leaves), _loss_and_grads(ref, leaves))


@pytest.mark.parametrize("op", [partial(chunk_gated_delta_rule, chunk_size=16), fused_recurrent_gated_delta_rule])
def test_grouped_value_heads_share_query_key_heads(op):
    """HV = 2 H: query/key head h serves value heads 2h and 2h+1 (fla's grouped value attention)."""
    leaves = _inputs(4, length=19, heads=2, value_heads=4)
    q, k, v, g, beta, h0 = leaves
    ours = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref = REF_CHUNK(q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2), v, g=g, beta=beta,
                    initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    _assert_same(_loss_and_grads(ours, leaves), _loss_and_grads(ref, leaves))


@pytest.mark.parametrize(("chunk_size", "length"), [(16, 1), (16, 50), (32, 31), (64, 70)])
def test_chunked_equals_recurrent(chunk_size, length):
    leaves = _inputs(5, length=length, heads=1, value_heads=3, head_dim=4, value_dim=5)
    q, k, v, g, beta, h0 = leaves
    kwargs = {"initial_state": h0, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    chunked = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    recurrent = fused_recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)
    _assert_same(_loss_and_grads(chunked, leaves), _loss_and_grads(recurrent, leaves))


@pytest.mark.parametrize("op", [partial(chunk_gated_delta_rule, chunk_size=16), fused_recurrent_gated_delta_rule])
def test_packed_sequences_run_independently(op):
    """``cu_seqlens``: sequences packed in batch 1 (one empty) equal each sequence run alone from its own state."""
    bounds = [0, 7, 7, 30, 41]
    leaves = _inputs(6, batch=1, length=bounds[-1], with_state=False)
    q, k, v, g, beta, _ = leaves
    h0 = torch.randn(len(bounds) - 1, *v.shape[2:3], q.shape[-1], v.shape[-1]).requires_grad_()
    leaves[-1] = h0
    ours = op(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.tensor(bounds))
    alone = [REF_CHUNK(*(x[:, a:b] for x in (q, k, v)), g=g[:, a:b], beta=beta[:, a:b], initial_state=h0[i:i + 1],
                       output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16)
             for i, (a, b) in enumerate(itertools.pairwise(bounds))]
    ref = (torch.cat([o for o, _ in alone], dim=1), torch.cat([s for _, s in alone], dim=0))
    _assert_same(_loss_and_grads(ours, leaves), _loss_and_grads(ref, leaves))


@pytest.mark.parametrize("op", [partial(chunk_gated_delta_rule, chunk_size=16), fused_recurrent_gated_delta_rule])
def test_low_precision_inputs_compute_in_float32(op):
    """bfloat16 in: the output comes back in bfloat16, the state in float32, both from float32 math."""
    q, k, v, g, beta, h0 = (x.detach() for x in _inputs(8, length=20))
    low = op(*(x.bfloat16() for x in (q, k, v, g, beta)), initial_state=h0, output_final_state=True)
    full = op(*(x.bfloat16().float() for x in (q, k, v, g, beta)), initial_state=h0, output_final_state=True)
    assert low[0].dtype == torch.bfloat16 and low[0].is_contiguous() and low[1].dtype == torch.float32
    torch.testing.assert_close(low[0], full[0].bfloat16())
    torch.testing.assert_close(low[1], full[1])


@pytest.mark.parametrize(("call", "field"), [
    (lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=torch.tensor([0, 5, 9])), "cu_seqlens"),
    (lambda q, k, v, g, b: chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], b[:1], cu_seqlens=[0, 4]), "cu_seqlens"),
    (lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, initial_state=torch.zeros(2, 2, 8, 8)),
     "initial_state"),
    (lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g, b, chunk_size=0), "chunk_size"),
    (lambda q, k, v, g, b: chunk_gated_delta_rule(q, k, v, g[..., :1], b), "g"),
    (lambda q, k, v, g, b: fused_recurrent_gated_delta_rule(q, k[..., :4], v, g, b), "q"),
    (lambda q, k, v, g, b: fused_recurrent_gated_delta_rule(q, k, v, g, b, use_gate_in_kernel=True),
     "use_gate_in_kernel"),
])
def test_bad_arguments_are_config_errors_naming_the_argument(call, field):
    q, k, v, g, beta, _ = (x.detach() if x is not None else None for x in _inputs(7, length=9, with_state=False))
    with pytest.raises(ConfigError) as raised:
        call(q, k, v, g, beta)
    assert raised.value.field == field and "Fix:" in str(raised.value)


def test_the_registry_serves_the_portable_ops_and_fla_only_on_cuda(monkeypatch):
    monkeypatch.setenv("FSDP_TURBO_DEVICE", "cpu")
    assert get_op("chunk_gated_delta_rule") is chunk_gated_delta_rule
    assert get_op("fused_recurrent_gated_delta_rule") is fused_recurrent_gated_delta_rule
    cuda = get_op("chunk_gated_delta_rule", "cuda")
    if library_available("fla"):  # fla's kernels, imported on the first call only
        assert isinstance(cuda, LazyKernel) and cuda.module == "fsdp_turbo.ops.fla.cuda"
    else:
        assert cuda is chunk_gated_delta_rule
    assert getattr(importlib.import_module("fsdp_turbo.ops"), "__file__", None) is None  # still a namespace package


# --- in a model -----------------------------------------------------------------------------------------------

def _qwen3_next(modeling):
    config = modeling.Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16, **_TINY)
    return modeling.Qwen3NextForCausalLM(config), modeling.Qwen3NextGatedDeltaNet


def _qwen3_5(modeling):
    config = importlib.import_module("transformers.models.qwen3_5.configuration_qwen3_5").Qwen3_5TextConfig(**_TINY)
    return modeling.Qwen3_5ForCausalLM(config), modeling.Qwen3_5GatedDeltaNet


def _qwen3_5_moe(modeling):
    config = importlib.import_module("transformers.models.qwen3_5_moe.configuration_qwen3_5_moe").Qwen3_5MoeTextConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, **_TINY)
    return modeling.Qwen3_5MoeForCausalLM(config), modeling.Qwen3_5MoeGatedDeltaNet


_TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
         "layer_types": ["linear_attention", "full_attention", "linear_attention"]}
_MODELS = {  # name: (modeling module, builder of (tiny model, its GatedDeltaNet class))
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", _qwen3_next),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", _qwen3_5),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", _qwen3_5_moe),
}


def _torch_references_only(modeling, monkeypatch):
    """Keep the unpatched baseline on transformers' torch code where fla is installed too (its
    Triton kernels take no CPU tensors): unwrap the module functions transformers points at fla,
    and drop the fla functions that transformers <= 5.6 binds to each module at construction."""
    for function in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        wrapped = getattr(modeling, function)
        monkeypatch.setattr(modeling, function, getattr(wrapped, "__wrapped__", wrapped))
    for function in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        if hasattr(modeling, function):
            monkeypatch.setattr(modeling, function, None)


def _build(name, monkeypatch):
    if importlib.util.find_spec(f"transformers.models.{name}") is None:
        pytest.skip(f"this transformers has no {name}")
    monkeypatch.setenv("FSDP_TURBO_DEVICE", "cpu")  # the ops' CPU kernels, as the model runs on the CPU
    modeling = importlib.import_module(_MODELS[name][0])
    _torch_references_only(modeling, monkeypatch)
    torch.manual_seed(0)
    model, delta_net = _MODELS[name][1](modeling)
    return modeling, model.float(), delta_net


def _train_step(model):
    """Loss and parameter gradients of one step on a batch whose length (21) is not a multiple of 16."""
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@torch.no_grad()
def _decode_step(model):
    """Prefill 11 tokens (the chunk op, keeping its final state), then decode one (the recurrent op)."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    prefill = model(input_ids=ids[:, :-1], use_cache=True)
    return model(input_ids=ids[:, -1:], past_key_values=prefill.past_key_values, use_cache=True).logits


def _assert_model_unchanged(before, after):
    (loss, grads), logits = before
    (loss2, grads2), logits2 = after
    torch.testing.assert_close(loss2, loss, **TOL)
    assert grads2.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], **TOL, msg=name)
    torch.testing.assert_close(logits2, logits, **TOL)


def _calls(op, log):
    def counted(*args, **kwargs):
        log.append(op)
        return op(*args, **kwargs)
    return counted


@pytest.mark.parametrize("name", list(_MODELS))
def test_client_patch_path_keeps_the_model(name, monkeypatch):
    """LLaMA-Factory's path: ``patch_model_members(model, 'Module.Class.chunk_gated_delta_rule',
    partial(get_op(...), chunk_size=16))`` and the recurrent op onto ``recurrent_gated_delta_rule``.

    transformers 5.6 (LLaMA-Factory's pin) keeps the two functions as members of each GatedDeltaNet
    module; later ones (5.23) call module-level functions instead: then there is no member to patch,
    and patching says so with a ConfigError naming it."""
    _, model, delta_net = _build(name, monkeypatch)
    count = sum(isinstance(m, delta_net) for m in model.modules())
    prefix = f"{delta_net.__module__}.{delta_net.__name__}"
    if not any(hasattr(m, "chunk_gated_delta_rule") for m in model.modules() if isinstance(m, delta_net)):
        with pytest.raises(ConfigError, match="chunk_gated_delta_rule"):
            patch_model_members(model, f"{prefix}.chunk_gated_delta_rule", get_op("chunk_gated_delta_rule"))
        return
    before = (_train_step(model), _decode_step(model))
    ran = []
    chunk = partial(get_op("chunk_gated_delta_rule"), chunk_size=16)
    recurrent = get_op("fused_recurrent_gated_delta_rule")
    assert patch_model_members(model, f"{prefix}.chunk_gated_delta_rule", _calls(chunk, ran)) == count == 2
    assert patch_model_members(model, f"{prefix}.recurrent_gated_delta_rule", _calls(recurrent, ran)) == count
    _assert_model_unchanged(before, (_train_step(model), _decode_step(model)))
    # 2 linear-attention layers: training and prefill use the chunk op, the decoded token the recurrent one
    assert ran.count(chunk) == 4 and ran.count(recurrent) == 2


@pytest.mark.parametrize("name", list(_MODELS))
def test_ops_replace_the_modeling_functions(name, monkeypatch):
    """transformers after 5.6 (5.23) calls ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
    of the modeling module (fla's where installed): the ops, put there, give the same loss, gradients and
    decoded logits, called with that forward's own arguments (heads not repeated, ``cu_seqlens=None``)."""
    modeling, model, delta_net = _build(name, monkeypatch)
    if any(hasattr(m, "chunk_gated_delta_rule") for m in model.modules() if isinstance(m, delta_net)):
        pytest.skip("this transformers calls the ops through module members: see the client path test")
    before = (_train_step(model), _decode_step(model))
    ran = []
    chunk = partial(get_op("chunk_gated_delta_rule"), chunk_size=16)
    recurrent = get_op("fused_recurrent_gated_delta_rule")
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", _calls(chunk, ran))
    monkeypatch.setattr(modeling, "torch_recurrent_gated_delta_rule", _calls(recurrent, ran))
    _assert_model_unchanged(before, (_train_step(model), _decode_step(model)))
    # 2 linear-attention layers: training and prefill use the chunk op, the decoded token the recurrent one
    assert ran.count(chunk) == 4 and ran.count(recurrent) == 2


# ----- Kimi Delta Attention: one log-decay per key channel ------------------------------------
kimi_linear = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
REF_KDA_CHUNK = getattr(kimi_linear.chunk_kimi_delta_attention, "__wrapped__",
                        kimi_linear.chunk_kimi_delta_attention)


def _kda_inputs(seed, batch=2, length=37, heads=2, head_dim=8, value_dim=6):
    """q, k, v, g (a log-decay per key channel, strong in some channels), beta, h0."""
    q, k, v, _, beta, h0 = _inputs(seed, batch, length, heads, heads, head_dim, value_dim)
    gen = torch.Generator().manual_seed(seed + 1)
    g = (logsigmoid(torch.randn(batch, length, heads, head_dim, generator=gen)) * 4).requires_grad_()
    return q, k, v, g, beta, h0


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_kda_chunked_equals_its_recurrence_and_transformers(chunk_size):
    """The chunked KDA (any chunk size) against the token-by-token form and transformers' own
    chunked reference (chunk 64), with l2-normalised q/k, an initial state and the final state;
    outputs and every input's gradient."""
    leaves = _kda_inputs(3)
    q, k, v, g, beta, h0 = leaves
    ours = _loss_and_grads(fsdp_turbo.ops.fla.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                        use_qk_l2norm_in_kernel=True, chunk_size=chunk_size), leaves)
    token = _loss_and_grads(fsdp_turbo.ops.fla.fused_recurrent_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True), leaves)
    theirs = _loss_and_grads(REF_KDA_CHUNK(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True), leaves)
    _assert_same(ours, token)
    _assert_same(ours, theirs)


def test_kda_packed_sequences_run_independently():
    q, k, v, g, beta, _ = (x.detach() for x in _kda_inputs(4, batch=1, length=20) if x is not None)
    bounds = [0, 6, 6, 20]  # an empty sequence included
    packed, states = get_op("chunk_kda", "cpu")(q, k, v, g, beta, cu_seqlens=torch.tensor(bounds),
                                                output_final_state=True)
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        alone, state = fsdp_turbo.ops.fla.fused_recurrent_kda(*(x[:, a:b] for x in (q, k, v, g, beta)),
                                                              output_final_state=True)
        torch.testing.assert_close(packed[:, a:b], alone, **TOL)
        torch.testing.assert_close(states[i:i + 1], state, **TOL)


def test_kda_refuses_a_decay_per_head():
    q, k, v, _, beta, _ = _inputs(5)
    with pytest.raises(ConfigError, match="one log-decay per key channel") as caught:
        fsdp_turbo.ops.fla.chunk_kda(q, k, v, torch.zeros(v.shape[:3]), beta)
    assert caught.value.field == "g"
