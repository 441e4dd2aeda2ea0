"""Shared pieces of the benchmarks: a network whose step costs about 10 ms on one core."""

import os
import subprocess
import sys
import textwrap
import timeit

import flax.linen as nn
import numpy as np
import optax

import dlspark


def best_of(fn, repeat=7, setup=lambda: None):
    """The shortest of ``repeat`` timings of one call of ``fn`` (``setup`` before each, unclocked)."""
    return min(timeit.repeat(fn, setup=setup, number=1, repeat=repeat))


class WideMLP(nn.Module):
    width: int = 768

    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.relu(nn.Dense(self.width)(x))
        return nn.Dense(10)(x)


class SmallCNN(nn.Module):
    """Compute-heavy per parameter: 51 k parameters for a step of ~10 ms at batch 16."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], 24, 24, 1)
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


#: kind -> (module factory, number of input features)
NETWORKS = {"mlp": (lambda: WideMLP(768), 256), "cnn": (SmallCNN, 576)}


#: name -> the updater a benchmark's network and its plain baseline train with
UPDATERS = {"sgd": lambda: optax.sgd(1e-3), "adam": lambda: optax.adam(1e-3)}


def make_network(kind="mlp", updater="sgd"):
    module, n_features = NETWORKS[kind]
    x = np.zeros((1, n_features), np.float32)
    return dlspark.Network(dlspark.Model.from_flax(module(), x), updater=UPDATERS[updater]())


def make_data(n, kind="mlp"):
    return dlspark.datasets.synthetic_classification(n, n_features=NETWORKS[kind][1], n_classes=10, seed=0)


def plain_steps_per_second(kind, batch_size, steps=60, core=0, updater="sgd"):
    """Steps/s of the same jitted step in a fresh process pinned to one core (the baseline)."""
    out = subprocess.run(*_plain_command(kind, batch_size, steps, core, updater), capture_output=True, text=True,
                         check=True)
    rate, cpu_per_wall = map(float, out.stdout.split())
    return rate, cpu_per_wall


def plain_concurrent_steps_per_second(kind, batch_size, cores=(0, 1), steps=60, updater="sgd", warm=None):
    """Mean steps/s of plain processes run at the same time, one pinned to each of ``cores``:
    the baseline with the machine as loaded as in a job (shared caches, memory bandwidth).
    Every process compiles and warms its step first; then all are timed at once. ``warm``:
    a :class:`PlainProcess` of the same step already running on one of ``cores``, which
    stands for that core (no process is started for it)."""
    started = [PlainProcess(kind, batch_size, core=c, updater=updater) for c in cores
               if warm is None or c != warm.core]
    procs = [warm, *started] if warm is not None and warm.core in cores else started
    try:
        for p in procs:
            p.ask(steps)
        rates = [p.answer()[0] for p in procs]
    finally:
        for p in started:
            p.close()
    return sum(rates) / len(rates)


def _plain_loop(kind, batch_size, updater="sgd"):
    """``run(steps) -> (steps/s, process CPU time per wall time)`` of the plain step (the
    field's own: ``plain_optax_step``, the same model and updater as ``make_network``),
    compiled and warmed here."""
    import time

    import jax

    module, _ = NETWORKS[kind]
    model, ds = module(), make_data(batch_size, kind)
    x, y = np.asarray(ds.features), np.asarray(ds.labels)
    tx = make_network(kind, updater).updater
    step = plain_optax_step(model, tx)
    held = {"params": model.init(jax.random.PRNGKey(0), x[:1])}
    held["opt"] = tx.init(held["params"])

    def run(steps):
        params, opt = held["params"], held["opt"]
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            params, opt, loss = step(params, opt, x, y)
        loss.block_until_ready()
        wall = time.perf_counter() - t0
        held["params"], held["opt"] = params, opt
        return steps / wall, (time.process_time() - c0) / wall

    run(5)
    return run


def _step_loop(kind, batch_size, steps, updater="sgd"):
    """The plain step's ``(steps/s, CPU per wall)`` over ``steps``, run where this is called: in a
    fresh pinned process (the baseline) or in a worker (the bound below), where the compiled
    and warmed loop is kept for the next call (this module travels by value: the worker's
    own object holds it)."""
    try:
        from distributed import get_worker

        held = get_worker().__dict__.setdefault("_bench_plain_loops", {})
    except ValueError:  # not in a worker
        held = {}
    key = (kind, batch_size, updater)
    if key not in held:
        held[key] = _plain_loop(kind, batch_size, updater)
    return held[key](steps)


def _serve_plain_loop(kind, batch_size, updater="sgd"):
    """A baseline process's loop: for each number of steps read from stdin, run them and print
    ``steps/s CPU-per-wall``."""
    run = _plain_loop(kind, batch_size, updater)
    print("ready", flush=True)
    for line in sys.stdin:
        print(*run(int(line)), flush=True)


class PlainProcess:
    """The baseline kept warm between measurements: one process pinned to ``core`` with the
    plain step compiled, asked for a rate whenever the caller likes (between the segments of
    a job, so that the baseline and the job see the machine at the same minutes).

    >>> with PlainProcess("mlp", 160) as plain:  # doctest: +SKIP
    ...     rate, cpu_per_wall = plain.rate(60)
    """

    def __init__(self, kind, batch_size, core=0, updater="sgd"):
        self.core = core
        self.proc = subprocess.Popen(*_pinned_call(core, f"_serve_plain_loop({kind!r}, {batch_size}, {updater!r})"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = False  # read on first use: processes started together compile side by side

    def ask(self, steps=60):
        """Start timing ``steps`` steps (once the step is compiled and warm); :meth:`answer` reads the rate."""
        if not self.ready:
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the baseline process did not start")
            self.ready = True
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()

    def answer(self):
        rate, cpu = map(float, self.proc.stdout.readline().split())
        return rate, cpu

    def rate(self, steps=60):
        self.ask(steps)
        return self.answer()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def in_cluster_steps_per_second(client, kind, batch_size, steps=150, updater="sgd"):
    """Mean steps/s of the plain step run as a task on every worker at once: what a job would get
    with no distributed-training work at all (no data loading, averaging or messages), the
    bound set by the cluster itself (scheduler, event loops, nannies) on this machine."""
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it
    # A dry run in a loaded test run once found the scheduler listing no worker here, between two
    # fits of a one-worker cluster (why, its log did not say): wait for one, not divide by none
    client.wait_for_workers(1, timeout=120)
    workers = sorted(client.scheduler_info()["workers"])
    futures = [client.submit(_step_loop, kind, batch_size, steps, updater, workers=[w], pure=False) for w in workers]
    rates = [rate for rate, _ in client.gather(futures)]
    return sum(rates) / len(rates)


def _pinned_call(core, call):
    """``Popen`` arguments for a fresh Python pinned to ``core`` that runs ``call``, a statement
    over this module's step loops."""
    code = textwrap.dedent(f"""
        import os, sys
        os.sched_setaffinity(0, {{{core}}})  # before JAX starts: its CPU pool sizes itself to the cores
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from _common import _serve_plain_loop, _step_loop  # noqa: F401
        {call}
    """)
    return ([sys.executable, "-c", code],)


def _plain_command(kind, batch_size, steps, core, updater="sgd"):
    return _pinned_call(core, f"print(*_step_loop({kind!r}, {batch_size}, {steps}, {updater!r}))")


def make_master(algorithm, batch, frequency=5, approach="export", **sharing):
    """The master a benchmark uses: averaging every ``frequency`` steps, or gradient sharing
    (``sharing`` holds GradientSharing's own options)."""
    if algorithm == "averaging":
        return dlspark.ParameterAveraging(batch_size_per_worker=batch, averaging_frequency=frequency,
                                          training_approach=approach)
    return dlspark.GradientSharing(batch_size_per_worker=batch, training_approach=approach, **sharing)


def plain_optax_step(model, tx):
    """The field's plain tool, the baseline of every comparison: a bare jitted flax + optax
    step on one-hot labels, ``(params, opt_state, x, y) -> (params, opt_state, loss)``, its
    parameter and updater buffers donated."""
    from functools import partial

    import jax

    def loss_fn(params, xb, yb):
        return optax.softmax_cross_entropy(model.apply(params, xb), yb).mean()

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
