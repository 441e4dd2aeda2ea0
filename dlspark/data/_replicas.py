"""Second copies of direct minibatches that Dask's Active Memory Manager leaves alone.

``training_approach="direct"`` keeps every minibatch on two workers, so that a lost worker
loses none (``Client.replicate``). Dask's Active Memory Manager, on by default, runs its
``ReduceReplicas`` policy every two seconds and drops every replica beyond the first of a key
no task waits for: the second copies would be gone before the first round. :func:`keep_replicas`
swaps that policy, on the scheduler, for one that skips the keys it is given (for as long as
they exist) and reduces every other key as before.
"""

from __future__ import annotations

from distributed.active_memory_manager import ReduceReplicas, Suggestion

__all__ = ["keep_replicas", "KeepReplicas"]


class KeepReplicas(ReduceReplicas):
    """``ReduceReplicas`` except for the keys in ``kept`` (forgotten once the scheduler forgets them)."""

    def __init__(self, kept=None):
        self.kept = set(kept or ())

    def run(self):
        tasks = self.manager.scheduler.tasks
        self.kept = {k for k in self.kept if k in tasks}
        for ts in self.manager.scheduler.replicated_tasks:
            if ts.key in self.kept:
                continue
            # ReduceReplicas' own rule: one replica, or one per worker a waiting task runs on
            nwaiters = len(ts.waiters or ())
            if 1 < nwaiters < 20:
                nwaiters = len({waiter.processing_on or waiter for waiter in ts.waiters or ()})
            ndrop = len(ts.who_has) - max(1, nwaiters)
            if ts in self.manager.pending:
                pending_repl, pending_drop = self.manager.pending[ts]
                ndrop += len(pending_repl) - len(pending_drop)
            for _ in range(max(0, ndrop)):
                yield Suggestion("drop", ts)


def _keep(keys, dask_scheduler=None):
    amm = dask_scheduler.extensions.get("amm")
    if amm is None:  # no Active Memory Manager: replicas stay
        return False
    mine = [p for p in amm.policies if isinstance(p, KeepReplicas)]
    if mine:
        mine[0].kept.update(keys)
        return True
    reducers = [p for p in amm.policies if type(p) is ReduceReplicas]
    if not reducers:  # the cluster does not reduce replicas
        return False
    for p in reducers:
        amm.policies.discard(p)
    amm.add_policy(KeepReplicas(keys))
    return True


def keep_replicas(client, keys) -> bool:
    """Keep every replica of ``keys`` on ``client``'s cluster; True if a policy had to be changed."""
    return client.run_on_scheduler(_keep, list(keys))
