"""The sections of the device run, each run by ``run.py`` in a fresh process of its own::

    python benchmarks/device/sections.py NAME CONFIG_JSON RESULT_JSON

A section writes its result to ``RESULT_JSON`` after every piece it measures (atomically), so
that a section stopped at its time budget keeps what it had; a piece that fails records its
error and the section goes on with the next. The sections:

``gpu_cluster``
    One worker per GPU on the embedded cluster, the client's JAX kept on CPU: the digits
    example; a worker's steps/s against the plain ``jax.jit`` + optax step on the same GPU
    (``bench_efficiency.measure`` with one worker); the worker's device memory with JAX's
    preallocation off and with a memory fraction.
``gpu_parallel``
    ParallelWrapper's gradient sharing on the one GPU with each threshold encoder (host and
    XLA), their final parameters compared bit for bit, beside the plain step on that device.
``many_core``
    ``bench_efficiency.measure`` at several CPU worker counts, each worker pinned to a core of
    its own, the client's process (scheduler, nannies, client) on cores after the workers'.
``network``
    Whether network namespaces, veth pairs and ``tc tbf`` work here, then the network
    benchmark's contenders (``benchmarks/bench_network.py``) where it exists.

With ``"dry_run": true`` in the config the GPU sections run their code on CPU devices, and
their GPU-only readings (``nvidia-smi``, device memory statistics) come back empty.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)  # _common and bench_efficiency, as the benchmarks import each other

#: efficiency targets of the issue this run answers: a GPU worker against the plain loop on the
#: same GPU, and a CPU worker per algorithm
TARGETS = {"gpu_worker": 0.95, "averaging": 0.9, "sharing": 0.85}

#: worker memory settings compared on the GPU (keyword arguments of ``local_cluster``)
MEMORY_SETTINGS = {
    "preallocate_off": {"preallocate": False},
    "fraction_30_preallocated": {"preallocate": True, "memory_fraction": 0.3},
    "fraction_30": {"preallocate": False, "memory_fraction": 0.3},
}


class Recorder:
    """A section's result, saved after every change; ``part`` runs one piece within the budget."""

    def __init__(self, path: str, budget_s: float):
        self.path, self.data = path, {}
        self.deadline = time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def put(self, key, value):
        self.data[key] = value
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1, default=_jsonable)
        os.replace(tmp, self.path)

    def part(self, fn, *args, need_s: float = 0.0, **kwargs) -> dict:
        """``fn(*args, **kwargs)``'s dict with its ``seconds``; an error or a lack of time becomes
        ``{"error": ...}`` or ``{"skipped": ...}`` instead of stopping the section."""
        if self.left() < need_s:
            return {"skipped": f"time budget: {self.left():.0f} s left, this piece needs about {need_s:.0f} s"}
        t0 = time.monotonic()
        try:
            out = dict(fn(*args, **kwargs))
        except Exception as e:  # recorded; the section goes on
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        out["seconds"] = round(time.monotonic() - t0, 2)
        return out

    def append(self, key, value):
        self.put(key, [*self.data.get(key, []), value])


def counted_rounds(n_rounds: int, segments: int, algorithm: str) -> int:
    """Rounds per segment that ``bench_efficiency.measure`` counts: a segment holds
    ``n_rounds // segments`` averaging rounds of data (5 steps each), gradient sharing makes a
    round of 20 steps, and the first 2 rounds of each segment are left out."""
    steps = (n_rounds // segments) * bench_efficiency_frequency()
    return steps // (4 * bench_efficiency_frequency() if algorithm == "sharing" else bench_efficiency_frequency()) - 2


def bench_efficiency_frequency() -> int:
    import bench_efficiency

    return bench_efficiency.FREQ


def _jsonable(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return repr(x)


def _spread(values) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


# -- GPU readings (empty where there is no NVIDIA GPU) ------------------------------------------
def nvidia_smi() -> dict:
    """The GPUs and their compute processes as ``nvidia-smi`` reports them, or why not."""
    if shutil.which("nvidia-smi") is None:
        return {"unavailable": "nvidia-smi is not on the PATH"}
    q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version",
                        "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=30)
    gpus = []
    for line in q.stdout.strip().splitlines():
        name, total, used, driver = [s.strip() for s in line.split(",")]
        gpus.append({"name": name, "memory_total_mib": float(total), "memory_used_mib": float(used),
                     "driver": driver})
    procs = {}
    for line in apps.stdout.strip().splitlines():
        pid, used = [s.strip() for s in line.split(",")]
        procs[pid] = float(used)
    return {"gpus": gpus, "process_memory_mib": procs}


def _worker_device_memory():
    """Runs in a worker: its device, JAX's memory statistics for it, and the settings it started with."""
    import jax

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    env = {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                          "CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS")}
    return {"pid": os.getpid(), "device": str(device), "platform": device.platform, "env": env,
            **{k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved")}}


# -- gpu_cluster -------------------------------------------------------------------------------
def digits_example(epochs: int, local: bool = False) -> dict:
    """``examples/train_digits.py`` as written (its ``main``), on the embedded cluster it starts
    (or, ``local``, in this process: its ``--local``)."""
    import cloudpickle

    spec = importlib.util.spec_from_file_location("train_digits", os.path.join(ROOT, "examples", "train_digits.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # cloudpickle pickles by value only what is imported
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # its model class travels to workers that cannot import it
    accuracy = module.main(["--epochs", str(epochs), *(["--local"] if local else [])])
    return {"epochs": epochs, "local": local, "test_accuracy": float(accuracy)}


def worker_vs_plain(algorithm: str, batch: int, n_rounds: int, segments: int) -> dict:
    """One worker on the embedded cluster (its GPU, or a core in a dry run) against the plain
    jitted optax step in a process of its own on the same device."""
    import bench_efficiency

    r = bench_efficiency.measure("mlp", n_rounds=n_rounds, workers=1, algorithm=algorithm, segments=segments,
                                 batch=batch)
    return {**r, "batch": batch, "target": TARGETS["gpu_worker"],
            "meets_target": r["efficiency"] >= TARGETS["gpu_worker"]}


def worker_memory(settings: dict, batch: int, rounds: int) -> dict:
    """A short fit on one worker started with ``settings``; then the worker's device memory as
    JAX and ``nvidia-smi`` see it."""
    from distributed import Client

    import dlspark
    from _common import make_data, make_network
    from dlspark.cluster import local_cluster

    with local_cluster(1, client_cpu=True, **settings) as cluster, Client(cluster) as client:
        net = make_network("mlp")
        master = dlspark.ParameterAveraging(batch_size_per_worker=batch, averaging_frequency=5)
        with dlspark.DistributedTrainer(client, net, master, progress=False) as trainer:
            trainer.fit(make_data(batch * 5 * rounds, "mlp"))
            (worker,) = client.run(_worker_device_memory).values()
        smi = nvidia_smi()
    used = smi.get("process_memory_mib", {}).get(str(worker["pid"]))
    total = smi["gpus"][0]["memory_total_mib"] if smi.get("gpus") else None
    limit = worker.get("bytes_limit")
    return {"settings": settings, "worker": worker, "nvidia_smi_worker_mib": used,
            "gpu_total_mib": total, "limit_share_of_gpu": limit / (total * 2**20) if limit and total else None,
            "nvidia_smi": smi}


def worker_pieces(cfg: dict) -> list:
    """``(algorithm, minibatch, rounds)`` in the order ``gpu_cluster`` measures them: every
    algorithm at the first minibatch before any at the next (three runs in a row measured
    averaging's two minibatches first, spent the budget there and never reached gradient sharing)."""
    return [(a, batch, rounds) for batch, rounds in cfg["worker_batches"] for a in cfg["algorithms"]]


def gpu_cluster(cfg: dict, rec: Recorder) -> None:
    from dlspark.cluster import gpu_devices, keep_client_on_cpu

    keep_client_on_cpu()  # before any JAX computation here: the GPU stays whole for the workers
    import jax

    platform, ids = gpu_devices()
    if not ids and not cfg["dry_run"]:
        rec.put("skipped", "JAX sees no GPU here (dlspark.cluster.gpu_devices() found none)")
        return
    rec.put("platform", platform or "cpu")
    rec.put("gpus", list(ids))
    rec.put("client_backend", jax.default_backend())
    rec.put("nvidia_smi", nvidia_smi())
    rec.put("digits", rec.part(digits_example, cfg["digits_epochs"], cfg.get("digits_local", False), need_s=20))
    # the first comparison, then the memory readings, then the other comparisons: what a
    # budget cut leaves out is the least needed. A piece is started only if the longest so far
    # still fits.
    took = cfg["measure_s"]
    for i, (algorithm, batch, rounds) in enumerate(worker_pieces(cfg)):
        entry = {"algorithm": algorithm, **rec.part(
            worker_vs_plain, algorithm, batch, rounds, cfg["segments"], need_s=took)}
        rec.append("worker_vs_plain", entry)
        if "efficiency" in entry:
            took = max(took, entry["seconds"])
        if i == 0:
            memory = {}
            for name in cfg["memory_settings"]:
                memory[name] = rec.part(worker_memory, MEMORY_SETTINGS[name], 160, cfg["memory_rounds"], need_s=10)
                rec.put("memory", memory)


# -- gpu_parallel ------------------------------------------------------------------------------
def _wrapper_sharing(device, encoder: str, batch: int, rounds: int, held: dict) -> dict:
    """Gradient sharing in a ParallelWrapper on ``device`` with ``encoder``: a warm-up fit
    (compilation), then the timed fit; its final parameters are kept in ``held``."""
    import dlspark
    from _common import make_data, make_network

    net = make_network("mlp")
    master = dlspark.GradientSharing(batch_size_per_worker=batch, steps_per_round=5)
    wrapper = dlspark.ParallelWrapper(net, master, devices=[device], progress=False, sharing_encoder=encoder)
    wrapper.fit(make_data(batch * 5 * 3, "mlp"))
    wrapper.fit(make_data(batch * 5 * rounds, "mlp"))
    stats = wrapper.last_fit_stats[2:]  # as bench_parallel: the first rounds hold the loader's start
    steps, wall = sum(s["minibatches"] for s in stats), sum(s["round_time"] for s in stats)
    held[encoder] = (net.state.params, wrapper.published.get("communication"),
                     [s.get("threshold") for s in wrapper.last_fit_stats])
    return {"encoder": wrapper.published.get("sharing_encoder", encoder), "batch": batch,
            "steps_per_s": steps / wall, "communication": wrapper.published.get("communication")}


def _plain_on_device(batch: int, steps: int) -> dict:
    from _common import _plain_loop

    rate, cpu = _plain_loop("mlp", batch)(steps)
    return {"batch": batch, "steps_per_s": rate, "cpu_per_wall": cpu}


def _same_bits(held: dict) -> dict:
    import jax
    import numpy as np

    (pa, ca, ta), (pb, cb, tb) = held["host"], held["xla"]
    diffs = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
             for a, b in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)) if np.size(a)]
    equal = all(np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)))
    return {"params_equal": bool(equal), "max_abs_difference": max(diffs, default=0.0),
            "communication_equal": ca == cb, "thresholds_equal": ta == tb}


def _auto_encoder(device) -> dict:
    """The encoder ``sharing_encoder="auto"`` picks on ``device``, as a short fit publishes it."""
    import dlspark
    from _common import make_data, make_network

    wrapper = dlspark.ParallelWrapper(make_network("mlp"), dlspark.GradientSharing(batch_size_per_worker=8),
                                      devices=[device], progress=False)
    wrapper.fit(make_data(16, "mlp"))
    return {"encoder": wrapper.published.get("sharing_encoder")}


def gpu_parallel(cfg: dict, rec: Recorder) -> None:
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu" and not cfg["dry_run"]:
        rec.put("skipped", f"JAX's default backend here is {jax.default_backend()!r}: no GPU")
        return
    rec.put("device", str(device))
    rec.put("platform", device.platform)
    rec.put("auto_encoder", rec.part(_auto_encoder, device))
    held: dict = {}
    for batch in cfg["gpu_batches"]:
        held.clear()
        entry = {"batch": batch, "plain": rec.part(_plain_on_device, batch, 5 * cfg["wrapper_rounds"], need_s=5)}
        for encoder in ("host", "xla"):
            entry[encoder] = rec.part(_wrapper_sharing, device, encoder, batch, cfg["wrapper_rounds"], held,
                                      need_s=cfg["measure_s"] / 2)
            plain = entry["plain"].get("steps_per_s")
            if plain and "steps_per_s" in entry[encoder]:
                entry[encoder]["over_plain"] = entry[encoder]["steps_per_s"] / plain
        entry["bits"] = rec.part(_same_bits, held) if len(held) == 2 else {"skipped": "an encoder's fit did not run"}
        rec.append("sharing", entry)


# -- many_core ---------------------------------------------------------------------------------
def many_core(cfg: dict, rec: Recorder) -> None:
    import bench_efficiency

    from dlspark.distributed._worker import pin_process

    cores = sorted(os.sched_getaffinity(0))
    rec.put("cores", cores)
    rec.put("targets", {a: TARGETS[a] for a, _ in cfg["pairs"]})
    took: dict = {}  # workers -> longest measurement so far, the estimate for the next
    for run in range(cfg["runs"]):  # every configuration once before any twice
        for workers in cfg["workers"]:
            spare = cores[workers:workers + 2]
            client_cores = spare or cores[-1:]  # no spare core: the client shares the last worker's
            for algorithm, kind in cfg["pairs"]:
                entry = {"run": run, "workers": workers, "algorithm": algorithm, "network": kind,
                         "worker_cores": cores[:workers], "client_cores": client_cores,
                         "client_shares_a_worker_core": not spare}
                if workers > len(cores):
                    entry["skipped"] = f"{workers} workers need {workers} cores; this process may use {len(cores)}"
                else:
                    try:
                        entry.update(rec.part(bench_efficiency.measure, kind, n_rounds=cfg["n_rounds"],
                                              workers=workers, algorithm=algorithm, segments=cfg["segments"],
                                              client_cores=client_cores, batch=cfg["batches"].get(kind),
                                              need_s=took.get(workers, cfg["measure_s"])))
                    finally:
                        pin_process(set(cores))  # also where measure stopped before moving back
                    if "seconds" in entry and "efficiency" in entry:
                        took[workers] = max(took.get(workers, 0.0), entry["seconds"])
                rec.append("runs", entry)
    summary = []
    for workers in cfg["workers"]:
        for algorithm, kind in cfg["pairs"]:
            done = [r for r in rec.data.get("runs", []) if "efficiency" in r and r["workers"] == workers
                    and r["algorithm"] == algorithm and r["network"] == kind]
            eff = _spread([r["efficiency"] for r in done])
            summary.append({"workers": workers, "algorithm": algorithm, "network": kind, "efficiency": eff,
                            "efficiency_over_bound": _spread([r["efficiency_over_bound"] for r in done]),
                            "cluster_bound": _spread([r["cluster_bound"] for r in done]),
                            "plain_step_ms": _spread([r["plain_step_ms"] for r in done]),
                            "meets_target": None if eff is None else eff["median"] >= TARGETS[algorithm]})
    rec.put("summary", summary)


# -- network -----------------------------------------------------------------------------------
def _sh(*cmd) -> tuple:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"{type(e).__name__}: {e}"
    return p.returncode == 0, (p.stdout + p.stderr).strip()[-400:]


def namespace_probe() -> dict:
    """Whether this host lets a benchmark emulate separate hosts: a network namespace, a veth
    pair into it, and a ``tc tbf`` rate limit; everything made here is removed again."""
    if shutil.which("ip") is None:
        return {"ok": False, "reason": "the ip command (iproute2) is not installed"}
    tag = f"devprobe{os.getpid() % 100000}"  # not dlspark.testing's prefix: its sweep leaves it alone
    steps = [("netns", ("ip", "netns", "add", tag)),
             ("veth", ("ip", "link", "add", tag + "a", "type", "veth", "peer", "name", tag + "b")),
             ("veth_into_netns", ("ip", "link", "set", tag + "b", "netns", tag)),
             ("tbf", ("tc", "qdisc", "add", "dev", tag + "a", "root", "tbf", "rate", "1gbit", "burst", "512kb",
                      "latency", "50ms"))]
    out = {"ok": True}
    try:
        for name, cmd in steps:
            ok, text = _sh(*cmd)
            out[name] = ok if ok else text
            if not ok:
                out["ok"], out["reason"] = False, f"{' '.join(cmd)} failed: {text}"
                break
    finally:
        _sh("ip", "link", "del", tag + "a")
        _sh("ip", "netns", "del", tag)
    return out


def _network_rows(cfg: dict, rec: Recorder, workers: int, singles: dict) -> list:
    """``bench_network.measure`` for each contender on ``workers`` emulated hosts."""
    import bench_network
    from distributed import Client

    from dlspark.testing import emulated_cluster

    rows = []
    with emulated_cluster(workers) as net, Client(net.scheduler_address, set_as_default=False) as client:
        for contender in cfg["contenders"]:
            framework = "torch" if contender.startswith("ddp") else "jax"
            if singles.get(framework) is None:
                row = {"skipped": f"{framework} is not installed here"}
            else:
                row = rec.part(bench_network.measure, net, client, contender, "unlimited", cfg["examples"],
                               cfg["epochs"], cfg["runs"], singles[framework], need_s=cfg["contender_s"])
            rows.append({"workers": workers, "contender": contender, **row})
            rec.put("rows", [*rec.data.get("rows", []), rows[-1]])
    return rows


def network(cfg: dict, rec: Recorder) -> None:
    probe = namespace_probe()
    rec.put("namespaces", probe)
    if importlib.util.find_spec("bench_network") is None:
        rec.put("skipped", "benchmarks/bench_network.py is not in this tree")
        return
    if not probe["ok"]:
        rec.put("skipped", f"network namespaces do not work here: {probe['reason']}")
        return
    import bench_network

    from dlspark.testing import netns_unavailable

    why = netns_unavailable()
    if why:
        rec.put("skipped", f"network namespaces do not work here: {why}")
        return
    singles = {"jax": bench_network.run_plain(cfg["examples"], cfg["epochs"]),
               "torch": None}
    if importlib.util.find_spec("torch") is not None and any(c.startswith("ddp") for c in cfg["contenders"]):
        singles["torch"] = bench_network.torch_single(cfg["examples"], cfg["epochs"], cfg["runs"])
    rec.put("single_process_examples_per_s", singles)
    for workers in cfg["workers"]:
        if rec.left() < cfg["contender_s"]:
            rec.put("rows", [*rec.data.get("rows", []), {"workers": workers, "skipped": "time budget"}])
            continue
        try:
            _network_rows(cfg, rec, workers, singles)
        except Exception as e:  # the emulated cluster itself failed: recorded, the next size still runs
            rec.put("rows", [*rec.data.get("rows", []), {"workers": workers, "error": f"{type(e).__name__}: {e}",
                                                         "traceback": traceback.format_exc()[-3000:]}])


SECTIONS = {"gpu_cluster": gpu_cluster, "gpu_parallel": gpu_parallel, "many_core": many_core, "network": network}


if __name__ == "__main__":
    name, config, result = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    recorder = Recorder(result, config["budget_s"])
    SECTIONS[name](config, recorder)
    recorder.put("done", True)
