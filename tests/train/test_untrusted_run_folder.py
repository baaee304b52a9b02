"""A run folder from someone else runs none of its code: the training state is read without
unpickling, an older version's pickled ``train_state.pt`` is refused unless trusted, and
``aah eval`` / ``aah generate`` never read the training state at all."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from aah.cli import main
from aah.config import load_config
from aah.train import train
from aah.train.checkpoint import (
    PICKLED_STATE_FILE,
    STATE_JSON,
    STATE_TENSORS,
    PickledStateError,
    checkpoint_dir,
    read_train_state,
    rng_state,
)
from aah.train.state_codec import decode, encode

#: The checkpoints of the shared run (``trained`` in conftest.py).
STEPS = (4, 8, 12)


class Plant:
    """Unpickling it creates ``marker``: what a hostile pickle could do with any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def reseal(folder: Path) -> None:
    """Rewrite the manifest to fit the files, as anyone who writes a run folder can."""
    info = json.loads((folder / "info.json").read_text())
    info["files"] = {
        f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
        for f in sorted(folder.iterdir()) if f.name != "info.json"
    }
    (folder / "info.json").write_text(json.dumps(info))


def pickle_state(folder: Path, state: object) -> None:
    """Turn ``folder`` into a checkpoint as older versions wrote it: the state in train_state.pt."""
    (folder / STATE_JSON).unlink()
    (folder / STATE_TENSORS).unlink()
    torch.save(state, folder / PICKLED_STATE_FILE)
    reseal(folder)


def one_line_error(code: int, err: str) -> str:
    lines = [line for line in err.strip().splitlines() if not line.startswith("skipping checkpoint")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def last_loss(run: Path) -> float:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"][-1]["loss"]


def test_a_hostile_pickled_state_runs_no_code_in_resume_eval_or_generate(run, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    for step in STEPS:
        pickle_state(checkpoint_dir(run, step), {"step": step, "optimizer": Plant(marker)})

    line = one_line_error(main(["train", "--resume", str(run)]), capsys.readouterr().err)
    assert str(checkpoint_dir(run, 12) / PICKLED_STATE_FILE) in line
    assert "unpickle" in line and "--trust-pickled-state" in line
    with pytest.raises(PickledStateError, match="train_state.pt"):
        train(load_config(run / "config.yaml"), run, resume=True)

    assert main(["eval", str(run), "--device", "cpu"]) == 0
    assert json.loads((run / "eval.json").read_text())["checkpoint_step"] == 12
    assert main(["generate", str(run), "--prompt", "It is", "--new-tokens", "4", "--temperature", "0"]) == 0
    assert "skipping" not in capsys.readouterr().err
    assert not marker.exists()

    # The check above can fail: trusting the file runs its code.
    read_train_state(checkpoint_dir(run, 12), trust_pickled_state=True)
    assert marker.exists()


def test_a_trusted_pickled_state_resumes_exactly_and_the_next_checkpoint_has_no_pickle(run, trained, capsys):
    folder = checkpoint_dir(run, 8)
    pickle_state(folder, read_train_state(folder))  # what an older version wrote at step 8
    shutil.rmtree(checkpoint_dir(run, 12))  # it "crashed" after step 8

    assert main(["train", "--resume", str(run), "--trust-pickled-state"]) == 0
    assert "from step 8" in capsys.readouterr().err
    assert last_loss(run) == last_loss(trained)
    names = {f.name for f in checkpoint_dir(run, 12).iterdir()}
    assert names == {"model.safetensors", STATE_TENSORS, STATE_JSON, "info.json"}

    one_line_error(main(["train", "configs/none.yaml", "--trust-pickled-state"]), capsys.readouterr().err)


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def name_a_missing_tensor(path: Path) -> None:
    path.write_text(path.read_text().replace('"optimizer/state/0/exp_avg"', '"nowhere"'))


def drop_the_data_position(path: Path) -> None:
    state = json.loads(path.read_text())
    del state["data"]
    path.write_text(json.dumps(state))


DAMAGE = {
    "truncated json": (STATE_JSON, truncate, False, "truncated"),
    "truncated tensors": (STATE_TENSORS, truncate, False, "truncated"),
    "truncated json, manifest rewritten": (STATE_JSON, truncate, True, "cannot be read"),
    "truncated tensors, manifest rewritten": (STATE_TENSORS, truncate, True, "cannot be read"),
    "json names a missing tensor, manifest rewritten": (STATE_JSON, name_a_missing_tensor, True, "'nowhere'"),
    "json without a data position, manifest rewritten": (STATE_JSON, drop_the_data_position, True, "'data'"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_or_edited_train_state_is_refused_naming_the_file(run, damage, capsys):
    name, spoil, resealed, reason = DAMAGE[damage]
    for step in STEPS:
        folder = checkpoint_dir(run, step)
        spoil(folder / name)
        if resealed:
            reseal(folder)
    line = one_line_error(main(["train", "--resume", str(run)]), capsys.readouterr().err)
    assert name in line and reason in line


def test_eval_and_generate_ignore_a_missing_or_damaged_train_state(run, capsys):
    folder = checkpoint_dir(run, 12)
    (folder / STATE_JSON).unlink()
    truncate(folder / STATE_TENSORS)
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    assert json.loads((run / "eval.json").read_text())["checkpoint_step"] == 12
    assert main(["generate", str(run), "--prompt", "It is", "--new-tokens", "4", "--checkpoint", "12"]) == 0
    assert "skipping" not in capsys.readouterr().err


def test_the_state_codec_gives_back_rng_and_optimizer_states_exactly():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = {
        "optimizer": optimizer.state_dict(), "rng": rng_state(), "shared": [model.weight, model.weight],
        "tagged": {"__tensor__": "not a reference"}, "scalar": np.int64(7), "nan": float("nan"),
    }
    structure, tensors = encode(state)
    back = decode(json.loads(json.dumps(structure)), tensors)
    assert back["rng"]["python"] == state["rng"]["python"]
    numpy_back, numpy_saved = back["rng"]["numpy"], state["rng"]["numpy"]
    assert numpy_back[0] == numpy_saved[0] and numpy_back[2:] == numpy_saved[2:]
    assert np.array_equal(numpy_back[1], numpy_saved[1]) and numpy_back[1].dtype == numpy_saved[1].dtype
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    saved_opt = state["optimizer"]
    assert back["optimizer"]["param_groups"] == saved_opt["param_groups"]
    assert list(back["optimizer"]["state"]) == list(saved_opt["state"]) == [0, 1]
    for pid, entry in saved_opt["state"].items():
        for key, value in entry.items():
            assert torch.equal(back["optimizer"]["state"][pid][key], value)
    assert all(torch.equal(t, model.weight) for t in back["shared"])
    assert back["tagged"] == {"__tensor__": "not a reference"} and back["scalar"] == 7
    assert np.isnan(back["nan"])

    with pytest.raises(TypeError, match="cannot store a Plant"):
        encode({"x": Plant(Path("unused"))})
    for bad in ({"__tensor__": "missing"}, {"__ndarray__": [1], "dtype": "O"}, {"__items__": [[1]]}):
        with pytest.raises(ValueError):
            decode(bad, {})
    with pytest.raises(ValueError, match="never names"):
        decode({}, {"extra": torch.zeros(1)})
