"""Capture attention weights (and their gradients) from PyTorch models.

``attnflow.adapters.torch`` records the attention probabilities of a model call and hands
them back in attnflow's canonical layout ``(*batch, layers, heads, n, n)`` with a padding
mask, ready for :func:`attnflow.rollout` and :func:`attnflow.flow`. It imports torch and
is imported only on demand (``import attnflow`` never imports it).

How the weights are captured, inside :func:`capture`:

* Every call of ``torch.nn.functional.scaled_dot_product_attention`` (SDPA) is replaced by
  an explicit computation with SDPA's semantics that records the softmax probabilities.
  This catches Hugging Face models with ``attn_implementation="sdpa"`` (the default in
  transformers 5), timm models with fused attention, ``nn.MultiheadAttention``,
  ``nn.TransformerEncoder(Layer)`` and any other code that looks SDPA up at call time.
  Besides the ``torch.nn.functional`` attribute, every global bound to SDPA in the modules
  that define the model's classes (and in ``transformers.integrations.sdpa_attention``)
  is swapped, so ``from torch.nn.functional import scaled_dot_product_attention`` in a
  model file is caught too.
* Hugging Face models with ``attn_implementation="eager"``: the model files' own
  ``eager_attention_forward`` is wrapped (the function every transformers 5 model calls
  for eager attention), and the weights it returns, which are the tensor multiplied with
  the values, are recorded. This needs no ``output_attentions=True``, keeps the model's
  outputs as they are, and gives gradients with respect to the same tensor as
  ``retain_grad()`` on ``output_attentions``.
* ``nn.MultiheadAttention``: the PyTorch fast paths are switched off
  (``torch.backends.mha.set_fastpath_enabled(False)``) and a forward pre-hook routes each
  call through SDPA (``need_weights=False``); if the caller asked for the weights, a
  forward hook hands back the recorded ones (head-averaged if ``average_attn_weights``),
  so the caller sees what it would have seen, and the weights are on the autograd path.

Encoder-decoder models (a Hugging Face model whose config has ``is_encoder_decoder=True``,
e.g. BART, or an ``nn.Transformer``) run three kinds of attention, kept apart as
``cap.encoder_attentions``, ``cap.decoder_attentions`` and ``cap.cross_attentions``. Each
attention call is classified from the module that made it, the innermost module running
when the weights are recorded (every submodule gets a pre-hook and a hook that keep a
stack of the running modules with their qualified names from ``model.named_modules()``):

* cross-attention if that module was called with a ``key_value_states`` /
  ``encoder_hidden_states`` (Hugging Face) or ``memory`` argument that is not None, has a
  true ``is_cross_attention`` attribute, or is named ``encoder_attn``, ``crossattention``,
  ``cross_attn``, ``EncDecAttention`` or ``multihead_attn`` (``nn.TransformerDecoderLayer``);
* otherwise decoder self-attention if the first component of its qualified name that ends
  with ``encoder`` or ``decoder`` ends with ``decoder`` (``decoder.layers.0.self_attn``,
  ``model.decoder.layers.0.self_attn``), or, without such a component, if it has a true
  ``is_decoder`` attribute;
* otherwise encoder self-attention (``encoder.layers.0.self_attn``).

For HF BART in transformers 5.23 the attention module is ``BartAttention`` for all three
(``is_decoder`` is True for both decoder kinds; cross-attention is told by the
``key_value_states`` argument, there is no ``is_cross_attention`` attribute), so the
arguments and the names decide.

Everything is restored when the block ends, also when the forward raises.

``capture(model, contributions="norm" | "globenc" | "alti")`` records value-aware
token-mixing matrices instead (:func:`attnflow.contributions`): hooks on each supported
attention block (Hugging Face BERT-like, DistilBERT, GPT-2, ViT and Llama-family layers,
``nn.TransformerEncoderLayer``)
collect its input, the attention's input and weights (and GlobEnc's second LayerNorm input)
and the core turns them into the block's ``n x n`` matrix when it returns; see
``attnflow.adapters._torch_contributions``.

:func:`input_gradients` gives the token importances that attention rollout and flow are
compared with in the paper: the gradient of a classifier's target score with respect to
the output of its embedding module, through a forward hook removed after the call.

:func:`ground_truth` checks which methods localise on a causal LM: on generated prompts
whose answer has a known source token (copying, retrieval, stated facts, subject-verb
agreement, indirect-object identification), how often each method of the registry, named,
ranks the source first (:func:`attnflow.evaluate.ground_truth` on the model's functions).
"""

from __future__ import annotations

from ._torch_capture import Capture, capture, sdpa_with_weights
from ._torch_diagnose import diagnose
from ._torch_explain import explain, explain_image, explain_text
from ._torch_generation import explain_generation
from ._torch_gradients import attention_gradients, input_gradients
from ._torch_llm import ground_truth
from ._torch_model_functions import model_functions

__all__ = [
    "Capture",
    "attention_gradients",
    "capture",
    "diagnose",
    "explain",
    "explain_generation",
    "explain_image",
    "explain_text",
    "ground_truth",
    "input_gradients",
    "model_functions",
    "sdpa_with_weights",
]
