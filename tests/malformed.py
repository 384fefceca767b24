"""The malformed-input corpus: broken variants of the real fixtures, and how dsckpt must answer each.

    python tests/malformed.py            # run every case, print the figures for docs/reliability.md

Each ``Case`` builds one broken input from a committed fixture and says which commands apply and
what counts as right: ``error`` (exit 2, one line naming ``names``), ``problem`` (inspect exit 1
listing it), or ``ok`` (a correct result: consolidate's output equals the fixture's reference).
Anything else - a traceback, another exit code, an output that differs - is a failure.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import resource
import signal
import shutil
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
MARKER_ENV = "DSCKPT_CORPUS_MARKER"
TORCHRUN_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Case:
    name: str
    family: str
    build: Callable[[Path], Path]  # tmp dir -> the path to hand to the commands
    expect: dict[str, str]  # command -> "error" | "problem" | "ok"
    names: str = ""  # a string the error must contain (the file or folder at fault)
    fixture: str = "z2_ws2_fp32"
    consolidate_args: tuple[str, ...] = ()
    dangerous: bool = False  # a marker file must not appear
    output: Callable[[Path, Path], Path] | None = None  # (tmp, input) -> OUT for consolidate
    max_file_size: int | None = None  # RLIMIT_FSIZE for consolidate: a disk that fills up


def copy(tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def rank_file(root: Path, pattern: str) -> Path:
    return next(root.glob(f"*/{pattern}"))  # in the fixture's one tag folder


# -- byte-level damage -------------------------------------------------------------------------
def truncate(fixture: str, pattern: str, where: str):
    def build(tmp):
        root = copy(tmp, fixture)
        f = rank_file(root, pattern)
        data = f.read_bytes()
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
        pkl = next(i for i in infos if i.filename.endswith("data.pkl"))
        big = max((i for i in infos if "/data/" in i.filename), key=lambda i: i.file_size)
        cut = {"zip header": 12, "pickle": pkl.header_offset + 60 + pkl.file_size // 2,
               "tensor data": big.header_offset + 100 + big.file_size // 2, "central directory": len(data) - 40}[where]
        f.write_bytes(data[:cut])
        return root
    return build


def flip(fixture: str, pattern: str, where: str):
    def build(tmp):
        root = copy(tmp, fixture)
        f = rank_file(root, pattern)
        data = bytearray(f.read_bytes())
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
        pkl = next(i for i in infos if i.filename.endswith("data.pkl"))
        if where == "tensor data":  # inside the fp32 partition, the bytes consolidate copies
            from dsckpt.formats.torchzip import TorchFile

            tf = TorchFile(f)
            ref = tf.obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
            pos = tf.storages[ref.storage.key].offset + 7
        elif where == "Adam moment":  # inside exp_avg_sq: bytes consolidate never reads, reshard carries
            from dsckpt.formats.torchzip import TorchFile

            tf = TorchFile(f)
            state = tf.obj["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
            pos = tf.storages[state["exp_avg_sq"].storage.key].offset + 11
        else:
            pos = {"local magic": 1, "central magic": data.rfind(b"PK\x01\x02") + 2,
                   "pickle": pkl.header_offset + 30 + len(pkl.filename) + len(pkl.extra) + pkl.file_size // 2}[where]
        data[pos] ^= 0x10
        f.write_bytes(bytes(data))
        return root
    return build


def replace_with(fixture: str, pattern: str, content: bytes | None = None, directory: bool = False):
    def build(tmp):
        root = copy(tmp, fixture)
        f = rank_file(root, pattern)
        f.unlink()
        if directory:
            f.mkdir()
        else:
            f.write_bytes(content or b"")
        return root
    return build


def foreign_zip(fixture: str, pattern: str):
    def build(tmp):
        root = copy(tmp, fixture)
        f = rank_file(root, pattern)
        with zipfile.ZipFile(f, "w") as zf:
            zf.writestr("notes.txt", "not a checkpoint")
        return root
    return build


def torch_save(fixture: str, pattern: str, edit: Callable[[dict], object], need_unsafe: bool = False):
    """Rewrite a rank file with torch after ``edit``; test code may unpickle its own fixtures."""
    def build(tmp):
        import torch

        root = copy(tmp, fixture)
        f = rank_file(root, pattern)
        obj = torch.load(f, weights_only=not need_unsafe)  # our own committed fixture
        new = edit(obj)
        obj = obj if new is None else new
        torch.save(obj, f)
        return root
    return build


# -- layout damage -------------------------------------------------------------------------------
def remove(fixture: str, pattern: str):
    def build(tmp):
        root = copy(tmp, fixture)
        rank_file(root, pattern).unlink()
        return root
    return build


def extra_rank(tmp):
    root = copy(tmp, "z2_ws2_fp32")
    shutil.copy(rank_file(root, "zero_pp_rank_1_*optim*"), root / "step3" / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    return root


def mixed(source: str, source_pattern: str, fixture: str, target_pattern: str):
    def build(tmp):
        root = copy(tmp, fixture)
        shutil.copy(rank_file(FIXTURES / source, source_pattern),
                    rank_file(root, target_pattern))
        return root
    return build


def latest_missing(keep_other: bool):
    def build(tmp):
        root = copy(tmp, "z2_ws2_fp32")
        if keep_other:
            shutil.copytree(root / "step3", root / "step4")
        else:
            shutil.rmtree(root / "step3")
        (root / "latest").write_text("step7")
        return root
    return build


def pipeline_files(tmp):
    root = copy(tmp, "z2_ws2_fp32")
    (root / "step3" / "layer_01-model_00-model_states.pt").write_bytes(b"")
    return root


def expert_files(name):
    """A mixture-of-experts save: DeepSpeed writes each expert's weights beside the rank files, not in `module`."""
    def build(tmp):
        root = copy(tmp, "z2_ws2_fp32")
        (root / "step3" / name).write_bytes(b"")
        return root
    return build


# -- hostile pickles ---------------------------------------------------------------------------------
class Hostile:
    """Pickles as a call of ``func(*args)``; each would create the marker file if ever run."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def hostile(kind: str) -> Hostile:
    marker = os.environ.get(MARKER_ENV, "/tmp/dsckpt-corpus-marker")
    cmd = f"touch {marker}"
    import builtins
    import importlib
    import subprocess as sp
    return {
        "os.system": Hostile(os.system, (cmd,)),
        "builtins.eval": Hostile(builtins.eval, (f"__import__('os').system({cmd!r})",)),
        "builtins.exec": Hostile(builtins.exec, (f"import os; os.system({cmd!r})",)),
        "subprocess.Popen": Hostile(sp.Popen, (["touch", marker],)),
        "pickle.loads": Hostile(pickle.loads, (pickle.dumps(Hostile(os.system, (cmd,))),)),
        "importlib.import_module": Hostile(importlib.import_module, ("antigravity",)),
    }[kind]


def inject(key_path: tuple[str, ...], kind: str):
    def edit(obj):
        target = obj
        for k in key_path[:-1]:
            target = target[k]
        target[key_path[-1]] = hostile(kind)
    return edit


# -- numbers that do not add up -------------------------------------------------------------------
def resize_flat(delta: int, stage3: bool):
    def edit(obj):
        import torch

        osd = obj["optimizer_state_dict"]
        key = "fp32_flat_groups" if stage3 else "single_partition_of_fp32_groups"
        t = osd[key][0]
        osd[key][0] = t[: t.numel() + delta].clone() if delta < 0 else torch.cat([t, torch.zeros(delta)])
    return edit


def set_key(path: tuple[str, ...], value):
    def edit(obj):
        target = obj
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = value
    return edit


# -- consolidated files ------------------------------------------------------------------------------
def consolidated(damage: str):
    def build(tmp):
        out = tmp / "m.safetensors"
        env = {**os.environ}
        subprocess.run([sys.executable, "-m", "dsckpt", "consolidate", str(FIXTURES / "z3_ws2_fp32"), str(out), "-q",
                        "--no-client-state"], check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        data = bytearray(out.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        if damage == "header longer than file":
            data[:8] = struct.pack("<Q", len(data) + 10)
        elif damage == "header not JSON":
            data[8:12] = b"{{{{"
        elif damage == "trailing bytes":
            data += b"\0" * 16
        elif damage in ("overlapping offsets", "offset past end"):
            names = [k for k in header if k != "__metadata__"]
            a, b = header[names[0]], header[names[1]]
            if damage == "overlapping offsets":
                b["data_offsets"] = a["data_offsets"][:]
                b["shape"], b["dtype"] = a["shape"], a["dtype"]
            else:
                a["data_offsets"] = [a["data_offsets"][0] + 10**9, a["data_offsets"][1] + 10**9]
            raw = json.dumps(header).encode()
            raw += b" " * (n - len(raw)) if len(raw) <= n else b""
            data[8:8 + n] = raw[:n] if len(raw) >= n else raw
        out.write_bytes(bytes(data))
        return out
    return build


def sharded(damage: str):
    def build(tmp):
        out = tmp / "hf"
        subprocess.run([sys.executable, "-m", "dsckpt", "consolidate", str(FIXTURES / "z3_ws2_fp32"), str(out), "-q",
                        "--max-shard-size", "10KB", "--no-client-state"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        index = out / "model.safetensors.index.json"
        if damage == "missing shard":
            next(out.glob("model-00002-*.safetensors")).unlink()
        else:
            index.write_text("{not json")
        return index
    return build


E, P, OK = "error", "problem", "ok"
INSP_CONS = lambda i, c: {"inspect": i, "consolidate": c}


def cases() -> list[Case]:
    out: list[Case] = []
    for kind, pattern in (("model", "mp_rank_00_model_states.pt"), ("optim", "zero_pp_rank_1_*optim*")):
        for where in ("zip header", "pickle", "tensor data", "central directory"):
            out.append(Case(f"truncated {kind} file inside {where}", "truncation", truncate("z2_ws2_fp32", pattern, where),
                            INSP_CONS(E if kind == "model" else P, E), names=pattern.replace("*", "").split("_optim")[0]))
    for where in ("local magic", "central magic", "pickle"):
        out.append(Case(f"bit flip in {where}", "bit flip", flip("z2_ws2_fp32", "zero_pp_rank_0_*optim*", where),
                        INSP_CONS(P, E), names="zero_pp_rank_0"))
    out.append(Case("bit flip in tensor data, --verify", "bit flip", flip("z2_ws2_fp32", "zero_pp_rank_0_*optim*", "tensor data"),
                    {"consolidate": E}, names="zero_pp_rank_0", consolidate_args=("--verify",)))
    out.append(Case("bit flip in the fp32 masters, CRC left as it was", "bit flip",
                    flip("z2_ws2_fp32", "zero_pp_rank_0_*optim*", "tensor data"),
                    {"consolidate": E, "reshard": E, "convert": E}, names="fails its CRC-32 check"))
    out.append(Case("bit flip in an Adam moment, CRC left as it was", "bit flip",
                    flip("z2_ws2_fp32", "zero_pp_rank_1_*optim*", "Adam moment"),
                    {"consolidate": OK, "reshard": E, "convert": E}, names="fails its CRC-32 check"))
    out += [
        Case("zero-byte model file", "not a checkpoint", replace_with("z2_ws2_fp32", "mp_rank_00_model_states.pt", b""),
             INSP_CONS(E, E), names="mp_rank_00_model_states.pt"),
        Case("zero-byte optim file", "not a checkpoint", replace_with("z2_ws2_fp32", "zero_pp_rank_0_*optim*", b""),
             INSP_CONS(P, E), names="zero_pp_rank_0"),
        Case("directory instead of optim file", "not a checkpoint",
             replace_with("z2_ws2_fp32", "zero_pp_rank_0_*optim*", directory=True), INSP_CONS(E, E), names="zero_pp_rank_0"),
        Case("text file with a rank file's name", "not a checkpoint",
             replace_with("z3_ws2_fp32", "zero_pp_rank_1_*model*", b"hello world\n" * 50), INSP_CONS(P, E),
             names="zero_pp_rank_1", fixture="z3_ws2_fp32"),
        Case("foreign zip with a rank file's name", "not a checkpoint", foreign_zip("z2_ws2_fp32", "zero_pp_rank_1_*optim*"),
             INSP_CONS(P, E), names="zero_pp_rank_1"),
        Case("plain tensor saved under a model-states name", "not a checkpoint",
             torch_save("z2_ws2_fp32", "mp_rank_00_model_states.pt", lambda o: __import__("torch").zeros(3)),
             INSP_CONS(E, E), names="mp_rank_00_model_states.pt"),
        Case("missing optim rank", "layout", remove("z3_ws3_bf16", "bf16_zero_pp_rank_2_*optim*"), INSP_CONS(P, E),
             names="rank 2", fixture="z3_ws3_bf16"),
        Case("missing stage-3 model rank", "layout", remove("z3_ws3_bf16", "zero_pp_rank_1_*model*"), INSP_CONS(P, E),
             names="rank 1", fixture="z3_ws3_bf16"),
        Case("extra rank file", "layout", extra_rank, INSP_CONS(P, E), names="rank 2"),
        Case("rank file from a run at another world size", "layout",
             mixed("z2_ws3_bf16", "bf16_zero_pp_rank_1_*optim*", "z2_ws2_fp32", "zero_pp_rank_1_*optim*"),
             INSP_CONS(P, E), names="partition count [3] differs from world size 2"),
        Case("stage-3 model file of a run at another world size", "layout",
             mixed("z3_ws2_fp32", "zero_pp_rank_1_*model*", "z3_ws3_bf16", "zero_pp_rank_1_*model*"),
             INSP_CONS(P, E), names="records world size 2", fixture="z3_ws3_bf16"),
        Case("world size recorded as text", "layout", torch_save("z2_ws2_fp32", "mp_rank_00_model_states.pt",
                                                                 set_key(("dp_world_size",), "two")),
             INSP_CONS(E, E), names="'dp_world_size' is 'two'"),
        Case("rank file from a run with other shapes", "layout",
             mixed("z3_ws2_fp32", "zero_pp_rank_1_*optim*", "z3_ws3_bf16", "bf16_zero_pp_rank_1_*optim*"),
             INSP_CONS(P, E), names="rank_1", fixture="z3_ws3_bf16"),
        Case("latest names a missing tag (no other tag)", "layout", latest_missing(False), INSP_CONS(E, E), names="latest"),
        Case("latest names a missing tag (other tags exist)", "layout", latest_missing(True), INSP_CONS(E, E), names="latest"),
        Case("empty checkpoint folder", "layout", lambda tmp: (tmp / "empty").mkdir() or tmp / "empty",
             INSP_CONS(E, E), names="empty"),
        Case("path that does not exist", "layout", lambda tmp: tmp / "nowhere", INSP_CONS(E, E), names="nowhere"),
        Case("an empty pipeline layer file", "layout", pipeline_files, INSP_CONS(P, E),
             names="layer_01-model_00-model_states.pt: not a torch zip"),
        Case("mixture-of-experts expert files", "unsupported", expert_files("layer_0_expert_3_mp_rank_00_model_states.pt"),
             INSP_CONS(P, E), names="expert files but no 'num_experts' list in the model states"),  # a stray one
        Case("mixture-of-experts files, older naming", "unsupported", expert_files("expert_0_mp_rank_00_model_states.pt"),
             INSP_CONS(P, E), names="expert_0_mp_rank_00_model_states.pt: an expert file of an older DeepSpeed layout"),
        Case("mp world size 2", "layout", torch_save("z2_ws2_fp32", "mp_rank_00_model_states.pt",
                                                     set_key(("mp_world_size",), 2)), INSP_CONS(P, E),
             names="records 2 tensor-parallel ranks"),
        Case("unknown zero_stage", "unsupported", torch_save("z2_ws2_fp32", "zero_pp_rank_0_*optim*",
                                                             set_key(("optimizer_state_dict", "zero_stage"), 7), need_unsafe=True),
             INSP_CONS(E, E), names="unknown zero_stage 7"),
        Case("stage-3 partition shorter than shapes need", "numel", torch_save("z3_ws2_fp32", "zero_pp_rank_1_*optim*",
                                                                               resize_flat(-8, True), need_unsafe=True),
             INSP_CONS(P, E), names="zero_pp_rank_1", fixture="z3_ws2_fp32"),
        Case("stage-3 partition longer than shapes need", "numel", torch_save("z3_ws2_fp32", "zero_pp_rank_0_*optim*",
                                                                              resize_flat(64, True), need_unsafe=True),
             INSP_CONS(P, E), names="zero_pp_rank_0", fixture="z3_ws2_fp32"),
        Case("stage-2 partition shorter than shapes need", "numel", torch_save("z2_ws2_fp32", "zero_pp_rank_1_*optim*",
                                                                               resize_flat(-300, False), need_unsafe=True),
             INSP_CONS(P, E), names="group 0"),
        Case("stage-2 partition longer than shapes need", "numel", torch_save("z2_ws2_fp32", "zero_pp_rank_1_*optim*",
                                                                              resize_flat(400, False), need_unsafe=True),
             INSP_CONS(P, E), names="group 0"),
        Case("param_shapes replaced by a hostile object", "hostile pickle",
             torch_save("z2_ws2_fp32", "mp_rank_00_model_states.pt", inject(("param_shapes",), "os.system")),
             INSP_CONS(E, E), names="mp_rank_00_model_states.pt", dangerous=True),
    ]
    for kind in ("os.system", "builtins.eval", "builtins.exec", "subprocess.Popen", "pickle.loads", "importlib.import_module"):
        out.append(Case(f"{kind} in the client state", "hostile pickle",
                        torch_save("z2_ws2_fp32", "mp_rank_00_model_states.pt", inject(("user", "evil"), kind)),
                        {"inspect": OK, "consolidate": OK}, dangerous=True))
    for kind in ("os.system", "subprocess.Popen", "builtins.eval"):
        out.append(Case(f"{kind} in the optimizer states", "hostile pickle",
                        torch_save("z2_ws2_fp32", "zero_pp_rank_0_*optim*",
                                   inject(("optimizer_state_dict", "loss_scaler"), kind), need_unsafe=True),
                        {"inspect": OK, "consolidate": OK}, dangerous=True))
    for damage in ("header longer than file", "header not JSON", "trailing bytes", "overlapping offsets", "offset past end"):
        out.append(Case(f"safetensors: {damage}", "consolidated file", consolidated(damage),
                        {"inspect": P, "resume": E}, names="m.safetensors"))
    existing = lambda tmp, src: (tmp / "taken.safetensors").write_text("keep") and tmp / "taken.safetensors"
    out += [
        Case("OUT exists, no --force", "output", lambda tmp: copy(tmp, "z2_ws2_fp32"), {"consolidate": E},
             names="taken.safetensors: already exists", output=existing),
        Case("a 16,610-bit integer in the client state, written as a Lightning .ckpt", "output",
             torch_save("z2_ws2_fp32", "mp_rank_00_model_states.pt", set_key(("big",), 2 ** 16610)),
             {"consolidate": E, "reshard": E, "convert": OK}, names="too large to write",
             output=lambda tmp, src: tmp / "out.ckpt"),
        Case("OUT is an input file", "output", lambda tmp: copy(tmp, "z2_ws2_fp32"), {"consolidate": E},
             names="refusing to write over an input", consolidate_args=("--force",),
             output=lambda tmp, src: src / "step3" / "mp_rank_00_model_states.pt"),
        Case("OUT's folder does not exist", "output", lambda tmp: copy(tmp, "z2_ws2_fp32"), {"consolidate": E},
             names="does not exist", output=lambda tmp, src: tmp / "no" / "m.safetensors"),
        Case("disk fills up mid-write", "output", lambda tmp: copy(tmp, "z3_ws3_bf16"), {"consolidate": E},
             names="writing failed", fixture="z3_ws3_bf16", max_file_size=12_000),
    ]
    for damage in ("missing shard", "index not JSON"):
        out.append(Case(f"sharded: {damage}", "consolidated file", sharded(damage), {"inspect": P, "resume": E},
                        names="index.json"))
    out += [  # tensor and pipeline parallel (fixtures/make_tp_fixtures.py, make_pp_fixtures.py, make_pptp_fixtures.py)
        Case("TP rank 1's optimizer file truncated in its tensor data", "tensor parallel",
             truncate("tp2_dp2_z3_fp32", "zero_pp_rank_1_mp_rank_01_optim_states.pt", "tensor data"), INSP_CONS(P, E),
             names="zero_pp_rank_1_mp_rank_01", fixture="tp2_dp2_z3_fp32"),
        Case("TP rank 1's model states missing", "tensor parallel", remove("tp2_dp2_z1_fp32", "mp_rank_01_model_states.pt"),
             INSP_CONS(E, E), names="tensor-parallel rank 1", fixture="tp2_dp2_z1_fp32"),
        Case("TP ranks' split descriptions differ", "tensor parallel",
             torch_save("tp2_dp1_z1_fp32", "mp_rank_01_model_states.pt",
                        set_key(("universal_checkpoint_info", "original_vocab_size"), 7), need_unsafe=True),
             INSP_CONS(P, E), names="differs from TP rank 0's", fixture="tp2_dp1_z1_fp32"),
        Case("pipeline layer file truncated in its pickle", "pipeline",
             truncate("pp2_dp2_z1_fp32", "layer_02-model_states.pt", "pickle"), INSP_CONS(P, E),
             names="layer_02-model_states.pt", fixture="pp2_dp2_z1_fp32"),
        Case("pipeline x TP: a stage's TP rank missing", "pipeline",
             remove("pp2_tp2_z1_fp32", "mp_rank_03_model_states.pt"), INSP_CONS(E, E),
             names="model-parallel rank 3 is missing", fixture="pp2_tp2_z1_fp32"),
    ]
    for case in out:
        if "reshard" not in case.expect and (expect := _reshard_expect(case)):
            case.expect["reshard"] = expect
        if "convert" not in case.expect and (expect := _convert_expect(case)):
            case.expect["convert"] = expect
    return out


WRITERS = ("consolidate", "reshard", "convert")


def _convert_expect(case: Case) -> str | None:
    """convert --to universal meets what reshard meets, with the same rule; a run of the MoE or ZeRO-0 fixtures
    is refused by name whatever it holds, so those cases say nothing new."""
    if "reshard" not in case.expect or case.fixture.startswith(("moe", "z0")):
        return None
    return case.expect["reshard"]


def _reshard_expect(case: Case) -> str | None:
    """reshard meets every input consolidate meets, with the same rule (refused with the same name, or a
    correct result), except: a foreign class in an optimizer file cannot be left out, so it is refused; a
    ZeRO-0 checkpoint is refused whatever it holds (nothing to reshard); --verify is consolidate's alone."""
    if "consolidate" not in case.expect or "--verify" in case.consolidate_args or case.fixture.startswith("z0"):
        return None
    if case.family == "hostile pickle" and "optimizer states" in case.name:
        return E
    return case.expect["consolidate"]


# -- running a case ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    case: str
    command: str
    verdict: str  # "expected" | "correct result" | "wrong result" | "traceback" | "unexpected"
    detail: str = ""


def run_cli(args: list[str], env: dict, max_file_size: int | None = None) -> subprocess.CompletedProcess:
    def limit():  # the disk "fills": writes past the limit fail with EFBIG instead of killing us
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_size, max_file_size))

    env = {k: v for k, v in env.items() if k not in TORCHRUN_ENV}  # one process, also when judged inside a rank
    return subprocess.run([sys.executable, "-m", "dsckpt", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env=env, preexec_fn=limit if max_file_size else None)


@contextlib.contextmanager
def file_size_limit(limit: int | None):
    """A disk that fills up at ``limit`` bytes per file, for this process only while the command runs."""
    if limit is None:
        yield
        return
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, previous)


def run_in_process(args: list[str], limit: int | None = None) -> subprocess.CompletedProcess:
    """``dsckpt ARGS`` through the CLI's own entry (``dsckpt.cli.app.run``) in this process: no interpreter start-up
    per command; a traceback lands in stderr as it would from a subprocess."""
    from dsckpt.cli.app import run

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), file_size_limit(limit):
        try:
            code = run(args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # a traceback is a verdict, not the end of the job
            import traceback

            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def one_process(args: list[str]) -> subprocess.CompletedProcess:
    """``dsckpt ARGS`` on one process: in this one, unless it is a rank of a distributed job (whose CLI would join
    the job's group: then a subprocess without torchrun's environment)."""
    if "LOCAL_RANK" in os.environ:
        return run_cli(args, dict(os.environ))
    return run_in_process(args)


def command_line(case: Case, command: str, tmp: Path, target: Path) -> tuple[list[str], Path]:
    """The arguments of ``dsckpt COMMAND`` for a case, and the OUT it writes."""
    force = ["--force"] if "--force" in case.consolidate_args else []
    if command == "inspect":
        return ["inspect", str(target)], tmp / "out-inspect.safetensors"
    if command == "consolidate":
        out = case.output(tmp, target) if case.output else tmp / "out-consolidate.safetensors"
        return ["consolidate", str(target), str(out), "-q", *case.consolidate_args], out
    if command in ("reshard", "convert"):
        out = case.output(tmp, target) if case.output else tmp / f"out-{command}"
        extra = ["-w", "3"] if command == "reshard" else ["--to", "universal"]
        return [command, str(target), str(out), *extra, "-q", *force], out
    return ["resume", "--full-weights", str(target), "--check", "--stage", "3"], tmp / "out-resume.safetensors"


def run_case(case: Case, tmp: Path) -> list[Outcome]:
    marker = tmp / "marker"
    env = {**os.environ, MARKER_ENV: str(marker)}
    os.environ[MARKER_ENV] = str(marker)
    target = case.build(tmp)
    results = []
    for command, expect in case.expect.items():
        args, out = command_line(case, command, tmp, target)
        before = out.read_bytes() if out.is_file() else None
        limit = case.max_file_size if command in WRITERS else None
        proc = run_cli(args, env, limit) if command == "resume" else run_in_process(args, limit)
        results.append(judge(case, command, expect, proc, out, before))
    if case.dangerous and marker.exists():
        results.append(Outcome(case.name, "pickle", "wrong result", "the hostile pickle ran"))
    return results


def judge(case: Case, command: str, expect: str, proc, out: Path, before: bytes | None) -> Outcome:
    if "Traceback" in proc.stderr:
        return Outcome(case.name, command, "traceback", proc.stderr[-400:])
    text = proc.stdout + proc.stderr
    if expect == "ok":
        if proc.returncode != 0:
            return Outcome(case.name, command, "unexpected", text[-300:])
        if command == "consolidate" and not matches_reference(out, case.fixture):
            return Outcome(case.name, command, "wrong result", "output differs from the live weights")
        if command == "reshard":
            return judge_resharded(case, out)
        if command == "convert":
            return judge_converted(case, out)
        return Outcome(case.name, command, "correct result")
    want_code = 1 if expect == "problem" else 2
    if proc.returncode != want_code or case.names not in text:
        return Outcome(case.name, command, "unexpected", f"exit {proc.returncode}: {text[-300:]}")
    if (out.read_bytes() if out.is_file() else None) != before:
        return Outcome(case.name, command, "wrong result", "OUT was created or changed")
    strays = [p.name for p in out.parent.glob(".*dsckpt-tmp*")] if out.parent.exists() else []
    if strays:
        return Outcome(case.name, command, "wrong result", f"temporary files left: {strays}")
    if expect == "error" and len(proc.stderr.strip().splitlines()) > 2:
        return Outcome(case.name, command, "unexpected", "more than one line of error")
    return Outcome(case.name, command, "expected")


def judge_resharded(case: Case, out: Path) -> Outcome:
    """A resharded output is right when stock DeepSpeed's way of loading it (a full-pickle ``torch.load``
    of every rank file) runs nothing, and its consolidation equals the live weights."""
    import torch

    for path in sorted(out.glob("*/*.pt")):
        torch.load(path, weights_only=False)  # TorchCheckpointEngine.load: a laundered payload runs here
    weights = out.parent / "out-resharded.safetensors"
    proc = one_process(["consolidate", str(out), str(weights), "-q"])
    if proc.returncode != 0 or not matches_reference(weights, case.fixture):
        return Outcome(case.name, "reshard", "wrong result", proc.stderr[-300:] or "differs from the live weights")
    return Outcome(case.name, "reshard", "correct result")


def judge_converted(case: Case, out: Path) -> Outcome:
    """A universal checkpoint is right when its weights, read back, equal the live weights."""
    weights = out.parent / "out-converted.safetensors"
    proc = one_process(["consolidate", str(out), str(weights), "-q", "--force"])
    if proc.returncode != 0 or not matches_reference(weights, case.fixture):
        return Outcome(case.name, "convert", "wrong result", proc.stderr[-300:] or "differs from the live weights")
    return Outcome(case.name, "convert", "correct result")


def matches_reference(out: Path, fixture: str) -> bool:
    import torch
    from safetensors.torch import load_file

    sd = load_file(out)
    ref = torch.load(FIXTURES / fixture / "reference.pt", weights_only=True)
    return all(torch.equal(sd.get(k, sd.get("embed.weight")).to(v.dtype), v) for k, v in ref.items())


def main() -> None:
    import tempfile
    from collections import Counter

    outcomes = []
    all_cases = cases()
    for case in all_cases:
        with tempfile.TemporaryDirectory() as tmp:
            outcomes += run_case(case, Path(tmp))
    verdicts = Counter(o.verdict for o in outcomes)
    families = Counter(c.family for c in all_cases)
    print(f"cases: {len(all_cases)} ({', '.join(f'{f}: {n}' for f, n in families.items())}); "
          f"command runs: {len(outcomes)}")
    print(f"rejected with the expected typed error/problem: {verdicts['expected']}; correct results: "
          f"{verdicts['correct result']}; wrong results: {verdicts['wrong result']}; tracebacks: {verdicts['traceback']}; "
          f"other: {verdicts['unexpected']}")
    for o in outcomes:
        if o.verdict not in ("expected", "correct result"):
            print(f"  {o.case} [{o.command}]: {o.verdict}: {o.detail}")


if __name__ == "__main__":
    main()
