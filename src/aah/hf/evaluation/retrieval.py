"""Run the retrieval tasks of :mod:`aah.hf.evaluation.tasks` for several settings of one model and score them.

Each setting (``full``, ``aah``, ``uniform``: :class:`aah.hf.evaluation.compare.Setting`) reads every
prompt once (the prefill, into the setting's own cache: transformers' dynamic cache for
``full``, the window cache otherwise) and then decodes ``max_new_tokens`` greedy tokens from
that cache. A sample is correct when every answer is a whole word of the decoded text. All
settings see the same samples, so their accuracies are paired.

Accuracies come with Wilson 95% score intervals over the trials behind them: overall, by
length, by depth and per (length, depth) cell, which the heatmap draws.

A long run can keep a journal (:class:`AnswerJournal`, ``aah hf retrieval --answers FILE``):
every answer is appended to it as soon as it is decoded, and a run given the same journal
reuses the answers already there (same setting, prompt tokens, filler, model and, but for
``full``, windows file), so a run that is stopped, crashes or is split by settings loses nothing. A
journal belongs to one model's content (:func:`model_key`, its first line): new weights saved
into the same folder make it refused, never reused.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...errors import CLIError
from ...train.checkpoint import sha256_file
from .compare import Setting, last_logits, setting_coverage
from .tasks import Sample, is_correct, task_filler

__all__ = ["AnswerJournal", "JournalError", "model_key", "wilson_interval", "generate_answers", "run_settings", "score", "draw_heatmaps",
           "depth_key"]

_Z95 = 1.959963984540054


def wilson_interval(correct: int, trials: int, z: float = _Z95) -> list[float] | None:
    """The Wilson score interval of a binomial proportion (95% by default); ``None`` for no trials."""
    if trials < 1:
        return None
    p = correct / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return [max(0.0, centre - half), min(1.0, centre + half)]


def depth_key(depth: float) -> str:
    """The JSON key of a depth: at most three decimals, e.g. ``0.05``, ``0.5``, ``0.275``."""
    return f"{depth:.3f}".rstrip("0").rstrip(".") if depth else "0"


@torch.no_grad()
def generate_answers(model, setting: Setting, sample: Sample, tokenizer) -> str:
    """The greedy continuation of ``sample``'s prompt under ``setting``, decoded to text."""
    ids = torch.tensor([sample.input_ids], dtype=torch.int64, device=model.device)
    cache = setting.new_cache(model)
    logits = last_logits(model, ids, cache)
    out = []
    for step in range(sample.max_new_tokens):
        token = logits.argmax(-1, keepdim=True)
        out.append(int(token))
        if step + 1 < sample.max_new_tokens:
            logits = last_logits(model, token, cache)
    return tokenizer.decode(out, skip_special_tokens=True)


def model_key(folder: str | Path) -> str:
    """The sha256 of a model folder's content: the name, size and sha256 of each of its files
    (weights, ``config.json``, tokenizer; hidden files and subfolders aside). Asked again in the
    same process about unchanged files (same names, sizes and modification times), it reads
    nothing again: the command line and the journal ask once each."""
    files = sorted(p for p in Path(folder).resolve().iterdir() if p.is_file() and not p.name.startswith("."))
    return _content_key(tuple((path, path.stat().st_size, path.stat().st_mtime_ns) for path in files))


@lru_cache(maxsize=8)
def _content_key(files: tuple[tuple[Path, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for path, size, _ in files:
        digest.update(f"{path.name}\0{size}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()


class JournalError(CLIError):
    """An answers journal that belongs to another model, or does not say which; one line, naming it."""


class AnswerJournal:
    """Answers already decoded, kept in a JSON-lines file.

    The first line, ``{"model": <model_key>}``, names the content of the model folder the answers
    came from; every other line is one answer, ``{"key", "text"}``. An answer's key is what decides
    it besides the model: the ``model_tag`` alone for the ``full`` setting (its answers are
    reused by runs with other windows files), the ``model_tag`` and the setting's own tag in
    ``setting_tags`` where it has one (a baseline that reads other windows, or no kept keys),
    else the ``windows_tag``; then the setting's name and a digest of the sample's prompt tokens and answer
    length; then, for a sample whose filler is not its task's default (``repeat``; ``niah_text``:
    ``dialogue``), the filler's name, so answers of different fillers never mix (and the keys
    of the default filler are those journals had before the filler could be chosen). Each
    answer line carries a ``check`` digest of its key and text: a line cut short by a crash,
    or damaged since, fails it and is ignored (that answer is decoded again). :meth:`bind`
    (which :func:`run_settings` calls with the model's folder) refuses a journal of another
    model's content, and one written before journals named their model.
    """

    def __init__(self, path: str | Path, model_tag: str, windows_tag: str,
                 setting_tags: dict[str, str] | None = None) -> None:
        self.path, self.model_tag, self.windows_tag = Path(path), model_tag, windows_tag
        self.setting_tags = dict(setting_tags or {})  # a setting's own tag in place of windows_tag
        self.done: dict[str, str] = {}
        self.model: str | None = None  # the model_key the journal was written for
        self.bound: Path | None = None
        self.answer_lines = 0  # answer lines read, whether or not they passed their check
        lines = self.path.read_text(errors="replace").splitlines() if self.path.exists() else []  # damage fails a check
        for index, line in enumerate(lines):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if index == 0 and isinstance(entry, dict) and isinstance(entry.get("model"), str):
                self.model = entry["model"]
            elif isinstance(entry, dict) and "text" in entry:
                self.answer_lines += 1
                if entry.get("check") == _line_check(entry.get("key"), entry.get("text")):
                    self.done[entry["key"]] = entry["text"]

    def bind(self, model_dir: str | Path | None) -> None:
        """Tie the journal to the content of ``model_dir``: a new journal records it, one written
        for other content (or for an unnamed model) raises :class:`JournalError`."""
        if self.bound is not None and self.bound == Path(model_dir or ""):
            return
        start_over = "delete it or choose another --answers to start over"
        if not model_dir or not Path(model_dir).is_dir():
            raise JournalError(f"answers journal {self.path}: the model has no folder to identify it by "
                               f"({model_dir!r})")
        if self.model is None and self.answer_lines:
            raise JournalError(f"answers journal {self.path} does not record which model it was written for "
                               f"(an older journal); {start_over}")
        folder = Path(model_dir)
        key = model_key(folder)
        if self.model is not None and self.model != key:
            raise JournalError(f"answers journal {self.path} was written for another model: the content of "
                               f"{folder} changed since; {start_over}")
        if self.model is None:
            self.path.write_text(json.dumps({"model": key}) + "\n")
            self.model = key
        self.bound = folder

    def key(self, setting: str, sample: Sample) -> str:
        prompt = hashlib.sha256(json.dumps([sample.input_ids, sample.max_new_tokens]).encode()).hexdigest()[:20]
        tag = self.model_tag if setting == "full" else f"{self.model_tag}{self.setting_tags.get(setting, self.windows_tag)}"
        key = f"{tag}|{setting}|{prompt}"
        return key if sample.filler == task_filler(sample.task) else f"{key}|{sample.filler}"

    def get(self, setting: str, sample: Sample) -> str | None:
        return self.done.get(self.key(setting, sample))

    def add(self, setting: str, sample: Sample, text: str) -> None:
        key = self.key(setting, sample)
        self.done[key] = text
        with self.path.open("a") as fh:
            fh.write(json.dumps({"key": key, "text": text, "check": _line_check(key, text)}) + "\n")


def _line_check(key: object, text: object) -> str | None:
    """The digest an answer line carries of its key and text (``None`` for a line without them)."""
    if not isinstance(key, str) or not isinstance(text, str):
        return None
    return hashlib.sha256(json.dumps([key, text]).encode()).hexdigest()[:16]


def run_settings(model, tokenizer, settings: Sequence[Setting], samples: Sequence[Sample],
                 *, progress: bool = True, journal: AnswerJournal | None = None) -> dict[str, list[str]]:
    """``{setting name: [output text of each sample]}``; the model is left unpatched. With a
    ``journal`` (bound first to the model's folder, ``model.name_or_path``), answers found there
    are reused and new ones are added to it as they come."""
    if journal is not None:
        journal.bind(getattr(model, "name_or_path", None))
    outputs: dict[str, list[str]] = {}
    bar = tqdm(total=len(settings) * len(samples), desc="retrieval", disable=not progress)
    try:
        for setting in settings:
            outputs[setting.name] = []
            applied = False
            for sample in samples:
                text = journal.get(setting.name, sample) if journal is not None else None
                if text is None:
                    if not applied:
                        setting.apply(model)
                        applied = True
                    bar.set_postfix_str(f"{setting.name} {sample.task} {sample.length}", refresh=False)
                    text = generate_answers(model, setting, sample, tokenizer)
                    if journal is not None:
                        journal.add(setting.name, sample, text)
                outputs[setting.name].append(text)
                bar.update()
    finally:
        bar.close()
        Setting("full", None).apply(model)
    return outputs


def _cell(flags: list[bool]) -> dict:
    correct = sum(flags)
    return {
        "accuracy": correct / len(flags) if flags else None,
        "ci": wilson_interval(correct, len(flags)),
        "correct": correct,
        "trials": len(flags),
    }


def score(samples: Sequence[Sample], outputs: dict[str, list[str]]) -> dict[str, dict[str, dict]]:
    """``{setting: {task: {accuracy, ci, correct, trials, by_length, by_depth, grid}}}``.

    ``by_length`` is keyed by the length in tokens, ``by_depth`` by :func:`depth_key` of the
    requested depth, and ``grid[length][depth]`` is one heatmap cell; each value has the same
    four keys as the task's own (``accuracy``, ``ci``, ``correct``, ``trials``).
    """
    results: dict[str, dict[str, dict]] = {}
    for name, texts in outputs.items():
        flags = [is_correct(s, text) for s, text in zip(samples, texts)]
        per_task: dict[str, dict] = {}
        for task in dict.fromkeys(s.task for s in samples):
            rows = [(s, f) for s, f in zip(samples, flags) if s.task == task]
            lengths = sorted({s.length for s, _ in rows})
            depths = sorted({s.depth for s, _ in rows})
            entry = _cell([f for _, f in rows])
            entry["by_length"] = {str(n): _cell([f for s, f in rows if s.length == n]) for n in lengths}
            entry["by_depth"] = {depth_key(d): _cell([f for s, f in rows if s.depth == d]) for d in depths}
            entry["grid"] = {
                str(n): {depth_key(d): _cell([f for s, f in rows if s.length == n and s.depth == d]) for d in depths}
                for n in lengths
            }
            per_task[task] = entry
        results[name] = per_task
    return results


def setting_facts(model, setting: Setting, seq_len: int) -> dict:
    """``acr``, ``causal_coverage``, ``executed_coverage`` (as the layers run a ``seq_len`` prompt;
    with kept keys, counting the keys kept and the tail rows, :func:`aah.hf.evaluation.compare.setting_coverage`)
    and the uniform ``window``."""
    if setting.windows is None:
        return {**setting_coverage(model, setting, seq_len), "window": None}
    setting.apply(model)
    try:
        coverage = setting_coverage(model, setting, seq_len)
    finally:
        Setting("full", None).apply(model)
    uniform = setting.windows.unique()
    return {**coverage, "window": int(uniform[0]) if uniform.numel() == 1 else None}


def draw_heatmaps(results: dict[str, dict[str, dict]], path: str | Path, *, filler: str | None = None) -> Path:
    """One PNG: a depth (rows) x length (columns) accuracy heatmap per setting (rows) and task
    (columns), titled with the haystack's ``filler`` when given."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(results)
    tasks = list(next(iter(results.values())))
    fig = Figure(figsize=(3.2 * len(tasks) + 1.0, 2.8 * len(names)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(names), len(tasks), squeeze=False)
    image = None
    for r, name in enumerate(names):
        for c, task in enumerate(tasks):
            grid = results[name][task]["grid"]
            lengths = list(grid)
            depths = list(next(iter(grid.values())))
            values = [[grid[n][d]["accuracy"] for n in lengths] for d in depths]
            ax = axes[r][c]
            image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="upper")
            for i, row in enumerate(values):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), lengths, fontsize=7)
            ax.set_yticks(range(len(depths)), depths, fontsize=7)
            ax.set_title(f"{name}: {task} ({results[name][task]['accuracy']:.2f})", fontsize=9)
            if r == len(names) - 1:
                ax.set_xlabel("length (tokens)", fontsize=8)
            if c == 0:
                ax.set_ylabel("needle depth", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="accuracy")
    if filler is not None:
        fig.suptitle(f"retrieval accuracy, {filler} filler", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path
