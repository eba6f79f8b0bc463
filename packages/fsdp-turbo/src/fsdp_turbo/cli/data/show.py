"""``fsdp-turbo data JOB --show N``: what the model will be trained on, before it is.

Statistics of every source (documents, tokens, loss tokens, windows, the padding and the
truncated fractions), then the first N training sequences in training order, decoded:
``⟦…⟧`` encloses the tokens that carry loss, ``│`` separates packed documents.
"""

from __future__ import annotations

from fsdp_turbo.core.model_facts import IGNORE_INDEX

OPEN, CLOSE, BOUNDARY = "⟦", "⟧", " │ "


def _fraction(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def source_lines(kind: str, prepared, weight: float | None, seq_len: int) -> list[str]:
    stats = prepared.stats
    padding = _fraction(stats["padding_tokens"], stats["windows"] * seq_len)
    what = "SFT (messages)" if prepared.spec.sft else "text"
    weight_text = f", weight {weight:g}" if weight is not None else ""
    return [f"{kind} {prepared.spec.field}: {prepared.spec.path} [{what}{weight_text}]",
            f"  {stats['documents']:,} documents, {stats['tokens']:,} tokens, {stats['loss_tokens']:,} carry loss "
            f"({_fraction(stats['loss_tokens'], stats['tokens'])})",
            f"  {stats['windows']:,} windows of {seq_len}: padding {padding}"
            f", truncated {_fraction(stats['dropped_tokens'], stats['tokens'])}, "
            f"{stats['pieces'] - stats['documents']:,} documents split into pieces"]


def marked(tokenizer, ids: list[int], labels: list[int], positions: list[int],
           ignore_index: int = IGNORE_INDEX) -> str:
    """One row decoded: loss-carrying runs in ⟦⟧, a │ where a document (or the padding) starts."""
    out, run, carrying = [], [], False
    for index, (token, label, position) in enumerate(zip(ids, labels, positions, strict=True)):
        starts = index > 0 and position == 0
        carries = label != ignore_index
        if run and (starts or carries != carrying):
            text = tokenizer.decode(run)
            out.append(f"{OPEN}{text}{CLOSE}" if carrying else text)
            run = []
        if starts:
            out.append(BOUNDARY)
        run.append(token)
        carrying = carries
    if run:
        text = tokenizer.decode(run)
        out.append(f"{OPEN}{text}{CLOSE}" if carrying else text)
    return "".join(out)


def _padding_start(batch, pad_id: int) -> int:
    """Where row 0's padding starts (its length when it has none)."""
    if batch.attention_mask is not None:
        return int(batch.attention_mask[0].sum())
    positions = batch.position_ids[0]
    last = int((positions == 0).nonzero().flatten()[-1])  # packing: the padding restarts at 0 too
    ignored = bool((batch.labels[0, last:] == batch.ignore_index).all() and (batch.input_ids[0, last:] == pad_id).all())
    return last if last > 0 and ignored and int(positions[-1]) == positions.numel() - last - 1 else positions.numel()


def show(data, job_data, count: int) -> str:
    """The report for a job's ``data`` section and its prepared ``JobData``."""
    lines = [f"tokenizer: {data.tokenizer} ({job_data.tokenizer.vocab_size:,} tokens); seq_len {data.seq_len}, "
             f"packing {'on' if data.packing else 'off'}, overflow {data.overflow}"]
    weights = [s.weight for s in data.sources] if data.sources is not None else [1.0]
    for prepared, weight in zip(job_data.train_sources, weights, strict=True):
        lines += source_lines("train", prepared, weight, data.seq_len)
    for prepared in job_data.eval_sources:
        lines += source_lines("eval", prepared, None, data.seq_len)
    stream = job_data.train
    for position in range(count):
        batch = stream.batch_at(position, 1)
        source, window = stream.windows_at(position, 1)[0]
        lines.append(f"--- sequence {position} (source {job_data.train_sources[source].spec.field}, window {window}, "
                     f"{int((batch.labels[0] != batch.ignore_index).sum())} tokens carry loss)")
        ids, labels, positions = (t[0].tolist() for t in (batch.input_ids, batch.labels, batch.position_ids))
        used = _padding_start(batch, job_data.tokenizer.pad_id)
        padding = f"{BOUNDARY}<{len(ids) - used} padding>" if used < len(ids) else ""
        lines.append(marked(job_data.tokenizer, ids[:used], labels[:used], positions[:used], batch.ignore_index)
                     + padding)
    return "\n".join(lines)
