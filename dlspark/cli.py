"""The ``dlspark`` command: look at a cluster, and run a training script on one (spark-submit's role).

    dlspark info [--scheduler ADDR] [TLS OPTIONS]
    dlspark train SCRIPT [--scheduler ADDR | --slurm OPTIONS | --local N] [--client-cpu] [TLS OPTIONS] [-- ARGS]

``train`` sets up the cluster, then runs ``python SCRIPT ARGS`` with
``dlspark.client.address`` pointing at it (``DASK_DLSPARK__CLIENT__ADDRESS``):
the script's ``DistributedTrainer(None, ...)`` connects there, so the same script
runs unchanged on a laptop, on SLURM or against a running scheduler.

A ``tls://`` scheduler is reached with the certificates in dask's configuration
(``distributed.comm.tls.ca-file``, ``distributed.comm.tls.client.cert`` and
``.key``), or those given as ``--tls-ca-file``, ``--tls-cert`` and ``--tls-key``:
these are handed to the script too (as ``DASK_DISTRIBUTED__COMM__TLS__...``
variables), and an embedded cluster started with them (``--local``) speaks TLS
only, every process presenting that certificate.
"""

from __future__ import annotations

import os
import subprocess
import sys

import click

__all__ = ["main", "worker_facts", "parse_slurm_options"]

_ENV_SHOWN = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "JAX_PLATFORMS", "XLA_PYTHON_CLIENT_PREALLOCATE",
              "XLA_PYTHON_CLIENT_MEM_FRACTION")


def worker_facts(dask_worker=None) -> dict:
    """What a worker runs on: JAX's devices, its memory limit, threads and JAX's settings (run on the worker)."""
    import jax

    return {"devices": [f"{d.platform}:{d.id}" for d in jax.devices()],
            "memory_limit": dask_worker.memory_manager.memory_limit,
            "nthreads": dask_worker.state.nthreads,
            "env": {k: os.environ[k] for k in _ENV_SHOWN if k in os.environ}}


def parse_slurm_options(text: str) -> dict:
    """``"workers=2,memory_limit=4GB,queue=gpu"`` (commas or spaces) into :func:`~dlspark.cluster.slurm_cluster`'s
    arguments; values read as YAML scalars (``2`` is a number, ``lo`` a string)."""
    import yaml

    options = {}
    for item in text.replace(",", " ").split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE pairs such as 'workers=2,memory_limit=4GB', got {item!r}",
                                     param_hint="--slurm")
        options[key.replace("-", "_")] = yaml.safe_load(value) if value else ""
    return options


def _tls_options(command):
    """``--tls-ca-file``, ``--tls-cert`` and ``--tls-key`` (dask's own CLI names) on ``command``."""
    for name, what in reversed((("--tls-ca-file", "the certificate authority that signed the cluster's certificates"),
                                ("--tls-cert", "this command's certificate (its key in --tls-key, or in the same file)"),
                                ("--tls-key", "the private key of --tls-cert"))):
        command = click.option(name, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
                               help=f"TLS: {what}; default: dask's distributed.comm.tls.* configuration")(command)
    return command


def _tls_config(ca_file, cert, key) -> dict:
    """Dask settings that make every connection of this command (and of a script it runs, and of
    an embedded cluster it starts) TLS with the given files, encryption required; {} without them."""
    if not (ca_file or cert or key):
        return {}
    if not (ca_file and cert):
        raise click.UsageError("TLS needs --tls-ca-file and --tls-cert (and --tls-key unless the certificate "
                               f"file holds the key too); got --tls-ca-file={ca_file!r} --tls-cert={cert!r}")
    paths = {"ca-file": ca_file}
    for role in ("client", "scheduler", "worker"):
        paths[f"{role}.cert"] = cert
        paths[f"{role}.key"] = key
    settings = {f"distributed.comm.tls.{k}": os.path.abspath(v) for k, v in paths.items() if v}
    settings["distributed.comm.require-encryption"] = True
    return settings


def _tls_env(settings: dict) -> dict:
    """:func:`_tls_config`'s settings as the ``DASK_...`` variables a script started from here reads."""
    return {"DASK_" + k.upper().replace(".", "__").replace("-", "_"): str(v) for k, v in settings.items()}


def _client(address, timeout, param_hint="--scheduler"):
    """A client of ``address``, or a usage error that says how to give a TLS scheduler its certificates."""
    from distributed import Client
    from distributed.security import Security

    if isinstance(address, str) and address.startswith("tls://") and not Security().get_connection_args("client").get(
            "ssl_context"):
        raise click.UsageError(
            f"{address} speaks TLS and no certificates are configured: give --tls-ca-file, --tls-cert and --tls-key, "
            "or set distributed.comm.tls.ca-file, distributed.comm.tls.client.cert and distributed.comm.tls.client.key "
            "in dask's configuration")
    return Client(address, timeout=timeout)


def _connect(scheduler, timeout):
    from distributed import Client

    from . import config

    address = scheduler or config.get("client.address")
    if address:
        return None, _client(address, timeout)
    from .cluster import local_cluster

    cluster = local_cluster()
    return cluster, Client(cluster)


@click.group()
def main():
    """dlspark: data-parallel training of JAX networks on Dask."""


@main.command()
@click.option("--scheduler", metavar="ADDR", help="a running scheduler (default: dlspark.client.address, "
              "else an embedded cluster sized to this machine)")
@click.option("--timeout", default=30.0, show_default=True, help="seconds to wait for the scheduler")
@_tls_options
def info(scheduler, timeout, tls_ca_file, tls_cert, tls_key):
    """The cluster: each worker's devices, memory and package versions, and any version mismatch."""
    import dask

    with dask.config.set(_tls_config(tls_ca_file, tls_cert, tls_key)):
        _info(scheduler, timeout)


def _info(scheduler, timeout):
    from dask.utils import format_bytes

    from .cluster import check_versions, cluster_versions, version_table
    from .errors import VersionMismatchError

    cluster, client = _connect(scheduler, timeout)
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        click.echo(f"scheduler {client.scheduler.address}, {len(workers)} worker(s)")
        facts = client.run(worker_facts)
        for addr in sorted(workers, key=lambda a: str(workers[a].get("name"))):
            f = facts.get(addr, {})
            limit = f.get("memory_limit")
            env = " ".join(f"{k}={v}" for k, v in f.get("env", {}).items())
            click.echo(f"  worker {workers[addr].get('name')} at {addr}: devices {', '.join(f.get('devices', []))}; "
                       f"{f.get('nthreads')} thread(s); memory limit {format_bytes(limit) if limit else 'none'}"
                       + (f"; {env}" if env else ""))
        versions = cluster_versions(client)
        click.echo("\n" + version_table(versions))
        try:
            check_versions(client)
        except VersionMismatchError as e:
            click.echo(f"\nversion mismatch: {', '.join(e.mismatches)}", err=True)
            sys.exit(1)
        click.echo("\nversions agree on every process")
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--scheduler", metavar="ADDR", help="run against this running scheduler")
@click.option("--slurm", metavar="OPTIONS", help="start SLURM workers: slurm_cluster's arguments as KEY=VALUE pairs, "
              "e.g. 'workers=4,gpus_per_worker=1,memory_limit=16GB,queue=gpu'")
@click.option("--local", type=click.IntRange(min=1), metavar="N", help="an embedded cluster of N workers")
@click.option("--client-cpu", is_flag=True, help="keep the script's JAX on CPU (JAX_PLATFORMS=cpu for it alone)")
@click.option("--timeout", default=300.0, show_default=True, help="seconds to wait for the workers")
@_tls_options
def train(script, args, scheduler, slurm, local, client_cpu, timeout, tls_ca_file, tls_cert, tls_key):
    """Run SCRIPT (with ARGS after --) on a cluster this command sets up; its trainer finds it.

    Without --scheduler, --slurm or --local: dlspark.client.address if set, else an embedded
    cluster sized to this machine. Exits with the script's exit status.
    """
    import dask

    tls = _tls_config(tls_ca_file, tls_cert, tls_key)
    with dask.config.set(tls):
        _train(script, args, scheduler, slurm, local, client_cpu, timeout, _tls_env(tls))


def _train(script, args, scheduler, slurm, local, client_cpu, timeout, tls_env):
    from distributed import Client

    from .cluster import gpu_devices, local_cluster, slurm_cluster
    from .distributed._client import install_plugins

    chosen = [name for name, v in (("--scheduler", scheduler), ("--slurm", slurm), ("--local", local)) if v]
    if len(chosen) > 1:
        raise click.UsageError(f"give one of --scheduler, --slurm, --local; got {' and '.join(chosen)}")
    cluster, pin, n = None, False, 0
    if slurm is not None:
        options = parse_slurm_options(slurm)
        n = options.pop("workers", 1)
        if not isinstance(n, int) or n < 1:
            raise click.BadParameter(f"workers must be a whole number >= 1, got {n!r}", param_hint="--slurm")
        if tls_env:  # dask-jobqueue reads no TLS settings: it takes them as a Security (which reads them)
            from distributed.security import Security

            options.setdefault("security", Security())
        try:
            cluster = slurm_cluster(n, **options)
        except TypeError as e:
            raise click.BadParameter(f"{e}; see dlspark.cluster.slurm_cluster for the options", param_hint="--slurm")
    elif scheduler is None and (local is not None or not _configured_address()):
        cluster = local_cluster(local)
        pin = not gpu_devices()[1]
    try:
        client = (Client(cluster, timeout=timeout) if cluster is not None
                  else _client(scheduler or _configured_address(), timeout))
        try:
            if n:
                client.wait_for_workers(n, timeout=timeout)
            install_plugins(client, pin)
            env = dict(os.environ, **tls_env, DASK_DLSPARK__CLIENT__ADDRESS=client.scheduler.address)
            if client_cpu:
                env["JAX_PLATFORMS"] = "cpu"
            click.echo(f"dlspark: running {script} against {client.scheduler.address} "
                       f"({len(client.scheduler_info(n_workers=-1)['workers'])} worker(s))", err=True)
            rc = subprocess.run([sys.executable, script, *args], env=env).returncode
            others = [c for c in client.run_on_scheduler(_clients_seen) if c != client.id]
            click.echo(f"dlspark: {script} exited with status {rc}; {len(others)} client(s) of its used this cluster",
                       err=True)
        finally:
            client.close()
    finally:
        if cluster is not None:
            cluster.close()
    sys.exit(rc)


def _clients_seen(dask_scheduler=None):
    """Ids of every client that connected to this scheduler (from its event log)."""
    return sorted(k for k in dask_scheduler.get_events() if str(k).startswith("Client-"))


def _configured_address():
    from . import config

    return config.get("client.address")


from .stats._cli import stats_command  # noqa: E402  (dlspark stats FILE.json [--html OUT.html])

main.add_command(stats_command)


if __name__ == "__main__":
    main()
