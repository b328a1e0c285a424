"""Tests for learner/trainer/data.py: corpus sources and errors, the split, shards, resume."""

import os
import pathlib
import threading

import numpy as np
import pytest

from atoll.learner.trainer.data import (
    Batches,
    Corpus,
    DataError,
    _walk,
    eval_batches,
    load_corpus,
    split_files,
    stdlib_dir,
)


def stream(n=10_000, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.uint8)


def write_tree(root: pathlib.Path, n_files=200):
    """n_files small text files, each with a unique marker line, in nested folders."""
    for i in range(n_files):
        path = root / f"d{i % 7}" / f"f{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"<<file {i:03d}>>\n" + "some text in it\n" * (1 + i % 5))
    return root


# -- shards and batches -------------------------------------------------------------


def test_learner_shards_are_disjoint_and_cover_the_windows():
    tokens, L, B, M = stream(20_001), 16, 5, 3
    num_windows = (len(tokens) - 1) // L
    per_learner = num_windows // M
    steps = per_learner // B  # one epoch's worth of whole batches
    seen = []
    for i in range(M):
        b = Batches(tokens, context=L, batch_size=B, learner=i, num_learners=M, seed=7)
        ids = np.concatenate([b.window_ids(s) for s in range(steps)])
        assert len(set(ids)) == len(ids)
        seen.append(set(ids))
    for i in range(M):
        for j in range(i + 1, M):
            assert not seen[i] & seen[j], f"learners {i} and {j} share windows"
    union = set().union(*seen)
    assert len(union) >= num_windows - M - M * B  # all but the epoch's leftovers
    assert union <= set(range(num_windows))


def test_batches_are_windows_of_the_stream():
    tokens, L = stream(5_000), 8
    b = Batches(tokens, context=L, batch_size=4, learner=1, num_learners=2, seed=3)
    batch = b[5]
    assert batch.shape == (4, L + 1) and batch.dtype == np.int32
    for row, w in zip(batch, b.window_ids(5)):
        np.testing.assert_array_equal(row, tokens[w * L : w * L + L + 1])


def test_a_process_reads_its_own_rows_of_a_batch():
    """A process of a multi-host learner reads rows a:b alone; together they make the batch."""
    b = Batches(stream(5_000), context=8, batch_size=8, learner=1, num_learners=2, seed=3)
    for step in (0, 7, 300):
        parts = [b.rows(step, slice(i, i + 2)) for i in range(0, 8, 2)]
        assert all(p.shape == (2, 9) and p.dtype == np.int32 for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), b[step])
    assert not np.array_equal(b.rows(7, slice(0, 2)), b.rows(7, slice(2, 4)))


def test_batches_are_deterministic_and_seeded():
    tokens = stream()
    a = Batches(tokens, context=8, batch_size=4, learner=0, num_learners=2, seed=1)
    b = Batches(tokens, context=8, batch_size=4, learner=0, num_learners=2, seed=1)
    c = Batches(tokens, context=8, batch_size=4, learner=0, num_learners=2, seed=2)
    for s in (0, 3, 500):  # 500 is several epochs in
        np.testing.assert_array_equal(a[s], b[s])
    assert not all(np.array_equal(a[s], c[s]) for s in range(3))


def test_resume_from_a_step_gives_the_same_batches_as_continuing():
    tokens, k = stream(3_000), 37  # a small stream: the run below crosses epochs
    go_on = Batches(tokens, context=8, batch_size=4, learner=1, num_learners=3, seed=5)
    straight = [x for _, x in zip(range(2 * k), go_on.iterate(0))]
    restarted = Batches(tokens, context=8, batch_size=4, learner=1, num_learners=3, seed=5)
    resumed = [x for _, x in zip(range(k), restarted.iterate(k))]
    for x, y in zip(straight[k:], resumed):
        np.testing.assert_array_equal(x, y)


def test_new_epoch_is_a_new_order():
    b = Batches(stream(1_001), context=10, batch_size=10, seed=0)  # 100 windows, 10 steps
    first = np.concatenate([b.window_ids(s) for s in range(10)])
    second = np.concatenate([b.window_ids(s) for s in range(10, 20)])
    assert sorted(first) == sorted(second) == list(range(100))
    assert not np.array_equal(first, second)


def test_batches_refuse_bad_arguments():
    with pytest.raises(DataError, match="learner index 2 not in"):
        Batches(stream(), context=8, batch_size=4, learner=2, num_learners=2)
    with pytest.raises(DataError, match="too few for 4 learners"):
        Batches(stream(20), context=8, batch_size=4, learner=0, num_learners=4)


def test_eval_batches_are_fixed_and_spread():
    held = stream(2_000)
    a = eval_batches(held, context=16, batch_size=4, num_batches=3)
    b = eval_batches(held, context=16, batch_size=4, num_batches=3)
    assert len(a) == 3 and all(x.shape == (4, 17) for x in a)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    short = eval_batches(stream(100), context=16, batch_size=4, num_batches=8)
    assert len(short) == 1  # 6 windows: one whole batch, no repeats
    with pytest.raises(DataError, match="fewer than context"):
        eval_batches(stream(10), context=16, batch_size=4, num_batches=1)


# -- the corpus ---------------------------------------------------------------------


def test_split_files_is_disjoint_stable_and_small():
    paths = _walk(stdlib_dir(), suffix=".py", skip_dirs=("site-packages",))
    assert len(paths) > 200 and paths == sorted(paths)
    train, held = split_files(paths)
    assert not set(train) & set(held) and sorted(train + held) == paths
    assert 0.015 < len(held) / len(paths) < 0.05
    # A path's side does not depend on the other paths.
    train2, held2 = split_files(paths[::2])
    assert set(held2) == set(held) & set(paths[::2])


def test_default_corpus_is_the_stdlib_and_cached(tmp_path):
    a = load_corpus(cache_dir=tmp_path)
    assert a.source.startswith("stdlib:") and a.num_files > 200
    assert a.train.dtype == np.uint8 and len(a.train) > 1_000_000
    assert 0.015 < len(a.heldout) / (len(a.train) + len(a.heldout)) < 0.06
    assert b"def " in bytes(a.train[:200_000])
    b = load_corpus(cache_dir=tmp_path)  # from the cache: memory-mapped, same bytes
    assert isinstance(b.train, np.memmap)
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.heldout, b.heldout)
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob("corpus-*")]


def test_directory_split_is_by_file(tmp_path):
    root = write_tree(tmp_path / "text", n_files=300)
    corpus = load_corpus(root, cache_dir=tmp_path / "cache")
    train, held = bytes(corpus.train), bytes(corpus.heldout)
    assert corpus.num_files == 300 and held
    for i in range(300):
        marker = f"<<file {i:03d}>>".encode()
        assert (marker in train) != (marker in held), f"file {i} on both sides or neither"


def test_text_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(256)) * 40)
    corpus = load_corpus(path, cache_dir=tmp_path / "cache")
    whole = np.concatenate([corpus.train, corpus.heldout])
    np.testing.assert_array_equal(whole, np.frombuffer(path.read_bytes(), np.uint8))
    assert 0 < len(corpus.heldout) < 0.05 * len(whole)


def test_small_directory_falls_back_to_a_tail_split(tmp_path):
    root = write_tree(tmp_path / "text", n_files=3)
    corpus = load_corpus(root, cache_dir=tmp_path / "cache")
    assert len(corpus.train) and len(corpus.heldout)


def test_directory_skips_binary_and_hidden_files(tmp_path):
    root = write_tree(tmp_path / "text", n_files=5)
    (root / "blob.bin").write_bytes(b"\0\1\2" * 100)
    (root / ".hidden").write_text("SECRET")
    corpus = load_corpus(root, cache_dir=tmp_path / "cache")
    everything = bytes(corpus.train) + bytes(corpus.heldout)
    assert corpus.num_files == 5 and b"SECRET" not in everything and b"\0" not in everything


def test_npy_tokens(tmp_path):
    path = tmp_path / "tokens.npy"
    tokens = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.uint16)
    np.save(path, tokens)
    corpus = load_corpus(path, vocab=1000)
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.heldout]), tokens)
    assert corpus.num_files == 0


@pytest.mark.parametrize(
    "make, kwargs, match",
    [
        (lambda p: p / "nope", {}, "no such file or directory"),
        (lambda p: (p / "empty").mkdir() or p / "empty", {}, "no files found"),
        (
            lambda p: (p / "e.txt").write_bytes(b"") and None or p / "e.txt",
            {},
            "no readable, non-empty text files",
        ),
        (
            lambda p: np.save(p / "big.npy", np.array([1, 2, 300])) or p / "big.npy",
            {},
            r"span \[1, 300\] but the model's vocabulary is \[0, 256\)",
        ),
        (
            lambda p: np.save(p / "neg.npy", np.array([-1, 2, 3])) or p / "neg.npy",
            {},
            r"span \[-1, 3\]",
        ),
        (
            lambda p: np.save(p / "f.npy", np.ones(9, np.float32)) or p / "f.npy",
            {},
            "want an integer dtype",
        ),
        (
            lambda p: np.save(p / "z.npy", np.zeros(0, np.int32)) or p / "z.npy",
            {},
            "token array is empty",
        ),
        (
            lambda p: (p / "bad.npy").write_bytes(b"not numpy") and None or p / "bad.npy",
            {},
            "not a readable .npy array",
        ),
        (
            lambda p: (p / "t.txt").write_text("hello") and None or p / "t.txt",
            {"vocab": 100},
            "needs vocab >= 256",
        ),
    ],
)
def test_bad_data_raises_a_clear_data_error(tmp_path, make, kwargs, match):
    with pytest.raises(DataError, match=match):
        load_corpus(make(tmp_path), cache_dir=tmp_path / "cache", **kwargs)


def test_concurrent_loads_build_one_complete_cache(tmp_path):
    root = write_tree(tmp_path / "text", n_files=100)
    cache = tmp_path / "cache"
    results: list[Corpus] = []
    threads = [
        threading.Thread(target=lambda: results.append(load_corpus(root, cache_dir=cache)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for r in results[1:]:
        np.testing.assert_array_equal(r.train, results[0].train)
    assert [p.name.startswith("corpus-") for p in cache.iterdir()] == [True]


def test_unwritable_cache_still_loads(tmp_path):
    root = write_tree(tmp_path / "text", n_files=20)
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should go")
    corpus = load_corpus(root, cache_dir=blocker / "cache")
    assert len(corpus.train) > 0


def test_cache_notices_changed_files(tmp_path):
    root = write_tree(tmp_path / "text", n_files=20)
    a = load_corpus(root, cache_dir=tmp_path / "cache")
    with open(root / "d0" / "f000.txt", "a") as f:
        f.write("NEW LINE\n")
    b = load_corpus(root, cache_dir=tmp_path / "cache")
    assert len(a.train) + len(a.heldout) + 9 == len(b.train) + len(b.heldout)
    assert len(os.listdir(tmp_path / "cache")) == 2
