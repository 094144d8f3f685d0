"""Deterministic batches: every sample is a pure function of (seed, split, step, index).

Sample ``i`` of the global batch of step ``s`` is drawn from its own generator
``default_rng([seed, split, s, i])``; data-parallel rank ``r`` of ``dp`` takes the
contiguous block ``[r * G/dp, (r+1) * G/dp)`` of the ``G`` global samples. So

- a resumed run reads exactly the batches an uninterrupted one would (the data position
  is the step number, nothing else), and
- every layout sees the same global batch, which is what makes loss curves comparable
  across tp/pp/dp layouts.

Sources: synthetic tasks (``increment``: label[t] = (token[t] + 1) % vocab; ``copy``: the
second half of the sequence repeats the first, labels are the next token, so the second
half is learnable by attending back; ``random``: uniform tokens, next-token labels, a
throughput task that cannot be learned; ``count_to``: rl.task count_to's format as supervised
rows, ``T a a+1 .. T <eot>`` (core.rl.tasks.count_to: the end of text is the vocabulary's
last id), the loss on the labels from ``a+1`` to ``<eot>`` only, over the global batch's
count of them, so the warm start learns to count on and to stop at the target) or an HDF5 token file (``data.kind: hdf5``): a
1-D ``tokens`` dataset and a ``vocab_size`` attribute, read as windows of seq_length + 1
tokens at deterministic positions. The last 5 % of the file (at least one window) is
held out for ``eval`` when the file is large enough for both.

``program: sft`` reads conversations instead (``SFTSource``, core.data.sft): one per row,
right-padded with end-of-text to seq_length, with a loss mask that is 1 only on the labels
the assistant wrote. Sample ``i`` of step ``s`` is conversation number ``g = s × G + i`` of
the run: position ``g mod n`` of epoch ``g // n``'s permutation, keyed by (seed, epoch), so
the data position is again the step number. Rows are padded, not packed: a packed row would
need a block-diagonal attention mask (one conversation must not attend to the one before it)
that Megatron's local and TE causal masks do not build from a batch, and one conversation
per row keeps a sample a pure function of its index.

No torch here: batches are numpy arrays, converted by ``core.model.gpt.step``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from core.config import sft as sft_spec
from core.config.run import RunConfig
from core.data import sft as chat
from core.errors import ConfigError

log = logging.getLogger(__name__)

Split = Literal["train", "eval"]
_SPLIT_ID = {"train": 0, "eval": 1}
_HELD_OUT_FRACTION = 0.05


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """``tokens`` and ``labels``: int64 arrays of shape (micro_batch, seq_length).

    ``loss_mask`` (bool, same shape): the labels the loss counts, and ``loss_tokens`` how many
    the whole global batch counts (its denominator); both None: every label counts (pretraining).
    """

    tokens: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray | None = None
    loss_tokens: int | None = None


def dp_sample_range(*, global_batch: int, dp: int, dp_rank: int) -> range:
    """Indices of the global batch that data-parallel rank ``dp_rank`` trains on."""
    if global_batch % dp:
        raise ConfigError(f"training.global_batch_size: {global_batch} is not divisible by dp = {dp}")
    per_rank = global_batch // dp
    return range(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def num_micro_batches(*, global_batch: int, micro_batch: int, dp: int) -> int:
    """global_batch / (micro_batch × dp); the layout check guarantees it divides."""
    if global_batch % (micro_batch * dp):
        raise ConfigError(
            f"training.global_batch_size: {global_batch} is not divisible by micro_batch_size × dp "
            f"= {micro_batch} × {dp}"
        )
    return global_batch // (micro_batch * dp)


def resolve_micro_batch(micro_batch: int | str, *, global_batch: int, dp: int) -> int:
    """``auto``: the largest of 4, 2, 1 that divides the per-replica batch."""
    if micro_batch != "auto":
        return int(micro_batch)
    per_rank = global_batch // dp
    return next(m for m in (4, 2, 1) if per_rank % m == 0)


def _open_token_file(path: str) -> tuple[np.ndarray, int]:
    """The ``tokens`` of an HDF5 token file (memory-mapped when contiguous) and its vocab size.

    The only h5py use of the training code: the file is closed again before training, so
    no HDF5 handle lives across the run; the tokens are read through ``np.memmap``.
    """
    import h5py  # only for data.kind: hdf5; this module loads without it

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data.path: {path!r} does not exist; build one with `baton data build`")
    with h5py.File(p, "r") as f:
        if "tokens" not in f or "vocab_size" not in f.attrs:
            raise ConfigError(f"data.path: {path!r} has no 'tokens' dataset or no 'vocab_size' attribute")
        dset = f["tokens"]
        if dset.ndim != 1:
            raise ConfigError(f"data.path: {path!r}: 'tokens' has shape {dset.shape}, expected 1-D")
        vocab = int(f.attrs["vocab_size"])
        offset = dset.id.get_offset()
        if dset.chunks is None and dset.compression is None and offset is not None:
            return np.memmap(p, dtype=dset.dtype, mode="r", offset=offset, shape=dset.shape), vocab
        log.warning("%s: 'tokens' is chunked or compressed; reading it into memory", path)
        return dset[()], vocab


class BatchSource:
    """Micro-batches of one data-parallel rank, as a pure function of the step."""

    def __init__(
        self,
        *,
        kind: str,
        task: str,
        path: str | None,
        seed: int,
        vocab_size: int,
        seq_length: int,
        global_batch: int,
        micro_batch: int,
        dp: int,
        dp_rank: int,
    ) -> None:
        self.kind, self.task = kind, task
        self.seed, self.vocab, self.seq = seed, vocab_size, seq_length
        self.micro_batch, self.global_batch = micro_batch, global_batch
        self.samples = dp_sample_range(global_batch=global_batch, dp=dp, dp_rank=dp_rank)
        self.n_micro = num_micro_batches(global_batch=global_batch, micro_batch=micro_batch, dp=dp)
        self._tokens: np.ndarray | None = None
        self._regions: dict[str, tuple[int, int]] = {}
        if kind == "hdf5":
            assert path is not None  # DataConfig requires it
            self._open(path)

    def _open(self, path: str) -> None:
        tokens, file_vocab = _open_token_file(path)
        if file_vocab > self.vocab:
            raise ConfigError(
                f"model.vocab_size: {self.vocab} is smaller than the vocabulary of {path} "
                f"({file_vocab}); set model.vocab_size ≥ {file_vocab}"
            )
        n, window = int(tokens.shape[0]), self.seq + 1
        if n < window:
            raise ConfigError(f"data.path: {path!r} has {n} tokens, fewer than seq_length + 1 = {window}")
        held_out = max(window, int(n * _HELD_OUT_FRACTION))
        if n - held_out >= window:
            self._regions = {"train": (0, n - held_out), "eval": (n - held_out, n)}
        else:
            log.warning("%s: %d tokens are too few to hold out an eval split; eval reuses train", path, n)
            self._regions = {"train": (0, n), "eval": (0, n)}
        self._tokens = tokens

    def sample(self, step: int, index: int, split: Split = "train") -> tuple[np.ndarray, np.ndarray]:
        """Global sample ``index`` of step ``step``: (tokens, labels), int64, seq_length each."""
        rng = np.random.default_rng([self.seed, _SPLIT_ID[split], step, index])
        s, v = self.seq, self.vocab
        if self.kind == "hdf5":
            assert self._tokens is not None
            lo, hi = self._regions[split]
            start = int(rng.integers(lo, hi - (s + 1) + 1))
            w = np.asarray(self._tokens[start:start + s + 1], dtype=np.int64)
            return w[:-1], w[1:]
        if self.task == "increment":
            tokens = rng.integers(0, v, size=s, dtype=np.int64)
            return tokens, (tokens + 1) % v
        if self.task == "copy":
            half = rng.integers(0, v, size=(s + 2) // 2, dtype=np.int64)
            w = np.concatenate([half, half])[: s + 1]
            return w[:-1], w[1:]
        if self.task == "random":
            w = rng.integers(0, v, size=s + 1, dtype=np.int64)
            return w[:-1], w[1:]
        if self.task == "count_to":
            w, _ = self._count_to(rng)
            return w[:-1], w[1:]
        raise ConfigError(f"data.task: {self.task!r} is not one of increment, copy, random, count_to")

    def _count_to(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """A ``count_to`` row of seq_length + 1 tokens, ``T a .. T <eot> <eot> ..``, and the
        mask of its labels the loss counts (``a+1`` .. the first ``<eot>``)."""
        eot = self.vocab - 1
        numbers = int(rng.integers(2, min(self.seq - 1, eot) + 1))  # a .. T, with T and <eot> in the row
        target = int(rng.integers(numbers - 1, eot))
        w = np.full(self.seq + 1, eot, dtype=np.int64)
        w[0], w[1:numbers + 1] = target, np.arange(target - numbers + 1, target + 1)
        mask = np.zeros(self.seq, dtype=bool)
        mask[1:numbers + 1] = True
        return w, mask

    def _mask(self, step: int, index: int, split: Split) -> np.ndarray:
        return self._count_to(np.random.default_rng([self.seed, _SPLIT_ID[split], step, index]))[1]

    def micro_batches(self, step: int, split: Split = "train") -> list[MicroBatch]:
        """This rank's micro-batches of step ``step``, in order (``count_to``'s with their loss
        mask and the whole global batch's count of counted labels)."""
        pairs = [self.sample(step, i, split) for i in self.samples]
        total = None
        if self.task == "count_to" and self.kind == "synthetic":
            total = int(sum(self._mask(step, i, split).sum() for i in range(self.global_batch)))
        out = []
        for m in range(self.n_micro):
            lo, hi = m * self.micro_batch, (m + 1) * self.micro_batch
            chunk = pairs[lo:hi]
            masks = None if total is None else np.stack([self._mask(step, i, split) for i in self.samples[lo:hi]])
            out.append(MicroBatch(tokens=np.stack([t for t, _ in chunk]), labels=np.stack([lab for _, lab in chunk]),
                                  loss_mask=masks, loss_tokens=total))
        return out

    def position(self, step: int) -> dict[str, Any]:
        """The data position as a checkpoint blob: the step is all a resumed run needs."""
        return {"kind": self.kind, "task": self.task, "seed": self.seed, "next_step": step}


class SFTSource:
    """``program: sft``'s micro-batches of one data-parallel rank: conversations, a pure
    function of the step. ``eval`` draws from the same conversations in another order (SFT
    holds none out)."""

    def __init__(self, conversations: chat.Conversations, *, seed: int, seq_length: int, global_batch: int,
                 micro_batch: int, dp: int, dp_rank: int) -> None:
        self.data, self.seed, self.seq = conversations, seed, seq_length
        self.kind, self.global_batch, self.micro_batch = "sft", global_batch, micro_batch
        self.samples = dp_sample_range(global_batch=global_batch, dp=dp, dp_rank=dp_rank)
        self.n_micro = num_micro_batches(global_batch=global_batch, micro_batch=micro_batch, dp=dp)
        # labels the loss counts per conversation: the global denominator without reading the rows
        self.counts = np.array([int(m[1:].sum()) for m in conversations.masks], dtype=np.int64)
        self._orders: dict[tuple[Split, int], np.ndarray] = {}

    def conversation(self, step: int, index: int, split: Split = "train") -> int:
        """Which conversation is global sample ``index`` of step ``step``."""
        n = len(self.data)
        g = step * self.global_batch + index
        key = (split, g // n)
        if key not in self._orders:
            if len(self._orders) > 4:  # a step spans at most a few epochs
                self._orders.clear()
            self._orders[key] = np.random.default_rng([self.seed, 11, _SPLIT_ID[split], g // n]).permutation(n)
        return int(self._orders[key][g % n])

    def sample(self, step: int, index: int, split: Split = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, labels, loss mask) of global sample ``index`` of step ``step``, seq_length each."""
        c = self.conversation(step, index, split)
        ids, mask = self.data.ids[c], self.data.masks[c]
        row = np.full(self.seq + 1, self.data.eos_id, dtype=np.int64)
        keep = np.zeros(self.seq + 1, dtype=bool)
        row[:len(ids)], keep[:len(ids)] = ids, mask
        return row[:-1], row[1:], keep[1:]

    def loss_tokens(self, step: int, split: Split = "train") -> int:
        """The labels the loss counts in the whole global batch of ``step`` (every rank agrees)."""
        return int(sum(self.counts[self.conversation(step, i, split)] for i in range(self.global_batch)))

    def micro_batches(self, step: int, split: Split = "train") -> list[MicroBatch]:
        """This rank's micro-batches of step ``step``, in order."""
        rows = [self.sample(step, i, split) for i in self.samples]
        total, m = self.loss_tokens(step, split), self.micro_batch
        return [MicroBatch(tokens=np.stack([r[0] for r in rows[k:k + m]]), labels=np.stack([r[1] for r in rows[k:k + m]]),
                           loss_mask=np.stack([r[2] for r in rows[k:k + m]]), loss_tokens=total)
                for k in range(0, len(rows), m)]

    def position(self, step: int) -> dict[str, Any]:
        """The data position as a checkpoint blob: the step is all a resumed run needs."""
        return {"kind": self.kind, "seed": self.seed, "next_step": step}


def from_config(cfg: RunConfig, *, dp: int, dp_rank: int, run_dir: Path | None = None) -> BatchSource | SFTSource:
    """The batch source of one data-parallel rank of a ``RunConfig``: for ``program: sft`` the
    conversations submit froze in ``run_dir`` (core.data.sft.FROZEN), or, without that file
    (ranks driven by a test), ``sft.data`` read and tokenized here; else ``data``'s."""
    micro = resolve_micro_batch(cfg.training.micro_batch_size, global_batch=cfg.training.global_batch_size, dp=dp)
    if cfg.program == "sft":
        s = cfg.sft
        frozen = None if run_dir is None else run_dir / chat.FROZEN
        if frozen is not None and frozen.is_file():
            conversations = chat.load(frozen)
        else:
            assert s.data is not None  # core.config.sft.check
            tokenizer = chat.load_chat_tokenizer(sft_spec.tokenizer_path(s, cfg.init_from))
            conversations = chat.read_conversations(s.data, key=s.messages_key, tokenizer=tokenizer,
                                                    seq_length=cfg.model.seq_length, too_long=s.too_long,
                                                    variables=s.chat_template_kwargs)
        return SFTSource(conversations, seed=cfg.seed, seq_length=cfg.model.seq_length,
                         global_batch=cfg.training.global_batch_size, micro_batch=micro, dp=dp, dp_rank=dp_rank)
    return BatchSource(
        kind=cfg.data.kind,
        task=cfg.data.task,
        path=cfg.data.path,
        seed=cfg.seed,
        vocab_size=cfg.model.vocab_size,
        seq_length=cfg.model.seq_length,
        global_batch=cfg.training.global_batch_size,
        micro_batch=micro,
        dp=dp,
        dp_rank=dp_rank,
    )
