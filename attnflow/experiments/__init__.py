"""Experiments that reproduce Abnar & Zuidema (2020) offline.

* :mod:`attnflow.experiments.agreement`: a seeded generator of English-like subject-verb
  agreement data (NumPy and the standard library only), a stand-in for the Linzen et al.
  (2016) data set that the paper trains on.
* :mod:`attnflow.experiments.agreement_torch`: the paper's model (a 6-layer, 8-head
  encoder of GPT-2 blocks without causal masking, classifying from ``[CLS]``), its
  training, and saving and loading it without pickle. Imports PyTorch.

Importing this package imports neither submodule.
"""

from __future__ import annotations

__all__: list[str] = []
