"""The multi-node launch recipes in examples/launch/, checked as far as they can be without a
cluster: single process, no network, no Slurm, no Kubernetes.

- ``slurm.sbatch``: its syntax (``bash -n``); its ``fsdp-turbo train`` line, with sample
  Slurm values put in, parsed by the command's own parser into the torchrun command line;
  and the script itself run with stand-ins for ``scontrol`` and ``srun``.
- ``kubeflow-pytorchjob.yaml``: the PyTorchJob's shape, and its command with the variables
  the Training Operator (v1) sets put in (names and values as in the operator's
  ``pkg/controller.v1/pytorch/envvar.go`` and ``master.go``, release 1.9), parsed the same
  way; the output dir on the shared claim, the job file from the ConfigMap, which loads and
  fits the job's world size.
- ``README.md`` names every recipe.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from fsdp_turbo.cli.main import _parser, _static_world, torchrun_args

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "examples" / "launch"
SBATCH = LAUNCH / "slurm.sbatch"
MANIFEST = LAUNCH / "kubeflow-pytorchjob.yaml"
JOB_FILE = ROOT / "examples" / "sft_tiny.yaml"
RECIPES = ("slurm.sbatch", "kubeflow-pytorchjob.yaml")

BASH = shutil.which("bash")
needs_bash = pytest.mark.skipif(BASH is None, reason="no bash on this machine")


def flag(launch: list[str], name: str) -> str:
    """The value after ``name`` in a torchrun command line (only the launcher's part)."""
    head = launch[:launch.index("-m")]
    assert head.count(name) == 1, f"{name} given {head.count(name)} times in {head}"
    return head[head.index(name) + 1]


# ----- Slurm ---------------------------------------------------------------------------------


def sbatch_train_line() -> str:
    """The ``fsdp-turbo train ...`` command of the script, its ``\\`` continuations joined."""
    joined = re.sub(r"\\\n", " ", SBATCH.read_text(encoding="utf-8"))
    lines = [line for line in joined.splitlines()
             if "fsdp-turbo train" in line and line.lstrip().startswith(("srun ", "fsdp-turbo "))]
    assert len(lines) == 1, lines
    return lines[0][lines[0].index("fsdp-turbo train"):]


def sbatch_defaults() -> dict[str, str]:
    """The script's own ``NAME=${NAME:-value}`` settings with a plain value (RDZV_PORT, ...)."""
    text = SBATCH.read_text(encoding="utf-8")
    return {name: value for name, again, value in re.findall(r"^(\w+)=\$\{(\w+):-([^}$]*)\}$", text, flags=re.MULTILINE)
            if name == again}


_SHELL_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def expand_shell(text: str, values: dict[str, str]) -> str:
    """``$NAME``, ``${NAME}`` and ``${NAME:-default}`` from ``values``; an unknown name fails."""

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        if name in values:
            return values[name]
        assert match.group(2) is not None, f"${name} has no sample value and no default"
        return match.group(2)

    return _SHELL_VAR.sub(one, text)


def test_the_sbatch_script_is_valid_bash():
    if BASH is None:
        pytest.skip("no bash on this machine")
    result = subprocess.run([BASH, "-n", str(SBATCH)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_sbatch_script_asks_for_one_task_per_node():
    text = SBATCH.read_text(encoding="utf-8")
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.MULTILINE))
    assert directives["nodes"] == "2"
    assert directives["ntasks-per-node"] == "1"
    assert directives["gpus-per-node"] == "8"
    assert text.startswith("#!/bin/bash\n")
    assert "scontrol show hostnames" in text


def sbatch_launch(tmp_path: Path, *, unset: tuple[str, ...] = ()) -> tuple[argparse.Namespace, list[str]]:
    """The script's ``fsdp-turbo train`` line with sample Slurm values (less ``unset``), parsed
    by the command's own parser: (its arguments, the torchrun command line)."""
    values = {**sbatch_defaults(), "SLURM_NNODES": "2", "SLURM_JOB_ID": "123", "SLURM_GPUS_ON_NODE": "8",
              "HEAD_NODE": "node001", "JOB_FILE": str(JOB_FILE), "OUTPUT_DIR": str(tmp_path / "out")}
    for name in unset:
        del values[name]
    line = sbatch_train_line()
    line = line[:line.index('"$@"')]  # no extra flags (and not the exit-status handling after them)
    argv = shlex.split(expand_shell(line, values))
    assert argv[:2] == ["fsdp-turbo", "train"]
    args = _parser().parse_args(argv[1:])
    return args, torchrun_args(args)


def test_the_sbatch_command_line_becomes_a_two_node_c10d_torchrun(tmp_path):
    args, launch = sbatch_launch(tmp_path)
    assert flag(launch, "--nnodes") == "2"
    assert flag(launch, "--rdzv-backend") == "c10d"
    host, port = flag(launch, "--rdzv-endpoint").rsplit(":", 1)
    assert host == "node001" and port.isdigit()
    assert flag(launch, "--rdzv-id") == "123"
    assert flag(launch, "--nproc-per-node") == "8"
    assert int(flag(launch, "--max-restarts")) >= 1
    assert "--standalone" not in launch
    worker = launch[launch.index("-m"):]
    assert worker[:3] == ["-m", "fsdp_turbo.cli.worker", str(JOB_FILE)]
    # the overrides reach the workers through the resolved job, applied once by the launcher
    from fsdp_turbo.cli.main import resolve

    assert "--output-dir" not in worker and resolve(args).output_dir == str(tmp_path / "out")
    assert args.config == str(JOB_FILE)
    # the check `fsdp-turbo train` does before it launches: 2 x 8 ranks fit the job's sizes
    from fsdp_turbo.cli.job_config import JobConfig

    assert _static_world(args) == 16
    JobConfig.from_file(args.config).turbo.validate(16)


def test_without_a_gpu_count_the_sbatch_script_lets_torchrun_count_the_gpus(tmp_path):
    assert "${SLURM_GPUS_ON_NODE:-" in sbatch_train_line()
    _, launch = sbatch_launch(tmp_path, unset=("SLURM_GPUS_ON_NODE",))
    nproc = flag(launch, "--nproc-per-node")
    assert nproc.isdigit() or nproc in ("gpu", "auto")


@needs_bash
def test_the_sbatch_script_runs_srun_once_with_those_flags(tmp_path):
    """The whole script, with stand-ins for scontrol (two hosts) and srun (records its argv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.args"
    (bin_dir / "scontrol").write_text(textwrap.dedent("""\
        #!/bin/bash
        [ "$1 $2" = "show hostnames" ] || exit 3
        printf 'node001\\nnode002\\n'
        """))
    (bin_dir / "srun").write_text(f'#!/bin/bash\n[ ! -e {shlex.quote(str(record))} ] || exit 4\n'
                                  f'printf "%s\\0" "$@" > {shlex.quote(str(record))}\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    output = tmp_path / "shared" / "run1"
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "USER": "tester",
           "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "123",
           "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "64", "OUTPUT_DIR": str(output)}
    result = subprocess.run([BASH, str(SBATCH), str(JOB_FILE), "--save-every", "7"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert output.is_dir()
    argv = record.read_text().split("\0")[:-1]
    start = argv.index("fsdp-turbo")
    assert "--ntasks-per-node=1" in argv[:start]
    args = _parser().parse_args(argv[start + 1:])
    launch = torchrun_args(args)
    assert flag(launch, "--nnodes") == "2"
    assert flag(launch, "--rdzv-backend") == "c10d"
    assert flag(launch, "--rdzv-endpoint") == "node001:29500"
    assert flag(launch, "--rdzv-id") == "123"
    assert flag(launch, "--nproc-per-node") == "8"
    assert "--standalone" not in launch
    assert (args.config, args.output_dir, args.save_every) == (str(JOB_FILE), str(output), 7)


@needs_bash
def test_a_preempted_run_is_requeued(tmp_path):
    """Slurm signals the step 180 s before the time limit (``--signal=USR1@180``, a default
    preemption signal of the job); fsdp-turbo saves and exits with 75, and the script requeues
    the job (``--requeue``) and exits with that code. Stand-ins: srun exits 75, scontrol records."""
    directives = re.findall(r"^#SBATCH (--[\w-]+(?:=\S+)?)", SBATCH.read_text(encoding="utf-8"), flags=re.MULTILINE)
    assert "--signal=USR1@180" in directives and "--requeue" in directives
    from fsdp_turbo.cli.job_config import JobConfig

    assert "SIGUSR1" in JobConfig.from_dict({"model": {"config": {"model_type": "llama"}}}).run.preemption_signals
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        echo "$*" >> {shlex.quote(str(calls))}
        [ "$1 $2" = "show hostnames" ] && printf 'node001\\nnode002\\n'
        exit 0
        """))
    (bin_dir / "srun").write_text("#!/bin/bash\nexit 75\n")
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "USER": "tester",
           "SLURM_JOB_NODELIST": "node[001-002]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "123",
           "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "64", "OUTPUT_DIR": str(tmp_path / "out")}
    result = subprocess.run([BASH, str(SBATCH), str(JOB_FILE)], env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 75, result.stdout + result.stderr
    assert calls.read_text().splitlines() == ["show hostnames node[001-002]", "requeue 123"]


@needs_bash
def test_the_sbatch_script_without_a_job_file_says_how_to_use_it(tmp_path):
    result = subprocess.run([BASH, str(SBATCH)], env={"PATH": os.environ.get("PATH", "")}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "usage" in result.stderr


# ----- Kubernetes (Kubeflow Training Operator v1) ----------------------------------------------


def manifest() -> dict[str, dict]:
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text(encoding="utf-8")) if d is not None]
    kinds = [d["kind"] for d in documents]
    assert len(kinds) == len(set(kinds)), kinds
    return {d["kind"]: d for d in documents}


def operator_env(job: dict, replica: str, index: int) -> dict[str, str]:
    """What the v1 operator sets in pod ``index`` of ``replica`` (Master present, no elasticPolicy)."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    master = specs["Master"]["template"]["spec"]["containers"]
    port = next(p["containerPort"] for c in master if c["name"] == "pytorch"
                for p in c.get("ports", []) if p["name"] == "pytorchjob-port")
    replicas = sum(spec["replicas"] for spec in specs.values())
    nproc = job["spec"]["nprocPerNode"]
    rank = index + (1 if replica == "Worker" else 0)
    address = f"{job['metadata']['name']}-master-0"
    return {"MASTER_ADDR": address, "PET_MASTER_ADDR": address, "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
            "WORLD_SIZE": str(replicas * (int(nproc) if nproc.isdigit() else 1)), "RANK": str(rank),
            "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": nproc, "PET_NNODES": str(replicas)}


_K8S_VAR = re.compile(r"\$\((\w+)\)")


def expand_k8s(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(NAME)`` expansion in command and args; here an unknown name fails."""

    def one(match: re.Match) -> str:
        assert match.group(1) in env, f"$({match.group(1)}) is not set in the container"
        return env[match.group(1)]

    return _K8S_VAR.sub(one, text)


def container(job: dict, replica: str) -> dict:
    containers = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"]
    named = [c for c in containers if c["name"] == "pytorch"]
    assert len(named) == 1, "the operator reads the port of the container named 'pytorch'"
    return named[0]


def test_the_manifest_is_a_v1_pytorchjob_with_a_master_and_workers():
    docs = manifest()
    job = docs["PyTorchJob"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    assert "elasticPolicy" not in job["spec"]
    assert job["spec"]["nprocPerNode"].isdigit()  # a string in the v1 API
    # Master and Worker run the same pod
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    assert specs["Master"]["restartPolicy"] == specs["Worker"]["restartPolicy"]
    assert docs["ConfigMap"]["apiVersion"] == docs["PersistentVolumeClaim"]["apiVersion"] == "v1"


@pytest.mark.parametrize(("replica", "index"), [("Master", 0), ("Worker", 0)])
def test_the_pod_command_becomes_a_multi_node_c10d_torchrun(replica, index):
    job = manifest()["PyTorchJob"]
    pod = container(job, replica)
    env = {**operator_env(job, replica, index), **{e["name"]: e["value"] for e in pod.get("env", [])}}
    argv = [expand_k8s(str(part), env) for part in [*pod["command"], *pod.get("args", [])]]
    assert argv[:2] == ["fsdp-turbo", "train"]
    args = _parser().parse_args(argv[1:])
    launch = torchrun_args(args)
    nodes = sum(s["replicas"] for s in job["spec"]["pytorchReplicaSpecs"].values())
    assert flag(launch, "--nnodes") == str(nodes)
    assert flag(launch, "--nproc-per-node") == job["spec"]["nprocPerNode"]
    assert flag(launch, "--rdzv-backend") == "c10d"
    assert flag(launch, "--rdzv-endpoint") == f"{job['metadata']['name']}-master-0:{env['MASTER_PORT']}"
    assert flag(launch, "--rdzv-id") == job["metadata"]["name"]
    assert int(flag(launch, "--max-restarts")) >= 1
    assert "--standalone" not in launch
    assert _static_world(args) == int(env["WORLD_SIZE"])


def mounts(pod: dict, volumes: list[dict], **source: str) -> list[str]:
    """Mount paths of the volumes whose source is ``source`` (e.g. configMap='name')."""
    (kind, name), = source.items()
    key = {"configMap": "name", "persistentVolumeClaim": "claimName"}[kind]
    names = {v["name"] for v in volumes if v.get(kind, {}).get(key) == name}
    return [m["mountPath"] for m in pod.get("volumeMounts", []) if m["name"] in names]


@pytest.mark.parametrize("replica", ["Master", "Worker"])
def test_the_output_dir_is_on_the_shared_claim_and_the_job_file_is_the_configmap(replica, tmp_path):
    docs = manifest()
    job, claim, config_map = docs["PyTorchJob"], docs["PersistentVolumeClaim"], docs["ConfigMap"]
    pod_spec = job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]
    pod = container(job, replica)
    args = _parser().parse_args(
        [expand_k8s(str(p), operator_env(job, replica, 0)) for p in [*pod["command"], *pod.get("args", [])]][1:])

    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    shared = mounts(pod, pod_spec["volumes"], persistentVolumeClaim=claim["metadata"]["name"])
    assert len(shared) == 1
    assert Path(args.output_dir).is_relative_to(shared[0]) and Path(args.output_dir) != Path(shared[0])

    job_dir = mounts(pod, pod_spec["volumes"], configMap=config_map["metadata"]["name"])
    assert job_dir == [str(Path(args.config).parent)]
    assert Path(args.config).name in config_map["data"]

    gpus = pod["resources"]
    assert gpus["requests"]["nvidia.com/gpu"] == gpus["limits"]["nvidia.com/gpu"] == int(job["spec"]["nprocPerNode"])


def test_the_configmap_job_loads_and_fits_the_pytorchjob_world(tmp_path):
    from fsdp_turbo.cli.job_config import JobConfig

    docs = manifest()
    job_file = tmp_path / "job.yaml"
    job_file.write_text(docs["ConfigMap"]["data"]["job.yaml"], encoding="utf-8")
    world = int(operator_env(docs["PyTorchJob"], "Master", 0)["WORLD_SIZE"])
    JobConfig.from_file(job_file).turbo.validate(world)


# ----- README ----------------------------------------------------------------------------------


def test_the_pods_have_time_to_save_when_kubernetes_stops_them():
    """Kubernetes sends SIGTERM (a default preemption signal of the job) and kills after the grace
    period: each pod gives the save 180 s, and OnFailure restarts a container that exits with 75."""
    from fsdp_turbo.cli.job_config import JobConfig

    assert "SIGTERM" in JobConfig.from_dict({"model": {"config": {"model_type": "llama"}}}).run.preemption_signals
    for replica, spec in manifest()["PyTorchJob"]["spec"]["pytorchReplicaSpecs"].items():
        assert spec["template"]["spec"]["terminationGracePeriodSeconds"] >= 120, replica
        assert spec["restartPolicy"] == "OnFailure", replica


def test_the_launch_readme_names_every_recipe():
    readme = (LAUNCH / "README.md").read_text(encoding="utf-8")
    present = sorted(p.name for p in LAUNCH.iterdir() if p.is_file() and p.name != "README.md")
    assert set(RECIPES) <= set(present)
    for name in present:
        assert f"]({name})" in readme, f"examples/launch/README.md does not link {name}"


def test_the_root_readme_links_the_recipes():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in ("README.md", *RECIPES):
        assert f"](examples/launch/{name})" in readme, name
