"""Run-folder JSON (meta.json, eval.json) is written atomically with the user's umask, so
colleagues reading shared run folders can open it."""

from __future__ import annotations

import os
import stat

import pytest

from aah.train.run_dir import write_json_atomic


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_run_folder_json_takes_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "meta.json", {"step": 3})
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "meta.json").stat().st_mode) == mode
    assert (tmp_path / "meta.json").read_text() == '{\n  "step": 3\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["meta.json"]  # no temporary file left behind
