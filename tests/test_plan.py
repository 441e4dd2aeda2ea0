import pytest

from dlspark.distributed._plan import Coordinator, split_balanced


def drain(c, workers, fail=None):
    """Run rounds to the end; ``fail(plan)`` names workers that fail in that round."""
    trained = []
    while (plan := c.plan_round(workers)) is not None:
        failed = set(fail(plan)) if fail else set()
        ok = [w for w in plan.assignment if w not in failed]
        for w in ok:
            trained.append((plan.epoch, plan.assignment[w]))
        c.complete_round(plan, ok)
        workers = [w for w in workers if w not in failed]
    return trained


def test_split_balanced():
    assert [len(s) for s in split_balanced(list(range(7)), 3)] == [3, 2, 2]
    assert split_balanced([0, 1], 3)[2] == []


def test_one_worker_keeps_order_and_every_epoch_trains_each_minibatch_once():
    c = Coordinator([0] * 7, epochs=2, steps_per_round=3)
    rounds = drain(c, ["a"])
    assert [r for e, r in rounds if e == 0] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [r for e, r in rounds if e == 1] == [[0, 1, 2], [3, 4, 5], [6]]
    assert c.finished and c.trained_total == 14


def test_the_final_epochs_deal_rounds_of_their_own_length():
    # 12 minibatches, 2 workers: rounds of 6 a worker (one an epoch), the last two epochs'
    # rounds 2 a worker (3 an epoch); every epoch still trains each minibatch once
    c = Coordinator([0] * 12, epochs=4, steps_per_round=6, final_epochs=2, final_steps_per_round=2)
    sizes = []
    while (plan := c.plan_round(["a", "b"])) is not None:
        sizes.append((plan.epoch, [len(r) for r in plan.assignment.values()]))
        c.complete_round(plan, plan.contributors)
    assert sizes == [(0, [6, 6]), (1, [6, 6])] + [(e, [2, 2]) for e in (2, 3) for _ in range(3)]
    assert c.trained_total == 48
    # more final epochs than the fit has: every epoch is one of them; none: the usual rounds
    every = Coordinator([0] * 12, epochs=2, steps_per_round=6, final_epochs=5, final_steps_per_round=3)
    assert len(drain(every, ["a", "b"])) == 8
    assert len(drain(Coordinator([0] * 12, epochs=2, steps_per_round=6, final_epochs=0,
                                 final_steps_per_round=3), ["a", "b"])) == 4


def test_balanced_final_partial_round_and_idle_workers():
    c = Coordinator([0] * 5, epochs=1, steps_per_round=2)
    p1 = c.plan_round(["a", "b"])
    assert p1.assignment == {"a": [0, 1], "b": [2, 3]}
    c.complete_round(p1, ["a", "b"])
    p2 = c.plan_round(["a", "b"])
    assert p2.assignment == {"a": [4], "b": []} and p2.contributors == ["a"]
    c.complete_round(p2, ["a"])
    assert c.plan_round(["a", "b"]) is None


def test_spark_default_strategy_uses_whole_chunks():
    c = Coordinator([0] * 5, epochs=1, steps_per_round=4)
    p = c.plan_round(["a", "b", "c"])
    assert p.assignment == {"a": [0, 1], "b": [2, 3], "c": [4]}
    c2 = Coordinator([0] * 5, epochs=1, steps_per_round=4, strategy="spark_default")
    assert c2.plan_round(["a", "b", "c"]).assignment == {"a": [0, 1, 2, 3], "b": [4], "c": []}
    c3 = Coordinator([0] * 6, epochs=1, steps_per_round=4)
    assert [len(v) for v in c3.plan_round(["a", "b", "c"]).assignment.values()] == [2, 2, 2]
    c4 = Coordinator([0] * 6, epochs=1, steps_per_round=4, strategy="spark_default")
    assert [len(v) for v in c4.plan_round(["a", "b", "c"]).assignment.values()] == [4, 2, 0]


def test_failed_worker_minibatches_are_reassigned_exactly_once():
    c = Coordinator([0] * 20, epochs=1, steps_per_round=2)
    first = {"done": False}

    def fail(plan):
        if not first["done"] and plan.round == 3:
            first["done"] = True
            return ["b"]
        return []

    rounds = drain(c, ["a", "b", "c"], fail)
    flat = sorted(i for _, r in rounds for i in r)
    assert flat == list(range(20))


def test_never_follows_partitions_and_rehomes_a_lost_workers_queue():
    parts = [0, 0, 0, 1, 1, 1, 1, 1]
    c = Coordinator(parts, epochs=1, steps_per_round=2, repartition="never")
    p = c.plan_round(["a", "b"])
    assert p.assignment == {"a": [0, 1], "b": [3, 4]}
    c.complete_round(p, ["a"])  # b failed: 3, 4 go back
    p = c.plan_round(["a"])
    assert p.assignment["a"] == [3, 4]  # the lost worker's minibatches are retrained first
    trained = [0, 1] + p.assignment["a"]
    c.complete_round(p, ["a"])
    while (p := c.plan_round(["a"])) is not None:
        trained += p.assignment["a"]
        c.complete_round(p, ["a"])
    assert sorted(trained) == list(range(8))


@pytest.mark.parametrize("n_parts, expect_follow", [(2, True), (3, False)])
def test_num_partitions_workers_differs(n_parts, expect_follow):
    parts = [i % n_parts for i in range(12)]
    c = Coordinator(parts, epochs=1, steps_per_round=6, repartition="num_partitions_workers_differs")
    p = c.plan_round(["a", "b"])
    followed = all(len({parts[i] for i in refs}) == 1 for refs in p.assignment.values())
    assert followed == expect_follow


def test_resume_skips_done_minibatches_in_the_first_epoch_only():
    c = Coordinator([0] * 6, epochs=2, steps_per_round=2, skip=[0, 1, 2, 3])
    rounds = drain(c, ["a"])
    assert rounds == [(0, [4, 5]), (1, [0, 1]), (1, [2, 3]), (1, [4, 5])]


def test_progress_reports_done_minibatches():
    c = Coordinator([0] * 4, epochs=1, steps_per_round=1)
    p = c.plan_round(["a", "b"])
    c.complete_round(p, ["a", "b"])
    assert c.progress() == {"epoch": 0, "done": [0, 1], "minibatches": 4}


def test_tree_links_form_a_tree_with_bounded_fanout():
    from collections import deque

    from dlspark.algorithms.sharing._topology import tree_links

    ws = [f"w{i:02d}" for i in range(11)]
    links = tree_links(ws, 2)
    assert sum(len(v) for v in links.values()) == 2 * (len(ws) - 1)  # a tree: n - 1 edges
    assert max(len(v) for v in links.values()) <= 3
    # flooding from any node reaches all, each exactly once
    for start in ws:
        seen, q = {start}, deque([(start, None)])
        while q:
            node, via = q.popleft()
            for nb in links[node]:
                if nb != via:
                    assert nb not in seen
                    seen.add(nb)
                    q.append((nb, node))
        assert seen == set(ws)
    assert tree_links(["a"], 3) == {"a": []}
    # a relay lost: who a worker no longer reaches (it waits no more for their messages that round)
    from dlspark.algorithms.sharing._run import _cut_off

    seven = tree_links(list("abcdefg"), 2)  # a: b, c; b: d, e; c: f, g
    assert _cut_off(seven, "a", "b") == {"d", "e"} and _cut_off(seven, "d", "b") == {"a", "c", "e", "f", "g"}
    assert _cut_off(seven, "a", "d") == set() and _cut_off(None, "a", "b") == set()


@pytest.mark.parametrize("repartition", ["always", "never", "num_partitions_workers_differs"])
@pytest.mark.parametrize("strategy", ["balanced", "spark_default"])
def test_peek_round_predicts_the_next_plan_and_changes_nothing(repartition, strategy):
    partitions = [i % 3 for i in range(23)]
    c = Coordinator(partitions, epochs=3, steps_per_round=2, repartition=repartition, strategy=strategy, skip=[0, 4])
    workers = ["a", "b", "c"]
    plan = c.plan_round(workers)
    rounds = 0
    while plan is not None:
        hint = c.peek_round(workers)
        before = (c.epoch, c.round, set(c.done), dict(c.inflight), c.trained_total, c._remaining())
        assert hint == c.peek_round(workers)  # peeking twice changes nothing
        assert (c.epoch, c.round, set(c.done), dict(c.inflight), c.trained_total, c._remaining()) == before
        c.complete_round(plan, plan.contributors)
        plan = c.plan_round(workers)
        assert hint == ({} if plan is None else {w: r for w, r in plan.assignment.items() if r})
        rounds += 1
    assert rounds > 3 * 23 // 6 and c.trained_total == 3 * 23 - 2


def test_peek_round_is_only_a_hint_when_a_worker_fails():
    c = Coordinator([0] * 8, epochs=1, steps_per_round=2)
    plan = c.plan_round(["a", "b"])
    assert c.peek_round(["a", "b"]) == {"a": [4, 5], "b": [6, 7]}
    c.complete_round(plan, ["a"])  # b was lost: its minibatches come back first
    assert c.plan_round(["a"]).assignment == {"a": [2, 3]}
