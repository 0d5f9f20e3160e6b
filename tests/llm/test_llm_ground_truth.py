"""Ground truth on SmolLM2: the pipeline of attnflow.evaluate.ground_truth end to end.

Every task's words are one token of SmolLM2's vocabulary and its items locate their source;
the model answers the agreement and IOI items in the expected fraction. Four copying items:
the ranks that ``ground_truth`` reports (registry methods run through ``explain`` under
SDPA) are recomputed independently from the eager model's ``output_attentions`` (and
their autograd gradients), ranked by a sort.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnflow
from attnflow.evaluate._llm_tasks import TASKS, copying_task, locate_source

torch = pytest.importorskip("torch")
ground_truth = pytest.importorskip("attnflow.adapters.torch").ground_truth


def tokenizer_function(tokenizer):
    def tokenize(text):
        encoded = tokenizer(text, return_offsets_mapping=True)
        return encoded["input_ids"], encoded["offset_mapping"]

    return tokenize


def sorted_rank(scores: np.ndarray, source: int, stop: int | None = None) -> int:
    """1 + the competitors (all but the first and last, before `stop`) scoring at least it."""
    end = len(scores) - 1 if stop is None else min(stop, len(scores) - 1)
    competitors = [j for j in range(1, end) if j != source]
    return 1 + sum(scores[j] >= scores[source] for j in competitors)


def test_every_task_word_is_one_leading_space_token(smollm2):
    _, tokenizer = smollm2
    from attnflow.evaluate import _llm_tasks as tasks

    words = [*tasks.NOUNS, *tasks.KEYS, *tasks.NAMES, *tasks.CITIES, *tasks.JOBS, *tasks.ANIMALS]
    words += [*(w for pair in tasks.NUMBERED_NOUNS for w in pair), *tasks.PLACES, *tasks.OBJECTS]
    words += ["is", "are"]
    assert [w for w in words if len(tokenizer(" " + w)["input_ids"]) != 1] == []
    tokenize = tokenizer_function(tokenizer)
    for name, generate in TASKS.items():
        for item in generate(20, seed=7):
            located = locate_source(item, tokenize)
            assert tokenizer.decode([located.answer_id]) == item.answer
            if item.foil is not None:
                assert tokenizer.decode([located.foil_id]) == item.foil
            source = tokenizer.decode([int(located.ids[located.source])])
            # The source token spells the source word: the subject noun for agreement.
            assert source == " " + item.prompt[slice(*item.source)], name
            assert (source == item.answer) == (name != "agreement")


def test_chat_template_items_locate_their_source_inside_the_user_message(smollm2):
    _, tokenizer = smollm2
    tokenize = tokenizer_function(tokenizer)

    def chat(message):
        conversation = [{"role": "user", "content": message}]
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )

    for generate in (TASKS["retrieval"], TASKS["stated_facts"]):
        for item in generate(4, seed=3, chat=chat):
            located = locate_source(item, tokenize)
            first, last = located.context
            context = tokenizer.decode(located.ids[first:last].tolist())
            # The context tokens are exactly the user's pairs or facts, nothing of the template.
            assert context == item.prompt[slice(*item.context)]
            assert tokenizer.decode([int(located.ids[located.source])]) == item.answer
            assert tokenizer.decode(located.ids.tolist()) == item.prompt


@pytest.fixture
def one_thread():
    """One torch thread: several times faster than two on a shared, loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_ground_truth_ranks_equal_an_independent_computation(smollm2):
    models, tokenizer = smollm2
    tokenize = tokenizer_function(tokenizer)
    items = [locate_source(item, tokenize) for item in copying_task(4, seed=11, words=12)]
    replacement = tokenizer(" the")["input_ids"][0]
    report = ground_truth(
        models["sdpa"], tokenizer, methods=("rollout", "gradient_rollout"), n_items=4, seed=11
    )
    erased_report = ground_truth(
        models["sdpa"], tokenizer, methods=("rollout",), n_items=4, seed=11, replacement=replacement
    )
    assert np.array_equal(erased_report.ranks["rollout"], report.ranks["rollout"])
    eager = models["eager"]
    for index, item in enumerate(items):
        ids = torch.as_tensor(item.ids[None])
        output = eager(ids, output_attentions=True)
        logits = output.logits[0, -1].double()
        assert bool(report.correct[index]) == (int(logits.argmax()) == item.answer_id)
        weights = torch.stack(output.attentions, dim=1)  # (1, L, H, n, n)
        gradients = torch.autograd.grad(
            output.logits[0, -1, item.answer_id], list(output.attentions)
        )
        weights64 = weights.detach().double()[0].numpy()
        grads64 = torch.stack(gradients, dim=1).double()[0].numpy()
        rolled = np.asarray(attnflow.rollout(weights64, rows=-1, layers="all"))
        gae = np.asarray(attnflow.gradient_rollout(weights64, grads64, rows=-1, layers="all"))
        expected = {
            "rollout": [sorted_rank(row, item.source) for row in rolled],
            "gradient_rollout": [sorted_rank(row, item.source) for row in gae],
        }
        for name, ranks in expected.items():
            # Float noise between SDPA capture and eager weights may swap near-ties only.
            got = report.prompt_ranks[name][index]
            assert np.mean(got == np.array(ranks)) >= 0.9, (name, got, ranks)
            assert got[-1] == ranks[-1]
        # Within the context (the list before " Again:") only the list's tokens compete.
        stop = item.context[1]
        within = sorted_rank(gae[-1], item.source, stop)
        assert report.ranks["gradient_rollout"][index, -1] == within
        # Comprehensiveness at 1 %: the top context token of the top rollout layer, replaced.
        top = 1 + int(np.argmax(rolled[-1][1:stop]))
        erased = ids.clone()
        erased[0, top] = replacement
        with torch.no_grad():
            before = torch.log_softmax(eager(ids).logits[0, -1].double(), -1)[item.answer_id]
            after = torch.log_softmax(eager(erased).logits[0, -1].double(), -1)[item.answer_id]
        np.testing.assert_allclose(
            erased_report.comprehensiveness["rollout"][index, 0], float(before - after), atol=1e-3
        )
    # The copying task is easy for SmolLM2, and gradient rollout finds the copied word.
    assert report.accuracy >= 0.75
    assert report.hit_rate("gradient_rollout") >= 0.75


@pytest.mark.usefixtures("one_thread")
def test_registry_method_with_explain_keywords_equals_an_independent_computation(smollm2):
    """GAE of log p(answer), a registry name with explain's keywords, from the eager model.

    The oracle: ``output_attentions`` and autograd of ``log_softmax(logits)[answer]``,
    rolled out by :func:`attnflow.gradient_rollout`; ``ground_truth`` ranks its top row.
    """
    from attnflow.adapters._torch_llm import registry_method

    models, tokenizer = smollm2
    eager = models["eager"]
    keywords = {"method": "gradient_rollout", "target_score": "log_probability"}
    report = ground_truth(
        models["sdpa"], tokenizer, methods={"gae log p": keywords}, n_items=2, seed=12
    )
    method = registry_method(
        models["sdpa"], "gradient_rollout", {"target_score": "log_probability"}
    )
    items = [locate_source(i, tokenizer_function(tokenizer)) for i in copying_task(2, seed=12)]
    for index, item in enumerate(items):
        ids = torch.as_tensor(item.ids[None])
        output = eager(ids, output_attentions=True)
        log_p = torch.log_softmax(output.logits[0, -1].double(), -1)[item.answer_id]
        gradients = torch.autograd.grad(log_p, list(output.attentions))
        weights = torch.stack(output.attentions, 1)[0].detach().double()
        grads = torch.stack(gradients, 1)[0].double()
        gae = attnflow.gradient_rollout(weights.numpy(), grads.numpy(), rows=-1, layers="all")
        got = method(item.ids, item.answer_id)
        np.testing.assert_allclose(got, np.asarray(gae), rtol=1e-3, atol=1e-6)
        expected = sorted_rank(np.asarray(gae)[-1], item.source, item.context[1])
        assert report.ranks["gae log p"][index, -1] == expected


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("task", "least"), [("agreement", 0.9), ("ioi", 0.95)])
def test_smollm2_answers_agreement_and_ioi_items_in_the_expected_fraction(smollm2, task, least):
    """The right form above the wrong one (agreement), the indirect object above the subject.

    Measured on 40 items of seeds 0, 1 and 2 (two attractors, after a lead-in clause):
    agreement 1.00 each (chance 0.5; 0.72, 0.90, 0.85 without the lead-in), IOI 1.00 each;
    here the 20 items of seed 1.
    """
    models, tokenizer = smollm2
    position = {"position": lambda ids, target: np.arange(len(ids), dtype=float)}
    report = ground_truth(
        models["sdpa"], tokenizer, task=task, methods=position, n_items=20, seed=1
    )
    assert report.accuracy >= least
    # A score rising with the position never ranks the early source first.
    assert report.hit_rate("position") == 0.0


def test_ground_truth_refuses_an_unknown_method_or_task_before_running_the_model(smollm2):
    models, tokenizer = smollm2
    calls = []
    hook = models["sdpa"].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"`methods\['rolout'\]` must be \"raw\", \"rollout\""):
            ground_truth(models["sdpa"], tokenizer, methods=["rollout", "rolout"])
        with pytest.raises(ValueError, match=r"`task` must be one of 'copying', .*'ioi'"):
            ground_truth(models["sdpa"], tokenizer, task="agreements", methods=["rollout"])
        with pytest.raises(TypeError, match="`methods` must be a non-empty sequence"):
            ground_truth(models["sdpa"], tokenizer, methods="rollout")
        from attnflow.evaluate import ground_truth as plain

        with pytest.raises(TypeError, match="torch module: call attnflow"):
            plain(models["sdpa"], tokenizer, methods={"m": lambda ids, target: ids})
    finally:
        hook.remove()
    assert calls == []
