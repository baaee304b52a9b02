"""Reading records (run folders with a checksum manifest): verified first, refused when damaged."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from aah.errors import CLIError
from aah.experiment import RecordError, write_manifest
from aah.report import cli as report_cli
from aah.report.runs import load_run

from ..experiment.test_records import DAMAGE as RECORD_DAMAGE


def _record(root: Path) -> Path:
    """A finished, evaluated run of full attention kept as a record."""
    folder = root / "full_attention" / "seed0"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("aah:\n  regime: full_attention\ntrain:\n  seed: 0\n")
    (folder / "meta.json").write_text(json.dumps({"regime": "full_attention", "seed": 0, "status": "complete"}))
    lines = [{"kind": "train", "step": 10, "loss": 5.0, "tokens_per_s": 900.0},
             {"kind": "train", "step": 20, "loss": 4.0, "tokens_per_s": 1000.0},
             {"kind": "eval", "step": 20, "val_loss": 4.5}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "eval.json").write_text(json.dumps({"val_loss": 4.4, "seq_len": 64}))
    write_manifest(folder)
    return folder


#: The record damages of the suite's tests, less the missing manifest (a folder without one is a
#: plain run folder to aah report), plus a manifest that cannot be read.
DAMAGE = {name: damage for name, damage in RECORD_DAMAGE.items() if damage[0] != "manifest.json"}
DAMAGE["manifest.json unreadable"] = ("manifest.json", lambda p: p.write_bytes(p.read_bytes()[:40]), "cannot be read")


def test_an_intact_record_reads_as_its_run(tmp_path):
    run = load_run(_record(tmp_path))
    assert run.eval_value("val_loss") == 4.4 and run.final_val_loss() == 4.5 and run.bad_lines == 0
    assert run.train_tokens_per_s() == 1000.0


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_record_is_refused_naming_the_file(tmp_path, damage):
    name, spoil, why = DAMAGE[damage]
    folder = _record(tmp_path / "records")
    spoil(folder / name)
    with pytest.raises(RecordError) as refused:
        load_run(folder)
    assert str(refused.value).startswith(f"{folder / name} ") and why in str(refused.value)
    parser = argparse.ArgumentParser(prog="aah")
    report_cli.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", str(tmp_path / "records"), "--out", str(tmp_path / "report")])
    with pytest.raises(CLIError) as refused:  # aah prints it as one line, exit status 2
        args.func(args)
    assert "\n" not in str(refused.value) and str(folder / name) in str(refused.value) and why in str(refused.value)
    assert not (tmp_path / "report" / "report.md").exists()
