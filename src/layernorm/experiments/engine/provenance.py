"""Where and how a run was made: the command, the code's commit, the versions, the processor and
what else was running, saved as ``provenance.json`` beside the records.

Timings are only comparable on the same processor with nothing else running; the load average at
the start and the end of a run is the cheap, portable sign of the latter (Linux and macOS).
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["command_line", "git_commit", "load_average", "processor", "provenance"]


def git_commit(where: Path | None = None) -> str | None:
    """The commit of the source checkout the package runs from, with ``+dirty`` when tracked files
    differ from it; ``None`` outside a git checkout (an installed wheel)."""
    root = Path(where) if where else Path(__file__).resolve().parents[4]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def processor() -> dict[str, Any]:
    """The processor's model name, the ISA torch's CPU kernels use, and the logical CPU count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    isa = torch.backends.cpu.get_cpu_capability()  # e.g. "AVX2", "AVX512", "DEFAULT"
    return {"model": model, "isa": isa, "arch": platform.machine(), "cpus": os.cpu_count()}


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (runnable processes), ``None`` where unavailable."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def command_line(argv: list[str] | None = None) -> str:
    """``argv`` (default: this process's) as the ``layernorm`` command that repeats it, whether it
    was started as the console script or as ``python -m layernorm``."""
    args = sys.argv if argv is None else argv
    return " ".join(shlex.quote(a) for a in ["layernorm", *args[1:]])


def provenance(threads: int, command: str | None = None) -> dict[str, Any]:
    """What is known at the start of a run; the runner adds the wall time and the end load.
    ``command``: the command line to record (default: :func:`command_line`)."""
    return {
        "command": command if command is not None else command_line(),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": processor(),
        "threads": threads,
        "load_average_start": load_average(),
    }
