"""Gradient sharing as one XLA program per step over the CPU devices of one process: an
experiment measured against the plain step, kept to show why ``ParallelWrapper`` stays on
the host encoder on CPU devices (README, ParallelWrapper).

Both programs run under ``shard_map`` over 2 CPU devices in one process pinned to 2 cores:

- ``plain``: the network's bare step on every device (what an averaging round runs);
- ``sharing``: the step's update, added per parameter leaf to the residual, threshold-encoded
  in XLA (``encode_on_device``, the exact-residual rule included), the quantized updates
  summed over the devices (``psum``) and applied: no host in the step. (``encode_on_device``'s
  rule of at least two moved elements applies per leaf here, not over the whole update:
  the same work, which is what this measures.)

Print milliseconds per step, three repeats, with
``python benchmarks/parallel_sharing_xla.py [mlp|cnn]``.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
from _common import make_data, make_network  # noqa: E402

from dlspark._mesh import AXIS  # noqa: E402
from dlspark._mesh import first as _first  # noqa: E402
from dlspark._mesh import lead as _lead  # noqa: E402
from dlspark.algorithms.sharing._xla import encode_on_device  # noqa: E402

BATCH = {"mlp": 160, "cnn": 16}


def programs(net, mesh):
    steps = net.steps

    def plain(state, batch):
        out = steps.bare_step(_first(state), _first(batch))
        return _lead(out.state), out.loss[None]

    def sharing(state, residual, batch, threshold):
        st = _first(state)
        u = steps.compute_update(st, _first(batch))
        leaves, treedef = jax.tree_util.tree_flatten(u.updates)
        encoded = [encode_on_device(r + u.astype(jnp.float32), threshold)
                   for r, u in zip(jax.tree_util.tree_leaves(_first(residual)), leaves)]
        total = jax.lax.psum([moved for moved, _, _ in encoded], AXIS)
        st = steps.apply_update(st, jax.tree_util.tree_unflatten(treedef, [t.astype(u.dtype) for t, u in
                                                                           zip(total, leaves)]),
                                 u.opt_state, u.model_state, u.rng)
        count = sum(c for _, _, c in encoded)
        return _lead(st), _lead(jax.tree_util.tree_unflatten(treedef, [r for _, r, _ in encoded])), count[None]

    spec = P(AXIS)
    return (jax.jit(jax.shard_map(plain, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec),
                                  check_vma=False), donate_argnums=(0,)),
            jax.jit(jax.shard_map(sharing, mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=(spec,) * 3,
                                  check_vma=False), donate_argnums=(0, 1)))


def ms_per_step(run, n=60, warm=5):
    for _ in range(warm):
        run()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    return 1000 * (time.perf_counter() - t0) / n


def main(kind="mlp"):
    # here, not at import (asv imports every module of benchmarks/): before JAX starts
    os.sched_setaffinity(0, {0, 1})
    jax.config.update("jax_num_cpu_devices", 2)
    net, batch = make_network(kind), BATCH[kind]
    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    sharded = NamedSharding(mesh, P(AXIS))
    stack = lambda tree: jax.device_put(jax.tree_util.tree_map(lambda x: np.stack([np.asarray(x)] * 2), tree),
                                        sharded)  # noqa: E731
    data = make_data(2 * batch, kind).jit_batch()
    batches = jax.device_put(jax.tree_util.tree_map(lambda x: np.asarray(x).reshape((2, batch) + x.shape[1:]), data),
                             sharded)
    plain, sharing = programs(net, mesh)
    held = {"plain": stack(net.state), "sharing": stack(net.state),
            "residual": stack(jax.tree_util.tree_map(lambda p: np.zeros(p.shape, np.float32), net.state.params))}

    def run_plain():
        held["plain"], loss = plain(held["plain"], batches)
        loss.block_until_ready()

    def run_sharing():
        held["sharing"], held["residual"], count = sharing(held["sharing"], held["residual"], batches,
                                                           np.float32(1e-3))
        np.asarray(count)  # the host reads the count each step, as a threshold algorithm must

    for _ in range(3):
        print(f"{kind}: plain {ms_per_step(run_plain):.2f} ms, sharing in XLA {ms_per_step(run_sharing):.2f} ms a step",
              flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
