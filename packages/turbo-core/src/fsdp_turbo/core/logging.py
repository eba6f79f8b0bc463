"""Rank-aware logging: rank 0 speaks by default; ``all_ranks=True`` lets every rank speak."""

from __future__ import annotations

import logging
import os
from typing import Any

_ROOT = "fsdp_turbo"
_seen: set[str] = set()


def _rank() -> int:
    # torch.distributed imports in every build (is_available() says whether it works), and a
    # destroyed group reads as not initialised: before a group, and after it, $RANK.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankLogger(logging.LoggerAdapter):
    """Logs on rank 0 only, unless a call passes ``all_ranks=True``."""

    def log(self, level: int, msg: Any, *args: Any, all_ranks: bool = False, **kwargs: Any) -> None:
        rank = _rank()
        if rank != 0 and not all_ranks:
            return
        if self.isEnabledFor(level):
            self.logger.log(level, f"[rank{rank}] {msg}", *args, **kwargs)

    def debug(self, msg, *args, **kwargs):
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg, *args, **kwargs):
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg, *args, **kwargs):
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg, *args, **kwargs):
        self.log(logging.ERROR, msg, *args, **kwargs)


def get_logger(name: str = _ROOT) -> RankLogger:
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    logger = logging.getLogger(name)
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("FSDP_TURBO_LOG_LEVEL", "INFO").upper())
    return RankLogger(logger, {})


def forget_warnings() -> None:
    """Let every warn-once message be warned again (a test rank reused for the next test)."""
    _seen.clear()


def warn_once(logger: RankLogger, message: str, *, all_ranks: bool = False) -> None:
    """Warn the first time ``message`` is seen in this process."""
    if message in _seen:
        return
    _seen.add(message)
    logger.warning(message, all_ranks=all_ranks)
