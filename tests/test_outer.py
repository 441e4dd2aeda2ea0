"""The outer optimizer of parameter averaging (DiLoCo), on a real 2-worker LocalCluster.

The parameters after each averaging are the round-start parameters moved by the
outer optimizer's update of (start - mean). Tested: ``None`` is the mean bit for
bit; ``optax.sgd(1.0)`` the mean to float32 rounding; Nesterov momentum equals
the same outer loop computed here; only a full round takes the outer step; a resumed fit
continues the outer state exactly.
"""

import asyncio

import jax
import numpy as np
import optax
import pytest
from conftest import _cluster_client
from distributed.protocol import to_serialize

import dlspark
from dlspark import DistributedTrainer, ParameterAveraging
from dlspark.algorithms.averaging._messages import AverageWith
from dlspark.algorithms.averaging._numerics import (average_leaves, averaged_indices, encode_moves, mean_of_moves,
                                                    outer_step)
from dlspark.checkpoint import state_from_arrays, state_to_arrays
from dlspark.data import save_minibatches
from dlspark.distributed._client import checked, setup_workers
from dlspark.distributed._messages import FitOrder, JobSpec
from dlspark.distributed._plan import Coordinator

pytestmark = pytest.mark.slow

NESTEROV = dict(learning_rate=0.7, momentum=0.9, nesterov=True)


@pytest.fixture(scope="module")
def client():
    yield from _cluster_client(2)


def _floats(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _one_averaged_round(client, net, master, urls):
    """Both workers fit one minibatch and average; returns (their states, their contributions)."""
    import uuid

    import cloudpickle

    DistributedTrainer(client, net, master, progress=False)  # installs the plugins
    job = uuid.uuid4().hex[:12]
    # the master a fit settles for its two workers (update_scale), as the trainer sends it
    spec = cloudpickle.dumps(JobSpec(net.definition(), net.token, master.for_workers(2), urls))
    a, b = sorted(client.scheduler_info()["workers"])

    async def scenario():
        await setup_workers(client, [a, b], job, spec, state_to_arrays(net.state))
        try:
            def fit(w, i):
                return client.rpc(w).dlspark_order(job=job, order=to_serialize(
                    FitOrder(round=1, epoch=0, refs=(i,), plan=AverageWith((a, b)))))

            for r in await asyncio.gather(fit(a, 0), fit(b, 1)):
                checked(r)
            contributions = [checked(await client.rpc(w).dlspark_peer(job=job, request="contribution", round=1))
                             ["reply"].leaves for w in (a, b)]
            states = [checked(await client.rpc(w).dlspark_state(job=job))["state"] for w in (a, b)]
            return states, contributions
        finally:
            await asyncio.gather(*[client.rpc(w).dlspark_teardown(job=job) for w in (a, b)])

    states, contributions = client.sync(scenario)
    return [state_from_arrays(s, net.state) for s in states], contributions


@pytest.mark.parametrize("outer", [None, "sgd1"])
def test_without_outer_updater_the_mean_bit_for_bit_and_sgd_one_to_rounding(client, make_net, digits, tmp_path,
                                                                             outer):
    tr, _ = digits
    urls = save_minibatches(tr[:64], url=str(tmp_path / "mb"), batch_size=32)
    net = make_net(updater=optax.sgd(0.1))
    master = ParameterAveraging(batch_size_per_worker=32, outer_updater=None if outer is None else optax.sgd(1.0))
    states, contributions = _one_averaged_round(client, net, master, urls)
    # the mean of the two contributions, computed here in numpy (the host reference)
    mean = average_leaves(contributions[0], contributions)
    n_params = len(jax.tree_util.tree_leaves(net.state.params))
    for st in states:
        got = _floats(st)
        for x, want in zip(got[:n_params], mean[:n_params]):
            if outer is None:
                np.testing.assert_array_equal(x, want)
            else:  # start - (start - mean): within a few float32 roundings of the mean
                np.testing.assert_allclose(x, want, rtol=0, atol=4 * np.finfo(np.float32).eps * (1 + np.abs(want).max()))
    start = _floats(net.state.params)
    assert any(not np.allclose(x, s) for x, s in zip(_floats(states[0].params), start))  # it trained


def _outer_loop_here(make_net, batches, workers, freq, lr, outer, moves=False, outer_lr=None, every_round=False):
    """The job's arithmetic in this process: each round every worker fits its share of the
    round's minibatches from the same start, the states are averaged, and, after a full round
    (every worker fitted ``freq`` minibatches; with ``every_round`` after any), the outer
    optimizer moves the round-start parameters by its update of (start - mean). A round that
    takes the outer step trains at SGD's rate ``outer_lr`` (default ``lr``), any other at
    ``lr``. With ``moves``, the mean is the start plus the mean of the workers' moves in
    bfloat16, each worker's rounding error carried into its next move
    (``exchange_precision="bfloat16"``)."""
    net = make_net(updater=optax.sgd(lr))
    at_outer_lr = make_net(updater=optax.sgd(lr if outer_lr is None else outer_lr))
    state = jax.tree_util.tree_map(np.asarray, net.state)
    outer_state = None if outer is None else outer.init(state.params)
    plan = Coordinator([0] * len(batches), 1, freq)
    names = [f"w{i}" for i in range(workers)]
    mixed = averaged_indices(state, True)
    residuals = {}
    while (p := plan.plan_round(names)) is not None:
        takes_outer = outer is not None and (every_round or min(len(p.assignment[w]) for w in p.contributors) >= freq)
        steps = (at_outer_lr if takes_outer else net).steps
        fitted = []
        for w in names:
            st = jax.tree_util.tree_map(np.copy, state)
            for i in p.assignment[w]:
                st = steps.train_step(st, jax.tree_util.tree_map(np.asarray, batches[i].jit_batch())).state
            fitted.append(jax.tree_util.tree_leaves(st))
        plan.complete_round(p, names)
        treedef = jax.tree_util.tree_structure(state)
        if moves:
            start = jax.tree_util.tree_leaves(state)
            theta = [np.asarray(start[i], np.float32) for i in mixed]
            bits = []
            for w, leaves in zip(names, fitted):
                b, residuals[w] = encode_moves([leaves[i] for i in mixed], theta,
                                               residuals.get(w) or [np.zeros_like(t) for t in theta])
                bits.append(b)
            leaves = list(fitted[0])  # the integers (step counts) as the first worker's, as averaging keeps them
            for i, x in zip(mixed, mean_of_moves(theta, bits)):
                leaves[i] = np.asarray(x).astype(leaves[i].dtype)
            mean = jax.tree_util.tree_unflatten(treedef, leaves)
        else:
            mean = jax.tree_util.tree_unflatten(treedef, average_leaves(fitted[0], fitted))
        if takes_outer:
            params, outer_state = outer_step(outer, state.params, mean.params, outer_state)
            mean = mean.replace(params=params)
        state = jax.tree_util.tree_map(np.asarray, mean)
    return state


def test_nesterov_outer_loop_equals_the_same_loop_computed_here(client, make_net, digits):
    tr, _ = digits
    batches = tr[:512].batches(32)  # 16 minibatches: 4 rounds of 2 workers x 2
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2,
                                outer_updater=optax.sgd(**NESTEROV), outer_update_scale=1.0)
    net = make_net(updater=optax.sgd(0.1))
    trainer = DistributedTrainer(client, net, master, progress=False)
    trainer.fit(batches)
    assert [s["workers"] for s in trainer.last_fit_stats] == [2] * 4
    here = _outer_loop_here(make_net, batches, 2, 2, 0.1, optax.sgd(**NESTEROV))
    plain = _outer_loop_here(make_net, batches, 2, 2, 0.1, None)
    for x, y in zip(_floats(net.state.params), _floats(here.params)):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
    # the outer optimizer changed the result (momentum carried across rounds)
    assert any(not np.allclose(x, y, rtol=1e-3, atol=1e-4) for x, y in zip(_floats(net.state.params),
                                                                           _floats(plain.params)))
    # its state is carried to the next fit, and it is the trace the local loop reached
    assert "outer_state" in trainer.algorithm_state


def test_moves_in_bfloat16_under_the_nesterov_outer_loop_equal_the_same_loop_computed_here(client, make_net, digits):
    tr, _ = digits
    batches = tr[:512].batches(32)  # 16 minibatches: 4 rounds of 2 workers x 2
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2, outer_update_scale=1.0,
                                outer_updater=optax.sgd(**NESTEROV), exchange_precision="bfloat16")
    net = make_net(updater=optax.sgd(0.1))
    trainer = DistributedTrainer(client, net, master, progress=False)
    trainer.fit(batches)
    here = _outer_loop_here(make_net, batches, 2, 2, 0.1, optax.sgd(**NESTEROV), moves=True)
    for x, y in zip(_floats(net.state.params), _floats(here.params)):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
    # each round fetched the peer's moves in 16 bits an element
    elements = sum(np.size(x) for x in jax.tree_util.tree_leaves(net.state.params))  # sgd keeps no state
    assert [s["bytes_received"] for s in trainer.last_fit_stats] == [2 * 2 * elements] * 4
    # a ParallelWrapper over two devices computes the same rounds
    on_devices = make_net(updater=optax.sgd(0.1))
    dlspark.ParallelWrapper(on_devices, master, devices=2, progress=False).fit(batches)
    for x, y in zip(_floats(on_devices.state.params), _floats(here.params)):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("runtime", ["cluster", "wrapper"])
def test_only_a_full_round_takes_the_outer_step(client, make_net, digits, runtime, precision):
    """A round in which a worker fits fewer than ``averaging_frequency`` minibatches (here the
    epoch's last) ends in the plain mean of steps at ``update_scale`` (the workers, 2), the
    outer state left as it was; a full round trains at ``outer_update_scale`` (sqrt(2) by
    default) and ends in the outer step. The same rounds on a cluster and a ParallelWrapper,
    with the exchange in float32 and in bfloat16."""
    tr, _ = digits
    batches = tr[:448].batches(32)  # 14 minibatches: 3 full rounds of 2 workers x 2, then 1 each
    tx = optax.sgd(**NESTEROV)
    moves = precision == "bfloat16"
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2, outer_updater=tx,
                                exchange_precision=precision)
    net = make_net(updater=optax.sgd(0.1))
    if runtime == "cluster":
        trainer = DistributedTrainer(client, net, master, progress=False)
        trainer.fit(batches)
        assert [s["workers"] for s in trainer.last_fit_stats] == [2] * 4
    else:
        dlspark.ParallelWrapper(net, master, devices=2, progress=False).fit(batches)
    here = _outer_loop_here(make_net, batches, 2, 2, 0.2, tx, moves=moves, outer_lr=0.1 * np.sqrt(2))
    for x, y in zip(_floats(net.state.params), _floats(here.params)):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
    # what the fit did not do: the outer step after the short round too, or every round at one rate
    for other in (_outer_loop_here(make_net, batches, 2, 2, 0.2, tx, moves=moves, outer_lr=0.1 * np.sqrt(2),
                                   every_round=True),
                  _outer_loop_here(make_net, batches, 2, 2, 0.1 * np.sqrt(2), tx, moves=moves),
                  _outer_loop_here(make_net, batches, 2, 2, 0.2, tx, moves=moves)):
        assert any(not np.allclose(x, y, rtol=1e-3, atol=1e-4)
                   for x, y in zip(_floats(net.state.params), _floats(other.params)))


def test_a_resumed_fit_continues_the_outer_state_exactly(client, make_net, digits, tmp_path):
    tr, _ = digits
    data = tr[:640]  # 20 minibatches: 5 rounds of 2 workers x 2 per epoch
    url = str(tmp_path / "ck.dls")
    master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2, outer_updater=optax.sgd(**NESTEROV))
    straight = make_net(updater=optax.adam(1e-2))
    DistributedTrainer(client, straight, master, progress=False).fit(data, epochs=2, checkpoint_every=7,
                                                                     checkpoint_url=url)
    aux = dlspark.checkpoint.read_checkpoint_aux(url)
    assert aux is not None and any(np.abs(a).sum() > 0 for a in aux)  # a momentum trace was saved
    resumed = make_net(updater=optax.adam(1e-2))
    trainer = DistributedTrainer(client, resumed, master, progress=False)
    trainer.fit(data, epochs=2, resume_from=url)
    assert (resumed.iteration, resumed.epoch) == (straight.iteration, straight.epoch) == (40, 2)
    for x, y in zip(_floats(resumed.state.params), _floats(straight.state.params)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    # The same checkpoint without its outer state: the resumed run restarts its momentum
    # and ends elsewhere, so the state saved is what made the resume exact.
    stripped = tmp_path / "no-outer.dls"
    _without_outer_state(url, stripped)
    assert dlspark.checkpoint.read_checkpoint_aux(str(stripped)) is None
    fresh = make_net(updater=optax.adam(1e-2))
    DistributedTrainer(client, fresh, master, progress=False).fit(data, epochs=2, resume_from=str(stripped))
    assert fresh.iteration == 40
    assert any(not np.allclose(x, y, rtol=1e-4, atol=1e-5)
               for x, y in zip(_floats(fresh.state.params), _floats(straight.state.params)))


def _without_outer_state(url, out):
    import json
    import zipfile

    with zipfile.ZipFile(url) as z:
        members = {n: z.read(n) for n in z.namelist() if n != "aux.npz"}
    meta = json.loads(members["dlspark.json"])
    del meta["aux_leaves"]
    members["dlspark.json"] = json.dumps(meta).encode()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def test_outer_updater_must_be_an_optax_transformation():
    with pytest.raises(TypeError, match="outer_updater must be an optax transformation"):
        ParameterAveraging(outer_updater=0.7)


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), "all", True, None])
def test_update_scale_must_be_workers_or_a_positive_number(scale):
    with pytest.raises(ValueError, match='update_scale must be "workers" or a positive finite number'):
        ParameterAveraging(update_scale=scale)
    with pytest.raises(ValueError, match='outer_update_scale must be "sqrt" or a positive finite number'):
        ParameterAveraging(outer_update_scale=scale)


def test_update_scale_is_settled_for_the_workers_before_a_run():
    master = ParameterAveraging()
    assert master.update_scale == "workers" and master.for_workers(3).update_scale == 3.0
    assert ParameterAveraging(update_scale=0.5).for_workers(3).update_scale == 0.5
    # a round that ends in the outer step trains at the square root of the workers' rate by default
    outer = ParameterAveraging(outer_updater=optax.sgd(0.7, momentum=0.9, nesterov=True)).for_workers(4)
    assert (outer.update_scale, outer.outer_update_scale) == (4.0, 2.0)
    assert ParameterAveraging(outer_update_scale=0.5).for_workers(3).outer_update_scale == 0.5
    assert master.for_workers(4).outer_update_scale == "sqrt"  # without an outer optimizer, unused: left as it is
    from dlspark.algorithms.averaging._numerics import settled_scale

    assert (settled_scale(outer), settled_scale(outer, outer=True)) == (4.0, 2.0)
    with pytest.raises(ValueError, match="update_scale='workers' is settled when a fit starts"):
        settled_scale(master)
    with pytest.raises(ValueError, match="outer_update_scale='sqrt' is settled when a fit starts"):
        settled_scale(master, outer=True)


def test_default_update_scale_is_the_rate_times_the_workers(client, make_net, digits):
    """By default the replicas' steps are their updater's times the number of workers (for
    SGD: the rate times 2 here); ``update_scale=1.0`` is DL4J's mean of unscaled steps."""
    tr, _ = digits
    batches = tr[:256].batches(32)  # 8 minibatches: 2 rounds of 2 workers x 2
    ends = {}
    for scale, rate_here in (("workers", 0.2), (1.0, 0.1)):
        net = make_net(updater=optax.sgd(0.1))
        master = ParameterAveraging(batch_size_per_worker=32, averaging_frequency=2, update_scale=scale)
        trainer = DistributedTrainer(client, net, master, progress=False)
        trainer.fit(batches)
        assert trainer.master.update_scale == scale  # the user's master is kept as given
        here = _outer_loop_here(make_net, batches, 2, 2, rate_here, None)
        for x, y in zip(_floats(net.state.params), _floats(here.params)):
            np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-5)
        ends[scale] = _floats(net.state.params)
    assert any(not np.allclose(x, y, rtol=1e-3, atol=1e-4) for x, y in zip(ends["workers"], ends[1.0]))
