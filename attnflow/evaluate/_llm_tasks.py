r"""Prompts whose answer has a known source token: ground truth for causal LMs.

Three task families where the prompt token that determines the next word is known by
construction (issue 21, item 7):

- :func:`copying_task`: a list of distinct words, then the start of its repetition; the
  next word's source is its earlier occurrence ("List: apple, river, stone. Again: apple,"
  -> " river").
- :func:`retrieval_task`: key-value pairs, then one key again; the source is that key's
  value ("red: apple, blue: river, green: stone. blue:" -> " river").
- :func:`stated_facts_task`: facts about people, then a question about one of them; the
  source is that person's object ("Anna lives in Paris. Tom lives in Rome. Where does Anna
  live? Anna lives in" -> " Paris").

Every answer appears exactly once in its prompt, as a whole word preceded by a space.
Items are plain strings with the character span of the source; :func:`locate_source`
turns an item into token ids, the answer's first token id and the source's token position
using any tokenizer's ids and character offsets. Everything here is pure Python and NumPy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "TaskItem",
    "TaskTokens",
    "copying_task",
    "locate_source",
    "retrieval_task",
    "stated_facts_task",
]

# Common English words, each one token with a leading space for GPT-2-style BPE
# vocabularies such as SmolLM2's (checked in tests/llm/test_llm_ground_truth.py).
NOUNS = (
    "apple", "river", "stone", "cloud", "horse", "bread", "chair", "table", "window",
    "garden", "paper", "music", "water", "money", "light", "night", "house", "phone",
    "street", "glass", "sugar", "train", "plant", "shirt", "mouse", "heart", "beach",
    "bottle", "forest", "island", "letter", "market", "pencil", "rabbit", "school",
    "silver", "summer", "winter", "doctor", "camera", "coffee", "dinner", "engine",
    "flower", "guitar", "hammer", "jacket", "kitchen", "ladder", "mirror",
)  # fmt: skip
KEYS = (
    "red", "blue", "green", "black", "white", "brown", "pink", "gold", "north",
    "south", "east", "west", "left", "right", "first", "last",
)  # fmt: skip
NAMES = (
    "Anna", "Tom", "Maria", "John", "Sarah", "David", "Emma", "James", "Laura", "Peter",
    "Lucy", "Mark", "Alice", "Paul", "Kate", "Sam",
)  # fmt: skip
CITIES = (
    "Paris", "Rome", "London", "Berlin", "Madrid", "Tokyo", "Boston", "Vienna", "Dublin",
    "Chicago", "Moscow", "Sydney", "Toronto", "Denver", "Seattle", "Cairo",
)  # fmt: skip
JOBS = (
    "doctor", "teacher", "lawyer", "farmer", "pilot", "writer", "nurse", "singer",
    "painter", "baker", "driver", "judge", "chef", "dancer",
)  # fmt: skip
ANIMALS = (
    "dog", "cat", "horse", "rabbit", "snake", "parrot", "tiger", "mouse", "goat", "duck",
    "sheep", "fish", "turtle", "pig",
)  # fmt: skip
RETRIEVAL_INSTRUCTION = "Complete the line of the key I ask for."
"""The request after the pairs in a chat prompt (:func:`retrieval_task` with `chat`)."""
RELATIONS = (
    ("lives in", CITIES, "Where does {} live?"),
    ("works as a", JOBS, "What is {}'s job?"),
    ("has a pet", ANIMALS, "What pet does {} have?"),
)


@dataclass(frozen=True)
class TaskItem:
    """One prompt whose next word is known, with the character span of its source.

    Parameters
    ----------
    prompt : str
        The text given to the model.
    answer : str
        The correct continuation, with its leading space (e.g. ``" river"``).
    source : tuple of int
        ``(start, stop)``: the characters of `prompt` that hold the earlier occurrence of
        the answer word (without the space), ``prompt[start:stop] == answer.strip()``.
    task : str
        The task family: ``"copying"``, ``"retrieval"`` or ``"stated_facts"``.
    context : tuple of int, optional
        ``(start, stop)``: the characters of `prompt` that hold the context (the list, the
        pairs, the facts) as opposed to the query after it; the source competes with the
        context's tokens only (:func:`locate_source`). None: the whole prompt.

    Examples
    --------
    >>> from attnflow.evaluate import TaskItem
    >>> item = TaskItem("a b c. a b", " c", (4, 5), "copying")
    >>> item.prompt[slice(*item.source)] == item.answer.strip()
    True
    """

    prompt: str
    answer: str
    source: tuple[int, int]
    task: str
    context: tuple[int, int] | None = None


@dataclass(frozen=True)
class TaskTokens:
    """A :class:`TaskItem` tokenized: what an evaluation needs.

    Parameters
    ----------
    ids : ndarray of int64, shape (n,)
        The prompt's token ids, as the tokenizer returns them (special tokens included).
    answer_id : int
        The first token of the answer, tokenized in context (``prompt + answer``).
    source : int
        The position in `ids` of the answer's earlier occurrence: the token whose
        character span holds the first character of the source word; its id is
        `answer_id`, and no other prompt token has that id.
    item : TaskItem
        The item it comes from.
    context : tuple of int, optional
        ``(start, stop)``: the positions of the context's tokens, ``start <= source <
        stop``; None: the whole prompt.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate import TaskItem, TaskTokens
    >>> item = TaskItem("a b c. a b", " c", (4, 5), "copying")
    >>> tokens = TaskTokens(np.array([1, 2, 3, 4, 1, 2]), 3, 2, item)
    >>> int(tokens.ids[tokens.source]) == tokens.answer_id
    True
    """

    ids: np.ndarray
    answer_id: int
    source: int
    item: TaskItem
    context: tuple[int, int] | None = None


def _check_count(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        msg = f"`{name}` must be an int; got {type(value).__name__} {value!r}."
        raise TypeError(msg)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        msg = f"`{name}` must be {bound}; got {value}."
        raise ValueError(msg)
    return int(value)


def _rng(seed: object) -> np.random.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        msg = f"`seed` must be a non-negative int (items are deterministic per seed); got {seed!r}."
        raise TypeError(msg) if not isinstance(seed, int | np.integer) else ValueError(msg)
    return np.random.default_rng(int(seed))


Piece = tuple[str, bool]
"""A piece of context text, and whether it is the source word."""

Draft = tuple[list[Piece], str, str, str]
"""``(context pieces, request, answer start, answer)`` of one item (see :func:`_generate`)."""

Chat = Callable[[str], str]


def _check_chat(chat: object) -> Chat | None:
    if chat is not None and not callable(chat):
        msg = (
            "`chat` must be None or a callable user message -> prompt text (the chat "
            "template with the assistant's turn opened, e.g. tokenizer.apply_chat_template"
            f"(..., tokenize=False, add_generation_prompt=True)); got {type(chat).__name__}."
        )
        raise TypeError(msg)
    return chat


def _generate(
    task: str,
    count: object,
    seed: object,
    compose: Callable[[np.random.Generator, bool], Draft],
    chat: Chat | None = None,
) -> list[TaskItem]:
    """Draw `count` items with ``compose(rng, chatting) -> (pieces, request, start, answer)``.

    The context is the pieces joined (the one marked True is the source, equal to the
    answer without its space). The prompt is ``context + request + start``, or with a chat
    template ``chat(context + request) + start.lstrip()``: the context and the request
    (an instruction or question) make the user's message, and the assistant's answer
    begins with `start` (e.g. the asked key ``"blue:"``), whose next word is the answer.
    """
    number = _check_count("count", count, 0)
    rng = _rng(seed)
    items = []
    for _ in range(number):
        pieces, request, start, answer = compose(rng, chat is not None)
        context = "".join(text for text, _ in pieces)
        marked = [i for i, (_, is_source) in enumerate(pieces) if is_source]
        assert len(marked) == 1
        first = sum(len(text) for text, _ in pieces[: marked[0]])
        if chat is None:
            prompt, offset = context + request + start, 0
        else:
            message = context + request
            wrapped: object = chat(message)
            if not isinstance(wrapped, str) or wrapped.count(message) != 1:
                msg = (
                    "`chat(message)` must return the prompt text holding the message exactly "
                    f"once; got {wrapped!r} for {message!r}."
                )
                raise ValueError(msg)
            offset = wrapped.index(message)
            prompt = wrapped + start.lstrip()
        span = (offset + first, offset + first + len(pieces[marked[0]][0]))
        assert prompt[slice(*span)] == answer.strip()
        items.append(TaskItem(prompt, answer, span, task, context=(offset, offset + len(context))))
    return items


def _draw(rng: np.random.Generator, pool: Sequence[str], size: int) -> list[str]:
    """`size` distinct entries of `pool`, in random order."""
    return [pool[i] for i in rng.choice(len(pool), size=size, replace=False)]


def copying_task(count: int, /, *, seed: int = 0, words: int = 12) -> list[TaskItem]:
    """In-context copying: a list of words, then the start of its repetition.

    ``"List: w1, w2, ..., wm. Again: w1, ..., wk,"`` with answer ``" w(k+1)"``, whose
    source is the word ``w(k+1)`` of the first list. The `words` distinct words are drawn
    from a fixed list of common nouns; ``k`` is uniform in ``2 .. words - 2``.

    Parameters
    ----------
    count : int
        Number of items (>= 0).
    seed : int, default 0
        Seed of the generator: the same seed gives the same items.
    words : int, default 12
        Length of the list, 4 to 50.

    Returns
    -------
    list of TaskItem
        `count` prompts, each with its answer and the character span of its source.

    See Also
    --------
    retrieval_task, stated_facts_task, locate_source

    Examples
    --------
    >>> from attnflow.evaluate import copying_task
    >>> item = copying_task(1, seed=0, words=4)[0]
    >>> item.prompt, item.answer
    ('List: money, heart, camera, letter. Again: money, heart,', ' camera')
    >>> item.prompt[slice(*item.source)]
    'camera'
    """
    words = _check_count("words", words, 4, len(NOUNS))

    def compose(rng: np.random.Generator, _chatting: bool) -> Draft:
        chosen = _draw(rng, NOUNS, words)
        repeated = int(rng.integers(2, words - 1))
        pieces: list[Piece] = [("List:", False)]
        for i, word in enumerate(chosen):
            pieces += [(" ", False), (word, i == repeated), ("," if i < words - 1 else ".", False)]
        query = " Again:" + "".join(f" {word}," for word in chosen[:repeated])
        return pieces, "", query, " " + chosen[repeated]

    return _generate("copying", count, seed, compose)


def retrieval_task(
    count: int, /, *, seed: int = 0, pairs: int = 5, chat: Chat | None = None
) -> list[TaskItem]:
    r"""Key-value retrieval: lines ``key: value``, then one key again.

    ``"red: apple\nblue: river\n...\ngold: stone\nblue:"`` with answer ``" river"``,
    whose source is the value of that key in the list. Keys (colours, directions) and
    values (nouns) are distinct within an item; the queried pair is uniform among the
    pairs. The context (:attr:`TaskItem.context`) is the lines; the asked key after them
    is the query.

    With `chat`, the lines and the request ``"Complete the line of the key I ask for."``
    are the user's message in the model's chat template, and the assistant's turn starts
    with ``"blue:"``. SmolLM2-135M-Instruct answers 0.80 of 5-pair items this way, against
    0.23 as plain text (40 items; every format tried is listed in docs/evaluation.md).

    Parameters
    ----------
    count : int
        Number of items (>= 0).
    seed : int, default 0
        Seed of the generator.
    pairs : int, default 5
        Number of key-value pairs, 2 to 16.
    chat : callable, optional
        ``chat(message) -> text``: the chat template applied to one user message, with the
        assistant's turn opened, e.g. ``lambda m: tokenizer.apply_chat_template([{"role":
        "user", "content": m}], tokenize=False, add_generation_prompt=True)``. The result
        must hold the message once. None: plain text.

    Returns
    -------
    list of TaskItem
        `count` prompts, each with its answer and the character spans of its source and
        context.

    Examples
    --------
    >>> from attnflow.evaluate import retrieval_task
    >>> item = retrieval_task(1, seed=0, pairs=3)[0]
    >>> item.prompt, item.answer
    ('south: apple\nnorth: cloud\nwest: river\nnorth:', ' cloud')
    >>> chat = lambda message: f"<user>{message}</user><assistant>"
    >>> retrieval_task(1, seed=0, pairs=3, chat=chat)[0].prompt
    '<user>south: apple\nnorth: cloud\nwest: river\nComplete the line of the key I ask for.</user><assistant>north:'
    """
    pairs = _check_count("pairs", pairs, 2, len(KEYS))
    chat = _check_chat(chat)

    def compose(rng: np.random.Generator, chatting: bool) -> Draft:
        keys, values = _draw(rng, KEYS, pairs), _draw(rng, NOUNS, pairs)
        asked = int(rng.integers(0, pairs))
        pieces: list[Piece] = []
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            pieces += [(("" if i == 0 else "\n") + f"{key}: ", False), (value, i == asked)]
        request = "\n" + RETRIEVAL_INSTRUCTION if chatting else "\n"
        return pieces, request, f"{keys[asked]}:", " " + values[asked]

    return _generate("retrieval", count, seed, compose, chat)


def stated_facts_task(
    count: int, /, *, seed: int = 0, facts: int = 3, chat: Chat | None = None
) -> list[TaskItem]:
    """Generate facts stated in the prompt, then a question about one of them.

    ``"Anna lives in Paris. Tom lives in Rome. Where does Anna live? Anna lives in"`` with
    answer ``" Paris"``. Each item uses one relation (``lives in`` a city, ``works as a``
    job, ``has a pet`` animal), `facts` distinct people with distinct objects, and asks
    about one of them; the answer's source is that person's object in the prompt. The
    context (:attr:`TaskItem.context`) is the facts; the question and the answer's start
    are the query. (The question before the answer helps small models: SmolLM2-135M
    answers the bare ``"... Anna lives in"`` form with a frequent city.)

    Parameters
    ----------
    count : int
        Number of items (>= 0).
    seed : int, default 0
        Seed of the generator.
    facts : int, default 3
        Number of stated facts, 2 to 14.
    chat : callable, optional
        As in :func:`retrieval_task`: the facts and the question are the user's message,
        and the assistant's turn starts with ``"Anna lives in"``. None: plain text.

    Returns
    -------
    list of TaskItem
        `count` prompts, each with its answer and the character span of its source.

    Examples
    --------
    >>> from attnflow.evaluate import stated_facts_task
    >>> item = stated_facts_task(1, seed=1, facts=2)[0]
    >>> item.prompt, item.answer
    ("James works as a doctor. Alice works as a lawyer. What is Alice's job? Alice works as a", ' lawyer')
    """
    facts = _check_count("facts", facts, 2, min(len(NAMES), *(len(r[1]) for r in RELATIONS)))
    chat = _check_chat(chat)

    def compose(rng: np.random.Generator, _chatting: bool) -> Draft:
        relation, objects, question = RELATIONS[int(rng.integers(0, len(RELATIONS)))]
        people, things = _draw(rng, NAMES, facts), _draw(rng, objects, facts)
        asked = int(rng.integers(0, facts))
        pieces: list[Piece] = []
        for i, (person, thing) in enumerate(zip(people, things, strict=True)):
            pieces += [(("" if i == 0 else " ") + f"{person} {relation} ", False)]
            pieces += [(thing, i == asked), (".", False)]
        request = " " + question.format(people[asked])
        return pieces, request, f" {people[asked]} {relation}", " " + things[asked]

    return _generate("stated_facts", count, seed, compose, chat)


Tokenize = Callable[[str], tuple[Sequence[int], Sequence[tuple[int, int]]]]


def locate_source(item: TaskItem, tokenize: Tokenize, /) -> TaskTokens:
    """Tokenize an item and find the answer's first token and its source position.

    The answer token is read in context: ``prompt + answer`` is tokenized, its first
    tokens must be the prompt's tokens, and the next one is the answer's first token. The
    source position is the prompt token whose character span ``[start, stop)`` holds the
    first character of the source word (a leading-space token such as ``" apple"``
    spans the space too). Both are checked: the source token must have the answer's id,
    and no other prompt token may have it, so that the source is unambiguous.

    Parameters
    ----------
    item : TaskItem
        From :func:`copying_task`, :func:`retrieval_task` or :func:`stated_facts_task`.
    tokenize : callable
        ``tokenize(text) -> (ids, offsets)``: the token ids and each token's character
        span ``(start, stop)`` in `text`, as a Hugging Face tokenizer gives with
        ``return_offsets_mapping=True`` (special tokens get an empty span).

    Returns
    -------
    TaskTokens
        The prompt's ids, the answer's first token id and the source position.

    Raises
    ------
    ValueError
        If the tokenization of ``prompt + answer`` does not start with the prompt's, or
        the source token is not the answer's first token, or that token occurs more than
        once in the prompt.

    Examples
    --------
    A whitespace tokenizer whose tokens carry their leading space, as BPE vocabularies do:

    >>> import re
    >>> from attnflow.evaluate import copying_task, locate_source
    >>> vocabulary = {}
    >>> def tokenize(text):
    ...     spans = [m.span() for m in re.finditer(r" ?[^ ,.:]+|[,.:]", text)]
    ...     ids = [vocabulary.setdefault(text[a:b], len(vocabulary)) for a, b in spans]
    ...     return ids, spans
    >>> located = locate_source(copying_task(1, seed=0, words=4)[0], tokenize)
    >>> located.source, located.answer_id == int(located.ids[located.source])
    (6, True)
    """
    given: object = item
    if not isinstance(given, TaskItem):
        msg = f"`item` must be a TaskItem (from copying_task & co.); got {type(given).__name__}."
        raise TypeError(msg)
    function: object = tokenize
    if not callable(function):
        msg = f"`tokenize` must be callable: text -> (ids, offsets); got {type(function).__name__}."
        raise TypeError(msg)
    ids, offsets = _tokenized(tokenize, item.prompt)
    full_ids, _ = _tokenized(tokenize, item.prompt + item.answer)
    n = len(ids)
    if len(full_ids) <= n or list(full_ids[:n]) != list(ids):
        msg = (
            f"the tokens of prompt + answer must start with the prompt's tokens, so that the "
            f"answer's first token is the next token; they do not for {item.prompt!r} + "
            f"{item.answer!r}. Use a tokenizer that splits at the space before a word."
        )
        raise ValueError(msg)
    answer_id = int(full_ids[n])
    start = item.source[0]
    source = [i for i, (a, b) in enumerate(offsets) if a <= start < b]
    if len(source) != 1 or int(ids[source[0]]) != answer_id:
        msg = (
            f"the source word {item.prompt[slice(*item.source)]!r} of {item.prompt!r} must be "
            f"one token equal to the answer's first token (id {answer_id}); the tokens at "
            f"character {start} are {[int(ids[i]) for i in source]}."
        )
        raise ValueError(msg)
    occurrences = int(np.count_nonzero(np.asarray(ids) == answer_id))
    if occurrences != 1:
        msg = (
            f"the answer's first token (id {answer_id}) occurs {occurrences} times in "
            f"{item.prompt!r}: the source is ambiguous."
        )
        raise ValueError(msg)
    return TaskTokens(
        ids=np.asarray(ids, dtype=np.int64),
        answer_id=answer_id,
        source=source[0],
        item=item,
        context=_context_tokens(item, offsets, source[0]),
    )


def _context_tokens(
    item: TaskItem, offsets: list[tuple[int, int]], source: int
) -> tuple[int, int] | None:
    """Return the positions ``[start, stop)`` of the tokens that start inside the context."""
    if item.context is None:
        return None
    first, last = item.context
    inside = [i for i, (a, b) in enumerate(offsets) if b > a and first <= a < last]
    if not inside or not inside[0] <= source <= inside[-1]:
        msg = (
            f"the context {item.context} of {item.prompt!r} must hold the source token; its "
            f"tokens are {inside}, the source is at {source}."
        )
        raise ValueError(msg)
    return inside[0], inside[-1] + 1


def _tokenized(tokenize: Tokenize, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    result: Any = tokenize(text)
    try:
        ids, offsets = result
        ids = [int(i) for i in ids]
        offsets = [(int(a), int(b)) for a, b in offsets]
    except (TypeError, ValueError):
        msg = (
            "`tokenize(text)` must return (ids, offsets): a sequence of token ids and one "
            f"(start, stop) character span per token; got {type(result).__name__}."
        )
        raise TypeError(msg) from None
    if len(ids) != len(offsets):
        msg = f"`tokenize(text)` returned {len(ids)} ids but {len(offsets)} offsets."
        raise ValueError(msg)
    return ids, offsets
