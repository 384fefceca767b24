"""Every output format's bytes over the fixtures, held to digests recorded before the seams were redrawn (#53).

A refactor of the write path may move code, never bytes: each case writes into a fresh folder and every file's
SHA-256 (by its path relative to OUT) must equal ``data/output_digests.json``.  After a deliberate change of an
output, record again with ``DSCKPT_RECORD_DIGESTS=1 pytest tests/test_output_bytes.py`` and say why in the commit.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import pytest

import dsckpt
from dsckpt.errors import DsckptError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DIGESTS = Path(__file__).resolve().parent / "data" / "output_digests.json"
RECORD = os.environ.get("DSCKPT_RECORD_DIGESTS") == "1"

Write = Callable[[Path, Path], object]
CASES: dict[str, Write] = {
    "safetensors": lambda ckpt, out: dsckpt.consolidate(ckpt, out / "model.safetensors"),
    "safetensors_bf16": lambda ckpt, out: dsckpt.consolidate(ckpt, out / "model.safetensors", dtype="bf16"),
    "pt": lambda ckpt, out: dsckpt.consolidate(ckpt, out / "model.pt"),
    "bin": lambda ckpt, out: dsckpt.consolidate(ckpt, out / "pytorch_model.bin"),
    "sharded": lambda ckpt, out: dsckpt.consolidate(ckpt, out / "shards", max_shard_size=20000),
    "dcp": lambda ckpt, out: dsckpt.convert(ckpt, out / "dcp", "dcp"),
    "universal": lambda ckpt, out: dsckpt.convert(ckpt, out / "universal", "universal"),
    "reshard_w3": lambda ckpt, out: dsckpt.reshard(ckpt, out / "ws3", 3),
    "reshard_w1_z3": lambda ckpt, out: dsckpt.reshard(ckpt, out / "ws1", 1, stage=3),
}
CHECKPOINTS = ["z1_ws2_fp32", "z2_ws3_bf16", "z3_ws2_fp32", "z0_ws2_bf16", "moe_z2_ws2_ep2_fp32",
               "tp2_dp2_z3_fp32", "pp2_dp2_z1_fp32"]


def _metadata_digest(path: Path) -> str:
    """DCP's ``.metadata`` as what it says (every entry, chunk, byte range and saved path), read through dsckpt's
    allowlist reader: its pickle also holds the run's save id and staged folder name, which differ every run."""
    from dsckpt.formats.dcp import read_index

    index = read_index(path.parent)
    said = ([(k, t.dtype, t.shape, [(c.offsets, c.sizes, c.file.name, c.offset, c.length) for c in t.chunks])
             for k, t in index.tensors.items()],
            [(k, v.file.name, v.offset, v.length) for k, v in index.values.items()], sorted(index.paths.items()))
    return hashlib.sha256(repr(said).encode()).hexdigest()


def _digests(out: Path) -> dict[str, str]:
    """SHA-256 of each file's bytes (DCP's ``.metadata``: of what it says)."""
    return {str(p.relative_to(out)): _metadata_digest(p) if p.name == ".metadata" else
            hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.rglob("*")) if p.is_file()}


def _outcome(ckpt: str, case: str, tmp_path: Path) -> dict[str, str] | str:
    out = tmp_path / "out"
    out.mkdir()
    try:
        CASES[case](FIXTURES / ckpt, out)
    except DsckptError as e:  # a refusal is an outcome too: its class must not change
        return f"refused: {type(e).__name__}"
    return _digests(out)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_output_bytes_unchanged(ckpt: str, case: str, tmp_path: Path) -> None:
    key = f"{ckpt}/{case}"
    got = _outcome(ckpt, case, tmp_path)
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    if RECORD:
        recorded[key] = got
        DIGESTS.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    assert key in recorded, f"no digest recorded for {key}: run with DSCKPT_RECORD_DIGESTS=1"
    assert got == recorded[key]
