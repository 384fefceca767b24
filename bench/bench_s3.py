"""Issue 41: `consolidate s3://... s3://...` against what a user does today, on an S3-protocol server.

    python bench/bench_s3.py [--layers 4] [--runs 3]          (starts moto's server on a loopback port)
    python bench/bench_s3.py --endpoint http://host:9000 ...  (any S3 endpoint: MinIO, Ceph; bucket created)

The checkpoint: bench_consolidate.generate (ZeRO-3, world size 4, real DeepSpeed), uploaded once.  Alternating,
each a fresh process (peak RSS of its own tree via ``os.wait4``):
  dsckpt      ``dsckpt consolidate s3://B/ckpt s3://B/out.safetensors`` (ranged GETs, upload)
  get-then    s3fs ``get`` of the whole checkpoint, ``dsckpt consolidate`` of the local copy, s3fs ``put`` of the result
              (what a user does today, with the fastest local converter)
  get         the plain ranged GETs of the bytes consolidate needs, 16 in flight (issue 41's floor)
  get+put     the same, then a multipart upload of as many bytes (16 parts in flight): the transfers alone, one
              after the other; no parsing, no checking, nothing written locally
Prints medians and ratios measured in the same run, and the CPU seconds of each approach and of the local server
while it ran (the server shares the host's cores: on a small host the transfers' own CPU is the bound); JSON beside
it with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from bench_consolidate import PY, generate, timed_cpu  # noqa: E402

BUCKET = "dsckpt-bench"

GET_THEN = """
import subprocess, sys, tempfile, fsspec
fs = fsspec.filesystem("s3")
with tempfile.TemporaryDirectory(dir=sys.argv[3]) as tmp:
    fs.get(sys.argv[1] + "/", tmp + "/ckpt/", recursive=True)
    subprocess.run([sys.executable, "-m", "dsckpt", "consolidate", tmp + "/ckpt", tmp + "/out.safetensors", "-q",
                    "--no-client-state"], check=True)
    fs.put_file(tmp + "/out.safetensors", sys.argv[2])
"""

FLOOR = """
import json, sys, fsspec
from concurrent.futures import ThreadPoolExecutor
fs = fsspec.filesystem("s3")
ranges = json.loads(open(sys.argv[1]).read())
chunks = [(k, s + o, min(s + o + (8 << 20), s + n)) for k, s, n in ranges for o in range(0, n, 8 << 20)]
with ThreadPoolExecutor(16) as pool:
    total = sum(pool.map(lambda c: len(fs.cat_file(c[0], start=c[1], end=c[2])), chunks))
if not sys.argv[2:]:
    sys.exit(0)
bucket, key, _ = fs.split_path(sys.argv[2])  # as many bytes back up: 8 MiB parts, 16 in flight, from memory
upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
block = bytes(8 << 20)
sizes = [min(len(block), total - o) for o in range(0, total, len(block))]
put = lambda i: fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=i + 1,
                           Body=block[:sizes[i]])["ETag"]
with ThreadPoolExecutor(16) as pool:
    etags = list(pool.map(put, range(len(sizes))))
fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
           MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]})
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU of process ``pid`` so far (0 without one: a remote endpoint)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def needed_ranges(ckpt: Path, prefix: str) -> list[tuple[str, int, int]]:
    """The storages consolidate reads, as (key, offset, bytes)."""
    from dsckpt.formats.torchzip import TorchFile
    from dsckpt.plan.consolidate import build_plan
    from dsckpt.zero.reader import open_checkpoint

    plan = build_plan(open_checkpoint(ckpt))
    wanted = {}
    for piece in (p for t in plan.tensors for p in t.pieces):
        path = getattr(piece, "path", None)
        if path is None:
            continue
        for loc in TorchFile(path).storages.values():
            if loc.offset < piece.offset + piece.nbytes and piece.offset < loc.offset + loc.nbytes:
                wanted[(str(path), loc.offset)] = loc.nbytes
    return [(f"{prefix}/{Path(p).relative_to(ckpt).as_posix()}", off, n) for (p, off), n in sorted(wanted.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of starting moto's server")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    server = None
    if args.endpoint is None:
        port = free_port()
        server = subprocess.Popen([PY, "-m", "moto.server", "-p", str(port)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        args.endpoint = f"http://127.0.0.1:{port}"
        for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}.items():
            os.environ.setdefault(key, value)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("moto's server did not start")
                time.sleep(0.1)
    os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        run(args, server.pid if server else None)
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)


def run(args: argparse.Namespace, server: int | None) -> None:
    import fsspec

    ckpt = generate(3, args.layers)
    fs = fsspec.filesystem("s3")
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    prefix = f"{BUCKET}/{ckpt.name}"
    if not fs.exists(f"{prefix}/latest"):
        fs.put(f"{ckpt}/", f"{prefix}/", recursive=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    ranges_file = scratch / "ranges.json"
    ranges = needed_ranges(ckpt, prefix)
    ranges_file.write_text(json.dumps(ranges))
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    commands = {
        "dsckpt": [PY, "-m", "dsckpt", "consolidate", f"s3://{prefix}", f"s3://{BUCKET}/out/dsckpt.safetensors",
                   "--force", "-q", "--no-client-state"],
        "get-then": [PY, "-c", GET_THEN, f"{prefix}", f"{BUCKET}/out/get-then.safetensors", str(scratch)],
        "get+put": [PY, "-c", FLOOR, str(ranges_file), f"{BUCKET}/out/floor.bin"],
        "get": [PY, "-c", FLOOR, str(ranges_file)],
    }
    results: dict[str, list[tuple[float, int, float, float]]] = {k: [] for k in commands}  # wall, RSS, CPU, server CPU
    for r in range(args.runs):
        for name in (list(commands) if r % 2 == 0 else list(commands)[::-1]):
            before = cpu_seconds(server)
            wall, rss, cpu, _ = timed_cpu(commands[name])
            results[name].append((wall, rss, cpu, cpu_seconds(server) - before))
    assert fs.cat_file(f"{BUCKET}/out/dsckpt.safetensors") == fs.cat_file(f"{BUCKET}/out/get-then.safetensors")
    med = {k: statistics.median(row[0] for row in v) for k, v in results.items()}
    print(f"bench_s3: {ckpt.name}: {ckpt_bytes / 1e6:,.0f} MB of rank files, {sum(n for _, _, n in ranges) / 1e6:,.0f} MB "
          f"read by consolidate; endpoint {args.endpoint}; {os.cpu_count()} CPUs; {args.runs} alternating runs, medians\n")
    print("| approach | seconds (min-max) | / get (floor) | / get+put | / get-then | peak RSS MiB | CPU s | server CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        walls = [row[0] for row in rows]
        cpu, server_cpu = (statistics.median(row[i] for row in rows) for i in (2, 3))
        print(f"| {name} | {med[name]:.2f} ({min(walls):.2f}-{max(walls):.2f}) | {med[name] / med['get']:.2f}x | "
              f"{med[name] / med['get+put']:.2f}x | {med[name] / med['get-then']:.2f}x | "
              f"{max(row[1] for row in rows) / 2**20:,.0f} | {cpu:.2f} | {server_cpu:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"checkpoint_bytes": ckpt_bytes, "needed": sum(n for _, _, n in ranges),
                                         "cpus": os.cpu_count(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
