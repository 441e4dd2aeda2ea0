"""Fetch the wheels a GPU host without a package index needs: dask, distributed and their
pure-Python needs, and xxhash (dlspark's one binary need that JAX does not bring), for Python
3.12 on manylinux x86-64, as listed (versions and sha256) in
``wheels.lock`` beside this file. They land in ``benchmarks/device/wheels/`` (kept out of git),
where ``run.py`` installs them offline::

    python benchmarks/device/fetch_wheels.py            # fetch what wheels.lock lists, check the hashes
    python benchmarks/device/fetch_wheels.py --debs     # also iproute2's Debian packages (apt-get download)
    python benchmarks/device/fetch_wheels.py --relock /path/to/python3.12 dask==X distributed==X xxhash==X

``--relock`` resolves the closure anew with that interpreter's pip (pip evaluates the
requirements' environment markers against the interpreter it runs in, not against
``--python-version``, so the closure for 3.12 is resolved by a 3.12) and rewrites the lock.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
LOCK = os.path.join(HERE, "wheels.lock")
WHEELS = os.path.join(HERE, "wheels")
#: what the run's files may weigh on the device machine's copy of the tree
MAX_BYTES = 64 * 2**20
#: the target: the GPU host's interpreter and machine
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
          *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                        "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64",
                        "manylinux_2_5_x86_64", "manylinux1_x86_64") for a in ("--platform", p)]]

#: iproute2 and the libraries its ip, tc and bridge link to, for a host without them (the
#: network section; run.py unpacks them into a folder of its own, nothing is installed)
DEBS = os.path.join(HERE, "debs")
DEB_PACKAGES = ("iproute2", "libbpf1", "libelf1", "libmnl0", "libbsd0", "libmd0", "libcap2", "libxtables12")

_LINE = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def read_lock(path: str = LOCK) -> dict:
    """``{name: (version, [sha256, ...])}`` from a requirements file in pip's hash-checking form."""
    text = open(path, encoding="utf-8").read().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        m = _LINE.match(line)
        if m:
            pins[m.group(1).lower()] = (m.group(2), _HASH.findall(line))
    if not pins:
        raise ValueError(f"{path} pins no package (expected lines such as 'dask==2026.7.1 --hash=sha256:...')")
    return pins


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def check_wheels(folder: str = WHEELS, lock: str = LOCK) -> list:
    """The wheel files in ``folder`` that the lock names, each checked against its sha256.

    Raises ``ValueError`` naming a package with no wheel, a wheel whose hash the lock does not
    list, or a set over :data:`MAX_BYTES`."""
    pins = read_lock(lock)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".whl")) if os.path.isdir(folder) else []
    by_name = {_normal(f.split("-", 1)[0]): f for f in files}
    found, total = [], 0
    for name, (version, hashes) in sorted(pins.items()):
        f = by_name.get(_normal(name))
        if f is None or f.split("-")[1] != version:
            raise ValueError(f"no wheel of {name}=={version} in {folder} (found {f!r}); "
                             "fetch them with: python benchmarks/device/fetch_wheels.py")
        path = os.path.join(folder, f)
        digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
        if digest not in hashes:
            raise ValueError(f"{f} has sha256 {digest}, which {os.path.basename(lock)} does not list for {name}")
        found.append(path)
        total += os.path.getsize(path)
    if total > MAX_BYTES:
        raise ValueError(f"the wheels weigh {total / 2**20:.1f} MiB, over the {MAX_BYTES / 2**20:.0f} MiB a run carries")
    return found


def fetch(folder: str = WHEELS, lock: str = LOCK) -> list:
    os.makedirs(folder, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", *TARGET,
                    "-r", lock, "-d", folder], check=True)
    return check_wheels(folder, lock)


def fetch_debs(folder: str = DEBS) -> list:
    """``apt-get download`` :data:`DEB_PACKAGES` (this machine's Debian release, amd64) into
    ``folder``; apt checks them against the archive's signed indexes."""
    os.makedirs(folder, exist_ok=True)
    subprocess.run(["apt-get", "download", *DEB_PACKAGES], cwd=folder, check=True)
    for f in os.listdir(folder):  # an epoch's colon comes escaped (libcap2_1%3a2.66...): plain names travel best
        if "%" in f:
            os.replace(os.path.join(folder, f), os.path.join(folder, f.replace("%3a", "_")))
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".deb"))


def relock(python: str, requirements: list, lock: str = LOCK) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", *TARGET,
                        "--target", os.path.join(tmp, "t"), "--report", report, *requirements], check=True)
        items = json.load(open(report))["install"]
    names = ", ".join(r.split("==")[0] for r in requirements)
    lines = [f"# {names} and their needs, for Python 3.12 on manylinux x86-64: what",
             "# benchmarks/device/run.py installs offline on a GPU host that has JAX but no package index.",
             "# Fetch: python benchmarks/device/fetch_wheels.py",
             f"# Resolved with: python benchmarks/device/fetch_wheels.py --relock PYTHON3.12 {' '.join(requirements)}"]
    for item in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
        digest = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{item['metadata']['name'].lower()}=={item['metadata']['version']} \\\n"
                     f"    --hash=sha256:{digest}")
    tmp_lock = lock + ".tmp"
    with open(tmp_lock, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp_lock, lock)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--relock", metavar="PYTHON3.12", help="resolve the closure anew with this interpreter's pip")
    ap.add_argument("requirements", nargs="*", help="with --relock: the top-level pins, e.g. dask==2026.7.1")
    ap.add_argument("--dest", default=WHEELS, help="where the wheels go (default: %(default)s)")
    ap.add_argument("--debs", action="store_true", help=f"also download {', '.join(DEB_PACKAGES)} into {DEBS}")
    args = ap.parse_args(argv)
    if args.relock:
        if not args.requirements:
            ap.error("--relock needs the top-level pins, e.g. dask==2026.7.1 distributed==2026.7.1")
        relock(args.relock, args.requirements)
    paths = fetch(args.dest)
    size = sum(os.path.getsize(p) for p in paths)
    print(f"{len(paths)} wheels, {size / 2**20:.1f} MiB, hashes as locked, in {args.dest}")
    if args.debs:
        debs = fetch_debs()
        print(f"{len(debs)} Debian packages, {sum(map(os.path.getsize, debs)) / 2**20:.1f} MiB, in {DEBS}")


if __name__ == "__main__":
    main()
