"""Gradient sharing's round driver (scheduler side, pure), and the sync plan."""

from __future__ import annotations

from ...distributed._machine import RoundDone
from ...distributed._messages import FitOrder
from .._base import RoundDriver
from ._messages import HaveOrder, ShareWith, SharingFigures, SyncOrder
from ._thresholds import senders, threshold_meta
from ._topology import tree_links

__all__ = ["SharingDriver", "sync_plan"]


def sync_plan(haves: dict, contributors) -> dict:
    """Which holder each replica fetches each message it misses from.

    ``haves`` maps each replica to ``{sender: [steps]}`` of the round's messages it
    holds. A message is fetched from its sender while the sender answered, else
    from a replica that holds it, contributors first. Returns
    ``{replica: {holder: [[sender, step], ...]}}``.
    """
    holder: dict = {}
    for w in sorted(haves, key=lambda a: a not in contributors):
        for sender, steps in haves[w].items():
            for k in steps:
                holder.setdefault((sender, k), sender if sender in haves else w)
    missing = {}
    for w in haves:
        mine = {(s, k) for s, ks in haves[w].items() for k in ks}
        need: dict = {}
        for key, h in holder.items():
            if key not in mine and key[0] != w:
                need.setdefault(h, []).append(list(key))
        missing[w] = need
    return missing


class SharingDriver(RoundDriver):
    """Workers step freely, exchanging messages peer to peer; then every replica catches
    up on the round's messages it missed, so that all applied the same set. A pass of
    that sync that lost a worker or found a holder unreachable is run again over the
    replicas left.

    A round in which every live worker trained, none was lost, and each fit reply says its
    replica holds and applied every contributor's messages of the round ends with the fit
    replies: no sync is asked for (the common case, one round trip a round). A replica
    forgets the messages of the rounds before when its next order comes (``synced``)."""

    failure = "the replicas could not be synced"

    def __init__(self, options, master):
        super().__init__(options)
        self.master = master
        self.counters: dict = {}  # worker -> its message counter
        self.thresholds: dict = {}  # worker -> its threshold state

    def begin(self, plan, hint, live):
        self.round = plan.round
        self.fits, self.fetched = {}, 0
        self.phase = "fit"
        peers = {w: (self.counters.get(w, 0), len(plan.assignment.get(w, []))) for w in sorted(live)}
        active = [w for w in sorted(live) if plan.assignment.get(w)]
        # Tree mesh: the round's active workers relay to tree neighbours only; idle
        # workers catch up in the sync.
        links = tree_links(active, self.master.tree_fanout) if self.master.mesh == "tree" else {}
        epoch = self.options.base_epoch + plan.epoch
        self.contributors = list(plan.contributors)
        synced = dict(self.counters)
        return [(w, FitOrder(round=plan.round, epoch=epoch, refs=tuple(plan.assignment[w]),
                             next_refs=tuple(hint.get(w, ())),
                             plan=ShareWith(peers, None if w not in links else tuple(links[w]), synced)))
                for w in active]

    def step(self, replies, live, attempt):
        if self.phase == "fit":
            self.fits = dict(replies)
            if self._settled_by_fits(live):
                held = {w: f.extra["have"] for w, f in self.fits.items()}
                return self._done(held, {w: (f.extra["last_step"], f.extra["threshold_state"])
                                         for w, f in self.fits.items()}, live)
            return self._have(live)
        if self.phase == "have":
            self.haves = {w: r.have for w, r in replies.items() if w in live}
            self.missing = sync_plan(self.haves, self.contributors)
            self.phase = "sync"
            return [(w, SyncOrder(self.missing[w])) for w in sorted(self.haves)]
        if self.phase == "sync":
            faults = set(self.haves) - set(live) or any(r.unreachable for r in replies.values())
            if faults:  # sync again from the holders left (or, if the failure passed, the same)
                return self._have(live)
            self.fetched = sum(sum(len(k) for k in self.missing[w].values()) for w in replies)
            return self._done(self.haves, {w: (r.step, r.threshold_state) for w, r in replies.items()}, live)
        raise RuntimeError(f"gradient sharing's round has no phase {self.phase!r} after which to step")

    def _settled_by_fits(self, live) -> bool:
        """Whether the fit replies end the round: every live worker trained in it and answered
        (none idle, none lost), and each holds and applied every contributor's messages."""
        if set(self.fits) != set(live) or set(self.contributors) != set(live):
            return False
        if not all("have" in f.extra for f in self.fits.values()):
            return False
        missing = sync_plan({w: f.extra["have"] for w, f in self.fits.items()}, self.contributors)
        return not any(missing.values())

    def _done(self, haves, replicas, live):
        """The round synced: each replica applied the messages in ``haves``; ``replicas`` maps a
        replica to its message counter and threshold state."""
        # every replica now holds each sender's messages up to here, a lost sender's too: a
        # worker that comes back at its address numbers its messages after them (a message
        # numbered as one already applied would be taken for a late copy and dropped)
        for have in haves.values():
            for sender, steps in have.items():
                if steps:
                    self.counters[sender] = max(self.counters.get(sender, 0), max(steps))
        for w, (step, threshold_state) in replicas.items():
            self.counters[w] = step
            self.thresholds[w] = tuple(threshold_state)
        self.phase = "done"
        return RoundDone(tuple(w for w in self.contributors if w in live))

    def _have(self, live):
        self.contributors = [w for w in self.contributors if w in self.fits and w in live]
        self.phase = "have"
        synced = dict(self.counters)  # the rounds before this one: not changed until it is synced
        return [(w, HaveOrder(synced)) for w in sorted(live)]

    def round_stats(self):
        fits = {w: f for w, f in self.fits.items() if w in self.contributors}
        x = {w: f.extra for w, f in fits.items()}
        sparsities = [e["sparsity"] for e in x.values() if e.get("sparsity") is not None]
        return SharingFigures(bytes_sent=sum(e["bytes_sent"] for e in x.values()),
                              dense_bytes=sum(e["dense_bytes"] for e in x.values()),
                              threshold={w: e["threshold"] for w, e in x.items()},
                              sparsity=sum(sparsities) / len(sparsities) if sparsities else None,
                              stale_wait=max((e["stale_wait"] for e in x.values()), default=0.0),
                              encoding_debug={w: e["debug"] for w, e in x.items() if e["debug"]},
                              relayed=sum(e.get("relayed", 0) for e in x.values()), fetched_at_sync=self.fetched,
                              direct=sum(e.get("direct", 0) for e in x.values()))

    def _stepped(self, workers):
        """The threshold states to carry: those of the workers that sent a message in this job
        (one that trained nothing still holds the fit's starting threshold, which would pull the
        mean back), or every worker's when none did."""
        have = [w for w in workers if w in self.thresholds]
        return senders([self.thresholds[w] for w in have], [self.counters.get(w, 0) for w in have])

    def result_state(self, workers):
        return {"threshold_states": self._stepped(workers)}

    def checkpoint_meta(self, workers):
        return {"threshold_states": threshold_meta(self.master.threshold_algorithm, self._stepped(workers))}
