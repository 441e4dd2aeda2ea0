"""The job machine's fault rules, event by event, with the real round drivers.

No cluster and no JAX computation: a small :class:`Player` plays the workers (it
answers every order the machine sends as a healthy worker would, unless a test
answers otherwise) and keeps, independently of the machine, which minibatches
were fitted by workers that saw their round through.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest

from dlspark.algorithms import GradientSharing, ParameterAveraging
from dlspark.algorithms.averaging._messages import AverageOrder, AverageReply, AverageWith
from dlspark.algorithms.sharing._driver import sync_plan
from dlspark.algorithms.sharing._messages import HaveOrder, HaveReply, ShareWith, SyncOrder, SyncReply
from dlspark.distributed._machine import (Abandon, Cancel, ClientBack, ClientLost, Emit, Fail, Failed, Finish,
                                          GraceOver, InvalidState, Join, Joined, JoinFailed, JobMachine, Probe, Probed,
                                          Replied, Send, Settings, Start, StateMachineEvent, Tell, Timer, WorkerJoined,
                                          WorkerLost)
from dlspark.distributed._messages import (Ack, CheckpointOrder, ErrorReply, FitOrder, FitReply, JobOptions,
                                           PeerLost, RngOrder, RngReply)


# -- the player -------------------------------------------------------------------------
class Player:
    """One job's machine and its workers, played: ``feed`` an event, ``answer`` an order."""

    def __init__(self, algorithm="averaging", workers=("a", "b", "c"), n=12, k=2, epochs=1,
                 settings=Settings(), settled=False, **options):
        self.options = JobOptions(epochs=epochs, steps_per_round=k, **options)
        master = (ParameterAveraging(averaging_frequency=k) if algorithm == "averaging"
                  else GradientSharing(steps_per_round=k))
        self.machine = JobMachine("job-1", workers, master.create_driver(self.options), [0] * n, self.options,
                                  settings)
        self.n = n
        self.alive = set(workers)  # the workers still in the job, as the player sees it
        self.inflight: dict = {}  # seq -> Send not answered yet
        self.fitted = defaultdict(dict)  # round -> {worker: (epoch, refs)} of fits answered
        self.counted: list = []  # (epoch, minibatch) fitted by workers alive at their round's end
        self.rounds: list = []  # every round statistic emitted
        self.log: list = []  # every instruction
        self.end = None  # Finish, Fail or Abandon
        self.round = 0
        # gradient sharing: each fit reply says its replica holds and applied every message of
        # the round, as a worker's does (else it says nothing, and the round is synced)
        self.settled = settled

    def feed(self, event, now=0.0):
        out = self.machine.handle(event, now)
        self.machine.validate_state()  # the machine's invariants hold after every event
        if isinstance(event, Joined) and any(isinstance(i, Emit) and i.msg["event"] == "joined" for i in out):
            self.alive.add(event.worker)
        for i in out:
            if isinstance(i, Emit) and i.msg["event"] == "partitioned":  # left the job, alive
                self.alive.discard(i.msg["worker"])
            if isinstance(i, Send):
                self.inflight[i.seq] = i
                if isinstance(i.order, FitOrder):
                    self.round = i.order.round
            elif isinstance(i, Emit) and i.msg["event"] == "round":
                self.rounds.append(i.msg)
                survivors = {w: f for w, f in self.fitted[i.msg["round"]].items() if w in self.alive}
                assert set(i.msg["worker_fit_time"]) == set(survivors)  # the machine counts the same workers
                # one per-iteration row per minibatch the survivors trained, numbered on from the last round
                first = self.rounds[-2]["trained_total"] if len(self.rounds) > 1 else 0
                assert [r["fit_step"] for r in i.msg["iterations"]] == \
                    list(range(first, first + sum(len(refs) for _, refs in survivors.values())))
                self.counted += [(epoch, m) for epoch, refs in survivors.values() for m in refs]
            elif isinstance(i, (Finish, Fail, Abandon)):
                self.end = i
        self.log += out
        return out

    def start(self):
        return self.feed(Start())

    def reply_to(self, send: Send):
        """What a healthy worker answers."""
        o, w = send.order, send.worker
        if isinstance(o, FitOrder):
            n = len(o.refs)
            if isinstance(o.plan, AverageWith):
                extra = {"averaged": AverageReply(contributors=o.plan.contributors)}
            else:
                extra = {"bytes_sent": 10 * n, "dense_bytes": 100 * n, "threshold": 1e-3, "stale_wait": 0.0,
                         "debug": None}
                if self.settled:
                    start, quota = o.plan.peers[w]
                    extra.update(have={p: list(range(s + 1, s + q + 1)) for p, (s, q) in o.plan.peers.items() if q},
                                 last_step=start + quota, threshold_state=(1e-3, 0.01, start + quota))
            return FitReply(loss_sum=0.5 * n, n=n, examples=8 * n, fit_time=0.1, extra=extra,
                            steps=tuple((0.5, 8) for _ in o.refs))
        if isinstance(o, AverageOrder):
            return AverageReply(contributors=o.contributors)
        if isinstance(o, HaveOrder):
            return HaveReply(have={s: list(range(len(refs))) for s, (_, refs) in self.fitted[self.round].items()})
        if isinstance(o, SyncOrder):
            return SyncReply(threshold=1e-3, step=self.round, threshold_state=(1e-3, 0.01))
        if isinstance(o, RngOrder):
            return RngReply(rng=[w])
        if isinstance(o, CheckpointOrder):
            return Ack()
        raise AssertionError(f"unexpected order {o!r}")

    def answer(self, send: Send, reply=None, now=0.0):
        del self.inflight[send.seq]
        if isinstance(send.order, FitOrder):
            self.fitted[send.order.round][send.worker] = (send.order.epoch, send.order.refs)
        return self.feed(Replied(send.worker, send.seq, reply if reply is not None else self.reply_to(send)), now)

    def answer_all(self):
        out = []
        for seq in sorted(self.inflight):
            out += self.answer(self.inflight[seq])
        return out

    def lose(self, worker):
        self.alive.discard(worker)
        for seq in [s for s, i in self.inflight.items() if i.worker == worker]:
            del self.inflight[seq]
        return self.feed(WorkerLost(worker))

    def probed(self, worker, alive):
        if not alive:
            self.alive.discard(worker)
        return self.feed(Probed(worker, alive))

    def order(self, worker) -> Send:
        """The one order in flight to ``worker``."""
        (send,) = [i for i in self.inflight.values() if i.worker == worker]
        return send

    def play(self, limit=1000):
        """Answer the orders in flight, oldest first, until the job ends; return its end."""
        for _ in range(limit):
            if self.end is not None:
                return self.end
            assert self.inflight, f"the job stalled after {self.log[-4:]}"
            self.answer(self.inflight[min(self.inflight)])
        raise AssertionError("the job did not end")

    def sent_to(self, worker, since=0):
        return [i for i in self.log[since:] if isinstance(i, Send) and i.worker == worker]

    def assert_each_minibatch_once_per_epoch(self, epochs):
        per_epoch = defaultdict(list)
        for epoch, m in self.counted:
            per_epoch[epoch].append(m)
        assert sorted(per_epoch) == list(range(epochs))
        for epoch, ms in per_epoch.items():
            assert sorted(ms) == list(range(self.n)), f"epoch {epoch}: {Counter(ms)}"


def sends(out, kind=None):
    return [i for i in out if isinstance(i, Send) and (kind is None or isinstance(i.order, kind))]


def untold(out):
    """The instructions but the word that a worker was lost: the notices to the others
    (:class:`Tell`) and the client's event."""
    return [i for i in out if not isinstance(i, Tell) and not (isinstance(i, Emit) and i.msg["event"] == "lost")]


def emits(out, event):
    return [i.msg for i in out if isinstance(i, Emit) and i.msg["event"] == event]


# -- a healthy job ------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_a_job_without_faults_trains_every_minibatch_once_per_epoch(algorithm):
    p = Player(algorithm, n=10, epochs=2)
    first = p.start()
    assert {s.worker: s.order.refs for s in sends(first, FitOrder)} == {"a": (0, 1), "b": (2, 3), "c": (4, 5)}
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 20 and end.result.workers == ("a", "b", "c")
    assert [s["attempts"] for s in p.rounds] == [0] * len(p.rounds)
    p.assert_each_minibatch_once_per_epoch(2)


# -- 1. a worker lost mid-round --------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["averaging", "sharing"])
def test_a_worker_lost_mid_round_has_its_minibatches_requeued(algorithm):
    p = Player(algorithm, n=12, epochs=2)
    p.start()
    p.answer(p.order("a"))
    # its fit of minibatches 2, 3 is in flight: the others are told at once (one way), so that
    # none waits out a timeout for its part (a's fit is answered: it may be waiting in its mean)
    lost = {"event": "lost", "worker": "b", "workers": 2, "round": 1}  # and the client is told
    assert p.lose("b") == [Emit(lost), Tell("a", PeerLost("b")), Tell("c", PeerLost("b"))]
    out = p.answer(p.order("c"))
    assert {s.worker for s in sends(out)} == {"a", "c"}
    if algorithm == "averaging":  # averaged again over the survivors
        assert {s.order for s in sends(out)} == {AverageOrder(1, ("a", "c"), 1)}
    out = p.answer_all()
    while not sends(out, FitOrder):
        out = p.answer_all()
    assert p.rounds[0]["minibatches"] == 4 and p.rounds[0]["workers"] == 2
    assert {s.worker: s.order.refs for s in sends(out, FitOrder)} == {"a": (2, 3), "c": (6, 7)}  # b's first
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 2 * 12 and end.result.workers == ("a", "c")
    p.assert_each_minibatch_once_per_epoch(2)
    assert len(p.sent_to("b")) == 1  # only its first fit
    assert end.result.events == (lost,)  # the client's last_fit_events


def test_a_sharing_round_whose_replicas_hold_every_message_ends_with_the_fit_replies():
    p = Player("sharing", n=10, epochs=2, settled=True)
    p.start()
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 20 and end.result.workers == ("a", "b", "c")
    p.assert_each_minibatch_once_per_epoch(2)
    assert not [s for s in p.log if isinstance(s, Send) and not isinstance(s.order, FitOrder)]  # no sync asked
    fits = [s for s in p.log if isinstance(s, Send) and isinstance(s.order, FitOrder)]
    second = [s for s in fits if s.order.round == 2]
    # the counters go on from the fit replies: each worker's next messages, and what every replica forgets
    assert {s.worker: s.order.plan.peers[s.worker][0] for s in second} == {"a": 2, "b": 2, "c": 2}
    assert all(s.order.plan.synced == {"a": 2, "b": 2, "c": 2} for s in second)
    start, quota = [s for s in fits if s.worker == "a"][-1].order.plan.peers["a"]
    assert end.result.algorithm_state["threshold_states"][0] == (1e-3, 0.01, start + quota)  # from a's last fit


def test_a_sharing_round_with_a_message_missing_or_a_worker_lost_is_synced():
    p = Player("sharing", n=6, settled=True)
    p.start()
    p.answer(p.order("a"))
    p.answer(p.order("b"))
    fit = p.reply_to(p.order("c"))
    have = {**fit.extra["have"], "a": [1]}  # c missed a's second message
    out = p.answer(p.order("c"), replace(fit, extra={**fit.extra, "have": have}))
    assert sorted(s.worker for s in sends(out, HaveOrder)) == ["a", "b", "c"] and sends(out, HaveOrder) == sends(out)
    assert all(s.order.synced == {} for s in sends(out))  # nothing synced before the first round
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 6
    p = Player("sharing", n=12, settled=True)
    p.start()
    p.answer(p.order("a"))
    p.lose("b")
    out = p.answer(p.order("c"))
    assert sorted(s.worker for s in sends(out, HaveOrder)) == ["a", "c"]
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 12
    p.assert_each_minibatch_once_per_epoch(1)


def test_averaging_marks_a_round_full_only_when_every_contributor_fits_the_frequency():
    """An outer optimizer steps only after a full round, in which every contributor fits
    ``averaging_frequency`` minibatches: the driver says so in every order of the round (the
    fits' plans, and the means asked again after a loss), and the epoch's short last round is not."""
    p = Player("averaging", n=10)  # 3 workers x 2 a round: (2, 2, 2), then the epoch's last 4
    out = p.start()
    assert [s.order.plan.full for s in sends(out, FitOrder)] == [True] * 3
    out = p.answer_all()
    fits = sends(out, FitOrder)
    assert sorted(len(s.order.refs) for s in fits) == [1, 1, 2]
    assert [s.order.plan.full for s in fits] == [False] * 3
    lost, *others = [s.worker for s in fits]
    p.lose(lost)
    out = []
    for w in others:
        out += p.answer(p.order(w))
    again = sends(out, AverageOrder)
    assert {s.worker for s in again} == set(others)
    assert {(s.order.contributors, s.order.attempt, s.order.full) for s in again} == {(tuple(others), 1, False)}


# -- 2. every contributor of a round lost --------------------------------------------------
def test_every_contributor_lost_the_idle_worker_averages_over_nobody_and_the_round_is_requeued():
    p = Player("averaging", n=2, epochs=2)
    out = p.start()
    # one minibatch each of the two a round (k=2): not a full round
    assert {s.worker: s.order for s in sends(out)} == {
        "a": FitOrder(round=1, epoch=0, refs=(0,), next_refs=(0,), plan=AverageWith(("a", "b"), full=False)),
        "b": FitOrder(round=1, epoch=0, refs=(1,), next_refs=(1,), plan=AverageWith(("a", "b"), full=False)),
        "c": AverageOrder(1, ("a", "b"), 0, full=False),  # c has no data this round: it only averages
    }
    assert untold(p.lose("a")) == []
    assert untold(p.lose("b")) == []
    out = p.answer(p.order("c"), AverageReply(unreachable=("a",), ok=False, contributors=("a", "b")))
    assert out == [Send("c", out[0].seq, AverageOrder(1, (), 1, full=False))]  # back to its state before the round
    out = p.answer(p.order("c"))
    (stat,) = emits(out, "round")
    assert stat["round"] == 1 and stat["minibatches"] == 0 and stat["workers"] == 0 and stat["loss"] is None
    assert stat["trained_total"] == 0
    (fit,) = sends(out)
    assert fit.worker == "c" and fit.order.refs == (0, 1) and fit.order.epoch == 0  # the round again, on c
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 2 * 2 and end.result.workers == ("c",)
    p.assert_each_minibatch_once_per_epoch(2)


# -- 3. a contributor lost during averaging ------------------------------------------------
def test_a_contributor_lost_while_averaging_is_averaged_again_over_the_survivors():
    p = Player("averaging", workers=("a", "b", "c", "d"), n=8)
    p.start()
    p.lose("d")  # mid-fit: the others average again over a, b, c
    for w in "abc":
        out = p.answer(p.order(w))
    assert sorted((s.worker, s.order) for s in sends(out)) == [(w, AverageOrder(1, ("a", "b", "c"), 1)) for w in "abc"]
    p.answer(p.order("a"))
    assert untold(p.lose("c")) == []  # lost with its AverageOrder in flight
    out = p.answer(p.order("b"), AverageReply(unreachable=("c",), ok=False, contributors=("a", "b", "c")))
    assert sorted((s.worker, s.order) for s in sends(out)) == [(w, AverageOrder(1, ("a", "b"), 2)) for w in "ab"]
    out = p.answer_all()
    (stat,) = emits(out, "round")
    assert stat["workers"] == 2 and stat["minibatches"] == 4 and stat["attempts"] == 2
    # c's and d's minibatches come back first
    assert {s.worker: s.order.refs for s in sends(out, FitOrder)} == {"a": (4, 5), "b": (6, 7)}
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 8
    p.assert_each_minibatch_once_per_epoch(1)


def test_a_contributor_lost_after_its_answer_still_counts_as_a_new_attempt():
    # d has no data in round 1 and only averages; c fits and answers, then is lost
    # while d's AverageOrder is in flight. The round is re-driven over a and b: by the
    # RoundDriver contract ("attempt counts the times the round was re-driven after a
    # fault") the re-drive carries attempt 1, as when c is lost before answering.
    p = Player("averaging", workers=("a", "b", "c", "d"), n=3)
    p.start()
    assert p.order("d").order == AverageOrder(1, ("a", "b", "c"), 0, full=False)  # one minibatch each: not full
    for w in "abc":
        assert p.answer(p.order(w)) == []
    assert untold(p.lose("c")) == []
    out = p.answer(p.order("d"), AverageReply(unreachable=("c",), ok=False, contributors=("a", "b", "c")))
    assert {s.order.contributors for s in sends(out)} == {("a", "b")}
    assert {s.order.attempt for s in sends(out)} == {1}


# -- 4. a fetch failure from a live peer -----------------------------------------------------
def unreachable_fit(peer, contributors):
    averaged = AverageReply(unreachable=(peer,), ok=False, contributors=contributors)
    return FitReply(unreachable=(peer,), loss_sum=1.0, n=2, examples=16, extra={"averaged": averaged},
                    steps=((0.5, 8), (0.5, 8)))


def test_a_live_peer_named_unreachable_is_probed_and_the_round_re_driven_a_bounded_number_of_times():
    """Failures that pass (each pair of workers failing once) re-drive the round over the same
    workers; past the bound the job fails, naming the pairs."""
    settings = Settings(extra_attempts=0)
    p = Player("averaging", n=6, settings=settings)
    p.start()
    p.answer(p.order("a"), unreachable_fit("b", ("a", "b", "c")))
    p.answer(p.order("b"))
    assert p.answer(p.order("c")) == [Probe("b")]
    attempts = []
    for reporter, peer in [("b", "c"), ("c", "a"), ("b", "a")]:  # each pair once: passing failures
        out = p.probed(p.log[-1].worker, True)
        assert sorted((s.worker, s.order.contributors) for s in sends(out)) == [(w, ("a", "b", "c")) for w in "abc"]
        (attempt,) = {s.order.attempt for s in sends(out)}
        attempts.append(attempt)
        for w in "abc":
            reply = AverageReply(unreachable=(peer,), ok=False, contributors=("a", "b", "c")) if w == reporter else None
            out = p.answer(p.order(w), reply) if reply else p.answer(p.order(w))
        assert out == [Probe(peer)]
    assert attempts == [1, 2, 3]
    (fail,) = p.probed("a", True)
    assert isinstance(fail, Fail)
    assert "round 1" in fail.error.text and "could not be averaged" in fail.error.text
    assert "a could not reach b" in fail.error.text and "b could not reach a" in fail.error.text
    assert p.feed(Probed("a", True)) == []


def test_two_live_workers_that_cannot_reach_each_other_twice_in_a_round_lose_one_side():
    p = Player("averaging", n=6)
    p.start()
    p.answer(p.order("a"), unreachable_fit("b", ("a", "b", "c")))
    p.answer(p.order("b"), unreachable_fit("a", ("a", "b", "c")))
    assert p.answer(p.order("c")) == [Probe("a"), Probe("b")]
    p.probed("a", True)
    out = p.probed("b", True)  # once: it may pass, the same workers try again
    assert sorted((s.worker, s.order) for s in sends(out)) == [(w, AverageOrder(1, ("a", "b", "c"), 1)) for w in "abc"]
    p.answer(p.order("a"), AverageReply(unreachable=("b",), ok=False, contributors=("a", "b", "c")))
    p.answer(p.order("b"), AverageReply(unreachable=("a",), ok=False, contributors=("a", "b", "c")))
    p.answer(p.order("c"))
    p.probed("a", True)
    out = p.probed("b", True)  # twice: a partition between them; the later address leaves the job
    assert [i.msg for i in out if isinstance(i, Emit)] == [{"event": "partitioned", "worker": "b",
                                                            "unreachable_from": ["a"], "workers": 2, "round": 1}]
    assert sorted((s.worker, s.order) for s in sends(out)) == [(w, AverageOrder(1, ("a", "c"), 2)) for w in "ac"]
    end = p.play()
    assert isinstance(end, Finish) and end.result.workers == ("a", "c") and end.result.trained == 6
    p.assert_each_minibatch_once_per_epoch(1)


def test_a_peer_the_coordinator_cannot_reach_either_is_dropped():
    p = Player("averaging", n=6)
    p.start()
    p.answer(p.order("a"), unreachable_fit("b", ("a", "b", "c")))
    p.answer(p.order("b"))
    assert p.answer(p.order("c")) == [Probe("b")]
    assert p.feed(Probed("c", False)) == []  # not probed: nothing happens
    out = p.probed("b", False)
    assert sorted((s.worker, s.order) for s in sends(out)) == [(w, AverageOrder(1, ("a", "c"), 1)) for w in "ac"]
    end = p.play()
    assert isinstance(end, Finish) and end.result.workers == ("a", "c") and end.result.trained == 6
    assert all(s.worker != "b" for s in sends(p.log[p.log.index(Probe("b")):]))
    p.assert_each_minibatch_once_per_epoch(1)


def test_a_probed_peer_lost_before_the_probe_answers_is_dropped():
    p = Player("averaging", n=6)
    p.start()
    p.answer(p.order("a"), unreachable_fit("b", ("a", "b", "c")))
    p.answer(p.order("b"))
    assert p.answer(p.order("c")) == [Probe("b")]
    out = p.lose("b")
    assert sorted((s.worker, s.order) for s in sends(out)) == [(w, AverageOrder(1, ("a", "c"), 1)) for w in "ac"]
    assert p.feed(Probed("b", False)) == []  # the probe's late answer


# -- 5. a joiner ------------------------------------------------------------------------------
def test_a_worker_arriving_mid_round_joins_at_the_next_round():
    p = Player("averaging", workers=("a", "b"), n=12)
    p.start()
    assert p.feed(WorkerJoined("j")) == []
    assert p.feed(WorkerJoined("a")) == []  # already in the job
    assert p.answer(p.order("a")) == []
    out = p.answer(p.order("b"))
    assert emits(out, "round") and not sends(out)
    assert out[-1] == Join("j", "a", 2)
    out = p.feed(Joined("j"))
    assert emits(out, "joined") == [{"event": "joined", "worker": "j", "workers": 3, "round": 1}]
    assert {s.worker: s.order.refs for s in sends(out, FitOrder)} == {"a": (4, 5), "b": (6, 7), "j": (8, 9)}
    end = p.play()
    assert isinstance(end, Finish) and end.result.workers == ("a", "b", "j") and end.result.trained == 12
    assert [e["event"] for e in end.result.events] == ["joined"]
    p.assert_each_minibatch_once_per_epoch(1)


def test_a_join_that_keeps_failing_is_retried_then_given_up():
    settings = Settings(join_attempts=3, join_interval=0.25)
    p = Player("averaging", workers=("a", "b"), n=12, settings=settings)
    p.start()
    p.feed(WorkerJoined("j"))
    p.answer(p.order("a"))
    assert p.answer(p.order("b"))[-1] == Join("j", "a", 2)
    for _ in range(settings.join_attempts - 1):
        (retry,) = p.feed(JoinFailed("j", "no plugin yet"))
        assert isinstance(retry, Join) and retry.worker == "j" and retry.source == "a"
        assert retry.delay == settings.join_interval
    out = p.feed(JoinFailed("j", "no plugin yet"))
    assert emits(out, "join-failed") == [{"event": "join-failed", "worker": "j", "error": "no plugin yet",
                                          "round": 1}]
    assert {s.worker for s in sends(out, FitOrder)} == {"a", "b"}  # the job goes on without j
    assert p.feed(Joined("j")) == []  # too late
    end = p.play()
    assert isinstance(end, Finish) and end.result.workers == ("a", "b") and end.result.trained == 12


def test_a_worker_that_arrives_and_leaves_mid_round_is_not_joined():
    p = Player("averaging", workers=("a", "b"), n=12)
    p.start()
    p.feed(WorkerJoined("j"))
    assert p.feed(WorkerLost("j")) == []
    p.answer(p.order("a"))
    out = p.answer(p.order("b"))
    assert not [i for i in out if isinstance(i, Join)] and {s.worker for s in sends(out)} == {"a", "b"}


# -- 6. gradient sharing's sync -----------------------------------------------------------------
def test_sync_plan_fetches_from_the_sender_if_it_answered_else_from_a_holder_contributors_first():
    haves = {
        "i": {"a": [0], "d": [0, 1, 2]},  # idle this round: holds d's messages too
        "a": {"a": [0], "b": [1], "d": [0]},
        "b": {"b": [0, 1], "d": [1]},
    }  # d, a sender, did not answer (lost)
    missing = sync_plan(haves, ["a", "b"])
    assert {w: {h: sorted(keys) for h, keys in need.items()} for w, need in missing.items()} == {
        "i": {"b": [["b", 0], ["b", 1]]},  # b's messages from b, not from a, which holds b1 too
        "a": {"b": [["b", 0], ["d", 1]], "i": [["d", 2]]},  # d1 from b: a contributor before i
        "b": {"a": [["a", 0], ["d", 0]], "i": [["d", 2]]},  # d2: only i holds it
    }


def test_an_unreachable_holder_in_the_sync_is_probed_dropped_and_the_sync_run_again():
    p = Player("sharing", n=6)
    p.start()
    out = p.answer_all()
    assert sorted(s.worker for s in sends(out, HaveOrder)) == ["a", "b", "c"]
    p.answer(p.order("a"), HaveReply(have={"a": [0, 1], "b": [0, 1]}))  # a missed c's messages
    p.answer(p.order("b"), HaveReply(have={"a": [0, 1], "b": [0, 1], "c": [0, 1]}))
    out = p.answer(p.order("c"), HaveReply(have={"a": [0, 1], "b": [0, 1], "c": [0, 1]}))
    assert p.order("a").order == SyncOrder({"c": [["c", 0], ["c", 1]]}) and len(sends(out, SyncOrder)) == 3
    p.answer(p.order("a"), SyncReply(unreachable=("c",)))
    p.answer(p.order("b"))
    assert p.answer(p.order("c")) == [Probe("c")]
    out = p.probed("c", False)
    assert sorted(s.worker for s in sends(out)) == ["a", "b"] and sends(out, HaveOrder) == sends(out)
    p.answer(p.order("a"), HaveReply(have={"a": [0, 1], "b": [0, 1]}))
    out = p.answer(p.order("b"), HaveReply(have={"a": [0, 1], "b": [0, 1], "c": [0, 1]}))
    assert p.order("a").order == SyncOrder({"b": [["c", 0], ["c", 1]]})  # c's messages from b now
    assert [s.worker for s in sends(out, SyncOrder)] == ["a", "b"]
    out = p.answer_all()  # the sync's replies end the round: the next round's orders follow at once
    (stat,) = emits(out, "round")
    assert stat["workers"] == 2 and stat["minibatches"] == 4 and stat["attempts"] == 1
    assert stat["fetched_at_sync"] == 2
    assert {s.worker: s.order.refs for s in sends(out, FitOrder)} == {"a": (4,), "b": (5,)}  # c's back
    assert all(isinstance(s.order.plan, ShareWith) and set(s.order.plan.peers) == {"a", "b"}
               for s in sends(out, FitOrder))
    # each replica forgets, as its next order comes, what every replica synced: c's messages too
    assert all(s.order.plan.synced["c"] == 1 for s in sends(out, FitOrder))
    end = p.play()
    assert isinstance(end, Finish) and end.result.workers == ("a", "b") and end.result.trained == 6
    assert len(end.result.algorithm_state["threshold_states"]) == 2
    p.assert_each_minibatch_once_per_epoch(1)


def test_a_sync_failure_that_passed_runs_the_sync_again_over_the_same_workers():
    p = Player("sharing", n=6)
    p.start()
    p.answer_all()  # fits
    p.answer_all()  # haves
    p.answer(p.order("a"), SyncReply(unreachable=("c",)))
    p.answer(p.order("b"))
    assert p.answer(p.order("c")) == [Probe("c")]
    out = p.probed("c", True)
    assert sorted(s.worker for s in sends(out, HaveOrder)) == ["a", "b", "c"]
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 6 and p.rounds[0]["attempts"] == 1


# -- 7. the client ------------------------------------------------------------------------------
def test_a_client_gone_past_its_grace_abandons_the_job():
    p = Player("averaging")
    p.start()
    assert p.feed(ClientLost()) == [Timer(Settings().client_grace, GraceOver(1))]
    (abandon,) = p.feed(GraceOver(1))
    assert isinstance(abandon, Abandon) and "job-1" in abandon.reason and "client is gone" in abandon.reason
    assert p.answer_all() == []


def test_a_client_back_within_its_grace_keeps_the_job_going():
    p = Player("averaging")
    p.start()
    assert p.feed(ClientLost()) == [Timer(Settings().client_grace, GraceOver(1))]
    assert p.feed(ClientBack()) == []
    assert p.feed(GraceOver(1)) == []
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 12


def test_a_timer_from_an_earlier_absence_does_not_abandon_a_client_gone_again_briefly():
    # Gone at t=0 (timer for t=10), back at t=5, gone again at t=8 (timer for t=18): at t=10
    # the client has been gone 2 s of its 10 s grace; only the t=18 timer may abandon the job.
    p = Player("averaging")
    p.start()
    grace = Settings().client_grace
    # each Timer carries the event it feeds back: which absence it is the grace of
    [first] = p.feed(ClientLost(), now=0.0)
    assert first == Timer(grace, GraceOver(1))
    assert p.feed(ClientBack(), now=5.0) == []
    [second] = p.feed(ClientLost(), now=8.0)
    assert second == Timer(grace, GraceOver(2))
    assert p.feed(first.event, now=10.0) == []
    assert [type(i) for i in p.feed(second.event, now=18.0)] == [Abandon]


# -- 8. checkpoints ---------------------------------------------------------------------------
def test_a_checkpoint_gathers_the_rngs_then_the_first_live_worker_writes_it():
    p = Player("averaging", n=18, checkpoint_every=2, checkpoint_url="file:///ckpt/job-1")
    p.start()
    out = p.answer_all()
    assert not sends(out, RngOrder) and sends(out, FitOrder)  # round 1: no checkpoint
    out = p.answer_all()
    assert emits(out, "round")[0]["round"] == 2
    assert [(s.worker, s.order) for s in sends(out)] == [(w, RngOrder()) for w in "abc"]
    out = p.answer_all()
    (write,) = sends(out)
    assert write.worker == "a" and write.order == CheckpointOrder(
        url="file:///ckpt/job-1", step=12, epoch=0,
        progress={"epoch": 0, "done": list(range(12)), "minibatches": 18, "epochs_total": 1},
        worker_rngs=[["a"], ["b"], ["c"]], meta={})
    out = p.lose("a")  # the writer is lost before answering: the next live worker writes it
    (write,) = sends(out)
    assert write.worker == "b" and isinstance(write.order, CheckpointOrder)
    assert write.order.url == "file:///ckpt/job-1" and write.order.worker_rngs == [["b"], ["c"]]
    assert write.order.step == 12 and write.order.progress["done"] == list(range(12))
    out = p.answer(write)
    assert emits(out, "checkpoint") == [{"event": "checkpoint", "url": "file:///ckpt/job-1", "round": 2}]
    assert {s.worker: s.order.round for s in sends(out, FitOrder)} == {"b": 3, "c": 3}
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 18
    p.assert_each_minibatch_once_per_epoch(1)


# -- 9. errors and a job with no workers left -------------------------------------------------------
def test_a_workers_error_fails_the_job_with_its_envelope():
    p = Player("averaging")
    p.start()
    p.answer(p.order("a"))
    error = ErrorReply.from_exception(ValueError("boom"))
    fit = p.order("b")
    assert p.feed(Failed("b", fit.seq, error)) == [Fail(error)]
    assert error.text == "ValueError: boom" and isinstance(error.exception(), ValueError)
    assert p.answer(p.order("c")) == []


def test_every_worker_lost_fails_the_job():
    p = Player("averaging")
    p.start()
    assert untold(p.lose("a")) == [] and untold(p.lose("b")) == []
    (fail,) = p.lose("c")
    assert isinstance(fail, Fail) and "every worker was lost" in fail.error.text


# -- 10. late replies, and a job that is over ---------------------------------------------------
def test_late_and_misaddressed_replies_are_ignored():
    p = Player("averaging", n=12)
    first = p.start()
    fit_a = p.order("a")
    assert p.feed(Replied("b", fit_a.seq, FitReply(n=2))) == []  # a's seq, from b
    assert p.feed(Failed("b", fit_a.seq, ErrorReply.from_exception(ValueError("x")))) == []
    p.answer_all()
    (stale,) = [s for s in first if s.worker == "a"]
    assert p.feed(Replied("a", stale.seq, p.reply_to(stale))) == []  # round 1 is over
    assert p.feed(Failed("a", stale.seq, ErrorReply.from_exception(ValueError("late")))) == []
    assert p.feed(WorkerLost("zz")) == [] and p.feed(Probed("a", False)) == []
    end = p.play()
    assert isinstance(end, Finish) and end.result.trained == 12


@pytest.mark.parametrize("how", ["finish", "fail", "cancel"])
def test_a_job_that_is_over_issues_nothing(how):
    p = Player("averaging", n=6)
    p.start()
    if how == "finish":
        assert isinstance(p.play(), Finish)
    elif how == "fail":
        assert isinstance(p.feed(Failed("a", p.order("a").seq, ErrorReply.from_exception(ValueError("x"))))[0], Fail)
    else:
        assert p.feed(Cancel()) == []
    for event in [Start(), WorkerLost("b"), WorkerJoined("j"), Joined("j"), JoinFailed("j", "x"), ClientLost(),
                  GraceOver(), Probed("b", False), Cancel()]:
        assert p.machine.handle(event) == []
    for send in list(p.inflight.values()):
        assert p.answer(send) == []


# -- typed events, their stimulus ids, the invariants ---------------------------------------
def test_events_are_typed_carry_a_stimulus_id_and_are_logged_with_what_they_gave():
    p = Player()
    start = Start(stimulus_id="job-started")
    out = p.feed(start)
    assert all(isinstance(e, StateMachineEvent) for e in (start, WorkerLost("a"), GraceOver(1)))
    lost, again = WorkerLost("a"), WorkerLost("a")
    assert lost.stimulus_id != again.stimulus_id and lost == again  # the id names the stimulus, not the fact
    assert p.machine.log[0] == ("job-started", "Start", tuple(type(i).__name__ for i in out))
    assert {type(i).__name__ for i in out} == {"Send"}
    p.feed(lost)
    assert p.machine.log[-1][:2] == (lost.stimulus_id, "WorkerLost")


def test_an_event_of_no_known_kind_is_refused_by_name():
    p = Player()
    with pytest.raises(TypeError, match="event must be a StateMachineEvent .* got str"):
        p.machine.handle("start")

    class Unknown(StateMachineEvent):
        pass

    with pytest.raises(TypeError, match="no handler for Unknown; it takes .*Replied.*WorkerLost"):
        p.machine.handle(Unknown())


def test_validate_state_names_a_broken_invariant():
    p = Player()
    p.feed(Start())
    p.machine.validate_state()
    p.machine.live.discard("b")  # as if "b" were dropped while an order to it is still awaited
    with pytest.raises(InvalidState, match=r"orders awaited from workers \['b'\] that are not live"):
        p.machine.validate_state()
    p.machine.live.add("b")
    p.machine.arrived.add("a")
    with pytest.raises(InvalidState, match=r"arrived workers \['a'\] are already live"):
        p.machine.validate_state()
