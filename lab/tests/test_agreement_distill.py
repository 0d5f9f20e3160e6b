"""The paper code's distilled student (attnflow_lab.agreement.agreement_distill), tiny configs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the distillation needs PyTorch")

from attnflow_lab.agreement.agreement import agreement_split, with_end_token
from attnflow_lab.agreement.agreement_distill import (
    AUTHORS_RECIPE,
    AUTHORS_TEACHER_DROPOUT,
    LSTMTeacher,
    _authors_initialisation,
    _authors_l2_parameters,
    cosine_decay_restarts,
    student_config,
    train_distilled_agreement_model,
)
from attnflow_lab.agreement.agreement_torch import (
    AgreementConfig,
    AgreementTransformer,
    accuracy,
    load_agreement_model,
    save_agreement_model,
)


@pytest.fixture(scope="module")
def split():
    train, test = agreement_split(1500, 200, seed=3)
    return with_end_token(train), with_end_token(test)


def test_the_student_is_the_paper_codes() -> None:
    config = student_config(300)
    assert (config.n_layers, config.n_heads, config.hidden) == (6, 8, 128)
    assert (config.dropout, config.attention_dropout, config.embedding_dropout) == (0.4, 0.6, 0.2)
    model = AgreementTransformer(config)
    assert model.drop.p == 0.2
    assert model.blocks[0].attn.dropout == 0.6
    assert model.blocks[0].attn.resid_dropout.p == 0.4
    assert model.blocks[0].mlp[3].p == 0.4
    teacher = LSTMTeacher(300)
    assert (teacher.lstm.num_layers, teacher.lstm.hidden_size) == (2, 256)
    assert teacher.embedding.embedding_dim == 256


def test_the_dropouts_survive_saving(tmp_path) -> None:
    config = AgreementConfig(vocab_size=10, n_layers=1, hidden=16, attention_dropout=0.6)
    save_agreement_model(AgreementTransformer(config), tmp_path)
    assert load_agreement_model(tmp_path).config == config
    assert '"embedding_dropout"' not in (tmp_path / "config.json").read_text()


@pytest.mark.parametrize("field", ["attention_dropout", "embedding_dropout"])
@pytest.mark.parametrize("value", [1.0, -0.1, True])
def test_bad_dropouts(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"`{field}` must be None or a number"):
        AgreementConfig(vocab_size=10, **{field: value})


def test_the_teacher_ignores_padding() -> None:
    torch.manual_seed(1)
    teacher = LSTMTeacher(12, hidden=8).eval()
    ids = torch.tensor([[1, 4, 5, 7], [1, 3, 6, 0]])
    mask = ids != 0
    with torch.no_grad():
        both = teacher(ids, mask)
        assert torch.allclose(both[1], teacher(ids[1:, :3])[0])
        assert torch.allclose(both[0], teacher(ids[:1])[0])


def test_a_tiny_student_learns_from_its_teacher(split) -> None:
    train, test = split
    tiny = AgreementConfig(
        len(train.vocabulary),
        n_layers=2,
        n_heads=2,
        hidden=32,
        dropout=0.1,
        attention_dropout=0.1,
        embedding_dropout=0.1,
    )
    student, teacher = train_distilled_agreement_model(
        train, seed=0, config=tiny, teacher_hidden=64, epochs=6, lr=3e-3, progress=False
    )
    assert not student.training
    assert not teacher.training
    # Both learn the task well above chance (0.5); the student is trained mostly (0.9)
    # on the teacher's outputs, so it agrees with the teacher more often than chance too.
    assert accuracy(student, test) > 0.65
    with torch.no_grad():
        ids, mask = torch.tensor(test.ids), torch.tensor(test.mask)
        taught = teacher(ids, mask).argmax(-1).numpy()
        learned = student(ids, mask).argmax(-1).numpy()
    assert np.mean(taught == test.labels) > 0.65
    assert np.mean(taught == learned) > 0.65


def test_training_is_reproducible(split) -> None:
    # The same data and seed give the same student (weights, dropout and batch order).
    train, _ = split
    tiny = AgreementConfig(len(train.vocabulary), n_layers=1, n_heads=2, hidden=16)
    first, _ = train_distilled_agreement_model(
        train,
        seed=0,
        config=tiny,
        teacher_hidden=16,
        epochs=1,
        distill_rate=1.0,
        progress=False,
    )
    again, _ = train_distilled_agreement_model(
        train,
        seed=0,
        config=tiny,
        teacher_hidden=16,
        epochs=1,
        distill_rate=1.0,
        progress=False,
    )
    ids = torch.tensor(train.ids[:8])
    mask = torch.tensor(train.mask[:8])
    with torch.no_grad():
        assert torch.equal(first(ids, mask), again(ids, mask))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"distill_rate": 1.5}, "`distill_rate` must lie in"),
        ({"temperature": 0.0}, "`temperature` be positive"),
        ({"epochs": 0}, "need epochs >= 1"),
        ({"optimiser": "sgd"}, "`optimiser` must be 'adamw' or 'authors'"),
        ({"optimiser": "authors", "warmup": 0.05}, "`warmup` does not apply"),
        ({"optimiser": "authors", "clip": 0.0}, "clip > 0"),
        ({"initialisation": "keras"}, "`initialisation` must be 'ours' or 'authors'"),
        ({"teacher_dropout": 0.8}, "`teacher_dropout` must be 'ours' or 'authors'"),
    ],
)
def test_bad_settings(split, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        train_distilled_agreement_model(split[0], seed=0, progress=False, **kwargs)  # type: ignore[arg-type]


class _Killed(Exception):
    pass


@pytest.mark.parametrize("optimiser", ["adamw", "authors"])
def test_a_killed_and_resumed_run_equals_an_uninterrupted_one(
    split, tmp_path, optimiser: str
) -> None:
    # Two epochs straight through, against one epoch, a "kill" (an exception raised
    # after the first epoch's checkpoint is written) and a second call that resumes
    # from the checkpoint: the same weights, bit for bit (the optimisers, schedules,
    # dropout generator and batch order all continue where they stopped).
    train, _ = split
    train = train.take(np.arange(256))
    tiny = AgreementConfig(len(train.vocabulary), n_layers=1, n_heads=2, hidden=16)
    settings: dict[str, Any] = {
        "seed": 0,
        "config": tiny,
        "teacher_hidden": 16,
        "epochs": 2,
        "optimiser": optimiser,
        "progress": False,
    }
    straight, straight_teacher = train_distilled_agreement_model(train, **settings)

    def kill(epoch: int, student: object, teacher: object) -> None:
        raise _Killed

    state = tmp_path / "state.pt"
    with pytest.raises(_Killed):
        train_distilled_agreement_model(train, checkpoint=state, on_epoch=kill, **settings)
    assert torch.load(state, weights_only=True)["epoch"] == 1
    seen: list[int] = []
    resumed, resumed_teacher = train_distilled_agreement_model(
        train, checkpoint=state, on_epoch=lambda e, s, t: seen.append(e), **settings
    )
    assert seen == [2]  # the epoch done before the kill is not called again
    for a, b in ((straight, resumed), (straight_teacher, resumed_teacher)):
        one, two = a.state_dict(), b.state_dict()
        assert one.keys() == two.keys()
        assert all(torch.equal(one[k], two[k]) for k in one)
    # A finished run's checkpoint trains nothing more and returns its models.
    again, _ = train_distilled_agreement_model(train, checkpoint=state, **settings)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in straight.state_dict().items())
    if optimiser == "adamw":
        # Other epochs are refused: attnflow's schedule decays over the whole run.
        for epochs in (1, 3):
            with pytest.raises(
                ValueError, match=rf"another run's state.*'epochs': \(2, {epochs}\)"
            ):
                train_distilled_agreement_model(
                    train, checkpoint=state, **{**settings, "epochs": epochs}
                )
    else:
        # Fewer epochs than the file holds are refused before any training.
        with pytest.raises(ValueError, match=r"holds 2 epochs, more than the epochs=1 asked"):
            train_distilled_agreement_model(train, checkpoint=state, **{**settings, "epochs": 1})
        # The authors' schedules depend on the step alone: the finished 2-epoch run's
        # file extends it to 3 epochs, with the weights of a 3-epoch run from the start.
        three = {**settings, "epochs": 3}
        longer, longer_teacher = train_distilled_agreement_model(train, **three)
        assert not torch.equal(longer.classifier.weight, straight.classifier.weight)
        seen.clear()
        extended, extended_teacher = train_distilled_agreement_model(
            train, checkpoint=state, on_epoch=lambda e, s, t: seen.append(e), **three
        )
        assert seen == [3]
        assert torch.load(state, weights_only=True)["epoch"] == 3
        for a, b in ((longer, extended), (longer_teacher, extended_teacher)):
            one, two = a.state_dict(), b.state_dict()
            assert all(torch.equal(one[k], two[k]) for k in one)
    # ... and so is the other optimiser's (the authors' run records its recipe).
    other = "adamw" if optimiser == "authors" else "authors"
    with pytest.raises(ValueError, match=r"holds another run's state.*'optimiser'"):
        train_distilled_agreement_model(train, checkpoint=state, **{**settings, "optimiser": other})


def _periods_oracle(step: int, t0: int, t_mul: float, m_mul: float, alpha: float) -> float:
    """SGDR by walking the periods one by one (Loshchilov & Hutter 2017, eq. 5 with
    restarts growing by t_mul and peaks shrinking by m_mul)."""
    start, length, peak = 0.0, float(t0), 1.0
    while step >= start + length:
        start, length, peak = start + length, length * t_mul, peak * m_mul
    return float((1 - alpha) * peak * 0.5 * (1 + np.cos(np.pi * (step - start) / length)) + alpha)


def test_cosine_decay_restarts_closed_form() -> None:
    # The authors' student schedule at steps whose value is known in closed form:
    # the start, a quarter, half and the end of the first period (10,000 steps), the
    # restart (m), the middle of the second period (50,000 steps long: t_mul = 5), and
    # the second restart (m^2, at 10,000 + 50,000).
    kw: dict[str, Any] = {"first_decay_steps": 10_000, "t_mul": 5.0, "m_mul": 0.96, "alpha": 0.001}
    a, m = 0.001, 0.96
    expected = {
        0: 1.0,
        2_500: (1 - a) * 0.5 * (1 + np.sqrt(0.5)) + a,
        5_000: (1 - a) * 0.5 + a,
        10_000: (1 - a) * m + a,
        35_000: (1 - a) * m * 0.5 + a,
        60_000: (1 - a) * m**2 + a,
    }
    for step, value in expected.items():
        assert cosine_decay_restarts(step, **kw) == pytest.approx(value, rel=1e-12, abs=1e-15)
    assert 0 < cosine_decay_restarts(9_999, **kw) - a < 1e-7  # the period's floor, alpha


@pytest.mark.parametrize("t_mul", [1.0, 2.0, 3.0, 5.0])
def test_cosine_decay_restarts_walks_the_periods(t_mul: float) -> None:
    # Against the period-by-period oracle, at every step of a small schedule, the
    # restarts' very steps included (where the closed form's logarithm rounds).
    for step in range(2_000):
        got = cosine_decay_restarts(step, first_decay_steps=7, t_mul=t_mul, m_mul=0.8, alpha=0.01)
        assert got == pytest.approx(_periods_oracle(step, 7, t_mul, 0.8, 0.01), abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step": -1}, "`step` must be a non-negative int"),
        ({"step": 1.5}, "`step` must be a non-negative int"),
        ({"first_decay_steps": 0}, "need first_decay_steps >= 1"),
        ({"t_mul": 0.0}, "t_mul > 0"),
        ({"alpha": 1.5}, "0 <= alpha <= 1"),
    ],
)
def test_cosine_decay_restarts_bad_settings(kwargs: dict[str, Any], match: str) -> None:
    settings: dict[str, Any] = {"step": 3, "first_decay_steps": 10, **kwargs}
    step = settings.pop("step")
    with pytest.raises(ValueError, match=match):
        cosine_decay_restarts(step, **settings)


def test_the_authors_optimisation(split: Any, tmp_path: Any) -> None:
    # A tiny run under optimiser="authors": Adam for the student and RAdam for the
    # teacher, at 1e-4 times their schedules after the run's steps; the L2 covers the
    # student's embeddings and dense layers, not its LayerNorms nor its classifier.
    train, _ = split
    train = train.take(np.arange(128))
    tiny = AgreementConfig(len(train.vocabulary), n_layers=1, n_heads=2, hidden=16)
    state = tmp_path / "state.pt"
    student, _ = train_distilled_agreement_model(
        train,
        seed=0,
        config=tiny,
        teacher_hidden=16,
        epochs=2,
        batch_size=32,
        optimiser="authors",
        checkpoint=state,
        progress=False,
    )
    saved = torch.load(state, weights_only=True)
    steps = 2 * 4
    student_group = saved["optimisers"][0]["param_groups"][0]
    teacher_group = saved["optimisers"][1]["param_groups"][0]
    assert "amsgrad" in student_group  # torch.optim.Adam's own setting
    assert "decoupled_weight_decay" in teacher_group  # torch.optim.RAdam's
    assert student_group["weight_decay"] == teacher_group["weight_decay"] == 0
    assert student_group["eps"] == teacher_group["eps"] == 1e-8
    lr = AUTHORS_RECIPE["lr"]
    expected = lr * cosine_decay_restarts(
        steps, first_decay_steps=10_000, t_mul=5.0, m_mul=0.96, alpha=0.001
    )
    assert student_group["lr"] == pytest.approx(expected, rel=1e-12)
    assert teacher_group["lr"] == pytest.approx(lr * 0.96 ** (steps / 10_000), rel=1e-12)
    assert saved["run"]["clip"] is None
    names = {id(p): n for n, p in student.named_parameters()}
    penalised = {names[id(p)] for p in _authors_l2_parameters(student)}
    expected_names = {
        n for n in names.values() if not n.startswith(("classifier.", "ln_f.")) and ".ln_" not in n
    }
    assert penalised == expected_names
    assert "token_embedding.weight" in penalised
    assert "blocks.0.attn.qkv.bias" in penalised


def test_the_authors_initialisers() -> None:
    # Reflect@d28ddd5: the student truncated-normal 0.05 (cut at 2 deviations, not
    # rescaled) on every embedding and dense kernel, zero biases, LayerNorms 1 / 0; the
    # teacher Keras's defaults (uniform 0.05 embeddings, Glorot kernels, orthogonal
    # recurrent kernels, forget-gate bias 1).
    scipy_stats = pytest.importorskip("scipy.stats")
    torch.manual_seed(0)
    student = AgreementTransformer(student_config(300))
    teacher = LSTMTeacher(300)
    _authors_initialisation(student, teacher)
    kernels = []
    for name, p in student.named_parameters():
        if "ln_" in name:
            assert torch.equal(p, torch.ones_like(p) if name.endswith("weight") else 0 * p)
        elif name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert p.abs().max() <= 0.1, name
            kernels.append(p.detach().flatten())
    pooled = torch.cat(kernels).double()
    std = 0.05 * scipy_stats.truncnorm(-2, 2).std()  # 0.0440, not 0.05
    assert float(pooled.std()) == pytest.approx(std, rel=0.01)
    assert abs(float(pooled.mean())) < 1e-3
    embedding = teacher.embedding.weight.detach().double()
    assert embedding.abs().max() <= 0.05
    assert float(embedding.std()) == pytest.approx(0.05 / 3**0.5, rel=0.01)
    hidden = teacher.lstm.hidden_size
    for layer in range(teacher.lstm.num_layers):
        w_ih = getattr(teacher.lstm, f"weight_ih_l{layer}").detach().double()
        w_hh = getattr(teacher.lstm, f"weight_hh_l{layer}").detach().double()
        bound = (6 / (w_ih.shape[1] + 4 * hidden)) ** 0.5
        assert w_ih.abs().max() <= bound
        assert float(w_ih.std()) == pytest.approx(bound / 3**0.5, rel=0.02)
        assert torch.allclose(w_hh.T @ w_hh, torch.eye(hidden, dtype=torch.float64), atol=1e-5)
        bias = getattr(teacher.lstm, f"bias_ih_l{layer}").detach()
        gates = torch.zeros(4, hidden)
        gates[1] = 1.0  # i, f, g, o: the forget gate's bias 1
        assert torch.equal(bias, gates.flatten())
        assert not getattr(teacher.lstm, f"bias_hh_l{layer}").any()
    classifier = teacher.classifier.weight.detach()
    assert classifier.abs().max() <= (6 / (hidden + 2)) ** 0.5
    assert not teacher.classifier.bias.any()


def test_the_variational_recurrence_is_torchs_lstm() -> None:
    torch.manual_seed(0)
    teacher = LSTMTeacher(10, hidden=8, n_layers=2, dropout=0.8, variational=True)
    x = torch.randn(3, 5, 8)
    teacher.hidden_dropout = 0.0  # every mask keeps everything
    with torch.no_grad():
        assert torch.allclose(teacher._variational_states(x), teacher.lstm(x)[0], atol=1e-6)


def test_the_authors_teacher_dropout_is_where_keras_puts_it() -> None:
    # An oracle of Keras's ClassifierLSTM in training: dropout 0.2 on the embeddings;
    # in each LSTM layer one mask per sentence on the inputs and one on the previous
    # state, the same at every step; dropout 0.8 on the last layer's output.
    teacher = LSTMTeacher(
        12,
        hidden=6,
        dropout=AUTHORS_TEACHER_DROPOUT["hidden"],
        input_dropout=AUTHORS_TEACHER_DROPOUT["input"],
        variational=True,
    )
    assert (teacher.input_drop.p, teacher.drop.p, teacher.lstm.dropout) == (0.2, 0.8, 0.0)
    ids = torch.tensor([[1, 4, 5, 7], [1, 3, 6, 0], [2, 2, 2, 2]])
    mask = ids != 0
    torch.manual_seed(5)
    got = teacher.train()(ids, mask)
    torch.manual_seed(5)
    x = torch.nn.functional.dropout(teacher.embedding(ids), 0.2)
    lstm, keep = teacher.lstm, 0.2
    for layer in range(2):
        w_ih, w_hh, b_ih, b_hh = (
            getattr(lstm, f"{k}_l{layer}") for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        )
        x_mask = torch.empty(3, 6).bernoulli_(keep) / keep
        h_mask = torch.empty(3, 6).bernoulli_(keep) / keep
        h = c = torch.zeros(3, 6)
        outs = []
        for t in range(ids.shape[1]):
            z = (x[:, t] * x_mask) @ w_ih.T + b_ih + (h * h_mask) @ w_hh.T + b_hh
            i, f, g, o = z.split(6, dim=1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
            outs.append(h)
        x = torch.stack(outs, dim=1)
    last = x[torch.arange(3), mask.sum(1) - 1]
    expected = teacher.classifier(torch.nn.functional.dropout(last, 0.8))
    assert torch.allclose(got, expected, atol=1e-5)
    with torch.no_grad():  # evaluation: no dropout, torch.nn.LSTM
        assert torch.allclose(teacher.eval()(ids[:1]), teacher(ids, mask)[:1], atol=1e-6)


def test_bad_teacher_settings() -> None:
    with pytest.raises(ValueError, match="`input_dropout` must be a number in"):
        LSTMTeacher(10, input_dropout=1.0)
    with pytest.raises(TypeError, match="`variational` must be a bool"):
        LSTMTeacher(10, variational=1)  # type: ignore[arg-type]


def test_the_authors_recipe_is_recorded(split: Any, tmp_path: Any) -> None:
    train = split[0].take(np.arange(64))
    tiny = AgreementConfig(len(train.vocabulary), n_layers=1, n_heads=2, hidden=16)
    state = tmp_path / "state.pt"
    options: dict[str, Any] = {
        "seed": 0,
        "config": tiny,
        "teacher_hidden": 8,
        "epochs": 1,
        "optimiser": "authors",
        "checkpoint": state,
        "progress": False,
    }
    train_distilled_agreement_model(
        train, initialisation="authors", teacher_dropout="authors", **options
    )
    run = torch.load(state, weights_only=True)["run"]
    assert run["initialisation"] == {"name": "authors", "student": 0.05}
    assert run["teacher_dropout"] == {"name": "authors", "input": 0.2, "hidden": 0.8}
    with pytest.raises(ValueError, match="holds another run's state"):
        train_distilled_agreement_model(train, **options)
