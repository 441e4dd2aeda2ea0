"""Worker side of a job: a WorkerPlugin whose comm handlers hold the per-job train state.

No numerics live here beyond calling the network's jitted steps; averaging is
:func:`dlspark.distributed._averaging.average_on_device`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import cloudpickle
import jax
import jax.numpy as jnp
import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize
from distributed.utils import sync
from distributed.worker import get_data_from_worker

from ..checkpoint import state_from_bytes, state_to_bytes
from ..data import as_dataset, load_minibatch
from ..errors import NonFiniteLossError
from ..io import write_bytes
from ..network import Network
from ._averaging import (assemble, average_on_device, average_share, is_averaged, share_bounds, share_pieces,
                         take_share)
from ._prefetch import Prefetcher

logger = logging.getLogger(__name__)

__all__ = ["DlsparkWorkerPlugin"]

_HANDLERS = ("setup", "join", "fit", "contribution", "average", "share", "state", "rng", "checkpoint", "teardown",
             "gs_push", "gs_have", "gs_sync", "gs_get", "gs_next")


def pin_process(cores) -> None:
    """Pin every thread of this process (and so every thread it starts later) to ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass


_NETWORKS: dict = {}
_NETWORKS_LOCK = threading.Lock()


def _cached_network(definition, key):
    """The same network across fits (a fit per epoch is common) reuses one Network,
    and so its compiled steps: jobs compile once, and repeated jobs not again.
    ``key`` is the client-side network's token."""
    with _NETWORKS_LOCK:
        net = _NETWORKS.get(key)
        if net is None:
            if len(_NETWORKS) >= 4:
                _NETWORKS.pop(next(iter(_NETWORKS)))
            net = _NETWORKS[key] = Network.from_definition(definition)
    return net


class _Job:
    """One job's state on one worker."""

    def __init__(self, worker, spec: dict, state_bytes: bytes, rank: int):
        self.worker = worker
        self.spec = spec
        self.master = spec["master"]
        self.net = _cached_network(spec["definition"], spec["network_token"])
        state = state_from_bytes(state_bytes, self.net.state)
        saved_rngs = spec.get("worker_rngs") or ()
        if rank < len(saved_rngs):  # resumed: this position's RNG when the checkpoint was written
            state = state.replace(rng=jnp.asarray(np.asarray(saved_rngs[rank], dtype=np.asarray(state.rng).dtype)))
        elif rank > 0:  # decorrelate dropout and the like across replicas
            state = state.replace(rng=jax.random.fold_in(state.rng, rank))
        self.state = state
        self.rank = rank
        self.treedef = jax.tree_util.tree_structure(state)
        self.sharing = None
        if self.master.algorithm == "sharing":
            from ._sharing import SharingState

            self.sharing = SharingState(self)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="dlspark-compute")
        self.contributions: dict = {}  # round -> this replica's leaves after its fit
        self.untouched: dict = {}  # round -> leaves of a replica that had no data that round, before averaging
        # round -> {(contributors, attempt): [Event, ("OK", averaged share) | ("lost", peer)]}
        self.shares: dict = {}
        self.ready: dict = {}
        self.refs = spec["refs"]
        # One loading thread for the job's life: it reads the next round's first
        # minibatches while this round is averaged.
        self.prefetch = Prefetcher(self.staged, self.master.worker_prefetch_num_batches)

    def close(self):
        self.prefetch.close()
        self.executor.shutdown(wait=False)
        # Handlers still waiting on this job (a peer's fetch of a share or a contribution)
        # end now rather than at their timeout.
        for slots in self.shares.values():
            for slot in slots.values():
                if slot[1] is None:
                    slot[1] = ("lost", None)
                slot[0].set()
        for round, event in self.ready.items():
            self.contributions.setdefault(round, None)
            event.set()

    # -- data ----------------------------------------------------------------
    def load(self, ref_index):
        ref = self.refs[ref_index]
        if isinstance(ref, str):
            loader = self.spec.get("loader")
            if loader is not None:
                return as_dataset(loader(ref), f"the loader's result for {ref!r}")
            return load_minibatch(ref, **(self.spec.get("storage_options") or {}))
        key, index = ref
        data = self.worker.data.get(key) if key in self.worker.data else None
        if data is None:
            data = sync(self.worker.loop, self._fetch_key, key)
        return data[index] if index is not None else data

    async def _fetch_key(self, key):
        holders = await self.worker.scheduler.who_has(keys=[key])
        for addr in holders.get(key, []):
            try:
                resp = await get_data_from_worker(self.worker.rpc, [key], addr, who=self.worker.address)
                if resp.get("status") == "OK" and key in resp["data"]:
                    return resp["data"][key]
            except OSError:
                continue
        raise RuntimeError(f"minibatch {key!r} is held by no live worker")

    def staged(self, ref_index):
        """A minibatch checked against the network and already on the device: ``(examples, batch)``.
        Runs on the prefetch thread, off the compute thread's path."""
        ds = self.load(ref_index)
        self.net.check_batch(ds)
        return len(ds), jax.tree_util.tree_map(jnp.asarray, ds.jit_batch())

    # -- compute (runs on the job's compute thread) -----------------------------
    def fit(self, refs, epoch, next_refs=()):
        steps = self.net.steps
        state = self.state
        if not self.master.save_updater:
            state = state.replace(opt_state=self.net.updater.init(state.params))
        state = state.replace(epoch=jnp.asarray(epoch, jnp.int32))
        losses, oks = [], []
        t0 = time.perf_counter()
        self.prefetch.expect(refs, next_refs)
        wait0 = self.prefetch.wait_time
        n_examples = 0
        base_step = int(state.step)
        for n, batch in self.prefetch.iterate(refs):
            state, loss, ok = steps.train_step(state, batch)
            losses.append(loss)
            oks.append(ok)
            n_examples += n
        # One device-to-host transfer per round, not per step.
        oks = [bool(x) for x in oks]
        if self.net.on_nonfinite == "raise" and not all(oks):
            bad = oks.index(False)
            self.state = state
            raise NonFiniteLossError(base_step + bad, float(losses[bad]))
        losses = [float(x) for x, ok in zip(losses, oks) if bool(ok)]
        self.state = state
        fit_time = time.perf_counter() - t0
        return {"loss_sum": float(sum(losses)), "n": len(losses), "examples": n_examples,
                "fit_time": fit_time, "data_wait": self.prefetch.wait_time - wait0}

    def contribution(self):
        """This replica's leaves after its fit: ``(on the device, on the host)``. The device
        leaves enter its own average without a copy; the host ones are served to peers
        (views of the same memory on a CPU device)."""
        leaves = jax.tree_util.tree_leaves(self.state)
        return leaves, [np.asarray(x) for x in leaves]

    def average_into_state(self, contributions):
        own = jax.tree_util.tree_leaves(self.state)  # its integer leaves are kept
        self.state = jax.tree_util.tree_unflatten(self.treedef, average_on_device(own, contributions))

    def set_leaves(self, leaves):
        self.state = jax.tree_util.tree_unflatten(self.treedef, jax.device_put(list(leaves)))

    def own_contribution(self, round):
        """This replica's contribution to ``round``: its device leaves until its first average
        of the round, the host ones after (so that the device holds one state, not two)."""
        device, host = self.contributions[round]
        return device if device is not None else host

    def set_floats(self, floats, pieces, values):
        """Replace the floating-point leaves ``floats`` by those ``pieces`` of ``values`` assemble."""
        leaves = jax.tree_util.tree_leaves(self.state)
        for i, x in zip(floats, assemble([leaves[i] for i in floats], pieces, values)):
            leaves[i] = x
        self.state = jax.tree_util.tree_unflatten(self.treedef, jax.device_put(leaves))

    def forget_rounds_before(self, round):
        for kept in (self.contributions, self.ready, self.untouched, self.shares):
            for r in [r for r in kept if r < round]:
                del kept[r]


def _reporting(handler):
    """Return errors as pickled bytes in the reply: the scheduler relays them to the
    client without unpickling user exception classes itself."""

    @functools.wraps(handler)
    async def wrapped(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except Exception as e:
            try:
                err = cloudpickle.dumps(e)
            except Exception:
                err = cloudpickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
            return {"status": "dlspark-error", "error": err, "text": f"{type(e).__name__}: {e}"}

    return wrapped


class DlsparkWorkerPlugin(WorkerPlugin):
    """Installs dlspark's comm handlers on every worker (present and future).

    Parameters
    ----------
    pin_cores : bool
        Pin each worker process to its own group of cores (embedded CPU
        clusters): XLA's CPU thread pool ignores thread-count flags, so this is
        how a worker gets the cores it was sized for.
    n_workers : int
        Workers sharing this machine, used to size the core groups.
    cores_per_worker : int, optional
        Size of each core group; default: the machine's cores split evenly
        among ``n_workers``.
    """

    name = "dlspark"

    def __init__(self, pin_cores: bool = False, n_workers: int = 1, cores_per_worker: int | None = None):
        self.pin_cores = pin_cores
        self.n_workers = max(1, int(n_workers))
        self.cores_per_worker = cores_per_worker

    def setup(self, worker):
        self.worker = worker
        self.jobs: dict = {}
        self.ended: collections.deque = collections.deque(maxlen=256)  # jobs torn down, newest last
        if self.pin_cores and hasattr(os, "sched_setaffinity"):
            cores = sorted(os.sched_getaffinity(0))
            per = self.cores_per_worker or max(1, len(cores) // self.n_workers)
            try:
                idx = int(worker.name) % max(1, len(cores) // per)
            except (TypeError, ValueError):
                idx = hash(worker.name) % max(1, len(cores) // per)
            pin_process(set(cores[idx * per:(idx + 1) * per]))
        for h in _HANDLERS:
            worker.handlers[f"dlspark_{h}"] = _reporting(getattr(self, f"_{h}"))

    def teardown(self, worker):
        for job in self.jobs.values():
            job.close()
        self.jobs.clear()

    def _job(self, job):
        try:
            return self.jobs[job]
        except KeyError:
            raise KeyError(f"job {job!r} is not set up on worker {self.worker.address}") from None

    async def _run(self, job, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(job.executor, fn, *args)

    # -- handlers ----------------------------------------------------------------
    async def _setup(self, job: str, spec: bytes, state: bytes, rank: int = 0):
        loop = asyncio.get_running_loop()
        new = await loop.run_in_executor(None, lambda: _Job(self.worker, cloudpickle.loads(spec), state, rank))
        if job in self.ended:  # torn down while it was being set up (the fit failed elsewhere)
            new.close()
            raise RuntimeError(f"job {job!r} ended before its set-up on worker {self.worker.address} finished")
        old = self.jobs.pop(job, None)
        if old is not None:  # set up again (a retried join): the first one's threads end here
            old.close()
        self.jobs[job] = new
        return {"status": "OK"}

    async def _join(self, job: str, source: str, spec: bytes, rank: int):
        """Set up a job on a worker that arrived mid-fit, from a live peer's current state."""
        resp = await self.worker.rpc(source).dlspark_state(job=job)
        return await self._setup(job, spec, resp["state"], rank)

    async def _fit(self, job: str, round: int, epoch: int, refs: list, next_refs: list = (),
                   average_with: list | None = None, peers: dict | None = None, links: list | None = None):
        """Fit this round's minibatches; with ``average_with``, average with those peers at once
        (one control message per round; the scheduler steps in only if a peer is lost)."""
        j = self._job(job)
        if j.sharing is not None:
            return await self._fit_sharing(j, job, epoch, refs, next_refs, peers or {}, links)
        j.forget_rounds_before(round)
        try:
            result = await self._run(j, j.fit, refs, epoch, next_refs)
            j.contributions[round] = await self._run(j, j.contribution)
        except BaseException:
            j.contributions[round] = None  # peers waiting for it learn it will not come
            if average_with and len(average_with) >= 3:  # and those waiting for its share
                slot = j.shares.setdefault(round, {}).setdefault((tuple(average_with), 0), [asyncio.Event(), None])
                if slot[1] is None:
                    slot[1] = ("lost", self.worker.address)
                slot[0].set()
            raise
        finally:
            j.ready.setdefault(round, asyncio.Event()).set()
        if average_with:
            result["averaged"] = await self._average(job, round, average_with)
        return result

    # -- gradient sharing ----------------------------------------------------------
    async def _push(self, job, sender, step, message, targets):
        me = self.worker.address
        payload = to_serialize(message)
        # One-way: no reply is written or awaited (a message lost on the way is fetched
        # at the round's sync). Half the messages on both event loops, which share the
        # cores with the steps: for the benchmark's small CNN, 63.3 against 58.1 steps/s
        # (medians of five paired runs).
        await asyncio.gather(*[self.worker.rpc(p).dlspark_gs_push(job=job, sender=sender, step=step, message=payload,
                                                                  via=me, reply=False)
                               for p in targets], return_exceptions=True)

    async def _fit_sharing(self, j, job, epoch, refs, next_refs, peers, links):
        loop = asyncio.get_running_loop()
        me = self.worker.address
        peers = {p: tuple(v) for p, v in peers.items() if p != me}
        # plain mesh: straight to every peer; tree mesh: to tree neighbours, who relay
        j.sharing.links = None if links is None else [p for p in links if p != me]
        targets = list(peers) if links is None else j.sharing.links
        j.sharing.relayed = 0

        def send(step, message):
            asyncio.run_coroutine_threadsafe(self._push(job, me, step, message, targets), loop)

        def run():
            j.state = j.state.replace(epoch=jnp.asarray(epoch, jnp.int32))
            j.prefetch.expect(refs, next_refs)
            wait0 = j.prefetch.wait_time
            t0 = time.perf_counter()
            out = j.sharing.fit(j.prefetch.iterate(refs), peers, send)
            out.update(fit_time=time.perf_counter() - t0, data_wait=j.prefetch.wait_time - wait0,
                       relayed=j.sharing.relayed)
            return out

        return await self._run(j, run)

    async def _gs_push(self, job: str, sender: str, step: int, message, via: str | None = None):
        j = self.jobs.get(job)
        if j is not None and j.sharing is not None:
            message = np.asarray(message)
            new = j.sharing.receive(sender, step, message)
            links = j.sharing.links
            if new and links:  # tree mesh: relay onwards, never back where it came from
                onward = [p for p in links if p not in (via, sender)]
                if onward:
                    j.sharing.relayed += 1
                    asyncio.ensure_future(self._push(job, sender, step, message, onward))
        return {"status": "OK"}

    async def _gs_have(self, job: str):
        return {"have": self._job(job).sharing.have(), "step": self._job(job).sharing.step}

    async def _gs_next(self, job: str):
        """Every replica has synced: forget the finished round's messages."""
        self._job(job).sharing.new_round()
        return {"status": "OK"}

    async def _gs_get(self, job: str, keys: list):
        return {"messages": to_serialize(self._job(job).sharing.get(keys))}

    async def _gs_sync(self, job: str, missing: dict):
        """Fetch the round's messages this replica missed (``{holder: [(sender, step), ...]}``), apply all."""
        j = self._job(job)
        extra, unreachable = [], []
        for holder, keys in missing.items():
            if holder == self.worker.address:
                continue
            try:
                resp = await self.worker.rpc(holder).dlspark_gs_get(job=job, keys=keys)
                messages = resp["messages"]
            except Exception as e:  # lost since it reported what it holds: the coordinator decides
                logger.info("dlspark job %s: could not fetch messages from %s: %s", job, holder, e)
                unreachable.append(holder)
                continue
            extra.extend(zip([tuple(k) for k in keys], messages))
        await self._run(j, lambda: j.sharing.apply_pending(extra))
        return {"threshold": float(j.sharing.tstate.threshold), "step": j.sharing.step,
                "threshold_state": tuple(j.sharing.tstate), "unreachable": unreachable}

    async def _contribution(self, job: str, round: int, share: list | None = None):
        """This replica's leaves after its fit in ``round``; with ``share=[lo, hi]``, only
        that flat range of its floating-point elements (see :func:`share_pieces`)."""
        j = self._job(job)
        ev = j.ready.setdefault(round, asyncio.Event())
        await asyncio.wait_for(ev.wait(), timeout=600)
        contribution = j.contributions.get(round)
        if contribution is None:
            return {"status": "no-contribution"}
        leaves = contribution[1]
        if share is not None:
            floats = [x for x in leaves if is_averaged(x)]
            leaves = take_share(floats, share_pieces([x.size for x in floats], *share))
        return {"status": "OK", "leaves": to_serialize(leaves)}

    async def _share(self, job: str, round: int, contributors: list, attempt: int = 0):
        """This replica's averaged share of ``round`` over ``contributors``, once it has it."""
        key = (tuple(contributors), attempt)
        slot = self._job(job).shares.setdefault(round, {}).setdefault(key, [asyncio.Event(), None])
        await asyncio.wait_for(slot[0].wait(), timeout=600)
        status, value = slot[1]
        if status != "OK":
            return {"status": "lost", "peer": value}
        return {"status": "OK", "values": to_serialize(value)}

    async def _average_in_shares(self, j, job, round, contributors, attempt, t0):
        """The mean over three or more contributors, in shares (see ``_averaging``): this
        replica averages its own share, if it is a contributor, then fetches the others'."""
        me = self.worker.address
        n = len(contributors)
        leaves = jax.tree_util.tree_leaves(j.state)  # shapes and dtypes; its integer leaves are kept
        floats = [i for i, x in enumerate(leaves) if is_averaged(x)]
        sizes = [leaves[i].size for i in floats]
        slot = j.shares.setdefault(round, {}).setdefault((tuple(contributors), attempt), [asyncio.Event(), None])
        nbytes = 0
        if me in contributors and slot[1] is None:
            try:
                bounds = share_bounds(sizes, n, contributors.index(me))
                pieces = share_pieces(sizes, *bounds)
                parts = []
                for addr in contributors:
                    if addr == me:
                        host = j.contributions[round][1]
                        parts.append(take_share([host[i] for i in floats], pieces))
                        continue
                    try:
                        resp = await self.worker.rpc(addr).dlspark_contribution(job=job, round=round,
                                                                                share=list(bounds))
                    except OSError:
                        resp = {}
                    if resp.get("status") != "OK":
                        slot[1] = ("lost", addr)  # peers waiting for this share learn whom to drop
                        return {"lost_peer": addr}
                    parts.append(list(resp["leaves"]))
                    nbytes += sum(np.asarray(x).nbytes for x in parts[-1])
                slot[1] = ("OK", await self._run(j, average_share, parts))
            finally:
                if slot[1] is None:  # failed here: its waiters must not wait for their timeout
                    slot[1] = ("lost", me)
                slot[0].set()
        elif me in contributors and slot[1][0] != "OK":
            return {"lost_peer": slot[1][1]}
        t_fetch = time.perf_counter() - t0
        all_pieces, all_values = [], []
        for k, addr in enumerate(contributors):
            if addr == me:
                values = slot[1][1]
            else:
                try:
                    resp = await self.worker.rpc(addr).dlspark_share(job=job, round=round, contributors=contributors,
                                                                     attempt=attempt)
                except OSError:
                    resp = {"peer": addr}
                if resp.get("status") != "OK":
                    return {"lost_peer": resp.get("peer", addr)}
                values = list(resp["values"])
                nbytes += sum(np.asarray(x).nbytes for x in values)
            all_pieces += share_pieces(sizes, *share_bounds(sizes, n, k))
            all_values += values
        await self._run(j, j.set_floats, floats, all_pieces, all_values)
        if j.contributions.get(round) is not None:  # averaged: its device copy is no longer needed
            j.contributions[round] = (None, j.contributions[round][1])
        return {"avg_time": time.perf_counter() - t0, "fetch_time": t_fetch, "bytes_received": nbytes,
                "contributors": contributors}

    async def _average(self, job: str, round: int, contributors: list, attempt: int = 0):
        """Average this round's contributions, fetched from the peers that hold them.

        The result depends on stored inputs only, never on the state an earlier call
        left, so calling it again with fewer contributors (one was lost) is safe: the
        contributions themselves, or, with none left, the state this replica had before
        the round's averaging. A peer whose contribution cannot be had is named in
        ``lost_peer`` and nothing changes here. ``attempt`` numbers the coordinator's
        calls in a round, so that averaging again over the same contributors (the
        failure passed) does not reuse a share that failed.
        """
        j = self._job(job)
        t0 = time.perf_counter()
        if round not in j.contributions:  # no data this round: keep what the round started from
            j.forget_rounds_before(round)
            j.untouched.setdefault(round, [np.asarray(x) for x in jax.tree_util.tree_leaves(j.state)])
        contributors = list(contributors)  # a tuple when it came over the wire
        if contributors == [self.worker.address] and j.contributions.get(round) is not None:
            # Sole contributor: the mean is its own state after its fit.
            await self._run(j, j.set_leaves, j.own_contribution(round))
            return {"avg_time": time.perf_counter() - t0, "fetch_time": 0.0, "bytes_received": 0,
                    "contributors": contributors}
        if not contributors and round in j.untouched:
            # Every contributor was lost: the round trained nothing. (A replica that fit
            # this round is among the contributors for as long as it lives.)
            await self._run(j, j.set_leaves, j.untouched[round])
            return {"avg_time": time.perf_counter() - t0, "fetch_time": 0.0, "bytes_received": 0,
                    "contributors": contributors}
        if len(contributors) >= 3:
            return await self._average_in_shares(j, job, round, contributors, attempt, t0)
        contribs = []
        nbytes = 0
        for addr in contributors:
            if addr == self.worker.address:
                contribs.append(j.own_contribution(round))
                continue
            try:
                resp = await self.worker.rpc(addr).dlspark_contribution(job=job, round=round)
            except OSError:
                resp = {}
            if resp.get("status") != "OK":
                return {"lost_peer": addr}
            leaves = resp["leaves"]
            nbytes += sum(np.asarray(x).nbytes for x in leaves)
            contribs.append(leaves)
        t_fetch = time.perf_counter() - t0
        await self._run(j, j.average_into_state, contribs)
        if j.contributions.get(round) is not None:  # averaged: its device copy is no longer needed
            j.contributions[round] = (None, j.contributions[round][1])
        return {"avg_time": time.perf_counter() - t0, "fetch_time": t_fetch, "bytes_received": nbytes,
                "contributors": contributors}

    async def _state(self, job: str, step: int | None = None, epoch: int | None = None):
        j = self._job(job)

        def dump():
            st = j.state
            if step is not None:
                st = st.replace(step=jnp.asarray(step, jnp.int32))
            if epoch is not None:
                st = st.replace(epoch=jnp.asarray(epoch, jnp.int32))
            return state_to_bytes(st)

        return {"state": await self._run(j, dump)}

    async def _rng(self, job: str):
        j = self._job(job)
        return {"rng": await self._run(j, lambda: np.asarray(j.state.rng).tolist())}

    async def _checkpoint(self, job: str, url: str, step: int, epoch: int, progress: dict,
                          worker_rngs: list | None = None, threshold_states: dict | None = None):
        """Write this worker's state; ``worker_rngs`` (every live worker's RNG, in the order
        rounds are assigned) lets a resumed fit give each worker the dropout stream it had,
        and ``threshold_states`` (gradient sharing: the algorithm and each worker's state)
        the threshold they had reached."""
        j = self._job(job)

        def write():
            st = j.state.replace(step=jnp.asarray(step, jnp.int32), epoch=jnp.asarray(epoch, jnp.int32))
            extra = {"iteration": step, "epoch": epoch, "seed": j.net.seed, "fit_progress": progress,
                     "worker_rngs": worker_rngs, "threshold_states": threshold_states}
            write_bytes(url, state_to_bytes(st, extra, j.net.definition()), **(j.spec.get("checkpoint_options") or {}))

        await self._run(j, write)
        return {"status": "OK"}

    async def _teardown(self, job: str):
        self.ended.append(job)
        j = self.jobs.pop(job, None)
        if j is not None:
            j.close()
        return {"status": "OK"}
