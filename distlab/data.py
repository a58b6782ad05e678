"""Datasets the course trains on, all usable offline.

* ``digits``: scikit-learn's bundled handwritten digits (1797 real 8x8 images, 10
  classes), optionally upsampled for CNNs. The offline default everywhere.
* ``synthetic_classification`` / ``synthetic_tokens``: seeded, learnable sets for
  exact-equivalence tests (same seed, same tensors, on every rank).
* ``mnist`` / ``cifar10`` / ``imagefolder``: the real formats through torchvision,
  ``download=False`` unless asked; missing files raise ``FileNotFoundError`` naming
  the flag (``--download``) or the directory to fill.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

DATASETS = ("digits", "synthetic", "mnist", "cifar10", "imagefolder")


def digits(split: str = "train", image_size: int = 8, flatten: bool = False,
           test_fraction: float = 0.2) -> TensorDataset:
    """scikit-learn's digits as (images (N, 1, S, S) or (N, S*S), labels (N,)), standardised.

    The split is a fixed shuffle (seed 0), so every rank and every run sees the same
    train and test sets. ``image_size`` > 8 upsamples bilinearly (for CNNs).
    """
    from sklearn.datasets import load_digits

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    raw = load_digits()
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(raw.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * test_fraction)
    idx = order[n_test:] if split == "train" else order[:n_test]
    x, y = x[idx], y[idx]
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = (x - 0.3) / 0.4  # roughly zero mean, unit variance over the data set
    if flatten:
        x = x.flatten(1)
    return TensorDataset(x, y)


def per_rank_batch(global_batch: int, world_size: int) -> int:
    """Each rank's share of a global batch; a ValueError with the arithmetic when it does not divide."""
    if global_batch % world_size:
        raise ValueError(f"--global-batch {global_batch} is not divisible by the world size {world_size} "
                         f"({global_batch} % {world_size} = {global_batch % world_size}): each rank must get "
                         f"an equal shard; try {global_batch - global_batch % world_size} or "
                         f"{global_batch + world_size - global_batch % world_size}")
    return global_batch // world_size


def synthetic_classification(n: int = 256, in_features: int = 16, num_classes: int = 4,
                             seed: int = 0) -> TensorDataset:
    """Gaussian inputs labelled by a random linear teacher: learnable, seeded, exact on every rank."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    teacher = torch.randn(in_features, num_classes, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def synthetic_tokens(n_seq: int = 64, seq_len: int = 16, vocab_size: int = 64,
                     seed: int = 0) -> TensorDataset:
    """Token sequences from a fixed random bigram rule with 10% noise: (inputs, next tokens).

    A model that learns the rule drives the loss well below log(vocab_size).
    """
    g = torch.Generator().manual_seed(seed)
    rule = torch.randperm(vocab_size, generator=g)  # next = rule[current]
    seq = torch.empty(n_seq, seq_len + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(vocab_size, (n_seq,), generator=g)
    for t in range(seq_len):
        noise = torch.rand(n_seq, generator=g) < 0.1
        seq[:, t + 1] = torch.where(noise, torch.randint(vocab_size, (n_seq,), generator=g),
                                    rule[seq[:, t]])
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


def _missing(name: str, root: Path, detail: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{name} files not found under {root} ({detail}). Pass --download to fetch them, "
        f"or --data-root DIR to point at a directory that holds them.")


def mnist(root: str | Path, split: str = "train", download: bool = False) -> Dataset:
    """MNIST through torchvision (root/MNIST/raw/*-ubyte), normalised 1x28x28 tensors."""
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        return datasets.MNIST(str(root), train=(split == "train"), download=download, transform=tf)
    except RuntimeError as exc:
        raise _missing("MNIST", Path(root), str(exc)) from exc


def cifar10(root: str | Path, split: str = "train", download: bool = False,
            verify_checksums: bool = True, augment: bool = False) -> Dataset:
    """CIFAR-10 through torchvision (root/cifar-10-batches-py/), normalised 3x32x32 tensors.

    ``verify_checksums=False`` accepts batch files whose MD5 differs from the
    official release (the tests write tiny files in the same format).
    """
    from torchvision import datasets, transforms

    steps = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if augment else []
    tf = transforms.Compose(steps + [transforms.ToTensor(),
                                     transforms.Normalize((0.4914, 0.4822, 0.4465), (0.247, 0.243, 0.261))])
    cls = datasets.CIFAR10
    if not verify_checksums:
        class _Unverified(datasets.CIFAR10):
            def _check_integrity(self) -> bool:
                base = Path(self.root) / self.base_folder
                return all((base / name).is_file() for name, _ in self.train_list + self.test_list)

            def _load_meta(self) -> None:
                path = Path(self.root) / self.base_folder / self.meta["filename"]
                if not path.is_file():
                    raise RuntimeError(f"{path} not found")
                with open(path, "rb") as f:
                    self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
                self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        cls = _Unverified
    try:
        return cls(str(root), train=(split == "train"), download=download, transform=tf)
    except RuntimeError as exc:
        raise _missing("CIFAR-10", Path(root), str(exc)) from exc


def imagefolder(root: str | Path, split: str = "train", image_size: int = 224,
                augment: bool = False) -> Dataset:
    """ImageNet layout through torchvision: root/{train,val}/<class>/<image>, normalised RGB."""
    from torchvision import datasets, transforms

    folder = Path(root) / split
    if not folder.is_dir():
        raise FileNotFoundError(
            f"ImageFolder split {folder} not found: --data-root must hold train/ and val/, "
            "each with one sub-directory of images per class (the ImageNet layout).")
    if augment:
        steps = [transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip()]
    else:
        steps = [transforms.Resize(int(image_size * 1.14)), transforms.CenterCrop(image_size)]
    tf = transforms.Compose(steps + [transforms.ToTensor(),
                                     transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    return datasets.ImageFolder(str(folder), transform=tf)


def get_dataset(name: str, split: str = "train", root: str | Path = "data", download: bool = False,
                image_size: int | None = None) -> Dataset:
    """One entry point for scripts: ``--dataset NAME --data-root DIR [--download]``."""
    if name == "digits":
        return digits(split, image_size=image_size or 8)
    if name == "synthetic":
        return synthetic_classification(seed=0 if split == "train" else 1)
    if name == "mnist":
        return mnist(root, split, download)
    if name == "cifar10":
        return cifar10(root, split, download)
    if name == "imagefolder":
        return imagefolder(root, "train" if split == "train" else "val", image_size or 224)
    raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")
