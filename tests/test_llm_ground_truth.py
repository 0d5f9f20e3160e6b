"""Ground truth for causal LMs: task generators, source location, ranks (NumPy, no model)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from attnflow.evaluate import (
    TaskItem,
    TaskTokens,
    competing_positions,
    copying_task,
    ground_truth,
    locate_source,
    max_attention,
    max_contribution,
    retrieval_task,
    source_ranks,
    stated_facts_task,
)

GENERATORS = [copying_task, retrieval_task, stated_facts_task]


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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_attention_is_the_max_over_layers_and_heads(dtype):
    rng = np.random.default_rng(1)
    weights = rng.random((2, 3, 4, 6, 6)).astype(dtype)
    got = max_attention(weights, rows=-2)
    expected = np.zeros((2, 6), dtype=dtype)
    for b in range(2):
        for j in range(6):
            expected[b, j] = max(weights[b, l, h, 4, j] for l in range(3) for h in range(4))
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)
    with pytest.raises(IndexError):
        max_attention(weights, rows=6)
    with pytest.raises(ValueError, match="layers, heads, n, n"):
        max_attention(weights[0, 0])


def test_max_attention_array_api_strict():
    xp = pytest.importorskip("array_api_strict")
    weights = np.random.default_rng(2).random((2, 2, 4, 4))
    got = max_attention(xp.asarray(weights))
    np.testing.assert_allclose(np.asarray(got), weights[:, :, -1].max(axis=(0, 1)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_contribution_is_the_max_over_layers_of_norm_contributions(dtype):
    """Oracle: Kobayashi's norm ||sum_h a^h_ij f^h(z_j)|| by loops, then the max over layers."""
    import attnflow

    rng = np.random.default_rng(3)
    layers, heads, n, d = 3, 2, 5, 4
    weights = rng.random((layers, heads, n, n))
    weights /= weights.sum(-1, keepdims=True)
    values = rng.normal(size=(layers, heads, n, d))
    norms = np.zeros((layers, n, n))
    for layer in range(layers):
        for i in range(n):
            for j in range(n):
                vector = sum(weights[layer, h, i, j] * values[layer, h, j] for h in range(heads))
                norms[layer, i, j] = np.sqrt(np.sum(np.asarray(vector) ** 2))
    expected = np.array([max(norms[layer, 1, j] for layer in range(layers)) for j in range(n)])
    # The library's own norm contributions (zero residual) give the same maximum.
    matrices = np.stack(
        [
            np.asarray(
                attnflow.contributions(
                    weights[layer].astype(dtype),
                    values[layer].astype(dtype),
                    np.zeros((n, d), dtype=dtype),
                    method="norm",
                )
            )
            for layer in range(layers)
        ]
    )
    got = max_contribution(matrices, rows=1)
    assert got.dtype == dtype
    np.testing.assert_allclose(got, expected, rtol=1e-5 if dtype == np.float32 else 1e-12)
    np.testing.assert_allclose(max_contribution(norms, rows=1), expected, rtol=1e-12)
    # A sink: most of the weight, small values, small contribution; max_attention ranks it first.
    attention = np.full((1, 1, 3, 3), 0.1)
    attention[0, 0, 2] = [0.8, 0.15, 0.05]
    small = np.array([[[0.1, 0.0], [2.0, 0.0], [1.0, 0.0]]])
    sink = np.asarray(attnflow.contributions(attention[0], small, np.zeros((3, 2)), method="norm"))
    assert np.argmax(max_attention(attention)) == 0
    assert np.argmax(max_contribution(sink[None])) == 1


def test_max_contribution_refuses_bad_arguments():
    with pytest.raises(ValueError, match="layers, n, n"):
        max_contribution(np.ones((4, 4)))
    with pytest.raises(IndexError, match="position"):
        max_contribution(np.ones((2, 4, 4)), rows=4)
    with pytest.raises(TypeError, match="one int"):
        max_contribution(np.ones((2, 4, 4)), rows=1.0)


@pytest.mark.parametrize(
    ("rows", "error", "message"),
    [
        (4, IndexError, r"a position in \[-4, 4\); got 4"),
        (-5, IndexError, r"a position in \[-4, 4\); got -5"),
        (1.0, TypeError, "one int position; got 1.0"),
        (True, TypeError, "one int position; got True"),
        ([1], TypeError, r"one int position; got \[1\]"),
    ],
)
def test_both_maxima_read_rows_alike(rows, error, message):
    """max_attention and max_contribution check and read `rows` the same way."""
    weights = np.random.default_rng(5).random((2, 3, 4, 4))
    for function, values in ((max_attention, weights), (max_contribution, weights[:, 0])):
        with pytest.raises(error, match=message):
            function(values, rows=rows)
        # Negative and NumPy integer positions name the same row.
        np.testing.assert_array_equal(function(values, rows=-3), function(values, rows=1))
        np.testing.assert_array_equal(function(values, rows=np.int64(1)), function(values, rows=1))


def test_max_contribution_array_api_strict():
    xp = pytest.importorskip("array_api_strict")
    matrices = np.random.default_rng(4).random((3, 4, 4))
    got = max_contribution(xp.asarray(matrices), rows=2)
    np.testing.assert_allclose(np.asarray(got), matrices[:, 2].max(axis=0))


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

    def pointer(t: TaskTokens) -> np.ndarray:
        ids = t.ids
        scores = np.linspace(0.1, 0.2, len(ids))
        scores[np.flatnonzero(ids[:-1] == ids[-1])[-1] + 1] = 1.0
        return np.stack([np.linspace(0.2, 0.1, len(ids)), scores])  # two "layers"

    def first(t: TaskTokens) -> np.ndarray:
        return np.linspace(1.0, 0.0, len(t.ids))

    report = ground_truth(
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
    assert "| pointer | 1.00 | 1.0 | 1: 1.00 (1.0) | 1.00 (1.0) |" in report.to_markdown()


def test_ground_truth_ranks_within_the_context_and_over_the_whole_prompt():
    item = TaskItem("x", " y", (0, 1), "copying")
    # Context: positions 0-3; the query 4-5 holds the highest-scoring competitor, 4.
    tokens = [TaskTokens(np.array([11, 1, 2, 3, 1, 2]), 3, 3, item, context=(0, 4))]

    def query_first(t: TaskTokens) -> np.ndarray:
        return np.array([0.0, 0.1, 0.2, 0.5, 0.9, 0.0])

    report = ground_truth(tokens, {"m": query_first}, induction_log_probabilities, replacement=0)
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


def test_ground_truth_refuses_bad_arguments():
    item = TaskTokens(np.array([11, 1, 2, 1]), 2, 2, TaskItem("x", " y", (0, 1), "copying"))
    with pytest.raises(TypeError, match="`items`"):
        ground_truth([1], {"a": lambda t: t.ids}, induction_log_probabilities)
    with pytest.raises(TypeError, match="`methods`"):
        ground_truth([item], {}, induction_log_probabilities)
    with pytest.raises(ValueError, match="shape"):
        ground_truth([item], {"a": lambda t: np.ones(3)}, induction_log_probabilities)
    with pytest.raises(TypeError, match="`replacement`"):
        ground_truth(
            [item], {"a": lambda t: np.ones(4)}, induction_log_probabilities, replacement=1.5
        )
