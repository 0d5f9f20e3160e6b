"""Bridges to other explainability toolkits, each in its own submodule.

* ``attnflow.integrations.inseq`` (extra ``attnflow[inseq]``): importing it registers the
  inseq attribution methods ``"attention_rollout"``, ``"attention_flow"`` and
  ``"gradient_rollout"``.
* ``attnflow.integrations.captum`` (extra ``attnflow[captum]``): captum-style
  ``AttentionRollout(model).attribute(inputs, ...)``, ``AttentionFlow`` and
  ``GradientRollout``, and ``Logits`` (a model's logits for captum's metrics).
* ``attnflow.integrations.quantus`` (extra ``attnflow[quantus]``): a Quantus
  ``explain_func`` for vision transformers, patch maps upsampled to pixels.

Each submodule imports its toolkit and PyTorch when it is imported; this package and
``import attnflow`` import neither.
"""

from __future__ import annotations

__all__: list[str] = []
