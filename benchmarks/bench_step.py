"""Single-process reference: one jitted train step of the digits MLP.

Run against the working tree without building environments:
``asv run --python=same --quick``.
"""

import timeit

import flax.linen as nn
import jax
import numpy as np
import optax

import dlspark


class _MLP(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(self.width)(nn.relu(nn.Dense(self.width)(x)))))


class TrainStep:
    """Steps/s of ``Network.steps.train_step`` (params donated) for three MLP widths."""

    params = [64, 512, 2048]
    param_names = ["width"]
    timer = timeit.default_timer

    def setup(self, width):
        rng = np.random.default_rng(0)
        self.ds = dlspark.DataSet(rng.normal(size=(64, 64)).astype(np.float32),
                                  np.eye(10, dtype=np.float32)[rng.integers(0, 10, 64)])
        self.net = dlspark.Network(dlspark.Model.from_flax(_MLP(width), self.ds.features[:1]),
                                   updater=optax.adam(1e-3))
        self.batch = jax.tree_util.tree_map(jax.numpy.asarray, self.ds.jit_batch())
        self.state = self.net.state
        for _ in range(3):  # compile and warm up
            self.state, loss, _ = self.net.steps.train_step(self.state, self.batch)
        loss.block_until_ready()

    def time_train_step(self, width):
        self.state, loss, _ = self.net.steps.train_step(self.state, self.batch)
        loss.block_until_ready()
