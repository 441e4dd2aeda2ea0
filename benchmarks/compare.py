"""Side-by-side: the same network, data and hyper-parameters trained by

1. a plain single-process loop: a bare ``jax.jit`` + optax step over numpy
   minibatches (one core), the field's plain tool and the baseline;
2. dlspark's own ``Network.fit`` in one process (by default 16 minibatches per compiled call);
3. dlspark's ParallelWrapper (averaging, sharing) in one process over 2 CPU devices;
4. dlspark parameter averaging on 2 workers;
5. dlspark gradient sharing on 2 workers;
6. PyTorch DistributedDataParallel (gloo) on 2 CPU processes.

Every contender is warmed the same way: every minibatch shape (the full one
and the last partial one) is compiled (or run once, for torch) outside the
clock, and the timed run starts again from the same initial parameters.
Two networks: the 64-128-10 MLP (a 0.2 ms step, where fixed costs dominate)
on digits and on a synthetic set, and the benchmarks' wide MLP (3 x 768, a
step of about 10 ms at 160 examples) on a synthetic set, the regime where
distribution starts to pay.

Every contender gets one core per process: JAX processes are pinned with
``os.sched_setaffinity`` before JAX starts (XLA's CPU pool ignores thread
flags), torch ranks are pinned the same way and call ``torch.set_num_threads(1)``;
OMP/MKL/OpenBLAS thread variables are set to 1 for all. The table reports
each figure as a ratio to the single-process JAX run, and is written as JSON.

    python benchmarks/compare.py --quick            # digits only, about a minute
    python benchmarks/compare.py --out results.json # digits, synthetic, and the wide MLP
    python benchmarks/compare.py --only wide        # the ~10 ms network alone

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
#: run name -> (hidden layer widths, examples per minibatch per worker, learning rate)
ARCH = {"digits": ((HIDDEN,), BATCH, LR), "synthetic": ((HIDDEN,), BATCH, LR), "wide": ((768, 768, 768), 160, 1e-3)}


def _datasets(names):
    import dlspark

    out = {}
    if "digits" in names:
        tr, te = dlspark.datasets.digits()
        out["digits"] = (tr, te, 0.95)
    if "synthetic" in names:
        full = dlspark.datasets.synthetic_classification(24_000, n_features=64, n_classes=10, noise=6.0, seed=1)
        out["synthetic"] = (full[:20_000], full[20_000:], 0.70)
    if "wide" in names:
        full = dlspark.datasets.synthetic_classification(36_000, n_features=256, n_classes=10, noise=6.0, seed=2)
        out["wide"] = (full[:32_000], full[32_000:], 0.70)
    return out


def _flax_mlp(widths):
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for w in widths:
                x = nn.relu(nn.Dense(w)(x))
            return nn.Dense(10)(x)

    return MLP()


def _net(tr, name):
    import optax

    import dlspark

    widths, _, lr = ARCH[name]
    return dlspark.Network(dlspark.Model.from_flax(_flax_mlp(widths), tr.features[:1]), updater=optax.adam(lr),
                           seed=0)


def _acc(net, te):
    return float((net.output(te.features).argmax(1) == te.labels.argmax(1)).mean())


def _run_epochs(train_one_epoch, evaluate, target, max_epochs):
    """Train epoch by epoch; return time and epochs to ``target`` accuracy and the final accuracy."""
    spent, to_target, acc, times = 0.0, None, 0.0, []
    for e in range(1, max_epochs + 1):
        t0 = time.perf_counter()
        train_one_epoch()
        times.append(time.perf_counter() - t0)
        spent += times[-1]
        acc = evaluate()
        if to_target is None and acc >= target:
            to_target = (spent, e)
    return {"train_time": spent, "time_to_target": to_target[0] if to_target else None,
            "epochs_to_target": to_target[1] if to_target else None, "final_accuracy": acc,
            "epochs": max_epochs, "epoch_times": times}


def run_plain(tr, te, target, max_epochs, name):
    """The baseline: a bare jitted flax + optax step over numpy minibatches, in a pinned process."""
    os.sched_setaffinity(0, {0})
    import jax

    from _common import plain_optax_step
    import optax

    widths, batch, lr = ARCH[name]
    model, tx = _flax_mlp(widths), optax.adam(lr)
    x, y = tr.features, tr.labels
    step = plain_optax_step(model, tx)

    predict = jax.jit(model.apply)
    batches = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]
    init = lambda: model.init(jax.random.PRNGKey(0), x[:1])  # noqa: E731
    params = init()
    opt_state = tx.init(params)
    for xb, yb in {len(b[0]): b for b in batches}.values():  # every shape, outside the clock
        params, opt_state, loss = step(params, opt_state, xb, yb)
    loss.block_until_ready()
    predict(params, te.features).block_until_ready()
    state = {"params": init()}
    state["opt"] = tx.init(state["params"])

    def epoch():
        p, o = state["params"], state["opt"]
        for xb, yb in batches:
            p, o, loss = step(p, o, xb, yb)
        loss.block_until_ready()
        state["params"], state["opt"] = p, o

    def evaluate():
        return float((predict(state["params"], te.features).argmax(1) == te.labels.argmax(1)).mean())

    r = _run_epochs(epoch, evaluate, target, max_epochs)
    r["examples_per_s"] = max_epochs * len(tr) / r["train_time"]
    r["bytes_per_step"] = 0
    return r


def run_network_fit(tr, te, target, max_epochs, name):
    """dlspark's Network.fit in one pinned process, warmed as the baseline is: every program
    its epoch runs compiled outside the clock (an epoch's fit runs 16 minibatches of one shape
    per call, a program of its own, and the rest one per call)."""
    os.sched_setaffinity(0, {0})
    net = _net(tr, name)
    batches = tr.batches(ARCH[name][1])
    net.fit(batches)  # every program and shape, outside the clock
    _acc(net, te)
    net.state = net.init_state()  # the same network (and compiled steps), from the start

    def epoch():
        import jax

        net.fit(batches)
        jax.block_until_ready(net.state)

    r = _run_epochs(epoch, lambda: _acc(net, te), target, max_epochs)
    r["examples_per_s"] = max_epochs * len(tr) / r["train_time"]
    r["bytes_per_step"] = 0
    return r


def run_dlspark(tr, te, target, max_epochs, algorithm, client, name):
    import dlspark

    from _common import make_master

    batch = ARCH[name][1]
    net = _net(tr, name)
    master = make_master(algorithm, batch, threshold_algorithm=dlspark.AdaptiveThreshold(initial=1e-2))
    trainer = dlspark.DistributedTrainer(client, net, master, progress=False)
    # Compile outside the clock, as for the plain run: workers keep the compiled
    # network (by its token) across fits, so one short fit warms them up.
    trainer.fit(tr[: 8 * batch])
    if len(tr) % batch:
        trainer.fit(tr[: 8 * batch + len(tr) % batch])  # ... and the partial last minibatch's shape
    _acc(trainer.network, te)
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


def run_parallel(tr, te, target, max_epochs, algorithm, name):
    """dlspark's ParallelWrapper in one process over 2 CPU devices (the process's 2 cores),
    warmed as the others: a short fit compiles every shape, then the initial state again."""
    import jax

    jax.config.update("jax_num_cpu_devices", 2)  # before JAX starts in this process
    import dlspark

    from _common import make_master

    batch = ARCH[name][1]
    net = _net(tr, name)
    master = make_master(algorithm, batch, threshold_algorithm=dlspark.AdaptiveThreshold(initial=1e-2))
    wrapper = dlspark.ParallelWrapper(net, master, devices=2, progress=False)
    wrapper.fit(tr[: 16 * batch])
    if len(tr) % batch:
        wrapper.fit(tr[: 16 * batch + len(tr) % batch])
    _acc(net, te)
    net.state = net.init_state()
    wrapper.algorithm_state.clear()
    steps = {"n": 0, "bytes": 0}

    def epoch():
        wrapper.fit(tr)
        jax.block_until_ready(net.state)
        stats = wrapper.last_fit_stats
        steps["n"] += sum(s["minibatches"] for s in stats)
        steps["bytes"] += sum(s.get("bytes_sent", s.get("bytes_equivalent", 0)) for s in stats)

    r = _run_epochs(epoch, lambda: _acc(net, te), target, max_epochs)
    r["examples_per_s"] = max_epochs * len(tr) / r["train_time"]
    r["bytes_per_step"] = steps["bytes"] / max(steps["n"], 1)  # what a cluster would have sent
    return r


def _ddp_rank(rank, world, tr_x, tr_y, te_x, te_y, target, max_epochs, port, out, name):
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    widths, batch, lr = ARCH[name]
    layers, width = [], tr_x.shape[1]
    for w in widths:
        layers += [torch.nn.Linear(width, w), torch.nn.ReLU()]
        width = w
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = torch.from_numpy(tr_x), torch.from_numpy(tr_y.argmax(1))
    share = torch.arange(rank, len(x), world)  # each rank its half, as a DistributedSampler without shuffle
    tx, ty = torch.from_numpy(te_x), torch.from_numpy(te_y.argmax(1))

    def epoch():
        for i in range(0, len(share), batch):
            idx = share[i:i + batch]
            opt.zero_grad()
            loss_fn(ddp(x[idx]), y[idx]).backward()
            opt.step()
        dist.barrier()

    def evaluate():
        with torch.no_grad():
            return float((model(tx).argmax(1) == ty).float().mean())

    # warmed as the others: one step of each minibatch size, then the initial parameters again
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    for size in (batch, len(share) % batch or batch):  # as many calls on every rank: each all-reduces
        idx = share[:size]
        opt.zero_grad()
        loss_fn(ddp(x[idx]), y[idx]).backward()
    opt.zero_grad()
    model.load_state_dict(initial)
    evaluate()

    r = _run_epochs(epoch, evaluate, target, max_epochs)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        r["examples_per_s"] = max_epochs * len(x) / r["train_time"]
        r["bytes_per_step"] = 4 * n_params * 2 * (world - 1) / world  # ring all-reduce, per rank
        with open(out, "w") as f:
            json.dump(r, f)
    dist.destroy_process_group()


def run_ddp(tr, te, target, max_epochs, name):
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
                                        out, name), nprocs=2, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description="dlspark side-by-side comparison")
    ap.add_argument("--quick", action="store_true", help="digits only, fewer epochs")
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--out", default="compare-results.json")
    ap.add_argument("--only", choices=sorted(ARCH), action="append", help="run only this set (repeatable)")
    args = ap.parse_args(argv)
    names = args.only or (["digits"] if args.quick else ["digits", "synthetic", "wide"])
    epochs = args.epochs or (12 if args.quick else 20)

    from distributed import Client

    from dlspark.cluster import local_cluster

    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
               "config": {"arch": ARCH, "epochs": epochs}, "runs": {}}
    import multiprocessing as mpc

    ctx = mpc.get_context("spawn")
    for name, (tr, te, target) in _datasets(names).items():
        ep = epochs if name != "wide" else min(epochs, 3)
        runs = {}
        with ctx.Pool(1) as pool:  # the plain runs each in their own pinned process
            runs["jax_single_process"] = pool.apply(run_plain, (tr, te, target, ep, name))
        with ctx.Pool(1) as pool:
            runs["dlspark_network_fit"] = pool.apply(run_network_fit, (tr, te, target, ep, name))
        for algorithm in ("averaging", "sharing"):
            with ctx.Pool(1) as pool:  # one process, two CPU devices
                runs[f"dlspark_parallel_wrapper_{algorithm}"] = pool.apply(
                    run_parallel, (tr, te, target, ep, algorithm, name))
        with local_cluster(2) as cluster, Client(cluster) as client:
            runs["dlspark_parameter_averaging"] = run_dlspark(tr, te, target, ep, "averaging", client, name)
            runs["dlspark_gradient_sharing"] = run_dlspark(tr, te, target, ep, "sharing", client, name)
        runs["torch_ddp_gloo"] = run_ddp(tr, te, target, ep, name)
        results["runs"][name] = {"target_accuracy": target, "results": runs}
        base = runs["jax_single_process"]
        widths, batch, lr = ARCH[name]
        print(f"\n{name}: target accuracy {target}, {ep} epochs, MLP {widths}, batch {batch}/worker, lr {lr}")
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
