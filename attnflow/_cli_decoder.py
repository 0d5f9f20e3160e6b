"""``attnflow explain`` on a causal LM: a target word, a chat prompt, blockwise rows, generation.

- ``--target WORD``: the vocabulary id of a word, tokenised by the model's tokenizer and
  refused when it is not one token (the pieces it splits into, and its one-token forms with
  or without a leading space, are named); an integer is an id (or a classifier's class,
  which ``--target LABEL`` also names through ``config.id2label``).
- ``--chat``: the text is the user's message of the tokenizer's chat template, with the
  generation prompt after it; the template's own special tokens, not the tokenizer's.
- ``--blockwise``: gradient rollout and rollout rows from each layer's queries and keys,
  never holding an attention matrix (``explain(..., blockwise=True)``), at every layer.
- ``--generate N``: generate up to N tokens greedily and attribute each to the prompt and
  the text generated before it (``explain_generation``); the page picks a generated token.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from ._cli_common import UsageError
from ._methods import method_spec

__all__ = [
    "add_decoder_cli_flags",
    "chat_tokenizer",
    "check_decoder_flags",
    "explain_blockwise",
    "explain_generated",
    "resolve_target",
]

#: What --blockwise and --generate compute.
BLOCKWISE_METHODS: tuple[str, ...] = ("direct_logit", "ifr", "gradient_rollout", "rollout")
GENERATION_METHODS: tuple[str, ...] = (
    "direct_logit",
    "alti_logit",
    "ifr",
    "gradient_rollout",
    "rollout",
    "raw",
)


def add_decoder_cli_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--chat``, ``--blockwise``, ``--generate`` and ``--spans``."""
    parser.add_argument(
        "--chat",
        action="store_true",
        help="causal LM: the text is the user's message of the tokenizer's chat template, "
        "followed by the generation prompt",
    )
    parser.add_argument(
        "--blockwise",
        action="store_true",
        help="causal LM (Llama, Mistral, Qwen2 style): gradient_rollout and rollout rows "
        "from recomputed queries and keys, never holding an attention matrix (long texts)",
    )
    parser.add_argument(
        "--generate",
        metavar="N",
        type=int,
        default=None,
        help="causal LM: generate up to N tokens (greedy) and attribute each to the prompt "
        "and the text generated before it; methods among gradient_rollout, rollout, raw",
    )
    parser.add_argument(
        "--spans",
        choices=("words", "sentences"),
        default=None,
        help="show the scores summed over the words or sentences of the text (a fast "
        "tokenizer's offsets; sinks and the explained token not counted)",
    )


def check_decoder_flags(args: argparse.Namespace, methods: list[str] | None) -> None:
    """Refuse combinations that cannot work, before anything is read."""
    if args.generate is not None:
        if args.generate < 1:
            msg = f"--generate must be >= 1 (tokens to generate); got {args.generate}"
            raise UsageError(msg)
        for flag, value in (
            ("--target", args.target),
            ("--rows", args.row),
            ("--blockwise", args.blockwise or None),
            ("--spans", args.spans),
            ("--image", args.image),
        ):
            if value is not None:
                msg = (
                    f"--generate explains each generated token at the position that "
                    f"predicted it; drop {flag}"
                )
                raise UsageError(msg)
        allowed = GENERATION_METHODS
    elif args.blockwise:
        allowed = BLOCKWISE_METHODS
    else:
        return
    if methods is not None and not set(methods) <= set(allowed):
        flag = "--generate" if args.generate is not None else "--blockwise"
        msg = f"{flag} computes {', '.join(allowed)}; got --method {','.join(methods)}"
        raise UsageError(msg)
    if args.heads != "mean" and args.generate is None:
        msg = "--blockwise fuses heads by their mean; drop --heads"
        raise UsageError(msg)


def check_causal(args: argparse.Namespace, causal: bool) -> None:
    """--chat, --blockwise and --generate need a causal LM."""
    for flag, given in (("--chat", args.chat), ("--blockwise", args.blockwise)):
        if given and not causal:
            msg = f"{flag} is for causal language models (a ...ForCausalLM config)"
            raise UsageError(msg)
    if args.generate is not None and not causal:
        msg = "--generate is for causal language models (a ...ForCausalLM config)"
        raise UsageError(msg)


def resolve_target(value: str | None, tokenizer: Any, config: Any, *, causal: bool) -> int | None:
    """``--target``: an int, a class label (``config.id2label``) or a one-token word.

    Examples
    --------
    >>> class Tok:
    ...     vocab = {"Paris": 5, " Paris": 6, "Par": 7, "is": 8}
    ...     def encode(self, text, add_special_tokens=False):
    ...         return [self.vocab[text]] if text in self.vocab else [7, 8]
    ...     def convert_ids_to_tokens(self, ids):
    ...         return [{v: k for k, v in self.vocab.items()}[i] for i in ids]
    >>> resolve_target(" Paris", Tok(), None, causal=True)
    6
    >>> resolve_target("12", Tok(), None, causal=True)
    12
    """
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        pass
    id2label = getattr(config, "id2label", None)
    if not causal and isinstance(id2label, Mapping):
        for index, label in id2label.items():
            if str(label) == value:
                return int(index)
        names = ", ".join(repr(str(label)) for label in id2label.values())
        msg = f"--target {value!r} is not a class of the model; its classes are {names}"
        raise UsageError(msg)
    ids = list(tokenizer.encode(value, add_special_tokens=False))
    if len(ids) == 1:
        return int(ids[0])
    pieces = [repr(p) for p in tokenizer.convert_ids_to_tokens(ids)]
    forms = []
    for variant in dict.fromkeys((value.strip(), " " + value.strip())):
        one = list(tokenizer.encode(variant, add_special_tokens=False))
        if len(one) == 1:
            forms.append(f"{variant!r} (id {one[0]})")
    hint = f"; one-token forms: {', '.join(forms)}" if forms else ""
    msg = (
        f"--target {value!r} is {len(ids)} tokens ({', '.join(pieces) or 'none'}), not one; "
        f"give one token or a vocabulary id{hint}"
    )
    raise UsageError(msg)


class _ChatTokenizer:
    """The tokenizer, calling itself without adding special tokens (the template has them)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __call__(self, text: str, **kwargs: Any) -> Any:
        return self._tokenizer(text, add_special_tokens=False, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def chat_tokenizer(tokenizer: Any, text: str) -> tuple[Any, str]:
    """``--chat``: the text in the chat template, and a tokenizer that adds nothing to it."""
    if not getattr(tokenizer, "chat_template", None):
        msg = "--chat needs a tokenizer with a chat template; this model's tokenizer has none"
        raise UsageError(msg)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return _ChatTokenizer(tokenizer), str(prompt)


def explain_blockwise(
    model: Any,
    tokenizer: Any,
    text: str,
    *,
    methods: list[str] | None,
    row: int | None,
    options: dict[str, Any],
) -> Any:
    """``--blockwise``: rows at every layer, no attention matrix held; an Explanation."""
    import torch

    from attnflow.adapters import torch as capture_torch  # type: ignore[import-not-found,unused-ignore]
    from attnflow.adapters._token_text import token_labels  # type: ignore[import-not-found,unused-ignore]
    from attnflow.adapters._torch_explain import (  # type: ignore[import-not-found,unused-ignore]
        DECODER_LEADING_METHOD,
    )
    from attnflow.explanation import Explanation

    chosen = methods or [
        m
        for m in dict.fromkeys((DECODER_LEADING_METHOD, "gradient_rollout", "rollout"))
        if m in BLOCKWISE_METHODS
    ]
    encoded = tokenizer(text, return_tensors="pt")
    ids = [int(i) for i in encoded["input_ids"][0]]
    n = len(ids)
    if row is not None and not -n <= row < n:
        msg = f"--rows must index the {n} tokens of the text; got {row}"
        raise UsageError(msg)
    position = n - 1 if row is None else row % n
    inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    decoder = {k: options[k] for k in ("exclude", "receptive_field") if k in options}
    scores = {}
    for method in chosen:
        spec = method_spec(method)
        if spec.target_conditioned:  # the explained row only, never a matrix: one forward
            chosen_target = {"target": options.get("target")} if spec.uses_target else {}
            result = capture_torch.explain(
                model, inputs, method=method, rows=position, layers="cumulative", **chosen_target
            )
            scores[method] = result[0].detach().cpu().double().numpy()
            continue
        extra: dict[str, Any] = {"residual": options.get("residual", 0.5)}
        if spec.gradients:
            extra |= {
                "target": options.get("target"),
                "target_score": options.get("target_score", "logit"),
                "exclude_self": True,
            }
        result = capture_torch.explain(
            model,
            inputs,
            method=method,
            rows=position,
            blockwise=True,
            layers="all",
            **decoder,
            **extra,
        )
        scores[method] = result[0].detach().cpu().double().numpy()
    with torch.no_grad():
        logits = model(**inputs).logits[0, position].double()
    probabilities = torch.softmax(logits, dim=-1).cpu().numpy()
    predicted = int(probabilities.argmax())
    target = options.get("target")
    named = {predicted} if target is None else {predicted, int(target)}
    special = tokenizer.get_special_tokens_mask(ids, already_has_special_tokens=True)
    notes = [
        (
            "Blockwise rows (no attention matrix held): the sink is taken to be the first "
            "position, which the weights were not kept to test."
        )
    ]
    if any(method_spec(m).gradients for m in chosen):
        notes.append("Gradient rollout without the explained token's own relevance (set to 0).")
    return Explanation(
        token_labels(tokenizer, ids),
        scores,
        rows=position,
        special=[bool(s) for s in special],
        target=target if any(method_spec(m).uses_target for m in chosen) else None,
        predicted=predicted,
        probabilities=probabilities,
        labels={i: tokenizer.decode([i]) for i in sorted(named)},
        text=text,
        notes=notes,
        sinks=(0,),
    )


def explain_generated(
    model: Any,
    tokenizer: Any,
    text: str,
    *,
    steps: int,
    methods: list[str] | None,
    options: dict[str, Any],
) -> Any:
    """``--generate N``: explain_generation with the command's options."""
    from attnflow.adapters import torch as capture_torch  # type: ignore[import-not-found,unused-ignore]

    settings: dict[str, Any] = {
        k: options[k] for k in ("exclude", "receptive_field") if k in options
    }
    if options.get("target_score", "logit") != "logit":
        settings["target_score"] = options["target_score"]
    chosen = methods or None
    if options.get("residual", 0.5) != 0.5:
        settings["residual"] = options["residual"]
    if options.get("heads", "mean") != "mean":
        settings["heads"] = options["heads"]
    return capture_torch.explain_generation(
        model, tokenizer, text, max_new_tokens=steps, methods=chosen, **settings
    )
