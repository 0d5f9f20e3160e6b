r"""Prompts whose answer has a known source token: ground truth for causal LMs.

Five task families where the prompt token that determines the next word is known by
construction (:data:`TASKS`; reached through :func:`attnflow.evaluate.ground_truth`):

- :func:`copying_task`: a list of distinct words, then the start of its repetition; the
  next word's source is its earlier occurrence ("List: apple, river, stone. Again: apple,"
  -> " river").
- :func:`retrieval_task`: key-value pairs, then one key again; the source is that key's
  value ("red: apple, blue: river, green: stone. blue:" -> " river").
- :func:`stated_facts_task`: facts about people, then a question about one of them; the
  source is that person's object ("Anna lives in Paris. Tom lives in Rome. Where does Anna
  live? Anna lives in" -> " Paris").
- :func:`agreement_task`: subject-verb agreement across attractors; the source is the
  subject noun, whose number decides the verb ("She said that the keys to the cabinet near
  the door" -> " are", not " is").
- :func:`ioi_task`: indirect-object identification; the source is the indirect object's
  only mention ("When Mary and John went to the store, John gave a drink to" -> " Mary",
  not the subject " John").

In the first four families the answer appears exactly once in its prompt, as a whole word
preceded by a space, at the source; in agreement the source is the subject noun, not the
answer. Agreement and IOI items carry a foil, the wrong answer the model must rank below
the right one. Items are plain strings with the character span of the source;
:func:`locate_source` turns an item into token ids, the answer's token id and the source's
token position using any tokenizer's ids and character offsets, checking that the answer
(and the foil) is one token. Everything here is pure Python and NumPy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "TASKS",
    "TaskItem",
    "TaskTokens",
    "agreement_task",
    "copying_task",
    "ioi_task",
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
NUMBERED_NOUNS = (
    ("key", "keys"), ("book", "books"), ("dog", "dogs"), ("car", "cars"), ("girl", "girls"),
    ("boy", "boys"), ("student", "students"), ("teacher", "teachers"), ("friend", "friends"),
    ("house", "houses"), ("door", "doors"), ("table", "tables"), ("window", "windows"),
    ("bottle", "bottles"), ("flower", "flowers"), ("tree", "trees"), ("picture", "pictures"),
    ("letter", "letters"), ("chair", "chairs"), ("bird", "birds"), ("road", "roads"),
    ("farmer", "farmers"), ("doctor", "doctors"), ("song", "songs"), ("wall", "walls"),
    ("bag", "bags"), ("room", "rooms"), ("ship", "ships"), ("lamp", "lamps"),
    ("player", "players"), ("cabinet", "cabinets"), ("river", "rivers"),
)  # fmt: skip
"""Singular and plural nouns of the agreement task, each one token with a leading space."""
PREPOSITIONS = ("to", "near", "behind", "beside", "under", "above", "by", "with", "of")
LEAD_INS = ("I think that", "She said that", "We know that", "He told me that", "They saw that")
"""What comes before the subject of an agreement item, so that the subject is not the first
candidate position: a method biased toward early positions does not find it by its place."""
IOI_TEMPLATES = (
    "When {} and {} went to the {place}, {subject} gave a {object} to",
    "After {} and {} went to the {place}, {subject} gave a {object} to",
    "While {} and {} were working at the {place}, {subject} gave a {object} to",
    "Then, {} and {} had a long day at the {place}. {subject} gave a {object} to",
    "When {} and {} got a {object} at the {place}, {subject} decided to give it to",
)
"""The IOI sentences: the two names, then the place, the subject again and the object."""
PLACES = ("store", "park", "school", "office", "station", "garden", "beach", "market")
OBJECTS = ("drink", "ball", "book", "gift", "key", "letter", "bottle", "snack", "ring")
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
        ``(start, stop)``: the characters of `prompt` that hold the source word (without
        the space): the earlier occurrence of the answer word, ``prompt[start:stop] ==
        answer.strip()``, or, where `copied` is False, the word that decides the answer
        (the subject noun of an agreement item).
    task : str
        The task family, one of :data:`TASKS`.
    context : tuple of int, optional
        ``(start, stop)``: the characters of `prompt` that hold the context (the list, the
        pairs, the facts) as opposed to the query after it; the source competes with the
        context's tokens only (:func:`locate_source`). None: the whole prompt.
    foil : str, optional
        The wrong continuation the model must rank below `answer` (``" is"`` for ``" are"``,
        the subject's name in IOI); None: the answer must be the top next token.
    copied : bool, default True
        Whether the source word is the answer itself (copying, retrieval, stated facts,
        IOI) rather than a word that decides it (agreement).

    Examples
    --------
    >>> from attnflow.evaluate._llm_tasks import TaskItem
    >>> item = TaskItem("a b c. a b", " c", (4, 5), "copying")
    >>> item.prompt[slice(*item.source)] == item.answer.strip()
    True
    """

    prompt: str
    answer: str
    source: tuple[int, int]
    task: str
    context: tuple[int, int] | None = None
    foil: str | None = None
    copied: bool = True


@dataclass(frozen=True)
class TaskTokens:
    """A :class:`TaskItem` tokenized: what an evaluation needs.

    Parameters
    ----------
    ids : ndarray of int64, shape (n,)
        The prompt's token ids, as the tokenizer returns them (special tokens included).
    answer_id : int
        The answer's token (one token), tokenized in context (``prompt + answer``).
    source : int
        The position in `ids` of the source word: for a copied answer its earlier
        occurrence, whose id is `answer_id` and no other prompt token's; otherwise the
        one token that spells the source word.
    item : TaskItem
        The item it comes from.
    context : tuple of int, optional
        ``(start, stop)``: the positions of the context's tokens, ``start <= source <
        stop``; None: the whole prompt.
    foil_id : int, optional
        The foil's token (one token, tokenized in context), None without a foil.

    Examples
    --------
    >>> import numpy as np
    >>> from attnflow.evaluate._llm_tasks import TaskItem, TaskTokens
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
    foil_id: int | None = None


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

Draft = tuple[list[Piece], str, str, str, str | None]
"""``(context pieces, request, answer start, answer, foil)`` of one item (:func:`_generate`)."""

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
    *,
    copied: bool = True,
    whole: bool = False,
) -> list[TaskItem]:
    """Draw `count` items with ``compose(rng, chatting) -> (pieces, request, start, answer, foil)``.

    The context is the pieces joined (the one marked True is the source, equal to the
    answer without its space where `copied`); with `whole`, the whole prompt competes (the
    item's context is None). The prompt is ``context + request + start``, or with a chat
    template ``chat(context + request) + start.lstrip()``: the context and the request
    (an instruction or question) make the user's message, and the assistant's answer
    begins with `start` (e.g. the asked key ``"blue:"``), whose next word is the answer.
    """
    number = _check_count("count", count, 0)
    rng = _rng(seed)
    items = []
    for _ in range(number):
        pieces, request, start, answer, foil = compose(rng, chat is not None)
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
        assert not copied or prompt[slice(*span)] == answer.strip()
        bounds = None if whole else (offset, offset + len(context))
        items.append(TaskItem(prompt, answer, span, task, bounds, foil=foil, copied=copied))
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
    retrieval_task, stated_facts_task, agreement_task, ioi_task, locate_source

    Examples
    --------
    >>> from attnflow.evaluate._llm_tasks import copying_task
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
        return pieces, "", query, " " + chosen[repeated], None

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
    >>> from attnflow.evaluate._llm_tasks import retrieval_task
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
        return pieces, request, f"{keys[asked]}:", " " + values[asked], None

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
    >>> from attnflow.evaluate._llm_tasks import stated_facts_task
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
        return pieces, request, f" {people[asked]} {relation}", " " + things[asked], None

    return _generate("stated_facts", count, seed, compose, chat)


def agreement_task(count: int, /, *, seed: int = 0, attractors: int = 2) -> list[TaskItem]:
    """Subject-verb agreement across attractors: the subject noun decides the verb's number.

    ``"She said that the keys to the cabinet near the door"`` with answer ``" are"`` and foil
    ``" is"``: a lead-in clause (:data:`LEAD_INS`, so that the subject is not the first
    candidate position), a subject noun, then `attractors` prepositional phrases whose
    nouns have the other number (the attractors, Linzen et al. 2016), so that the nearest
    noun points to the wrong verb. The source is the subject noun (it is not the answer:
    ``copied=False``); the whole prompt competes. A model answers correctly when the right form's logit is
    above the wrong one's (the contrastive setting of Ferrando et al. 2023, "Explaining
    How Transformers Use Context to Build Predictions", ACL). The noun pairs, prepositions
    and the subject's number are drawn uniformly; nouns are distinct within an item.

    Parameters
    ----------
    count : int
        Number of items (>= 0).
    seed : int, default 0
        Seed of the generator.
    attractors : int, default 2
        Number of attractor phrases, 1 to 4.

    Returns
    -------
    list of TaskItem
        `count` prompts, each with its answer (``" is"`` or ``" are"``), the other form as
        the foil, and the character span of the subject noun.

    Examples
    --------
    >>> from attnflow.evaluate._llm_tasks import agreement_task
    >>> item = agreement_task(1, seed=0, attractors=1)[0]
    >>> item.prompt, item.answer, item.foil
    ('She said that the room to the roads', ' is', ' are')
    >>> item.prompt[slice(*item.source)]
    'room'
    """
    attractors = _check_count("attractors", attractors, 1, 4)

    def compose(rng: np.random.Generator, _chatting: bool) -> Draft:
        nouns = [NUMBERED_NOUNS[i] for i in rng.choice(len(NUMBERED_NOUNS), attractors + 1, False)]
        plural = bool(rng.integers(0, 2))
        subject = nouns[0][int(plural)]
        lead = LEAD_INS[int(rng.integers(0, len(LEAD_INS)))]
        pieces: list[Piece] = [(f"{lead} the ", False), (subject, True)]
        for noun in nouns[1:]:
            preposition = PREPOSITIONS[int(rng.integers(0, len(PREPOSITIONS)))]
            pieces.append((f" {preposition} the {noun[int(not plural)]}", False))
        answer, foil = (" are", " is") if plural else (" is", " are")
        return pieces, "", "", answer, foil

    return _generate("agreement", count, seed, compose, copied=False, whole=True)


def ioi_task(count: int, /, *, seed: int = 0) -> list[TaskItem]:
    """Indirect-object identification: the name that was not repeated receives the object.

    ``"When Mary and John went to the store, John gave a drink to"`` with answer ``" Mary"``
    and foil ``" John"`` (Wang et al. 2023, "Interpretability in the Wild", ICLR). Two
    distinct names, one of the templates of :data:`IOI_TEMPLATES`, a place and an object
    are drawn; the indirect object comes first or second with equal odds; the subject is
    named again before the verb. The source is the indirect object's only mention; the
    whole prompt competes, the subject's two mentions too. A model answers correctly when
    the indirect object's logit is above the subject's.

    Parameters
    ----------
    count : int
        Number of items (>= 0).
    seed : int, default 0
        Seed of the generator.

    Returns
    -------
    list of TaskItem
        `count` prompts, each with its answer (the indirect object), the subject as the
        foil, and the character span of the indirect object's mention.

    Examples
    --------
    >>> from attnflow.evaluate._llm_tasks import ioi_task
    >>> item = ioi_task(1, seed=0)[0]
    >>> item.prompt, item.answer, item.foil
    ('When Peter and Laura got a drink at the school, Peter decided to give it to', ' Laura', ' Peter')
    >>> item.prompt[slice(*item.source)]
    'Laura'
    """

    def compose(rng: np.random.Generator, _chatting: bool) -> Draft:
        template = IOI_TEMPLATES[int(rng.integers(0, len(IOI_TEMPLATES)))]
        indirect, subject = _draw(rng, NAMES, 2)
        place = PLACES[int(rng.integers(0, len(PLACES)))]
        thing = OBJECTS[int(rng.integers(0, len(OBJECTS)))]
        first, second = (indirect, subject) if rng.integers(0, 2) else (subject, indirect)
        before, middle, after = template.split("{}")
        rest = after.format(place=place, subject=subject, object=thing)
        pieces: list[Piece] = [(before, False), (first, first == indirect), (middle, False)]
        pieces += [(second, second == indirect), (rest, False)]
        return pieces, "", "", " " + indirect, " " + subject

    return _generate("ioi", count, seed, compose, whole=True)


TASKS: dict[str, Callable[..., list[TaskItem]]] = {
    "copying": copying_task,
    "retrieval": retrieval_task,
    "stated_facts": stated_facts_task,
    "agreement": agreement_task,
    "ioi": ioi_task,
}
"""The task families by name, in table order."""


Tokenize = Callable[[str], tuple[Sequence[int], Sequence[tuple[int, int]]]]


def locate_source(item: TaskItem, tokenize: Tokenize, /) -> TaskTokens:
    """Tokenize an item and find the answer's token and its source position.

    The answer token is read in context: ``prompt + answer`` is tokenized, its first
    tokens must be the prompt's tokens, and exactly one token must follow them: the
    answer is one token (so is the foil, read the same way). The source position is the
    prompt token whose character span ``[start, stop)`` holds the first character of the
    source word (a leading-space token such as ``" apple"`` spans the space too). Both are
    checked: for a copied answer, the source token must have the answer's id and no other
    prompt token may have it, so that the source is unambiguous; otherwise the source
    token must end where the source word ends (the word is one token).

    Parameters
    ----------
    item : TaskItem
        From one of the generators of :data:`TASKS`.
    tokenize : callable
        ``tokenize(text) -> (ids, offsets)``: the token ids and each token's character
        span ``(start, stop)`` in `text`, as a Hugging Face tokenizer gives with
        ``return_offsets_mapping=True`` (special tokens get an empty span).

    Returns
    -------
    TaskTokens
        The prompt's ids, the answer's (and foil's) token id and the source position.

    Raises
    ------
    ValueError
        If the tokenization of ``prompt + answer`` (or ``prompt + foil``) does not start
        with the prompt's or adds more than one token, or the source token is not as
        described above.

    Examples
    --------
    A whitespace tokenizer whose tokens carry their leading space, as BPE vocabularies do:

    >>> import re
    >>> from attnflow.evaluate._llm_tasks import copying_task, locate_source
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
        msg = f"`item` must be a TaskItem (from a task generator); got {type(given).__name__}."
        raise TypeError(msg)
    function: object = tokenize
    if not callable(function):
        msg = f"`tokenize` must be callable: text -> (ids, offsets); got {type(function).__name__}."
        raise TypeError(msg)
    ids, offsets = _tokenized(tokenize, item.prompt)
    answer_id = _next_token(tokenize, item, ids, item.answer, "answer")
    foil_id = None if item.foil is None else _next_token(tokenize, item, ids, item.foil, "foil")
    if foil_id == answer_id:
        msg = (
            f"the answer {item.answer!r} and the foil {item.foil!r} are the same token {answer_id}."
        )
        raise ValueError(msg)
    start, stop = item.source
    source = [i for i, (a, b) in enumerate(offsets) if a <= start < b]
    word = item.prompt[start:stop]
    if item.copied:
        if len(source) != 1 or int(ids[source[0]]) != answer_id:
            msg = (
                f"the source word {word!r} of {item.prompt!r} must be one token equal to "
                f"the answer's token (id {answer_id}); the tokens at character {start} are "
                f"{[int(ids[i]) for i in source]}."
            )
            raise ValueError(msg)
        occurrences = int(np.count_nonzero(np.asarray(ids) == answer_id))
        if occurrences != 1:
            msg = (
                f"the answer's token (id {answer_id}) occurs {occurrences} times in "
                f"{item.prompt!r}: the source is ambiguous."
            )
            raise ValueError(msg)
    elif len(source) != 1 or offsets[source[0]][1] != stop:
        msg = (
            f"the source word {word!r} of {item.prompt!r} must be one token; the tokens "
            f"at character {start} span {[offsets[i] for i in source]}, the word ends at {stop}."
        )
        raise ValueError(msg)
    return TaskTokens(
        ids=np.asarray(ids, dtype=np.int64),
        answer_id=answer_id,
        source=source[0],
        item=item,
        context=_context_tokens(item, offsets, source[0]),
        foil_id=foil_id,
    )


def _next_token(tokenize: Tokenize, item: TaskItem, ids: list[int], text: str, name: str) -> int:
    """Return the one token that `text` adds after the prompt's tokens, checked."""
    full_ids, _ = _tokenized(tokenize, item.prompt + text)
    n = len(ids)
    if list(full_ids[:n]) != list(ids):
        msg = (
            f"the tokens of prompt + {name} must start with the prompt's tokens, so that the "
            f"{name} is the next token; they do not for {item.prompt!r} + {text!r}. Use a "
            "tokenizer that splits at the space before a word."
        )
        raise ValueError(msg)
    if len(full_ids) != n + 1:
        msg = (
            f"the {name} {text!r} must be one token after {item.prompt!r}; the tokenizer "
            f"gives {len(full_ids) - n}. Use words that are one token in this vocabulary."
        )
        raise ValueError(msg)
    return int(full_ids[n])


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
