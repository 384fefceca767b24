"""ZeRO-Infinity checkpoints (issue 70): the optimizer on NVMe, its state in ``<tag>/offloaded_tensors/rankNN/``.

The reading tests use the committed fixtures (fixtures/make_nvme_fixtures.py: real DeepSpeed runs with the async_io
op, several swapped sub-groups and one kept in the rank files; ``reference.pt``: the live engine's masters, moments
and step at the save).  The training flows need the op itself (``tests/nvme_support.py``): ``make test-all`` builds
it; elsewhere they run where its build is cached and skip, saying so, where it is not.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, NVME_FIXTURE_NAMES, ROOT, run_cli, run_job
from nvme_support import aio_built, aio_environment

torch = pytest.importorskip("torch")
sys.path.insert(0, str(ROOT / "fixtures"))
from make_nvme_fixtures import FIXTURES as SPECS  # noqa: E402

import dsckpt  # noqa: E402
from dsckpt.api.consolidation import load_state_dict  # noqa: E402

OFFLOADED = "step3/offloaded_tensors"


def reference(name: str) -> dict:
    return torch.load(FIXTURES / name / "reference.pt")


def test_every_nvme_run_of_the_generator_is_committed():
    assert NVME_FIXTURE_NAMES == sorted(SPECS)
    for name in NVME_FIXTURE_NAMES:  # what makes them worth having: swapped sub-groups beside one kept in memory
        ckpt = dsckpt.open_checkpoint(FIXTURES / name)
        swapped = [type(g.fp32.file).__name__ == "SwapFile" for g in ckpt.optimizer_states[0].groups]
        assert swapped.count(True) >= 2 and swapped.count(False) >= 1, swapped


@pytest.mark.parametrize("name", NVME_FIXTURE_NAMES)
def test_consolidate_gives_the_live_masters_bit_for_bit(name, tmp_path):
    """DeepSpeed's own get_fp32_state_dict_from_zero_checkpoint fails on these (ValueError, measured)."""
    result = dsckpt.consolidate(FIXTURES / name, tmp_path / "m.safetensors", verify=True)
    assert result.verified
    ref = reference(name)
    got = dict(load_state_dict(FIXTURES / name))
    masters = [k for k in ref if "::" not in k and k in got]
    assert len(masters) == sum(1 for k in ref if "::" not in k and k != "positions")  # every parameter and buffer
    assert [k for k in masters if not torch.equal(ref[k], got[k])] == []


@pytest.mark.parametrize("name", NVME_FIXTURE_NAMES)
def test_universal_and_dcp_carry_the_moments_and_step(name, tmp_path):
    """The moments of swapped and kept sub-groups alike, and Adam's step, as the live optimizer held them."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref = reference(name)
    assert run_cli("convert", FIXTURES / name, tmp_path / "uni", "--to", "universal").returncode == 0
    zero = tmp_path / "uni" / "step3" / "zero"
    trainable = [k for k in ref if "::" not in k and (zero / k).is_dir()]
    assert trainable and all(f"{k}::exp_avg" in ref for k in trainable)
    for key in trainable:
        for kind in ("exp_avg", "exp_avg_sq"):
            saved = torch.load(zero / key / f"{kind}.pt", weights_only=True)
            saved = saved["param"] if isinstance(saved, dict) else saved
            assert torch.equal(saved.reshape(ref[f"{key}::{kind}"].shape), ref[f"{key}::{kind}"]), (key, kind)
    assert run_cli("convert", FIXTURES / name, tmp_path / "dcp", "--to", "dcp").returncode == 0
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    flat = torch.load(tmp_path / "dcp.pt", weights_only=True)
    optim = flat["optim"]["state"]
    for key in trainable:
        assert torch.equal(optim[key]["exp_avg_sq"], ref[f"{key}::exp_avg_sq"]), key
        assert float(optim[key]["step"]) == float(ref["::step"])
    assert isinstance(FileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata, dict)


def test_inspect_du_verify_list_and_prune_count_the_swap_files(tmp_path):
    name = "nvme_z3_ws2_fp32"
    swap_bytes = sum(p.stat().st_size for p in (FIXTURES / name / OFFLOADED).rglob("*.swp"))
    doc = json.loads(run_cli("inspect", FIXTURES / name, "--json").stdout)
    nvme = doc["nvme"]
    assert nvme["offloaded"] == ["offload_optimizer", "offload_param"] and nvme["bytes"] == swap_bytes
    assert nvme["swapped_sub_groups"] == 4 and nvme["sub_groups"] == 5 and set(nvme["per_rank"]) == {"rank00", "rank01"}
    assert doc["bytes"] == swap_bytes + sum(f["size"] for f in doc["rank_files"])
    text = run_cli("inspect", FIXTURES / name).stdout
    assert "NVMe offload" in text and "4 of 5 sub-groups' masters + exp_avg + exp_avg_sq" in text
    du = json.loads(run_cli("inspect", FIXTURES / name, "--du", "--json").stdout)
    third = swap_bytes // 3  # masters and each moment: the same padded size per sub-group
    assert du["components"]["exp_avg"] >= third and du["components"]["fp32 masters"] >= third
    verified = run_cli("verify", FIXTURES / name, "--json")
    report = json.loads(verified.stdout)
    assert verified.returncode == 0 and report["ok"] and len(report["tags"][0]["swap_files"]) == 24
    assert report["tags"][0]["tensors_checked"] > 0 and any("NVMe swap files" in n for n in report["notes"])
    root = tmp_path / "run"
    shutil.copytree(FIXTURES / name, root)
    shutil.copytree(root / "step3", root / "step2")
    listed = {e.tag: e for e in dsckpt.list_tags(root)}
    tag_bytes = sum(p.stat().st_size for p in (root / "step2").rglob("*") if p.is_file())
    assert listed["step2"].bytes == tag_bytes and tag_bytes > swap_bytes
    dsckpt.prune(root, keep=1)
    assert not (root / "step2").exists() and (root / OFFLOADED).is_dir()


def test_reshard_writes_the_swap_files_an_nvme_engine_reads_and_refuses_what_it_cannot_name(tmp_path):
    """--offload nvme: each sub-group the engine at M ranks swaps as DeepSpeed lays it out (named after the source's
    swap files, the partition's bytes, zeros to the aio alignment), its rank-file entries empty; every copy's rank
    files record their storages on "cpu" (torch.load knows no "nvme").  A sub-group cut anew at M, or kept in memory
    at N, has no name the checkpoint records: refused, nothing written."""
    from dsckpt.formats.pickle_tree import tensor_refs
    from dsckpt.formats.torchzip import TorchFile
    from dsckpt.plan import offload
    from dsckpt.plan.reshard import build_reshard_plan

    name = FIXTURES / "nvme_z3_ws2_fp32"
    out = tmp_path / "ws2"
    assert run_cli("reshard", name, out, "-w", "2", "--offload", "nvme").returncode == 0
    source, copy = dsckpt.open_checkpoint(name), dsckpt.open_checkpoint(out)
    for held, written in zip(source.optimizer_states, copy.optimizer_states):
        for was, now in zip(held.groups, written.groups):
            assert type(now.fp32.file) is type(was.fp32.file)
            if type(now.fp32.file).__name__ != "SwapFile":
                continue
            for kind in (None, "exp_avg", "exp_avg_sq"):
                path = now.fp32.file.path if kind is None else now.moments[kind].file.path
                data, was_path = path.read_bytes(), (was.fp32.file if kind is None else was.moments[kind].file).path
                assert path.name == was_path.name and len(data) == was_path.stat().st_size
                size = now.fp32.numel * 4
                assert data[:size] == was_path.read_bytes()[:size] and not data[size:].strip(b"\0")
    got, ref = dict(load_state_dict(out)), reference(name.name)
    assert [k for k in ref if "::" not in k and k in got and not torch.equal(ref[k], got[k])] == []
    assert run_cli("reshard", name, tmp_path / "plain", "-w", "3").returncode == 0
    for rank_file in [*(out / "step3").glob("*.pt"), *(tmp_path / "plain" / "step3").glob("*.pt")]:
        assert {ref.storage.location for ref in tensor_refs(TorchFile(rank_file).obj)} <= {"cpu"}, rank_file
    for args, says in ((("-w", "3"), "this one is cut differently at 3 ranks"),
                       (("-w", "1"), "this one is cut differently at 1 rank"),
                       (("-w", "2", "--stage", "2"), "at ZeRO-3 only")):
        proc = run_cli("reshard", name, tmp_path / "refused", *args, "--offload", "nvme")
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert not (tmp_path / "refused").exists()
    with pytest.raises(dsckpt.errors.UnsupportedCheckpointError, match="this one was kept in memory at 2"):
        offload.for_nvme(build_reshard_plan(source, 2), source, threshold=36 * 4)  # (the last sub-group's size)


@pytest.mark.runtime
def test_two_processes_read_the_swap_files_as_one_does(tmp_path):
    """consolidate and reshard --nproc 2: each process's view holds the swap files two folders below the tag."""
    name = FIXTURES / "nvme_z3_ws2_fp32"
    for args in (("consolidate", name, "{out}.safetensors", "--no-client-state"), ("reshard", name, "{out}", "-w", "3"),
                 ("reshard", name, "{out}", "-w", "2", "--offload", "nvme")):
        outs = {n: str(tmp_path / f"{args[0]}-{len(args)}-{n}") for n in (1, 2)}
        for n, out in outs.items():
            proc = run_cli(*(a.format(out=out) if isinstance(a, str) else a for a in args), "--no-fsync",
                           *(["--nproc", "2"] if n == 2 else []))
            assert proc.returncode == 0, proc.stderr[-2000:]
        if args[0] == "consolidate":
            assert open(f"{outs[1]}.safetensors", "rb").read() == open(f"{outs[2]}.safetensors", "rb").read()
        else:
            assert run_cli("diff", outs[1], outs[2], "--optimizer").returncode == 0
            swapped = [sorted(p.relative_to(out) for p in Path(out).rglob("*.swp")) for out in outs.values()]
            assert swapped[0] == swapped[1] and all((Path(outs[1]) / p).read_bytes() == (Path(outs[2]) / p)
                                                    .read_bytes() for p in swapped[0])


def _damaged(tmp_path, edit):
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "nvme_z3_ws2_fp32", root)
    edit(root / OFFLOADED)
    return root


def _truncate(folder):
    os.truncate(folder / "rank01" / "exp_avg-18_21.tensor.swp", 4000)


def _drop_moment(folder):
    (folder / "rank01" / "exp_avg_sq-14_17.tensor.swp").unlink()


def _drop_rank(folder):
    shutil.rmtree(folder / "rank01")


def _drop_set(folder):
    for path in (folder / "rank00").glob("*22_23.tensor.swp"):
        path.unlink()


def _link_out(folder):
    target = folder.parent.parent.parent / "elsewhere.swp"
    shutil.copy(folder / "rank00" / "14_17.tensor.swp", target)
    (folder / "rank00" / "14_17.tensor.swp").unlink()
    (folder / "rank00" / "14_17.tensor.swp").symlink_to(target)


def _only_masters(folder):
    for path in (folder / "rank00").glob("exp_avg*-28_13.tensor.swp"):
        path.rename(path.with_name(path.name.replace("28_13", "28_99")))


@pytest.mark.parametrize("edit, fragment", [
    (_truncate, "rank01/exp_avg-18_21.tensor.swp: holds 4000 bytes; its sub-group's partition needs 4752"),
    (_drop_moment, "rank01: sub-group 14_17's exp_avg_sq is missing (exp_avg_sq-14_17.tensor.swp)"),
    (_drop_rank, "rank01: rank 1's swap folder is missing: 4 sub-groups keep their masters and moments there"),
    (_drop_set, "rank00: the swap files of sub-group 22_23 (22_23.tensor.swp and its state) are missing; rank 1 has"),
    (_link_out, "a symlink to"),
    (_only_masters, "but not its masters (28_99.tensor.swp)"),
])
def test_damaged_swap_files_are_typed_errors_naming_the_file(tmp_path, edit, fragment):
    root = _damaged(tmp_path, edit)
    out = tmp_path / "out.safetensors"
    proc = run_cli("consolidate", root, out)
    assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.glob("*.dsckpt-tmp*"))
    verified = run_cli("verify", root)
    assert verified.returncode == 1 and fragment in verified.stdout, verified.stdout


# --- the training flows: the async_io op must be there ------------------------------------------------------------
def needs_aio(test):
    """Starts ranks (``runtime``), and skips, saying so, where the op's build is not cached."""
    reason = "DeepSpeed's async_io op is not built here (tests/nvme_support.py; `make nvme-tools` builds it)"
    return pytest.mark.runtime(pytest.mark.skipif(not aio_built(), reason=reason)(test))


def _job(nproc, *args, **env):
    return run_job("nvme_flow.py", nproc, *map(str, args), env={**aio_environment(), **env})


@needs_aio
def test_resume_is_exact_where_deepspeeds_own_load_is_not(tmp_path):
    """Adam's step, the sub-group kept in memory and the next losses: DeepSpeed's own load loses the first two
    (the losses show it); dsckpt's load gives the uninterrupted run's, bit for bit."""
    _job(2, "train", tmp_path, tmp_path / "train.json")
    losses = json.loads((tmp_path / "train.json").read_text())["losses"]
    _job(2, "resume-dsckpt", tmp_path, tmp_path / "ours.json")
    _job(2, "resume-stock", tmp_path, tmp_path / "stock.json")
    ours, stock = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("ours", "stock"))
    assert ours["different"] == [] and ours["step"] == 3.0 and ours["losses"] == losses
    assert "::step" in stock["different"] and any(k.startswith("norm.") for k in stock["different"])
    assert stock["losses"] != losses
    _job(3, "load", tmp_path, tmp_path / "three.json")  # five sub-groups at 2 ranks, cut anew at 3
    assert json.loads((tmp_path / "three.json").read_text()) == {"different": [], "step": 3.0}


@needs_aio
def test_a_background_save_of_an_nvme_run_resumes_exactly(tmp_path):
    """dsckpt's background engine stages the swap files DeepSpeed copies in the call with the rank files and
    publishes them with the tag; the engine's own load_checkpoint (enable_async_save's) resumes it exactly."""
    _job(2, "train", tmp_path, tmp_path / "train.json", NVME_FLOW_SAVE="background")
    assert len(list((tmp_path / "ckpt" / OFFLOADED).rglob("*.swp"))) == 24
    assert not list((tmp_path / "ckpt").glob(".*"))  # nothing staged is left
    _job(2, "resume-engine", tmp_path, tmp_path / "ours.json", NVME_FLOW_SAVE="background")  # its load_checkpoint
    ours = json.loads((tmp_path / "ours.json").read_text())
    assert ours["different"] == [] and ours["losses"] == json.loads((tmp_path / "train.json").read_text())["losses"]


@needs_aio
def test_another_world_size_loads_into_nvme_and_cpu_offload_engines_exactly(tmp_path):
    """2 ranks with the optimizer on NVMe into 3 ranks with it on NVMe (no offloaded_tensors/ at that size: DeepSpeed
    cannot) and on the CPU, read in place and from `dsckpt reshard`'s copy; and a CPU-offload run into an NVMe engine.
    One sub-group, which every size cuts alike."""
    whole = 10 ** 12
    _job(2, "train", tmp_path, tmp_path / "train.json", "nvme", whole)
    for offload in ("nvme", "cpu"):
        _job(3, "load", tmp_path, tmp_path / f"{offload}.json", offload, whole)
        result = json.loads((tmp_path / f"{offload}.json").read_text())
        assert result == {"different": [], "step": 3.0}, offload
    assert run_cli("reshard", tmp_path / "ckpt", tmp_path / "ws3", "-w", "3").returncode == 0  # a copy on disk: the
    _job(3, "load", tmp_path, tmp_path / "copy.json", "nvme", whole, NVME_FLOW_LOAD=str(tmp_path / "ws3"))  # same
    assert json.loads((tmp_path / "copy.json").read_text()) == {"different": [], "step": 3.0}
    assert not (tmp_path / "ws3" / "step3" / "offloaded_tensors").exists()  # (the moments in the rank files)
    swapped = tmp_path / "ws3-nvme"  # and swap files for the engine at 3 ranks, which DeepSpeed's own load copies:
    assert run_cli("reshard", tmp_path / "ckpt", swapped, "-w", "3", "--offload", "nvme").returncode == 0
    assert len(list((swapped / OFFLOADED).rglob("*.tensor.swp"))) == 9
    _job(3, "resume-stock", tmp_path, tmp_path / "stock.json", "nvme", whole, NVME_FLOW_LOAD=str(swapped))
    assert json.loads((tmp_path / "stock.json").read_text())["different"] == ["::step"]  # (its own defect, above)
    _job(3, "load", tmp_path, tmp_path / "swapped.json", "nvme", whole, NVME_FLOW_LOAD=str(swapped))
    assert json.loads((tmp_path / "swapped.json").read_text()) == {"different": [], "step": 3.0}
    assert run_cli("convert", tmp_path / "ckpt", tmp_path / "dcp", "--to", "dcp").returncode == 0  # FSDP2's layout,
    proc = run_cli("convert", tmp_path / "dcp", tmp_path / "back", "--to", "deepspeed", "-w", "3", "--stage", "3",
                   "--model", "make_nvme_fixtures:build_nvme_model", cwd=FIXTURES)  # (its first block is frozen)
    assert proc.returncode == 0, proc.stderr  # and back into DeepSpeed at 3 ranks, for an NVMe engine
    _job(3, "load", tmp_path, tmp_path / "back.json", "nvme", whole, NVME_FLOW_LOAD=str(tmp_path / "back"))
    assert json.loads((tmp_path / "back.json").read_text()) == {"different": [], "step": 3.0}
    cpu_run = tmp_path / "cpu"
    cpu_run.mkdir()
    _job(2, "train", cpu_run, cpu_run / "train.json", "cpu", 1000)
    _job(2, "resume-dsckpt", cpu_run, cpu_run / "into-nvme.json", "nvme", 1000)
    assert json.loads((cpu_run / "into-nvme.json").read_text())["different"] == []


@needs_aio
def test_hpz_with_the_optimizer_on_nvme_resumes_and_reshards_exactly(tmp_path):
    """hpZ (zero_hpz_partition_size 2) at 4 ranks with the optimizer on NVMe: consolidated bit for bit, resumed at 4
    ranks with the uninterrupted run's losses, loaded at 2 in place, from `reshard -w 2`'s copy and from a round
    trip through DCP (`convert --to dcp`, then `--to deepspeed -w 2`); `reshard -w 2 --offload nvme`'s copy by
    DeepSpeed's own load, every master and moment.  (With the parameters on NVMe too, DeepSpeed 0.19.8 fails
    in initialize: "Expected one of cpu, cuda, ... device type at start of device string: nvme".)"""
    whole = 10 ** 12
    _job(4, "train", tmp_path, tmp_path / "train.json", "nvme-optimizer", whole, NVME_FLOW_HPZ="2")
    reference = torch.load(tmp_path / "reference.pt")
    got = dict(load_state_dict(tmp_path / "ckpt"))
    assert [k for k in reference if "::" not in k and not torch.equal(reference[k], got[k])] == []
    _job(4, "resume-dsckpt", tmp_path, tmp_path / "ours.json", "nvme-optimizer", whole, NVME_FLOW_HPZ="2")
    ours = json.loads((tmp_path / "ours.json").read_text())
    assert ours["different"] == [] and ours["losses"] == json.loads((tmp_path / "train.json").read_text())["losses"]
    _job(2, "load", tmp_path, tmp_path / "two.json", "nvme-optimizer", whole, NVME_FLOW_HPZ="2")
    assert json.loads((tmp_path / "two.json").read_text()) == {"different": [], "step": 3.0}
    assert run_cli("reshard", tmp_path / "ckpt", tmp_path / "ws2", "-w", "2").returncode == 0  # a copy on disk,
    assert run_cli("convert", tmp_path / "ckpt", tmp_path / "dcp", "--to", "dcp").returncode == 0  # and via DCP
    proc = run_cli("convert", tmp_path / "dcp", tmp_path / "back", "--to", "deepspeed", "-w", "2", "--stage", "3",
                   "--model", "make_nvme_fixtures:build_nvme_model", cwd=FIXTURES)
    assert proc.returncode == 0, proc.stderr
    for copy in ("ws2", "back"):
        _job(2, "load", tmp_path, tmp_path / f"{copy}.json", "nvme-optimizer", whole, NVME_FLOW_HPZ="2",
             NVME_FLOW_LOAD=str(tmp_path / copy))
        assert json.loads((tmp_path / f"{copy}.json").read_text()) == {"different": [], "step": 3.0}, copy
    swapped = tmp_path / "ws2-nvme"  # swap files for DeepSpeed's own load at 2 ranks (its step restarts, as above)
    assert run_cli("reshard", tmp_path / "ckpt", swapped, "-w", "2", "--offload", "nvme").returncode == 0
    _job(2, "resume-stock", tmp_path, tmp_path / "stock.json", "nvme-optimizer", whole, NVME_FLOW_HPZ="2",
         NVME_FLOW_LOAD=str(swapped))
    assert json.loads((tmp_path / "stock.json").read_text())["different"] == ["::step"]
