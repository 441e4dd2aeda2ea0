"""The parity suite's tasks stay runnable: each builds its data and model and takes a step.

The suite itself (``benchmarks/bench_suite.py``) is a benchmark of hours, not part of the
test run; this keeps its tasks from rotting as the library changes.
"""

import contextlib
import dataclasses
import os
import sys

import jax
import numpy as np
import pytest

import dlspark

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import bench_suite  # noqa: E402
from _install import NUMERIC_PACKAGES  # noqa: E402


def test_suite_shape():
    assert len(bench_suite.SUITE) >= 8
    assert len(bench_suite.HELD_OUT) * 2 == len(bench_suite.SUITE) and set(bench_suite.HELD_OUT) <= set(bench_suite.SUITE)
    # a task outside the rule is a tuning task, run only when named
    outside = set(bench_suite.TASKS) - set(bench_suite.SUITE)
    assert outside and not any(bench_suite.TASKS[t].held_out for t in outside)
    assert bench_suite.SEEDS == tuple(range(10))
    assert {t.metric for t in bench_suite.TASKS.values()} == {"accuracy", "auc", "mse"}


@pytest.mark.parametrize("name", list(bench_suite.TASKS))
def test_task_builds_and_steps(name):
    task = bench_suite.TASKS[name]
    train, test = task.data()
    again, _ = task.data()
    np.testing.assert_array_equal(train.features, again.features)  # pairing needs the same data every call
    assert len(train) > len(test) > 0
    net = bench_suite.make_network(task, train, seed=0)
    before = [np.asarray(p) for p in jax.tree.leaves(net.params)]  # copies: the step may donate buffers
    net.fit(train[:16], epochs=1, batch_size=16)
    assert any(not np.array_equal(a, b) for a, b in zip(before, jax.tree.leaves(net.params)))
    after = bench_suite.score(task, net, test[:256])
    assert np.isfinite(after)
    if task.metric != "mse":
        assert 0.0 <= after <= 1.0


def test_points_sign():
    mse = bench_suite.TASKS["diabetes"]
    acc = bench_suite.TASKS["cancer"]
    assert bench_suite.points(mse, 0.9, 1.0) == pytest.approx(10.0)  # lower MSE is better
    assert bench_suite.points(acc, 0.91, 0.9) == pytest.approx(1.0)


def test_cli_rejects_a_seed_outside_the_suite(capsys):
    with pytest.raises(SystemExit):
        bench_suite.main(["--seeds", "12", "--table", "--out", os.devnull])
    assert "--seeds takes seeds of the suite, 0 to 9; got 12" in capsys.readouterr().err


def test_options_build_their_masters_and_are_paired_with_their_algorithms_defaults():
    assert bench_suite.DGC_WARMUP == dlspark.GradientSharing.DGC_SPARSITY_WARMUP  # the schedule measured is DGC's
    task = bench_suite.TASKS["cancer"]
    train, _ = task.data()
    for name, (algorithm, options) in bench_suite.OPTIONS.items():
        _, master = bench_suite.run_setup(task, train, 0, name, workers=2)  # what a run of the option trains
        assert master.name == algorithm, name
        for k, v in options.items():
            if k == "lr_scale":  # the network's learning rate, not the master's
                assert v in bench_suite.LR_SCALES, name
            elif k == "outer":  # a named outer updater, made when the run starts
                assert master.outer_updater is not None, name
            elif k == "update_scale_workers":  # the updates times the workers (or a factor of them), outer step or not
                assert master.update_scale == master.outer_update_scale == 2.0 * (1.0 if v is True else v), name
            elif k == "update_scale_sqrt":  # the updates times the square root of the workers, outer step or not
                assert master.update_scale == master.outer_update_scale == pytest.approx(2.0 ** 0.5), name
            elif k == "outer_cosine":  # an outer SGD rate falling from 1 to 0 over the fit's rounds
                tx, g = master.outer_updater, np.ones(3, np.float32)
                rounds = bench_suite.fit_rounds(task, train, options, 2)
                assert rounds == task.epochs  # cancer: 29 minibatches an epoch, a round each at 2 workers
                moved, state = tx.update(g, tx.init(g))
                np.testing.assert_allclose(np.asarray(moved), -g, err_msg=name)
                for _ in range(rounds - 1):
                    moved, state = tx.update(g, state)
                assert 0 < -float(moved[0]) < 0.01, name  # the fit's last round barely moves
            elif k == "outer_rate":  # an outer SGD step at a rate of the workers: it applies their moves' sum
                moved, _ = master.outer_updater.update(np.ones(3), master.outer_updater.init(np.ones(3)))
                np.testing.assert_allclose(np.asarray(moved), -2.0 * np.ones(3), err_msg=name)
            elif k == "band":  # an adaptive threshold's sparsity band
                t = master.threshold_algorithm
                assert (t.min_sparsity, t.max_sparsity) == tuple(v), name
            elif k == "halving_steps":  # an adaptive threshold that halves or doubles over that many steps
                assert master.threshold_algorithm.decay ** v == pytest.approx(0.5), name
            elif k == "threshold_lr":  # a fixed threshold of that many times the task's learning rate
                assert master.threshold_algorithm == dlspark.FixedThreshold(v * task.learning_rate), name
            elif k == "frequent_epochs":  # the first or last epochs a fit of their own at frequency 5
                side, n = v
                (first, e1), (second, e2) = bench_suite.phases(task, name, master)
                assert e1 + e2 == task.epochs and (e1 if side == "first" else e2) == n, name
                frequent, rest = (first, second) if side == "first" else (second, first)
                assert (frequent.averaging_frequency, frequent.outer_updater, rest) == (5, None, master), name
                # the closing (or opening) epochs are the defaults' rounds: updates scaled with the workers
                assert frequent.for_workers(2).update_scale == 2.0, name
                assert master.averaging_frequency == options["averaging_frequency"], name
            elif k in bench_suite.WRAPPER_ONLY:  # the fit's (see the tests below); the master has the others
                rest = {o: x for o, x in options.items() if o != k}
                assert master == bench_suite.make_master(algorithm, rest), name
            else:
                assert getattr(master, k) == (tuple(v) if isinstance(v, list) else v), name
    results = [{"task": "cancer", "run": run, "workers": 2, "seed": s, "value": v}
               for s in (0, 1) for run, v in (("sharing", 0.90), ("sharing-encoded", 0.89),
                                              ("sharing-masking", 0.91 + s / 100))]
    table = bench_suite.options_table(results)
    # an option measured under the former own update is paired with it, not with today's default
    assert table["rows"][0][:6] == ["cancer", "sharing-encoded", "sharing", 2, 2, "-1.00"]
    assert table["rows"][1][:6] == ["cancer", "sharing-masking", "sharing-encoded", 2, 2, "+2.50"]
    assert bench_suite.options_table([r for r in results if r["run"] == "sharing"]) is None
    # averaging's options measured under its former default (unscaled updates) are paired with it
    assert bench_suite.against("averaging-lr-linear") == "averaging-unscaled" == bench_suite.against("averaging-sum")
    assert bench_suite.against("localsgd-f50-nesterov") == "averaging-unscaled"
    assert bench_suite.against("averaging-unscaled") == "averaging" == bench_suite.against("averaging-f50-nesterov-scaled")


def test_a_learning_rate_scaling_option_scales_adams_rate_with_the_workers():
    task = bench_suite.TASKS["cancer"]
    train, _ = task.data()
    runs = {"averaging": 1.0, "averaging-lr-sqrt": 2.0, "averaging-lr-linear": 4.0}
    for run, factor in runs.items():
        net, master = bench_suite.run_setup(task, train, 0, run, workers=4)
        assert master.name == run.split("-")[0] and master.batch_size_per_worker == 16
        # Adam's first step moves each parameter by about its learning rate, whatever the gradient
        before = [np.asarray(p) for p in jax.tree.leaves(net.params)]
        net.fit(train[:16], epochs=1, batch_size=16)
        step = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(jax.tree.leaves(net.params), before))
        assert step == pytest.approx(factor * task.learning_rate, rel=1e-2), run


def test_a_reference_run_is_one_process_at_the_global_minibatch_with_the_scaled_rate(tmp_path):
    out = str(tmp_path / "suite.json")
    # no distributed run is named: no cluster starts, only the single processes train
    results = bench_suite.run_grid(["cancer"], [0], [4], ["single-global-lr-linear"], out)
    runs = {(r["run"], r["workers"]): r["value"] for r in results}
    assert set(runs) == {("single", 1), ("single-global", 4), ("single-global-lr-linear", 4)}
    task = bench_suite.TASKS["cancer"]
    again = bench_suite.single_fit(task, task.data(), 0, batch=64, lr_factor=4.0)["value"]
    assert runs[("single-global-lr-linear", 4)] == again
    tables = bench_suite.summary(bench_suite._results(out))
    assert [row[3] for row in tables[0]["rows"]] == ["single-global-lr-linear"]  # tabled against the single process
    assert tables[1]["rows"] == []  # and not an algorithm under the rule
    # every result names the install it ran under, and the file maps the name to what it was
    saved = bench_suite._load(out)
    here = bench_suite.install()
    assert {r["install"] for r in results} == {bench_suite.install_id(here)}
    assert saved["installs"] == {bench_suite.install_id(here): here}
    assert all(f"{p} " in here for p in NUMERIC_PACKAGES) and "CPU flags " in here
    assert "note" not in tables[0]  # one install: no pair across installs


def test_a_task_outside_the_rule_is_tabled_but_moves_no_verdict():
    def result(task, run, workers, seed, value):
        return {"task": task, "run": run, "workers": workers, "seed": seed, "value": value}

    suite = [result(t, run, w, s, 0.9 if run == "single" else 0.895) for t in bench_suite.SUITE
             for run, w in (("single", 1), ("averaging", 2)) for s in bench_suite.SEEDS]
    outside = [result("tokens-count", run, w, s, 0.9 if run == "single" else 0.5)
               for run, w in (("single", 1), ("averaging", 2)) for s in bench_suite.SEEDS]
    paired, rule = bench_suite.summary(suite + outside)[:2]
    each = [bench_suite.points(bench_suite.TASKS[t], 0.895, 0.9) for t in bench_suite.SUITE]  # MSE: lower is better
    assert rule["rows"] == [["averaging", 2, len(bench_suite.SUITE), f"{min(each):+.2f}", f"{np.mean(each):+.2f}", "yes"]]
    assert "note" not in rule  # every suite task and seed: the verdict, though one task is missing
    row = next(r for r in paired["rows"] if r[0] == "tokens-count")
    assert row[1] == "no (outside the rule)" and row[6] == "-40.00"
    # the same results without one suite task are not a verdict
    assert "note" in bench_suite.summary([r for r in suite if r["task"] != "cancer"] + outside)[1]


def test_an_install_names_a_missing_package_rather_than_failing():
    from _install import install

    here = install(("numpy", "no-such-package-here"))
    assert here.startswith(f"numpy {np.__version__}, no-such-package-here not installed; ") and "CPU flags " in here


def test_pairs_across_installs_are_named_in_the_tables(capsys, tmp_path):
    def result(run, workers, seed, install, value=0.9):
        r = {"task": "cancer", "run": run, "workers": workers, "seed": seed, "epochs": 20, "metric": "accuracy",
             "value": value}
        return {**r, "install": install} if install else r

    singles = [result("single", 1, 0, "aaaa"), result("single", 1, 1, "aaaa")]
    same = singles + [result("sharing", 2, 0, "aaaa"), result("sharing", 2, 1, "aaaa")]
    mixed = singles + [result("sharing", 2, 0, "aaaa"), result("sharing", 2, 1, "bbbb")]
    unknown = singles + [result("sharing", 2, 0, None), result("sharing", 2, 1, None)]
    assert bench_suite.across_installs(mixed, "cancer", "sharing", 2, ("single", 1)) == (1, 2)
    assert bench_suite.across_installs(same, "cancer", "sharing", 2, ("single", 1)) == (0, 2)
    assert bench_suite.across_installs(unknown, "cancer", "sharing", 2, ("single", 1)) == (0, 2)  # not known
    assert "note" not in bench_suite.summary(same)[0]
    assert "cancer sharing at 2 workers (1 of 2)" in bench_suite.summary(mixed)[0]["note"]
    # a run into a file whose single processes came from another install says so before it trains
    out = str(tmp_path / "suite.json")
    bench_suite.write(out, singles, "", "", {"aaaa": "another install"})
    bench_suite.run_grid(["cancer"], [0], [2], [], out)  # trains the single process at the global batch
    assert "run under other installs (aaaa; this one is" in capsys.readouterr().err
    here = bench_suite.install()
    assert bench_suite._contents(out)[1] == {"aaaa": "another install", bench_suite.install_id(here): here}


def test_the_wrapper_runtime_trains_the_clusters_job_to_the_same_bits(client2, tmp_path):
    # gradient sharing's bytes follow every threshold, and each threshold every bit of the residual
    task = dataclasses.replace(bench_suite.TASKS["cancer"], epochs=5)  # 75 steps a replica, as many thresholds
    data = task.data()
    on_cluster = bench_suite.distributed_fit(client2, task, data, 0, "sharing", 2)
    on_devices = bench_suite.wrapper_fit(task, data, 0, "sharing", 2)
    assert on_devices["runtime"] == "wrapper" and on_devices["value"] == on_cluster["value"]
    assert on_devices["bytes_sent"] == on_cluster["bytes_sent"] > 0
    assert on_devices["dense_bytes"] == on_cluster["dense_bytes"] > on_devices["bytes_sent"]
    # a run of two fits of one network (its last two epochs at averaging frequency 5) too, to
    # float rounding: the wrapper's regular rounds step all devices in one compiled call, whose
    # float results differ from one device's in the last bits (the regression's MSE shows it);
    # far closer than to the run's single fit at 50 (4 of the task's 40 epochs)
    task = dataclasses.replace(bench_suite.TASKS["diabetes"], epochs=4)
    data = task.data()
    on_cluster = bench_suite.distributed_fit(client2, task, data, 0, "averaging-f50-scaled-last2-f5", 2)["value"]
    on_devices = bench_suite.wrapper_fit(task, data, 0, "averaging-f50-scaled-last2-f5", 2)["value"]
    assert on_devices == pytest.approx(on_cluster, rel=1e-6)
    assert bench_suite.wrapper_fit(task, data, 0, "averaging-f50-scaled", 2)["value"] != pytest.approx(on_cluster, rel=1e-4)
    # a wrapper's devices step in lockstep: a run that delivers late is refused before any fit
    with pytest.raises(SystemExit, match="sharing-async deliver late"):
        bench_suite.run_grid(["friedman"], [0], [2], ["sharing-async"], str(tmp_path / "s.json"), runtime="wrapper")
    assert not (tmp_path / "s.json").exists()


def test_the_accuracy_benchmarks_wrapper_runtime_trains_the_clusters_job_to_the_same_bits(client2):
    import bench_parity

    task = dataclasses.replace(bench_parity.TASKS["tabular"], epochs=1)
    train, test = bench_parity.TASKS["tabular"].data()
    data = (train[:1024], test)  # 32 steps a worker: the same bits or not, in seconds
    for algorithm in ("averaging", "sharing"):
        options = bench_parity.RUNS[algorithm][1]
        on_cluster = bench_parity.distributed_fit(client2, task, data, 0, algorithm, options)
        on_devices = bench_parity.wrapper_fit(task, data, 0, algorithm, options, 2)
        assert on_devices.pop("runtime") == "wrapper"
        assert on_devices == on_cluster, algorithm
    with pytest.raises(ValueError, match="runtime must be 'cluster' or 'wrapper'"):
        bench_parity.run_grid(["tabular"], 1, [2], ["averaging"], "unused.json", runtime="threads")


def test_the_accuracy_benchmark_judges_by_the_suites_rule():
    import bench_parity

    assert (bench_parity.RULE_EVERY, bench_parity.RULE_MEAN) == (bench_suite.RULE_EVERY, bench_suite.RULE_MEAN)

    def results(diffs):  # the run's accuracy minus the single process's, by task, seeds 0 and 1
        return [r for task, d in diffs.items() for seed in (0, 1)
                for r in ({"task": task, "run": "single", "workers": 1, "seed": seed, "accuracy": 0.5 + seed / 10},
                          {"task": task, "run": "sharing", "workers": 2, "seed": seed, "accuracy": 0.5 + seed / 10 + d})]

    # one task 1.2 points behind fails the rule, one 1.2 points ahead does not (the old rule was two-sided)
    rows = bench_parity.summary_rows(results({"image": -0.012, "tabular": +0.012}))
    by_task = {r[0]: r for r in rows if r[1] == "sharing"}
    assert by_task["image"][6] == "no" and by_task["tabular"][6] == "yes"
    assert by_task["all 2 tasks"][5] == "worst -1.20, average +0.00 pts" and by_task["all 2 tasks"][6] == "no"
    # every task within a point, and their average 0.6 behind: the average fails it
    rows = bench_parity.summary_rows(results({"image": -0.006, "tabular": -0.006}))
    assert [r[6] for r in rows if r[1] == "sharing"] == ["yes", "yes", "no"]
    assert bench_parity.summary_table(results({"image": 0.0})).count("\n") == 1 + 2 + 1


def _one_step(task, run):
    """One minibatch on each of two devices with the XLA encoder, within the run's replaced piece
    of the step if it has one: how far each parameter of the first replica (the network's)
    moved, and the bytes sent."""
    train, _ = task.data()
    net, master = bench_suite.run_setup(task, train, 0, run, 2)

    def flat():
        return np.concatenate([np.ravel(p) for p in jax.tree.leaves(net.params)])

    before = flat()
    wrapper = dlspark.ParallelWrapper(net, master, devices=2, progress=False, sharing_encoder="xla")
    replaced = bench_suite.replaced_piece(run)
    with bench_suite.WRAPPER_ONLY[replaced]() if replaced else contextlib.nullcontext():
        wrapper.fit(train[:32], epochs=1)
    return np.abs(flat() - before), wrapper.communication["bytes_sent"]


def test_the_unencoded_diagnostic_sends_every_element_whole_and_only_within_its_fit(tmp_path):
    # one step on each of two devices: gradient sharing's first messages carry a few of the
    # elements (its warm-up aims at 1e-3 of them; 43 of 1,058 move here), while the unencoded
    # run applies both replicas' whole Adam updates, which move every parameter by up to twice
    # the learning rate
    task = bench_suite.TASKS["cancer"]
    whole, _ = _one_step(task, "sharing-unencoded")
    assert (whole > 0).mean() > 0.9 and whole.max() == pytest.approx(2 * task.learning_rate, rel=1e-2)
    encoded, _ = _one_step(task, "sharing-encoded")  # the library's encoder is back after the diagnostic's fit
    assert 0 < (encoded > 0).mean() < 0.1
    # it runs on the wrapper alone: a cluster's workers encode on their own
    with pytest.raises(SystemExit, match="sharing-unencoded replace a piece of the ParallelWrapper's step"):
        bench_suite.run_grid(["cancer"], [0], [2], ["sharing-unencoded"], str(tmp_path / "s.json"))
    assert not (tmp_path / "s.json").exists()


def test_the_whole_own_update_and_dl4js_send_the_same_bytes_and_move_the_first_replica_apart():
    # one step on each of two devices, from the same start and data: under the whole own update
    # (the default) the first replica (the network's under sharing-first) moves every parameter
    # by its own Adam step (about the learning rate), under sharing-encoded only the few elements
    # both messages carry; the messages, and so the bytes, are the same
    task = bench_suite.TASKS["cancer"]
    own, own_bytes = _one_step(task, "sharing-first")
    encoded, encoded_bytes = _one_step(task, "sharing-encoded")
    assert (own > 0).mean() > 0.9 and np.median(own) == pytest.approx(task.learning_rate, rel=1e-2)
    assert 0 < (encoded > 0).mean() < 0.1
    assert own_bytes == encoded_bytes > 0
    assert bench_suite.against("sharing-masking") == "sharing-encoded" == bench_suite.against("sharing-band")
    assert bench_suite.against("sharing-encoded") == "sharing" == bench_suite.against("sharing-first")
    # options measured without the sparsity warm-up: at 4 workers, where the defaults have DGC's,
    # against the defaults without it
    assert bench_suite.against("sharing-first", 4) == "sharing-no-warmup" == bench_suite.against("sharing-whole-band", 4)
    assert bench_suite.against("sharing-no-warmup", 4) == "sharing" == bench_suite.against("sharing-whole-warmup", 4)
    assert bench_suite.against("sharing-masking", 4) == "sharing-encoded"
    # the default ends with the replicas' mean: where their Adam steps disagree in sign, it
    # moves little
    mean, mean_bytes = _one_step(task, "sharing")
    assert mean_bytes == own_bytes and 0 < (mean < 0.5 * own).mean() < 0.5


def _averaged_params(run, rows):
    """The parameters a two-device averaging fit of cancer's first ``rows`` rows ends with, within
    the run's replaced piece of the step if it has one."""
    task = bench_suite.TASKS["cancer"]
    train, _ = task.data()
    net, master = bench_suite.run_setup(task, train, 0, run, 2)
    wrapper = dlspark.ParallelWrapper(net, master, devices=2, progress=False)
    replaced = bench_suite.replaced_piece(run)
    with bench_suite.WRAPPER_ONLY[replaced]() if replaced else contextlib.nullcontext():
        wrapper.fit(train[:rows], epochs=1)
    return np.concatenate([np.ravel(p) for p in jax.tree.leaves(net.params)])


@pytest.mark.parametrize("run", ["averaging-late", "averaging-eager", "averaging-eager-params"])
def test_the_late_mean_diagnostics_move_each_round_on_before_its_mean(run, tmp_path):
    # one round (5 minibatches a replica at frequency 5): the late mean of the fit's only round is
    # its mean, which the fit ends with: the library's to float rounding (the correction is
    # nothing but rounding: 9.3e-10 late, 6e-8 eager, here)
    np.testing.assert_allclose(_averaged_params(run, 160), _averaged_params("averaging", 160), rtol=0, atol=1e-6)
    # three rounds: each replica trains its second and third before it has the last round's mean
    # (late: from its own state; eager: with only its own share of the last round's move), so
    # the fit ends elsewhere (by up to 2.7e-3 late, 8.3e-3 to 9.5e-3 eager, here), though near (15 Adam
    # steps of at most 1e-3 at scale 2, each way)
    late, library = _averaged_params(run, 480), _averaged_params("averaging", 480)
    assert 1e-4 < np.abs(late - library).max() < 2 * 15 * 2 * 1e-3
    # the library's round is back after the diagnostic's fit
    assert np.array_equal(_averaged_params("averaging", 480), library)
    with pytest.raises(SystemExit, match=f"{run} replace a piece of the ParallelWrapper's step"):
        bench_suite.run_grid(["cancer"], [0], [2], [run], str(tmp_path / "s.json"))


def test_the_bfloat16_exchange_averages_rounded_moves_and_carries_their_error():
    # one round (5 minibatches a replica at frequency 5): each replica's move (at most 5 Adam
    # steps of the rate, 1e-3, times the scale, 2) rounded to bfloat16's 8 bits loses at most
    # 2**-9 of it: the fit ends near the float32 mean's, not on it
    one, exact_one = _averaged_params("averaging-bf16", 160), _averaged_params("averaging", 160)
    assert 0 < np.abs(one - exact_one).max() < 5 * 2 * 1e-3 * 2.0 ** -8
    # three rounds: the rounding errors are carried into the next round's move rather than
    # piling up; the fit stays near the float32 mean's
    three, exact = _averaged_params("averaging-bf16", 480), _averaged_params("averaging", 480)
    assert 0 < np.abs(three - exact).max() < 3 * 5 * 2 * 1e-3 * 2.0 ** -8


def _cluster_params(client, rows, **options):
    """The parameters and round statistics of a two-worker cluster fit of cancer's first
    ``rows`` rows with averaging's defaults (and ``options``)."""
    task = bench_suite.TASKS["cancer"]
    train, _ = task.data()
    net, master = bench_suite.run_setup(task, train, 0, "averaging", 2)
    with dlspark.DistributedTrainer(client, net, dataclasses.replace(master, **options), progress=False) as trainer:
        trainer.fit(train[:rows], epochs=1)
        stats = trainer.last_fit_stats
    return np.concatenate([np.ravel(p) for p in jax.tree.leaves(net.params)]), stats


def test_the_bfloat16_exchange_trains_alike_on_both_runtimes_at_half_the_bytes(client2):
    # three rounds on a two-worker cluster: each worker fetched its peer's moves in bfloat16 and
    # added their mean to the round's start, as the ParallelWrapper's devices do
    moved, stats = _cluster_params(client2, 480, exchange_precision="bfloat16")
    task = bench_suite.TASKS["cancer"]
    train, _ = task.data()
    net, master = bench_suite.run_setup(task, train, 0, "averaging-bf16", 2)
    wrapper = dlspark.ParallelWrapper(net, master, devices=2, progress=False)
    wrapper.fit(train[:480], epochs=1)
    np.testing.assert_allclose(moved, np.concatenate([np.ravel(p) for p in jax.tree.leaves(net.params)]),
                               rtol=0, atol=1e-6)
    exact, exact_stats = _cluster_params(client2, 480)
    assert np.abs(moved - exact).max() > 1e-6  # not the float32 mean
    assert [s["bytes_received"] for s in stats] == [s["bytes_received"] // 2 for s in exact_stats]
    assert len(stats) == 3 and all(s["bytes_received"] > 0 for s in stats)
    # the wrapper's statistics give the cluster's bytes as their equivalent
    assert [s["bytes_equivalent"] for s in wrapper.last_fit_stats] == [s["bytes_received"] for s in stats]
    with pytest.raises(ValueError, match='exchange_precision must be "float32" or "bfloat16", got .float16.'):
        dataclasses.replace(master, exchange_precision="float16")
