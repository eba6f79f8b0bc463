"""The ``fsdp-turbo`` command.

    fsdp-turbo train JOB.yaml [--nproc-per-node N] [--max-steps N] [--output-dir DIR]
                              [--save-every N] [--max-restarts N] [--resume auto|none|DIR]
                              [--stop-at-step N]
                              [torchrun rendezvous flags: --nnodes, --node-rank, --rdzv-*, ...]
    fsdp-turbo plan JOB.yaml [--world-size N] [--nnodes N] [--nproc-per-node K] [--json]
                             [--auto --memory-per-rank SIZE [--write FILE]]
    fsdp-turbo data JOB.yaml [--show N] [--output-dir DIR]

``train`` checks the job file, then hands the job to PyTorch's own launcher
(``torch.distributed.run``, i.e. torchrun's agent, run here: ``run_agent``), which starts
``fsdp_turbo.cli.worker``'s ranks (forked from a server that imported them once), restarts
the group when a worker dies (``--max-restarts``) and handles multi-node rendezvous.
``plan`` is a dry run on the meta device. ``data`` tokenizes and packs the data (into the
cache ``train`` then uses) and shows the first sequences and statistics.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from fsdp_turbo.core.errors import ConfigError

# torchrun flags passed through as they are (multi-node rendezvous and the like).
TORCHRUN_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-id", "--rdzv-conf",
                  "--master-addr", "--master-port", "--monitor-interval", "--log-dir")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-turbo", description="FSDPTurbo: train and plan jobs")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a job with torchrun")
    train.add_argument("config", help="the job file (YAML or TOML)")
    train.add_argument("--nproc-per-node", default="1", help="processes per node (torchrun)")
    train.add_argument("--max-steps", type=int, help="override run.steps")
    train.add_argument("--output-dir", help="override output_dir")
    train.add_argument("--save-every", type=int, help="override checkpoint.save_every")
    train.add_argument("--max-restarts", type=int, default=0, help="restarts after a worker failure (torchrun)")
    train.add_argument("--resume", default="auto", help="auto (latest complete checkpoint), none, or a folder")
    train.add_argument("--stop-at-step", type=int, help="stop cleanly after this step (with a checkpoint)")
    train.add_argument("--standalone", action="store_true", help="single-node rendezvous (the default for one node)")
    train.add_argument("--auto", action="store_true", help="train with the layout plan --auto picks for "
                       "--memory-per-rank at the launched world size")
    _auto_flags(train)
    for flag in TORCHRUN_FLAGS:
        train.add_argument(flag, help="passed to torchrun")
    plan = commands.add_parser("plan", help="dry run: patterns, mesh layout and per-rank memory")
    plan.add_argument("config")
    plan.add_argument("--world-size", type=int, help="default: the product of the job's parallel sizes")
    plan.add_argument("--json", action="store_true", help="print one JSON object (memory.peak_bytes: the peak)")
    plan.add_argument("--auto", action="store_true", help="search the layouts that fit --memory-per-rank")
    plan.add_argument("--write", help="with --auto: write the job with the chosen layout to this file")
    _auto_flags(plan)
    # plan's own --nnodes/--nproc-per-node are numbers (train's pass torchrun's strings through):
    # with either, the plan also shows which node each mesh group lands on
    plan.add_argument("--nnodes", type=int, help="nodes: add the placement of every mesh group on them")
    plan.add_argument("--nproc-per-node", type=int, help="ranks per node (with --nnodes: world = N x K)")
    data = commands.add_parser("data", help="the first training sequences, decoded, and data statistics")
    data.add_argument("config")
    data.add_argument("--show", type=int, default=3, help="how many training sequences to print")
    data.add_argument("--output-dir", help="override output_dir (where the data cache is, by default)")
    return parser


def _auto_flags(parser: argparse.ArgumentParser) -> None:
    """The budget and the cost model's hardware (``cli.auto_plan``)."""
    parser.add_argument("--memory-per-rank", help="with --auto: the memory budget of a rank, e.g. 80GiB")
    parser.add_argument("--flops", type=float, default=400.0, help="with --auto: TFLOP/s a rank sustains")
    parser.add_argument("--link-bandwidth", type=float, default=50.0, help="with --auto: GB/s a rank receives")
    parser.add_argument("--memory-bandwidth", type=float, default=2000.0, help="with --auto: device GB/s")
    parser.add_argument("--host-bandwidth", type=float, default=25.0, help="with --auto: device-host GB/s")


def torchrun_args(args: argparse.Namespace, signals_to_handle: str | None = None) -> list[str]:
    """The ``torch.distributed.run`` command line for a parsed ``train`` call. The workers
    take the job from the launcher's resolved file (``cli.resolved_job``), overrides applied;
    the job file stays on their command line, which they check the resolved file against.
    ``signals_to_handle``: the signals torchrun's agent ends the job on (the others are the
    launcher's: ``cli.preemption``)."""
    launch = ["--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts)]
    if signals_to_handle is not None:
        launch += ["--signals-to-handle", signals_to_handle]
    passed = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in TORCHRUN_FLAGS}
    for flag, value in passed.items():
        if value is not None:
            launch += [flag, str(value)]
    if args.standalone or (passed["--nnodes"] in (None, "1") and passed["--rdzv-endpoint"] is None
                           and passed["--master-addr"] is None):
        launch.append("--standalone")
    worker = ["-m", "fsdp_turbo.cli.worker", args.config, "--resume", args.resume]
    if args.stop_at_step is not None:
        worker += ["--stop-at-step", str(args.stop_at_step)]
    return launch + worker


def _static_world(args: argparse.Namespace) -> int | None:
    nproc, nnodes = str(args.nproc_per_node), str(args.nnodes or 1)
    return int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None


def _prepare_data(job):
    """Tokenize and pack the data here, once, before any worker starts: a bad source is one
    clear error, and the workers find the cache (each prepares it itself only where this
    node has no copy, e.g. without a shared file system)."""
    from fsdp_turbo.cli.data import load_data
    from fsdp_turbo.cli.model import hf_config, stated_vocab_size

    vocab_size = stated_vocab_size(job.model)
    if vocab_size is None:
        vocab_size = getattr(hf_config(job.model), "vocab_size", None)
    return load_data(job.data, job.output_dir, job.run.seed, vocab_size=vocab_size,
                     ignore_index=job.turbo.model_facts.ignore_index)


def _prepare_data_here(job, args: argparse.Namespace) -> None:
    """``_prepare_data``; a data error on one node of several is left to its workers.

    On one node the error ends the command before launch. With several nodes, the other
    nodes' agents would wait for this one at the rendezvous until its timeout (minutes).
    So this node launches anyway: its workers meet the same error inside an all-ranks
    agreement, and every rank of every node stops at once with its message."""
    try:
        _prepare_data(job)
    except ConfigError as error:
        if args.nnodes in (None, "1"):
            raise
        print(f"fsdp-turbo: this node cannot prepare the data; its workers will stop every node with: {error}",
              file=sys.stderr)


def resolve(args: argparse.Namespace):
    """The job of a parsed call: its file with the command's overrides applied, checked."""
    from fsdp_turbo.cli.resolved_job import resolve_job

    return resolve_job(args.config, max_steps=getattr(args, "max_steps", None),
                       output_dir=getattr(args, "output_dir", None), save_every=getattr(args, "save_every", None))


def _check_train(job, args: argparse.Namespace) -> None:
    """What ``train`` checks before launch: the sizes at the launched world, where the flags
    fix it (elastic ranges such as ``1:4`` are checked by the workers), then the data."""
    from fsdp_turbo.cli.sizes import job_sizes

    world = _static_world(args)
    if world is not None:
        job_sizes(job, world)
    _prepare_data_here(job, args)


# What every rank imports, imported once per launch by the forkserver the workers fork from.
WORKER_PRELOAD = ["fsdp_turbo.cli.preload"]


def run_agent(launch: list[str]) -> None:
    """torchrun's agent, in this process, on a ``torchrun_args`` command line: torchrun's own
    rendezvous, restarts, signals and failure reports, with one change. torchrun would start
    each worker as ``python -u -m fsdp_turbo.cli.worker``, and every worker would import
    torch, transformers and the library again (4-5 s of CPU each on the suite's machine,
    more than a tiny job's training). Here each is a function (``worker.rank_main``) forked
    from a forkserver that imported them once for the launch (``WORKER_PRELOAD``: ``cli.preload``); torch
    starts no thread and touches no device at import, so forking afterwards is safe. A
    restart forks fresh workers from the same server."""
    import multiprocessing
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args, parse_min_max_nnodes

    script = launch.index("-m")
    args = parse_args([*launch[:script], "--start-method", "forkserver", *launch[script:]])
    # what torchrun's ``run`` does with the same flags before it launches
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                           and parse_min_max_nnodes(args.nnodes)[1] == 1):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)  # sets OMP_NUM_THREADS=1 for several workers, as torchrun does
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # torchrun's ``python -u``: the server and its forks
    multiprocessing.get_context("forkserver").set_forkserver_preload(WORKER_PRELOAD)
    # record: a failed worker's error, as torchrun's ``main`` reports it
    record(elastic_launch(config=config, entrypoint=_rank))(launch[script + 2:])


def _rank(argv: list[str]) -> None:
    """A worker's entry point (``worker.rank_main``), named here so that the launcher, which
    only pickles it for the forkserver, never imports the worker and its dependencies (1 s of
    CPU a launch): the forkserver has them preloaded."""
    from fsdp_turbo.cli.worker import rank_main

    rank_main(argv)


def _launch(job, args: argparse.Namespace) -> int:
    """torchrun, with the resolved job in a folder of this launch's (``cli.resolved_job``); the
    preemption signals passed on to the workers (``cli.preemption``). Returns the exit code:
    0, or ``PREEMPTED_EXIT`` when the workers saved and ended on a preemption signal."""
    from fsdp_turbo.cli import preemption
    from fsdp_turbo.cli.resolved_job import VARIABLE, write_resolved

    # Restarted workers must not share the rendezvous TCPStore of the failed attempt: with it
    # they can read the dead attempt's peer addresses (pytorch/pytorch#135712; seen here as
    # gloo "connection refused" and hangs after a kill -9).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    preemption.clear_mark(job.output_dir)
    notice = preemption.LauncherNotice(job.run.preemption_signals)
    try:
        with tempfile.TemporaryDirectory(prefix="fsdp-turbo-job-") as folder:
            os.environ[VARIABLE] = str(write_resolved(job, args.config, folder))
            run_agent(torchrun_args(args, notice.torchrun_signals))
    finally:
        notice.close()
    record = preemption.read_mark(job.output_dir)
    if record is None and notice.received is None:
        return 0
    where = f"after step {record['step']} ({record.get('signal')})" if record else f"({notice.received})"
    print(f"fsdp-turbo: preempted {where}: the checkpoint of that step is complete; run the same command "
          f"again (--resume auto) to go on. Exit code {preemption.PREEMPTED_EXIT}.", file=sys.stderr)
    return preemption.PREEMPTED_EXIT


def _run_command(args: argparse.Namespace):
    """``plan`` and ``data`` do their work; ``train`` checks the job and returns it to launch."""
    job = resolve(args)
    if args.command == "plan":
        if args.auto:
            _plan_auto(job, args)
            return None
        from fsdp_turbo.cli.plan import print_plan

        print_plan(job, args.world_size, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, as_json=args.json)
        return None
    if args.command == "data":
        from fsdp_turbo.cli.data.show import show

        sys.stdout.write(show(job.data, _prepare_data(job), args.show) + "\n")
        return None
    if args.auto:
        job = _train_auto(job, args)
    _check_train(job, args)
    return job


def _search(job, args: argparse.Namespace, world: int | None):
    from fsdp_turbo.cli.auto_plan import Hardware, parse_size, search

    if args.memory_per_rank is None:
        raise ConfigError("--memory-per-rank", None, "give the memory budget of a rank with --auto, e.g. "
                          "--memory-per-rank 80GiB")
    if world is None:
        raise ConfigError("--auto", True, "give the world size (plan: --world-size; train: a whole --nproc-per-node "
                          "and --nnodes)", reason="the search needs a fixed number of ranks")
    hardware = Hardware(args.flops * 1e12, args.link_bandwidth * 1e9, args.memory_bandwidth * 1e9,
                        args.host_bandwidth * 1e9)
    return search(job, world, parse_size(args.memory_per_rank), hardware)


def _plan_auto(job, args: argparse.Namespace) -> None:
    """``plan --auto``: the fitting layouts, fastest first (``--json``: ``auto.turbo`` is the
    chosen section); ``--write FILE``: the job with it."""
    import json

    from fsdp_turbo.cli.auto_plan import auto_json, auto_lines, with_best
    from fsdp_turbo.cli.plan import plan_job

    world = args.world_size
    if world is None and args.nnodes and args.nproc_per_node:
        world = args.nnodes * args.nproc_per_node
    result = _search(job, args, world)
    chosen = with_best(job, result)  # raises, naming the smallest peak, when nothing fits
    if args.write:
        from fsdp_turbo.cli.auto_plan import write_job

        write_job(chosen, args.write)
    if args.json:
        from fsdp_turbo.cli.job_config import JobConfig

        summary = plan_job(JobConfig.from_dict(chosen), world).summary
        print(json.dumps({**summary, "auto": auto_json(result)}, indent=2))
        return
    print("\n".join(auto_lines(result) + ([f"wrote {args.write}"] if args.write else [])))


def _train_auto(job, args: argparse.Namespace):
    """``train --auto``: the job with the layout ``plan --auto`` picks at the launched world."""
    from fsdp_turbo.cli.auto_plan import with_best
    from fsdp_turbo.cli.job_config import JobConfig

    result = _search(job, args, _static_world(args))
    print(f"fsdp-turbo: --auto picked {result.best.choice.describe()} (predicted peak "
          f"{result.best.peak / 2**20:,.1f} MiB a rank)", file=sys.stderr)
    return JobConfig.from_dict(with_best(job, result))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        job = _run_command(args)
    except ConfigError as error:
        print(f"fsdp-turbo: {error}", file=sys.stderr)
        return 2
    return 0 if job is None else _launch(job, args)


if __name__ == "__main__":
    sys.exit(main())
