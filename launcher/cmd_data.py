"""``baton data build INPUTS... --output PATH``: tokenize text into an HDF5 token dataset.

The build runs ``python -m core.data.build`` in a subprocess: it needs h5py and numpy,
which the login-node CLI never imports, so ``baton`` itself stays light and starts fast.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from core.config.inputs import arg_text

REPO_ROOT = Path(__file__).resolve().parents[1]  # so `-m core.data.build` resolves without an install


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``data`` and its ``build`` subcommand."""
    data = sub.add_parser("data", help="build token datasets", description="Token dataset tools.")
    data_sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND", parser_class=type(data))
    data_sub.required = True
    p = data_sub.add_parser(
        "build", help="tokenize .txt/.jsonl/.parquet files into an HDF5 token dataset",
        description="Tokenize text into an HDF5 file with a contiguous, memory-mappable `tokens` dataset "
                    "and `doc_offsets`. A .txt file is one document; .jsonl takes one document per line "
                    "from --text-key; .parquet (needs pyarrow) from the --text-key column. Runs "
                    "`python -m core.data.build` in a subprocess to keep the login-node CLI light "
                    "(no h5py import in `baton` itself).",
    )
    p.add_argument("inputs", nargs="+", type=arg_text, help=".txt (one document per file), .jsonl, .parquet files or folders")
    p.add_argument("--output", "-o", required=True, type=arg_text, help="the HDF5 file to write")
    p.add_argument("--tokenizer", default="byte", type=arg_text,
                   help="'byte' (built-in, vocab 257, EOS 256), 'qwen3' (Qwen2/2.5/3 BPE, offline, vocab 151669, "
                   "EOS <|endoftext|>) or a Hugging Face model folder (hf:PATH or PATH; its tokenizer.json and "
                   "tokenizer_config.json's eos_token)")
    p.add_argument("--text-key", default="text", type=arg_text, help="JSONL field / parquet column with the text (default: text)")
    p.set_defaults(func=run)


def build_command(args: argparse.Namespace) -> list[str]:
    """The subprocess command line for ``args`` (inputs first, then the options)."""
    return [sys.executable, "-m", "core.data.build", *args.inputs, "--output", args.output,
            "--tokenizer", args.tokenizer, "--text-key", args.text_key]


def run(args: argparse.Namespace) -> int:
    """Run the build in a subprocess; its exit code is ours (2 on bad input)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(build_command(args), env=env, check=False).returncode
