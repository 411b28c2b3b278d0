"""Loaders for the public datasets in ``../shared/data`` (formats in that folder's README).

Every loader raises ``DataMissing`` when its files are absent, so that an experiment can print
why it skipped and exit cleanly; nothing here downloads anything.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import DATA, read_idx

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081

#: where decoded datasets are cached (outside the repository); ``GRABKIT_EXPERIMENTS_CACHE``
#: overrides it
CACHE = Path(
    os.environ.get("GRABKIT_EXPERIMENTS_CACHE", Path.home() / ".cache" / "grabkit-experiments")
)

CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip


class DataMissing(FileNotFoundError):
    """A dataset this experiment needs is not in ``../shared/data``."""


def _require(path: Path) -> Path:
    if not path.exists():
        raise DataMissing(
            f"{path} not found (the experiments read ../shared/data, or the folder GRABKIT_DATA "
            "names; see its README)"
        )
    return path


def _read_idx(path: Path) -> np.ndarray:
    """An idx file (gzip) as a uint8 array, or the clean skip when it is absent."""
    return read_idx(_require(path))


def mnist(
    n_train: int, n_test: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``n_train`` training and ``n_test`` test images: (n, 784) float32 normalised
    with the training set's mean and std, and int64 labels."""
    folder = DATA / "mnist"

    def images(name: str, n: int) -> torch.Tensor:
        x = torch.as_tensor(_read_idx(folder / name)[:n].reshape(n, 28 * 28), dtype=torch.float32)
        return (x / 255.0 - MNIST_MEAN) / MNIST_STD

    def labels(name: str, n: int) -> torch.Tensor:
        return torch.as_tensor(_read_idx(folder / name)[:n], dtype=torch.int64)

    return (
        images("train-images-idx3-ubyte.gz", n_train),
        labels("train-labels-idx1-ubyte.gz", n_train),
        images("t10k-images-idx3-ubyte.gz", n_test),
        labels("t10k-labels-idx1-ubyte.gz", n_test),
    )


def cifar10_subset() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lossless CIFAR-10 subset: 4,000 train and 1,000 test images, (n, 3, 32, 32) float32
    normalised per channel with the training images' statistics, and int64 labels."""
    from PIL import Image

    folder = DATA / "cifar10" / "lossless_subset"

    def batch(k: int) -> np.ndarray:
        image = Image.open(_require(folder / f"cifar10_batch_{k}.png")).convert("RGB")
        return np.asarray(image).reshape(1000, 32, 32, 3)

    text = _require(folder / "cifar10_labels.js").read_text()
    labels = json.loads(text[text.index("[") : text.rindex("]") + 1])
    train = np.concatenate([batch(k) for k in range(4)])  # a fresh, writable array
    test = batch(50).copy()
    x_train = torch.as_tensor(train, dtype=torch.float32).permute(0, 3, 1, 2) / 255.0
    x_test = torch.as_tensor(test, dtype=torch.float32).permute(0, 3, 1, 2) / 255.0
    mean = x_train.mean(dim=(0, 2, 3), keepdim=True)
    std = x_train.std(dim=(0, 2, 3), keepdim=True)
    y_train = torch.as_tensor(labels[:4000], dtype=torch.int64)
    y_test = torch.as_tensor(labels[50000:51000], dtype=torch.int64)
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def _cifar10_jpeg_decode() -> dict[str, torch.Tensor]:
    """Decode ``cifar10/jpeg_full`` into uint8 tensors, the training images in CIFAR-10's
    original order (rebuilt from the 50,000 labels of the lossless subset: the k-th image of a
    class in that order is the archive's ``train/<class>/k.jpg``), the test images by class."""
    from PIL import Image

    archive_path = _require(DATA / "cifar10" / "jpeg_full" / "cifar10_jpeg.tar.gz")
    text = _require(DATA / "cifar10" / "lossless_subset" / "cifar10_labels.js").read_text()
    labels = json.loads(text[text.index("[") : text.rindex("]") + 1])[:50000]
    images: dict[tuple[str, int, int], np.ndarray] = {}
    with tarfile.open(archive_path, "r:gz") as archive:
        for member in archive:
            parts = member.name.split("/")
            if len(parts) != 4 or not parts[3].endswith(".jpg"):
                continue
            key = (parts[1], CIFAR10_CLASSES.index(parts[2]), int(parts[3][:-4]))
            raw = archive.extractfile(member).read()
            images[key] = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    seen = [0] * 10
    train = []
    for label in labels:
        train.append(images[("train", label, seen[label])])
        seen[label] += 1
    test_keys = sorted(k for k in images if k[0] == "test")
    return {
        "x_train": torch.as_tensor(np.stack(train)).permute(0, 3, 1, 2).contiguous(),
        "y_train": torch.tensor(labels, dtype=torch.int64),
        "x_test": torch.as_tensor(np.stack([images[k] for k in test_keys]))
        .permute(0, 3, 1, 2)
        .contiguous(),
        "y_test": torch.tensor([k[1] for k in test_keys], dtype=torch.int64),
    }


def cifar10_full(
    mean: tuple[float, float, float], std: tuple[float, float, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All of CIFAR-10 from the JPEG archive: 50,000 train images in the original order and
    10,000 test images, (n, 3, 32, 32) float32 scaled to [0, 1] then normalised with ``mean``
    and ``std`` per channel, and int64 labels. The decoded images are cached in ``CACHE``
    (150 MB of uint8) after the first call, which takes about a minute."""
    cache = CACHE / "cifar10_jpeg_full.pt"
    if cache.exists():
        tensors = torch.load(cache, weights_only=True)
    else:
        tensors = _cifar10_jpeg_decode()
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        torch.save(tensors, partial)
        partial.replace(cache)
    m = torch.tensor(mean).view(1, 3, 1, 1)
    s = torch.tensor(std).view(1, 3, 1, 1)

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return (x.float() / 255.0 - m) / s

    return (
        scaled(tensors["x_train"]),
        tensors["y_train"],
        scaled(tensors["x_test"]),
        tensors["y_test"],
    )


def word_corpus(name: str, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Token ids of a word-level corpus: (train ids, test ids, vocabulary size).

    ``name`` is ``"wikitext2"`` (only valid and test ship here: valid is the training text, test
    the test text) or ``"ptb"`` (train / test). Lines end with ``<eos>``; the ``vocab_size - 1``
    most frequent training words keep their id, every other word is ``<unk>`` (id 0).
    """
    if name == "wikitext2":
        train_path, test_path = DATA / "wikitext2" / "valid.txt", DATA / "wikitext2" / "test.txt"
    elif name == "ptb":
        train_path, test_path = DATA / "ptb" / "ptb.train.txt", DATA / "ptb" / "ptb.test.txt"
    else:
        raise ValueError(f"unknown corpus {name!r}; expected 'wikitext2' or 'ptb'")

    def words(path: Path) -> list[str]:
        out: list[str] = []
        for line in _require(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                out += [*line.split(), "<eos>"]
        return out

    train_words, test_words = words(train_path), words(test_path)
    common = [w for w, _ in Counter(train_words).most_common() if w != "<unk>"][: vocab_size - 1]
    index = {w: i + 1 for i, w in enumerate(common)}

    def ids(ws: list[str]) -> torch.Tensor:
        return torch.tensor([index.get(w, 0) for w in ws], dtype=torch.int64)

    return ids(train_words), ids(test_words), len(common) + 1


def imdb_lengths_and_labels(split: str = "train") -> tuple[list[list[str]], list[int]]:
    """IMDB reviews of one split as lower-cased whitespace tokens (``<br />`` removed), labels
    1 (pos) / 0 (neg), in the archive's order."""
    path = _require(DATA / "imdb" / "aclImdb_labeled.tar.gz")
    texts: list[list[str]] = []
    labels: list[int] = []
    with tarfile.open(path, "r:gz") as archive:
        for member in archive:
            parts = member.name.split("/")
            if len(parts) == 4 and parts[1] == split and parts[2] in ("pos", "neg"):
                raw = archive.extractfile(member).read().decode("utf-8", errors="replace")
                texts.append(raw.replace("<br />", " ").lower().split())
                labels.append(int(parts[2] == "pos"))
    return texts, labels
