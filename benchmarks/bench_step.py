"""Single-process reference: one jitted train step for an MLP, a small CNN and an LSTM.

Run against the working tree without building environments:
``asv run --python=same --quick --show-stderr``.
"""

import timeit

import flax.linen as nn
import jax
import numpy as np
import optax

import dlspark


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(512)(nn.relu(nn.Dense(512)(x)))))


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], 24, 24, 1)
        x = nn.max_pool(nn.relu(nn.Conv(16, (3, 3))(x)), (2, 2), (2, 2))
        x = nn.max_pool(nn.relu(nn.Conv(32, (3, 3))(x)), (2, 2), (2, 2))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


class _LSTM(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], 24, 24)  # 24 steps of 24 features
        h = nn.RNN(nn.OptimizedLSTMCell(64))(x)
        return nn.Dense(10)(h[:, -1])


_MODELS = {"mlp": _MLP, "cnn": _CNN, "lstm": _LSTM}


class TrainStep:
    """Steps/s of ``Network.steps.train_step`` (state donated), batch 32."""

    params = ["mlp", "cnn", "lstm"]
    param_names = ["network"]
    timer = timeit.default_timer

    def setup(self, kind):
        rng = np.random.default_rng(0)
        ds = dlspark.DataSet(rng.normal(size=(32, 576)).astype(np.float32),
                             np.eye(10, dtype=np.float32)[rng.integers(0, 10, 32)])
        self.net = dlspark.Network(dlspark.Model.from_flax(_MODELS[kind](), ds.features[:1]), updater=optax.adam(1e-3))
        self.batch = jax.tree_util.tree_map(jax.numpy.asarray, ds.jit_batch())
        # train_step donates its input state: step a copy, and keep the network's own intact
        self.state = jax.tree_util.tree_map(jax.numpy.copy, self.net.state)
        for _ in range(3):  # compile and warm up
            out = self.net.steps.train_step(self.state, self.batch)
            self.state = out.state
        out.loss.block_until_ready()

    def time_train_step(self, kind):
        out = self.net.steps.train_step(self.state, self.batch)
        self.state = out.state
        out.loss.block_until_ready()

    def peakmem_local_fit(self, kind):
        self.net.fit([dlspark.DataSet(np.asarray(self.batch[0]), np.asarray(self.batch[1]))] * 20)
