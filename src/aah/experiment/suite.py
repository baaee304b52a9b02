"""Experiment suites: every (regime, seed) of a comparison, run, evaluated and reported.

A suite file names a folder of per-regime configs, the regimes, the seeds and
overrides that apply to every run::

    name: main
    config_dir: ../../cpu          # relative to the suite file; holds <regime>.yaml
    regimes: [full_attention, grouping_off, full_adaptive, shallow_freeze, deep_practical_reuse]
    seeds: [0]
    overrides: [train.max_steps=300]

A suite may run one regime several times with different settings: ``variants``
names each extra entry of ``regimes`` with the regime whose config it uses and
its own overrides::

    regimes: [uniform_window, budgeted, budgeted_tight]
    variants:
      budgeted_tight: {regime: budgeted, overrides: [aah.budget=0.30]}

Runs land in ``OUT/<name>/seed<seed>`` (``name``: the regime or variant). A run whose ``meta.json`` says
``complete`` and that has an ``eval.json`` is skipped; one with checkpoints is
resumed; anything else starts fresh. The report is written to ``OUT/report``.

A suite too long for one sitting can keep *records* (``aah experiment --records DIR``): each finished run's
``config.yaml``, ``meta.json``, ``metrics.jsonl`` and ``eval.json`` (no checkpoints, a few
hundred kB) are copied to ``DIR/<name>/seed<seed>``, and a later invocation, on another
machine or a fresh clone, takes a recorded run of the same config as finished instead of
training it again. A record of another config is an error, never silently reused or replaced.
Each record carries a checksum manifest (:mod:`aah.experiment.records`); a record that does not
verify against it (truncated, edited, half-written) is never used: a warning names the file,
and the run trains again and is recorded anew.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from .. import regimes as regime_registry
from ..config import ConfigError, config_to_dict, load_config
from ..train.checkpoint import latest_checkpoint
from ..train.run_dir import read_meta
from .records import (
    RECORD_FILES,
    RecordError,
    copy_record,
    verify_record,
    write_json,
    write_manifest,
)

__all__ = ["Suite", "RunSpec", "load_suite", "plan_runs", "run_suite", "run_state", "save_record", "sync_records"]


@dataclass(frozen=True)
class RunSpec:
    regime: str
    seed: int
    config: Path
    overrides: tuple[str, ...]
    run_dir: Path
    max_steps: int
    resolved: dict = field(default_factory=dict, compare=False, repr=False)  # the run's full config

    @property
    def name(self) -> str:
        return f"{self.regime}/seed{self.seed}"


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path
    config_dir: Path
    regimes: tuple[str, ...]
    seeds: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    regime_overrides: dict = field(default_factory=dict)
    variants: dict = field(default_factory=dict)  # name -> (regime, overrides)

    def regime_of(self, name: str) -> str:
        """The registered regime an entry of ``regimes`` runs (itself, or its variant's)."""
        return self.variants[name][0] if name in self.variants else name


_KEYS = {"name", "config_dir", "regimes", "seeds", "overrides", "regime_overrides", "description", "variants"}


def _variants(raw: object, path: Path) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"suite {path}: variants must map names to {{regime, overrides}}")
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict) or "regime" not in spec or set(spec) - {"regime", "overrides"}:
            raise ConfigError(f"suite {path}: variant {name!r} needs 'regime' and optional 'overrides' only")
        out[str(name)] = (str(spec["regime"]), tuple(str(o) for o in spec.get("overrides") or ()))
    return out


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite file (every regime and config must exist)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read suite file {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"suite file {path} must hold a mapping")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ConfigError(f"suite {path}: unknown key(s) {unknown}; allowed: {sorted(_KEYS)}")
    for key in ("config_dir", "regimes"):
        if key not in raw:
            raise ConfigError(f"suite {path}: missing key {key!r}")
    config_dir = (path.parent / raw["config_dir"]).resolve()
    regimes = tuple(raw["regimes"])
    variants = _variants(raw.get("variants"), path)
    known = regime_registry.names()
    for name in variants:
        if name not in regimes:
            raise ConfigError(f"suite {path}: variant {name!r} is not listed in regimes")
    for entry in regimes:
        regime = variants[entry][0] if entry in variants else entry
        if regime not in known:
            raise ConfigError(f"suite {path}: unknown regime {regime!r}; known regimes: {', '.join(known)}")
        if not (config_dir / f"{regime}.yaml").is_file():
            raise ConfigError(f"suite {path}: no config {config_dir / (regime + '.yaml')}")
    seeds = tuple(int(s) for s in raw.get("seeds", [0]))
    regime_overrides = {k: tuple(v) for k, v in (raw.get("regime_overrides") or {}).items()}
    for regime in regime_overrides:
        if regime not in regimes:
            raise ConfigError(f"suite {path}: regime_overrides names {regime!r}, which is not in regimes")
    return Suite(
        name=str(raw.get("name", path.stem)),
        path=path,
        config_dir=config_dir,
        regimes=regimes,
        seeds=seeds,
        overrides=tuple(raw.get("overrides") or ()),
        regime_overrides=regime_overrides,
        variants=variants,
    )


def plan_runs(suite: Suite, out_dir: Path, seeds: tuple[int, ...] | None = None,
              extra_overrides: tuple[str, ...] = ()) -> list[RunSpec]:
    """One :class:`RunSpec` per (regime, seed); each config is validated before anything runs."""
    specs = []
    for seed in seeds or suite.seeds:
        for regime in suite.regimes:
            overrides = (
                *suite.overrides, *suite.regime_overrides.get(regime, ()),
                *suite.variants.get(regime, ("", ()))[1], *extra_overrides, f"train.seed={seed}",
            )
            config = suite.config_dir / f"{suite.regime_of(regime)}.yaml"
            cfg = load_config(config, overrides)  # fail early, naming the key
            specs.append(
                RunSpec(regime, seed, config, overrides, out_dir / regime / f"seed{seed}", cfg.train.max_steps,
                        config_to_dict(cfg))
            )
    return specs


def config_mismatch(spec: RunSpec, folder: Path | None = None) -> str | None:
    """Why an existing run folder (``spec.run_dir`` or ``folder``) does not belong to this plan
    (``None`` when it does).

    A run is only skipped or resumed when its saved config equals the planned one
    (logging settings aside): otherwise changed overrides would be silently ignored.
    """
    folder = spec.run_dir if folder is None else folder
    saved_path = folder / "config.yaml"
    if not saved_path.is_file() or not spec.resolved:
        return None
    saved = config_to_dict(load_config(saved_path))
    keys = [
        f"{section}.{key}"
        for section, values in spec.resolved.items() if section != "log"
        for key, value in values.items() if saved.get(section, {}).get(key) != value
    ]
    if not keys:
        return None
    return (
        f"{folder} was trained with a different config ({', '.join(keys[:5])} differ); "
        f"remove it or choose another {'--out' if folder == spec.run_dir else '--records'}"
    )


def _record_dir(records: Path, spec: RunSpec) -> Path:
    return records / spec.regime / f"seed{spec.seed}"


def _meta(run_dir: Path) -> dict:
    """``meta.json`` of ``run_dir`` (``{}`` without one); :class:`ConfigError` naming it when unreadable."""
    try:
        return read_meta(run_dir)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{run_dir / 'meta.json'} cannot be read ({exc}); remove {run_dir} to run it again") from None


def _tag_row(run_dir: Path, spec: RunSpec) -> bool:
    """Name the suite row in the finished run's ``meta.json`` (``suite_row``): the report groups a
    variant (``loss_aware_late``) apart from its regime's own row (``loss_aware``). True if it changed."""
    meta = _meta(run_dir)
    if meta.get("suite_row") == spec.regime:
        return False
    write_json(run_dir / "meta.json", {**meta, "suite_row": spec.regime})
    return True


def save_record(spec: RunSpec, records: Path) -> Path:
    """Keep the finished run of ``spec`` as ``records/<name>/seed<seed>``, its manifest written last."""
    dest = _record_dir(records, spec)
    _tag_row(spec.run_dir, spec)
    copy_record(spec.run_dir, dest, manifest=True)
    return dest


def _verified_records(specs: list[RunSpec], records: Path) -> tuple[dict[RunSpec, Path], dict[RunSpec, str]]:
    """The record folders of ``specs`` that verify against their manifests, and why each other
    existing record folder does not (it is left until the run's new record replaces it)."""
    verified, damaged = {}, {}
    for spec in specs:
        folder = _record_dir(records, spec)
        if not folder.exists():
            continue
        try:
            verify_record(folder, RECORD_FILES)
        except RecordError as exc:
            damaged[spec] = str(exc)
            continue
        verified[spec] = folder
    return verified, damaged


def sync_records(specs: list[RunSpec], records: Path) -> list[str]:
    """Before a suite runs: finished runs of ``specs`` without a record get one, and recorded runs
    the output folder has not finished are restored into it (they are then skipped).

    Only records that verify against their manifests are used; one that does not gets a warning
    naming the file and counts as missing. Raises :class:`ConfigError`, before anything is copied,
    when a record was trained with a config other than the plan's. Returns one line per record
    saved or restored, and one per warning.
    """
    verified, damaged = _verified_records(specs, records)
    for spec, folder in verified.items():
        mismatch = config_mismatch(spec, folder)
        if mismatch:
            raise ConfigError(mismatch)
    lines = []
    for spec in specs:
        other_config = config_mismatch(spec) is not None
        finished = not other_config and run_state(spec.run_dir) == "done"
        if spec in damaged:
            lines.append(f"warning: record of {spec.name} not used: {damaged[spec]}; "
                         + (f"it is recorded again from {spec.run_dir}" if finished
                            else "the run trains again and its new record replaces it"))
        if other_config:
            continue  # a run of another config in the output folder: the run itself reports it
        folder = verified.get(spec)
        recorded = folder is not None and run_state(folder) == "done"
        if recorded and _tag_row(folder, spec):  # records kept before runs were tagged
            write_manifest(folder)
        if finished and not recorded:
            save_record(spec, records)
            lines.append(f"recorded {spec.name}")
        elif recorded and not finished:
            if spec.run_dir.exists():
                shutil.rmtree(spec.run_dir)  # a partial run of the same config: the record is further
            copy_record(folder, spec.run_dir, manifest=False)
            lines.append(f"restored {spec.name} from {folder}")
    return lines


def run_state(run_dir: Path) -> str:
    """``done`` (trained and evaluated), ``evaluate``, ``resume`` or ``fresh``."""
    meta = _meta(run_dir)
    if meta.get("status") == "complete":
        return "done" if (run_dir / "eval.json").is_file() else "evaluate"
    if latest_checkpoint(run_dir) is not None:
        return "resume"
    return "fresh"


def _command(spec: RunSpec, state: str) -> list[list[str]]:
    aah = [sys.executable, "-m", "aah.cli"]
    quiet = ["log.progress=false"]
    steps = []
    if state == "fresh":
        if spec.run_dir.exists():
            shutil.rmtree(spec.run_dir)  # a start that never reached a checkpoint
        steps.append([*aah, "train", str(spec.config), *spec.overrides, *quiet, "--out", str(spec.run_dir)])
    elif state == "resume":
        steps.append([*aah, "train", "--resume", str(spec.run_dir)])
    if state in ("fresh", "resume", "evaluate"):
        steps.append([*aah, "eval", str(spec.run_dir)])
    return steps


#: Exit status of a run stopped by a signal after writing its checkpoint (``aah train``).
INTERRUPTED = 130
NOT_STARTED = "not started: the suite was stopped"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under ``taskset``), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _execute(spec: RunSpec, threads: int, stopping: threading.Event,
             records: Path | None = None) -> tuple[RunSpec, int, str]:
    if stopping.is_set():
        return spec, INTERRUPTED, NOT_STARTED
    state = run_state(spec.run_dir)
    mismatch = config_mismatch(spec) if state != "fresh" else None
    if mismatch:
        return spec, 2, mismatch
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    spec.run_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = spec.run_dir.parent / f"seed{spec.seed}.log"
    for index, cmd in enumerate(_command(spec, state)):
        if index and stopping.is_set():  # trained, but the suite is stopping: leave the evaluation
            return spec, INTERRUPTED, f"trained, not evaluated; see {log_path}"
        with open(log_path, "a") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if code != 0:
            if code == INTERRUPTED:
                stopping.set()  # the run was stopped by a signal: start no more
            return spec, code, f"see {log_path}"
    _tag_row(spec.run_dir, spec)
    if records is not None:  # at once, so a suite stopped later loses nothing finished
        save_record(spec, records)
    return spec, 0, f"see {log_path}"


@contextmanager
def _stop_on_signals(stopping: threading.Event):
    """SIGINT and SIGTERM set ``stopping`` (no new run starts) instead of killing the suite.

    The running ``aah train`` processes share the suite's process group, so a Ctrl-C or a
    signal to the group reaches them too: each finishes its step, writes a checkpoint and
    exits, and the next ``aah experiment`` resumes it. Outside the main thread nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame) -> None:
        if not stopping.is_set():
            print("\nstop requested: no new run starts; running ones stop after their checkpoint",
                  file=sys.stderr)
        stopping.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_suite(
    suite: Suite,
    out_dir: str | Path,
    *,
    seeds: tuple[int, ...] | None = None,
    jobs: int = 1,
    extra_overrides: tuple[str, ...] = (),
    rows: tuple[str, ...] | None = None,
    records: str | Path | None = None,
) -> tuple[list[RunSpec], list[tuple[RunSpec, int, str]]]:
    """Run every pending (regime, seed); returns the plan and the failures (spec, code, detail).

    ``rows`` (names of ``regimes``) runs only those rows, in the suite's order; the returned plan
    still holds every row, so a report can cover the runs that other invocations finished.

    ``records`` (a folder): runs of the plan recorded there are restored first (every row, so the
    report covers them), and each run that finishes is recorded there (:func:`sync_records`).

    A run stopped by a signal (exit status :data:`INTERRUPTED`), or SIGINT / SIGTERM to the
    suite, stops it: no further run starts, and those left are failures with that status.
    """
    out_dir = Path(out_dir)
    specs = plan_runs(suite, out_dir, seeds, extra_overrides)
    if rows is not None:
        unknown = sorted(set(rows) - set(suite.regimes))
        if unknown:
            raise ConfigError(f"--rows: unknown row(s) {unknown}; the suite's rows: {', '.join(suite.regimes)}")
    selected = [s for s in specs if rows is None or s.regime in rows]
    records = Path(records) if records is not None else None
    if records is not None:
        for line in sync_records(specs, records):
            print(line, file=sys.stderr)
    cores = usable_cores()
    threads = max(1, cores // max(1, jobs))
    failures = []
    done = [s for s in specs if run_state(s.run_dir) == "done" and not config_mismatch(s)]
    for spec in done:  # finished before runs were tagged: the report still tells variants apart
        _tag_row(spec.run_dir, spec)
    pending = [s for s in selected if s not in done]
    total_steps = sum(s.max_steps for s in selected)
    # Steps already logged (a resumed suite) are the bar's start, so its rate and time left count
    # only the steps this invocation runs.
    bar = tqdm(total=total_steps, initial=_steps_done(selected), desc=f"suite {suite.name}", unit="step",
               dynamic_ncols=True)
    finished = threading.Event()
    stopping = threading.Event()

    def monitor() -> None:
        # A resumed run logs again from its last checkpoint: the bar never goes back.
        while not finished.wait(1.0):
            bar.n = max(bar.n, _steps_done(selected))
            bar.refresh()

    watcher = threading.Thread(target=monitor, daemon=True)
    watcher.start()
    try:
        with _stop_on_signals(stopping), ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for spec, code, log in pool.map(lambda s: _execute(s, threads, stopping, records), pending):
                outcome = "ok" if code == 0 else "stopped" if code == INTERRUPTED else "FAILED"
                bar.set_postfix_str(f"{spec.name} {outcome}")
                if code != 0:
                    failures.append((spec, code, log))
    finally:
        finished.set()
        watcher.join()
        bar.n = max(bar.n, _steps_done(selected))
        bar.close()
    return specs, failures


def _steps_done(specs: list[RunSpec]) -> int:
    """Steps the runs of ``specs`` have logged, each counted up to its ``max_steps``."""
    return sum(min(s.max_steps, _logged_step(s.run_dir)) for s in specs)


def _logged_step(run_dir: Path) -> int:
    """The last step a run logged (0 when it has not logged yet)."""
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - 4096))
            lines = fh.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0
