"""#53: an error keeps the file it is about as data (``DsckptError.at``), and a local copy standing for what the user
typed (a bucket's view, another host's files) renames that data through an ``Alias`` - never by searching text."""
from __future__ import annotations

import pickle
from pathlib import Path

from dsckpt.errors import CorruptFileError, DsckptError, MissingRankError
from dsckpt.formats.storage import SAME_NAMES, Alias
from dsckpt.parallel.group import _describe
from dsckpt.zero.reader import open_checkpoint

VIEW = Alias((("/tmp/view/run", "s3://bucket/runs/run"), ("/tmp/view", "s3://bucket/runs")))


def test_an_error_shows_what_it_is_about_first_and_keeps_it_as_data():
    exc = CorruptFileError("truncated", hint="copy it again", at=Path("/tmp/view/run/step3/f.pt"))
    assert str(exc) == "/tmp/view/run/step3/f.pt: truncated"
    assert (exc.message, exc.hint, exc.at) == ("truncated", "copy it again", Path("/tmp/view/run/step3/f.pt"))
    assert str(exc.named(VIEW)) == "s3://bucket/runs/run/step3/f.pt: truncated"
    assert str(DsckptError("no file at all")) == "no file at all" and DsckptError("x").named(VIEW).at is None
    copy = pickle.loads(pickle.dumps(exc))  # (what crosses processes)
    assert (type(copy), str(copy), copy.hint) == (CorruptFileError, str(exc), "copy it again")


def test_an_error_travels_to_the_other_processes_with_what_it_is_about():
    name, message, hint, at = _describe(MissingRankError("rank 1 is missing", at=Path("/tmp/view/run/step3")))
    assert (name, message, hint, at) == ("MissingRankError", "rank 1 is missing", None, "/tmp/view/run/step3")
    assert _describe(ValueError("bad"))[1:] == ("ValueError: bad", None, None)


def test_an_alias_renames_paths_below_its_folders_and_nothing_else():
    assert VIEW("/tmp/view/run") == "s3://bucket/runs/run"
    assert VIEW(Path("/tmp/view/latest")) == "s3://bucket/runs/latest"  # (the second pair: a tag folder's root)
    assert VIEW("/tmp/view/run/step3/f.pt: bad bytes / header") == "s3://bucket/runs/run/step3/f.pt: bad bytes / header"
    assert VIEW("/tmp/viewer/x") == "/tmp/viewer/x"  # a folder whose name merely starts alike
    assert VIEW("see /tmp/view/run/x") == "see /tmp/view/run/x"  # prose is not searched
    assert VIEW(3) == 3 and SAME_NAMES("/tmp/view/run") == "/tmp/view/run"
    report = {"root": "/tmp/view/run", "files": ["/tmp/view/run/a"], "problems": [{"message": "/tmp/view/x: gone"}],
              "count": 2}
    assert VIEW.renamed(report) == {"root": "s3://bucket/runs/run", "files": ["s3://bucket/runs/run/a"],
                                    "problems": [{"message": "s3://bucket/runs/x: gone"}], "count": 2}


def test_a_recorded_problem_is_raised_with_what_it_is_about(fixture_copy):
    ckpt = fixture_copy("z2_ws2_fp32")
    tag_dir = ckpt / (ckpt / "latest").read_text().strip()
    next(tag_dir.glob("*rank_1_*optim_states.pt")).unlink()
    opened = open_checkpoint(ckpt)
    try:
        opened.require_complete()
    except MissingRankError as exc:
        assert exc.at == tag_dir and "rank 1 is missing" in exc.message
        assert str(opened.problems[0]) == str(exc)
    else:
        raise AssertionError("a missing rank file was not refused")
    assert opened.problems[0].named(Alias(((str(ckpt), "s3://b/run"),))).at == f"s3://b/run/{tag_dir.name}"
