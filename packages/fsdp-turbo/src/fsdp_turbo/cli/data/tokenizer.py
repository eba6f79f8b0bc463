"""The job's tokenizer: ``byte`` (vocab 256, no special tokens) or a local HF tokenizer folder.

Both give the same small surface the data pipeline needs: encode a batch of documents,
decode for ``fsdp-turbo data --show``, the padding id, a chat template (HF only) and a
fingerprint that changes whenever the tokenizer's own files do (part of the cache key and of
the data identity a resume checks).

A tokenizer folder is often the model's folder: the fingerprint reads only the files a
tokenizer is loaded from, streamed, never the weights beside them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fsdp_turbo.core.errors import ConfigError

BYTE = "byte"
# What ``PreTrainedTokenizerBase.from_pretrained`` reads from a folder besides the class's own
# ``vocab_files_names``: its additional files, and the vocabularies a fast tokenizer can be
# converted from when tokenizer.json is missing (BPE, WordPiece, sentencepiece, tiktoken, tekken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "tiktoken.model", "tekken.json")
CHAT_TEMPLATES = "additional_chat_templates"  # a folder of named *.jinja templates


class ByteTokenizer:
    """UTF-8 bytes as tokens. A document needs no end token: packing marks its boundaries."""

    vocab_size = 256
    pad_id = 0
    chat_template = None
    fingerprint = "byte-v1"

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """``transformers.AutoTokenizer`` from a local folder, nothing downloaded. Documents get
    the tokenizer's own special tokens (e.g. BOS) and end with its EOS token."""

    def __init__(self, folder: str) -> None:
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        self.hf = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        if not self.hf.is_fast:
            raise ConfigError("data.tokenizer", folder, "use a tokenizer with a tokenizer.json (a fast tokenizer)",
                              reason="SFT masks come from the fast tokenizer's character offsets")
        self.vocab_size = len(self.hf)
        self.eos_id = self.hf.eos_token_id
        self.pad_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else (self.eos_id or 0)
        self.chat_template = self.hf.chat_template
        self.fingerprint = fingerprint(self.folder, type(self.hf))

    def encode(self, texts: list[str]) -> list[list[int]]:
        # The Rust backend's batch call without character offsets: the same ids as
        # ``self.hf(texts)`` (tested), in about two thirds of the time.
        encoded = [e.ids for e in self.hf.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=True)]
        if self.eos_id is None:
            return encoded
        return [ids if ids and ids[-1] == self.eos_id else [*ids, self.eos_id] for ids in encoded]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A rendered chat (its special tokens are in the text already) and each token's
        character span."""
        out = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return out["input_ids"], [tuple(span) for span in out["offset_mapping"]]

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)


def tokenizer_files(folder: Path, tokenizer_class: type) -> list[Path]:
    """The files of ``folder`` that ``tokenizer_class`` is loaded from, sorted by name."""
    names = set(TOKENIZER_FILES) | set(getattr(tokenizer_class, "vocab_files_names", {}).values())
    config = folder / "tokenizer_config.json"
    if config.is_file():  # versioned tokenizer.json files ("tokenizer.4.0.json"), picked by version
        names |= set(json.loads(config.read_text(encoding="utf-8")).get("fast_tokenizer_files", []))
    files = [folder / name for name in names if (folder / name).is_file()]
    files += (folder / CHAT_TEMPLATES).glob("*.jinja")
    return sorted(files)


def fingerprint(folder: Path, tokenizer_class: type) -> str:
    """A digest of the tokenizer's files (names and contents, read in blocks). Not of its
    class, which a transformers upgrade may rename while the files stay the same."""
    digest = hashlib.sha256()
    for path in tokenizer_files(folder, tokenizer_class):
        with path.open("rb") as handle:
            content = hashlib.file_digest(handle, "sha256").digest()
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + content)
    return f"hf-{digest.hexdigest()[:16]}"


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    if spec == BYTE:
        return ByteTokenizer()
    folder = Path(spec)
    if not folder.is_dir() or not ((folder / "tokenizer.json").is_file()
                                   or (folder / "tokenizer_config.json").is_file()):
        raise ConfigError("data.tokenizer", spec, "give a local tokenizer folder (with tokenizer.json and "
                          "tokenizer_config.json), or 'byte'", reason="no tokenizer there")
    return HFTokenizer(spec)
