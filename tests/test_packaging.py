"""The base install (`pip install dsckpt`) inspects, consolidates, reshards and converts to universal checkpoints
without torch, DeepSpeed or safetensors."""
import subprocess
from pathlib import Path
import sys
import tomllib

from conftest import FIXTURES, ROOT

HEAVY = ("torch", "deepspeed", "safetensors")
# Run the CLI in a process where importing any heavy package fails, as on a machine without them.
BLOCKED = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {HEAVY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
sys.meta_path.insert(0, Block())
from dsckpt.cli import main
sys.argv = ['dsckpt', *sys.argv[1:]]
main()
"""


def blocked_cli(*args):
    return subprocess.run([sys.executable, "-c", BLOCKED, *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_base_dependencies_are_light():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert not any(name in base for name in HEAVY)
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["runtime"])


def test_inspect_and_consolidate_need_no_torch(tmp_path):
    ckpt = FIXTURES / "z3_ws3_bf16"
    assert blocked_cli("inspect", ckpt).returncode == 0
    for out in ("m.safetensors", "m.pt", "sharded"):
        proc = blocked_cli("consolidate", ckpt, tmp_path / out, "--verify", "-q")
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert blocked_cli("inspect", tmp_path / "m.safetensors").returncode == 0
    assert blocked_cli("inspect", tmp_path / "m.pt").returncode == 0
    proc = blocked_cli("consolidate", ckpt, tmp_path / "n2.safetensors", "--nproc", "2", "-q")  # nor --nproc
    assert proc.returncode == 0 and (tmp_path / "n2.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()
    proc = blocked_cli("reshard", ckpt, tmp_path / "ws2", "--world-size", "2", "-q")  # reshard needs no torch either
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert blocked_cli("inspect", tmp_path / "ws2").returncode == 0
    proc = blocked_cli("convert", ckpt, tmp_path / "universal", "--to", "universal", "-q")  # nor --to universal
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert blocked_cli("inspect", tmp_path / "universal").returncode == 0
    proc = blocked_cli("convert", ckpt, tmp_path / "dcp", "--to", "dcp")  # DCP is torch's format
    assert proc.returncode == 2 and "torch is not installed" in proc.stderr and not (tmp_path / "dcp").exists()


def test_a_url_without_its_backend_names_the_extra():
    without_s3fs = BLOCKED.replace(repr(HEAVY), repr(("s3fs",)))
    proc = subprocess.run([sys.executable, "-c", without_s3fs, "inspect", "s3://bucket/runs/demo"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "s3fs" in proc.stderr and "pip install 'dsckpt[s3]'" in proc.stderr


def test_runtime_commands_name_the_extra():
    proc = blocked_cli("train", "--steps", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "pip install 'dsckpt[runtime]'" in proc.stderr


def test_without_isal_zlibs_crc_writes_the_same_bytes(tmp_path):
    """Where isal has no wheel, ``formats.crc`` falls back to zlib's CRC-32: the ``.pt`` and the resharded rank
    files come out byte for byte as with ISA-L's (the writer's output is deterministic)."""
    ckpt = FIXTURES / "z3_ws3_bf16"
    no_isal = BLOCKED.replace(f"{HEAVY!r}", f"{HEAVY + ('isal',)!r}")
    for name, script in (("with", BLOCKED), ("without", no_isal)):
        (tmp_path / name).mkdir()
        for args in (("consolidate", ckpt, tmp_path / name / "m.pt", "--verify", "-q", "--no-client-state"),
                     ("reshard", ckpt, tmp_path / name / "ws2", "--world-size", "2", "-q")):
            proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                                  cwd=ROOT)
            assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(p.relative_to(tmp_path / "with") for p in (tmp_path / "with").rglob("*") if p.is_file())
    assert any(f.suffix == ".pt" for f in files) and len(files) > 3
    for f in files:
        assert (tmp_path / "with" / f).read_bytes() == (tmp_path / "without" / f).read_bytes(), f


def test_every_public_name_is_documented_and_typed():
    import inspect as pyinspect

    import dsckpt

    for name in dsckpt.__all__:
        obj = getattr(dsckpt, name)
        if name == "__version__":
            continue
        doc = pyinspect.getdoc(obj) or ""
        assert len(doc) > 200 and "see the module docstring" not in doc, name
        hints = pyinspect.signature(obj).return_annotation
        assert hints is not pyinspect.Signature.empty, name
    assert (Path(dsckpt.__file__).parent / "py.typed").is_file()
    assert 'dsckpt = ["py.typed"]' in (Path(dsckpt.__file__).parent.parent / "pyproject.toml").read_text()
    api_page = (Path(dsckpt.__file__).parent.parent / "docs" / "api.md").read_text()
    assert all(f"| `{name}(" in api_page for name in dsckpt.__all__ if name != "__version__")
