"""Real attention that ships with attnflow, to try every function on, offline.

Two recordings, each read into fresh, read-only NumPy arrays:

- :func:`load_sample`: the attention of the pretrained sentence-transformers
  all-MiniLM-L6-v2 (6 layers, 12 heads) on three sentences from Abnar & Zuidema (2020),
  recorded as one padded batch (a :class:`Sample`: attentions, mask, tokens). It is what
  ``attnflow demo`` and the gallery draw.
- :func:`load_image_sample`: a small vision transformer trained in the repository on
  8 x 8 digits (2 x 2 patches, a CLS token), its attention on six of them (an
  :class:`ImageSample`).

Examples
--------
>>> import numpy as np
>>> import attnflow
>>> from attnflow.data import load_sample
>>> sample = load_sample()
>>> sample.attentions.shape[1:3]  # layers, heads
(6, 12)
>>> real = np.flatnonzero(sample.mask[0])  # the first sentence without its padding
>>> tokens = [sample.tokens[0][i] for i in real]
>>> one = sample.attentions[0][..., real, :][..., real]
>>> scores = attnflow.rollout(one, rows=0)  # [CLS]'s row: one score per token
>>> scores.shape == (len(tokens),)
True
"""

from attnflow._sample import ImageSample, Sample, load_image_sample, load_sample

__all__ = ["ImageSample", "Sample", "load_image_sample", "load_sample"]
