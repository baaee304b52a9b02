"""The run folder: resolved config, ``meta.json``, ``metrics.jsonl`` and TensorBoard events.

Layout::

    RUN/
      config.yaml        resolved configuration
      meta.json          version, commit, seed, regime, backend, device, machines, times, status
      metrics.jsonl      one JSON object per logged step ("kind": "train" or "eval")
      tensorboard/       event files (when tensorboard is installed)
      checkpoints/       one folder per checkpoint (see aah.train.checkpoint)
      eval.json          written by ``aah eval``
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..data._files import atomic_path

__all__ = [
    "MetricsLog", "write_json_atomic", "read_meta", "update_meta", "git_commit", "now_iso", "peak_memory_mb",
    "machine_description", "machines_with",
]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` atomically, with the user's umask (colleagues may read it)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_meta(run_dir: Path) -> dict:
    path = Path(run_dir) / "meta.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def update_meta(run_dir: Path, **fields) -> dict:
    meta = read_meta(run_dir)
    meta.update(fields)
    write_json_atomic(Path(run_dir) / "meta.json", meta)
    return meta


def git_commit() -> str | None:
    """The commit of the source tree this package runs from, if it is a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; elsewhere what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_description(device: torch.device) -> dict:
    """Where a run trains: CPU model, cores, torch threads, and the GPU when there is one.

    Kernels round differently on another CPU or GPU, so a run repeats to the
    last digit only where it was trained (docs/reproducing.md, "How far a run
    repeats"); the run folder keeps this to say where that was.
    """
    machine = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        machine["accelerator"] = torch.cuda.get_device_name(device)
    return machine


def machines_with(machines: list[dict], device: torch.device) -> list[dict]:
    """``meta.json``'s ``machines`` after a (re)start here: this machine appended unless it is the last one."""
    here = machine_description(device)
    return list(machines) if machines and machines[-1] == here else [*machines, here]


def peak_memory_mb(device: torch.device) -> float:
    """GPU: max allocated; CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 1024 if sys.platform != "darwin" else rss / 2**20
    except (ImportError, OSError):
        return float("nan")


class MetricsLog:
    """Appends metric records to ``metrics.jsonl`` (flushed per line) and TensorBoard."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, resume_after: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_after is not None:
            self._truncate_after(resume_after)
        self._fh = open(self.path, "a")  # noqa: SIM115 - kept open for the whole run, closed in close()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # On resume, drop events logged after the checkpoint so curves do not overlap.
                purge = None if resume_after is None else resume_after + 1
                self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge)
            except ImportError:
                print("tensorboard is not installed: writing metrics.jsonl only", file=sys.stderr)

    def _truncate_after(self, step: int) -> None:
        """Drop records logged after ``step`` (a resumed run repeats those steps)."""
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
            if record.get("step", 0) <= step:
                kept.append(line)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            kind, step = record.get("kind", "train"), record["step"]
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
                elif isinstance(value, dict):
                    for sub, v in value.items():
                        if isinstance(v, (int, float)):
                            self._tb.add_scalar(f"{kind}/{key}/{sub}", v, step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
