"""A job's run on one worker: what every algorithm's worker side shares.

:class:`WorkerRun` holds the job's train state, its network (from the one
worker-side cache, so jobs of the same network compile once), a compute thread,
and a prefetcher that loads minibatches through the one reference resolver.
It answers the orders every algorithm needs (``rng``, ``checkpoint``) and the
state requests of the client and of joiners. An algorithm subclasses it with
its ``fit`` and its own orders and peer requests (see ``dlspark.algorithms``);
the worker plugin routes to it by job id.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from .. import config
from .._netcache import cached_network
from ..checkpoint import fit_checkpoint_bytes, state_from_arrays, state_to_arrays
from ..data import load_ref
from ..errors import CorruptMinibatchError
from ..io import write_bytes
from ..stats._recorder import NULL, Recorder
from ._messages import Ack, CheckpointOrder, Order, RngOrder, RngReply
from ._prefetch import Prefetcher

__all__ = ["WorkerRun"]


def check_minibatch(net, ds, name: str) -> None:
    """``net.check_batch(ds)`` with the minibatch named in the message; under
    ``on_nonfinite="raise"`` non-finite features are refused here too, by name, before a
    step turns them into a non-finite loss that no longer says where it came from."""
    try:
        net.check_batch(ds)
    except (ValueError, TypeError) as e:
        raise type(e)(f"minibatch {name}: {e}") from None
    if net.on_nonfinite != "raise":
        return
    for x in jax.tree_util.tree_leaves(ds.features):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
            bad = int(x.size - np.count_nonzero(np.isfinite(x)))
            raise ValueError(f"minibatch {name} holds {bad} non-finite feature values (NaN or inf); clean the data, "
                             "or train with Network(..., on_nonfinite='skip') to skip the steps they spoil")


class WorkerRun:
    """One job's state on one worker.

    Subclasses define ``order_<op>(order)`` coroutines for their orders,
    ``peer_<op>(**kw)`` coroutines for requests from peers and, where a notice
    matters to them, ``notice_<kind>(notice)`` methods (called on the event loop).
    """

    def __init__(self, worker, job: str, spec, state: dict, rank: int):
        t_setup = time.time()
        # the job's statistics (dlspark.stats): a recorder that does nothing when they are off
        self.stats = Recorder() if spec.master.collect_training_stats else NULL
        self.stats.bind()
        self.worker = worker
        self.job = job
        self.spec = spec
        self.master = spec.master
        self.rank = rank
        self.net = cached_network(spec.definition, spec.network_token)
        state = state_from_arrays(state, self.net.state, f"job {job}'s state")
        saved_rngs = spec.worker_rngs or ()
        if rank < len(saved_rngs):  # resumed: this position's RNG when the checkpoint was written
            state = state.replace(rng=jnp.asarray(np.asarray(saved_rngs[rank], dtype=np.asarray(state.rng).dtype)))
        elif rank > 0:  # decorrelate dropout and the like across replicas
            state = state.replace(rng=jax.random.fold_in(state.rng, rank))
        self.state = state
        self.treedef = jax.tree_util.tree_structure(state)
        self.on_cpu = all(d.platform == "cpu" for d in jax.tree_util.tree_leaves(state)[0].devices())
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="dlspark-compute", initializer=self.stats.bind)
        # One loading thread for the job's life: it reads the next round's first
        # minibatches while this round is still being combined.
        self.prefetch = Prefetcher(self.staged, self.master.prefetch_depth)
        self.stats.unbind()
        self.stats.add("setup", t_setup, time.time())
        self.stats.start_idle()

    @property
    def address(self) -> str:
        return self.worker.address

    def close(self):
        """Stop the job's threads; subclasses also release calls waiting on the job."""
        self.prefetch.close()
        self.executor.shutdown(wait=False)

    async def compute(self, fn, *args):
        """Run ``fn`` on the job's compute thread (one per job: JAX work stays off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @staticmethod
    def peer_timeout() -> float:
        return config.get_seconds("worker.peer-timeout")

    # -- routing ------------------------------------------------------------------
    async def handle(self, order: Order):
        handler = getattr(self, f"order_{order.op}", None)
        if handler is None:
            raise TypeError(f"{type(self).__name__} takes no {order.op!r} order")
        self.stats.begin_order(getattr(order, "round", None), outside=isinstance(order, (RngOrder, CheckpointOrder)))
        try:
            return await handler(order)
        except CorruptMinibatchError as e:
            if getattr(order, "op", None) != "fit" or "(round " in str(e.reason):
                raise
            # a file that went bad after the job listed it: say when it was needed
            raise CorruptMinibatchError(e.url, f"{e.reason} (round {order.round}, epoch "
                                               f"{order.epoch + 1}, worker {self.address})") from None
        finally:
            self.stats.end_order()

    def notice(self, notice):
        """The coordinator's one-way word (a :class:`~dlspark.distributed._messages.PeerLost`):
        handled by ``notice_<kind>`` where the run defines one, else of no concern to it."""
        handler = getattr(self, f"notice_{notice.kind}", None)
        if handler is not None:
            handler(notice)

    async def peer(self, op: str, **kw):
        handler = getattr(self, f"peer_{op}", None)
        if handler is None:
            raise TypeError(f"{type(self).__name__} answers no {op!r} request")
        return await handler(**kw)

    # -- data -----------------------------------------------------------------------
    def staged(self, ref_index):
        """A minibatch checked against the network and already on the device: ``(examples, batch)``.
        Runs on the prefetch thread, off the compute thread's path."""
        t0 = self.stats.now()
        ref = self.spec.refs[ref_index]
        ds = load_ref(ref, self.spec.loader, self.spec.storage_options, self.worker)
        check_minibatch(self.net, ds, repr(ref) if isinstance(ref, str) else f"#{ref_index}")
        batch = ds.jit_batch()
        if not self.on_cpu:  # an accelerator's copy is made here, off the steps' path
            batch = jax.tree_util.tree_map(jnp.asarray, batch)
        # on a CPU device the arrays go to the step as they are: its call takes host arrays for
        # a few microseconds each, a jnp.asarray per array costs this core about 50
        out = len(ds), batch
        self.stats.add("load", t0, self.stats.now(), "loader", examples=out[0])
        return out

    def batches(self, refs):
        """The minibatches of ``refs`` from the prefetcher, in order; each wait for one is
        the main lane's ``data_wait``."""
        mark = self.stats.mark
        for r in refs:
            item = self.prefetch.take(r)
            mark("data_wait")
            yield item

    def set_leaves(self, leaves):
        self.state = jax.tree_util.tree_unflatten(self.treedef, jax.device_put(list(leaves)))

    # -- orders every algorithm answers ------------------------------------------
    async def order_rng(self, order: RngOrder):
        return RngReply(rng=await self.compute(lambda: np.asarray(self.state.rng).tolist()))

    def checkpoint_arrays(self):
        """Arrays the algorithm keeps beside the train state (a pytree, or None)."""
        return None

    async def order_checkpoint(self, order: CheckpointOrder):
        def write():
            raw = fit_checkpoint_bytes(self.state, self.net, step=order.step, epoch=order.epoch,
                                       progress=order.progress, worker_rngs=order.worker_rngs, meta=order.meta,
                                       aux=self.checkpoint_arrays())
            write_bytes(order.url, raw, **(self.spec.checkpoint_options or {}))
            self.stats.mark("checkpoint", bytes=len(raw))

        await self.compute(write)
        return Ack()

    async def dump_state(self, step=None, epoch=None, for_joiner: bool = False) -> dict:
        """The train state as :func:`~dlspark.checkpoint.state_to_arrays` gives it (with the
        counters the client asks for), and what the algorithm carries beside it; with
        ``for_joiner``, the state a worker joining mid-fit starts from (:meth:`joiner_state`)."""

        def dump():
            st = self.joiner_state() if for_joiner else self.state
            if step is not None:
                st = st.replace(step=jnp.asarray(step, jnp.int32))
            if epoch is not None:
                st = st.replace(epoch=jnp.asarray(epoch, jnp.int32))
            return state_to_arrays(st), self.carried_state()

        state, carried = await self.compute(dump)
        return {"state": state, "carried": carried}

    def carried_state(self):
        """What this worker's algorithm hands back to the client at the end of a job (host arrays)."""
        return None

    def joiner_state(self):
        """The train state a worker joining mid-fit starts from, taken from this one's (on the
        compute thread): by default this replica's own."""
        return self.state

    def adopt(self, carried):
        """Take over what a live peer's algorithm carries (a worker joining mid-fit)."""

    def replica_extra(self):
        """What this replica keeps, beside its train state, for a next fit that goes on from this
        one's end (gradient sharing's residual and threshold); never sent. None: nothing."""
        return None

    def continue_from(self, extra):
        """Go on from :meth:`replica_extra` of the fit before on this worker."""
