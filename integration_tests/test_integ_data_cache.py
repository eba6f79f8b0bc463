"""The data cache and the tokenizer fingerprint, in one process on real files: the
fingerprint reads the tokenizer's files and never the model weights beside them; a file
rewritten to the same size with its mtime set back is tokenized again; a copy of the data
keeps its identity, so a loader state still loads; a damaged entry is reported and built
again; a failed build leaves no partial folder; a held lock times out naming the lock."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_turbo.cli.data import load_data
from fsdp_turbo.cli.data.tokenizer import HFTokenizer, tokenizer_files
from fsdp_turbo.cli.job_config import DataSection
from fsdp_turbo.core.errors import ConfigError

pytest.importorskip("datasets")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sft_tiny"
TOKENIZER = str(EXAMPLE / "tokenizer")
GIB = 2**30
# A fresh process: the peak RSS before and after building the tokenizer from the model's
# folder. It builds it first from a copy without the weights, so that what transformers
# imports and caches on the way is in the peak already and only the weights could add to it.
PEAK_RSS = """
import json, resource, sys
from fsdp_turbo.cli.data.tokenizer import HFTokenizer
HFTokenizer(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
tokenizer = HFTokenizer(sys.argv[2])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_mib": (after - before) / 1024, "fingerprint": tokenizer.fingerprint}))
"""


def _data(tmp_path: Path, path: Path, cache: Path | None = None, **data):
    fields = {"tokenizer": TOKENIZER, "seq_len": 32, "cache_dir": str(cache or tmp_path / "cache"),
              "sources": [{"path": str(path), "text_field": "text"}], **data}
    return load_data(DataSection.from_dict(fields), tmp_path / "out", seed=0, vocab_size=4096)


def _write(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def _tokens(source) -> list[list[int]]:
    return source.tokens.column("input_ids").to_pylist()


def _expected(texts: list[str]) -> list[list[int]]:
    return HFTokenizer(TOKENIZER).encode(texts)


def _damage_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is damaged" in r.getMessage()]


@pytest.fixture
def model_folder(tmp_path):
    """The tokenizer in a model's folder, beside two 1 GiB sparse weight files (no disk used)."""
    folder = tmp_path / "model"
    shutil.copytree(TOKENIZER, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    shutil.copytree(folder, tmp_path / "without_weights")
    for name in ("model.safetensors", "shard-00001-of-00002"):
        with (folder / name).open("wb") as handle:
            handle.truncate(GIB)
    return folder


def test_the_fingerprint_reads_the_tokenizer_files_and_no_weights(model_folder):
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, str(model_folder.parent / "without_weights"),
                             str(model_folder)], capture_output=True, text=True, check=True, timeout=300)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["growth_mib"] < 64, measured  # reading a weights file would add 1024 MiB
    tokenizer = HFTokenizer(str(model_folder))
    assert measured["fingerprint"] == tokenizer.fingerprint
    assert {p.name for p in tokenizer_files(model_folder, type(tokenizer.hf))} == {
        "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}

    with (model_folder / "model.safetensors").open("r+b") as handle:  # new weights: the same tokenizer
        handle.write(b"new weights")
    assert HFTokenizer(str(model_folder)).fingerprint == tokenizer.fingerprint
    with (model_folder / "tokenizer.json").open("a") as handle:  # still valid JSON, other bytes
        handle.write("\n")
    assert HFTokenizer(str(model_folder)).fingerprint != tokenizer.fingerprint


def test_a_rewrite_to_the_same_size_with_its_mtime_set_back_is_tokenized_again(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, ["one two three"])
    first = _data(tmp_path, path).train_sources[0]
    stat = path.stat()
    _write(path, ["six two three"])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)

    second = _data(tmp_path, path).train_sources[0]
    assert second.built and second.key != first.key and second.identity != first.identity
    assert _tokens(second) == _expected(["six two three"]) != _tokens(first)


def test_a_copy_of_the_data_has_the_same_identity_and_a_saved_position_still_loads(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, [f"doc {i} " * (i % 9 + 1) for i in range(100)])
    stream = _data(tmp_path, path).train
    stream.next_batch(2, 0, 2)
    state = json.loads(json.dumps(stream.state_dict()))  # as the checkpoint keeps it

    copied = tmp_path / "other_node" / "d.jsonl"  # another node's copy, another cache
    copied.parent.mkdir()
    shutil.copy2(path, copied)
    elsewhere = _data(tmp_path, copied, tmp_path / "other_cache").train
    replaced = tmp_path / "replacement"  # the same path, a new file (a new inode)
    shutil.copy2(path, replaced)
    os.replace(replaced, path)
    again = _data(tmp_path, path).train
    for resumed in (elsewhere, again):
        assert resumed.sources[0].built and resumed.sources[0].key != stream.sources[0].key
        assert resumed.sources[0].identity == stream.sources[0].identity
        resumed.load_state_dict(state)
        assert resumed.consumed == stream.consumed == 4

    _write(path, ["other data"] * 100)
    with pytest.raises(ConfigError, match="written for other data"):
        _data(tmp_path, path).train.load_state_dict(state)


def test_a_position_saved_before_identities_loads_with_one_warning(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    _write(path, [f"doc {i}" for i in range(50)])
    stream = _data(tmp_path, path).train
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        stream.load_state_dict({"consumed": 6, "seed": 0, "sources": ["0123456789abcdef0123"]})
    assert stream.consumed == 6
    assert [r.getMessage() for r in caplog.records if "data identities" in r.getMessage()] != []
    with pytest.raises(ConfigError, match="written for other data"):  # two sources for one: not this data
        stream.load_state_dict({"consumed": 6, "seed": 0, "sources": ["a", "b"]})


def _truncate(path: Path) -> None:
    with path.open("r+b") as handle:
        handle.truncate(path.stat().st_size // 2)


def _garble(path: Path) -> None:
    path.write_bytes(b"\x00garbled" * (path.stat().st_size // 8) + b"\x00" * (path.stat().st_size % 8))


DAMAGE = {"tokens.arrow truncated": ("tokens.arrow", _truncate), "stats.json missing": ("stats.json", Path.unlink),
          "windows.npz garbled": ("windows.npz", _garble), "manifest.json garbled": ("manifest.json", _garble),
          "manifest.json missing": ("manifest.json", Path.unlink)}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_entry_is_reported_once_and_built_again(tmp_path, caplog, damage):
    path = tmp_path / "d.jsonl"
    texts = [f"document {i}: " + "word " * (i % 13) for i in range(60)]
    _write(path, texts)
    first = _data(tmp_path, path).train_sources[0]
    name, spoil = DAMAGE[damage]
    spoil(tmp_path / "cache" / first.key / name)

    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        again = _data(tmp_path, path).train_sources[0]
    warnings = _damage_warnings(caplog)
    assert len(warnings) == 1 and str(tmp_path / "cache" / first.key) in warnings[0], warnings
    assert again.built and again.key == first.key and again.identity == first.identity
    assert _tokens(again) == _expected(texts)
    assert again.stats == first.stats

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fsdp_turbo"):
        found = _data(tmp_path, path).train_sources[0]
    assert not found.built and _damage_warnings(caplog) == []


def test_a_failed_build_leaves_no_partial_folder(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, [f"fine {i}" for i in range(20)])
    key = _data(tmp_path, path).train_sources[0].key
    cache = tmp_path / "cache"
    shutil.rmtree(cache / key)
    (cache / f"{key}.partial.4194304").mkdir()  # what a build killed mid-way leaves
    (cache / f"{key}.partial.4194304" / "tokens.arrow").write_bytes(b"half")
    assert _data(tmp_path, path).train_sources[0].built
    assert sorted(p.name for p in cache.glob("*.partial*")) == []

    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": i}) + "\n" for i in range(20)))
    with pytest.raises(ConfigError, match="give a column of strings"):
        _data(tmp_path, numbers)
    assert sorted(p.name for p in cache.glob("*.partial*")) == []


HOLD_LOCK = """
import sys
from filelock import FileLock
lock = FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def test_a_held_lock_fails_after_the_timeout_naming_the_lock(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, ["one two three"])
    lock = tmp_path / "cache" / f"{_data(tmp_path, path).train_sources[0].key}.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError) as raised:
            _data(tmp_path, path, cache_lock_timeout_s=0.5)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    message = str(raised.value)
    assert raised.value.field == "data.cache_lock_timeout_s" and str(lock) in message and "0.5 s" in message
    assert "another process is preparing this data" in message
    assert not _data(tmp_path, path, cache_lock_timeout_s=0.5).train_sources[0].built  # released: found
