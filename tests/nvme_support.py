"""Where DeepSpeed's async_io op (NVMe offload) can run: libaio unpacked under ``.tools/libaio`` (``make nvme-tools``:
Debian's ``libaio-dev`` and ``libaio1`` through ``apt-get download`` + ``dpkg -x``, no root) and the op's JIT build
cached in ``.tools/torch_extensions`` (~5 min on 2 cores the first time, so only ``make test-all`` and the fixture
script build it; ``make test`` runs the NVMe training flows only where the build is already there)."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBAIO = ROOT / ".tools" / "libaio" / "usr"
EXTENSIONS = ROOT / ".tools" / "torch_extensions"


def aio_environment() -> dict[str, str] | None:
    """The variables a process needs to build and load the op, or None where libaio is not unpacked."""
    include, lib = LIBAIO / "include", LIBAIO / "lib" / "x86_64-linux-gnu"
    if not (include / "libaio.h").is_file():
        return None
    joined = os.pathsep.join(filter(None, [str(lib), os.environ.get("LD_LIBRARY_PATH")]))
    return {"CPATH": str(include), "LIBRARY_PATH": str(lib), "LD_LIBRARY_PATH": joined, "CFLAGS": f"-I{include}",
            "LDFLAGS": f"-L{lib}", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS)}


def aio_built() -> bool:
    """Whether the op's build is cached (a run then loads it in a second instead of building it for minutes)."""
    return aio_environment() is not None and (EXTENSIONS / "async_io" / "async_io.so").is_file()


def build() -> int:
    """Build (or find cached) the op in a process with the variables set; 0 when it loads."""
    import subprocess
    import sys

    env = aio_environment()
    if env is None:
        print("libaio is not unpacked under .tools/libaio (make nvme-tools): the NVMe flows will skip", file=sys.stderr)
        return 1
    code = "from deepspeed.ops.op_builder import AsyncIOBuilder as B; B().load(verbose=False)"
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}).returncode


if __name__ == "__main__":
    raise SystemExit(build())
