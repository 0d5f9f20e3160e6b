"""The paper code's distilled student (attnflow._experiments.agreement_distill), tiny configs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the distillation needs PyTorch")

from attnflow._experiments.agreement import agreement_split, with_end_token
from attnflow._experiments.agreement_distill import (
    LSTMTeacher,
    student_config,
    train_distilled_agreement_model,
)
from attnflow._experiments.agreement_torch import (
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
    ],
)
def test_bad_settings(split, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        train_distilled_agreement_model(split[0], seed=0, progress=False, **kwargs)  # type: ignore[arg-type]


class _Killed(Exception):
    pass


def test_a_killed_and_resumed_run_equals_an_uninterrupted_one(split, tmp_path) -> None:
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
    # Another run's settings are refused before any training.
    with pytest.raises(ValueError, match=r"holds another run's state.*'epochs': \(2, 3\)"):
        train_distilled_agreement_model(train, checkpoint=state, **{**settings, "epochs": 3})
