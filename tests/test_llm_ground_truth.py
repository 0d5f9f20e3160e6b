"""Ground truth for causal LMs: task generators, source location, ranks, the API (no model)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from attnflow.evaluate import GROUND_TRUTH_TASKS, GroundTruthReport, ground_truth
from attnflow.evaluate._llm_ground_truth import _score
from attnflow.evaluate._llm_ranks import competing_positions, source_ranks
from attnflow.evaluate._llm_tasks import (
    TaskItem,
    TaskTokens,
    agreement_task,
    copying_task,
    ioi_task,
    locate_source,
    retrieval_task,
    stated_facts_task,
)

GENERATORS = [copying_task, retrieval_task, stated_facts_task]
"""The tasks whose answer is copied from the context (a query follows the context)."""


def word_tokenizer(space_in_token: bool = True):
    """Words with their leading space (BPE style), punctuation alone; one id per string."""
    vocabulary: dict[str, int] = {}
    pattern = r" ?[^ ,.:?\n]+|[,.:?\n]" if space_in_token else r"[^ ,.:?\n]+|[,.:?\n]"

    def tokenize(text: str):
        spans = [m.span() for m in re.finditer(pattern, text)]
        ids = [vocabulary.setdefault(text[a:b].strip(), len(vocabulary)) for a, b in spans]
        return ids, spans

    return tokenize


@pytest.mark.parametrize("generate", GENERATORS)
def test_items_are_deterministic_and_the_source_is_the_only_occurrence(generate):
    items = generate(12, seed=3)
    assert items == generate(12, seed=3)
    assert items != generate(12, seed=4)
    for item in items:
        word = item.answer.strip()
        assert item.answer == " " + word
        assert item.prompt[slice(*item.source)] == word
        # The answer is a whole word of the prompt exactly once: at the source.
        starts = [m.start() for m in re.finditer(rf"(?<![A-Za-z]){word}(?![A-Za-z])", item.prompt)]
        assert starts == [item.source[0]]
        assert item.prompt[item.source[0] - 1] == " "


@pytest.mark.parametrize("generate", GENERATORS)
def test_the_context_holds_the_source_and_the_query_follows_it(generate):
    for item in generate(12, seed=5):
        start, stop = item.context
        assert start == 0
        assert start <= item.source[0] < item.source[1] <= stop < len(item.prompt)
        # The query names what to retrieve but never holds the answer word.
        assert item.answer.strip() not in re.findall(r"\w+", item.prompt[stop:])
        located = locate_source(item, word_tokenizer())
        first, last = located.context
        assert first == 0
        assert first < located.source < last < len(located.ids)
        _, spans = word_tokenizer()(item.prompt)
        assert [a < stop for a, _ in spans] == [i < last for i in range(len(spans))]


def test_copying_repeats_the_list_up_to_the_answer():
    for item in copying_task(20, seed=0, words=6):
        listed, again = item.prompt.removeprefix("List: ").split(". Again: ")
        words = listed.split(", ")
        repeated = again.rstrip(",").split(", ")
        assert len(words) == 6
        assert words[: len(repeated)] == repeated
        assert words[len(repeated)] == item.answer.strip()


def test_retrieval_asks_for_a_stated_key():
    for item in retrieval_task(20, seed=0, pairs=5):
        *pairs, key = item.prompt.split("\n")
        table = dict(pair.split(": ") for pair in pairs)
        assert len(table) == 5
        assert table[key.removesuffix(":")] == item.answer.strip()
        assert item.prompt[slice(*item.context)] == "\n".join(pairs)


def chat_template(message: str) -> str:
    return f"<|user|>\n{message}<|end|>\n<|assistant|>\n"


@pytest.mark.parametrize("generate", [retrieval_task, stated_facts_task])
def test_chat_prompts_wrap_the_context_and_request_as_the_user_message(generate):
    plain = generate(8, seed=2)
    chatted = generate(8, seed=2, chat=chat_template)
    for before, after in zip(plain, chatted, strict=True):
        assert after.answer == before.answer
        context = before.prompt[slice(*before.context)]
        assert after.prompt.startswith("<|user|>\n" + context)
        assert after.prompt[slice(*after.context)] == context
        assert after.prompt[slice(*after.source)] == after.answer.strip()
        # The assistant's turn starts with the query's last line, without its space.
        start = before.prompt.rsplit("\n" if generate is retrieval_task else "?", 1)[1]
        assert after.prompt.endswith("<|assistant|>\n" + start.lstrip())
    with pytest.raises(TypeError, match="`chat`"):
        generate(1, chat="template")
    with pytest.raises(ValueError, match="exactly once"):
        generate(1, chat=lambda message: "no message")


def test_stated_facts_ask_about_a_stated_person():
    for item in stated_facts_task(20, seed=0, facts=4):
        person = item.prompt.rsplit("? ", 1)[1].split(" ")[0]
        fact = re.search(rf"{person} (lives in|works as a|has a pet) (\w+)\.", item.prompt)
        assert fact is not None
        assert fact.group(2) == item.answer.strip()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: copying_task(-1), ValueError),
        (lambda: copying_task(2.0), TypeError),
        (lambda: copying_task(1, words=3), ValueError),
        (lambda: retrieval_task(1, pairs=17), ValueError),
        (lambda: stated_facts_task(1, facts=1), ValueError),
        (lambda: stated_facts_task(1, seed=-1), ValueError),
    ],
)
def test_bad_arguments_are_refused(call, error):
    with pytest.raises(error):
        call()


@pytest.mark.parametrize("space_in_token", [True, False])
@pytest.mark.parametrize("generate", GENERATORS)
def test_locate_source_finds_the_answer_token(generate, space_in_token):
    tokenize = word_tokenizer(space_in_token)
    for item in generate(10, seed=1):
        located = locate_source(item, tokenize)
        ids, spans = tokenize(item.prompt)
        assert located.ids.tolist() == ids
        a, b = spans[located.source]
        assert item.prompt[a:b].strip() == item.answer.strip()
        assert located.answer_id == tokenize(item.prompt + item.answer)[0][len(ids)]
        assert 0 < located.source < len(ids) - 1


def test_locate_source_refuses_an_ambiguous_or_misaligned_source():
    tokenize = word_tokenizer()
    twice = TaskItem("List: a, b, a, b. Again: a,", " b", (9, 10), "copying")
    with pytest.raises(ValueError, match="occurs 2 times"):
        locate_source(twice, tokenize)
    wrong = TaskItem("List: a, b, c. Again: a,", " b", (6, 7), "copying")  # points at "a"
    with pytest.raises(ValueError, match="source word 'a'"):
        locate_source(wrong, tokenize)

    def merging(text: str):  # merges across the prompt/answer boundary
        ids, spans = tokenize(text)
        return (
            ([*ids[:-2], 99], [*spans[:-2], (spans[-2][0], spans[-1][1])])
            if len(ids) > 9
            else (ids, spans)
        )

    with pytest.raises(ValueError, match="must start with the prompt's tokens"):
        locate_source(copying_task(1, words=4)[0], merging)
    with pytest.raises(TypeError, match="tokenize"):
        locate_source(copying_task(1)[0], lambda text: 3)


def oracle_rank(scores: np.ndarray, source: int) -> int:
    """Position of the source in a sort of the competitors, ties against the source."""
    n = scores.shape[0]
    competitors = list(range(1, n - 1))
    order = sorted(competitors, key=lambda j: (-scores[j], j != source))
    return (
        1
        + sum(1 for j in order[: order.index(source)] if True)
        + sum(1 for j in order[order.index(source) + 1 :] if scores[j] == scores[source])
    )


def test_source_ranks_match_an_oracle_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, size=(50, 3, 9)).astype(np.float64)  # many ties
    sources = rng.integers(1, 8, size=50)
    ranks = source_ranks(scores, sources)
    assert ranks.shape == (50, 3)
    for b in range(50):
        for k in range(3):
            assert ranks[b, k] == oracle_rank(scores[b, k], int(sources[b]))
    # A constant score never ranks the source first; the first and last never compete.
    assert source_ranks(np.ones((1, 6)), [2])[0] == 4
    assert source_ranks(np.array([[9.0, 0.1, 0.5, 0.2, 9.0]]), [2])[0] == 1


def test_source_ranks_refuse_bad_sources():
    with pytest.raises(ValueError, match="competing positions"):
        source_ranks(np.ones((1, 5)), [0])
    with pytest.raises(ValueError, match="competing positions"):
        source_ranks(np.ones((1, 5)), [4])
    with pytest.raises(ValueError, match="one int position per item"):
        source_ranks(np.ones((2, 5)), [1])
    with pytest.raises(ValueError, match="NaN"):
        source_ranks(np.full((1, 5), np.nan), [1])


def test_competing_positions():
    assert competing_positions(4).tolist() == [False, True, True, False]
    assert competing_positions(5, explained=2).tolist() == [False, True, False, True, True]
    assert competing_positions(6, context=(0, 3)).tolist() == [False, True, True] + [False] * 3
    assert competing_positions(6, context=(2, 6)).tolist() == [
        False,
        False,
        True,
        True,
        True,
        False,
    ]
    with pytest.raises(ValueError, match="an int >= 3"):
        competing_positions(2)
    with pytest.raises(ValueError, match="start < stop"):
        competing_positions(6, context=(3, 3))
    with pytest.raises(TypeError, match="`context`"):
        competing_positions(6, context=(0.0, 3))


def test_source_ranks_within_a_context_match_an_oracle():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 4, size=(40, 2, 10)).astype(np.float64)
    stops = rng.integers(4, 10, size=40)
    sources = np.array([rng.integers(1, stop - 1) for stop in stops])
    contexts = [(0, int(stop)) for stop in stops]
    ranks = source_ranks(scores, sources, contexts=contexts)
    for b in range(40):
        s, stop = int(sources[b]), int(stops[b])
        for k in range(2):
            inside = [j for j in range(1, min(stop, 9)) if j != s]
            assert ranks[b, k] == 1 + sum(scores[b, k, j] >= scores[b, k, s] for j in inside)
    # Without contexts every position but the first and last competes.
    assert (source_ranks(scores, sources) >= ranks).all()
    with pytest.raises(ValueError, match="competing positions"):
        source_ranks(np.ones((1, 6)), [4], contexts=[(0, 3)])
    with pytest.raises(ValueError, match="one \\(start, stop\\)"):
        source_ranks(np.ones((2, 6)), [1, 2], contexts=[(0, 3)])


def induction_log_probabilities(ids: np.ndarray) -> np.ndarray:
    """A toy LM: predicts the token after the last earlier occurrence of the last token."""
    out = np.full((len(ids), 12), np.log(0.01 / 11))
    for b, row in enumerate(np.asarray(ids)):
        earlier = np.flatnonzero(row[:-1] == row[-1])
        out[b, row[earlier[-1] + 1] if earlier.size else 0] = np.log(0.99)
    return out


def test_ground_truth_end_to_end_on_a_toy_model():
    item = TaskItem("x", " y", (0, 1), "copying")  # text unused by ground_truth
    tokens = [
        TaskTokens(np.array([11, 1, 2, 3, 4, 1, 2]), 3, 3, item),  # correct
        TaskTokens(np.array([11, 5, 6, 7, 5, 6]), 8, 3, item),  # wrong: predicts 7
    ]

    def pointer(ids: np.ndarray, target: int) -> np.ndarray:
        scores = np.linspace(0.1, 0.2, len(ids))
        scores[np.flatnonzero(ids[:-1] == ids[-1])[-1] + 1] = 1.0
        return np.stack([np.linspace(0.2, 0.1, len(ids)), scores])  # two "layers"

    def first(ids: np.ndarray, target: int) -> np.ndarray:
        return np.linspace(1.0, 0.0, len(ids))

    report = _score(
        tokens, {"pointer": pointer, "first": first}, induction_log_probabilities, replacement=0
    )
    assert report.correct.tolist() == [True, False]
    assert report.accuracy == 0.5
    assert report.ranks["pointer"].tolist() == [[3, 1], [3, 1]]
    assert report.hit_rate("pointer") == 1.0
    assert report.hit_rate("pointer", layer=0) == 0.0
    assert report.mean_rank("first") == 3.0  # positions 1, 2 outrank the source 3
    assert report.best_layer("pointer") == 1
    # Comprehensiveness at 1 % removes the top competing token: the source, by hand.
    removed = tokens[0].ids.copy()
    removed[3] = 0
    drop = (
        induction_log_probabilities(tokens[0].ids[None])[0, 3]
        - (induction_log_probabilities(removed[None])[0, 3])
    )
    np.testing.assert_allclose(report.comprehensiveness["pointer"][0, 0], drop, rtol=1e-9)
    # Sufficiency at 50 % of 5 competitors keeps the top 3 of the top layer (the source 3,
    # then 5 and 4) and replaces 1 and 2, which the toy model needs.
    kept = tokens[0].ids.copy()
    kept[[1, 2]] = 0
    drop = (
        induction_log_probabilities(tokens[0].ids[None])[0, 3]
        - (induction_log_probabilities(kept[None])[0, 3])
    )
    assert drop > 1
    np.testing.assert_allclose(report.sufficiency["pointer"][0, -1], drop, rtol=1e-9)
    assert report.mrr("pointer") == 1.0
    assert report.mrr("first") == 1 / 3
    assert "| pointer | 1.00 | 1.00 | 1.0 | 1: 1.00 (1.0) | 1.00 (1.0) |" in report.to_markdown()


def test_ground_truth_ranks_within_the_context_and_over_the_whole_prompt():
    item = TaskItem("x", " y", (0, 1), "copying")
    # Context: positions 0-3; the query 4-5 holds the highest-scoring competitor, 4.
    tokens = [TaskTokens(np.array([11, 1, 2, 3, 1, 2]), 3, 3, item, context=(0, 4))]

    def query_first(ids: np.ndarray, target: int) -> np.ndarray:
        return np.array([0.0, 0.1, 0.2, 0.5, 0.9, 0.0])

    report = _score(tokens, {"m": query_first}, induction_log_probabilities, replacement=0)
    assert report.ranks["m"].tolist() == [[1]]
    assert report.prompt_ranks["m"].tolist() == [[2]]
    assert report.hit_rate("m") == 1.0
    assert report.hit_rate("m", scope="prompt") == 0.0
    assert report.mean_rank("m", scope="prompt") == 2.0
    with pytest.raises(ValueError, match="`scope`"):
        report.hit_rate("m", scope="query")
    # Erasure removes context positions only (1, 2, 3): at 1 %, the source.
    removed = tokens[0].ids.copy()
    removed[3] = 0
    drop = (
        induction_log_probabilities(tokens[0].ids[None])[0, 3]
        - (induction_log_probabilities(removed[None])[0, 3])
    )
    np.testing.assert_allclose(report.comprehensiveness["m"][0, 0], drop, rtol=1e-9)


def test_agreement_items_put_attractors_of_the_other_number_between_subject_and_verb():
    from attnflow.evaluate._llm_tasks import LEAD_INS, NUMBERED_NOUNS

    singular = {pair[0] for pair in NUMBERED_NOUNS}
    plural = {pair[1] for pair in NUMBERED_NOUNS}
    items = agreement_task(30, seed=4, attractors=2)
    assert items == agreement_task(30, seed=4, attractors=2)
    assert {item.answer for item in items} == {" is", " are"}  # both numbers drawn
    for item in items:
        lead, rest = item.prompt.split(" the ", 1)
        assert lead in LEAD_INS
        words = rest.split(" ")
        subject = item.prompt[slice(*item.source)]
        assert words[0] == subject
        assert item.source[0] == len(lead) + 5
        attractors = [words[i + 1] for i, word in enumerate(words) if word == "the"]
        assert len(attractors) == 2
        if item.answer == " are":
            assert subject in plural
            assert set(attractors) <= singular
            assert item.foil == " is"
        else:
            assert subject in singular
            assert set(attractors) <= plural
            assert item.foil == " are"
        assert item.context is None
        assert not item.copied
        located = locate_source(item, word_tokenizer())
        # Not the first candidate: the lead-in's words and "the" come before the subject.
        assert located.source == len(lead.split(" ")) + 1
        assert located.foil_id not in (None, located.answer_id)
        assert located.answer_id not in located.ids.tolist()  # the verb is not in the prompt
    assert [len(i.prompt.split(" the ")) for i in agreement_task(5, attractors=3)] == [5] * 5


def test_ioi_items_name_the_indirect_object_once_and_the_subject_twice():
    items = ioi_task(40, seed=6)
    assert items == ioi_task(40, seed=6)
    firsts = set()
    for item in items:
        indirect, subject = item.answer.strip(), item.foil.strip()
        names = re.findall(r"\b[A-Z][a-z]+\b", item.prompt)
        assert names.count(indirect) == 1
        assert names.count(subject) == 2
        assert item.prompt[slice(*item.source)] == indirect
        firsts.add(item.prompt.index(indirect) < item.prompt.index(subject))
        located = locate_source(item, word_tokenizer())
        assert located.ids[located.source] == located.answer_id
        assert located.foil_id in located.ids.tolist()  # the subject is in the prompt
    assert firsts == {True, False}  # the indirect object comes first or second


def test_locate_source_refuses_an_answer_or_subject_of_several_tokens():
    def splitting(word: str):  # splits `word` into two tokens
        def tokenize(text: str):
            return split(text, word)

        return tokenize

    base = word_tokenizer()  # one vocabulary for every call

    def split(text: str, word: str):
        ids, spans = base(text)
        out_ids, out_spans = [], []
        for token, (a, b) in zip(ids, spans, strict=True):
            if text[a:b].strip() == word:
                out_ids += [token, 1000]
                out_spans += [(a, b - 1), (b - 1, b)]
            else:
                out_ids.append(token)
                out_spans.append((a, b))
        return out_ids, out_spans

    plural = TaskItem("The keys to the door", " are", (4, 8), "agreement", None, " is", False)
    with pytest.raises(ValueError, match=r"source word 'keys' .* must be one token"):
        locate_source(plural, splitting("keys"))
    singular = TaskItem("The key to the doors", " is", (4, 7), "agreement", None, " are", False)
    with pytest.raises(ValueError, match="the answer ' is' must be one token"):
        locate_source(singular, splitting("is"))
    same = TaskItem("The key to the doors", " is", (4, 7), "agreement", None, " is", False)
    with pytest.raises(ValueError, match="the same token"):
        locate_source(same, word_tokenizer())


def test_ground_truth_runs_plain_functions_on_every_task():
    tokenize = word_tokenizer()

    def log_probabilities(ids: np.ndarray) -> np.ndarray:
        return np.zeros((len(ids), 10_000))  # the first token (id 0) always wins

    def last_but_one(ids: np.ndarray, target: int) -> np.ndarray:
        assert ids.ndim == 1
        assert isinstance(target, int)
        return np.arange(len(ids), dtype=float)

    for task in GROUND_TRUTH_TASKS:
        report = ground_truth(
            log_probabilities, tokenize, task=task, methods={"m": last_but_one}, n_items=3
        )
        assert isinstance(report, GroundTruthReport)
        assert report.tasks.tolist() == [task] * 3
        assert report.ranks["m"].shape == (3, 1)
        assert set(report.seconds) == {"m"}
        # Ties with a foil (all log-probabilities equal) are not correct answers.
        assert not report.correct.any()


def test_ground_truth_scores_a_foil_task_by_the_answer_against_the_foil():
    tokenize = word_tokenizer()
    items = [locate_source(i, tokenize) for i in agreement_task(6, seed=2)]

    def log_probabilities(ids: np.ndarray) -> np.ndarray:
        out = np.zeros((len(ids), 1000))
        for item in items:  # the right form above the wrong one, a third token on top
            if np.array_equal(item.ids, ids[0]):
                out[0, item.answer_id], out[0, 999] = 1.0, 5.0
        return out

    sources = {item.ids.tobytes(): item.source for item in items}

    def subject(ids: np.ndarray, target: int) -> np.ndarray:
        scores = np.zeros(len(ids))
        scores[sources[ids.tobytes()]] = 1.0
        return scores

    report = _score(items, {"subject": subject}, log_probabilities)
    assert report.accuracy == 1.0
    assert report.hit_rate("subject") == 1.0


def test_ground_truth_refuses_bad_arguments_before_any_work():
    tokenize = word_tokenizer()
    methods = {"m": lambda ids, target: np.ones(len(ids))}

    def model(ids):
        msg = "no work before the checks"
        raise AssertionError(msg)

    with pytest.raises(ValueError, match=r"`task` must be one of 'copying', 'retrieval', "):
        ground_truth(model, tokenize, task="copy", methods=methods)
    with pytest.raises(ValueError, match="'agreement', 'ioi'; got 'copy'"):
        ground_truth(model, tokenize, task="copy", methods=methods)
    with pytest.raises(TypeError, match="`model` must be a callable"):
        ground_truth("gpt2", tokenize, methods=methods)
    with pytest.raises(TypeError, match="`tokenizer`"):
        ground_truth(model, "gpt2", methods=methods)
    with pytest.raises(TypeError, match=r"attnflow\.adapters\.torch\.ground_truth"):
        ground_truth(model, tokenize, methods=["rollout"])  # registry names need torch
    with pytest.raises(TypeError, match="`methods` must be a non-empty mapping"):
        ground_truth(model, tokenize, methods={})
    with pytest.raises(ValueError, match="`n_items`"):
        ground_truth(model, tokenize, methods=methods, n_items=0)
    with pytest.raises(ValueError, match="`size` does not apply to task 'ioi'"):
        ground_truth(model, tokenize, task="ioi", methods=methods, size=3)
    with pytest.raises(ValueError, match="`words`"):
        ground_truth(model, tokenize, methods=methods, size=2)
    with pytest.raises(ValueError, match="`chat=True` needs a tokenizer with a chat template"):
        ground_truth(model, tokenize, task="retrieval", methods=methods, chat=True)
    with pytest.raises(ValueError, match="`chat` applies to the tasks"):
        ground_truth(model, tokenize, methods=methods, chat=chat_template)
    with pytest.raises(TypeError, match="`replacement`"):
        ground_truth(model, tokenize, methods=methods, replacement=1.5)


def test_ground_truth_refuses_bad_method_outputs():
    tokenize = word_tokenizer()

    def model(ids):
        return np.zeros((len(ids), 10_000))

    def run(method):
        return ground_truth(model, tokenize, methods={"m": method}, n_items=2)

    with pytest.raises(ValueError, match=r"`methods\['m'\]` must return scores of shape"):
        run(lambda ids, target: np.ones(3))
    with pytest.raises(ValueError, match="NaN"):
        run(lambda ids, target: np.full(len(ids), np.nan))
    with pytest.raises(ValueError, match="`model\\(ids\\)` must return"):
        ground_truth(lambda ids: np.zeros(5), tokenize, methods={"m": lambda i, t: i}, n_items=1)
