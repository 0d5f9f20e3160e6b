r"""Ground truth for the attributions of a causal LM: :func:`ground_truth`.

Prompts whose answer has a known source token (:mod:`._llm_tasks`) are generated, located
in the model's tokens, and each attribution method is scored by the rank of the source
(:mod:`._llm_ranks`) among the prompt's tokens; :class:`._llm_report.GroundTruthReport`
holds the result. The model and the methods are plain callables, so that any framework
fits; :func:`attnflow.adapters.torch.ground_truth` builds them for a PyTorch causal LM and
names of attnflow's method registry, then calls :func:`ground_truth`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from attnflow._host import to_host
from attnflow._namespace import enter_boundary

from ._erasure import ERASER_FRACTIONS, comprehensiveness, sufficiency
from ._llm_ranks import competing_positions, source_ranks
from ._llm_report import GroundTruthReport
from ._llm_tasks import TASKS, TaskTokens, Tokenize, locate_source

__all__ = ["GROUND_TRUTH_TASKS", "ground_truth", "task_size"]

GROUND_TRUTH_TASKS = tuple(TASKS)
"""The tasks of :func:`ground_truth`: copying, retrieval, stated_facts, agreement, ioi."""

# The size of each task's items that ground_truth uses by default (the generator's keyword
# and its value): those SmolLM2-135M-Instruct answers reliably (docs/evaluation.md).
_SIZES: dict[str, tuple[str, int] | None] = {
    "copying": ("words", 12),
    "retrieval": ("pairs", 5),
    "stated_facts": ("facts", 2),
    "agreement": ("attractors", 2),
    "ioi": None,
}
_CHAT_TASKS = ("retrieval", "stated_facts")
# Log-probabilities are mapped to two-class "probabilities" q = 1 + log p / _FLOOR for the
# erasure functions: differences of q times _FLOOR are differences of log p (exact above
# the floor, log p >= _FLOOR nats).
_FLOOR = 200.0

Method = Callable[[np.ndarray, int], Any]
LogProbabilities = Callable[[Any], Any]


def ground_truth(
    model: LogProbabilities,
    tokenizer: Any,
    /,
    *,
    task: str = "copying",
    methods: Mapping[str, Method],
    n_items: int = 40,
    seed: int = 0,
    size: int | None = None,
    chat: bool | Callable[[str], str] | None = None,
    replacement: int | None = None,
) -> GroundTruthReport:
    r"""Score attribution methods of a causal LM on prompts whose answer has a known source.

    `n_items` prompts of one `task` are generated (seeded; templates in code, nothing is
    downloaded) and tokenized; each item has a source token that determines the answer,
    and the answer (and the foil, where there is one) is checked to be one token:

    - ``"copying"``: a list of words, then its start again; the next word's source is its
      earlier occurrence (``"List: apple, river, stone. Again: apple,"`` -> ``" river"``);
    - ``"retrieval"``: ``key: value`` lines, then a key; the source is its value;
    - ``"stated_facts"``: facts about people, then a question; the source is the asked
      person's object (``"... Anna lives in Paris ... Anna lives in"`` -> ``" Paris"``);
    - ``"agreement"``: subject-verb agreement across attractors; the source is the subject
      noun (``"She said that the keys to the cabinet near the door"`` -> ``" are"``, foil
      ``" is"``);
    - ``"ioi"``: indirect-object identification; the source is the indirect object's mention
      (``"When Mary and John went to the store, John gave a drink to"`` -> ``" Mary"``, foil
      ``" John"``).

    For each item the model is correct if its top next token is the answer, or, with a
    foil, if the answer's logit is above the foil's. Each method scores every prompt token
    for the last position, explaining the answer token (the target of target-conditioned
    methods), at every layer it reports; the rank of the source among the competing
    positions is

    .. math::

        \operatorname{rank} = 1 + \#\{\, j \in C,\ j \ne s : x_j \ge x_s \,\},

    with :math:`C` the context's positions (the list, the pairs, the facts; the whole
    prompt for agreement and IOI) but the first token (the attention sink) and the
    explained one; ties count against the source. hit@1, the mean reciprocal rank and the
    mean rank are read over the correctly answered items (:class:`GroundTruthReport`).

    Parameters
    ----------
    model : callable
        ``ids (B, n) int64 -> (B, vocab)``: the log-softmax of the model's next-token
        logits at the last position, in any array library. For a PyTorch causal LM, call
        :func:`attnflow.adapters.torch.ground_truth`, which builds it (and the methods from
        registry names).
    tokenizer : tokenizer or callable
        A Hugging Face fast tokenizer (its character offsets locate the source), or a
        callable ``text -> (ids, offsets)``: the token ids and each token's character span.
    task : str, default "copying"
        One of :data:`GROUND_TRUTH_TASKS`.
    methods : mapping of str to callable
        The methods scored, by label: ``method(ids, target) -> scores`` of shape
        ``(layers, n)`` (one row per layer; the last is the top) or ``(n,)``, for one item's
        token ids ``(n,)`` (NumPy int64) and the answer's token id, the target a
        target-conditioned method explains (any array library).
    n_items : int, default 40
        Number of items.
    seed : int, default 0
        Seed of the items: the same seed gives the same prompts.
    size : int, optional
        The number of words (copying), pairs (retrieval), facts (stated_facts) or
        attractors (agreement); IOI has none. None: 12, 5, 2 and 2.
    chat : bool or callable, optional
        Retrieval and stated facts only: put the context and the question in the user's
        turn of the chat template, the assistant's turn opening with the answer's start
        (small instruction-tuned models answer far more items so). True: the tokenizer's
        ``apply_chat_template``; a callable: ``message -> prompt text``; False: plain text;
        None: the chat template when the tokenizer has one.
    replacement : int, optional
        A token id: also measure ERASER comprehensiveness and sufficiency of the answer's
        log-probability (fractions 1, 5, 10, 20, 50 % of the competing positions, replaced
        by this token) for every method's top layer; two batched model calls per method
        and correct item. None: ranks only.

    Returns
    -------
    GroundTruthReport
        Accuracy, the source's rank per method and layer, the erasure metrics, and each
        method's time.

    Raises
    ------
    ValueError
        Before any work: an unknown `task` (the list is given), a bad count, seed or size.
    TypeError
        A `model`, `tokenizer`, `methods` or `chat` of the wrong kind (a torch model: use
        :func:`attnflow.adapters.torch.ground_truth`).

    See Also
    --------
    attnflow.adapters.torch.ground_truth : The same on a PyTorch causal LM, with the
        methods of attnflow's registry by name.

    References
    ----------
    Ferrando et al. (2023), "Explaining How Transformers Use Context to Build Predictions",
    ACL (agreement and IOI as contrastive ground truth); Wang et al. (2023),
    "Interpretability in the Wild", ICLR (IOI).

    Examples
    --------
    A toy "model" that predicts the token after the previous occurrence of the last token,
    its tokenizer (one id per word), and a method that points at that token:

    >>> import re
    >>> import numpy as np
    >>> from attnflow.evaluate import ground_truth
    >>> vocabulary = {}
    >>> def tokenize(text):
    ...     spans = [m.span() for m in re.finditer(r" ?[^ ,.:]+|[,.:]", text)]
    ...     return [vocabulary.setdefault(text[a:b], len(vocabulary)) for a, b in spans], spans
    >>> def log_probabilities(ids):  # the word after the first occurrence of the last word
    ...     out = np.full((len(ids), 100), -10.0)
    ...     for b, row in enumerate(ids):
    ...         out[b, row[np.flatnonzero(row == row[-2])[0] + 2]] = 0.0
    ...     return out
    >>> def pointer(ids, target):
    ...     scores = np.zeros(len(ids))
    ...     scores[np.flatnonzero(ids == ids[-2])[0] + 2] = 1.0
    ...     return scores
    >>> report = ground_truth(
    ...     log_probabilities, tokenize, methods={"pointer": pointer}, n_items=3, size=6
    ... )
    >>> report.accuracy, report.hit_rate("pointer"), report.mrr("pointer")
    (1.0, 1.0, 1.0)
    >>> try:
    ...     ground_truth(log_probabilities, tokenize, task="copy", methods={"p": pointer})
    ... except ValueError as error:
    ...     print(error)
    `task` must be one of 'copying', 'retrieval', 'stated_facts', 'agreement', 'ioi'; got 'copy'.
    """
    options = task_size(task, size)
    if _is_torch_module(model):
        msg = (
            "`model` is a torch module: call attnflow.adapters.torch.ground_truth(model, "
            "tokenizer, ...), which runs it and takes the registry's methods by name."
        )
        raise TypeError(msg)
    function: object = model
    if not callable(function):
        msg = (
            "`model` must be a callable ids (B, n) -> next-token log-probabilities (B, "
            f"vocab); got {type(model).__name__}."
        )
        raise TypeError(msg)
    tokenize = _tokenize_function(tokenizer)
    chosen = _chat_function(chat, tokenizer, task)
    if chosen is not None:
        options["chat"] = chosen
    named = _methods(methods)
    count: object = n_items
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 1:
        msg = f"`n_items` must be a positive int; got {n_items!r}."
        raise ValueError(msg)
    if replacement is not None and (
        isinstance(replacement, bool) or not isinstance(replacement, int | np.integer)
    ):
        msg = f"`replacement` must be a token id (int) or None; got {replacement!r}."
        raise TypeError(msg)
    items = [
        locate_source(item, tokenize) for item in TASKS[task](int(n_items), seed=seed, **options)
    ]
    return _score(items, named, model, replacement=replacement)


def _is_torch_module(model: object) -> bool:
    """Whether `model` is a torch module (without importing torch: if it is, torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def _tokenize_function(tokenizer: object) -> Tokenize:
    if hasattr(tokenizer, "convert_ids_to_tokens") and callable(tokenizer):
        hugging_face: Any = tokenizer

        def tokenize(text: str) -> tuple[Sequence[int], Sequence[tuple[int, int]]]:
            encoded = hugging_face(text, return_offsets_mapping=True)
            return encoded["input_ids"], encoded["offset_mapping"]

        return tokenize
    if callable(tokenizer):
        function: Tokenize = tokenizer
        return function
    msg = (
        "`tokenizer` must be a Hugging Face fast tokenizer or a callable text -> (ids, "
        f"offsets); got {type(tokenizer).__name__}."
    )
    raise TypeError(msg)


def _chat_function(chat: object, tokenizer: object, task: str) -> Callable[[str], str] | None:
    if chat is not None and not isinstance(chat, bool) and not callable(chat):
        msg = (
            "`chat` must be None, True, False or a callable message -> prompt text; got "
            f"{type(chat).__name__}."
        )
        raise TypeError(msg)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is True and not has_template:
        msg = (
            "`chat=True` needs a tokenizer with a chat template (apply_chat_template); "
            "pass a callable message -> prompt text, or chat=False."
        )
        raise ValueError(msg)
    if chat not in (None, False) and task not in _CHAT_TASKS:
        msg = f"`chat` applies to the tasks {_CHAT_TASKS}; task {task!r} takes none (drop it)."
        raise ValueError(msg)
    if chat is False or task not in _CHAT_TASKS or (chat is None and not has_template):
        return None
    if callable(chat):
        function: Callable[[str], str] = chat
        return function
    template: Any = tokenizer

    def apply(message: str) -> str:
        conversation = [{"role": "user", "content": message}]
        text: str = template.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        return text

    return apply


def task_size(task: object, size: object) -> dict[str, Any]:
    """Return the generator's keyword for `size` (``{"words": 12}`` for copying by default).

    Refuses an unknown `task`, and a `size` for IOI, which has none; the generator checks
    the value.
    """
    if not isinstance(task, str) or task not in TASKS:
        listed = ", ".join(repr(name) for name in TASKS)
        msg = f"`task` must be one of {listed}; got {task!r}."
        raise ValueError(msg)
    keyword = _SIZES[task]
    if keyword is None:
        if size is not None:
            msg = f"`size` does not apply to task {task!r}; drop it."
            raise ValueError(msg)
        return {}
    return {keyword[0]: keyword[1] if size is None else size}


def _methods(methods: object) -> dict[str, Method]:
    """Labels to callables, checked."""
    if (
        not isinstance(methods, Mapping)
        or not methods
        or not all(isinstance(k, str) and callable(v) for k, v in methods.items())
    ):
        msg = (
            "`methods` must be a non-empty mapping of labels to callables (ids, target) -> "
            "scores (layers, n) or (n,); for the registry's methods by name on a torch model, "
            f"call attnflow.adapters.torch.ground_truth; got {methods!r}."
        )
        raise TypeError(msg)
    return dict(methods)


def _score(
    items: Sequence[TaskTokens],
    methods: Mapping[str, Method],
    log_probabilities: LogProbabilities,
    /,
    *,
    replacement: int | None = None,
    fractions: Sequence[float] = ERASER_FRACTIONS,
) -> GroundTruthReport:
    """Correctness, ranks and erasure metrics of `methods` over located `items`."""
    bins = tuple(fractions)
    correct = np.zeros(len(items), dtype=bool)
    ranks: dict[str, list[np.ndarray]] = {name: [] for name in methods}
    whole: dict[str, list[np.ndarray]] = {name: [] for name in methods}
    comp: dict[str, list[np.ndarray]] = {name: [] for name in methods}
    suff: dict[str, list[np.ndarray]] = {name: [] for name in methods}
    seconds = dict.fromkeys(methods, 0.0)
    for index, item in enumerate(items):
        ids = item.ids[None]
        n = ids.shape[1]
        base = _log_probabilities_of(log_probabilities, ids)[0]
        if item.foil_id is None:
            correct[index] = int(np.argmax(base)) == item.answer_id
        else:
            correct[index] = base[item.answer_id] > base[item.foil_id]
        where = competing_positions(n, context=item.context)[None]
        predict = _answer_predict(log_probabilities, item.answer_id)
        for name, method in methods.items():
            start = time.perf_counter()
            output = method(item.ids.copy(), item.answer_id)
            scores = _scores_of(name, output, n)
            seconds[name] += time.perf_counter() - start
            ranks[name].append(
                source_ranks(scores[None], [item.source], contexts=[item.context])[0]
            )
            whole[name].append(source_ranks(scores[None], [item.source])[0])
            if replacement is None:
                continue
            if not correct[index]:  # a wrong answer has no known source: not erased
                comp[name].append(np.full(len(bins), np.nan))
                suff[name].append(np.full(len(bins), np.nan))
                continue
            top = scores[-1][None]
            for kind, store in ((comprehensiveness, comp), (sufficiency, suff)):
                drop = kind(
                    predict,
                    ids,
                    top,
                    replacement=int(replacement),
                    target=0,
                    fractions=bins,
                    where=where,
                )
                store[name].append(np.asarray(drop)[0] * _FLOOR)
    for name, values in ranks.items():
        if len({r.shape for r in values}) > 1:
            msg = f"`methods[{name!r}]` returned a different number of layers across items."
            raise ValueError(msg)
    return GroundTruthReport(
        correct=correct,
        ranks={name: np.stack(values) for name, values in ranks.items()},
        comprehensiveness={k: np.stack(v) for k, v in comp.items() if v},
        sufficiency={k: np.stack(v) for k, v in suff.items() if v},
        fractions=bins,
        tasks=np.array([item.item.task for item in items]),
        prompt_ranks={name: np.stack(values) for name, values in whole.items()},
        seconds=seconds,
    )


def _scores_of(name: str, output: Any, n: int) -> np.ndarray:
    (converted,), _ = enter_boundary([output], [f"methods[{name!r}](ids, target)"])
    host = to_host(converted, name=f"methods[{name!r}](ids, target)").astype(np.float64)
    if host.ndim == 1:
        host = host[None]
    if host.ndim != 2 or host.shape[-1] != n:
        msg = (
            f"`methods[{name!r}]` must return scores of shape (layers, n) or (n,) with "
            f"n = {n} prompt tokens; got shape {host.shape}."
        )
        raise ValueError(msg)
    if np.isnan(host).any():
        msg = f"`methods[{name!r}]` returned NaN scores; a rank is undefined."
        raise ValueError(msg)
    return host


def _log_probabilities_of(log_probabilities: LogProbabilities, ids: np.ndarray) -> np.ndarray:
    output = log_probabilities(ids)
    (converted,), _ = enter_boundary([output], ["model(ids)"])
    host = to_host(converted, name="model(ids)").astype(np.float64)
    if host.ndim != 2 or host.shape[0] != ids.shape[0]:
        msg = (
            "`model(ids)` must return next-token log-probabilities of shape (B, vocab) = "
            f"({ids.shape[0]}, vocab); got shape {host.shape}."
        )
        raise ValueError(msg)
    return host


def _answer_predict(
    log_probabilities: LogProbabilities, answer_id: int
) -> Callable[[Any], np.ndarray]:
    """Two-class 'probabilities' ``(q, 1 - q)``, ``q = 1 + max(log p, -F) / F``, for erasure."""

    def predict(ids: Any) -> np.ndarray:
        values = _log_probabilities_of(log_probabilities, np.asarray(ids))[:, answer_id]
        q = 1.0 + np.maximum(values, -_FLOOR) / _FLOOR
        return np.stack([q, 1.0 - q], axis=1)

    return predict
