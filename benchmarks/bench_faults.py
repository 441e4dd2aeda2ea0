"""Fault campaign: fits on a 3-worker LocalCluster, each with one worker SIGKILLed at a random moment.

For every fit, one worker process is killed after a delay drawn uniformly from the length of an
unfaulted fit of the same job (the shorter of two) (so kills land in set-up, rounds, averaging or the sharing sync,
checkpoint writes and the last round alike); its nanny restarts it and it may rejoin. Each fit
writes a checkpoint every two rounds. The campaign then checks, from the fit's round results:

- the fit completed;
- every minibatch was counted exactly once per epoch (none lost, none doubled);
- the replicas ended equal: bit for bit with averaging (the largest difference, reduced on the
  workers, is 0.0), within gradient sharing's tolerance (1e-5) with ``sharing-encoded``
  (DL4J's own update, under which every replica applies the same messages: equal replicas
  show that the lost worker's messages were applied everywhere or nowhere). Under the
  default whole own update (``sharing``) each replica keeps its own residual, so replicas
  differ by design and are not compared;

and it reports how long the faulted fits took beside an unfaulted one.

Run::

    python benchmarks/bench_faults.py --fits 20            # 20 per algorithm, the full campaign
    python benchmarks/bench_faults.py --fits 5 --out f.json
    python benchmarks/bench_faults.py --when rounds --sharing-steps-per-round 2   # kills after a random round

The figures go to stdout (and ``--out`` as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass

SHARING_TOLERANCE = 1e-5


def _masters(sharing_steps_per_round=16):
    import dlspark

    @dataclass(frozen=True)
    class CheckedAveraging(dlspark.ParameterAveraging):
        """Parameter averaging that also measures how far the replicas ended apart."""

        def compare_replicas(self) -> bool:
            return True

    return {"averaging": CheckedAveraging(batch_size_per_worker=32, averaging_frequency=2),
            "sharing": dlspark.GradientSharing(batch_size_per_worker=32, steps_per_round=sharing_steps_per_round),
            "sharing-encoded": dlspark.GradientSharing(batch_size_per_worker=32, own_update="encoded",
                                                       steps_per_round=sharing_steps_per_round)}


#: the largest replica difference a fit may end with; None: replicas differ by design (not compared)
TOLERANCE = {"averaging": 0.0, "sharing": None, "sharing-encoded": SHARING_TOLERANCE}


def _network(seed):
    import flax.linen as nn
    import optax

    import dlspark

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(10)(nn.relu(nn.Dense(64)(x)))

    tr, _ = dlspark.datasets.digits()
    return dlspark.Network(dlspark.Model.from_flax(MLP(), tr.features[:1]), updater=optax.adam(1e-2), seed=seed)


def slow_load(url):
    """Read a minibatch file a little slowly (rounds last long enough for a kill to land inside them)."""
    import dlspark

    time.sleep(0.05)
    return dlspark.data.load_minibatch(url)


def one_fit(client, master, data, epochs, kill_after, rng, ckdir, kill_round=None):
    """One fit with a worker SIGKILLed ``kill_after`` s after it starts (None: no kill), or, with
    ``kill_round``, ``kill_after`` s after that round's results arrive."""
    import dlspark

    pids = client.run(os.getpid)
    victim = rng.choice(sorted(pids))
    rounds = []
    killed = {}

    def kill():
        killed["round"] = rounds[-1] if rounds else 0
        killed["at"] = time.monotonic() - t0
        os.kill(pids[victim], signal.SIGKILL)

    trainer = dlspark.DistributedTrainer(client, _network(rng.randrange(1 << 30)), master, progress=False)
    timer = None if kill_after is None else threading.Timer(kill_after, kill)
    t0 = time.monotonic()
    if timer is not None and kill_round is None:
        timer.start()

    def on_round(s):
        rounds.append(s["round"])
        if timer is not None and s["round"] == kill_round:
            timer.start()

    error = None
    try:
        kw = dict(epochs=epochs, checkpoint_every=2, checkpoint_url=os.path.join(ckdir, "ck.dls"), callbacks=[on_round])
        if isinstance(data, str):  # files read by slow_load
            trainer.fit_paths(data, loader=slow_load, **kw)
        else:
            trainer.fit(data, **kw)
    except Exception as e:  # a failed fit is a finding, not a crash of the campaign
        error = f"{type(e).__name__}: {e}"
    finally:
        if timer is not None:
            timer.cancel()
    took = time.monotonic() - t0
    per_epoch = Counter()
    for s in trainer.last_fit_stats if error is None else ():
        per_epoch[s["epoch"]] += s["minibatches"]
    trainer.close()
    round_times = [s["round_time"] for s in trainer.last_fit_stats] if error is None else []
    return {"completed": error is None, "error": error, "seconds": took,
            "round_time": sum(round_times) / max(1, len(round_times)),
            "killed": bool(killed), "kill_at_s": killed.get("at"), "kill_after_round": killed.get("round"),
            "rounds": len(rounds), "per_epoch": [per_epoch[e] for e in range(epochs)],
            "divergence": trainer.published.get("replica_divergence")}


def campaign(fits, n_workers=3, epochs=2, seed=0, algorithms=("averaging", "sharing", "sharing-encoded"), when="time",
             sharing_steps_per_round=16, log=print):
    from distributed import Client

    import dlspark
    from dlspark.cluster import local_cluster

    rng = random.Random(seed)
    tr, _ = dlspark.datasets.digits()
    data = tr[:576]  # 18 minibatches of 32 an epoch: 3 rounds of 3 workers x 2 with averaging
    n = 18
    out = {}
    with local_cluster(n_workers) as cluster, Client(cluster) as client, tempfile.TemporaryDirectory() as ckdir:
        if when == "rounds":  # rounds of at least 0.1 s, so that callbacks arrive while the fit runs
            dlspark.data.save_minibatches(data, url=os.path.join(ckdir, "mb"), batch_size=32)
            data = os.path.join(ckdir, "mb")
        for name in algorithms:
            master = _masters(sharing_steps_per_round)[name]
            # the length of an unfaulted fit (after one warm-up fit) sets the range of kill moments
            warm = one_fit(client, master, data, epochs, None, rng, ckdir)
            base = one_fit(client, master, data, epochs, None, rng, ckdir)
            span = min(warm["seconds"], base["seconds"])  # a kill drawn past a fit's end is no kill
            runs, nannies_gave_up = [], []
            for i in range(fits):
                try:  # the nanny restarts the worker killed in the last fit
                    client.wait_for_workers(n_workers, timeout=300)
                except TimeoutError:
                    have = len(client.scheduler_info()["workers"])
                    log(f"only {have} of {n_workers} workers after 300 s: going on with {have} (a nanny gave up)")
                    nannies_gave_up.append(i)
                    n_workers = have
                if when == "time":
                    r = one_fit(client, master, data, epochs, rng.uniform(0.0, span), rng, ckdir)
                else:  # after a round drawn uniformly (results reach the client late: the kill lands later)
                    r = one_fit(client, master, data, epochs, rng.uniform(0.0, base["round_time"]), rng, ckdir,
                                kill_round=rng.randrange(1, base["rounds"]) if base["rounds"] > 1 else 0)
                r["workers"] = len(client.scheduler_info()["workers"])
                runs.append(r)
                log(f"{name} fit {i + 1}/{fits}: completed={r['completed']} killed={r['killed']} "
                    f"(at {r['kill_at_s'] or 0:.2f} s, after round {r['kill_after_round']}) per epoch={r['per_epoch']} "
                    f"divergence={r['divergence']} {'' if r['completed'] else r['error']}")
            done = [r for r in runs if r["completed"]]
            lost = sum(max(0, n - c) for r in done for c in r["per_epoch"])
            doubled = sum(max(0, c - n) for r in done for c in r["per_epoch"])
            limit = TOLERANCE[name]
            faulted = sorted(r["seconds"] for r in done if r["killed"])
            out[name] = {
                "fits": fits, "kills": sum(r["killed"] for r in runs), "completed": len(done),
                "minibatches_per_epoch": n, "lost": lost, "doubled": doubled,
                "replicas_within_tolerance": None if limit is None else sum((r["divergence"] or 0.0) <= limit
                                                                            for r in done),
                "max_divergence": max((r["divergence"] or 0.0 for r in done), default=None),
                "unfaulted_fit_s": span, "nannies_gave_up_before_fit": nannies_gave_up,
                "faulted_fit_s": {"median": statistics.median(faulted), "min": faulted[0], "max": faulted[-1]}
                if faulted else None,
                "runs": runs,
            }
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fits", type=int, default=20, help="faulted fits per algorithm (default 20)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--algorithms", nargs="+", default=["averaging", "sharing", "sharing-encoded"],
                   choices=sorted(TOLERANCE))
    p.add_argument("--when", choices=["time", "rounds"], default="time",
                   help="time: kill at a moment drawn uniformly over a fit (set-up included); rounds: fits from files "
                        "read in 0.05 s each, a kill within one round's length after a round drawn uniformly "
                        "(averaging, syncs, checkpoints, the last round)")
    p.add_argument("--sharing-steps-per-round", type=int, default=16,
                   help="gradient sharing's steps_per_round (default 16, the library's: 2 rounds a fit here)")
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args(argv)
    res = campaign(args.fits, args.workers, seed=args.seed, algorithms=tuple(args.algorithms), when=args.when,
                   sharing_steps_per_round=args.sharing_steps_per_round)
    print("algorithm        fits kills completed lost doubled replicas-ok max-divergence unfaulted-fit "
          "faulted-fit median (min-max)")
    for name, r in res.items():
        ok = "n/a" if r["replicas_within_tolerance"] is None else r["replicas_within_tolerance"]
        f = r["faulted_fit_s"]
        took = f"{f['median']:.1f} s ({f['min']:.1f}-{f['max']:.1f})" if f else "-"
        print(f"{name:<16} {r['fits']:>4} {r['kills']:>5} {r['completed']:>9} {r['lost']:>4} {r['doubled']:>7} "
              f"{ok!s:>11} {r['max_divergence']!s:>14} {r['unfaulted_fit_s']:>11.1f} s {took}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
