"""Issue 16 part 1, the variants not tried before: more copy threads, and the inputs' page cache.

    python bench/bench_copy_variants.py [--ckpt bench/cache/z3_d1024_l26_ws4] [--runs 5]

In one process, the consolidation plan of a checkpoint (fp32 masters -> one flat output, the bytes a
safetensors file holds after its header) is executed by variants of the same ``copy_file_range`` loop:

* ``serial``: one thread, pieces in plan order (what ``io/writer.py`` does);
* ``threads2`` / ``threads4``: the pieces split into 2 / 4 runs of about equal bytes, one thread each;
* ``serial+dontneed``: serial, then ``POSIX_FADV_DONTNEED`` on every input (drop what it cached);
* ``cold serial`` / ``cold cp``: page cache dropped first (``/proc/sys/vm/drop_caches``, needs root),
  the loop against ``cp --reflink=never`` of a file of the output's size.

Warm variants alternate; every run starts from warm inputs (read once untimed) and a removed output;
``sync`` untimed before each. Prints medians (min-max) and the ratio to ``serial``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from dsckpt.plan.consolidate import build_plan  # noqa: E402
from dsckpt.zero.reader import open_checkpoint  # noqa: E402


def pieces_of(ckpt_dir: Path) -> list[tuple[str, int, int, int]]:
    """(source path, source offset, nbytes, output offset) for every piece, in plan order."""
    out, pos = [], 0
    for t in build_plan(open_checkpoint(ckpt_dir)).tensors:
        for p in t.pieces:
            out.append((str(p.path), p.offset, p.nbytes, pos))
            pos += p.nbytes
    return out


def copy(pieces, dst_fd: int, fds: dict[str, int]) -> None:
    for path, src_off, nbytes, dst_off in pieces:
        done = 0
        while done < nbytes:
            n = os.copy_file_range(fds[path], dst_fd, nbytes - done, src_off + done, dst_off + done)
            if n == 0:
                raise OSError(f"{path}: short copy")
            done += n


def split(pieces, parts: int):
    total, runs, current, acc = sum(p[2] for p in pieces), [], [], 0
    for p in pieces:
        current.append(p)
        acc += p[2]
        if acc >= total * (len(runs) + 1) / parts and len(runs) < parts - 1:
            runs.append(current)
            current = []
    return runs + [current]


def run_variant(name: str, pieces, out: Path, total: int) -> float:
    fds = {path: os.open(path, os.O_RDONLY) for path in {p[0] for p in pieces}}
    try:
        out.unlink(missing_ok=True)
        subprocess.run(["sync"], check=True)
        if name.startswith("cold"):
            Path("/proc/sys/vm/drop_caches").write_text("1")
        start = time.perf_counter()
        dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(dst, total)
        threads = int(name[-1]) if name.startswith("threads") else 1
        if threads == 1:
            copy(pieces, dst, fds)
        else:
            workers = [threading.Thread(target=copy, args=(part, dst, fds)) for part in split(pieces, threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        os.close(dst)
        if name.endswith("dontneed"):
            for fd in fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return time.perf_counter() - start
    finally:
        for fd in fds.values():
            os.close(fd)


def warm(paths) -> None:
    for path in paths:
        with open(path, "rb") as fh:
            while fh.read(16 << 20):
                pass


def cold_cp(source: Path, dest: Path) -> float:
    dest.unlink(missing_ok=True)
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("1")
    start = time.perf_counter()
    subprocess.run(["cp", "--reflink=never", str(source), str(dest)], check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, default=HERE / "cache" / "z3_d1024_l26_ws4")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    pieces = pieces_of(args.ckpt)
    total = sum(p[2] for p in pieces)
    scratch = HERE / "out"
    scratch.mkdir(exist_ok=True)
    out, cp_source, cp_dest = scratch / "variant.bin", scratch / "cp_source.bin", scratch / "cp_dest.bin"
    sources = sorted({p[0] for p in pieces})
    print(f"{args.ckpt.name}: {len(pieces):,} pieces, {total / 2**30:.2f} GiB out of {len(sources)} files\n")
    times: dict[str, list[float]] = {}
    warm_variants = ("serial", "threads2", "threads4", "serial+dontneed")
    for _ in range(args.runs):
        for name in warm_variants:
            warm(sources)
            times.setdefault(name, []).append(run_variant(name, pieces, out, total))
    can_drop = os.access("/proc/sys/vm/drop_caches", os.W_OK)
    if can_drop:
        run_variant("serial", pieces, cp_source, total)  # a file of the output's size for cp
        for _ in range(args.runs):
            times.setdefault("cold serial", []).append(run_variant("cold serial", pieces, out, total))
            times.setdefault("cold cp", []).append(cold_cp(cp_source, cp_dest))
    base = statistics.median(times["serial"])
    print("| variant | median s (min-max) | vs serial |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} ({min(ts):.3f}-{max(ts):.3f}) | {med / base:.2f}x |")
    if not can_drop:
        print("\n(cold runs skipped: /proc/sys/vm/drop_caches is not writable here)")
    for f in (out, cp_source, cp_dest):
        f.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
