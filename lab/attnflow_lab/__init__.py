"""The attnflow lab: Abnar & Zuidema (2020) reproduced offline, and studies of the methods.

A distribution of its own (``attnflow-lab``, in ``lab/`` of attnflow's repository) that
uses attnflow's public API only. ``attnflow-lab evaluate agreement|sentiment`` runs the
reproductions; ``lab/scripts`` trains the models, ``lab/protocols`` holds the ablations
and anchors, ``lab/reports`` the dated logs of the studies and their data.

* :mod:`attnflow_lab.agreement`: the subject-verb agreement task and Tables 1-2.
* :mod:`attnflow_lab.sentiment`: the Table 3 analogue on the shipped MiniLM.
* :mod:`attnflow_lab.value_aware`: every method's faithfulness on both tasks, over the
  attention weights and the value-aware matrices (norm-based, GlobEnc, ALTI).

Importing this package imports none of its submodules.
"""

from __future__ import annotations

__all__: list[str] = []
