"""One machine-readable line per measured ratio, for ``run_all.py`` to gather into a table.

Each benchmark prints its own human-readable lines as well; these lines start with
``RESULT`` and hold tab-separated fields: metric, ours / baseline, goal, detail.
"""

from __future__ import annotations

PREFIX = "RESULT"


def result(metric: str, ratio: float, goal: str, detail: str = "") -> None:
    print(f"{PREFIX}\t{metric}\t{ratio:.3f}\t{goal}\t{detail}", flush=True)


def parse(line: str) -> tuple[str, float, str, str] | None:
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 5 or fields[0] != PREFIX:
        return None
    return fields[1], float(fields[2]), fields[3], fields[4]
