"""A fit's fixed transfers on emulated hosts, before and after: its end, and its start.

``--part end``: at the end of every gradient-sharing fit the client takes the trained state
from one worker and the replicas are compared (``replica_divergence``). This measures, in one
run on the emulated cluster of :mod:`bench_network` (2 workers, links at ``--rate``), fits
whose end works as it did before (each other replica fetched the source's whole state,
parameters and optimizer state, after the client's state transfer) against fits with the
current code (the source fetches the others' parameters only, while its state goes to the
client).

``--part start``: every fit used to send every worker the whole train state (and the outer
optimizer's momentum inside the spec); now every replica keeps its trained state at a fit's
end and the next fit sends only the arrays that differ (``dlspark.distributed._kept``). The
"before" fits keep nothing (the end skips the keeping, the start sends everything), the "now"
fits are the current code (each after an unmeasured one, so that it starts from a kept
state), for ``--contender`` (``averaging5``, ``averaging50-outer``, ``sharing``).

Fits alternate ``--runs`` times after a warm fit: time from the ``fit`` call to its return,
and the bytes every worker's interface sent and received (the counters).

Run::

    python benchmarks/bench_network_fixed.py --part end --rate 1gbit --runs 3
    python benchmarks/bench_network_fixed.py --part start --contender averaging50-outer --rate 1gbit --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

try:
    from .bench_network import BATCH, LR, _data, _flax_mlp, _master
except ImportError:  # run as a script from benchmarks/
    from bench_network import BATCH, LR, _data, _flax_mlp, _master


async def _old_final_state(client, workers, job, step, epoch, compare):
    """The end of a fit as it was: the state to the client, then each other replica fetches the
    source's whole state and compares."""
    from dlspark.distributed._client import checked, fetch_state_from_any

    source, final = await fetch_state_from_any(client, workers, job, step, epoch)
    if not compare:
        return source, final, None

    async def one(w):
        return checked(await client.rpc(w).dlspark_divergence(job=job, source=source, whole_state=True))["reply"]

    found = await asyncio.gather(*[one(w) for w in workers if w != source])
    return source, final, max(found, default=0.0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["end", "start"], default="end")
    p.add_argument("--contender", default="sharing", help="with --part start: averaging5, averaging50-outer, sharing")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--examples", type=int, default=8000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import optax
    from distributed import Client

    import dlspark
    from dlspark.distributed import _client
    from dlspark.testing import emulated_cluster

    new_final_state, new_keep = _client._final_state, _client._keep_states

    async def keep_nothing(*args):
        return {}

    x, y = _data(a.examples)
    data = dlspark.DataSet(x, y)
    out = {"old": {"seconds": [], "wire_tx": [], "wire_rx": [], "divergence": []},
           "new": {"seconds": [], "wire_tx": [], "wire_rx": [], "divergence": []}}
    if a.part == "end":
        master, old = dlspark.GradientSharing(batch_size_per_worker=BATCH), (_old_final_state, new_keep)
    else:
        master, old = _master(a.contender), (new_final_state, keep_nothing)
    with emulated_cluster(2, rate=a.rate) as net, Client(net.scheduler_address, set_as_default=False) as client:
        model = dlspark.Network(dlspark.Model.from_flax(_flax_mlp(), x[:1]), updater=optax.adam(LR))
        trainer = dlspark.DistributedTrainer(client, model, master, progress=False)
        trainer.fit(data, epochs=a.epochs)  # warm
        try:
            # with --part start a "now" fit needs the fit before it to have kept its state, so an
            # unmeasured "now" fit follows each "before" fit
            order = [("old", old), ("new", (new_final_state, new_keep))]
            if a.part == "start":
                order.insert(1, (None, (new_final_state, new_keep)))
            for _ in range(a.runs):
                for name, (final, keep) in order:
                    _client._final_state, _client._keep_states = final, keep
                    if name == "old":  # what the last fit kept is not used: everything is sent
                        trainer._kept_states = {}
                    if name is None:
                        trainer.fit(data, epochs=a.epochs)
                        continue
                    before = net.wire_bytes()
                    t0 = time.perf_counter()
                    trainer.fit(data, epochs=a.epochs)
                    out[name]["seconds"].append(time.perf_counter() - t0)
                    d = net.wire_delta(before, net.wire_bytes())
                    out[name]["wire_tx"].append(sum(d[h.name]["tx"] for h in net.hosts))
                    out[name]["wire_rx"].append(sum(d[h.name]["rx"] for h in net.hosts))
                    out[name]["divergence"].append(trainer.published.get("replica_divergence"))
        finally:
            _client._final_state, _client._keep_states = new_final_state, new_keep
            trainer.close()
    for name in ("old", "new"):
        s, w, r = out[name]["seconds"], out[name]["wire_tx"], out[name]["wire_rx"]
        print(f"{name}: fit {statistics.median(s):.3f} s ({min(s):.3f}-{max(s):.3f}), "
              f"workers sent {statistics.median(w) / 1e6:.2f} MB ({min(w) / 1e6:.2f}-{max(w) / 1e6:.2f}), "
              f"received {statistics.median(r) / 1e6:.2f} MB ({min(r) / 1e6:.2f}-{max(r) / 1e6:.2f})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"part": a.part, "contender": a.contender if a.part == "start" else "sharing", "rate": a.rate,
                       "examples": a.examples, "epochs": a.epochs, **out}, f, indent=1)
    return out


if __name__ == "__main__":
    main()
