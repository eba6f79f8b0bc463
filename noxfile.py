"""FSDPTurbo's sessions. ``nox`` runs lint, build, each package alone, then integration.

Each package session installs only that package, turbo-core and the test tools,
which proves the package works without its siblings.

Environments are built by uv (one cache, linked wheels: seconds per session instead of a
minute or more); without uv, nox falls back to plain virtualenv and pip. uv does not read
pip's configuration, so pip's find-links (where this machine keeps the CPU build of
torch) are handed to uv: without them ``torch==2.13.0`` would resolve to PyPI's CUDA build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
FEATURE_PACKAGES = {
    "distributed": "turbo-distributed",
    "memory": "turbo-memory",
    "quant": "turbo-quant",
}
TRITON_TESTS = "test_quant_triton.py"  # turbo-quant's, run once triton is installed
ALL_PACKAGES = ("turbo-core", "turbo-distributed", "turbo-memory", "turbo-quant", "fsdp-turbo")
# loadgroup: a module marked xdist_group runs on one worker (its module fixtures are built once)
# --durations: the slowest tests in every CI log, to keep CI inside its time
PYTEST = ("pytest", "-n", "2", "--dist", "loadgroup", "--timeout", "900", "--durations", "40")

# quant_triton's tests run at the end of the quant session (one environment fewer).
nox.options.sessions = ["lint", "build", "core", *FEATURE_PACKAGES, "integration", "peers"]
nox.options.reuse_existing_virtualenvs = False
nox.options.default_venv_backend = "uv|virtualenv"


def _pip_find_links() -> str:
    """pip's find-links (its environment variable, else its config files), comma-separated for uv."""
    links = os.environ.get("PIP_FIND_LINKS", "")
    if not links:
        found = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                               capture_output=True, text=True, check=False)
        links = found.stdout if found.returncode == 0 else ""
    return ",".join(links.split())


if "UV_FIND_LINKS" not in os.environ and (_links := _pip_find_links()):
    os.environ["UV_FIND_LINKS"] = _links
# Bytecode: every test process imports torch and transformers, and where
# PYTHONDONTWRITEBYTECODE is set (as on the project's machines) each would compile their
# sources again (a 4-rank launch took 2.4 times as long). Compiling everything at install
# (uv's --compile-bytecode) took 22 s per session for torch and transformers alone, most of
# it for modules no test imports (transformers' hundreds of model families). So the sessions'
# processes may write bytecode, and one process imports what every test imports before the
# tests start (else pytest's workers and their rank servers would compile the same modules
# side by side); anything else is compiled by its first import, once for the session.
os.environ["PYTHONDONTWRITEBYTECODE"] = ""  # empty: writing allowed (a non-empty value forbids it)
# Inductor compiles in a pool of worker processes by default, one pool per rank: on the suite's two
# cores, with four ranks compiling at once, each pool only adds processes that import torch. One
# compile thread per rank: the 4-rank compile test took 56 s instead of 62 s (a cold kernel cache),
# 29 s instead of 35 s (a warm one).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# A test that skips here has never run: every skip fails the session (the root conftest.py; it
# lists each skip with its reason, and the few that are expected).
os.environ["FSDP_TURBO_NO_SKIPS"] = "1"
WARM_IMPORTS = """
import importlib.util
import torch, torch.distributed.tensor, torch._dynamo
for name in ("transformers.models.llama.modeling_llama", "transformers.models.qwen3_moe.modeling_qwen3_moe",
             "fsdp_turbo.fsdp_turbo"):
    if importlib.util.find_spec(name.split(".")[0]):
        __import__(name)
"""


def _install(session: nox.Session, *targets: str) -> None:
    # torch first, alone, so pip never considers another build of it.
    session.install(*CONSTRAINTS, "torch==2.13.0")
    session.install(*CONSTRAINTS, *targets)
    session.run("python", "-c", WARM_IMPORTS)


def _package(name: str, extra: str = "") -> str:
    return f"{ROOT / 'packages' / name}{extra}"


@nox.session
def lint(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "ruff")
    session.run("ruff", "check", ".")


# hatch builds in environments of its own; inside a uv-made session it installs hatchling
# with uv into the session's environment instead of its own, so this one session keeps pip.
@nox.session(venv_backend="virtualenv")
def build(session: nox.Session) -> None:
    """Every package builds a wheel and an sdist with hatch, at the version it declares."""
    session.install(*CONSTRAINTS, "hatch")
    out = ROOT / "dist"
    versions = {}
    for name in ALL_PACKAGES:
        with session.chdir(ROOT / "packages" / name):
            # hatch may log environment setup first; the version is the last line.
            versions[name] = session.run("hatch", "version", silent=True).strip().splitlines()[-1]
            session.run("hatch", "build", "-c", "-t", "wheel", "-t", "sdist", str(out / name))
    session.run("python", str(ROOT / "tools" / "check_dists.py"), str(out),
                *[f"{n}={v}" for n, v in versions.items()])


@nox.session
def core(session: nox.Session) -> None:
    """turbo-core alone."""
    _install(session, _package("turbo-core", "[test]"))
    session.run(*PYTEST, "packages/turbo-core/tests", *session.posargs)


def _feature_session(short: str, dist: str) -> None:
    def run(session: nox.Session) -> None:
        _install(session, _package("turbo-core"), _package(dist, "[test]"))
        # quant's Triton tests run after triton is installed (in the same environment: a venv less in CI)
        triton_later = ("--ignore", f"packages/{dist}/tests/{TRITON_TESTS}") if short == "quant" else ()
        session.run(*PYTEST, f"packages/{dist}/tests", *triton_later, *session.posargs)
        if short == "quant":
            _triton_tests(session)

    run.__doc__ = f"{dist} with only turbo-core installed" + (", then its Triton kernels" if short == "quant" else "")
    nox.session(name=short)(run)


def _triton_tests(session: nox.Session) -> None:
    session.install(*CONSTRAINTS, "triton")
    session.run("pytest", "--timeout", "900", f"packages/turbo-quant/tests/{TRITON_TESTS}", *session.posargs)


for _short, _dist in FEATURE_PACKAGES.items():
    _feature_session(_short, _dist)


@nox.session
def quant_triton(session: nox.Session) -> None:
    """turbo-quant's Triton kernels, bit-exact vs the portable ones under Triton's CPU interpreter."""
    _install(session, _package("turbo-core"), _package("turbo-quant", "[test]"))
    _triton_tests(session)


@nox.session
def integration(session: nox.Session) -> None:
    """Every package together: integration_tests/ (multi-package, torchrun)."""
    _install(session, *(_package(n) for n in ALL_PACKAGES), _package("turbo-core", "[test]"),
             _package("fsdp-turbo", "[peft,trl]"))
    session.run(*PYTEST, "integration_tests", *session.posargs)


@nox.session
def peers(session: nox.Session) -> None:
    """Code nobody here wrote. torchtitan's models (0.2.2, a test-only dependency: the last release
    that trains on CPU) through FSDPTurbo, against the same model in one process; torchtitan
    imports triton at load time, even on CPU. LLaMA-Factory v1's own SFT command with its
    ``fsdpturbo`` backend, against its ``fsdp2`` one: its wheel without its dependencies (they
    pin forks: transformers-kt, peft-kt, accelerate-kt, and datasets<=4), beside the stock
    transformers and datasets of constraints.txt and what its v1 SFT path imports besides
    (omegaconf: config and data; peft: the fsdp2 engine; accelerate: the model engine;
    torchdata, torchtitan's too: the batching)."""
    _install(session, *(_package(n) for n in ALL_PACKAGES), _package("turbo-core", "[test]"), "torchtitan", "triton",
             "omegaconf", "peft", "accelerate", "torchdata")
    session.install("--no-deps", "llamafactory-kt==0.9.6.dev0")
    session.run(*PYTEST, "peer_tests", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The demo: `fsdp-turbo train examples/qwen3_moe_tiny.yaml` on 4 CPU ranks (torchrun)."""
    _install(session, _package("fsdp-turbo"), *(_package(n) for n in ALL_PACKAGES[:-1]))
    session.run("fsdp-turbo", "train", "examples/qwen3_moe_tiny.yaml", "--nproc-per-node", "4",
                "--output-dir", str(ROOT / "demo_output"), "--resume", "none", *session.posargs)


@nox.session
def demo_lora(session: nox.Session) -> None:
    """LoRA on the shipped chat data: `fsdp-turbo train examples/sft_tiny_lora.yaml` on 4 CPU ranks
    (adapter-only checkpoints; final/ in PEFT's format, final_merged/ in transformers')."""
    _install(session, _package("fsdp-turbo", "[peft]"), *(_package(n) for n in ALL_PACKAGES[:-1]))
    session.run("fsdp-turbo", "train", "examples/sft_tiny_lora.yaml", "--nproc-per-node", "4",
                "--output-dir", str(ROOT / "sft_lora_output"), "--resume", "none", *session.posargs)


@nox.session
def demo_sft(session: nox.Session) -> None:
    """SFT on the shipped chat data and tokenizer: `fsdp-turbo train examples/sft_tiny.yaml` on 4 CPU ranks."""
    _install(session, _package("fsdp-turbo"), *(_package(n) for n in ALL_PACKAGES[:-1]))
    session.run("fsdp-turbo", "data", "examples/sft_tiny.yaml", "--show", "2", "--output-dir", str(ROOT / "sft_output"))
    session.run("fsdp-turbo", "train", "examples/sft_tiny.yaml", "--nproc-per-node", "4",
                "--output-dir", str(ROOT / "sft_output"), "--resume", "none", *session.posargs)


@nox.session
def demo_trl(session: nox.Session) -> None:
    """TRL's SFTTrainer on FSDPTurbo: `torchrun --nproc-per-node 4 examples/trl_sft.py`, a plain TRL script with two
    added lines, on 4 CPU ranks (CP=2 x FSDP=2 with EP=2)."""
    _install(session, _package("fsdp-turbo", "[trl]"), *(_package(n) for n in ALL_PACKAGES[:-1]))
    session.run("torchrun", "--nproc-per-node", "4", str(ROOT / "examples" / "trl_sft.py"), *session.posargs)
