"""Several nodes on one machine: each node is its own ``fsdp-turbo train`` agent (torchrun's
elastic agent) with its own workers and local ranks, meeting at a c10d rendezvous on
localhost, as separate hosts would.

The job is the demo's model (Qwen3-MoE, hidden 64, 8 experts) under HSDP 2 x 2 with
``fully_shard_parallel_size: -1``, 8 steps, a checkpoint every 2, and a global batch of 8
rows, so that a job resumed on fewer nodes keeps its batch and its data order. The
uninterrupted two-node run is the reference: the other runs repeat it, run it on one node,
lose a node (which comes back, or never does), or have a worker stop responding.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from processes import tree
from test_integ_cli import assert_same_weights, metrics, untimed, weights, with_data_cache

pytest.importorskip("transformers")
pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("multinode")]

ROOT = Path(__file__).resolve().parent.parent
NPROC = 2  # per node
RDZV_ID = "multinode-test"


def _job() -> dict:
    job = yaml.safe_load((ROOT / "examples" / "qwen3_moe_tiny.yaml").read_text())
    job["data"]["max_bytes"] = 300_000
    job["run"] = {"steps": 8, "micro_batch": 2, "global_batch": 8, "seed": 0}
    job["checkpoint"] = {"save_every": 2, "keep": 2}
    job["turbo"] = {"data_parallel_size": 2, "fully_shard_parallel_size": -1}
    job["logging"] = {"plot": False}  # drawn and checked in test_integ_cli
    return job


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Node:
    """One node's agent (and, through torchrun, its workers)."""

    def __init__(self, job_file, output, node_rank, nnodes, port, *extra, env=None, rdzv_conf="", cwd=None):
        self.log = Path(output) / f"node{node_rank}-{time.monotonic_ns()}.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "fsdp_turbo.cli.main", "train", str(job_file), "--nnodes", str(nnodes),
                   "--node-rank", str(node_rank), "--nproc-per-node", str(NPROC), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RDZV_ID, "--output-dir", str(output),
                   # Node 0's agent hosts the rendezvous store (on one machine every agent
                   # could; the first to bind would), so that losing another node keeps it.
                   "--rdzv-conf", ",".join(filter(None, [f"is_host={int(node_rank == 0)}", rdzv_conf])),
                   *map(str, extra)]
        with self.log.open("w") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd)

    def wait(self, timeout=400) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"node did not finish in {timeout} s:\n{self.text()[-4000:]}") from None

    def kill(self) -> None:
        """The agent and every worker at once, as a lost host."""
        for pid in tree(self.process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def launch(job_file, output, nodes=2, nnodes=None, *extra, env=None, lost_env=None, port=None,
           rdzv_conf="") -> list[Node]:
    """``nodes`` agents; ``lost_env`` goes to the last one's only (the node a test loses)."""
    port = port or _free_port()
    return [Node(job_file, output, rank, nnodes or nodes, port, *extra, rdzv_conf=rdzv_conf,
                 env={**(env or {}), **((lost_env or {}) if rank == nodes - 1 else {})}) for rank in range(nodes)]


def _kill_leftovers(output: Path) -> None:
    """Any process still running for ``output`` (a failed test must not leave workers
    behind to load the machine)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError, ProcessLookupError):
            if str(output) in cmdline.read_bytes().decode(errors="replace"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)


def finish(nodes: list[Node]) -> None:
    try:
        for node in nodes:
            code = node.wait()
            assert code == 0, node.text()[-5000:]
    finally:
        stop_all(nodes)


def stop_all(nodes: list[Node]) -> None:
    """Kill whatever of ``nodes`` still runs, and any leftover worker of their outputs."""
    for node in nodes:
        if node.process.poll() is None:
            node.kill()
        _kill_leftovers(node.log.parent)


def wait_until_stopped(node: Node, timeout=300) -> None:
    """Until a worker of ``node`` has stopped itself (the STOP test hook): the node is then
    lost at a known step, whatever the speed of the machine."""
    deadline = time.monotonic() + timeout
    while "T" not in tree(node.process.pid).values():
        assert node.process.poll() is None, node.text()[-4000:]
        assert time.monotonic() < deadline, f"no worker stopped after {timeout} s"
        time.sleep(0.2)


# Node 1's workers stop themselves after step 5 (on the first attempt only); the test
# then kills that node's agent and workers: a host lost after the step-4 checkpoint.
LOSE_NODE_1 = {"FSDP_TURBO_FAULTS": "stop@5:*"}


def losses(output) -> list[float]:
    return [row["loss"] for row in metrics(output)]


@pytest.fixture(scope="module")
def job_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("multinode-job") / "job.yaml"
    path.write_text(yaml.safe_dump(with_data_cache(_job(), tmp_path_factory.mktemp("data-cache"))))
    return path


@pytest.fixture(scope="module")
def reference(job_file, tmp_path_factory):
    """Two nodes of two processes, uninterrupted."""
    output = tmp_path_factory.mktemp("two-nodes")
    finish(launch(job_file, output))
    return output


def test_two_nodes_train_and_repeat_to_the_last_bit(job_file, reference, tmp_path):
    rows = metrics(reference)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert {r["world_size"] for r in rows} == {4}
    assert rows[-1]["loss"] < rows[0]["loss"]
    finish(launch(job_file, tmp_path))
    assert untimed(metrics(tmp_path)) == untimed(rows)
    assert_same_weights(weights(tmp_path), weights(reference))


def test_each_node_has_its_own_local_ranks(reference):
    """Every worker's LOCAL_RANK and LOCAL_WORLD_SIZE come from its own node's agent, and a
    node's workers hold a contiguous block of global ranks (what the mesh places by)."""
    import re

    places = {}
    for log in sorted(reference.glob("node*.log")):
        for match in re.finditer(r"rank (\d+): local rank (\d+) of (\d+) on node (\d+)", log.read_text()):
            rank, local, local_world, node = map(int, match.groups())
            places[rank] = (log.name.split("-")[0], node, local, local_world)
    assert sorted(places) == [0, 1, 2, 3]
    for rank, (_, node, local, local_world) in places.items():
        assert (node, local, local_world) == (rank // NPROC, rank % NPROC, NPROC)
    # one agent per node: each log holds one node's two ranks
    assert {places[0][0], places[2][0]} == {"node0", "node1"}
    assert places[0][0] == places[1][0] and places[2][0] == places[3][0]


def test_one_node_of_four_matches_two_nodes_of_two(job_file, reference, tmp_path):
    """The same job from one agent with four processes: the same ranks in the same mesh, so
    the same losses (stated: rtol 1e-5, the parity tolerance)."""
    from test_integ_cli import train

    train(job_file, tmp_path, 4)
    torch.testing.assert_close(torch.tensor(losses(tmp_path)), torch.tensor(losses(reference)), rtol=1e-5, atol=0)


def test_a_node_that_dies_and_comes_back_finishes_bit_identical(job_file, reference, tmp_path):
    """Node 1's agent and workers are killed together after the step-4 checkpoint; node 0's
    workers fail (their peers are gone) and its agent restarts them into a new rendezvous,
    which node 1's restarted command joins. The job resumes from the last checkpoint."""
    port = _free_port()
    nodes = launch(job_file, tmp_path, 2, None, "--max-restarts", 3, port=port, lost_env=LOSE_NODE_1)
    try:
        wait_until_stopped(nodes[1])
        nodes[1].kill()
        nodes[1] = Node(job_file, tmp_path, 1, 2, port, "--max-restarts", 3)  # the same command, no hook
    finally:
        finish(nodes)
    assert "resumed from" in "".join(node.text() for node in nodes)
    assert untimed(metrics(tmp_path)) == untimed(metrics(reference))
    assert_same_weights(weights(tmp_path), weights(reference))


def test_an_elastic_job_shrinks_to_the_nodes_left(job_file, reference, tmp_path):
    """``--nnodes 1:2``: node 1 is lost after the step-4 checkpoint and never returns. Node
    0's agent re-forms the job alone (after the rendezvous' last call), at world 2: HSDP
    2 x 1, the checkpoint resharded, the global batch kept by accumulating 2 micro-batches,
    so the same rows make each step. Stated: the losses within rtol 1e-5 of the two-node
    run (the sums are ordered differently, nothing else changes)."""
    nodes = launch(job_file, tmp_path, 2, "1:2", "--max-restarts", 3, rdzv_conf="last_call_timeout=10",
                   lost_env=LOSE_NODE_1)
    try:
        wait_until_stopped(nodes[1])
        nodes[1].kill()
        nodes = nodes[:1]
    finally:
        finish(nodes)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["world_size"] for r in rows] == [4] * 4 + [2] * 4
    torch.testing.assert_close(torch.tensor(losses(tmp_path)), torch.tensor(losses(reference)), rtol=1e-5, atol=0)
    print(f"elastic shrink: final loss {rows[-1]['loss']:.6f}, uninterrupted {metrics(reference)[-1]['loss']:.6f}")


def test_a_stopped_worker_becomes_a_restart_not_a_hang(job_file, reference, tmp_path):
    """Rank 3 is stopped (SIGSTOP: alive, silent) after step 5. The others' next collective
    times out after ``run.collective_timeout_s`` (10 s here) and fails; the agents restart
    every worker (the stopped one is killed), and the job finishes from the step-4
    checkpoint, bit-identical. The subprocess timeout is the hang guard."""
    job = yaml.safe_load(job_file.read_text())
    job["run"]["collective_timeout_s"] = 10
    stopped_job = tmp_path / "job.yaml"
    stopped_job.write_text(yaml.safe_dump(job))
    nodes = launch(stopped_job, tmp_path / "out", 2, None, "--max-restarts", 2,
                   env={"FSDP_TURBO_FAULTS": "stop@5:3"})
    finish(nodes)
    logs = "".join(node.text() for node in nodes)
    assert "Timed out waiting 10000ms" in logs, logs[-4000:]  # gloo's own message, at the job's timeout
    assert "resumed from" in logs
    assert untimed(metrics(tmp_path / "out")) == untimed(metrics(reference))
    assert_same_weights(weights(tmp_path / "out"), weights(reference))


def test_one_ranks_error_ends_every_node_with_its_message(job_file, tmp_path):
    """Rank 3 (node 1) raises after step 3, outside any all-ranks agreement, as one rank out
    of memory would; the collective timeout is 300 s. Every worker on both nodes stops within
    60 s, and node 0's log names rank 3's error (posted to the job's store by rank 3, read
    by every worker's fail-fast watcher)."""
    job = yaml.safe_load(job_file.read_text())
    job["run"]["collective_timeout_s"] = 300
    failing_job = tmp_path / "job.yaml"
    failing_job.write_text(yaml.safe_dump(job))
    output = tmp_path / "out"
    nodes = launch(failing_job, output, 2, None, env={"FSDP_TURBO_FAULTS": "raise@3:3"})
    try:
        deadline = time.monotonic() + 240
        while '"step": 3' not in _text(output / "metrics.jsonl") and all(n.process.poll() is None for n in nodes):
            assert time.monotonic() < deadline, nodes[0].text()[-4000:]
            time.sleep(0.1)
        failed_at = time.monotonic()  # step 3 is logged, and rank 3 raises right after it
        codes = [node.wait(timeout=120) for node in nodes]
        seconds = time.monotonic() - failed_at
    finally:
        stop_all(nodes)
    assert all(code != 0 for code in codes), codes
    node0 = nodes[0].text()
    assert "rank 3 failed: InjectedFault: fault injection: rank 3 fails after step 3" in node0, node0[-4000:]
    assert [r["step"] for r in metrics(output)] == [1, 2, 3]
    print(f"one rank's error: every node ended {seconds:.1f} s after step 3 (collective timeout 300 s)")
    assert seconds < 60


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def test_a_data_file_missing_on_one_nodes_disk_ends_every_node(job_file, tmp_path):
    """The job names its data by a relative path, and each node runs in its own folder (its
    own disk): node 1's has no such file. Node 1's command cannot prepare the data, launches
    anyway (else node 0's agent would wait for it at the rendezvous for minutes), and its
    workers meet the error inside the all-ranks agreement: every worker of both nodes stops,
    node 0's with rank 2's message."""
    import json

    job = yaml.safe_load(job_file.read_text())
    job["data"] = {"sources": [{"path": "corpus/train.jsonl", "text_field": "text"}], "seq_len": 32}
    relative_job = tmp_path / "job.yaml"
    relative_job.write_text(yaml.safe_dump(job))
    disks = [tmp_path / "node0-disk", tmp_path / "node1-disk"]
    for disk in disks:
        disk.mkdir()
    (disks[0] / "corpus").mkdir()
    rows = [json.dumps({"text": f"document {i}: " + "a few words of text. " * (i % 7 + 1)}) for i in range(200)]
    (disks[0] / "corpus" / "train.jsonl").write_text("\n".join(rows) + "\n")
    output, port = tmp_path / "out", _free_port()
    began = time.monotonic()
    nodes = [Node(relative_job, output, rank, 2, port, cwd=disks[rank]) for rank in range(2)]
    try:
        codes = [node.wait(timeout=300) for node in nodes]
        seconds = time.monotonic() - began
    finally:
        stop_all(nodes)
    assert all(code != 0 for code in codes), codes
    assert "this node cannot prepare the data" in nodes[1].text()
    node0 = nodes[0].text()
    assert "load the data: rank 2 failed" in node0 and "no file matches" in node0, node0[-4000:]
    assert not (output / "metrics.jsonl").exists() or not metrics(output)  # no step ran
    print(f"a file missing on one node: both nodes ended {seconds:.1f} s after launch")
