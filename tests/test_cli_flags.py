"""The flags several commands share (aah.cli_flags): one meaning, one default, one check, everywhere.

Each flag parses its good values and refuses bad ones with one line naming the flag and the values
it takes (exit 2 through aah.cli.main); old spellings are refused with the new name; and every
parser that ``aah`` builds takes each shared flag from aah.cli_flags with its one default, so a
new command cannot drift.
"""

from __future__ import annotations

import argparse
import json

import pytest

from aah.cli import build_parser, main
from aah.cli_flags import DEFAULTS

#: The commands that take each shared flag.
COMMANDS = {
    "--windows-file": {"aah hf eval", "aah hf retrieval", "aah bench vllm"},
    "--windows": {"aah bench attention", "aah bench decode", "aah bench train"},
    "--json": {"aah hf eval", "aah hf retrieval", "aah bench attention", "aah bench decode", "aah bench train",
               "aah bench vllm"},
    "--sink-tokens": {"aah hf calibrate", "aah hf eval", "aah hf retrieval", "aah bench attention"},
    "--seq-len": {"aah hf calibrate", "aah hf eval", "aah bench attention", "aah bench decode", "aah bench train",
                  "aah bench vllm"},
    "--new-tokens": {"aah hf eval", "aah bench decode", "aah bench vllm", "aah generate"},
    "--decode-batch": {"aah hf eval", "aah bench vllm"},
}

#: The only defaults that differ from DEFAULTS, each because the value comes from elsewhere.
OVERRIDES = {
    ("aah hf eval", "--sink-tokens"): None,  # the windows file's sink tokens
    ("aah hf retrieval", "--sink-tokens"): None,  # the windows file's sink tokens
    ("aah bench decode", "--seq-len"): None,  # --context + --new-tokens, rounded up to a power of two
}


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in {id(p): p for p in action.choices.values()}.values():
                yield from _parsers(sub)


def _shared_actions():
    """(command, flag, action) for every shared flag of every parser aah builds, refusals aside."""
    for parser in _parsers(build_parser()):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag in DEFAULTS and not hasattr(action.type, "refuses"):
                    yield parser.prog, flag, action


def test_every_command_takes_the_shared_flags_from_one_place_with_one_default():
    seen: dict[str, set[str]] = {flag: set() for flag in DEFAULTS}
    for command, flag, action in _shared_actions():
        seen[flag].add(command)
        assert getattr(action.type, "flag", None) == flag, f"{command} defines {flag} itself, not via aah.cli_flags"
        expected = OVERRIDES.get((command, flag), DEFAULTS[flag])
        assert action.default == expected, f"{command} {flag}: default {action.default!r}, expected {expected!r}"
        assert action.required == (flag == "--windows-file"), f"{command} {flag}"
    assert seen == COMMANDS
    assert {key[0] for key in OVERRIDES} <= {c for commands in COMMANDS.values() for c in commands}


def _parse(argv):
    return build_parser().parse_args(argv)


def test_good_values_parse(tmp_path):
    windows_file = tmp_path / "w.safetensors"
    windows_file.write_bytes(b"")
    args = _parse(["bench", "attention", "--seq-len", "2", "--sink-tokens", "0", "--windows", "4, 8,16",
                   "--json", str(tmp_path / "a.json")])
    assert (args.seq_len, args.sink_tokens, args.windows, args.json) == (2, 0, (4, 8, 16), str(tmp_path / "a.json"))
    assert _parse(["bench", "decode", "--new-tokens", "1", "--json", "-"]).json == "-"
    args = _parse(["bench", "vllm", str(tmp_path), "--windows-file", str(windows_file), "--decode-batch", "1",
                   "--new-tokens", "7"])
    assert (args.windows_file, args.decode_batch, args.new_tokens) == (str(windows_file), 1, 7)
    args = _parse(["bench", "attention"])
    assert (args.seq_len, args.sink_tokens, args.windows, args.json) == (4096, 4, None, None)


def _one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("flag,command,bad,takes", [
    ("--seq-len", ["bench", "attention"], ["1", "x", "2.5", "-4"], "an int >= 2"),
    ("--sink-tokens", ["bench", "attention"], ["-1", "x", "1.5"], "an int >= 0"),
    ("--new-tokens", ["bench", "decode"], ["0", "x", "-2"], "an int >= 1"),
    ("--decode-batch", ["hf", "eval", "m"], ["0", "x"], "an int >= 1"),
    ("--windows", ["bench", "train"], ["4,x", "4,,8", "0,8", "", "-3", "8;16"], "comma-separated list of positive ints"),
])
def test_bad_values_are_one_line_naming_the_flag_and_what_it_takes(capsys, flag, command, bad, takes):
    for value in bad:
        line = _one_line(capsys, [*command, f"{flag}={value}"])
        assert line.startswith(f"aah {' '.join(c for c in command if c != 'm')}: {flag} takes ")
        assert takes in line and repr(value) in line


def test_a_missing_or_folder_windows_file_is_named_before_any_work(capsys, tmp_path):
    for value, problem in (("no/such/file.safetensors", "no file no/such/file.safetensors"),
                           (str(tmp_path), f"{tmp_path} is a directory, not a file")):
        line = _one_line(capsys, ["hf", "retrieval", "m", "--windows-file", value])
        assert line.startswith("aah hf retrieval: --windows-file: ") and problem in line


@pytest.mark.parametrize(("flag", "command", "value", "problem"), [
    ("--json", ["bench", "attention"], "no/such/folder/out.json", "no folder no/such/folder"),
    ("--json", ["bench", "decode"], ".", "it is a directory"),
    ("--json", ["bench", "train"], "README.md/out.json", "no folder README.md"),
    ("--heatmap", ["hf", "retrieval", "m", "--windows-file", "README.md"], "out.gif", "its suffix must be one of .png, .pdf, .svg"),
    ("--answers", ["hf", "retrieval", "m", "--windows-file", "README.md"], "docs", "it is a directory"),
    ("--out", ["hf", "calibrate", "m"], "docs", "it is a directory"),
    ("--out", ["report", "docs"], "README.md", "it is a file, not a folder"),
    ("--out", ["bench", "grid"], "no/such/folder/grid.json", "no folder no/such/folder"),
    ("--out", ["train", "c.yaml"], "README.md", "it is a file, not a folder"),
    ("--out", ["experiment", "s.yaml"], "README.md/runs", "README.md is a file, not a folder"),
    ("--records", ["experiment", "s.yaml"], "pyproject.toml", "it is a file, not a folder"),
])
def test_outputs_that_cannot_be_written_are_refused_before_any_work(capsys, flag, command, value, problem):
    line = _one_line(capsys, [*command, flag, value])
    assert line.endswith(f"{flag}: cannot write {value!r}: {problem}")


@pytest.mark.parametrize("command", [["hf", "eval", "m"], ["hf", "retrieval", "m"], ["bench", "vllm", "m"]])
def test_windows_given_a_file_names_windows_file(capsys, tmp_path, command):
    for value in (str(tmp_path / "w.safetensors"), "4,8"):
        line = _one_line(capsys, [*command, "--windows", value])
        assert "--windows-file FILE" in line and line.startswith(f"aah {command[0]} {command[1]}: --windows ")


@pytest.mark.parametrize("command", [["bench", "attention"], ["bench", "decode"], ["bench", "train"]])
def test_a_bare_json_names_json_file(capsys, command):
    for argv in ([*command, "--json"], [*command, "--json", "--seq-len", "64"]):
        line = _one_line(capsys, argv)
        assert "--json FILE" in line and "--json - (stdout)" in line


def test_max_new_tokens_names_new_tokens(capsys, tmp_path):
    assert "--new-tokens N" in _one_line(capsys, ["generate", str(tmp_path), "--max-new-tokens", "5"])


def test_json_file_and_stdout_hold_the_same_object(capsys, tmp_path):
    argv = ["bench", "attention", "--seq-len", "16", "--heads", "2", "--head-dim", "8", "--backends", "dense",
            "--repeats", "1", "--warmup", "0", "--device", "cpu"]
    out = tmp_path / "a.json"
    assert main([*argv, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "dense" in table and not table.lstrip().startswith("{")  # the table, as without --json
    assert main([*argv, "--json", "-"]) == 0
    printed = json.loads(capsys.readouterr().out)  # the JSON alone
    written = json.loads(out.read_text())
    assert set(printed) == set(written) and printed["config"] == written["config"]
