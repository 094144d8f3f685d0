"""Build an HDF5 token dataset from text files: ``python -m core.data.build`` / ``baton data build``.

Inputs (files, or folders searched recursively for these suffixes):

- ``.txt``: one document per file, read exactly (blank lines, trailing newlines and all).
  Splitting on blank lines would lose the exact whitespace; put documents that must be
  split in a ``.jsonl`` file instead.
- ``.jsonl``: one JSON object per line, the document under ``text_key``; blank lines skipped.
- ``.parquet``: the ``text_key`` column, read in record batches; needs ``pyarrow``.

Output, format version 1: an HDF5 file with

- ``tokens``: 1-D, contiguous (no chunks, no compression, so readers can memory-map it),
  uint16 when the vocabulary fits in 16 bits, else uint32; every document is followed by EOS.
- ``doc_offsets``: int64, where each document starts in ``tokens``.
- attrs ``vocab_size``, ``tokenizer``, ``eos_id``, ``format_version``, ``documents``.

Why a raw temporary file and not two passes: a contiguous dataset needs its length when
it is created, but tokenizing twice doubles the slowest part of the build. So the one
tokenizing pass streams ids to a raw file beside the output (constant memory, one
document at a time), then the ids are copied into the dataset in fixed-size chunks. The
cost is disk: about twice the token bytes, for a moment. The HDF5 file is written under a
temporary name and renamed into place, so a crash never leaves a half-written dataset.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from core.data.tokenizer import BYTE, Tokenizer, load_tokenizer
from core.errors import ExitCode, UserError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SUFFIXES = (".txt", ".jsonl", ".parquet")
COPY_CHUNK_TOKENS = 1 << 22  # 4 Mi tokens (8–16 MiB) per copy into HDF5
FLUSH_TOKENS = 1 << 20  # ids buffered in memory before they go to the raw file
LOG_EVERY_DOCS = 100_000


class DataBuildError(UserError):
    """An input file is missing, unreadable or malformed; the message names it and the fix."""


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<u4")


def expand_inputs(inputs: Sequence[Path]) -> list[Path]:
    """Check every input before any work: folders → their data files, sorted."""
    files: list[Path] = []
    for given in map(Path, inputs):
        if given.is_dir():
            found = sorted(p for p in given.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise DataBuildError(f"{given}: folder has no {', '.join(SUFFIXES)} files")
            files += found
        elif not given.exists():
            raise DataBuildError(f"{given}: no such file; check the path")
        elif given.suffix not in SUFFIXES:
            raise DataBuildError(f"{given}: unknown extension {given.suffix or '(none)'!r}; "
                                 f"supported: {', '.join(SUFFIXES)}")
        else:
            files.append(given)
    if not files:
        raise DataBuildError("no input files given")
    if any(p.suffix == ".parquet" for p in files):
        _require_pyarrow(next(p for p in files if p.suffix == ".parquet"))
    return files


def _require_pyarrow(path: Path) -> Any:
    try:
        import pyarrow.parquet as pq  # optional: only .parquet input needs it
    except ImportError:
        raise DataBuildError(f"{path}: reading .parquet needs pyarrow; pip install pyarrow") from None
    return pq


def _iter_txt(path: Path) -> Iterator[str]:
    try:
        # newline="" keeps \r\n as written: the round trip is byte-exact
        with open(path, encoding="utf-8", newline="") as f:
            yield f.read()
    except UnicodeDecodeError as exc:
        raise DataBuildError(f"{path}: not UTF-8 text (bad byte at offset {exc.start}); "
                             "convert it with iconv -t utf-8") from None


def _iter_jsonl(path: Path, text_key: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise DataBuildError(f"{path}:{lineno}: not UTF-8 (bad byte at column {exc.start + 1}); "
                                     "JSONL must be UTF-8") from None
            except json.JSONDecodeError as exc:
                raise DataBuildError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                                     "each line must be one JSON object") from None
            if not isinstance(record, dict):
                raise DataBuildError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            if text_key not in record:
                keys = ", ".join(sorted(record)[:8]) or "none"
                raise DataBuildError(f"{path}:{lineno}: no field {text_key!r} (fields: {keys}); "
                                     "pass --text-key NAME")
            text = record[text_key]
            if not isinstance(text, str):
                raise DataBuildError(f"{path}:{lineno}: field {text_key!r} is {type(text).__name__}, not a string")
            yield text


def _iter_parquet(path: Path, text_key: str) -> Iterator[str]:
    pq = _require_pyarrow(path)
    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid (an Exception) for non-parquet files
        raise DataBuildError(f"{path}: not a readable parquet file ({exc})") from None
    names = reader.schema_arrow.names
    if text_key not in names:
        raise DataBuildError(f"{path}: no column {text_key!r} (columns: {', '.join(names[:8])}); "
                             "pass --text-key NAME")
    for batch in reader.iter_batches(columns=[text_key]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise DataBuildError(f"{path}: column {text_key!r} holds {type(text).__name__}, not strings")
            yield text


def iter_documents(path: Path, *, text_key: str = "text") -> Iterator[str]:
    """The documents of one input file, in order, one at a time."""
    if path.suffix == ".txt":
        return _iter_txt(path)
    if path.suffix == ".jsonl":
        return _iter_jsonl(path, text_key)
    if path.suffix == ".parquet":
        return _iter_parquet(path, text_key)
    raise DataBuildError(f"{path}: unknown extension {path.suffix!r}; supported: {', '.join(SUFFIXES)}")


def _read_documents(path: Path, text_key: str) -> Iterator[str]:
    try:
        yield from iter_documents(path, text_key=text_key)
    except OSError as exc:
        raise DataBuildError(f"{path}: cannot read ({exc.strerror or exc}); check its permissions") from None


def _tokenize_to_raw(files: list[Path], tok: Tokenizer, text_key: str, dtype: np.dtype[Any],
                     tokens_raw: Path, offsets_raw: Path) -> tuple[int, int]:
    """Stream every document's ids (+ EOS) and start offsets to raw files; (documents, tokens)."""
    n_docs = n_tokens = 0
    pending: list[int] = []
    with open(tokens_raw, "wb") as tf, open(offsets_raw, "wb") as of:
        for path in files:
            for text in _read_documents(path, text_key):
                of.write(np.int64(n_tokens).tobytes())
                ids = tok.encode(text)
                pending += ids
                pending.append(tok.eos_id)
                n_tokens += len(ids) + 1
                n_docs += 1
                if len(pending) >= FLUSH_TOKENS:
                    tf.write(np.asarray(pending, dtype=dtype).tobytes())
                    pending.clear()
                if n_docs % LOG_EVERY_DOCS == 0:
                    logger.info("%d documents, %d tokens", n_docs, n_tokens)
        tf.write(np.asarray(pending, dtype=dtype).tobytes())
    return n_docs, n_tokens


def _copy_raw(raw: Path, dset: h5py.Dataset) -> None:
    if dset.shape[0] == 0:
        return
    src = np.memmap(raw, dtype=dset.dtype, mode="r", shape=dset.shape)
    for start in range(0, dset.shape[0], COPY_CHUNK_TOKENS):
        dset[start:start + COPY_CHUNK_TOKENS] = src[start:start + COPY_CHUNK_TOKENS]
    del src


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build_dataset(inputs: Sequence[Path], output: Path, *, tokenizer: str | Path = BYTE,
                  text_key: str = "text") -> dict[str, Any]:
    """Tokenize ``inputs`` into the HDF5 token file ``output``; return its stats.

    Stats: ``output``, ``files``, ``documents``, ``tokens``, ``dtype``, ``vocab_size``,
    ``eos_id``, ``tokenizer``, ``file_bytes``. Raises ``UserError`` subclasses for bad input,
    before ``output`` is touched.
    """
    output = Path(output)
    files = expand_inputs(inputs)
    tok = load_tokenizer(tokenizer)
    if output.is_dir():
        raise DataBuildError(f"--output {output}: is a folder; give a file name such as {output / 'data.h5'}")
    output.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    tmp_h5 = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}.raw-") as raw_dir:
            tokens_raw, offsets_raw = Path(raw_dir) / "tokens.bin", Path(raw_dir) / "offsets.bin"
            n_docs, n_tokens = _tokenize_to_raw(files, tok, text_key, dtype, tokens_raw, offsets_raw)
            if n_docs == 0:
                raise DataBuildError(f"no documents in {', '.join(map(str, files))}; nothing to build")
            with h5py.File(tmp_h5, "w") as f:
                # no chunks, no maxshape, no filters: a contiguous layout that np.memmap can read
                _copy_raw(tokens_raw, f.create_dataset("tokens", shape=(n_tokens,), dtype=dtype))
                _copy_raw(offsets_raw, f.create_dataset("doc_offsets", shape=(n_docs,), dtype="<i8"))
                f.attrs.update({"vocab_size": tok.vocab_size, "tokenizer": tok.name, "eos_id": tok.eos_id,
                                "format_version": FORMAT_VERSION, "documents": n_docs})
        _fsync(tmp_h5)
        os.replace(tmp_h5, output)
    finally:
        tmp_h5.unlink(missing_ok=True)
    stats = {"output": str(output), "files": len(files), "documents": n_docs, "tokens": n_tokens,
             "dtype": dtype.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
             "tokenizer": tok.name, "file_bytes": output.stat().st_size}
    logger.info("built %s: %d documents, %d tokens", output, n_docs, n_tokens)
    return stats


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    raise AssertionError("unreachable")


def build_parser(prog: str = "python -m core.data.build") -> argparse.ArgumentParser:
    """The arguments of ``baton data build`` (shared with the launcher's subcommand)."""
    p = argparse.ArgumentParser(prog=prog, description="Tokenize .txt/.jsonl/.parquet files into an "
                                "HDF5 token dataset (contiguous, memory-mappable).")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the build arguments to ``p`` (the launcher mirrors them without importing this module)."""
    p.add_argument("inputs", nargs="+", type=Path, help=".txt (one document per file), .jsonl, .parquet, or folders")
    p.add_argument("--output", "-o", required=True, type=Path, help="the HDF5 file to write")
    p.add_argument("--tokenizer", default=BYTE, help="'byte' (built-in, vocab 257), 'qwen3' (Qwen2/2.5/3 BPE, offline, vocab 151669) "
                   "or a Hugging Face model folder (hf:PATH or PATH) or its tokenizer.json")
    p.add_argument("--text-key", default="text", help="the JSONL field / parquet column holding the text")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, build, print the stats. Bad input: one line on stderr, exit code 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        stats = build_dataset(args.inputs, args.output, tokenizer=args.tokenizer, text_key=args.text_key)
    except UserError as exc:
        print(f"baton data build: error: {exc}", file=sys.stderr)
        return ExitCode.USER_ERROR
    print(f"wrote {stats['output']}")
    print(f"  documents {stats['documents']:,} from {stats['files']} file(s)")
    print(f"  tokens    {stats['tokens']:,} ({stats['dtype']}, vocab {stats['vocab_size']}, "
          f"tokenizer {stats['tokenizer']})")
    print(f"  file size {_human_bytes(stats['file_bytes'])}")
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
