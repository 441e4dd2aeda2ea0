"""The device run (``benchmarks/device/run.py``) as a dry run on this machine's CPU: the same
script the GPU host runs, so that it cannot rot between the rare runs there."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "benchmarks", "device", "run.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "device"))

from fetch_wheels import LOCK, check_wheels, read_lock  # noqa: E402

#: the only skips a dry run may record: the network benchmark's, where this machine lacks what it needs
NETWORK_SKIPS = ("benchmarks/bench_network.py is not in this tree", "network namespaces do not work here")


def _problems(tree, where=""):
    """Every piece of a section's result that recorded an error or a skip, by its place."""
    if isinstance(tree, dict):
        found = [f"{where}: {tree.get('error') or tree.get('skipped')}"] if ("error" in tree or "skipped" in tree) else []
        return found + [p for k, v in tree.items() for p in _problems(v, f"{where}.{k}")]
    if isinstance(tree, list):
        return [p for i, v in enumerate(tree) for p in _problems(v, f"{where}[{i}]")]
    return []


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    # a machine shared with other heavy work may need longer budgets than the dry run's own
    scale = os.environ.get("DLSPARK_DEVICE_BUDGET_SCALE", "1")
    proc = subprocess.run([sys.executable, RUN, "--out", str(out), "--dry-run", "--budget-scale", scale],
                          capture_output=True, text=True, timeout=float(scale) * 900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "device.log").exists()
    return json.loads((out / "device.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(float(os.environ.get("DLSPARK_DEVICE_BUDGET_SCALE", "1")) * 900 + 60)
def test_the_dry_run_runs_every_section_but_the_gpu_readings(report):
    assert report["schema"] == 1 and report["dry_run"] is True and report["finished"]
    assert report["install"]["versions"]["dask"] and "nothing" in report["install"]["done"]
    assert list(report["sections"]) == ["gpu_cluster", "gpu_parallel", "network", "many_core"]
    for name in ("gpu_cluster", "gpu_parallel", "many_core"):
        section = report["sections"][name]
        assert section["status"] == "ok", (name, section.get("log_tail"))
        assert section["result"]["done"] is True
        assert _problems(section["result"]) == [], name

    gpu = report["sections"]["gpu_cluster"]["result"]
    assert gpu["platform"] == "cpu" and gpu["client_backend"] == "cpu"
    assert gpu["nvidia_smi"] == {"unavailable": "nvidia-smi is not on the PATH"}  # the GPU-only reading
    assert gpu["digits"]["test_accuracy"] > 0.5 and gpu["digits"]["local"] is True  # the full run's: False
    (worker,) = gpu["worker_vs_plain"]
    assert worker["algorithm"] == "averaging" and worker["job_steps_per_s"] > 0 and worker["plain_steps_per_s"] > 0
    assert worker["efficiency"] > 0 and isinstance(worker["meets_target"], bool)
    (preallocated,) = gpu["memory"].values()  # the setting's own worker, started with both variables set
    assert preallocated["settings"] == {"preallocate": True, "memory_fraction": 0.3}
    assert preallocated["worker"]["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert preallocated["worker"]["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3"
    assert preallocated["worker"]["platform"] == "cpu" and preallocated["worker"]["pid"] != os.getpid()

    wrapper = report["sections"]["gpu_parallel"]["result"]
    assert wrapper["platform"] == "cpu" and wrapper["auto_encoder"]["encoder"] == "host"
    (sharing,) = wrapper["sharing"]
    assert sharing["host"]["encoder"] == "host" and sharing["xla"]["encoder"] == "xla"
    assert sharing["host"]["steps_per_s"] > 0 and sharing["xla"]["steps_per_s"] > 0 and sharing["plain"]["steps_per_s"] > 0
    assert sharing["bits"]["params_equal"] is True and sharing["bits"]["max_abs_difference"] == 0.0
    assert sharing["bits"]["communication_equal"] and sharing["bits"]["thresholds_equal"]

    cores = report["sections"]["many_core"]["result"]
    runs = cores["runs"]
    assert [(r["algorithm"], r["network"]) for r in runs] == [("sharing", "cnn")]
    for r in runs:
        assert r["workers"] == 2 and r["worker_cores"] == cores["cores"][:2] and r["client_cores"]
        assert r["efficiency"] > 0 and r["cluster_bound"] > 0 and r["plain_step_ms"] > 0
    assert [s["efficiency"]["n"] for s in cores["summary"]] == [1]

    network = report["sections"]["network"]
    assert isinstance(network["result"]["namespaces"]["ok"], bool)
    if network["status"] == "skipped":
        assert network["result"]["skipped"].startswith(NETWORK_SKIPS)
    else:
        assert network["status"] == "ok" and _problems(network["result"]) == []
        (row,) = network["result"]["rows"]
        assert row["workers"] == 2 and row["contender"] == "averaging5" and row["over_plain"]["median"] > 0
        assert row["wire_tx_per_worker_per_fit"] > 0  # read from the namespaces' interface counters


def test_every_measured_segment_counts_rounds_in_the_full_and_the_dry_run():
    import run
    import sections

    for plan in (run.FULL, run.DRY):
        gpu, cores = plan["gpu_cluster"], plan["many_core"]
        measured = [(rounds, gpu["segments"], a) for a in gpu["algorithms"] for _, rounds in gpu["worker_batches"]]
        measured += [(cores["n_rounds"], cores["segments"], a) for a, _ in cores["pairs"]]
        for n_rounds, segments, algorithm in measured:
            assert sections.counted_rounds(n_rounds, segments, algorithm) >= 1, (n_rounds, segments, algorithm)
    assert sections.counted_rounds(24, 3, "sharing") == 0  # what the full run had first: nothing to divide by


def test_the_gpu_worker_is_measured_with_every_algorithm_before_a_second_minibatch():
    import run
    import sections

    pieces = sections.worker_pieces(run.FULL["gpu_cluster"])
    assert [(a, b) for a, b, _ in pieces[:2]] == [("averaging", 160), ("sharing", 160)]
    assert sorted(pieces) == sorted((a, b, r) for a in run.FULL["gpu_cluster"]["algorithms"]
                                    for b, r in run.FULL["gpu_cluster"]["worker_batches"])


def test_the_lock_pins_dask_and_distributed_with_hashes():
    pins = read_lock(LOCK)
    assert {"dask", "distributed", "tornado", "zict", "tblib", "partd", "locket", "xxhash"} <= set(pins)
    assert pins["dask"][0] == pins["distributed"][0]  # distributed pins its own dask release
    assert all(len(hashes) >= 1 and all(len(h) == 64 for h in hashes) for _, hashes in pins.values())


def test_a_wheel_whose_hash_the_lock_does_not_list_is_refused(tmp_path):
    lock = tmp_path / "wheels.lock"
    lock.write_text("toolz==1.2.0 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    (tmp_path / "toolz-1.2.0-py3-none-any.whl").write_bytes(b"not the locked wheel")
    with pytest.raises(ValueError, match=r"toolz-1.2.0-py3-none-any.whl has sha256 [0-9a-f]{64}, which wheels.lock "
                                         r"does not list for toolz"):
        check_wheels(str(tmp_path), str(lock))
    (tmp_path / "toolz-1.2.0-py3-none-any.whl").unlink()
    with pytest.raises(ValueError, match=r"no wheel of toolz==1.2.0 in .*fetch_wheels.py"):
        check_wheels(str(tmp_path), str(lock))


def test_a_debian_package_is_unpacked_beside_the_tree_and_its_programs_run_with_its_libraries(tmp_path):
    # a host without iproute2 gets it from benchmarks/device/debs this way (nothing installed)
    import shutil

    import run

    if shutil.which("dpkg-deb") is None:
        pytest.skip("dpkg-deb is not installed (a Debian tool): the package cannot be built here")
    pkg = tmp_path / "pkg"
    (pkg / "DEBIAN").mkdir(parents=True)
    (pkg / "DEBIAN" / "control").write_text("Package: dlspark-probe\nVersion: 1.0\nArchitecture: all\n"
                                            "Maintainer: dlspark\nDescription: a test package\n")
    (pkg / "usr" / "sbin").mkdir(parents=True)
    (pkg / "usr" / "sbin" / "probe").write_text('#!/bin/sh\necho "libraries: $LD_LIBRARY_PATH"\n')
    (pkg / "usr" / "sbin" / "probe").chmod(0o755)
    (pkg / "usr" / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    (pkg / "usr" / "lib" / "x86_64-linux-gnu" / "libprobe.so.1").write_bytes(b"\x7fELF")
    debs = tmp_path / "debs"
    debs.mkdir()
    subprocess.run(["dpkg-deb", "--build", str(pkg), str(debs / "probe_1.0_all.deb")], check=True,
                   capture_output=True)
    prefix = tmp_path / "prefix"
    tools = run.unpack_debs(str(debs), str(prefix))
    assert tools["packages"] == ["probe_1.0_all.deb"]
    assert (prefix / "usr" / "lib" / "x86_64-linux-gnu" / "libprobe.so.1").read_bytes() == b"\x7fELF"
    out = subprocess.run([os.path.join(tools["bin"], "probe")], capture_output=True, text=True, check=True).stdout
    assert f"{prefix}/usr/lib/x86_64-linux-gnu" in out
    env = run._env_for("network", True, None, str(tmp_path), tools)
    assert env["PATH"].split(os.pathsep)[0] == tools["bin"]
    assert "PATH" not in {k for k, v in run._env_for("many_core", True, None, str(tmp_path), tools).items()
                          if v != os.environ.get(k)}
    assert run.unpack_debs(str(tmp_path / "none"), str(prefix)) == {"packages": []}
    (debs / "bad.deb").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="bad.deb is not a Debian package"):
        run.unpack_debs(str(debs), str(tmp_path / "prefix2"))
