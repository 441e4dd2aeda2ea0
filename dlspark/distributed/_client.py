"""The client side of a job: set it up on the workers, start it in the scheduler, wait,
bring the trained state back, and resume from checkpoints.

Algorithm-specific work goes through the master's hooks (``resume_state``,
``after_fit``, ``compare_replicas``); nothing here asks which algorithm runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import asdict

import cloudpickle
import numpy as np
from distributed.protocol import to_serialize

from .._mesh import divergence, is_averaged, stitch_owners
from ..checkpoint import read_checkpoint_meta, state_from_arrays, state_to_arrays
from ..errors import CheckpointError, JobFailedError
from ._kept import continuing, pull_arrays, sent_bytes, state_digests, thin
from ._messages import WORKER_EVENTS, JobOptions, JobSpec

logger = logging.getLogger(__name__)

__all__ = ["run_fit", "setup_workers", "fetch_state", "fetch_state_from_any", "checked", "install_plugins",
           "check_fit_args"]


def _plugins_installed(dask_scheduler=None):
    from ._scheduler import DlsparkSchedulerPlugin
    from ._worker import DlsparkWorkerPlugin

    return {"scheduler": DlsparkSchedulerPlugin.name in dask_scheduler.plugins,
            "worker": DlsparkWorkerPlugin.name in dask_scheduler.worker_plugins}


def install_plugins(client, pin: bool):
    """Register dlspark's scheduler and worker plugins once per cluster (``pin``: pin each
    worker process to its own cores, for embedded CPU clusters)."""
    from ._scheduler import DlsparkSchedulerPlugin
    from ._worker import DlsparkWorkerPlugin

    have = client.run_on_scheduler(_plugins_installed)
    if not have["scheduler"]:
        client.register_plugin(DlsparkSchedulerPlugin())
    if not have["worker"]:
        client.register_plugin(DlsparkWorkerPlugin(pin_cores=pin, n_workers=len(client.scheduler_info()["workers"])))


def check_epochs_and_checkpoints(epochs, checkpoint_every, checkpoint_url):
    """A fit's ``epochs``, and ``checkpoint_every`` and ``checkpoint_url`` (both or neither; a
    local URL must be writable), as both trainers take them."""
    from .._validate import positive_int
    from ..io import check_writable

    positive_int("epochs", epochs)
    if checkpoint_url is not None and checkpoint_every is None:
        raise ValueError("checkpoint_url needs checkpoint_every, the rounds between two checkpoints, e.g. "
                         "fit(data, checkpoint_every=10, checkpoint_url=...); without it no checkpoint is written")
    if checkpoint_every is not None:
        positive_int("checkpoint_every", checkpoint_every)
        if not checkpoint_url:
            raise ValueError("checkpoint_every needs checkpoint_url, e.g. fit(data, checkpoint_every=10, checkpoint_url='s3://b/ck.dls')")
        check_writable(checkpoint_url, "checkpoint_url")


def check_fit_args(master, epochs, checkpoint_every, checkpoint_url):
    from ..data._sources import reject_memory

    if master is None:
        raise ValueError("this trainer has no master; pass one, e.g. DistributedTrainer(client, net, ParameterAveraging())")
    check_epochs_and_checkpoints(epochs, checkpoint_every, checkpoint_url)
    if checkpoint_every is not None:  # written by worker processes
        reject_memory(checkpoint_url, "checkpoint_url")


def _progress_bar(show, total):
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="batch", desc="dlspark fit")


def checked(resp):
    """A worker's reply, or the error its envelope carries, raised here."""
    if isinstance(resp, dict) and "error" in resp:
        raise resp["error"].exception()
    return resp


async def setup_workers(client, workers, job, spec: bytes, state: dict, kept: dict | None = None, own=(),
                        ended: dict | None = None) -> int:
    """Set the job up on ``workers``; ``state``: the train state as :func:`state_to_arrays` gives it.

    ``kept``: ``{worker: (key, digests)}`` of the states workers kept from the last fit (see
    ``_kept``): such a worker is sent only the arrays that differ from its own, and everything
    if it no longer holds them. ``state["carried"]``: arrays pulled out of ``spec`` (see
    ``_kept.pull_arrays``). ``own``: indices of the state's arrays that a replica which goes on
    from the last fit takes from what it kept (its updater state, where the algorithm keeps one
    per replica), when ``state`` is the very state the last fit ended with: one a worker kept, or
    the one of digests ``ended`` that the last fit combined from the replicas. Returns the bytes
    sent (the spec and the arrays)."""
    kept = {w: k for w, k in (kept or {}).items() if w in workers and k[1] is not None}
    mine = await asyncio.get_running_loop().run_in_executor(None, state_digests, state) if kept else None
    same = kept and (continuing(mine, kept) or (ended is not None and mine == ended))
    own = frozenset(own) if same and own else frozenset()

    async def one(rank, w):
        if w in kept:
            thinned = thin(state, mine, *kept[w], own=own)
            r = checked(await client.rpc(w).dlspark_setup(job=job, spec=spec, state=to_serialize(thinned), rank=rank))
            if not r.get("missing"):
                return len(spec) + sent_bytes(thinned)
        checked(await client.rpc(w).dlspark_setup(job=job, spec=spec, state=to_serialize(state), rank=rank))
        return len(spec) + sent_bytes(state)

    return sum(await asyncio.gather(*[one(i, w) for i, w in enumerate(workers)]))


def replica_arrays(master, state: dict) -> list:
    """Indices of ``state``'s arrays (``state_to_arrays``) that each replica keeps as its own from
    fit to fit under ``master``: those of its ``replica_fields`` (the updater state's, for an
    algorithm whose replicas each run their own updater), for an algorithm whose replicas go on
    where they stopped (``replicas_continue``); else none."""
    if not master.replicas_continue():
        return []
    return sorted({i for field in master.replica_fields() for i in _leaves_under(state, field)})


def _leaves_under(state: dict, field: str) -> list:
    """Indices of ``state``'s arrays (``state_to_arrays``) that lie under the train state's ``field``."""
    return [i for i, leaf in enumerate(state["leaves"]) if leaf["path"].startswith(field)]


def _own_updater_arrays(state: dict) -> list:
    """Indices of ``state``'s updater-state arrays of a floating-point dtype (each replica's own
    where replicas keep their own updaters; the step counts are left out)."""
    import jax.numpy as jnp

    return [i for i in _leaves_under(state, ".opt_state") if is_averaged(jnp.dtype(state["leaves"][i]["dtype"]))]


async def fetch_state(client, worker, job, step, epoch) -> dict:
    """``{"state": the train state as state_to_arrays gives it, "carried": what the algorithm
    carries}`` of one worker."""
    return checked(await client.rpc(worker).dlspark_state(job=job, step=step, epoch=epoch))


async def fetch_state_from_any(client, workers, job, step, epoch):
    """``(worker, state)`` from the first of ``workers`` that sends its state: every replica
    holds the trained state at the end of a job (bit for bit with averaging, to float
    tolerance with gradient sharing), so a worker lost just after the job ended costs nothing."""
    errors = []
    for worker in workers:
        try:
            return worker, await fetch_state(client, worker, job, step, epoch)
        except Exception as e:
            errors.append(f"{worker}: {type(e).__name__}: {e}")
    raise JobFailedError(f"job {job} finished, but no worker could send its state: {'; '.join(errors)}")


def _resume(trainer, url, epochs, n_minibatches, storage_options=None):
    """``(epochs left, minibatches done, worker RNGs, epochs done, algorithm state)``. Everything
    is checked before the network takes the checkpoint's state: a refused resume leaves it as it was.
    ``n_minibatches``: the resumed fit's minibatches an epoch, which must be the checkpoint's."""
    opts = storage_options or {}
    meta = read_checkpoint_meta(url, **opts)
    prog = meta.get("fit_progress")
    if prog is not None and prog.get("epochs_total") != epochs:
        raise CheckpointError(url, f"was written by a fit of {prog.get('epochs_total')} epochs; resume with epochs={prog.get('epochs_total')}")
    if prog is not None and prog.get("minibatches", n_minibatches) != n_minibatches:
        # the minibatches it marks as done are positions in its own data: in other data they
        # would skip minibatches never trained
        raise CheckpointError(url, f"was written by a fit of {prog['minibatches']} minibatches an epoch, and this "
                                   f"fit's data makes {n_minibatches}: resume with the data (and batch size) the "
                                   "checkpoint's fit had, or start a new fit from it with "
                                   "network.restore(url) and no resume_from")
    rngs = meta.get("worker_rngs") or []
    want = np.shape(np.asarray(trainer.network.state.rng))
    if any(np.shape(r) != want for r in rngs):
        raise CheckpointError(url, f"holds worker RNG keys of shape {np.shape(rngs[0])}, this network's are "
                                   f"{want}: resume with the PRNG implementation that wrote it")
    algorithm_state = trainer.master.resume_state(meta, url, trainer.network, storage_options=opts)
    trainer.network.restore(url, **opts)
    if prog is None:
        return epochs, (), None, 0, algorithm_state
    # The fit goes on where the checkpoint stands: ``prog["epoch"]`` of ``epochs`` done,
    # and ``done`` minibatches of the next one.
    return epochs - prog["epoch"], prog["done"], rngs, prog["epoch"], algorithm_state


def check_data(net, refs, loader, storage_options) -> None:
    """What can be checked before any cluster work: there is data, and the first minibatch
    file fits the network (named when it does not). Every other minibatch is checked as a
    worker loads it (``_run.check_minibatch``)."""
    from ..data import load_ref
    from ._run import check_minibatch

    if not refs:
        raise ValueError("the data holds no examples: fit needs at least one minibatch, got an empty dataset")
    if isinstance(refs[0], str):
        check_minibatch(net, load_ref(refs[0], loader, storage_options), repr(refs[0]))


def run_fit(trainer, refs, partitions, epochs, *, loader=None, storage_options=None, checkpoint_every=None,
            checkpoint_url=None, resume_from=None, callbacks=(), progress=None, export_span=None):
    """Run one fit as a job on ``trainer``'s cluster; the trained state lands in ``trainer.network``.
    ``export_span``: when the data's export began and ended (for the statistics)."""
    from ..stats._collect import ClientSide, NoClientSide

    master = trainer.master
    check_data(trainer.network, refs, loader, storage_options)
    skip, worker_rngs, epochs_done, epochs_total = (), None, 0, epochs
    if resume_from is not None:
        epochs, skip, worker_rngs, epochs_done, carried = _resume(trainer, resume_from, epochs, len(refs), storage_options)
        trainer.algorithm_state = carried
        if epochs <= 0:  # the checkpoint's fit was finished: nothing to train
            trainer.last_fit_stats = trainer.last_fit_events = []
            return trainer.network
    net, client = trainer.network, trainer.client
    workers = trainer._workers()
    # the job's master: what depends on the number of replicas settled for these workers
    master = master.for_workers(len(workers))
    job = uuid.uuid4().hex[:12]
    def job_spec(algorithm_state):
        return cloudpickle.dumps(JobSpec(net.definition(), net.token, master, refs, loader, storage_options,
                                         algorithm_state, worker_rngs, checkpoint_options=storage_options))

    # the scheduler keeps the whole spec (for workers that join mid-fit); the workers' copy leaves
    # out the arrays of what the algorithm carries, which travel with the state, thinned alike
    spec = job_spec(dict(trainer.algorithm_state))
    pulled, carried = pull_arrays(dict(trainer.algorithm_state))
    state = state_to_arrays(net.state)
    setup_spec = spec
    if carried:
        setup_spec, state["carried"] = job_spec(pulled), carried
    base_step, base_epoch = net.iteration, net.epoch
    options = JobOptions(epochs=epochs, skip=tuple(skip), base_step=base_step, base_epoch=base_epoch,
                         epochs_total=epochs_total, epochs_done=epochs_done, checkpoint_every=checkpoint_every,
                         checkpoint_url=checkpoint_url, **master.job_options())
    bar = _progress_bar(trainer.progress if progress is None else progress, epochs * len(refs) - len(skip))

    seen = []  # what happened to the workers, as it arrives: the record of a fit that fails

    def on_event(event):
        _, msg = event
        if msg.get("event") != "round":
            if msg.get("event") in WORKER_EVENTS:
                seen.append(msg)
            _log_worker_event(job, msg)
            return
        if bar is not None:
            bar.update(msg["minibatches"])
            if msg["loss"] is not None:
                bar.set_postfix(loss=f"{msg['loss']:.4g}", ex_s=f"{msg['examples'] / max(msg['round_time'], 1e-9):.0f}",
                                refresh=False)
        for cb in callbacks:
            cb(msg)

    topic = f"dlspark-{job}"
    trainer.last_fit_events = seen
    client.subscribe_topic(topic, on_event)
    lost = False
    try:
        st = ClientSide(client, export_span) if master.collect_training_stats else NoClientSide()
        with st.span("broadcast") as span:
            # replicas go on from the last fit only under the same master (a threshold or an updater
            # state reached under another is not this one's)
            own = replica_arrays(master, state) if trainer._kept_master == master else []
            sent = client.sync(setup_workers, client, workers, job, setup_spec, state, trainer._kept_states, own,
                               trainer._ended)
            if hasattr(span, "fields"):
                span.fields["bytes"] = sent
        run = dict(job=job, workers=workers, spec=spec, partitions=partitions, master=cloudpickle.dumps(master),
                   options=asdict(options), client=client.id)
        if master.collect_training_stats:  # the start and the wait, each timed on its own
            with st.span("start"):
                client.sync(client.scheduler.dlspark_start, **run)
            with st.span("wait"):
                result = checked(client.sync(client.scheduler.dlspark_wait, job=job))["result"]
        else:  # one call: the scheduler starts the job and answers when it is done
            result = checked(client.sync(client.scheduler.dlspark_start, wait=True, **run))["result"]
        step, epoch = base_step + result.trained, base_epoch + epochs
        with st.span("fetch_state"):
            source, final, apart, trainer._kept_states = client.sync(
                _fit_end, client, list(result.workers), job, step, epoch, master.compare_replicas(),
                [a.nbytes for a in state["arrays"]],
                _leaves_under(state, ".params"), master.end_params if master.final_mean() else None,
                _own_updater_arrays(state))
            trainer._kept_master = master
        net.state = state_from_arrays(final["state"], net.state, f"the state from worker {source}")
        trainer.algorithm_state = master.after_fit(trainer.algorithm_state, result, final["carried"], trainer.published)
        trainer._ended = None
        if master.final_mean() and len(result.workers) > 1:  # combined and stitched: no worker holds it
            carried = pull_arrays(dict(trainer.algorithm_state))[1]
            trainer._ended = state_digests({"arrays": final["state"]["arrays"], "carried": carried or []})
        if apart is not None:
            trainer.published["replica_divergence"] = apart
        for s in result.stats:
            trainer.loss_history.append((s["round"], base_epoch + s["epoch"], s["loss"]))
        if master.collect_training_stats:
            trainer.training_stats.add(st.finish(job, master.name, result.stats, workers))
        trainer.last_fit_stats = list(result.stats)
        trainer.last_fit_events = list(result.events)
    except OSError as e:  # Dask's CommClosedError is one
        if not _scheduler_lost(client):
            raise
        lost = True
        raise JobFailedError(
            f"the connection to the scheduler at {client.scheduler.address} was lost during the fit "
            f"({type(e).__name__}: {e}); the job died with the scheduler. Start a cluster again and go on from "
            f"the last checkpoint: fit(..., resume_from={checkpoint_url or 'the checkpoint_url'!r})") from e
    finally:
        client.unsubscribe_topic(topic)
        try:
            if not lost and client.status == "running":  # a lost scheduler has nothing left to clean
                client.sync(client.scheduler.dlspark_finish, job=job)
        except Exception:  # the cluster is going away; nothing left to clean
            pass
        if bar is not None:
            bar.close()
    return net


def _log_worker_event(job, msg) -> None:
    """Say what happened to a worker of the fit (the job's coordinator sent ``msg``), as it happens."""
    kind, worker, left = msg.get("event"), msg.get("worker"), msg.get("workers")
    if kind == "lost":
        logger.warning("dlspark job %s: worker %s was lost in round %s; training goes on with %s worker(s), its "
                       "unfinished minibatches trained by them", job, worker, msg.get("round"), left)
    elif kind == "joined":
        logger.info("dlspark job %s: worker %s joined after round %s; %s worker(s) train", job, worker,
                    msg.get("round"), left)
    elif kind == "join-failed":
        logger.warning("dlspark job %s: worker %s could not join: %s", job, worker, msg.get("error"))
    elif kind == "partitioned":
        logger.warning("dlspark job %s: worker %s was dropped after round %s: %s cannot reach it while the "
                       "coordinator reaches both; training goes on with %s worker(s)", job, worker, msg.get("round"),
                       ", ".join(msg.get("unreachable_from", ())), left)


def _scheduler_lost(client, within: float = 2.0) -> bool:
    """Whether ``client`` lost its scheduler: a call that failed with a closed connection
    may be seen a moment before the client itself notices (its status leaves "running").
    Until it does, a call to the scheduler would retry the refused connection for the
    client's whole connect timeout, so the fit's clean-up must not make one."""
    deadline = time.monotonic() + within
    while client.status == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.status != "running"


async def _replica_differences(client, job, source, others):
    """``source``'s largest parameter difference from each of ``others``: ``source`` fetches their
    parameters (not their whole state) and reduces each difference itself; one number per
    other replica comes back, no state. A replica lost since the job ended gives None."""
    async def one(w):
        try:
            return checked(await client.rpc(source).dlspark_divergence(job=job, source=w))["reply"]
        except Exception:  # lost since the job ended: it has nothing left to compare
            return None

    return await asyncio.gather(*[one(w) for w in others])


async def _keep_states(client, workers, job, step, epoch) -> dict:
    """``{worker: (job, digests)}``: every replica keeps its trained state for the next fit (see
    ``_kept``); a replica that cannot is left out (the next fit sends it everything)."""
    async def one(w):
        try:
            return w, (job, checked(await client.rpc(w).dlspark_keep(job=job, step=step, epoch=epoch))["digests"])
        except Exception:  # lost since the job ended
            return w, None

    return {w: k for w, k in await asyncio.gather(*[one(w) for w in workers]) if k is not None and k[1] is not None}


def split_fetch(kept: dict, workers, sizes, params=()) -> dict | None:
    """Where to fetch the final state's arrays from when replicas hold the same bits:
    ``{worker: [array indices]}``, each array from one of the workers whose kept digest of it
    equals the source's (the first of ``workers`` that kept its state), the bytes spread over
    them, largest arrays first (``sizes``: bytes per array). None when that spreads nothing (one
    holder of everything, or no digests). ``params``: the parameters' indices; a plan is made
    only when every worker's parameters equal the source's (their divergence is then 0)."""
    holders = [w for w in workers if w in kept]
    if len(holders) < 2 or len(holders) != len(workers):  # every replica's digests, or no claim on them
        return None
    source, mine = holders[0], kept[holders[0]][1]["arrays"]
    if len(mine) != len(sizes) or any(kept[w][1]["arrays"][i] != mine[i] for w in holders[1:] for i in params):
        return None
    load = {w: 0 for w in holders}
    plan: dict = {w: [] for w in holders}
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        have = [w for w in holders if kept[w][1]["arrays"][i] == mine[i]]
        w = min(have, key=lambda h: (load[h], h != source))
        plan[w].append(i)
        load[w] += sizes[i]
    return {w: sorted(ix) for w, ix in plan.items() if ix} if sum(1 for ix in plan.values() if ix) > 1 else None


async def _fetch_shares(client, job, step, epoch, plan: dict, source: str):
    """``(replies, arrays)``: every worker of ``plan`` sends, all at once, the arrays of its final
    state that ``plan`` names (``{worker: [array indices]}``; ``source`` also what the algorithm
    carries); ``replies`` by worker, and ``arrays`` the state's arrays, each from a worker that
    sent it (None where none did)."""
    async def one(w):
        return w, checked(await client.rpc(w).dlspark_state(job=job, step=step, epoch=epoch,
                                                             only=sorted(plan.get(w, [])), carried=w == source))

    got = dict(await asyncio.gather(*[one(w) for w in plan if w != source], one(source)))
    arrays = list(got[source]["state"]["arrays"])
    for w, r in got.items():
        for i in plan.get(w, []):
            arrays[i] = r["state"]["arrays"][i]
    return got, arrays


async def _fetch_split(client, job, step, epoch, plan: dict, source: str) -> dict:
    """The final state as :func:`fetch_state` gives it, its arrays from the workers of ``plan``
    at once (what the algorithm carries from ``source``, the first of them)."""
    got, arrays = await _fetch_shares(client, job, step, epoch, plan, source)
    if any(a is None for a in arrays):
        raise RuntimeError("a split fetch left arrays of the final state unfetched")
    return {"state": dict(got[source]["state"], arrays=arrays), "carried": got[source]["carried"]}


async def _stitched_state(client, workers, job, step, epoch, sizes, params, own, combine):
    """``(source, state, divergence)`` of a fit ending with ``combine`` of the replicas'
    parameters (see :func:`_combined_state`), its arrays from every worker at once: each sends
    its parameters, and each array of ``own`` (the updater state's floating-point arrays, each
    replica's own) comes from the one worker :func:`~dlspark._mesh.stitch_owners` names, as the
    ParallelWrapper takes it; every other array, and what the algorithm carries, from the first
    worker, the source. So no link carries a whole state. Raises when a worker is lost since."""
    source = workers[0]
    plan = {w: list(params) for w in workers}
    for i, r in zip(own, stitch_owners([sizes[i] for i in own], sum(sizes[i] for i in params), len(workers))):
        plan[workers[r]].append(i)
    plan[source] += sorted(set(range(len(sizes))) - set(params) - set(own))
    got, arrays = await _fetch_shares(client, job, step, epoch, plan, source)
    replicas = [[got[w]["state"]["arrays"][i] for i in params] for w in workers]
    for i, a in zip(params, combine(replicas)):
        arrays[i] = np.asarray(a, dtype=np.asarray(arrays[i]).dtype)
    if any(a is None for a in arrays):
        raise RuntimeError("a stitched fetch left arrays of the final state unfetched")
    final = got[source]
    return source, {**final, "state": dict(final["state"], arrays=arrays)}, divergence(replicas)


async def _fit_end(client, workers, job, step, epoch, compare: bool, sizes=None, params=(), combine=None, own=()):
    """``(source, state, divergence, kept)``: every replica keeps its state (:func:`_keep_states`),
    then the client takes the source's. Where other replicas hold arrays of it bit for bit (the
    kept digests say which), each array comes from one of its holders, so that the bytes leave
    over several links at once; otherwise, with ``combine`` (the master's ``end_params``),
    :func:`_stitched_state` (or, a worker lost since, :func:`_combined_state`), else
    :func:`_final_state` (``sizes``: bytes per array of the state; ``params``: the parameters'
    indices among them; ``own``: the updater state's floating-point arrays' indices)."""
    kept = await _keep_states(client, workers, job, step, epoch)
    plan = None if sizes is None else split_fetch(kept, workers, sizes, params)
    if plan is not None:
        source = next(w for w in workers if w in kept)
        try:
            final = await _fetch_split(client, job, step, epoch, plan, source)
        except Exception as e:  # a holder lost since: the whole state from any replica
            logger.info("dlspark job %s: a split fetch of the final state failed (%s); fetching it whole", job, e)
        else:
            # every replica's parameters are the source's bit for bit (split_fetch checked)
            return source, final, (0.0 if compare else None), kept
    if combine is not None and len(workers) > 1 and params:
        if sizes is not None:
            try:
                return (*await _stitched_state(client, workers, job, step, epoch, sizes, params, own, combine), kept)
            except Exception as e:  # a worker lost since: the first live one's state, the others' parameters
                logger.info("dlspark job %s: a stitched fetch of the final state failed (%s); fetching it from "
                            "the first worker that answers", job, e)
        return (*await _combined_state(client, workers, job, step, epoch, params, combine), kept)
    ended = await _final_state(client, workers, job, step, epoch, compare)
    return (*ended, kept)


async def _combined_state(client, workers, job, step, epoch, params, combine):
    """``(source, state, divergence)``: the first worker's state with ``combine`` of every replica's
    parameters (``params``: their indices among the state's arrays; ``combine`` takes each
    replica's list of them, in address order, as the ParallelWrapper's devices stand) in place
    of its own, and the largest difference of a replica's parameters from the source's. The
    other workers send their parameters alone, while the source sends its state; a worker lost
    since the job ended is left out."""
    async def leaves(w):
        try:
            return checked(await client.rpc(w).dlspark_state(job=job, params=True))["params"]
        except Exception:  # lost since the job ended: the others are combined
            return None

    taken, *others = await asyncio.gather(fetch_state_from_any(client, workers, job, step, epoch),
                                          *[leaves(w) for w in workers[1:]])
    source, final = taken
    arrays = list(final["state"]["arrays"])
    mine = [arrays[i] for i in params]
    by_worker = {source: mine}
    if source == workers[0]:  # else the first was lost meanwhile: the source's own parameters
        by_worker.update({w: p for w, p in zip(workers[1:], others) if p is not None})
    for i, a in zip(params, combine([by_worker[w] for w in sorted(by_worker)])):
        arrays[i] = np.asarray(a, dtype=np.asarray(arrays[i]).dtype)
    others = [p for w, p in by_worker.items() if w != source]
    return source, {**final, "state": dict(final["state"], arrays=arrays)}, divergence([mine, *others])


async def _final_state(client, workers, job, step, epoch, compare: bool):
    """``(source, its state, replica divergence or None)``. The comparison runs while the state
    comes to the client, on the other link direction: ``workers[0]``, the replica the client
    takes, receives its peers' parameters while it sends its state."""
    if not compare or len(workers) < 2:
        source, final = await fetch_state_from_any(client, workers, job, step, epoch)
        return source, final, (0.0 if compare else None)
    taken, found = await asyncio.gather(fetch_state_from_any(client, workers, job, step, epoch),
                                        _replica_differences(client, job, workers[0], workers[1:]))
    source, final = taken
    if source != workers[0]:  # the first was lost meanwhile: compare against the one taken
        found = await _replica_differences(client, job, source, [w for w in workers if w != source])
    return source, final, max((d for d in found if d is not None), default=0.0)
