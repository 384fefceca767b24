"""Every example in `--help` and the README that names the demo's run works as written after `make demo`.

The demo's own recipe is read from the Makefile and run in a scratch folder (its cwd, as `make demo` runs it);
then each example runs in a fresh copy of that folder (an output it writes that the demo already wrote is
removed first).  An example "works" when it ends with exit 0, 1 (differences or problems found: an answer) or 3
(non-finite values: an answer), without an error line or a traceback.  Examples about other runs (an HF Trainer's
out/checkpoint-500, a MoE run, Lightning's folder) name paths the demo does not make and are left out.
"""
import re
import shlex
import shutil
import subprocess

import pytest

from conftest import ROOT, run_cli

pytestmark = pytest.mark.runtime  # the demo trains and resumes on 2-3 ranks (~1 min on 2 cores)
DEMO_INPUTS = ("runs/demo", "model.safetensors", "model.pt")
WRITERS = {"consolidate": 1, "reshard": 1, "convert": 1}  # command -> index of OUT among its positionals


def dsckpt(args: list[str], cwd) -> subprocess.CompletedProcess:
    return run_cli(*args, timeout=600, cwd=cwd)


def demo_recipe() -> list[list[str]]:
    lines = (ROOT / "Makefile").read_text().split("\ndemo: setup-runtime\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [shlex.split(line.strip()[len("$(DS) "):]) for line in lines if line.strip().startswith("$(DS) ")]


def leaves_something(args: list[str]) -> bool:
    """A recipe step whose files the examples may use (a resume that saves nothing only checks: left out here)."""
    return args[0] != "resume" or "--save-dir" in args


def documented_examples() -> list[str]:
    from dsckpt.cli import cli

    found = []
    for name, command in cli.all_commands().items():
        text = (command.help or "").split("Examples:", 1)
        found += [line.strip() for line in text[1].splitlines() if line.strip().startswith("dsckpt ")] if len(text) > 1 else []
    for block in re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        found += [line.strip() for line in block.splitlines() if line.strip().startswith("dsckpt ")]
    return sorted(set(found))


def as_run(example: str) -> list[str] | None:
    """The argv of an example about the demo's run (None: another run's, or a training job)."""
    text = re.split(r"\s{2,}[#(]|\s\|\s|\s&&\s", example)[0]
    args = shlex.split(text)[1:]
    positionals = [a for a in args[1:] if not a.startswith("-")]
    if args[0] in ("train", "resume") or not positionals or not positionals[0].startswith(DEMO_INPUTS):
        return None
    return args


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo_run")
    for args in filter(leaves_something, demo_recipe()):
        proc = dsckpt(args, folder)
        assert proc.returncode == 0, (args, proc.stderr[-3000:])
    return folder


def test_the_demo_recipe_is_the_readme_walkthrough():
    recipe = [" ".join(args[:3]) for args in demo_recipe()]
    assert "train --stage 3" in recipe and "consolidate runs/demo model.safetensors" in recipe
    assert len([e for e in documented_examples() if as_run(e)]) >= 20


def test_every_example_about_the_demo_runs_as_written(demo, tmp_path):
    failures = []
    for i, example in enumerate(e for e in documented_examples() if as_run(e)):
        args = as_run(example)
        here = tmp_path / f"ex{i}"
        shutil.copytree(demo, here)
        if args[0] in WRITERS:
            out = here / [a for a in args[1:] if not a.startswith("-")][WRITERS[args[0]]]
            shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
            for sidecar in out.parent.glob(f"{out.name}.client_state.*"):  # what the demo wrote beside it
                sidecar.unlink()
        proc = dsckpt(args, here)
        if proc.returncode not in (0, 1, 3) or "dsckpt: error" in proc.stderr or "Traceback" in proc.stderr:
            failures.append(f"{example}: exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
        shutil.rmtree(here)
    assert failures == []
