"""Side-by-side: the same network, data and hyper-parameters trained by

1. a plain single-process JAX/optax loop (one core),
2. dlspark parameter averaging on 2 workers,
3. dlspark gradient sharing on 2 workers,
4. PyTorch DistributedDataParallel (gloo) on 2 CPU processes.

Every contender gets one core per process: JAX processes are pinned with
``os.sched_setaffinity`` before JAX starts (XLA's CPU pool ignores thread
flags), torch ranks are pinned the same way and call ``torch.set_num_threads(1)``;
OMP/MKL/OpenBLAS thread variables are set to 1 for all. The table reports
each figure as a ratio to the single-process JAX run, and is written as JSON.

    python benchmarks/compare.py --quick            # digits only, < 10 minutes
    python benchmarks/compare.py --out results.json # digits and the synthetic set

torch is not a dlspark dependency: ``pip install -e ".[compare]"``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_v] = "1"

HIDDEN, LR, BATCH = 128, 3e-3, 16


def _datasets(names):
    import dlspark

    out = {}
    if "digits" in names:
        tr, te = dlspark.datasets.digits()
        out["digits"] = (tr, te, 0.95)
    if "synthetic" in names:
        full = dlspark.datasets.synthetic_classification(24_000, n_features=64, n_classes=10, noise=6.0, seed=1)
        out["synthetic"] = (full[:20_000], full[20_000:], 0.70)
    return out


def _flax_mlp():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(HIDDEN)(x)))

    return MLP()


def _net(tr):
    import optax

    import dlspark

    return dlspark.Network(dlspark.Model.from_flax(_flax_mlp(), tr.features[:1]), updater=optax.adam(LR), seed=0)


def _acc(net, te):
    return float((net.output(te.features).argmax(1) == te.labels.argmax(1)).mean())


def _run_epochs(train_one_epoch, evaluate, target, max_epochs):
    """Train epoch by epoch; return time and epochs to ``target`` accuracy and the final accuracy."""
    spent, to_target, acc = 0.0, None, 0.0
    for e in range(1, max_epochs + 1):
        t0 = time.perf_counter()
        train_one_epoch()
        spent += time.perf_counter() - t0
        acc = evaluate()
        if to_target is None and acc >= target:
            to_target = (spent, e)
    return {"train_time": spent, "time_to_target": to_target[0] if to_target else None,
            "epochs_to_target": to_target[1] if to_target else None, "final_accuracy": acc,
            "epochs": max_epochs}


def run_plain(tr, te, target, max_epochs):
    os.sched_setaffinity(0, {0})
    net = _net(tr)
    batches = tr.batches(BATCH)
    net.fit(batches[:2])  # compile outside the clock
    net = _net(tr)
    r = _run_epochs(lambda: net.fit(batches), lambda: _acc(net, te), target, max_epochs)
    r["examples_per_s"] = max_epochs * len(tr) / r["train_time"]
    r["bytes_per_step"] = 0
    return r


def run_dlspark(tr, te, target, max_epochs, algorithm, client):
    import dlspark

    from _common import make_master

    net = _net(tr)
    master = make_master(algorithm, BATCH, threshold_algorithm=dlspark.AdaptiveThreshold(initial=1e-2))
    trainer = dlspark.DistributedTrainer(client, net, master, progress=False)
    # Compile outside the clock, as for the plain run: workers keep the compiled
    # network (by its token) across fits, so one short fit warms them up.
    trainer.fit(tr[: 8 * BATCH])
    if len(tr) % BATCH:
        trainer.fit(tr[: 8 * BATCH + len(tr) % BATCH])  # ... and the partial last minibatch's shape
    net.state = net.init_state()
    trainer.algorithm_state.clear()  # the threshold reached while warming up is not carried on
    steps = {"n": 0, "bytes": 0}

    def epoch():
        trainer.fit(tr)
        stats = trainer.last_fit_stats
        steps["n"] += sum(s["minibatches"] for s in stats)
        steps["bytes"] += sum(s.get("bytes_sent", s.get("bytes_received", 0)) for s in stats)

    r = _run_epochs(epoch, lambda: _acc(trainer.network, te), target, max_epochs)
    r["examples_per_s"] = max_epochs * len(tr) / r["train_time"]
    r["bytes_per_step"] = steps["bytes"] / max(steps["n"], 1)
    trainer.delete_temp_files()
    return r


def _ddp_rank(rank, world, tr_x, tr_y, te_x, te_y, target, max_epochs, port, out):
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(tr_x.shape[1], HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.from_numpy(tr_x), torch.from_numpy(tr_y.argmax(1))
    share = torch.arange(rank, len(x), world)  # each rank its half, as a DistributedSampler without shuffle
    tx, ty = torch.from_numpy(te_x), torch.from_numpy(te_y.argmax(1))

    def epoch():
        for i in range(0, len(share), BATCH):
            idx = share[i:i + BATCH]
            opt.zero_grad()
            loss_fn(ddp(x[idx]), y[idx]).backward()
            opt.step()
        dist.barrier()

    def evaluate():
        with torch.no_grad():
            return float((model(tx).argmax(1) == ty).float().mean())

    r = _run_epochs(epoch, evaluate, target, max_epochs)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        r["examples_per_s"] = max_epochs * len(x) / r["train_time"]
        r["bytes_per_step"] = 4 * n_params * 2 * (world - 1) / world  # ring all-reduce, per rank
        with open(out, "w") as f:
            json.dump(r, f)
    dist.destroy_process_group()


def run_ddp(tr, te, target, max_epochs):
    try:
        import torch.multiprocessing as mp
    except ImportError:
        return {"skipped": "torch is not installed: pip install -e '.[compare]'"}
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "ddp.json")
    mp.start_processes(_ddp_rank, args=(2, tr.features, tr.labels, te.features, te.labels, target, max_epochs, port,
                                        out), nprocs=2, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description="dlspark side-by-side comparison")
    ap.add_argument("--quick", action="store_true", help="digits only, fewer epochs")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--out", default="compare-results.json")
    args = ap.parse_args(argv)
    names = ["digits"] if args.quick else ["digits", "synthetic"]
    epochs = args.epochs or (12 if args.quick else 20)

    from distributed import Client

    from dlspark.cluster import local_cluster

    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
               "config": {"hidden": HIDDEN, "lr": LR, "batch_size_per_worker": BATCH, "epochs": epochs}, "runs": {}}
    import multiprocessing as mpc

    ctx = mpc.get_context("spawn")
    for name, (tr, te, target) in _datasets(names).items():
        runs = {}
        with ctx.Pool(1) as pool:  # the plain run in its own pinned process
            runs["jax_single_process"] = pool.apply(run_plain, (tr, te, target, epochs))
        with local_cluster(2) as cluster, Client(cluster) as client:
            runs["dlspark_parameter_averaging"] = run_dlspark(tr, te, target, epochs, "averaging", client)
            runs["dlspark_gradient_sharing"] = run_dlspark(tr, te, target, epochs, "sharing", client)
        runs["torch_ddp_gloo"] = run_ddp(tr, te, target, epochs)
        results["runs"][name] = {"target_accuracy": target, "results": runs}
        base = runs["jax_single_process"]
        print(f"\n{name}: target accuracy {target}, {epochs} epochs, batch {BATCH}/worker, lr {LR}")
        print(f"{'contender':<30}{'examples/s':>12}{'x':>7}{'time to target':>16}{'x':>7}{'epochs':>8}{'final acc':>11}{'bytes/step':>12}")
        for k, r in runs.items():
            if "skipped" in r:
                print(f"{k:<30} skipped: {r['skipped']}")
                continue
            ratio = r["examples_per_s"] / base["examples_per_s"]
            ttt = r["time_to_target"]
            tr_ratio = (ttt / base["time_to_target"]) if ttt and base["time_to_target"] else float("nan")
            r["examples_per_s_ratio"], r["time_to_target_ratio"] = ratio, tr_ratio
            print(f"{k:<30}{r['examples_per_s']:>12.0f}{ratio:>7.2f}{(ttt or float('nan')):>16.2f}{tr_ratio:>7.2f}"
                  f"{str(r['epochs_to_target']):>8}{r['final_accuracy']:>11.4f}{r['bytes_per_step']:>12.0f}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwritten to {args.out}")
    return results


if __name__ == "__main__":
    main()
