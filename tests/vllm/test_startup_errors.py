"""aah.vllm's start-up errors: a bad windows file or setting is refused in one line naming the
file, in vLLM's front-end process before any engine starts (``vllm serve``, ``vllm.LLM``, the
runner behind ``aah bench vllm``); a windows file kept in the model folder is served and never
loaded as weights. The checks themselves run here without vLLM; the end-to-end tests need the
vLLM environment and skip, with the reason, without it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from aah.hf.bridge.windows_file import model_signature, save_windows
from aah.vllm.startup import (
    StartupError,
    WindowsSource,
    check_settings,
    check_windows_file,
    drop_windows_files,
    is_windows_file,
    windows_source,
)

#: A Llama-shaped configuration: 2 layers, 4 query heads on 2 KV heads, head size 16.
CONFIG = {"model_type": "llama", "vocab_size": 50, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "hidden_size": 64}


def _meta(config: dict, **changes) -> dict:
    meta = {"model": model_signature(SimpleNamespace(**config)), "seq_len": 64, "policy": "uniform",
            "budget": 0.5, "sink_tokens": 4, "acr": 0.5, "causal_coverage": 0.5}
    return {**meta, **changes}


def _bad_file(kind: str, folder: Path) -> tuple[Path, str]:
    """A path of ``kind`` and what its refusal says after the path and its source."""
    path = folder / f"{kind}.safetensors"
    if kind == "missing":
        return path, "does not exist"
    if kind == "directory":
        path.mkdir()
        return path, "is a directory, not a windows file"
    if kind == "fifo":
        os.mkfifo(path)
        return path, "is not a regular file"
    if kind == "empty":
        path.write_bytes(b"")
        return path, "is not a readable windows file: "
    if kind == "garbage":
        path.write_bytes(b"not a safetensors file at all, but long enough to have a header")
        return path, "is not a readable windows file: "
    if kind == "weights":
        save_file({f"model.layers.{i}.mlp.weight": torch.zeros(2, 2) for i in range(5)}, str(path))
        return path, "is not a windows file: it holds 5 tensors (model.layers.0.mlp.weight, "
    if kind == "another_model":
        save_windows(path, torch.full((3, 4), 8), _meta({**CONFIG, "num_hidden_layers": 3}))
        return path, "was calibrated for {'model_type': 'llama', 'num_layers': 3"
    if kind == "wrong_shape":  # the right signature, windows of another shape
        save_windows(path, torch.full((2, 3), 8), _meta(CONFIG))
        return path, "holds windows of shape (2, 3); this model needs (2, 4)"
    if kind == "edited":  # the windows changed after the checksum was written
        save_windows(path, torch.full((2, 4), 8), _meta(CONFIG))
        data = bytearray(path.read_bytes())
        data[-300:] = data[-300:].replace((8).to_bytes(8, "little"), (9).to_bytes(8, "little"), 1)
        path.write_bytes(bytes(data))
        return path, "is refused: its windows or metadata do not match its sha256"
    if kind == "bad_sinks":
        save_windows(path, torch.full((2, 4), 8), _meta(CONFIG, sink_tokens=-1))
        return path, "is refused: metadata sink_tokens must be an integer in [0, 4096], got -1"
    if kind == "no_metadata":
        save_file({"windows": torch.full((2, 4), 8)}, str(path))
        return path, "lacks metadata ['model', "
    raise AssertionError(kind)


BAD_FILES = ["missing", "directory", "fifo", "empty", "garbage", "weights", "another_model", "wrong_shape", "edited",
             "bad_sinks", "no_metadata"]


@pytest.mark.parametrize("kind", BAD_FILES)
def test_a_bad_windows_file_is_refused_in_one_line_naming_it(kind, tmp_path):
    path, says = _bad_file(kind, tmp_path)
    with pytest.raises(StartupError) as refused:
        check_windows_file(WindowsSource(path, "$AAH_WINDOWS"), SimpleNamespace(**CONFIG))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"aah.vllm: windows file {path} (named by $AAH_WINDOWS) {says}"), message


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permissions do not stop root from reading")
def test_an_unreadable_windows_file_is_refused_in_one_line(tmp_path):
    path = save_windows(tmp_path / "w.safetensors", torch.full((2, 4), 8), _meta(CONFIG))
    path.chmod(0)
    with pytest.raises(StartupError, match=r"^aah\.vllm: windows file .* is not a readable windows file: "):
        check_windows_file(WindowsSource(path, "$AAH_WINDOWS"), SimpleNamespace(**CONFIG))


def test_a_good_windows_file_gives_its_windows_and_sinks(tmp_path):
    path = save_windows(tmp_path / "w.safetensors", torch.tensor([[3, 3, 9, 9], [5, 5, 7, 7]]), _meta(CONFIG))
    windows, sinks = check_windows_file(WindowsSource(path, "$AAH_WINDOWS"), SimpleNamespace(**CONFIG))
    assert windows.tolist() == [[3, 3, 9, 9], [5, 5, 7, 7]] and sinks == 4


def test_the_line_names_what_named_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("AAH_WINDOWS", raising=False)
    assert windows_source(tmp_path, SimpleNamespace()) is None
    config = SimpleNamespace(aah_windows="w.safetensors")
    assert windows_source(tmp_path, config) == WindowsSource(tmp_path / "w.safetensors",
                                                             f'"aah_windows" of {tmp_path / "config.json"}')
    overridden = windows_source(tmp_path, config, {"aah_windows": "w.safetensors"})
    assert overridden == WindowsSource(tmp_path / "w.safetensors", '"aah_windows" of --hf-overrides')
    monkeypatch.setenv("AAH_WINDOWS", str(tmp_path / "env.safetensors"))
    assert windows_source(tmp_path, config) == WindowsSource(tmp_path / "env.safetensors", "$AAH_WINDOWS")


@pytest.mark.parametrize("setting,says", [
    ({"platform": "cuda"}, "cannot be served on vLLM's cuda platform: AAH windows run on vLLM's CPU platform only"),
    ({"kv_cache_dtype": "fp8"}, "cannot be served with kv_cache_dtype='fp8'"),
    ({"use_mla": True}, "cannot be served with this model's multi-head latent attention (MLA)"),
    ({"encoder_decoder": True}, "cannot be served with an encoder-decoder model"),
    ({"attention_free": True}, "cannot be served with an attention-free model"),
    ({"draft_model": "tiny-draft"}, "cannot be served with speculative decoding by a draft model (tiny-draft)"),
])
def test_settings_the_plugin_cannot_serve_are_refused_in_one_line(setting, says, tmp_path):
    source = WindowsSource(tmp_path / "w.safetensors", "$AAH_WINDOWS")
    served = {"platform": "cpu", "kv_cache_dtype": "auto"}
    check_settings(source, **served)  # what the plugin serves passes
    with pytest.raises(StartupError) as refused:
        check_settings(source, **{**served, **setting})
    assert str(refused.value).startswith(f"aah.vllm: windows file {source.path} (named by $AAH_WINDOWS) {says}")


def test_windows_files_among_the_weight_files_are_dropped(tmp_path):
    weights = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(weights))
    windows = save_windows(tmp_path / "aah_windows.safetensors", torch.full((2, 4), 8), _meta(CONFIG))
    old = tmp_path / "old.safetensors"  # a windows file from before the checksum: the tensor `windows` alone
    save_file({"windows": torch.full((2, 4), 8)}, str(old))
    one_tensor = tmp_path / "one.safetensors"  # weights that happen to hold a tensor `windows`, and more
    save_file({"windows": torch.zeros(1), "lm_head.weight": torch.zeros(1)}, str(one_tensor))
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x00")
    files = [str(p) for p in (weights, windows, old, one_tensor, broken, tmp_path / "pytorch_model.bin")]
    assert is_windows_file(windows) and is_windows_file(old) and not is_windows_file(weights)
    assert drop_windows_files(files) == [files[0], files[3], files[4], files[5]]


# ---- aah bench vllm: checked before either engine starts ------------------------------------


@pytest.mark.parametrize("kind", ["garbage", "weights", "another_model", "edited"])
def test_bench_refuses_a_bad_windows_file_in_one_line(kind, tmp_path, capsys):
    from aah.vllm.bench import main as bench_main

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    path, says = _bad_file(kind, tmp_path)
    assert bench_main([str(tmp_path), "--windows-file", str(path), "--vllm-python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"aah bench vllm: windows file {path} (named by --windows-file) {says}"), err


@pytest.mark.parametrize("kind,says", [("missing", "no file"), ("directory", "is a directory, not a file")])
def test_bench_refuses_a_missing_windows_file_in_one_line(kind, says, tmp_path, capsys):
    from aah.vllm.bench import main as bench_main

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    path, _ = _bad_file(kind, tmp_path)
    assert bench_main([str(tmp_path), "--windows-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and says in err, err


# ---- in vLLM (the vLLM environment) ----------------------------------------------------------


@pytest.fixture(scope="module")
def startup_setup(tmp_path_factory, byte_bpe):
    """The vLLM environment checked; the tiny Llama of test_plugin, a windows file for it, one for
    another model, and a copy of the model folder whose config.json names the windows file kept
    beside its weights."""
    from .test_plugin import (
        MAX_LEN,
        TINY_SINKS,
        TINY_WINDOWS,
        _tiny_model,
        _vllm_unavailable,
        _windows_file,
    )

    reason = _vllm_unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm_startup")
    model_dir = _tiny_model(root, byte_bpe)
    windows = _windows_file(root / "w.safetensors", model_dir, TINY_WINDOWS, TINY_SINKS)
    other = root / "other.safetensors"
    config = json.loads((model_dir / "config.json").read_text())
    signature = {**model_signature(SimpleNamespace(**config)), "num_layers": 3}
    save_windows(other, torch.full((3, 4), 8), {**_meta(CONFIG), "model": signature, "seq_len": MAX_LEN})
    folder = root / "folder"
    shutil.copytree(model_dir, folder)
    shutil.copy(windows, folder / "aah_windows.safetensors")
    (folder / "config.json").write_text(json.dumps({**config, "aah_windows": "aah_windows.safetensors"}))
    missing = root / "missing"
    shutil.copytree(model_dir, missing)
    (missing / "config.json").write_text(json.dumps({**config, "aah_windows": "aah_windows.safetensors"}))
    return SimpleNamespace(root=root, model=model_dir, windows=windows, other=other, folder=folder, missing=missing)


def _line(path, named_by: str, says: str) -> str:
    return f"aah.vllm: windows file {path} (named by {named_by}) {says}"


#: Runs ``vllm.LLM(...)`` once per case (vLLM imported once) and records what each raised and
#: whether vLLM's engine was built; in its own process, as a user's program would be.
LLM_CASES_SCRIPT = '''
import json, os, sys

def main():
    from vllm import LLM
    from vllm.v1.engine.llm_engine import LLMEngine

    built = []
    init = LLMEngine.__init__

    def recording_init(self, *args, **kwargs):
        built.append(True)
        return init(self, *args, **kwargs)

    LLMEngine.__init__ = recording_init
    cases, out = json.load(open(sys.argv[1])), {}
    for name, case in cases.items():
        os.environ.pop("AAH_WINDOWS", None)
        os.environ.update(case.get("env", {}))
        built.clear()
        args = {"dtype": "float32", "skip_tokenizer_init": True, "gpu_memory_utilization": 0.3, "max_model_len": 512,
                "enforce_eager": True, **case.get("args", {})}
        if args["dtype"] == "bfloat16" and not __import__("torch").cpu._is_amx_tile_supported():
            out[name] = {"skipped": True}
            continue
        try:
            LLM(model=case["model"], **args)
            out[name] = {"raised": None, "engine_built": bool(built)}
        except Exception as exc:
            out[name] = {"raised": type(exc).__name__, "message": str(exc), "engine_built": bool(built)}
    json.dump(out, open(sys.argv[2], "w"))

if __name__ == "__main__":
    main()
'''


@pytest.mark.slow
def test_vllm_llm_refuses_bad_start_ups_before_the_engine_is_built(startup_setup):
    from .test_plugin import VLLM_PYTHON

    s = startup_setup
    garbage, _ = _bad_file("garbage", s.root)
    cases = {
        "another model": ({"env": {"AAH_WINDOWS": str(s.other)}},
                          _line(s.other, "$AAH_WINDOWS", "was calibrated for {'model_type': 'llama', 'num_layers': 3")),
        "missing": ({"env": {"AAH_WINDOWS": str(s.root / "nope.safetensors")}},
                    _line(s.root / "nope.safetensors", "$AAH_WINDOWS", "does not exist")),
        "directory": ({"env": {"AAH_WINDOWS": str(s.root)}},
                      _line(s.root, "$AAH_WINDOWS", "is a directory, not a windows file")),
        "malformed": ({"env": {"AAH_WINDOWS": str(garbage)}},
                      _line(garbage, "$AAH_WINDOWS", "is not a readable windows file: ")),
        "weights": ({"env": {"AAH_WINDOWS": str(s.model / "model.safetensors")}},
                    _line(s.model / "model.safetensors", "$AAH_WINDOWS", "is not a windows file: it holds ")),
        "missing by config.json": ({"model": str(s.missing)},
                                   _line(s.missing / "aah_windows.safetensors",
                                         f'"aah_windows" of {s.missing / "config.json"}', "does not exist")),
        "missing by --hf-overrides": ({"args": {"hf_overrides": {"aah_windows": "nope.safetensors"}}},
                                      _line(s.model / "nope.safetensors", '"aah_windows" of --hf-overrides',
                                            "does not exist")),
        "quantised KV cache": ({"env": {"AAH_WINDOWS": str(s.windows)}, "args": {"kv_cache_dtype": "fp8"}},
                               _line(s.windows, "$AAH_WINDOWS", "cannot be served with kv_cache_dtype='fp8'")),
        "bfloat16 pages with AMX": ({"env": {"AAH_WINDOWS": str(s.windows)}, "args": {"dtype": "bfloat16"}},
                                    _line(s.windows, "$AAH_WINDOWS",
                                          "cannot be served with dtype torch.bfloat16 here: vLLM's CPU attention "
                                          "stores keys for isa='amx'")),
    }
    spec = {name: {"model": str(s.model), **case} for name, (case, _) in cases.items()}
    (s.root / "cases.json").write_text(json.dumps(spec))
    (s.root / "cases.py").write_text(LLM_CASES_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "AAH_WINDOWS"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    done = subprocess.run([str(VLLM_PYTHON), str(s.root / "cases.py"), str(s.root / "cases.json"),
                           str(s.root / "out.json")], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads((s.root / "out.json").read_text())
    for name, (_, line) in cases.items():
        got = out[name]
        if got.get("skipped"):  # the page layout is refused on CPUs with AMX only
            continue
        assert got["raised"] == "StartupError" and not got["engine_built"], (name, got)
        assert "\n" not in got["message"] and got["message"].startswith(line), (name, got["message"])


def _serve(model: Path, env: dict, log: Path) -> subprocess.CompletedProcess:
    from .test_plugin import MAX_LEN, VLLM_PYTHON, _free_port

    command = ["timeout", "300", str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(_free_port()), "--dtype", "float32", "--max-model-len",
               str(MAX_LEN), "--enforce-eager", "--gpu-memory-utilization", "0.3"]
    base = {k: v for k, v in os.environ.items() if k != "AAH_WINDOWS"}
    with open(log, "w") as fh:
        return subprocess.run(command, env={**base, "VLLM_CPU_KVCACHE_SPACE": "1", **env}, stdout=fh,
                              stderr=subprocess.STDOUT, timeout=360)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["another model by $AAH_WINDOWS", "missing by config.json"])
def test_vllm_serve_stops_with_the_line_last_before_the_engine_starts(startup_setup, case):
    s = startup_setup
    if case == "another model by $AAH_WINDOWS":
        model, env = s.model, {"AAH_WINDOWS": str(s.other)}
        line = _line(s.other, "$AAH_WINDOWS", "was calibrated for {'model_type': 'llama', 'num_layers': 3")
    else:
        model, env = s.missing, {}
        line = _line(s.missing / "aah_windows.safetensors", f'"aah_windows" of {s.missing / "config.json"}',
                     "does not exist")
    log = s.root / f"serve-{case.split()[0]}.log"
    done = _serve(model, env, log)
    text = log.read_text()
    lines = text.rstrip("\n").splitlines()
    assert done.returncode == 1, text[-3000:]
    assert lines[-1].startswith(line), text[-3000:]
    assert "Traceback" not in text and "EngineCore" not in text, text[-3000:]


@pytest.mark.slow
def test_the_runner_behind_the_bench_stops_with_the_line_last(startup_setup):
    from .test_plugin import VLLM_PYTHON

    s = startup_setup
    spec = {"model": str(s.model), "in_process": True, "engines": [
        {"name": "aah", "windows": str(s.other), "engine_args": {"enforce_eager": True, "max_model_len": 512},
         "rounds": [{"prompts": [[1, 2, 3]], "max_tokens": 1}]},
    ]}
    (s.root / "bad_spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "AAH_WINDOWS"}
    done = subprocess.run([str(VLLM_PYTHON), "-m", "aah.vllm.runner", str(s.root / "bad_spec.json"),
                           str(s.root / "bad_out.json")], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith(_line(s.other, "$AAH_WINDOWS", "was calibrated for ")), done.stderr[-3000:]
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_windows_file_in_the_model_folder_is_served_not_loaded_as_weights(startup_setup):
    """The folder's config.json names aah_windows.safetensors beside model.safetensors: vLLM with
    the plugin serves its windows (equal to aah.hf's patched model), and a vanilla engine on the
    same folder loads the weights alone (equal to the unpatched model). The engines' workers run
    in their own processes, as under ``vllm serve``."""
    from .test_plugin import (
        MAX_LEN,
        TINY_SINKS,
        TINY_WINDOWS,
        VLLM_PYTHON,
        _check_requests,
        _hf_logprobs,
        _prompts,
    )

    s = startup_setup
    prompts = _prompts([300, 37, 2], seed=11)
    round_ = {"prompts": prompts, "max_tokens": 3, "prompt_logprobs": True}
    eager = {"enforce_eager": True, "max_model_len": MAX_LEN}
    spec = {"model": str(s.folder), "in_process": False, "engines": [
        {"name": "folder", "engine_args": eager, "rounds": [round_]},  # no "windows": config.json decides
        {"name": "vanilla", "windows": None, "engine_args": eager, "rounds": [round_]},
    ]}
    (s.root / "folder_spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "AAH_WINDOWS"}
    done = subprocess.run([str(VLLM_PYTHON), "-m", "aah.vllm.runner", str(s.root / "folder_spec.json"),
                           str(s.root / "folder_out.json")], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads((s.root / "folder_out.json").read_text())
    _check_requests(out["folder"]["rounds"][0], prompts,
                    lambda seqs: _hf_logprobs(s.model, TINY_WINDOWS, TINY_SINKS, seqs))
    _check_requests(out["vanilla"]["rounds"][0], prompts, lambda seqs: _hf_logprobs(s.model, None, 0, seqs))
