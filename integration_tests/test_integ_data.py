"""The data pipeline in one process (and, for the cache, in 4 at once): every format reads
the same documents, SFT masks equal a hand-computed mask, packing keeps every token once,
mixing follows the weights, and a resumed stream continues exactly, at any dp size."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_turbo.cli.data import load_data
from fsdp_turbo.cli.data.loader import IGNORE
from fsdp_turbo.cli.data.packing import cut_documents, pack
from fsdp_turbo.cli.data.tokenizer import HFTokenizer
from fsdp_turbo.cli.job_config import DataSection
from fsdp_turbo.core.testing import run_distributed

datasets = pytest.importorskip("datasets")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft_tiny"
TOKENIZER = str(EXAMPLE / "tokenizer")
DOCS = [f"document {i}: " + "word " * (3 + 7 * i % 23) for i in range(40)]


def _load(tmp_path, sources=None, **data):
    fields = {"tokenizer": TOKENIZER, "seq_len": 32, **data}
    if sources is not None:
        fields["sources"] = sources
    return load_data(DataSection.from_dict(fields), tmp_path / "out", seed=0, vocab_size=4096)


def _all_tokens(source) -> list[list[int]]:
    return source.tokens.column("input_ids").to_pylist()


@pytest.fixture(scope="module")
def formats(tmp_path_factory):
    """The same 40 documents as jsonl, json, parquet, csv, txt (a file each) and save_to_disk."""
    root = tmp_path_factory.mktemp("formats")
    rows = [{"text": d, "n": i} for i, d in enumerate(DOCS)]
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "docs.json").write_text(json.dumps(rows))
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(root / "docs.parquet"))
    table.to_csv(str(root / "docs.csv"), index=False)
    table.save_to_disk(str(root / "saved"))
    (root / "txt").mkdir()
    for i, d in enumerate(DOCS):
        (root / "txt" / f"{i:03d}.txt").write_text(d)
    return root


@pytest.mark.parametrize("path", ["docs.jsonl", "docs.json", "docs.parquet", "docs.csv", "saved", "txt/*.txt"])
def test_every_format_reads_the_same_documents(formats, tmp_path, path):
    data = _load(tmp_path, [{"path": str(formats / path), "text_field": "text"}])
    plain = HFTokenizer(TOKENIZER).hf(DOCS)["input_ids"]  # transformers' own batched call, and EOS
    expected = [[*ids, HFTokenizer(TOKENIZER).eos_id] for ids in plain]
    assert _all_tokens(data.train_sources[0]) == expected
    assert data.train_sources[0].stats["documents"] == len(DOCS)


def test_sft_labels_are_exactly_the_assistant_turns(tmp_path):
    """Hand-computed: each ChatML segment tokenized alone; only the assistant's content and
    its end of turn (``<|im_end|>`` and the newline after it) carry loss."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "Six, of course."}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    data = _load(tmp_path, [{"path": str(tmp_path / "chat.jsonl"), "messages_field": "messages"}], seq_len=128)
    tokenizer = data.tokenizer
    ids, mask = [], []
    for m in messages:
        head = tokenizer.encode_with_offsets(f"<|im_start|>{m['role']}\n")[0]
        body = tokenizer.encode_with_offsets(f"{m['content']}<|im_end|>\n")[0]
        ids += head + body
        mask += [False] * len(head) + [m["role"] == "assistant"] * len(body)
    row = data.train_sources[0].tokens.slice(0, 1).to_pylist()[0]
    assert row["input_ids"] == ids
    assert row["labels"] == [i if keep else IGNORE for i, keep in zip(ids, mask, strict=True)]
    batch = data.train.next_batch(1, 0, 1)
    carried = [int(i) for i, lab in zip(batch.input_ids[0], batch.labels[0], strict=True) if lab != IGNORE]
    assert tokenizer.decode(carried) == "Four.<|im_end|>\nSix, of course.<|im_end|>\n"


@pytest.mark.parametrize("overflow", ["split", "truncate"])
@pytest.mark.parametrize("packing", [True, False])
def test_packing_keeps_every_token_once_and_never_crosses_a_window(overflow, packing):
    lengths = np.array([5, 40, 1, 17, 16, 0, 33, 8, 8, 8, 64, 2])
    doc, start, length, dropped = cut_documents(lengths, 16, overflow, "x")
    windows = pack(doc, start, length, 16, packing, dropped)
    seen: dict[int, list[int]] = {}
    for w in range(len(windows)):
        pieces = windows.pieces(w)
        assert sum(n for _, _, n in pieces) <= 16
        assert packing or len(pieces) == 1
        for d, s, n in pieces:
            seen.setdefault(d, []).extend(range(s, s + n))
    for d, n in enumerate(lengths):
        kept = n if overflow == "split" else min(n, 16)
        assert sorted(seen.get(d, [])) == list(range(kept)), d
    assert windows.dropped_tokens == (0 if overflow == "split" else int(np.maximum(lengths - 16, 0).sum()))
    if packing:  # first-fit fills: the 5-, 1- and 8-token pieces share windows
        assert len(windows) < len(doc)


def test_a_packed_row_restarts_positions_and_predicts_nothing_across_a_boundary(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a b c", "d e", "f g h i"]))
    data = _load(tmp_path, [{"path": str(tmp_path / "d.jsonl"), "text_field": "text"}], seq_len=64)
    batch = data.train.next_batch(1, 0, 1)
    starts = (batch.position_ids[0] == 0).nonzero().flatten().tolist()
    assert len(starts) == 4  # three documents and the padding
    assert all(batch.labels[0, s] == IGNORE for s in starts)
    assert batch.attention_mask is None
    unpacked = _load(tmp_path, [{"path": str(tmp_path / "d.jsonl"), "text_field": "text"}], seq_len=64,
                     packing=False).train.next_batch(3, 0, 1)
    assert unpacked.attention_mask.sum().item() == data.train_sources[0].stats["tokens"]
    assert unpacked.position_ids.equal(torch.arange(64).expand(3, 64))


def test_mixing_follows_the_weights_deterministically(tmp_path):
    for name, count in (("a", 300), ("b", 100)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} {i} " * 6}) + "\n"
                                                        for i in range(count)))
    sources = [{"path": str(tmp_path / "a.jsonl"), "text_field": "text", "weight": 1},
               {"path": str(tmp_path / "b.jsonl"), "text_field": "text", "weight": 3}]
    stream = _load(tmp_path, sources).train
    drawn = stream.windows_at(0, 8000)
    share_b = sum(s for s, _ in drawn) / len(drawn)
    assert abs(share_b - 0.75) < 0.02
    again = _load(tmp_path, sources).train.windows_at(0, 8000)
    assert drawn == again
    windows_b = len(stream.sources[1].windows)
    first_epoch_b = [w for s, w in drawn if s == 1][:windows_b]
    assert sorted(first_epoch_b) == list(range(windows_b))  # each window once an epoch
    other_seed = load_data(DataSection.from_dict({"tokenizer": TOKENIZER, "seq_len": 32, "sources": sources}),
                           tmp_path / "out", seed=1, vocab_size=4096).train.windows_at(0, 100)
    assert other_seed != drawn[:100]


def test_a_resumed_stream_takes_every_window_once_at_another_dp_size(tmp_path):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i} " * (i % 9 + 1)}) + "\n"
                                              for i in range(200)))
    sources = [{"path": str(tmp_path / "d.jsonl"), "text_field": "text"}]
    whole = _load(tmp_path, sources).train
    expected = [row.tolist() for _ in range(14) for row in whole.next_batch(2, 0, 1).input_ids]  # 28 windows

    taken = []
    first = _load(tmp_path, sources).train
    for _ in range(3):  # 3 steps at dp=2 (4 windows a step)
        taken += [r.tolist() for rank in range(2) for r in first.batch_at(first.consumed + rank * 2, 2).input_ids]
        first.consumed += 4
    state = json.loads(json.dumps(first.state_dict()))  # as the checkpoint keeps it
    second = _load(tmp_path, sources).train
    second.load_state_dict(state)
    for _ in range(2):  # 2 steps at dp=4
        taken += [r.tolist() for rank in range(4) for r in second.batch_at(second.consumed + rank * 2, 2).input_ids]
        second.consumed += 8
    assert taken == expected  # nothing skipped, nothing repeated, in the same order


def _prepare_on_a_rank(folder: str) -> bool:
    data = load_data(DataSection.from_dict({"tokenizer": TOKENIZER, "seq_len": 32, "cache_dir": folder + "/cache",
                                            "sources": [{"path": str(EXAMPLE / "train.jsonl"),
                                                         "messages_field": "messages"}]}),
                     folder, seed=0, vocab_size=4096)
    return data.train_sources[0].built


def test_one_process_tokenizes_and_the_others_find_the_cache(tmp_path):
    built = run_distributed(_prepare_on_a_rank, 4, str(tmp_path), init_process_group=False, timeout=300)
    assert sorted(built) == [False, False, False, True]
    assert _prepare_on_a_rank(str(tmp_path)) is False


def test_the_cache_follows_the_files(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "one two three"}) + "\n")
    first = _load(tmp_path, [{"path": str(path), "text_field": "text"}]).train_sources[0]
    path.write_text(json.dumps({"text": "one two three four five"}) + "\n")
    second = _load(tmp_path, [{"path": str(path), "text_field": "text"}]).train_sources[0]
    assert first.key != second.key and second.built
    assert second.stats["tokens"] > first.stats["tokens"]
