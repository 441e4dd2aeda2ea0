"""Per-device efficiency of ParallelWrapper (averaging and gradient sharing): one process, its
CPU devices, no cluster.

efficiency = (steps/s of one device inside a ParallelWrapper fit) / (steps/s of
the plain jitted optax step of the same model and updater in a plain process
pinned to one core). The wrapper runs
in a fresh process, where JAX starts with ``jax_num_cpu_devices`` = devices and
which may use as many cores: XLA's default, one pool of threads that both devices'
ops share (``one_thread=True`` sets ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false``
there: each device's ops on one thread, as the pinned baseline's are). The
baseline is measured in the same run, before
and after, and averaged (``efficiency_vs_concurrent`` divides by plain processes run side
by side, one pinned to each core). The steps/s of the wrapper come from its round
statistics, leaving out the first two rounds (as ``bench_efficiency.py`` does
for the cluster). Print the figures with
``python benchmarks/bench_parallel.py [mlp|cnn ...]``.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
import timeit

sys.path.insert(0, os.path.dirname(__file__))

from _common import (make_data, make_network, plain_concurrent_steps_per_second,  # noqa: E402
                     plain_steps_per_second)

#: network -> minibatch size of a plain step of roughly 10-13 ms on one core here (bench_efficiency's)
BATCH = {"mlp": 160, "cnn": 16}
FREQ = 5


def _longest(wait):
    """A round's wait for data: per replica in the round record (the longest counts), a float before."""
    return max(wait.values(), default=0.0) if isinstance(wait, dict) else wait


def run_wrapper(kind, batch, freq, n_rounds, devices, fused=True, algorithm="averaging"):
    """Runs in the wrapper's own process: a warm-up fit (compilation), then the timed fit. With
    gradient sharing a round is ``freq`` steps per device (``steps_per_round``)."""
    import dlspark

    net = make_network(kind)
    if algorithm == "averaging":
        master = dlspark.ParameterAveraging(batch_size_per_worker=batch, averaging_frequency=freq, fused_steps=fused)
    else:
        master = dlspark.GradientSharing(batch_size_per_worker=batch, steps_per_round=freq)
    wrapper = dlspark.ParallelWrapper(net, master, devices=devices, progress=False)
    wrapper.fit(make_data(batch * freq * devices * 4, kind))
    data = make_data(batch * freq * devices * n_rounds, kind)
    t0, c0 = time.perf_counter(), time.process_time()
    wrapper.fit(data)
    whole, cpu = time.perf_counter() - t0, time.process_time() - c0
    stats = wrapper.last_fit_stats[2:]
    steps = sum(s["minibatches"] for s in stats) / devices
    wall = sum(s["round_time"] for s in stats)
    return {"steps_per_s": steps / wall, "whole_fit_steps_per_s": n_rounds * freq / whole,
            "data_wait_share": sum(_longest(s.get("data_wait", 0.0)) for s in stats) / wall, "params": net.num_params,
            "cpu_ms_per_step": 1000 * cpu / (n_rounds * freq * devices),
            "device": str(wrapper.devices[0].platform)}


def wrapper_steps_per_second(kind, batch, freq=FREQ, n_rounds=40, devices=2, fused=True, one_thread=False,
                             algorithm="averaging"):
    code = textwrap.dedent(f"""
        import json, os, sys
        os.sched_setaffinity(0, set(range({devices})))  # before JAX starts
        import jax
        jax.config.update("jax_num_cpu_devices", {devices})
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from bench_parallel import run_wrapper
        print(json.dumps(run_wrapper({kind!r}, {batch}, {freq}, {n_rounds}, {devices}, {fused}, {algorithm!r})))
    """)
    env = dict(os.environ)
    if one_thread:  # each device's ops on one thread, as the pinned baseline's are
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(kind="mlp", n_rounds=40, devices=2, freq=FREQ, fused=True, one_thread=False, algorithm="averaging"):
    batch = BATCH[kind]
    load = os.getloadavg()[0]
    before, cpu_before = plain_steps_per_second(kind, batch)
    job = wrapper_steps_per_second(kind, batch, freq, n_rounds, devices, fused, one_thread, algorithm)
    after, cpu_after = plain_steps_per_second(kind, batch)
    plain = (before + after) / 2
    concurrent = plain_concurrent_steps_per_second(kind, batch, cores=tuple(range(devices)))
    return {"algorithm": algorithm, "network": kind, "devices": devices, "frequency": freq, "fused_steps": fused,
            "one_thread_per_device": one_thread,
            "wrapper_steps_per_s_per_device": job["steps_per_s"], "plain_steps_per_s": plain,
            "efficiency": job["steps_per_s"] / plain,
            "efficiency_whole_fit": job["whole_fit_steps_per_s"] / plain,
            "efficiency_vs_concurrent": job["steps_per_s"] / concurrent,
            "plain_step_ms": 1000 / plain, "plain_drift": after / before,
            "data_wait_share": job["data_wait_share"], "params": job["params"],
            "load_average": (load, os.getloadavg()[0]),  # other processes on the machine, before and after
            # CPU time per step (the wrapper's: per step of one device), a figure load on the machine moves less
            "cpu_ms_per_step_ratio": (cpu_before / before + cpu_after / after) / 2 * 1000 / job["cpu_ms_per_step"]}


class ParallelWrapperEfficiency:
    """asv: the ratio is the figure (``track_``), not an absolute time."""

    timeout = 300
    timer = timeit.default_timer
    unit = "ratio"

    params = (["mlp", "cnn"], [True, False])
    param_names = ["network", "fused_steps"]

    def track_averaging_efficiency_2_devices(self, kind, fused):
        return measure(kind, fused=fused)["efficiency"]


class ParallelWrapperSharingEfficiency:
    """asv: gradient sharing's per-device efficiency over 2 CPU devices (a ratio)."""

    timeout = 300
    timer = timeit.default_timer
    unit = "ratio"

    params = (["mlp", "cnn"],)
    param_names = ["network"]

    def track_sharing_efficiency_2_devices(self, kind):
        return measure(kind, algorithm="sharing")["efficiency"]


if __name__ == "__main__":
    for kind in sys.argv[1:] or ["mlp", "cnn"]:
        for fused in (True, False):
            print(json.dumps(measure(kind, fused=fused)))
        print(json.dumps(measure(kind, algorithm="sharing")))
