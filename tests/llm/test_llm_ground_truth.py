"""Ground truth on SmolLM2: the pipeline of attnflow.evaluate.ground_truth end to end.

Four copying items; the ranks that ``ground_truth`` reports (through the torch helper, which
captures under SDPA) are recomputed independently from the eager model's
``output_attentions`` (and their autograd gradients), ranked by a sort.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnflow
from attnflow.evaluate import _llm_tasks as tasks
from attnflow.evaluate import (
    copying_task,
    ground_truth,
    locate_source,
    retrieval_task,
    stated_facts_task,
)

torch = pytest.importorskip("torch")


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
    words = [*tasks.NOUNS, *tasks.KEYS, *tasks.NAMES, *tasks.CITIES, *tasks.JOBS, *tasks.ANIMALS]
    assert [w for w in words if len(tokenizer(" " + w)["input_ids"]) != 1] == []
    tokenize = tokenizer_function(tokenizer)
    for generate in (copying_task, retrieval_task, stated_facts_task):
        for item in generate(5, seed=7):
            located = locate_source(item, tokenize)
            assert tokenizer.decode([located.answer_id]) == item.answer
            assert tokenizer.decode([int(located.ids[located.source])]) == item.answer


def test_chat_template_items_locate_their_source_inside_the_user_message(smollm2):
    _, tokenizer = smollm2
    tokenize = tokenizer_function(tokenizer)

    def chat(message):
        conversation = [{"role": "user", "content": message}]
        return tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )

    for generate in (retrieval_task, stated_facts_task):
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
    from attnflow.adapters._torch_llm import ground_truth_methods, next_token_log_probabilities

    models, tokenizer = smollm2
    tokenize = tokenizer_function(tokenizer)
    items = [locate_source(item, tokenize) for item in copying_task(4, seed=11)]
    methods = ground_truth_methods(models["sdpa"], methods=("rollout", "gradient rollout"))
    replacement = tokenizer(" the")["input_ids"][0]
    report = ground_truth(
        items,
        methods,
        next_token_log_probabilities(models["sdpa"]),
        replacement=replacement,
        fractions=(0.01,),
        erase=("rollout",),
    )
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
            "gradient rollout": [sorted_rank(row, item.source) for row in gae],
        }
        for name, ranks in expected.items():
            # Float noise between SDPA capture and eager weights may swap near-ties only.
            got = report.prompt_ranks[name][index]
            assert np.mean(got == np.array(ranks)) >= 0.9, (name, got, ranks)
            assert got[-1] == ranks[-1]
        # Within the context (the list before " Again:") only the list's tokens compete.
        stop = item.context[1]
        within = sorted_rank(gae[-1], item.source, stop)
        assert report.ranks["gradient rollout"][index, -1] == within
        # Comprehensiveness at 1 %: the top context token of the top rollout layer, replaced.
        top = 1 + int(np.argmax(rolled[-1][1:stop]))
        erased = ids.clone()
        erased[0, top] = replacement
        with torch.no_grad():
            before = torch.log_softmax(eager(ids).logits[0, -1].double(), -1)[item.answer_id]
            after = torch.log_softmax(eager(erased).logits[0, -1].double(), -1)[item.answer_id]
        np.testing.assert_allclose(
            report.comprehensiveness["rollout"][index, 0], float(before - after), atol=1e-3
        )
    # The copying task is easy for SmolLM2, and gradient rollout finds the copied word.
    assert report.accuracy >= 0.75
    assert report.hit_rate("gradient rollout") >= 0.75


@pytest.mark.usefixtures("one_thread")
def test_log_probability_gae_and_max_norm_contribution_equal_independent_computations(smollm2):
    """GAE of log p(answer) and the max norm contribution, from the eager model by hand.

    The oracle: ``output_attentions`` and autograd of ``log_softmax(logits)[answer]`` for
    GAE; for the norm-based contributions, each head's value ``v^h_j`` (a hook on
    ``v_proj``, grouped-query heads repeated) through its slice of ``o_proj``, weighted by
    the head's attention from the last row, summed over heads, its 2-norm, max over layers.
    """
    from attnflow.adapters._torch_llm import ground_truth_methods

    models, tokenizer = smollm2
    eager = models["eager"]
    config = eager.config
    heads, kv_heads, size = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    items = [locate_source(i, tokenizer_function(tokenizer)) for i in copying_task(2, seed=12)]
    names = ("gradient rollout (log-probability)", "max norm contribution")
    methods = ground_truth_methods(models["sdpa"], methods=names)
    values: list = []
    hooks = [
        layer.self_attn.v_proj.register_forward_hook(lambda _m, _a, out: values.append(out))
        for layer in eager.model.layers
    ]
    try:
        for item in items:
            values.clear()
            ids = torch.as_tensor(item.ids[None])
            output = eager(ids, output_attentions=True)
            log_p = torch.log_softmax(output.logits[0, -1].double(), -1)[item.answer_id]
            gradients = torch.autograd.grad(log_p, list(output.attentions))
            weights = torch.stack(output.attentions, 1)[0].detach().double()
            grads = torch.stack(gradients, 1)[0].double()
            gae = attnflow.gradient_rollout(weights.numpy(), grads.numpy(), rows=-1, layers="all")
            got = methods[names[0]](item)
            np.testing.assert_allclose(got, np.asarray(gae), rtol=1e-3, atol=1e-6)
            n = ids.shape[1]
            largest = torch.zeros(n, dtype=torch.float64)
            for layer, block in enumerate(eager.model.layers):
                v = values[layer][0].detach().double().reshape(n, kv_heads, size)
                v = v.repeat_interleave(heads // kv_heads, dim=1)  # (n, H, size)
                o = block.self_attn.o_proj.weight.detach().double().reshape(-1, heads, size)
                f = torch.einsum("jhe,dhe->hjd", v, o)  # (H, n, d): f^h(z_j)
                row = torch.einsum("hj,hjd->jd", weights[layer, :, -1], f).norm(dim=-1)
                largest = torch.maximum(largest, row)
            np.testing.assert_allclose(methods[names[1]](item), largest.numpy(), rtol=1e-4)
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.usefixtures("one_thread")
def test_explain_log_probability_gae_equals_the_ground_truth_helper(smollm2):
    """explain(target_score="log_probability") against the helper's own computation.

    The helper (``ground_truth_methods``) differentiates ``log_softmax(logits[0, -1])
    [answer]`` through a callable target of ``attention_gradients`` and rolls the float64
    weights and gradients out itself; explain does it in one call, materialised or
    blockwise. On the report seed's copying items the row ranks the source first.
    """
    from attnflow.adapters import torch as adapter
    from attnflow.adapters._torch_llm import ground_truth_methods

    models, tokenizer = smollm2
    model = models["sdpa"]
    name = "gradient rollout (log-probability)"
    helper = ground_truth_methods(model, methods=(name,))[name]
    items = [locate_source(i, tokenizer_function(tokenizer)) for i in copying_task(2, seed=1)]
    for item in items:
        ids = torch.as_tensor(item.ids[None])
        expected = helper(item)  # (layers, n)
        scale = float(np.abs(expected).max())
        for blockwise in (False, True):
            got = adapter.explain(
                model,
                {"input_ids": ids},
                method="gradient_rollout",
                rows=-1,
                target=item.answer_id,
                target_score="log_probability",
                layers="all",
                blockwise=blockwise,
            )
            assert got.shape == (1, *expected.shape)
            np.testing.assert_allclose(
                got[0].double().numpy(), expected, rtol=1e-4, atol=1e-5 * scale
            )
        with torch.no_grad():
            predicted = int(model(ids).logits[0, -1].argmax())
        if predicted == item.answer_id:  # docs/llms.md: hit@1 1.00 on correct items
            last = got[0, -1].double().numpy()
            assert sorted_rank(last, item.source, item.context[1]) == 1
