"""Make the SFT example's data and tokenizer (``examples/sft_tiny/``), offline.

    python tools/make_example_data.py [OUT]     # default: examples/sft_tiny

- ``train.jsonl`` / ``valid.jsonl``: chat conversations ({"messages": [...]}) asking what a
  standard-library function or class does; the answer is the first paragraph of its
  docstring. Every 10th conversation goes to ``valid``.
- ``tokenizer/``: a byte-level BPE (vocab 2048) trained on those answers with HF
  ``tokenizers``, saved as a transformers tokenizer with a ChatML chat template.

The files are committed; this script is how they were made (their content depends on the
Python version's docstrings).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
from pathlib import Path

MODULES = ("json", "os.path", "re", "itertools", "functools", "collections", "string", "textwrap", "math",
           "statistics", "random", "shutil", "pathlib", "datetime", "heapq", "bisect", "difflib", "fnmatch",
           "glob", "hashlib", "base64", "csv", "copy", "operator", "typing", "dataclasses", "enum", "inspect",
           "logging", "argparse", "subprocess", "tempfile", "zipfile", "tarfile", "gzip", "struct", "uuid",
           "urllib.parse", "html", "textwrap", "pprint", "decimal", "fractions", "calendar", "time", "io")
SYSTEM = "You answer questions about the Python standard library in one short paragraph."
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _first_paragraph(doc: str) -> str:
    text = inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ").strip()
    return text[:400]


def conversations() -> list[dict]:
    out, seen = [], set()
    for name in MODULES:
        module = importlib.import_module(name)
        for attribute in sorted(dir(module)):
            obj = getattr(module, attribute)
            if attribute.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)
                                                   or inspect.isbuiltin(obj)):
                continue
            doc = getattr(obj, "__doc__", None)
            answer = _first_paragraph(doc) if isinstance(doc, str) else ""
            key = f"{name}.{attribute}"
            if len(answer) < 20 or key in seen:
                continue
            seen.add(key)
            messages = [{"role": "user", "content": f"What does `{key}` do?"},
                        {"role": "assistant", "content": answer}]
            if len(out) % 3 == 0:
                messages.insert(0, {"role": "system", "content": SYSTEM})
            out.append({"messages": messages})
    return out


def train_tokenizer(texts: list[str], folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                      chat_template=CHAT_TEMPLATE)
    wrapped.save_pretrained(str(folder))


def main(out: str = "examples/sft_tiny") -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = conversations()
    train = [r for i, r in enumerate(rows) if i % 10]
    valid = [r for i, r in enumerate(rows) if not i % 10]
    for name, part in (("train", train), ("valid", valid)):
        with (folder / f"{name}.jsonl").open("w", encoding="utf-8") as handle:
            for row in part:
                handle.write(json.dumps(row) + "\n")
    texts = [m["content"] for r in rows for m in r["messages"]]
    train_tokenizer(texts, folder / "tokenizer")
    sys.stdout.write(f"{len(train)} train and {len(valid)} valid conversations, tokenizer in {folder / 'tokenizer'}\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
