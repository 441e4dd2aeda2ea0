"""Parameter averaging's bytes on more than two emulated hosts, from the links' own counters.

With two contributors each averaging replica fetches its peer's whole contribution; with three
or more each contributor reduces one share of the elements and every replica gathers the
shares' means (``dlspark.algorithms.averaging._numerics``). This brings up ``--hosts`` worker
namespaces on a bridge (:func:`dlspark.testing.emulated_cluster`; root and iproute2 needed),
fits one network twice with each exchange precision (the first fit compiles; the second is
counted) and reports, per fit, the bytes the workers say they received against what each
host's interface counted. Bytes only: on a machine with fewer cores than hosts the workers
share cores, and their speed says nothing of separate hosts.

Run ``python benchmarks/bench_network_hosts.py --hosts 3 --out hosts.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

BATCH = 16
FREQUENCY = 4
HIDDEN = 1024


def _network():
    import flax.linen as nn
    import optax

    import dlspark

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(HIDDEN)(x)))

    train = dlspark.datasets.digits()[0]
    model = dlspark.Model.from_flax(MLP(), train.features[:1])
    return dlspark.Network(model, loss="softmax_cross_entropy", updater=optax.adam(1e-2), seed=0), train


def measure(net, client, precision: str) -> dict:
    """One precision's counted fit: the reported and the counted bytes, per round and per fit."""
    import jax

    import dlspark

    network, train = _network()
    master = dlspark.ParameterAveraging(batch_size_per_worker=BATCH, averaging_frequency=FREQUENCY,
                                        save_updater=False, exchange_precision=precision)
    trainer = dlspark.DistributedTrainer(client, network, master, progress=False)
    trainer.fit(train)  # compiles
    before = net.wire_bytes()
    trainer.fit(train)
    wire = net.wire_delta(before, net.wire_bytes())
    stats = trainer.last_fit_stats
    params = sum(x.nbytes for x in jax.tree_util.tree_leaves(network.state.params))
    return {"precision": precision, "parameter_bytes": params, "rounds": len(stats),
            "contributors": sorted({s["workers"] for s in stats}),
            "reported_per_round": sorted({s["bytes_received"] for s in stats}),
            "reported": sum(s["bytes_received"] for s in stats),
            "received": {h.name: wire[h.name]["rx"] for h in net.hosts},
            "sent": {h.name: wire[h.name]["tx"] for h in net.hosts}}


def table(rows, hosts) -> dict:
    base = next((r for r in rows if r["precision"] == "float32"), None)
    out = []
    for r in rows:
        received = sum(r["received"].values())
        saved = "" if base is None or r is base else \
            f"{(sum(base['received'].values()) - received) / max(1, base['reported'] - r['reported']):.3f}"
        out.append([r["precision"], r["rounds"], ", ".join(f"{x:,}" for x in r["reported_per_round"]),
                    f"{r['reported_per_round'][0] / r['parameter_bytes']:.2f}" if r["reported_per_round"] else "",
                    f"{r['reported']:,}", f"{received:,}", saved])
    return {"title": f"Averaging's bytes a fit on {hosts} emulated hosts (frequency {FREQUENCY}, save_updater=False)",
            "columns": ["exchange", "rounds", "reported a round (B)", "a round over the parameters' bytes",
                        "reported a fit (B)", "received on the links a fit (B, all hosts)",
                        "links' saving over the reported saving"],
            "rows": out}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3, help="worker hosts (default %(default)s)")
    p.add_argument("--rate", default="1gbit", help="every link's rate (default %(default)s)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    if a.hosts < 2:
        p.error(f"--hosts must be at least 2, got {a.hosts}")
    from distributed import Client

    from dlspark.testing import emulated_cluster

    t0 = time.time()
    with emulated_cluster(a.hosts, rate=a.rate) as net, Client(net.scheduler_address, set_as_default=False) as client:
        rows = [measure(net, client, precision) for precision in ("float32", "bfloat16")]
    for r in rows:
        print(json.dumps(r), flush=True)
    result = {"suite": "network-hosts",
              "command": "python benchmarks/bench_network_hosts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": f"{os.cpu_count()} CPU cores; {a.hosts} workers, each a network namespace at {a.rate}",
              "source": "benchmarks/bench_network_hosts.py, one run of the command above (bytes are the same "
                        "from run to run but for a fit's control messages)",
              "tables": [table(rows, a.hosts)], "hosts": a.hosts, "rate": a.rate, "rows": rows,
              "seconds": round(time.time() - t0, 1)}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


class TrackNetworkHosts:
    """asv: bytes received on the links a fit over those reported, three hosts, each precision."""

    params = (["float32", "bfloat16"],)
    param_names = ["precision"]
    timeout = 600
    unit = "wire / reported"

    def setup(self, precision):
        from dlspark.testing import netns_unavailable

        if netns_unavailable():
            raise NotImplementedError(netns_unavailable())  # asv skips

    def track_wire_over_reported(self, precision):
        from distributed import Client

        from dlspark.testing import emulated_cluster

        with emulated_cluster(3, rate="1gbit") as net, Client(net.scheduler_address, set_as_default=False) as client:
            r = measure(net, client, precision)
        return float(np.sum(list(r["received"].values())) / r["reported"])


if __name__ == "__main__":
    main()
