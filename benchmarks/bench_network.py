"""Examples/s on separate emulated hosts at several link rates: dlspark against torch DDP.

Two workers, each in a network namespace of its own with its link rate-limited in both
directions (:func:`dlspark.testing.emulated_cluster`; root and iproute2 needed), train the
320-640-640-640-10 MLP (about 1.03 M parameters) with Adam, 128 examples a step per worker,
on 16,000 synthetic examples for 2 epochs. Each contender is warmed by an identical earlier
fit and timed from its ``fit`` call to its return; its examples/s is divided by that of one
plain ``jax.jit`` + optax process pinned to one core, run before and after it in the same run
(their mean). Wire bytes per worker per fit come from the namespaces' interface counters,
beside what dlspark reports. torch DDP (gloo, one rank per namespace, ``GLOO_SOCKET_IFNAME``)
is the field's baseline, plain and with its ``fp16_compress_hook`` and ``powerSGD_hook``; each
framework's scaling over its own single process is reported too, so that torch's and XLA's
CPU speeds are not read as an algorithm's merit. ``--delays`` adds a one-way delay between
the hosts (iptables needed), for designs bound by round trips.

Run::

    python benchmarks/bench_network.py --rates unlimited 1gbit --runs 3 --out docs/_data/bench_network.json
    python benchmarks/bench_network.py --rates 1gbit --delays none 1ms --runs 3   # with latency

Under asv, :class:`TrackNetwork` measures one contender at one rate per call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

WIDTHS = (640, 640, 640)
N_FEATURES = 320
BATCH = 128
LR = 1e-3


#: The task: Gaussian inputs labelled by a random teacher network (320-16-10, ReLU, argmax),
#: which the MLP goes on learning and then fitting for many epochs, so that every timed fit
#: has updates worth sending. A first task of separated clusters was learned within the warm
#: fit, after which gradient sharing's timed fits sent next to nothing (4 kB per worker per
#: fit at 100 Mbit/s here; 3.5 kB at 8 workers on the device host): they timed training with
#: no exchange at all.
TEACHER_HIDDEN = 16
#: held-out examples for the time to accuracy (test labels carry no noise: there is none)
TEST_EXAMPLES = 4000
#: the held-out accuracy that times a contender: the plain process reaches it in its second
#: epoch (0.585 after the first, 0.619 after the second, 0.64 at most after that: the MLP
#: then overfits 16,000 examples)
TARGET_ACCURACY = 0.60


def _examples(n, seed):
    """``n`` inputs and their teacher's class ids; the teacher is the same for every seed."""
    import numpy as np

    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(N_FEATURES, TEACHER_HIDDEN)) / np.sqrt(N_FEATURES)
    w2 = rng.normal(size=(TEACHER_HIDDEN, 10))
    x = np.random.default_rng(seed).normal(size=(n, N_FEATURES)).astype(np.float32)
    return x, (np.maximum(x @ w1, 0) @ w2).argmax(1)


def _data(n):
    """The training examples: inputs and one-hot labels."""
    import numpy as np

    x, y = _examples(n, seed=1)
    return x, np.eye(10, dtype=np.float32)[y]


def _test_data(n=TEST_EXAMPLES):
    """Held-out inputs and class ids, from the same teacher."""
    return _examples(n, seed=2)


def _flax_mlp():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for w in WIDTHS:
                x = nn.relu(nn.Dense(w)(x))
            return nn.Dense(10)(x)

    return MLP()


# -- the plain processes (one core each) ---------------------------------------------------------
def _plain_step(model, tx):
    import jax
    import optax

    @jax.jit
    def step(params, opt, xb, yb):
        def loss(p):
            return optax.softmax_cross_entropy(model.apply(p, xb), yb).mean()

        l, g = jax.value_and_grad(loss)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, l

    return step


def plain_jax(n, epochs, core):
    """Examples/s of a bare ``jax.jit`` + optax loop at ``BATCH`` a step, warmed by an identical fit."""
    os.sched_setaffinity(0, {core})
    import jax
    import optax

    x, y = _data(n)
    model = _flax_mlp()
    tx = optax.adam(LR)
    step = _plain_step(model, tx)

    def fit():
        params = model.init(jax.random.PRNGKey(0), x[:1])
        opt = tx.init(params)
        t0 = time.perf_counter()
        for _ in range(epochs):
            for i in range(0, n - BATCH + 1, BATCH):
                params, opt, l = step(params, opt, x[i:i + BATCH], y[i:i + BATCH])
        jax.block_until_ready(params)
        return time.perf_counter() - t0

    fit()
    return epochs * (n // BATCH) * BATCH / fit()


def plain_curve(n, max_epochs, core):
    """The plain loop from its initial parameters, an epoch at a time: ``[[seconds, held-out
    accuracy], ...]``, the seconds training alone (the step and the evaluation compiled first)."""
    os.sched_setaffinity(0, {core})
    import jax
    import optax

    x, y = _data(n)
    xt, yt = _test_data()
    model = _flax_mlp()
    tx = optax.adam(LR)
    step = _plain_step(model, tx)
    accuracy = jax.jit(lambda p: (model.apply(p, xt).argmax(1) == yt).mean())
    params = model.init(jax.random.PRNGKey(0), x[:1])
    opt = tx.init(params)
    jax.block_until_ready(step(params, opt, x[:BATCH], y[:BATCH]))  # compiles; its result is dropped
    float(accuracy(params))
    curve = []
    for _ in range(max_epochs):
        t0 = time.perf_counter()
        for i in range(0, n - BATCH + 1, BATCH):
            params, opt, _ = step(params, opt, x[i:i + BATCH], y[i:i + BATCH])
        jax.block_until_ready(params)
        curve.append([time.perf_counter() - t0, float(accuracy(params))])
        if curve[-1][1] >= TARGET_ACCURACY:
            break
    return curve


def torch_rank(rank, world, n, epochs, runs, hook, master, port, core, curve_epochs=0):
    """One torch rank (world 1: a plain torch loop). Prints the timed fits' seconds (rank 0); with
    ``curve_epochs``, instead each epoch's seconds and held-out accuracy from the initial weights,
    until the target accuracy or ``curve_epochs`` epochs."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = _data(n)
    layers, width = [], N_FEATURES
    for w in WIDTHS:
        layers += [torch.nn.Linear(width, w), torch.nn.ReLU()]
        width = w
    model = plain = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
        if hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2, warm_start=False)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    xs, ys = torch.from_numpy(x[rank::world]), torch.from_numpy(y[rank::world].argmax(1))
    steps = len(xs) // BATCH  # equal on every rank: each step all-reduces

    def fit(epochs):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(epochs):
            for i in range(steps):
                opt.zero_grad()
                loss_fn(model(xs[i * BATCH:(i + 1) * BATCH]), ys[i * BATCH:(i + 1) * BATCH]).backward()
                opt.step()
        if world > 1:
            dist.barrier()
        return time.perf_counter() - t0, epochs * steps * BATCH * world

    if curve_epochs:
        xt, yt = _test_data()
        xt = torch.from_numpy(xt)
        curve, reached = [], torch.zeros(1)
        while len(curve) < curve_epochs and not reached.item():
            seconds, _ = fit(1)
            with torch.no_grad():  # the bare module: DDP's forward would wait for the other ranks
                accuracy = float((plain(xt).argmax(1).numpy() == yt).mean())
            curve.append([seconds, accuracy])
            reached[0] = float(accuracy >= TARGET_ACCURACY)
            if world > 1:  # rank 0's verdict: every rank stops after the same epoch
                dist.broadcast(reached, 0)
        if rank == 0:
            print(json.dumps({"curve": curve}))
    else:
        fit(epochs)  # warm
        times = [fit(epochs) for _ in range(runs)]
        if rank == 0:
            print(json.dumps({"seconds": [t for t, _ in times], "examples": times[0][1]}))
    if world > 1:
        dist.destroy_process_group()
    del np


# -- the measurements ----------------------------------------------------------------------------
def _self(*args, core=None, netns=None):
    cmd = [sys.executable, os.path.abspath(__file__), *map(str, args)]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu")
    return cmd, env


def run_plain(n, epochs, core=0):
    cmd, env = _self("--plain", n, epochs, core)
    return float(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.split()[-1])


def run_torch(net, n, epochs, runs, hook, world, curve_epochs=0):
    """``{"seconds": [...], "examples": ...}`` of torch on ``world`` ranks (1: one plain process on
    core 0); with ``curve_epochs``, ``{"curve": ...}`` as :func:`torch_rank` prints it."""
    import random

    port = random.randint(20000, 40000)
    master = net.hosts[0].ip if world > 1 else "127.0.0.1"
    procs = []
    for rank in range(world):
        cmd, env = _self("--torch-rank", rank, world, n, epochs, runs, hook, master, port, rank, curve_epochs,
                         netns=net.hosts[rank].namespace if world > 1 else None)
        env["GLOO_SOCKET_IFNAME"] = "eth0"
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    before = net.wire_bytes()
    outs = [p.communicate(timeout=900) for p in procs]
    wire = net.wire_delta(before, net.wire_bytes())
    for p, (_, err) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"a torch rank failed: {err[-2000:]}")
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    if world > 1 and not curve_epochs:  # warm fit + runs: the counters saw runs + 1 fits
        result["wire_tx_per_worker"] = sum(wire[h.name]["tx"] for h in net.hosts[:world]) / world / (runs + 1)
        result["wire_rx_per_worker"] = sum(wire[h.name]["rx"] for h in net.hosts[:world]) / world / (runs + 1)
        result["wire_tx_busiest"] = max(wire[h.name]["tx"] for h in net.hosts[:world]) / (runs + 1)
    return result


CONTENDERS = ("averaging5", "sharing", "averaging50-outer", "ddp", "ddp-fp16", "ddp-powersgd",
              "averaging5-no-updater", "localsgd50-bf16-outer", "sharing-sync", "sharing-async", "sharing-encoded",
              "sharing-first", "sharing-dgc-warmup", "sharing-no-clipping", "averaging50", "sharing-dask-messages",
              "averaging5-bf16", "sharing-rounds64", "sharing-lag1")
#: measured by default; torch 2.13's powerSGD_hook fails a collective on gloo here ("Received data
#: size doesn't match expected size"), so it runs only when named, as does averaging without
#: save_updater (whose rounds carry the parameters alone) and LocalSGD (averaging50-outer's rounds
#: with the pseudo-gradient sent in bfloat16, error feedback kept on each replica), and averaging
#: at 50 with its defaults otherwise (updates scaled with the workers, no outer step), and the
#: defaults with their exchange in bfloat16 (exchange_precision, half of a round's bytes), and
#: gradient sharing with rounds of 64 steps (a round's end waits on the coordinator: under a
#: delay, fewer rounds wait less), and with its peers' messages applied a step late
DEFAULT_CONTENDERS = CONTENDERS[:5]


#: contenders that are another's master with worker settings of their own (dask config keys)
CONTENDER_CONFIG = {
    # gradient sharing with its messages through Dask's comms, not the job's own connections
    "sharing-dask-messages": {"dlspark.sharing.direct-messages": False},
}


def _swap_config(settings):
    """On a worker: set ``settings`` (dask config), returning the values they replace."""
    import dask

    import dlspark.config  # noqa: F401 - dlspark's defaults, which a worker has not read before its first job

    before = {k: dask.config.get(k) for k in settings}
    dask.config.set(settings)
    return before


@contextlib.contextmanager
def _worker_config(client, name):
    """A contender's worker settings (:data:`CONTENDER_CONFIG`) on every worker while it runs."""
    settings = CONTENDER_CONFIG.get(name)
    if not settings:
        yield
        return
    before = client.run(_swap_config, settings)
    try:
        yield
    finally:
        for worker, values in before.items():
            client.run(_swap_config, values, workers=[worker])


def _master(name):
    import optax

    import dlspark

    if name == "averaging5":
        return dlspark.ParameterAveraging(batch_size_per_worker=BATCH, averaging_frequency=5)
    if name == "averaging5-bf16":
        return dlspark.ParameterAveraging(batch_size_per_worker=BATCH, averaging_frequency=5,
                                          exchange_precision="bfloat16")
    if name == "averaging5-no-updater":
        return dlspark.ParameterAveraging(batch_size_per_worker=BATCH, averaging_frequency=5, save_updater=False)
    if name == "averaging50-outer":
        return dlspark.ParameterAveraging(batch_size_per_worker=BATCH, averaging_frequency=50,
                                          outer_updater=optax.sgd(0.7, momentum=0.9, nesterov=True))
    if name == "averaging50":
        return dlspark.ParameterAveraging(batch_size_per_worker=BATCH, averaging_frequency=50)
    if name in ("sharing", "sharing-dask-messages"):
        return dlspark.GradientSharing(batch_size_per_worker=BATCH)
    if name == "sharing-sync":
        return dlspark.GradientSharing(batch_size_per_worker=BATCH, max_staleness=0)
    if name == "sharing-rounds64":
        return dlspark.GradientSharing(batch_size_per_worker=BATCH, steps_per_round=64)
    if name == "sharing-lag1":  # peers' messages applied a step late: a step does not wait for a round trip
        return dlspark.GradientSharing(batch_size_per_worker=BATCH, delivery_lag=1)
    if name == "sharing-encoded":  # DL4J's own update (the default before own_update="whole")
        return dlspark.GradientSharing(batch_size_per_worker=BATCH, own_update="encoded")
    if name == "sharing-first":  # the whole own update, a fit ending with the first replica's parameters
        return dlspark.GradientSharing(batch_size_per_worker=BATCH, final_params="first")
    if name == "sharing-async":  # DL4J's asynchronous delivery (the default before 5d37075)
        return dlspark.GradientSharing(batch_size_per_worker=BATCH, max_staleness=4)
    if name == "sharing-dgc-warmup":
        return dlspark.GradientSharing(batch_size_per_worker=BATCH,
                                       sparsity_warmup=dlspark.GradientSharing.DGC_SPARSITY_WARMUP)
    if name.startswith("sharing-band"):  # sharing-band0.001-0.03: AdaptiveThreshold's sparsity band
        low, high = map(float, name[len("sharing-band"):].split("-"))
        return dlspark.GradientSharing(batch_size_per_worker=BATCH, threshold_algorithm=dlspark.AdaptiveThreshold(
            min_sparsity=low, max_sparsity=high))
    if name == "sharing-no-clipping":
        from dlspark.algorithms.sharing import NoResidualPostProcessing

        return dlspark.GradientSharing(batch_size_per_worker=BATCH,
                                       residual_post_processor=NoResidualPostProcessing())
    if name == "localsgd50-bf16-outer":
        return dlspark.algorithms.LocalSGD(local_steps=50, batch_size_per_worker=BATCH,
                                           outer_updater=optax.sgd(0.7, momentum=0.9, nesterov=True))
    raise ValueError(f"contender must be one of {CONTENDERS}, got {name!r}")


def run_dlspark(net, client, name, n, epochs, runs):
    """Contender ``name`` on the emulated cluster ``net``: ``runs`` timed fits after a warm one,
    their seconds, wire and reported bytes (medians) and each fit's round statistics."""
    import optax

    import dlspark

    x, y = _data(n)
    data = dlspark.DataSet(x, y)
    model = dlspark.Network(dlspark.Model.from_flax(_flax_mlp(), x[:1]), updater=optax.adam(LR))
    trainer = dlspark.DistributedTrainer(client, model, _master(name), progress=False)
    try:
        trainer.fit(data, epochs=epochs)  # warm: compiles, exports
        seconds, wire, received, reported, busiest, rounds = [], [], [], [], [], []
        for _ in range(runs):
            before = net.wire_bytes()
            t0 = time.perf_counter()
            trainer.fit(data, epochs=epochs)
            seconds.append(time.perf_counter() - t0)
            d = net.wire_delta(before, net.wire_bytes())
            wire.append(sum(d[h.name]["tx"] for h in net.hosts) / len(net.hosts))
            busiest.append(max(d[h.name]["tx"] for h in net.hosts))  # the link a fit's end waits on
            received.append(sum(d[h.name]["rx"] for h in net.hosts) / len(net.hosts))
            reported.append(sum(s.get("bytes_sent", 0) + s.get("bytes_received", 0)
                                for s in trainer.last_fit_stats) / len(net.hosts))
            rounds.append(trainer.last_fit_stats)
        trained = sum(s["minibatches"] for s in trainer.last_fit_stats)
        return {"seconds": seconds, "examples": trained * BATCH, "wire_tx_per_worker": statistics.median(wire),
                "wire_rx_per_worker": statistics.median(received), "reported_per_worker": statistics.median(reported),
                "wire_tx_busiest": statistics.median(busiest), "round_stats": rounds}
    finally:
        trainer.close()


def dlspark_curve(client, name, n, max_epochs):
    """A contender from the network's initial state, an epoch a fit: ``[[seconds, held-out
    accuracy], ...]`` until the target accuracy or ``max_epochs``. A warm fit compiles first; the
    state and what the algorithm carries (thresholds, an outer optimizer's momentum) are then
    reset, so that the first timed fit starts as a first fit does."""
    import optax

    import dlspark

    x, y = _data(n)
    xt, yt = _test_data()
    data = dlspark.DataSet(x, y)
    net = dlspark.Network(dlspark.Model.from_flax(_flax_mlp(), x[:1]), updater=optax.adam(LR))
    trainer = dlspark.DistributedTrainer(client, net, _master(name), progress=False)
    try:
        trainer.fit(data, epochs=1)
        net.output(xt[:BATCH])
        net.state, trainer.algorithm_state = net.init_state(), {}
        curve = []
        while len(curve) < max_epochs:
            t0 = time.perf_counter()
            trainer.fit(data, epochs=1)
            seconds = time.perf_counter() - t0
            curve.append([seconds, float((net.output(xt).argmax(1) == yt).mean())])
            if curve[-1][1] >= TARGET_ACCURACY:
                break
        return curve
    finally:
        trainer.close()


def time_to_target(curve):
    """``{"epochs", "seconds"}`` to the first epoch at the target accuracy (None: never reached)."""
    total = 0.0
    for k, (seconds, accuracy) in enumerate(curve, 1):
        total += seconds
        if accuracy >= TARGET_ACCURACY:
            return {"epochs": k, "seconds": total}
    return None


def _link(rate, delay):
    """A link's name in the tables: its rate, and its one-way delay where there is one."""
    return rate if delay is None else f"{rate}, {delay * 1e3:g} ms one way"


def measure_curve(net, client, contender, rate, n, max_epochs, single):
    """One contender's time to the target accuracy at one rate (and the harness's delay), over
    its framework's single process (``single``: that process's :func:`time_to_target`)."""
    net.set_rate(rate)
    if contender.startswith("ddp"):
        hook = {"ddp": "none", "ddp-fp16": "fp16", "ddp-powersgd": "powersgd"}[contender]
        curve = run_torch(net, n, 1, 1, hook, len(net.hosts), curve_epochs=max_epochs)["curve"]
    else:
        with _worker_config(client, contender):
            curve = dlspark_curve(client, contender, n, max_epochs)
    reached = time_to_target(curve)
    return {"contender": contender, "rate": rate, "delay": net.delay, "curve": curve, "to_target": reached,
            "over_own_single_process": None if not (reached and single) else single["seconds"] / reached["seconds"]}


def plain_time_to_target(n, max_epochs, framework):
    """The single process's curve and time to the target: JAX's plain loop or one torch loop."""
    if framework == "jax":
        cmd, env = _self("--plain-curve", n, max_epochs, 0)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        curve = json.loads(out.strip().splitlines()[-1])
    else:
        cmd, env = _self("--torch-rank", 0, 1, n, 1, 1, "none", "127.0.0.1", 0, 0, max_epochs)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        curve = json.loads(out.strip().splitlines()[-1])["curve"]
    return {"curve": curve, "to_target": time_to_target(curve)}


def _spread(values):
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _delay_cpu(net):
    """CPU seconds the processes that hold the hosts' packets have used (0 without a delay):
    they share the machine's cores with the workers."""
    import psutil

    total = 0.0
    for h in net.hosts:
        if h.name in net.delayers:
            t = psutil.Process(net.delayers[h.name].pid).cpu_times()
            total += t.user + t.system
    return total


def measure(net, client, contender, rate, n, epochs, runs, single=None):
    """One contender at one rate (and the harness's delay): examples/s over the plain process
    (before and after it)."""
    net.set_rate(rate)
    plain_before = run_plain(n, epochs)
    delay_cpu = _delay_cpu(net)
    if contender.startswith("ddp"):
        hook = {"ddp": "none", "ddp-fp16": "fp16", "ddp-powersgd": "powersgd"}[contender]
        r = run_torch(net, n, epochs, runs, hook, len(net.hosts))
    else:
        with _worker_config(client, contender):
            r = run_dlspark(net, client, contender, n, epochs, runs)
    delay_cpu = _delay_cpu(net) - delay_cpu
    plain_after = run_plain(n, epochs)
    plain = (plain_before + plain_after) / 2
    speeds = [r["examples"] / s for s in r["seconds"]]
    out = {"contender": contender, "rate": rate, "delay": net.delay, "examples_per_s": _spread(speeds),
           "over_plain": _spread([s / plain for s in speeds]), "plain_examples_per_s": [plain_before, plain_after],
           "fit_seconds": _spread(r["seconds"]), "wire_tx_per_worker_per_fit": r.get("wire_tx_per_worker"),
           "wire_rx_per_worker_per_fit": r.get("wire_rx_per_worker"),
           "wire_tx_busiest_worker_per_fit": r.get("wire_tx_busiest"),
           "reported_per_worker_per_fit": r.get("reported_per_worker"),
           "delay_cpu_seconds_per_fit": delay_cpu / (runs + 1)}  # the warm fit's too
    if single:
        out["over_own_single_process"] = _spread([s / single for s in speeds])
    return out


def torch_single(n, epochs, runs):
    cmd, env = _self("--torch-rank", 0, 1, n, epochs, runs, "none", "127.0.0.1", 0, 0, 0)
    r = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
    return statistics.median(r["examples"] / s for s in r["seconds"])


def _ratio(spread):
    return f"{spread['median']:.2f}x ({spread['min']:.2f}-{spread['max']:.2f})"


def _mb(x):
    return "" if x is None else f"{x / 1e6:.2f}"


def table(rows, a):
    """The suite's table for the docs: one row per contender and rate."""
    return {"title": f"2 workers, {a.examples} examples x {a.epochs} epochs, {BATCH} a step per worker, "
                     f"median (min-max) of {a.runs} fits",
            "columns": ["link rate", "contender", "examples/s over the plain JAX process",
                        "over its own single process", "fit s", "wire MB sent per worker per fit (counters)",
                        "wire MB sent by the busiest worker per fit", "MB dlspark reports per worker per fit"],
            "rows": [[_link(r["rate"], r.get("delay")), r["contender"], _ratio(r["over_plain"]),
                      _ratio(r["over_own_single_process"]),
                      f"{r['fit_seconds']['median']:.2f}", _mb(r["wire_tx_per_worker_per_fit"]),
                      _mb(r.get("wire_tx_busiest_worker_per_fit")), _mb(r["reported_per_worker_per_fit"])]
                     for r in rows],
            "note": "The plain process (one jax.jit + optax loop on one core) is run before and after each "
                    "contender; its mean is the contender's denominator. torch's own single process is one "
                    "plain torch loop on one core."}


def curve_table(curves, singles):
    """The docs' table of times to the target accuracy."""
    def cell(reached):
        return "not reached" if reached is None else f"{reached['seconds']:.2f} s ({reached['epochs']} epochs)"

    jax_one, torch_one = singles["jax"]["to_target"], (singles.get("torch") or {}).get("to_target")
    return {"title": f"time from the initial state to {TARGET_ACCURACY} held-out accuracy, one fit an epoch, "
                     "one run each (single process: JAX " + cell(jax_one) +
                     ("" if torch_one is None else ", torch " + cell(torch_one)) + ")",
            "columns": ["link rate", "contender", "time to the target (epochs)", "over the plain JAX process's time",
                        "over its own single process's time"],
            "rows": [[_link(r["rate"], r.get("delay")), r["contender"], cell(r["to_target"]),
                      "" if not (r["to_target"] and jax_one) else f"{jax_one['seconds'] / r['to_target']['seconds']:.2f}x",
                      "" if r["over_own_single_process"] is None else f"{r['over_own_single_process']:.2f}x"]
                     for r in curves],
            "note": "Seconds are the fits' alone (call to return, an epoch each); the held-out accuracy is "
                    "read between fits, off the clock."}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", nargs="+", default=["unlimited", "1gbit"])
    p.add_argument("--delays", nargs="+", default=["none"],
                   help="one-way delays between the hosts, each run at every rate: none, or such as 500us, 2ms")
    p.add_argument("--contenders", nargs="+", default=list(DEFAULT_CONTENDERS),
                   help=f"of {CONTENDERS}, or sharing-bandL-H (AdaptiveThreshold(min_sparsity=L, max_sparsity=H))")
    p.add_argument("--examples", type=int, default=16000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--to-accuracy", action="store_true",
                   help=f"also time each contender from its initial state to {TARGET_ACCURACY} held-out accuracy")
    p.add_argument("--curve-epochs", type=int, default=6, help="the most epochs a time to accuracy may take")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.runs < 0 or (a.runs == 0 and not a.to_accuracy):
        p.error("--runs must be at least 1, or 0 with --to-accuracy (the time to accuracy alone)")
    from distributed import Client

    from dlspark.testing import emulated_cluster, latency_unavailable, parse_delay

    try:
        delays = [None if d == "none" else parse_delay(d) for d in a.delays]
    except ValueError as e:
        p.error(str(e))
    if any(delays) and latency_unavailable():
        p.error(f"--delays: {latency_unavailable()}")

    rows = []
    load_before = os.getloadavg()
    jax_single = statistics.median(run_plain(a.examples, a.epochs) for _ in range(3))
    torch_used = any(c.startswith("ddp") for c in a.contenders)
    torch_one = torch_single(a.examples, a.epochs, max(a.runs, 1)) if torch_used else None
    singles = {}
    if a.to_accuracy:
        singles = {"jax": plain_time_to_target(a.examples, a.curve_epochs, "jax")}
        if torch_used:
            singles["torch"] = plain_time_to_target(a.examples, a.curve_epochs, "torch")
        for name, one in singles.items():
            print(f"single {name} process: {one['to_target']} to {TARGET_ACCURACY} ({one['curve']})", flush=True)
    t_start = time.time()
    curves = []
    with emulated_cluster(2) as net, Client(net.scheduler_address, set_as_default=False) as client:
        for delay, rate in ((d, r) for d in delays for r in a.rates):
            net.set_delay(delay)
            link = _link(rate, delay)
            for c in a.contenders if a.to_accuracy else ():
                one = singles["torch" if c.startswith("ddp") else "jax"]["to_target"]
                row = measure_curve(net, client, c, rate, a.examples, a.curve_epochs, one)
                curves.append(row)
                print(f"{link:>9} {c:>18}: {row['to_target']} to {TARGET_ACCURACY} held-out accuracy, "
                      f"{row['over_own_single_process'] or 0:.2f}x its own single process ({row['curve']})",
                      flush=True)
            for c in a.contenders if a.runs else ():
                single = torch_one if c.startswith("ddp") else jax_single
                row = measure(net, client, c, rate, a.examples, a.epochs, a.runs, single)
                rows.append(row)
                print(f"{link:>9} {c:>18}: {row['over_plain']['median']:.2f}x plain "
                      f"({row['over_plain']['min']:.2f}-{row['over_plain']['max']:.2f}), "
                      f"{row['over_own_single_process']['median']:.2f}x its own single process, "
                      f"wire {row['wire_tx_per_worker_per_fit'] or 0:.3g} B/worker/fit, "
                      f"reported {row['reported_per_worker_per_fit'] or 0:.3g}", flush=True)
    from _install import NUMERIC_PACKAGES, install

    result = {"suite": "network",
              "command": "python benchmarks/bench_network.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{os.cpu_count()} CPU cores, load average {load_before[0]:.2f} at the start and "
                         f"{os.getloadavg()[0]:.2f} at the end (1-minute); 2 workers, each a network namespace "
                         "pinned to its own core",
              "source": "benchmarks/bench_network.py, one run of the command above",
              # the versions and the CPU the figures came from (torch's for DDP, its baseline)
              "install": install(NUMERIC_PACKAGES + ("torch",)),
              "tables": ([table(rows, a)] if rows else []) + ([curve_table(curves, singles)] if curves else []),
              "workers": 2, "target_accuracy": TARGET_ACCURACY, "single_process_curves": singles,
              "to_accuracy": curves, "examples": a.examples, "epochs": a.epochs, "delays": delays,
              "batch_per_worker": BATCH, "runs": a.runs, "plain_jax_examples_per_s": jax_single,
              "plain_torch_examples_per_s": torch_one, "seconds": time.time() - t_start, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _over_plain(contender, rate, delay=None):
    """asv: one contender's median examples/s over the plain process on a fresh emulated cluster."""
    from distributed import Client

    from dlspark.testing import emulated_cluster

    with emulated_cluster(2, delay=delay) as net, Client(net.scheduler_address, set_as_default=False) as client:
        return measure(net, client, contender, rate, 16000, 2, 1)["over_plain"]["median"]


def _skip_unless(reason):
    if reason:
        raise NotImplementedError(reason)  # asv skips


class TrackNetwork:
    """asv: one contender's examples/s over the plain process at one link rate (root needed)."""

    params = (["unlimited", "1gbit"], list(DEFAULT_CONTENDERS))
    param_names = ["rate", "contender"]
    timeout = 1200
    unit = "x plain"

    def setup(self, rate, contender):
        from dlspark.testing import netns_unavailable

        _skip_unless(netns_unavailable())

    def track_over_plain(self, rate, contender):
        return _over_plain(contender, rate)


class TrackNetworkLatency:
    """asv: examples/s over the plain process on unlimited links with a one-way delay between the
    hosts (root, iproute2 and iptables needed), for the contenders the delay parts."""

    params = (["500us", "2500us"], ["sharing", "sharing-lag1", "averaging5", "averaging50-outer"])
    param_names = ["delay", "contender"]
    timeout = 1200
    unit = "x plain"

    def setup(self, delay, contender):
        from dlspark.testing import latency_unavailable

        _skip_unless(latency_unavailable())

    def track_over_plain(self, delay, contender):
        return _over_plain(contender, "unlimited", delay)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--plain":
        print(plain_jax(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    elif len(sys.argv) > 1 and sys.argv[1] == "--torch-rank":
        r, w, n, e, runs, hook, master, port, core, curve = sys.argv[2:12]
        torch_rank(int(r), int(w), int(n), int(e), int(runs), hook, master, int(port), int(core), int(curve))
    elif len(sys.argv) > 1 and sys.argv[1] == "--plain-curve":
        print(json.dumps(plain_curve(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
