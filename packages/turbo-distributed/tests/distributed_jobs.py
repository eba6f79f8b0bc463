"""Rank functions shared by this package's parity tests (importable by the spawned ranks)."""

from fsdp_turbo.core.testing import make_token_batches, shard_rows, train_steps
from fsdp_turbo.core.testing.models import tiny_hf_causal_lm

STEPS = 4
BATCHES = make_token_batches(vocab_size=256, global_batch=8, seq_len=16, steps=STEPS)
TOLERANCES = {"loss_rtol": 1e-5, "grad_rtol": 1e-4, "grad_atol": 1e-6}


def reference_run(kind, batches, model_kwargs=None, clip=None):
    return train_steps(tiny_hf_causal_lm(kind, **(model_kwargs or {})), batches, clip_grad_norm=clip)


def _facts(model, batch):
    from torch.distributed.tensor import DTensor

    facts = {
        "dtensor": {n: isinstance(p, DTensor) for n, p in model.named_parameters()},
        "placements": {n: str(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)},
        "local_rows": {n: p.to_local().shape[0] for n, p in model.named_parameters() if isinstance(p, DTensor)},
        "class": type(model).__name__,
        "config_passthrough": model.config.num_hidden_layers,
    }
    # After the parameter facts: a forward leaves the FSDP root's parameters unsharded.
    logits = model(input_ids=batch).logits
    facts["logits"] = (type(logits).__name__, str(getattr(logits, "placements", None)),
                       tuple(logits.to_local().shape if isinstance(logits, DTensor) else logits.shape))
    return facts


def facade_run(kind, batches, config, model_kwargs=None, clip=None, inspect=False):
    from fsdp_turbo.fsdp_turbo import FSDPTurbo

    model = FSDPTurbo(config, tiny_hf_causal_lm(kind, **(model_kwargs or {})))
    state = model.parallel_state
    local = [shard_rows(b, state.dp_rank, state.dp_size) for b in batches]
    record = train_steps(model, local, clip_grad_norm=clip)
    return (record, _facts(model, local[0])) if inspect else record
