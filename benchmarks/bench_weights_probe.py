"""Benchmark: is the predicted weight load right? ``weights probe`` on this machine, the prediction
made from it, and a timed cold read of a generated model, on local disk and on a throttled source.

1. A model-like file set is generated in ``--dir`` (default /var/tmp): ``--gb`` GB (at most 3;
   refused when the filesystem has less than twice that free, plus 1 GB) of random bytes in
   ``--files`` safetensors-named shards, with a config.json and an index.
2. ``api.weights_probe`` on the bundled local inventory (this machine, through the same runner
   ``k3launch weights probe`` uses), ``--path`` that directory, ``--probe-mib`` MiB.
3. The prediction: ``k3launch.planning.loadtime.predict`` on the local plan reshaped to the
   generated model (its weights the generated size; R ranks on the one node, each reading its
   ``1/R`` share, contending for the node's disk) with the probe's throughput.
4. The actual read, as cold as the probe's: every shard's pages dropped (``posix_fadvise
   DONTNEED``, then ``fincore`` says what is still resident), then R readers at once (threads,
   8 MiB buffered reads, as a loader reads), each its share of the shards; and the same with
   ``dd iflag=direct`` (O_DIRECT, the probe's own method) per reader.

The throttled source: this process joins a block-I/O cgroup that limits reads from the disk
holding ``--dir`` to ``--throttle-mbps`` MB/s (cgroup v2 ``io.max rbps=``; on a cgroup v1 host
``blkio.throttle.read_bps_device``), so the probe and the reads run under the limit; it needs
root and the disk's major:minor. ``--throttle-mbps 0`` skips it; when it cannot be set up the
benchmark says why. The throttled run reads the first ``--throttle-gb`` GB of shards only.

Prints figures (predicted, actual, actual / predicted); asserts nothing.

Run: python benchmarks/bench_weights_probe.py [--gb 2.5] [--files 10] [--readers 1,2,4] [--runs 3] [--dir /var/tmp] [--throttle-mbps 100]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from k3launch import api
from k3launch.models.plan import Plan
from k3launch.models.weights import METHODS, Probe
from k3launch.planning.loadtime import predict

MB = 1_000_000
CHUNK = 8 << 20


def generate(root: Path, gb: float, files: int) -> list[Path]:
    """``files`` shards of random bytes totalling ``gb`` GB, named and indexed as a safetensors checkpoint."""
    root.mkdir(parents=True, exist_ok=True)
    each = int(gb * 1e9 / files)
    shards = []
    block = os.urandom(CHUNK)
    for i in range(files):
        p = root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with p.open("wb") as fh:
            left = each
            while left > 0:  # a fresh random block per write: nothing for a compressing filesystem to shrink
                block = os.urandom(min(CHUNK, left))
                fh.write(block)
                left -= len(block)
            fh.flush()
            os.fsync(fh.fileno())
        shards.append(p)
    (root / "config.json").write_text(json.dumps({"architectures": ["Generated"], "bytes": each * files}))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"t{i}": s.name for i, s in enumerate(shards)}}))
    return shards


def drop(paths: list[Path]) -> int:
    """Drop the files' pages from the page cache; the bytes fincore still reports resident (-1: no fincore)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None:
        return -1
    out = subprocess.run(["fincore", "-nb", "-o", "RES", *map(str, paths)], capture_output=True, text=True, check=False).stdout
    return sum(int(x) for x in out.split() if x.isdigit())


def read_buffered(paths: list[Path], readers: int) -> float:
    """Seconds for ``readers`` threads to read their shares of ``paths`` (8 MiB buffered reads)."""
    shares = [paths[i::readers] for i in range(readers)]

    def one(share: list[Path]) -> None:
        for p in share:
            with p.open("rb", buffering=0) as fh:
                while fh.read(CHUNK):
                    pass

    threads = [threading.Thread(target=one, args=(s,)) for s in shares]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def read_direct(paths: list[Path], readers: int) -> float:
    """Seconds for ``readers`` processes to read their shares with ``dd iflag=direct`` (O_DIRECT)."""
    shares = [paths[i::readers] for i in range(readers)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["bash", "-c", " && ".join(f"dd if={p} of=/dev/null bs=4M iflag=direct status=none" for p in s)])
             for s in shares if s]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0


def shaped(plan: Plan, gb: float, readers: int) -> Plan:
    """The local plan reshaped to the generated model: its weights ``gb``; ``readers`` TP ranks on its one node."""
    pool = plan.capacity.pools[0].model_copy(update={"weights_gb": gb, "tp": readers, "dp": 1, "pp": 1, "parallelism": "tp"})
    cap = plan.capacity.model_copy(update={"weights_gb": gb, "checkpoint_gb": gb, "pools": [pool]})
    procs = [p.model_copy(update={"gpus": readers}) if p.role != "router" else p for p in plan.processes]
    return plan.model_copy(update={"capacity": cap, "processes": procs})


def disk_of(path: Path) -> str:
    """major:minor of the whole disk holding ``path`` (throttles apply to a disk, not a partition)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sysdir = Path(f"/sys/dev/block/{major}:{minor}")
    if (sysdir / "partition").exists():
        return (sysdir.resolve().parent / "dev").read_text().strip()
    return f"{major}:{minor}"


@contextlib.contextmanager
def throttled(path: Path, mbps: float) -> Iterator[str]:
    """This process in a cgroup whose reads from ``path``'s disk are limited to ``mbps`` MB/s; yields how."""
    dev = disk_of(path)
    bps = int(mbps * MB)
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "io" in (v2 / "cgroup.controllers").read_text().split():
        root, limit_file, limit, how = v2, "io.max", f"{dev} rbps={bps}", f"cgroup v2 io.max {dev} rbps={bps}"
        with contextlib.suppress(OSError):
            (v2 / "cgroup.subtree_control").write_text("+io")
    elif (Path("/sys/fs/cgroup/blkio") / "blkio.throttle.read_bps_device").exists():
        root, limit_file, limit = Path("/sys/fs/cgroup/blkio"), "blkio.throttle.read_bps_device", f"{dev} {bps}"
        how = f"cgroup v1 blkio.throttle.read_bps_device {dev} {bps}"
    else:
        raise RuntimeError("no cgroup io controller (v2 io.max or v1 blkio throttle) on this machine")
    group = root / f"k3bench-{os.getpid()}"
    before = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if (line.split(":")[1] == "blkio" if root.name == "blkio" else line.startswith("0::"))), "/")
    group.mkdir()
    try:
        (group / limit_file).write_text(limit)
        (group / "cgroup.procs").write_text(str(os.getpid()))
        try:
            yield how
        finally:
            (root / before.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
    finally:
        for _ in range(50):  # children (dd, bash) may still be leaving
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def scenario(title: str, plan: Plan, inv: Path, shards: list[Path], probe_mib: int, readers: list[int], runs: int) -> None:
    gb = sum(p.stat().st_size for p in shards) / 1e9
    probes = api.weights_probe(plan, inv, path=str(shards[0].parent), size=probe_mib << 20, timeout=120)
    p: Probe = probes[0]
    if not p.ok:
        print(f"{title}: the probe failed: {p.error}")
        return
    print(f"\n{title}: {gb:.2f} GB in {len(shards)} shards")
    print(f"  probe: {p.read_mbps:,.0f} MB/s reading {p.bytes / MB:,.0f} MB ({METHODS[p.method]}); write {p.write_mbps:,.0f} MB/s")
    print(f"  actual: best / median of {runs} cold reads; ratio: actual / predicted (best, median)")
    print(f"  {'readers':>7}  {'predicted':>10}  {'buffered':>16}  {'ratio':>11}  {'O_DIRECT':>16}  {'ratio':>11}  resident before")
    for r in readers:
        pred = predict(shaped(plan, gb, r), {plan.processes[0].node: p.read_mbps / 1e3})
        assert pred is not None
        buffered, direct, resident = [], [], 0
        for _ in range(runs):
            resident = max(resident, drop(shards))
            buffered.append(read_buffered(shards, r))
            drop(shards)
            direct.append(read_direct(shards, r))
        b, d, s = sorted(buffered), sorted(direct), pred.total_s
        res_txt = "fincore missing" if resident < 0 else f"{resident / MB:,.1f} MB"
        print(f"  {r:>7}  {s:>9.2f}s  {b[0]:>6.2f}s / {statistics.median(b):>6.2f}s  {b[0] / s:>4.2f} / {statistics.median(b) / s:>4.2f}  "
              f"{d[0]:>6.2f}s / {statistics.median(d):>6.2f}s  {d[0] / s:>4.2f} / {statistics.median(d) / s:>4.2f}  {res_txt}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.5, help="size of the generated model (at most 3 GB)")
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--readers", default="1,2,4", help="ranks reading at once on the node")
    ap.add_argument("--dir", default="/var/tmp", help="where the model is generated (a real disk, not tmpfs)")
    ap.add_argument("--probe-mib", type=int, default=256)
    ap.add_argument("--throttle-mbps", type=float, default=100.0, help="read limit of the throttled run (0: skip it)")
    ap.add_argument("--throttle-gb", type=float, default=0.8, help="GB of shards the throttled run reads")
    ap.add_argument("--runs", type=int, default=3, help="cold reads per reader count (best and median)")
    a = ap.parse_args()
    gb = min(a.gb, 3.0)
    readers = [int(x) for x in a.readers.split(",")]
    base = Path(a.dir)
    free = shutil.disk_usage(base).free
    if free < 2 * gb * 1e9 + 1e9:
        sys.exit(f"{base} has {free / 1e9:.1f} GB free: not enough for a {gb:g} GB model (needs twice that plus 1 GB)")
    inv = api.bundled_inventory("local")
    plan = api.plan(inv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="k3bench-weights-", dir=base) as tmp:
        t0 = time.perf_counter()
        shards = generate(Path(tmp) / "model", gb, a.files)
        print(f"generated {gb:g} GB in {a.files} shards under {tmp} in {time.perf_counter() - t0:.1f} s; "
              f"disk {disk_of(base)}; load average {load:.2f}; {os.cpu_count()} CPUs")
        scenario("local disk", plan, inv, shards, a.probe_mib, readers, a.runs)
        if a.throttle_mbps > 0:
            part, size = [], 0
            for s in shards:
                if size >= a.throttle_gb * 1e9:
                    break
                part.append(s)
                size += s.stat().st_size
            try:
                with throttled(base, a.throttle_mbps) as how:
                    scenario(f"throttled source ({how})", plan, inv, part, min(a.probe_mib, 128), readers, a.runs)
            except (OSError, RuntimeError) as exc:
                print(f"\nthrottled source: not measured: {exc}")


if __name__ == "__main__":
    main()
