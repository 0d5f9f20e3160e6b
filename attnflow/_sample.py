"""The samples that ship with attnflow (public as :mod:`attnflow.data`).

``attnflow/data/minilm_sample.npz`` holds the attention of the real pretrained
sentence-transformers all-MiniLM-L6-v2 (6 layers, 12 heads) on three short sentences from
Abnar & Zuidema (2020), recorded as one padded batch by ``scripts/record_sample.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "SAMPLE_FILE",
    "VIT_SAMPLE_FILE",
    "ImageSample",
    "Sample",
    "load_image_sample",
    "load_sample",
]

SAMPLE_FILE = "minilm_sample.npz"
"""File name of the sample inside the ``attnflow.data`` package."""

_KEYS = ("attentions", "mask", "tokens", "sentences", "source")


@dataclass(frozen=True)
class Sample:
    """Attention weights of a real model on a padded batch of sentences.

    Made by :func:`load_sample`, which checks the file's shapes; the fields are its
    attributes.

    Parameters
    ----------
    attentions : ndarray of float32, shape (batch, layers, heads, n, n)
        Attention probabilities as the model returned them (rows = queries, columns =
        keys), padded positions included. Read-only.
    mask : ndarray of bool, shape (batch, n)
        True for real tokens, False for padding. Read-only.
    tokens : list of list of str
        ``batch`` lists of ``n`` word pieces each, ``"[PAD]"`` for padding.
    sentences : list of str
        The input sentences.
    source : str
        Model, library versions and recording date.

    Examples
    --------
    >>> from attnflow.data import load_sample
    >>> sample = load_sample()
    >>> sample.mask.shape == (len(sample.sentences), sample.attentions.shape[-1])
    True
    >>> sample.tokens[0][0]
    '[CLS]'
    """

    attentions: NDArray[np.float32]
    mask: NDArray[np.bool_]
    tokens: list[list[str]]
    sentences: list[str]
    source: str


def load_sample() -> Sample:
    """Load the attention sample shipped with attnflow.

    Returns
    -------
    Sample
        The sample; its arrays are fresh, read-only NumPy arrays.

    Raises
    ------
    FileNotFoundError
        If the data file is not installed.
    ValueError
        If the file does not have the expected contents.

    Examples
    --------
    >>> from attnflow.data import load_sample
    >>> sample = load_sample()
    >>> sample.attentions.shape[1:3]  # layers, heads
    (6, 12)
    """
    resource = resources.files("attnflow.data").joinpath(SAMPLE_FILE)
    if not resource.is_file():
        msg = (
            f"the attention sample {SAMPLE_FILE!r} is not installed with attnflow "
            "(package data of attnflow.data); reinstall attnflow."
        )
        raise FileNotFoundError(msg)
    with resource.open("rb") as stream, np.load(stream, allow_pickle=False) as data:
        missing = [key for key in _KEYS if key not in data.files]
        if missing:
            msg = f"the attention sample {SAMPLE_FILE!r} lacks {', '.join(missing)}."
            raise ValueError(msg)
        attentions = np.asarray(data["attentions"], dtype=np.float32)
        mask = np.asarray(data["mask"], dtype=np.bool_)
        tokens = data["tokens"]
        sentences = data["sentences"]
        source = data["source"]

    if (
        attentions.ndim != 5
        or attentions.shape[-1] != attentions.shape[-2]
        or mask.shape != (attentions.shape[0], attentions.shape[-1])
        or tokens.shape != mask.shape
        or sentences.shape != mask.shape[:1]
        or source.shape != ()
    ):
        msg = (
            f"the attention sample {SAMPLE_FILE!r} has inconsistent shapes: attentions "
            f"{attentions.shape}, mask {mask.shape}, tokens {tokens.shape}, sentences "
            f"{sentences.shape}, source {source.shape}."
        )
        raise ValueError(msg)
    attentions.setflags(write=False)
    mask.setflags(write=False)
    return Sample(
        attentions=attentions,
        mask=mask,
        tokens=[[str(token) for token in row] for row in tokens],
        sentences=[str(sentence) for sentence in sentences],
        source=str(source[()]),
    )


VIT_SAMPLE_FILE = "vit_digits_sample.npz"
"""File name of the image sample inside the ``attnflow.data`` package."""


@dataclass(frozen=True)
class ImageSample:
    """Attention weights of a small trained vision transformer on six digits.

    Made by :func:`load_image_sample`, which checks the file's shapes; the fields are its
    attributes.

    Parameters
    ----------
    attentions : ndarray of float32, shape (images, layers, heads, 17, 17)
        Token 0 is [CLS], then the 4 x 4 patches (2 x 2 pixels each) row by row.
    images : ndarray of float32, shape (images, 8, 8)
        The digits, in [0, 1].
    labels, predictions : ndarray of int64, shape (images,)
        True and predicted classes.
    source : str
        Model, training, library versions and recording date.

    Examples
    --------
    >>> from attnflow.data import load_image_sample
    >>> digits = load_image_sample()
    >>> digits.images.shape[1:]  # 8 x 8 pixels
    (8, 8)
    >>> bool((digits.labels == digits.predictions).mean() > 0.5)
    True
    """

    attentions: NDArray[np.float32]
    images: NDArray[np.float32]
    labels: NDArray[np.int64]
    predictions: NDArray[np.int64]
    source: str


def load_image_sample() -> ImageSample:
    """Load the digits sample recorded by ``scripts/record_vit_digits.py``.

    Returns
    -------
    ImageSample
        Read-only arrays.

    Raises
    ------
    FileNotFoundError
        If the file is not installed with attnflow.
    ValueError
        If it lacks an array or its shapes disagree.

    Examples
    --------
    >>> import attnflow
    >>> from attnflow.data import load_image_sample
    >>> digits = load_image_sample()
    >>> digits.attentions.shape[1:]  # layers, heads, 1 + 4 x 4 tokens
    (4, 4, 17, 17)
    >>> patches = attnflow.rollout(digits.attentions[0], rows=0)[1:]  # CLS row, patches only
    >>> patches.reshape(4, 4).shape
    (4, 4)
    """
    resource = resources.files("attnflow.data").joinpath(VIT_SAMPLE_FILE)
    if not resource.is_file():
        msg = f"the image sample {VIT_SAMPLE_FILE!r} is not installed with attnflow."
        raise FileNotFoundError(msg)
    keys = ("attentions", "images", "labels", "predictions", "source")
    with resource.open("rb") as file, np.load(file, allow_pickle=False) as data:
        missing = [key for key in keys if key not in data]
        if missing:
            msg = f"the image sample {VIT_SAMPLE_FILE!r} lacks {', '.join(missing)}."
            raise ValueError(msg)
        arrays = {key: np.asarray(data[key]) for key in keys}
    count = arrays["attentions"].shape[0]
    if arrays["attentions"].ndim != 5 or any(
        arrays[key].shape[0] != count for key in ("images", "labels", "predictions")
    ):
        msg = f"the image sample {VIT_SAMPLE_FILE!r} has inconsistent shapes."
        raise ValueError(msg)
    for key in ("attentions", "images", "labels", "predictions"):
        arrays[key].setflags(write=False)
    return ImageSample(
        attentions=arrays["attentions"],
        images=arrays["images"],
        labels=arrays["labels"],
        predictions=arrays["predictions"],
        source=str(arrays["source"][()]),
    )
