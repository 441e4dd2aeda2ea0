"""Where gradient sharing's accuracy goes: a synchronous, in-process model of it.

``n`` virtual workers take turns over the digits minibatches (16 examples each); at
every step each computes its optax (Adam) update from the shared parameters, and every
replica applies the sum. The sum is dense (``dense``: what sharing would do without
quantization) or each worker's update goes through the real residual, threshold
encoding, threshold algorithm and residual clipping of ``dlspark.algorithms.sharing``
(``sharing``). Options isolate one cause at a time: ``scale`` multiplies the applied
sum (0.5: the mean of two workers), ``noclip`` drops the residual clipping, ``band``
and ``target`` change the threshold algorithm, ``init`` starts it at a fixed value
(DL4J's way), ``lr`` the learning rate, ``flush`` applies what is left in the
residuals at the end. ``values`` sends, where the residual crosses the threshold, the
residual's own values instead of ``±threshold`` (as Deep Gradient Compression sends its
top elements; 8 bytes an element here against the sign-and-index encoding's 4). No
cluster, no asynchrony: what differs from ``single`` (one process) is the algorithm's
arithmetic alone.

``python benchmarks/sharing_anatomy.py single dense sharing dense:scale=0.5 sharing:noclip=1``
prints ``config seed accuracy dense/sent seconds`` per configuration and seed (3 seeds).
"""

import sys
import time

import numpy as np


def run(mode, n=2, epochs=8, lr=3e-3, seed=0, scale=1.0, noclip=0, flush=0, target=0.0, band=0.0, init=0.0):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from jax.flatten_util import ravel_pytree

    import dlspark
    from dlspark.algorithms.sharing._encoding import BITMAP, EMPTY, decode_into, threshold_encode
    from dlspark.algorithms.sharing._thresholds import (AdaptiveThreshold, NoResidualPostProcessing,
                                                        ResidualClipping, TargetSparsityThreshold)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))

    tr, te = dlspark.datasets.digits()
    net = dlspark.Network(dlspark.Model.from_flax(MLP(), tr.features[:1]), updater=optax.adam(lr), seed=seed)

    def accuracy():
        return float((np.asarray(net.output(te.features)).argmax(-1) == te.labels.argmax(-1)).mean())

    if mode == "single":
        net.fit(tr, epochs=epochs, batch_size=16)
        return accuracy(), None
    steps, batches = net.steps, tr.batches(16)
    unravel = ravel_pytree(net.state.params)[1]
    size = ravel_pytree(net.state.params)[0].size
    states = [jax.tree_util.tree_map(lambda a: jnp.array(a, copy=True), net.state) for _ in range(n)]
    algo = AdaptiveThreshold()
    if init:
        algo = AdaptiveThreshold(initial=init)
    if band:
        algo = AdaptiveThreshold(min_sparsity=band / 10, max_sparsity=band)
    if target:
        algo = TargetSparsityThreshold(target=target)
    post = NoResidualPostProcessing() if noclip else ResidualClipping()
    res = [np.zeros(size, np.float32) for _ in range(n)]
    ts = [algo.init() for _ in range(n)]
    compute = jax.jit(steps.compute_update)
    sent = count = 0
    for _ in range(epochs):
        for r in range(0, len(batches) - n + 1, n):
            total, kept = np.zeros(size, np.float32), []
            for w in range(n):
                step = compute(states[w], batches[r + w].jit_batch())
                flat = np.asarray(ravel_pytree(step.updates)[0])
                kept.append((step.opt_state, step.model_state, step.rng))
                if mode == "dense":
                    total += flat
                    continue
                res[w] += flat
                ts[w] = algo.prepare(ts[w], res[w])
                t = ts[w].threshold
                if mode == "values":  # DGC's way: the residual's own values where it crosses the threshold
                    hit = np.flatnonzero(np.abs(res[w]) >= t)
                    total[hit] += res[w][hit]
                    res[w][hit] = 0.0
                    sent += 8 * hit.size + 16
                    ts[w] = algo.update(ts[w], hit.size / size)
                    continue
                enc = threshold_encode(res[w], t, out=res[w], min_count=2)
                if enc.message[0] != EMPTY:
                    decode_into(enc.message, total)
                sent += enc.message.nbytes
                res[w] = post.update(res[w], t, count + 1)
                ts[w] = algo.update(ts[w], 1 / 16 if enc.format == BITMAP else enc.count / size)
            count += 1
            total *= scale
            states = [steps.apply_update(states[w], unravel(jnp.asarray(total)), *kept[w]) for w in range(n)]
    if flush:
        left = unravel(jnp.asarray(sum(res)))
        states = [steps.apply_update(s, left, s.opt_state, s.model_state, s.rng) for s in states]
    net.state = states[0]
    return accuracy(), (count * n * 4 * size / sent if sent else None)


def main(configs, seeds=3):
    floats = {"scale", "lr", "target", "band", "init"}
    for seed in range(seeds):
        for c in configs:
            mode, *opts = c.split(":")
            kw = {k: (float(v) if k in floats else int(v)) for k, v in (o.split("=") for o in opts)}
            t0 = time.perf_counter()
            acc, ratio = run(mode, seed=seed, **kw)
            print(c, seed, round(acc, 4), "" if ratio is None else round(ratio, 1),
                  round(time.perf_counter() - t0, 1), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["single", "dense", "sharing"])
