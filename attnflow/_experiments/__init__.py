"""Experiments that reproduce Abnar & Zuidema (2020) offline, private to the command line.

``attnflow evaluate`` and the scripts in ``scripts/`` run them; ``attnflow.experiments``
was their public name before 0.1 (deprecated, removed in 0.2).

* :mod:`attnflow._experiments.agreement`: a seeded generator of English-like subject-verb
  agreement data (NumPy and the standard library only), a stand-in for the Linzen et al.
  (2016) data set that the paper trains on.
* :mod:`attnflow._experiments.agreement_torch`: the paper's model (a 6-layer, 8-head
  encoder of GPT-2 blocks without causal masking, classifying from ``[CLS]``), its
  training, and saving and loading it without pickle. Imports PyTorch.
* :mod:`attnflow._experiments.agreement_distill`: the model the paper's code used, a
  student of that shape distilled online from a 2-layer LSTM teacher. Imports PyTorch.
* :mod:`attnflow._experiments.reproduction`: the paper's Tables 1-2 on the agreement task.
* :mod:`attnflow._experiments.sentiment`: a seeded generator of English-like review
  sentences with negation, contrast and concession (the paper's Table 3 analogue, SST-2
  being out of reach offline).
* :mod:`attnflow._experiments.sentiment_torch`: the shipped pretrained MiniLM fine-tuned
  on that task. Imports PyTorch and transformers.
* :mod:`attnflow._experiments.value_aware`: every method's faithfulness on both tasks,
  over the attention weights and the value-aware matrices (norm-based, GlobEnc, ALTI).

Importing this package imports none of its submodules.
"""

from __future__ import annotations

__all__: list[str] = []
