"""Byte-level training data: the corpus, each learner's disjoint shard, eval batches.

The default corpus is the Python standard library's own `.py` sources (present on
every machine; site-packages excluded), read in sorted order. `load_corpus(path)`
takes instead a text file, a directory of text files, or a 1-D integer token array
(`.npy`). Held-out data is chosen by file (a hash of the relative path), so no
held-out file is ever trained on; a single file or array holds out its tail.

The training stream is cut into windows of context + 1 tokens at stride context
(consecutive windows share one token, so every token is a target once). Each epoch
permutes the window ids with (seed, epoch); learner i of M takes positions i, i+M,
i+2M, … of that permutation, so learners' shards are disjoint and together cover
every window but the < M left over. A batch is a pure function of the step number:
a restarted learner resumes at step k by asking for batch k, with nothing to replay.

Corpora built from text are cached as `.npy` files under a cache directory (the
caller's, else $ATOLL_CACHE_DIR, else ~/.cache/atoll), written to a temporary
directory and renamed into place, so learners starting together never read a half
written cache; the arrays are memory-mapped, so they share one copy in page cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np

log = logging.getLogger(__name__)

ENV_CACHE_DIR = "ATOLL_CACHE_DIR"  # overrides the default cache directory
CACHE_FORMAT = "atoll.corpus.v1"  # bump when the cached layout or split rule changes
HELDOUT_FRACTION = 0.03  # share of files (or of a single stream's tail) held out
_BINARY_PROBE = 8192  # a file with a NUL byte in its first 8 KiB is not text
_SKIP_STDLIB = ("site-packages", "dist-packages")  # installed packages, not the stdlib

Tokens = np.ndarray  # 1-D integer array of token ids


class DataError(ValueError):
    """Data that cannot be used; the message says what is wrong and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A token stream split into train and held-out parts."""

    train: Tokens  # 1-D, values in [0, vocab); may be a read-only memory map
    heldout: Tokens  # 1-D, disjoint from train (by file where there are files)
    source: str  # where it came from, for logs: "stdlib:<dir>" or the path
    num_files: int  # text files read (0 for a token array)


# -- the corpus ----------------------------------------------------------------------


def split_files(
    relpaths: Sequence[str], heldout_fraction: float = HELDOUT_FRACTION
) -> tuple[list[str], list[str]]:
    """(train, held_out) relative paths: a file is held out when its path's hash says so.

    Depends only on each path, so adding or removing files never moves another file
    across the split.
    """

    def held(path: str) -> bool:
        h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big")
        return h < heldout_fraction * 2.0**64

    train = [p for p in relpaths if not held(p)]
    return train, [p for p in relpaths if held(p)]


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _walk(root: pathlib.Path, *, suffix: str | None, skip_dirs: Sequence[str]) -> list[str]:
    """Sorted "/"-joined relative paths of regular files under root (no hidden ones)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip_dirs)
        for name in sorted(filenames):
            if name.startswith(".") or (suffix and not name.endswith(suffix)):
                continue
            full = pathlib.Path(dirpath, name)
            if full.is_file():
                out.append(full.relative_to(root).as_posix())
    return sorted(out)


def _read_texts(
    root: pathlib.Path, relpaths: Sequence[str], skip_binary: bool
) -> tuple[list[bytes], list[str]]:
    """Contents and paths of the readable, non-empty (and non-binary) files."""
    texts, kept = [], []
    for rel in relpaths:
        try:
            data = (root / rel).read_bytes()
        except OSError as e:
            log.debug("skipping unreadable %s: %s", rel, e)
            continue
        if data and not (skip_binary and b"\0" in data[:_BINARY_PROBE]):
            texts.append(data)
            kept.append(rel)
    return texts, kept


def _tail_split(tokens: Tokens, heldout_fraction: float) -> tuple[Tokens, Tokens]:
    """Holds out the last heldout_fraction of one stream (at least one token)."""
    n_held = max(1, int(round(len(tokens) * heldout_fraction)))
    if len(tokens) - n_held < 2:
        raise DataError(
            f"only {len(tokens)} tokens: too few to split into train and "
            f"held-out parts; give more data"
        )
    return tokens[:-n_held], tokens[-n_held:]


def _build_text(
    root: pathlib.Path, relpaths: list[str], heldout_fraction: float, what: str, skip_binary: bool
) -> tuple[Tokens, Tokens, int]:
    """Reads files and splits them by file (by tail when one side would be empty)."""
    train_paths, held_paths = split_files(relpaths, heldout_fraction)
    train_texts, train_kept = _read_texts(root, train_paths, skip_binary)
    held_texts, held_kept = _read_texts(root, held_paths, skip_binary)
    if not train_kept and not held_kept:
        raise DataError(
            f"{what}: no readable, non-empty text files; point --data at text "
            f"files, a directory of them, or a .npy token array"
        )
    num_files = len(train_kept) + len(held_kept)
    if train_kept and held_kept:
        return (
            np.frombuffer(b"".join(train_texts), np.uint8),
            np.frombuffer(b"".join(held_texts), np.uint8),
            num_files,
        )
    # Too few files for a split by file (a small directory): hold out the tail instead.
    everything = np.frombuffer(b"".join(train_texts + held_texts), np.uint8)
    return (*_tail_split(everything, heldout_fraction), num_files)


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    if cache_dir is not None:
        return pathlib.Path(cache_dir)
    if os.environ.get(ENV_CACHE_DIR):
        return pathlib.Path(os.environ[ENV_CACHE_DIR])
    return pathlib.Path.home() / ".cache" / "atoll"


def _cache_key(root: pathlib.Path, relpaths: Sequence[str], *settings: object) -> str:
    """Changes whenever a file is added, removed, resized or touched, or a setting changes."""
    h = hashlib.sha256(f"{CACHE_FORMAT}\0{root.resolve()}\0{settings!r}".encode())
    for rel in relpaths:
        try:
            st = (root / rel).stat()
            h.update(f"\0{rel}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        except OSError:
            h.update(f"\0{rel}\0?".encode())
    return h.hexdigest()[:20]


def _cached(
    root: pathlib.Path,
    relpaths: list[str],
    heldout_fraction: float,
    what: str,
    skip_binary: bool,
    cache_dir: str | os.PathLike[str] | None,
) -> tuple[Tokens, Tokens, int]:
    """_build_text through the on-disk cache; builds in memory if the cache is unusable."""
    cache = _cache_root(cache_dir)
    final = cache / f"corpus-{_cache_key(root, relpaths, heldout_fraction, skip_binary)}"
    if (final / "meta.json").is_file():
        try:
            meta = json.loads((final / "meta.json").read_text())
            return (
                np.load(final / "train.npy", mmap_mode="r"),
                np.load(final / "heldout.npy", mmap_mode="r"),
                int(meta["num_files"]),
            )
        except (OSError, ValueError, KeyError) as e:
            log.warning("corpus cache %s is unreadable (%s); rebuilding", final, e)
    train, heldout, num_files = _build_text(root, relpaths, heldout_fraction, what, skip_binary)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".building-", dir=cache))
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is an ordinary directory
    except OSError as e:
        log.warning("cannot write the corpus cache under %s (%s); not caching", cache, e)
        return train, heldout, num_files
    try:
        np.save(tmp / "train.npy", train)
        np.save(tmp / "heldout.npy", heldout)
        # meta.json last: its presence marks a complete directory.
        (tmp / "meta.json").write_text(
            json.dumps(
                {
                    "format": CACHE_FORMAT,
                    "source": what,
                    "num_files": num_files,
                    "train_tokens": len(train),
                    "heldout_tokens": len(heldout),
                }
            )
        )
        os.rename(tmp, final)  # atomic; fails if a concurrent learner got there first
    except OSError:
        pass  # another learner's identical copy is in place (or the disk is full)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return train, heldout, num_files


def _load_npy(path: pathlib.Path, vocab: int, heldout_fraction: float) -> Corpus:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e})") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(
            f"{path}: token array has dtype {arr.dtype}; want an integer dtype "
            f"(e.g. arr.astype(np.uint16))"
        )
    arr = arr.reshape(-1)
    if arr.size == 0:
        raise DataError(f"{path}: the token array is empty")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab:
        raise DataError(
            f"{path}: token ids span [{lo}, {hi}] but the model's vocabulary is "
            f"[0, {vocab}); re-tokenise or use a model with vocab > {hi}"
        )
    return Corpus(*_tail_split(arr, heldout_fraction), source=str(path), num_files=0)


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    vocab: int = 256,
    cache_dir: str | os.PathLike[str] | None = None,
    heldout_fraction: float = HELDOUT_FRACTION,
) -> Corpus:
    """Loads (and caches) a corpus.

    Args:
      path: None for the stdlib's `.py` sources; a text file; a directory (every
        non-hidden, non-binary file below it); or a `.npy` integer token array.
      vocab: the model's vocabulary; every token id must be below it (bytes: 256).
      cache_dir: where text corpora are cached (default $ATOLL_CACHE_DIR or
        ~/.cache/atoll); unwritable means "don't cache".
      heldout_fraction: share held out for evaluation, in (0, 0.5].

    Returns:
      The Corpus. Raises DataError for a missing path, an empty corpus, a bad array or
      token ids out of range.

    Example:
      >>> corpus = load_corpus()  # the stdlib, ~31 MB of bytes
      >>> corpus.train.dtype, len(corpus.heldout) > 0
      (dtype('uint8'), True)
    """
    if not 0 < heldout_fraction <= 0.5:
        raise DataError(f"heldout_fraction must be in (0, 0.5], got {heldout_fraction}")
    if path is None:
        root = stdlib_dir()
        relpaths = _walk(root, suffix=".py", skip_dirs=_SKIP_STDLIB)
        what = f"stdlib:{root}"
    else:
        p = pathlib.Path(path).expanduser()
        if not p.exists():
            raise DataError(f"--data {path}: no such file or directory")
        if p.is_file() and p.suffix == ".npy":
            return _load_npy(p, vocab, heldout_fraction)
        if p.is_dir():  # every file below it, except binary ones
            root, relpaths, what = p, _walk(p, suffix=None, skip_dirs=()), str(p)
        else:  # one file, named on purpose: taken whatever its bytes
            root, relpaths, what = p.parent, [p.name], str(p)
    if vocab < 256:
        raise DataError(f"text is byte-level and needs vocab >= 256, got vocab={vocab}")
    if not relpaths:
        raise DataError(
            f"{what}: no files found; point --data at text files, a "
            f"directory of them, or a .npy token array"
        )
    skip_binary = path is None or p.is_dir()
    train, heldout, num_files = _cached(
        root, relpaths, heldout_fraction, what, skip_binary, cache_dir
    )
    return Corpus(train, heldout, source=what, num_files=num_files)


# -- a learner's batches ---------------------------------------------------------------


class Batches:
    """Learner `learner` of `num_learners`'s batches: `batches[step]` -> int32 (B, L+1).

    Random access by step, so resuming at step k is `batches[k]`; `iterate(k)` yields
    k, k+1, ….
    """

    def __init__(
        self,
        tokens: Tokens,
        *,
        context: int,
        batch_size: int,
        learner: int = 0,
        num_learners: int = 1,
        seed: int = 0,
    ):
        if context < 1 or batch_size < 1:
            raise DataError(f"context ({context}) and batch_size ({batch_size}) must be >= 1")
        if not 0 <= learner < num_learners:
            raise DataError(
                f"learner index {learner} not in [0, {num_learners}); learner "
                f"indices run from 0 to num_learners - 1"
            )
        self.tokens, self.context, self.batch_size = tokens, context, batch_size
        self.learner, self.num_learners, self.seed = learner, num_learners, seed
        self.num_windows = max(0, (len(tokens) - 1) // context)
        self.windows_per_learner = self.num_windows // num_learners  # per epoch
        if self.windows_per_learner < 1:
            raise DataError(
                f"{len(tokens)} training tokens make {self.num_windows} windows "
                f"of {context + 1} tokens: too few for {num_learners} learners; "
                f"give more data or a shorter context"
            )
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        """The epoch's window order (the last two are kept: a batch can straddle epochs)."""
        if epoch not in self._perms:
            rng = np.random.default_rng([self.seed, epoch])
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = rng.permutation(self.num_windows)
        return self._perms[epoch]

    def window_ids(self, step: int) -> np.ndarray:
        """The (B,) window ids of batch `step`; window w is tokens[w*L : w*L + L + 1]."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        positions = step * self.batch_size + np.arange(self.batch_size)
        epochs, index = np.divmod(positions, self.windows_per_learner)
        out = np.empty(self.batch_size, np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._perm(int(epoch))[index[sel] * self.num_learners + self.learner]
        return out

    def __getitem__(self, step: int) -> np.ndarray:
        return self.rows(step, slice(None))

    def rows(self, step: int, rows: slice) -> np.ndarray:
        """Rows `rows` of batch `step` alone: a process of a multi-host learner reads only
        the part of the global batch its own devices hold."""
        starts = self.window_ids(step)[rows] * self.context
        index = starts[:, None] + np.arange(self.context + 1)[None, :]
        return np.asarray(self.tokens[index], np.int32)

    def iterate(self, start_step: int = 0) -> Iterator[np.ndarray]:
        step = start_step
        while True:
            yield self[step]
            step += 1


def eval_batches(
    tokens: Tokens, *, context: int, batch_size: int, num_batches: int
) -> list[np.ndarray]:
    """Fixed held-out batches: windows spread evenly over the held-out stream.

    Gives fewer than `num_batches` batches (at least one) when the stream is short;
    windows repeat only if there are fewer of them than one batch has rows. DataError
    if the stream cannot fill even one window.
    """
    num_windows = (len(tokens) - 1) // context
    if num_windows < 1:
        raise DataError(
            f"held-out part has {len(tokens)} tokens, fewer than context + 1 = "
            f"{context + 1}; give more data or a shorter context"
        )
    n_rows = min(num_batches * batch_size, num_windows)
    n_rows = max(batch_size, n_rows - n_rows % batch_size)
    ids = (np.arange(n_rows) * num_windows) // n_rows
    rows = ids[:, None] * context + np.arange(context + 1)[None, :]
    arr = np.asarray(tokens[rows], np.int32)
    return [arr[i : i + batch_size] for i in range(0, n_rows, batch_size)]
