"""Property-based fuzzing of the readers that face untrusted bytes (hypothesis).

Property: whatever the bytes, a reader returns a checked result or raises a ``DsckptError`` -
never another exception, never a reference outside its file.  ``make test`` runs the "ci" profile
(a bounded run); ``make fuzz`` runs the "long" one (``HYPOTHESIS_PROFILE=long``).
"""
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURES
from dsckpt.errors import DsckptError
from forge import replace_data_pkl

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=20_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

RANK_FILE = next((FIXTURES / "z2_ws2_fp32" / "step3").glob("zero_pp_rank_0_*optim_states.pt"))
SEED_PICKLE = __import__("zipfile").ZipFile(RANK_FILE).read(
    next(n for n in __import__("zipfile").ZipFile(RANK_FILE).namelist() if n.endswith("data.pkl")))


def _mutate(data: bytes, edits: list[tuple[int, int, bytes]]) -> bytes:
    out = bytearray(data)
    for kind, pos, chunk in edits:
        pos %= max(len(out), 1)
        if kind == 0:
            out[pos:pos + len(chunk)] = chunk  # overwrite
        elif kind == 1:
            out[pos:pos] = chunk  # insert
        else:
            del out[pos:pos + len(chunk) + 1]  # delete
    return bytes(out)


def _read_torch(pickle_bytes: bytes) -> None:
    from dsckpt.formats.torchzip import TorchFile, tensor_byte_range

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank.pt"
        shutil.copy(RANK_FILE, path)
        replace_data_pkl(path, pickle_bytes)
        try:
            tf = TorchFile(path)
        except DsckptError:
            return
        stack = [tf.obj]
        while stack:  # every tensor reference it returned lies inside its own storage
            value = stack.pop()
            if hasattr(value, "storage") and hasattr(value, "stride"):
                try:
                    _, offset, length = tensor_byte_range(value)
                    assert 0 <= offset and offset + length <= path.stat().st_size
                except DsckptError:
                    pass
            elif isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, (list, tuple)):
                stack.extend(value)


edits = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 20), st.binary(min_size=1, max_size=8)),
                 min_size=1, max_size=6)


@given(edits)
def test_mutated_real_pickles(edit_list):
    _read_torch(_mutate(SEED_PICKLE, edit_list))


@given(st.binary(max_size=200))
def test_arbitrary_opcode_streams(tail):
    _read_torch(b"\x80\x02" + tail)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
entries = st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "BF16", "I64", "X9"]) | json_values,
                                 "shape": st.lists(st.integers(-1, 5), max_size=3) | json_values,
                                 "data_offsets": st.lists(st.integers(-4, 64), min_size=2, max_size=2) | json_values})


@given(st.dictionaries(st.text(max_size=6), entries | json_values, max_size=4), st.binary(max_size=64),
       st.dictionaries(st.text(max_size=6), st.text(max_size=6) | json_values, max_size=3))
def test_safetensors_headers(header, data, metadata):
    from dsckpt.formats.safetensors_file import parse_aliases, read_header

    header = {**header, "__metadata__": metadata}
    raw = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        try:
            parsed, start = read_header(path)
            parse_aliases(parsed.get("__metadata__", {}).get("dsckpt.aliases"), path)
        except DsckptError:
            return
        for name, info in parsed.items():
            if name != "__metadata__":
                assert start + info["data_offsets"][1] <= path.stat().st_size


@given(json_values | st.fixed_dictionaries({"weight_map": st.dictionaries(st.text(max_size=10), json_values | st.text(max_size=12), max_size=4)}))
def test_index_files(doc):
    from dsckpt.formats.safetensors_file import read_index

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors.index.json"
        path.write_text(json.dumps(doc))
        try:
            _, weight_map = read_index(path)
        except DsckptError:
            return
        assert all((path.parent / shard).is_file() and "/" not in shard for shard in weight_map.values())
