"""SFT: a conversation rendered with the tokenizer's own chat template, loss on the
assistant turns only.

Which tokens belong to an assistant turn comes from the template itself: for assistant
message *i*, the conversation rendered up to message *i - 1* with the generation prompt
is a prefix of the text, and the conversation rendered up to message *i* ends where the
turn ends (its content, the end-of-turn token and whatever the template puts after it
before the next turn). Tokens whose first character lies between the two carry loss;
everything else is labelled with the ignore index (the job's ``turbo.model_facts.ignore_index``,
default -100). This needs no ``{% generation %}`` markers in the template,
and a template whose renderings are not prefixes of each other is refused, not guessed.
"""

from __future__ import annotations

from typing import Any

from fsdp_turbo.core.errors import ConfigError
from fsdp_turbo.core.model_facts import IGNORE_INDEX


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ConfigError(where, messages, "give a list of {role, content} messages")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise ConfigError(where, message, "give each message a string role and a string content")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(where, [m["role"] for m in messages], "give each conversation an assistant turn",
                          reason="nothing in it would carry loss")
    return messages


def assistant_spans(tokenizer, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    text = tokenizer.render(messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.render(messages[:i], add_generation_prompt=True) if i else ""
        through = tokenizer.render(messages[: i + 1])
        if not text.startswith(through) or not through.startswith(before):
            raise ConfigError("data.tokenizer", str(tokenizer.folder), "use a chat template whose rendering of a "
                              "conversation's first turns is a prefix of the whole rendering",
                              reason=f"{where}: the turns cannot be located in the rendered text")
        spans.append((len(before), len(through)))
    return text, spans


def render_conversation(tokenizer, messages: list[dict[str, str]], where: str,
                        ignore_index: int = IGNORE_INDEX) -> tuple[list[int], list[int]]:
    """Token ids and labels (``ignore_index`` outside the assistant turns) of one conversation."""
    text, spans = assistant_spans(tokenizer, messages, where)
    ids, offsets = tokenizer.encode_with_offsets(text)
    labels = [ignore_index] * len(ids)
    for index, (start, _) in enumerate(offsets):
        if any(low <= start < high for low, high in spans):
            labels[index] = ids[index]
    return ids, labels
