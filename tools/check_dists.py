"""Check the built distributions: one wheel and one sdist per package, at its own version,
and no wheel ships ``fsdp_turbo/__init__.py`` (the namespace stays open)."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path


def main(out: Path, expected: dict[str, str]) -> int:
    problems = []
    for name, version in expected.items():
        stem = name.replace("-", "_")
        wheels = list((out / name).glob(f"{stem}-{version}-*.whl"))
        sdists = list((out / name).glob(f"{stem}-{version}.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            problems.append(f"{name} {version}: wheels={wheels} sdists={sdists}")
            continue
        files = zipfile.ZipFile(wheels[0]).namelist()
        if "fsdp_turbo/__init__.py" in files:
            problems.append(f"{wheels[0].name} ships fsdp_turbo/__init__.py")
        if not any(f.startswith("fsdp_turbo/") and f.endswith(".py") for f in files):
            problems.append(f"{wheels[0].name} ships no fsdp_turbo module")
        print(f"{name:18s} {version:8s} {wheels[0].name} ({len(files)} files), {sdists[0].name}")
    for problem in problems:
        print("PROBLEM:", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    pairs = dict(arg.split("=", 1) for arg in sys.argv[2:])
    sys.exit(main(Path(sys.argv[1]), pairs))
