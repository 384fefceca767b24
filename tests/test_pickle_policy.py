"""The package never runs a checkpoint's pickle code."""
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dsckpt"


def test_no_unsafe_loading_in_the_package():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for pattern in (r"weights_only\s*=\s*False", r"\bpickle\.loads?\(", r"\bpickle\.Unpickler\(",
                        r"torch\.load\((?![^)]*weights_only\s*=\s*True)"):
            for m in re.finditer(pattern, text):
                offenders.append(f"{path.name}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}")
    assert offenders == []


def test_reader_never_imports_torch_or_deepspeed():
    import subprocess
    import sys

    code = ("import sys, dsckpt.analysis.inspect, dsckpt.api.consolidation, dsckpt.zero.reader; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
