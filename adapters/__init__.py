"""Capture attention weights from models: ``attnflow.adapters``.

The adapters pull attention weights (and their gradients) out of PyTorch, JAX/Flax and
Keras models and hand them to the core in its canonical layout
``(*batch, layers, heads, n, n)`` with a padding mask. They do I/O, not maths.

This package lives in the top-level ``adapters/`` folder of the repository and installs as
``attnflow.adapters``. Each framework gets its own submodule, imported only when asked for,
so that ``import attnflow`` never imports a deep-learning framework:

- ``attnflow.adapters.torch``: PyTorch, Hugging Face ``transformers`` (eager or sdpa) and
  anything that calls ``torch.nn.functional.scaled_dot_product_attention``, and
  ``torch.nn.MultiheadAttention``.
- ``attnflow.adapters.jax``: Flax linen ``MultiHeadDotProductAttention`` (also under
  ``jax.jit``) and NNX ``MultiHeadAttention``, with gradients through perturbations and
  value-aware contributions (norm, GlobEnc, ALTI) of pre-LN and post-LN blocks.
- ``attnflow.adapters.keras``: Keras 3 ``MultiHeadAttention`` layers on the TensorFlow,
  JAX and torch backends.
"""

from __future__ import annotations

__all__: list[str] = []
