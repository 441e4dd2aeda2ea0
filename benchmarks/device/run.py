"""The device run: one command, at most ten minutes, that measures dlspark on a GPU host and
writes ``device.json`` (and ``device.log``) to a folder.

On a host with JAX but without dask, distributed or a package index, from the tree's root::

    python3 benchmarks/device/run.py --out "$OUT"

installs the wheels of ``benchmarks/device/wheels/`` offline (fetched beforehand with
``python benchmarks/device/fetch_wheels.py``; their hashes are checked against
``wheels.lock``) and dlspark from this tree, then runs the sections of ``sections.py``, each in
a process of its own under a time budget (a section that fails or runs out of time is recorded
as such, and the next one runs). ``--dry-run`` runs the same code on CPU devices with the
smallest sizes (two CPU workers, one run each): the test suite's check that nothing here rots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from fetch_wheels import DEBS, LOCK, WHEELS, check_wheels, read_lock  # noqa: E402

SCHEMA = 1
#: the GPU first, since the host may go away; the many-core curve last, since it uses whatever
#: time the sections before it left (a section's unused budget goes to the next)
ORDER = ("gpu_cluster", "gpu_parallel", "network", "many_core")

#: the full run on a GPU host with 16 cores: sizes and seconds per section (about 8.5 minutes
#: together, with the install); ``--only many_core`` or ``--only network`` gives one section a
#: whole run's time. On one H200 the GPU sections took 140 s and 13 s, and a many-core
#: configuration 30 to 40 s (twelve of them a run)
FULL = {
    # a GPU step of the MLP takes well under a millisecond: many rounds cost little, and each
    # (minibatch, rounds) keeps a segment's data near 100 MB
    "gpu_cluster": {"budget_s": 190, "digits_epochs": 12, "algorithms": ["averaging", "sharing"],
                    "worker_batches": [[160, 200], [2048, 64]], "segments": 4, "measure_s": 25,
                    "memory_settings": ["preallocate_off", "fraction_30_preallocated", "fraction_30"],
                    "memory_rounds": 10},
    "gpu_parallel": {"budget_s": 30, "gpu_batches": [160, 2048], "wrapper_rounds": 20, "measure_s": 12},
    "many_core": {"budget_s": 160, "workers": [2, 4, 8], "runs": 3,
                  "pairs": [["averaging", "mlp"], ["averaging", "cnn"], ["sharing", "mlp"], ["sharing", "cnn"]],
                  "batches": {}, "n_rounds": 60, "segments": 3, "measure_s": 15},
    # the network's four contenders at 4 workers take about 110 s (one fit each, on an H100
    # host): at 60 s the full run measured gradient sharing alone
    "network": {"budget_s": 110, "workers": [4, 8], "contenders": ["sharing", "averaging5", "ddp", "averaging50-outer"],
                "examples": 16000, "epochs": 2, "runs": 1, "contender_s": 20},
}
#: the dry run: the same code on CPU devices, smallest sizes, each loop's body once or twice;
#: the budgets are ceilings, not the expected times (``--budget-scale`` widens them further)
DRY = {
    # the digits example in this process (its --local): the same main, which tests/test_examples.py
    # runs on the embedded cluster; the cluster's code here is the measurements' below
    "gpu_cluster": {"budget_s": 300, "digits_epochs": 1, "digits_local": True, "algorithms": ["averaging"],
                    "worker_batches": [[16, 24]],
                    "segments": 2, "measure_s": 0,
                    # one memory setting (its own worker, each a cluster's start): the one that changes both
                    # variables from the worker's defaults, which tests/test_cluster.py checks
                    "memory_settings": ["fraction_30_preallocated"], "memory_rounds": 2},
    "gpu_parallel": {"budget_s": 150, "gpu_batches": [16], "wrapper_rounds": 4, "measure_s": 0},
    # gradient sharing's CNN only: gpu_cluster's worker_vs_plain already runs bench_efficiency.measure
    # with averaging's MLP, so a second pair here would run the same code again
    "many_core": {"budget_s": 300, "workers": [2], "runs": 1, "pairs": [["sharing", "cnn"]],
                  "batches": {"cnn": 2}, "n_rounds": 24, "segments": 2, "measure_s": 0},
    "network": {"budget_s": 240, "workers": [2], "contenders": ["averaging5"], "examples": 1024, "epochs": 1,
                "runs": 1, "contender_s": 0},
}
#: the sections' budgets together in a full run; sections run alone (``--only``) share as much
FULL_BUDGET_S = sum(c["budget_s"] for c in FULL.values())
#: seconds a section gets after its budget to end by itself, before it is killed
GRACE_S = 10


def _ar_members(path: str):
    """``(name, bytes)`` of each member of an ``ar`` archive (a ``.deb``)."""
    with open(path, "rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise ValueError(f"{path} is not a Debian package (no ar header)")
        while header := f.read(60):
            name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode())
            yield name, f.read(size)
            if size % 2:
                f.read(1)


def unpack_debs(folder: str, prefix: str) -> dict:
    """Unpack every ``.deb`` in ``folder`` under ``prefix`` (nothing is installed: no
    maintainer script runs, no system path is touched) and put a wrapper for each program of
    ``bin``, ``sbin``, ``usr/bin`` and ``usr/sbin`` in ``prefix/wrappers`` that runs it with the
    unpacked libraries first. Returns ``{"packages": [...], "bin": prefix/wrappers}``, or
    ``{"packages": []}``."""
    import io
    import tarfile

    debs = sorted(f for f in os.listdir(folder) if f.endswith(".deb")) if os.path.isdir(folder) else []
    if not debs:
        return {"packages": []}
    for deb in debs:
        data = [(n, b) for n, b in _ar_members(os.path.join(folder, deb)) if n.startswith("data.tar")]
        if not data:
            raise ValueError(f"{deb} holds no data.tar member")
        with tarfile.open(fileobj=io.BytesIO(data[0][1])) as tar:
            # a link to an absolute path (documentation, mostly) would point outside the prefix
            keep = [m for m in tar.getmembers() if not (m.issym() and os.path.isabs(m.linkname))]
            tar.extractall(prefix, members=keep, filter="tar")
    libs = [os.path.join(prefix, d) for d in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu")]
    bin_dir = os.path.join(prefix, "wrappers")
    os.makedirs(bin_dir, exist_ok=True)
    for sub in ("usr/sbin", "sbin", "usr/bin", "bin"):
        d = os.path.join(prefix, sub)
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            wrapper = os.path.join(bin_dir, name)
            if os.path.exists(wrapper) or not os.path.isfile(os.path.join(d, name)):
                continue
            with open(wrapper, "w") as f:
                f.write(f'#!/bin/sh\nLD_LIBRARY_PATH={":".join(libs)}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}} '
                        f'exec {os.path.join(d, name)} "$@"\n')
            os.chmod(wrapper, 0o755)
    return {"packages": debs, "bin": bin_dir}


def _env_for(section: str, dry_run: bool, pythonpath: str | None, cache: str, tools: dict | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tools and tools.get("bin") and section == "network":  # iproute2 unpacked from benchmarks/device/debs
        env["PATH"] = tools["bin"] + os.pathsep + env.get("PATH", "")
    if "JAX_COMPILATION_CACHE_DIR" not in env:
        # every measurement starts several processes that compile the same step: compile it once
        env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    if dry_run or section in ("many_core", "network"):
        env["JAX_PLATFORMS"] = "cpu"  # CPU workers; on a GPU host they would otherwise each want the GPU
    else:
        # the plain baseline processes share the GPU with a worker: neither takes 75% of it at start
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    return env


def _importable(python: str, env=None) -> tuple:
    code = ("import json, dask, distributed, dask.distributed, dlspark, jax; "
            "print(json.dumps({'dask': dask.__version__, 'distributed': distributed.__version__, "
            "'jax': jax.__version__, 'dlspark': dlspark.__file__}))")
    # from / : the tree's own folder on sys.path would make dlspark importable uninstalled
    p = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd="/")
    return (json.loads(p.stdout.strip().splitlines()[-1]), "") if p.returncode == 0 else (None, p.stderr[-1500:])


def install(python: str = sys.executable, wheels: str = WHEELS, lock: str = LOCK) -> dict:
    """Make ``import dask.distributed, dlspark`` work for ``python`` without a package index.

    Nothing is installed where it works already. Otherwise the locked wheels (hashes checked)
    go in with ``pip install --no-index``, pip keeping the packages already there that satisfy
    them, and dlspark from this tree (``pip install --no-deps``; where it cannot be built, this
    tree goes on ``PYTHONPATH`` instead). Returns what was done, with ``pythonpath`` set to the
    path the sections need, if any.
    """
    found, why = _importable(python)
    if found:
        return {"done": "nothing: dask.distributed and dlspark import already", "versions": found, "pythonpath": None}
    out = {"before": why.strip().splitlines()[-1] if why.strip() else why, "pythonpath": None}
    out["wheels"] = [os.path.basename(p) for p in check_wheels(wheels, lock)]
    pins = read_lock(lock)
    top = [f"{n}=={pins[n][0]}" for n in ("dask", "distributed", "xxhash")]
    t0 = time.monotonic()
    subprocess.run([python, "-m", "pip", "install", "--no-index", "--find-links", wheels, "--no-cache-dir",
                    "--disable-pip-version-check", "-q", *top], check=True)
    p = subprocess.run([python, "-m", "pip", "install", "--no-index", "--no-deps", "--no-build-isolation",
                        "--no-cache-dir", "--disable-pip-version-check", "-q", ROOT], capture_output=True, text=True)
    if p.returncode == 0:
        out["dlspark"] = "pip install --no-deps of this tree"
    else:
        out["dlspark"] = "on PYTHONPATH (pip could not build this tree: " + (p.stderr.strip().splitlines() or ["?"])[-1] + ")"
        out["pythonpath"] = ROOT
    out["seconds"] = round(time.monotonic() - t0, 1)
    env = dict(os.environ, PYTHONPATH=ROOT) if out["pythonpath"] else None
    out["versions"], why = _importable(python, env)
    if out["versions"] is None:
        raise RuntimeError(f"after installing, `import dask.distributed, dlspark` still fails:\n{why}")
    return out


def host_info() -> dict:
    info = {"hostname": platform.node(), "python": sys.version.split()[0], "machine": platform.machine(),
            "cpus": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0))}
    try:
        p = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        info["commit"] = p.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def run_section(name: str, config: dict, env: dict, log) -> dict:
    """One section in a process group of its own, killed whole (workers too) past its budget."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        t0 = time.monotonic()
        with open(os.path.join(tmp, "log"), "w+") as out:
            proc = subprocess.Popen([sys.executable, os.path.join(HERE, "sections.py"), name, json.dumps(config),
                                     result], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
            try:
                rc = proc.wait(config["budget_s"] + GRACE_S)
                status = "ok" if rc == 0 else f"failed (exit status {rc})"
            except subprocess.TimeoutExpired:
                status = f"stopped at its time budget ({config['budget_s']} s)"
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(proc.pid, sig)
                        proc.wait(10)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
            try:  # a killed section's helpers (workers, baselines) are in its group too
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out.seek(0)
            text = out.read()
        log.write(f"===== {name}: {status}\n{text[-20000:]}\n")
        log.flush()
        try:
            data = json.load(open(result))
        except (OSError, ValueError):
            data = {}
    entry = {"status": status if status != "ok" or "skipped" not in data else "skipped",
             "seconds": round(time.monotonic() - t0, 1), "budget_s": config["budget_s"], "config": config,
             "result": data}
    if status != "ok":
        entry["log_tail"] = text[-3000:]
    return entry


def _save(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for device.json and device.log")
    ap.add_argument("--dry-run", action="store_true", help="CPU devices, smallest sizes: a check that the code runs")
    ap.add_argument("--only", nargs="+", choices=ORDER,
                    help="run these sections alone, sharing a full run's time among them")
    ap.add_argument("--install-only", action="store_true", help="install (if needed), check the imports, stop")
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiply every section's time budget (for a slow or loaded machine)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "device.json")
    plan = DRY if args.dry_run else FULL
    report = {"schema": SCHEMA, "dry_run": args.dry_run,
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/device/run.py", *(sys.argv[1:] if argv is None else argv)]),
              "host": host_info(), "sections": {}}
    t0 = time.monotonic()
    try:
        report["install"] = install()
    except Exception as e:  # nothing below can run without it
        report["install"] = {"error": f"{type(e).__name__}: {e}"}
        _save(path, report)
        raise SystemExit(f"install failed: {e}")
    _save(path, report)
    if args.install_only:
        return report
    env_path = report["install"].get("pythonpath")
    names = args.only or ORDER
    scale = args.budget_scale * (1.0 if args.dry_run else FULL_BUDGET_S / sum(plan[n]["budget_s"] for n in names))
    with open(os.path.join(args.out, "device.log"), "w") as log, tempfile.TemporaryDirectory() as cache, \
            tempfile.TemporaryDirectory() as tools_dir:
        tools = None
        if "network" in names and shutil.which("ip") is None:
            try:
                tools = report["tools"] = unpack_debs(DEBS, tools_dir)
            except Exception as e:  # the network section then records its skip
                report["tools"] = {"error": f"{type(e).__name__}: {e}"}
        spare = 0.0  # what the sections so far left of their budgets goes to the next
        for name in names:
            budget = round(plan[name]["budget_s"] * scale + spare)
            config = dict(plan[name], dry_run=args.dry_run, budget_s=budget)
            print(f"{name}: up to {config['budget_s']} s", flush=True)
            env = _env_for(name, args.dry_run, env_path, cache, tools)
            report["sections"][name] = run_section(name, config, env, log)
            spare = max(0.0, budget - report["sections"][name]["seconds"])
            print(f"{name}: {report['sections'][name]['status']} in {report['sections'][name]['seconds']} s", flush=True)
            _save(path, report)
    report["seconds"] = round(time.monotonic() - t0, 1)
    report["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _save(path, report)
    return report


if __name__ == "__main__":
    main()
