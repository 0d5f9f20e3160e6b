"""faithfulness(): the composition of the pieces, chunked, resumable and parallel."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backends import Variant, selected_variants
from evaluation_models import TokenClassifier, predict_for

import attnflow
from attnflow.evaluate import EvaluationFolderError

VOCABULARY, SAMPLES, N, LAYERS, HEADS, UNK = 12, 7, 6, 3, 2, 0


class ToyModel:
    """A classifier with attention derived from its embeddings, and token gradients."""

    def __init__(self, seed: int = 2) -> None:
        self.classifier = TokenClassifier(vocabulary=VOCABULARY, seed=seed)
        rng = np.random.default_rng(seed + 1)
        self.queries = rng.normal(size=(LAYERS, HEADS, 5, 5))
        self.calls = 0

    def predict(self, ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        return self.classifier.probabilities(
            np.asarray(ids), None if mask is None else np.asarray(mask)
        )

    def attentions(self, ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        self.calls += 1
        states = self.classifier.embeddings[np.asarray(ids)]  # (B, n, d)
        logits = np.einsum("bid,lhde,bje->blhij", states, self.queries, states)
        if mask is not None:
            logits = np.where(np.asarray(mask)[:, None, None, None, :], logits, -np.inf)
        logits -= logits.max(axis=-1, keepdims=True)
        weights = np.exp(logits)
        return weights / weights.sum(axis=-1, keepdims=True)

    def input_gradients(self, ids: np.ndarray, mask: Any, targets: Any) -> np.ndarray:
        # Not a real gradient: any per-token score works as a reference for the runner.
        states = self.classifier.embeddings[np.asarray(ids)]
        return np.abs(states @ self.classifier.output[:, 0]) + np.asarray(targets)[:, None]

    def functions(self, identity: str | None = None) -> attnflow.evaluate.ModelFunctions:
        return attnflow.evaluate.ModelFunctions(
            self.predict, self.attentions, self.input_gradients, identity=identity
        )


@pytest.fixture(scope="module")
def dataset() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCABULARY, size=(SAMPLES, N))
    lengths = np.array([6, 5, 6, 3, 4, 6, 2])
    mask = np.arange(N)[None, :] < lengths[:, None]
    ids = np.where(mask, ids, 0)
    labels = rng.integers(0, 3, size=SAMPLES)
    return ids, mask, labels


@pytest.mark.parametrize("rows", [0, "max", "mean"])
def test_report_equals_the_pieces(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray], rows: Any
) -> None:
    ids, mask, labels = dataset
    model = ToyModel()
    where = np.ones(N, dtype=bool)
    where[0] = False  # [CLS] takes no part
    report = attnflow.evaluate.faithfulness(
        model.functions(),
        ids,
        replacement=UNK,
        targets=labels,
        mask=mask,
        where=where,
        rows=rows,
        fractions=(0.2, 0.5),
        chunk_size=3,
    )
    attentions = model.attentions(ids, mask)
    predict = functools.partial(model.predict)
    blank = attnflow.evaluate.blank_out(predict, ids, replacement=UNK, target=labels, mask=mask)
    gradients = model.input_gradients(ids, mask, labels)
    included = mask & where
    for name, method in (
        ("raw", attnflow.raw),
        ("rollout", attnflow.rollout),
        ("flow", attnflow.flow),
    ):
        explained = method(
            attentions, rows=rows if isinstance(rows, int) else None, layers="all", mask=mask
        )
        if rows == "max":
            explained = explained.max(axis=-2)
        elif rows == "mean":
            explained = explained.sum(axis=-2) / mask.sum(axis=1)[:, None, None]
        np.testing.assert_allclose(report.samples[f"scores.{name}"], explained, rtol=0, atol=1e-12)
        for reference, values in (("blank_out", blank), ("input_gradients", gradients)):
            usable = included & np.isfinite(values)
            expected = attnflow.evaluate.rank_correlation(
                explained, values[:, None, :], where=usable[:, None, :]
            )
            got = report.samples[f"correlation.{name}.{reference}"]
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
            np.testing.assert_allclose(
                report.correlation_mean(name, reference), expected.mean(axis=0)
            )
            np.testing.assert_allclose(
                report.correlation_std(name, reference), expected.std(axis=0)
            )
        for metric in ("comprehensiveness", "sufficiency"):
            expected = getattr(attnflow.evaluate, metric)(
                predict,
                ids,
                explained,
                replacement=UNK,
                target=labels,
                fractions=(0.2, 0.5),
                mask=mask,
                where=included,
            )
            np.testing.assert_allclose(
                report.samples[f"{metric}.{name}"], expected, rtol=0, atol=1e-12
            )
            mean, std = report.aopc(name, metric)
            np.testing.assert_allclose(mean, expected.mean(axis=-1).mean(axis=0))
            np.testing.assert_allclose(std, expected.mean(axis=-1).std(axis=0))
    predicted = np.argmax(model.predict(ids, mask), axis=1)
    assert report.accuracy == pytest.approx(np.mean(predicted == labels))
    np.testing.assert_array_equal(report.samples["index"], np.arange(SAMPLES))
    assert report.n_layers == LAYERS
    assert report.n_samples == SAMPLES


def _dense_spearman_oracle(a: np.ndarray, b: np.ndarray) -> float:
    """The paper code's ``my_spearmanr``: dense ranks, then 1 - 6 sum d^2 / (m (m^2 - 1))."""
    m = len(a)
    if m < 2:
        return 0.0
    ra = np.searchsorted(np.unique(a), a) + 1  # dense ranks, written independently
    rb = np.searchsorted(np.unique(b), b) + 1
    return float(1 - 6 * np.sum((ra - rb) ** 2.0) / (m * (m * m - 1)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_paper_code_protocol_passes_through(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray], dtype: type
) -> None:
    # Reflect@d28ddd5's Tables 1-2: blank out positions 0..n-2 with UNK, score
    # |p_gold(x) - p_gold(x~_i)|, give the final token 0, correlate by dense ranks.
    ids, mask, labels = dataset
    model = ToyModel()

    def predict(batch: np.ndarray, batch_mask: np.ndarray | None) -> np.ndarray:
        return model.predict(batch, batch_mask).astype(dtype)

    functions = attnflow.evaluate.ModelFunctions(predict, model.attentions)
    report = attnflow.evaluate.faithfulness(
        functions,
        ids,
        replacement=UNK,
        targets=labels,
        mask=mask,
        references=["blank_out"],
        blank_out_score="abs",
        blank_out_last_token="zero",
        correlation="spearman_dense",
        fractions=None,
        chunk_size=4,
    )
    assert report.blank_out_last_token == "zero"
    assert report.correlation == "spearman_dense"
    assert "dense ranks" in report.to_markdown(aopc=False)
    rollout = attnflow.rollout(model.attentions(ids, mask), rows=0, layers="all", mask=mask)
    for sample in range(SAMPLES):
        m = int(mask[sample].sum())
        base = predict(ids[sample : sample + 1, :m], None)[0, labels[sample]]
        expected = np.zeros(m)
        for i in range(m - 1):
            blanked = ids[sample : sample + 1, :m].copy()
            blanked[0, i] = UNK
            expected[i] = abs(base - predict(blanked, None)[0, labels[sample]])
        got = report.samples["reference.blank_out"][sample, :m]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
        for layer in range(LAYERS):
            rho = _dense_spearman_oracle(report.samples["scores.rollout"][sample, layer, :m], got)
            assert report.samples["correlation.rollout.blank_out"][sample, layer] == (
                pytest.approx(rho, abs=1e-12)
            )
        np.testing.assert_allclose(
            report.samples["scores.rollout"][sample, :, :m], rollout[sample, :, :m], atol=1e-12
        )
    # The correlation half alone, from the saved outputs, gives the same correlations.
    saved = attnflow.evaluate.faithfulness_from_outputs(
        model.attentions(ids, mask),
        {"blank_out": report.samples["reference.blank_out"]},
        mask=mask,
        correlation="spearman_dense",
        methods=["rollout"],
    )
    np.testing.assert_allclose(
        saved.samples["correlation.rollout.blank_out"],
        report.samples["correlation.rollout.blank_out"],
        rtol=0,
        atol=1e-12,
    )
    # The default still blanks the last token out.
    default = attnflow.evaluate.faithfulness(
        functions,
        ids,
        replacement=UNK,
        targets=labels,
        mask=mask,
        references=["blank_out"],
        blank_out_score="abs",
        fractions=None,
    )
    last = mask.sum(axis=1) - 1
    changed = default.samples["reference.blank_out"][np.arange(SAMPLES), last]
    assert np.all(changed > 0)


def test_cumulative_over_layers_is_the_paper_logs_aggregation(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    ids, mask, labels = dataset
    report = attnflow.evaluate.faithfulness(
        ToyModel().functions(), ids, replacement=UNK, targets=labels, mask=mask, fractions=None
    )
    for method in ("raw", "rollout", "flow"):
        for reference in ("blank_out", "input_gradients"):
            values = report.samples[f"correlation.{method}.{reference}"]
            mean = report.correlation_mean(method, reference, over_layers="cumulative")
            std = report.correlation_std(method, reference, over_layers="cumulative")
            for layer in range(LAYERS):
                # The paper code's lists, never reset between layers.
                pooled = [values[s, k] for k in range(layer + 1) for s in range(SAMPLES)]
                assert mean[layer] == pytest.approx(np.mean(pooled), abs=1e-12)
                assert std[layer] == pytest.approx(np.std(pooled), abs=1e-12)
            # De-cumulated, the log gives the per-layer table back.
            each = report.correlation_mean(method, reference)
            steps = np.arange(1, LAYERS + 1)
            cumulated = steps * mean
            np.testing.assert_allclose(np.diff(cumulated, prepend=0.0), each, atol=1e-12)
    with pytest.raises(ValueError, match="`over_layers` must be one of"):
        report.correlation_mean("flow", "blank_out", over_layers="total")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`over_layers` must be one of"):
        report.correlation_std("flow", "blank_out", over_layers=None)  # type: ignore[arg-type]


def test_cumulative_over_layers_leaves_nan_out() -> None:
    values = np.array([[0.5, np.nan, 0.1], [0.3, 0.9, np.nan]])
    report = attnflow.evaluate.FaithfulnessReport(
        {"correlation.flow.blank_out": values}, ("flow",), ("blank_out",), "spearman", "drop", 0
    )
    mean = report.correlation_mean("flow", "blank_out", over_layers="cumulative")
    np.testing.assert_allclose(mean, [0.4, np.mean([0.5, 0.3, 0.9]), np.mean([0.5, 0.3, 0.9, 0.1])])


def test_chunking_does_not_change_the_numbers(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    ids, mask, _ = dataset
    one = attnflow.evaluate.faithfulness(
        ToyModel().functions(), ids, replacement=UNK, mask=mask, chunk_size=100
    )
    many = attnflow.evaluate.faithfulness(
        ToyModel().functions(), ids, replacement=UNK, mask=mask, chunk_size=2
    )
    assert one.samples.keys() == many.samples.keys()
    for key in one.samples:
        np.testing.assert_allclose(
            many.samples[key], one.samples[key], rtol=0, atol=1e-12, err_msg=key
        )
    assert one.accuracy is None  # no labels given


def test_any_backend_reaches_the_model_in_its_own_arrays(
    backend: Variant, dataset: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    ids, mask, labels = dataset
    toy = ToyModel()
    predict = predict_for(backend, toy.classifier, "float64")

    def attentions(batch: Any, batch_mask: Any) -> Any:
        return backend.asarray(
            toy.attentions(backend.to_numpy(batch), backend.to_numpy(batch_mask))
        )

    functions = attnflow.evaluate.ModelFunctions(predict, attentions)
    report = attnflow.evaluate.faithfulness(
        functions,
        backend.asarray(ids),
        replacement=UNK,
        mask=backend.asarray(mask),
        targets=backend.asarray(labels),
        references=["blank_out"],
        methods=["raw", "rollout"],
        fractions=(0.5,),
        chunk_size=4,
    )
    host = attnflow.evaluate.faithfulness(
        attnflow.evaluate.ModelFunctions(toy.predict, toy.attentions),
        ids,
        replacement=UNK,
        mask=mask,
        targets=labels,
        references=["blank_out"],
        methods=["raw", "rollout"],
        fractions=(0.5,),
        chunk_size=4,
    )
    for key in host.samples:
        np.testing.assert_allclose(
            report.samples[key], host.samples[key], rtol=0, atol=1e-9, err_msg=key
        )


def test_resumed_run_gives_the_identical_report(
    tmp_path: Path, dataset: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    ids, mask, labels = dataset
    options: dict[str, Any] = {"replacement": UNK, "mask": mask, "targets": labels, "chunk_size": 2}
    fresh = attnflow.evaluate.faithfulness(ToyModel().functions(), ids, **options)

    class Interrupted(Exception):
        pass

    failing = ToyModel()
    original = failing.attentions

    def attentions(batch: np.ndarray, batch_mask: np.ndarray) -> np.ndarray:
        if failing.calls == 2:  # the third chunk
            raise Interrupted
        return original(batch, batch_mask)

    failing.attentions = attentions  # type: ignore[method-assign]
    with pytest.raises(Interrupted):
        attnflow.evaluate.faithfulness(failing.functions("toy"), ids, output=tmp_path, **options)
    assert sorted(p.name for p in tmp_path.glob("chunk-*.npz")) == [
        "chunk-000000.npz",
        "chunk-000001.npz",
    ]

    resumed_model = ToyModel()
    resumed = attnflow.evaluate.faithfulness(
        resumed_model.functions("toy"), ids, output=tmp_path, **options
    )
    assert resumed_model.calls == 2  # chunks 2 and 3 of 4 only
    assert resumed.to_markdown() == fresh.to_markdown()
    for key in fresh.samples:
        np.testing.assert_array_equal(resumed.samples[key], fresh.samples[key], err_msg=key)
    # A third run computes nothing and gives the same report again.
    idle = ToyModel()
    again = attnflow.evaluate.faithfulness(idle.functions("toy"), ids, output=tmp_path, **options)
    assert idle.calls == 0
    assert again.to_markdown() == fresh.to_markdown()
    manifest = json.loads((tmp_path / "evaluation.json").read_text())
    assert manifest["samples"] == SAMPLES
    assert manifest["methods"] == ["raw", "rollout", "flow"]


def test_killed_process_resumes_to_the_identical_table(tmp_path: Path) -> None:
    # A run in another process is killed with SIGKILL after its second chunk; the rerun
    # finishes the rest and prints the table of an uninterrupted run.
    script = tmp_path / "evaluate.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys, time
            import numpy as np
            import attnflow

            rng = np.random.default_rng(5)
            ids = rng.integers(1, 9, size=(12, 5))
            table = rng.normal(size=(9, 4))

            def predict(batch, mask):
                logits = np.tanh(table[batch].sum(axis=1))[:, :2] * 3
                e = np.exp(logits - logits.max(axis=1, keepdims=True))
                return e / e.sum(axis=1, keepdims=True)

            def attentions(batch, mask):
                if sys.argv[2] == "slow":
                    time.sleep(0.4)
                s = table[batch]
                w = np.exp(np.einsum("bid,bjd->bij", s, s))[:, None, None]
                w = np.repeat(w, 3, axis=1)
                return w / w.sum(axis=-1, keepdims=True)

            report = attnflow.evaluate.faithfulness(
                attnflow.evaluate.ModelFunctions(predict, attentions), ids, replacement=0,
                references=["blank_out"], chunk_size=2, output=sys.argv[1] or None,
            )
            print(report.to_markdown())
            """
        )
    )
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    folder = tmp_path / "results"
    process = subprocess.Popen([sys.executable, str(script), str(folder), "slow"], env=env)
    deadline = time.monotonic() + 60
    while len(list(folder.glob("chunk-*.npz"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    process.kill()
    process.wait()
    written = len(list(folder.glob("chunk-*.npz")))
    assert 2 <= written < 6, written
    run = functools.partial(subprocess.run, capture_output=True, text=True, check=True, env=env)
    resumed = run([sys.executable, str(script), str(folder), "fast"]).stdout
    fresh = run([sys.executable, str(script), "", "fast"]).stdout
    assert resumed == fresh
    assert "Spearman correlation with blank-out" in fresh
    assert not list(folder.glob(".chunk-*"))  # no temporary file left behind


def test_flow_workers_lost_costs_one_retry_of_that_chunk(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    ids, mask, _ = dataset

    class DiesOnce(ThreadPoolExecutor):
        """Its first task fails as a process pool does when a worker is killed."""

        died = False

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            if not DiesOnce.died:
                DiesOnce.died = True
                future: Future[Any] = Future()
                future.set_exception(BrokenProcessPool("a worker was killed"))
                return future
            return super().submit(fn, *args, **kwargs)

    options: dict[str, Any] = {
        "replacement": UNK,
        "mask": mask,
        "references": ["blank_out"],
        "fractions": None,
    }
    serial = attnflow.evaluate.faithfulness(ToyModel().functions(), ids, **options)
    with DiesOnce(max_workers=2) as executor:
        retried = attnflow.evaluate.faithfulness(
            ToyModel().functions(), ids, executor=executor, **options
        )
    for key in serial.samples:
        np.testing.assert_array_equal(retried.samples[key], serial.samples[key], err_msg=key)
    assert "running them again" in caplog.text


@pytest.mark.with_backend("dask")
def test_dask_local_cluster_equals_serial(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    if "dask" in {v.library for v in selected_variants()}:
        import distributed  # requested with dask: it must be installed
    else:
        distributed = pytest.importorskip(
            "distributed", reason="the Dask cluster test runs in the dask session"
        )
    ids, mask, labels = dataset
    options: dict[str, Any] = {"replacement": UNK, "mask": mask, "targets": labels, "chunk_size": 3}
    serial = attnflow.evaluate.faithfulness(ToyModel().functions(), ids, **options)
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        clustered = attnflow.evaluate.faithfulness(
            ToyModel().functions(), ids, executor=client.get_executor(), **options
        )
    for key in serial.samples:
        np.testing.assert_array_equal(clustered.samples[key], serial.samples[key], err_msg=key)


def test_two_processes_with_n_jobs_equal_serial(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    ids, mask, labels = dataset
    options: dict[str, Any] = {
        "replacement": UNK,
        "mask": mask,
        "targets": labels,
        "methods": ["flow"],
    }
    serial = attnflow.evaluate.faithfulness(ToyModel().functions(), ids, n_jobs=1, **options)
    parallel = attnflow.evaluate.faithfulness(ToyModel().functions(), ids, n_jobs=2, **options)
    for key in serial.samples:
        np.testing.assert_array_equal(parallel.samples[key], serial.samples[key], err_msg=key)


def test_folder_of_another_evaluation_is_refused(
    tmp_path: Path, dataset: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    ids, mask, _ = dataset
    options: dict[str, Any] = {
        "replacement": UNK,
        "mask": mask,
        "fractions": None,
        "references": ["blank_out"],
    }
    attnflow.evaluate.faithfulness(ToyModel().functions(), ids, output=tmp_path, **options)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(EvaluationFolderError, match="differs in rows"):
        attnflow.evaluate.faithfulness(
            ToyModel().functions(), ids, output=tmp_path, rows="max", **options
        )
    with pytest.raises(EvaluationFolderError, match="differs in data"):
        attnflow.evaluate.faithfulness(
            ToyModel().functions(), ids[::-1].copy(), output=tmp_path, **options
        )
    with pytest.raises(EvaluationFolderError, match="blank_out_last_token"):
        attnflow.evaluate.faithfulness(
            ToyModel().functions(), ids, output=tmp_path, blank_out_last_token="zero", **options
        )
    with pytest.raises(EvaluationFolderError, match="differs in correlation"):
        attnflow.evaluate.faithfulness(
            ToyModel().functions(), ids, output=tmp_path, correlation="spearman_dense", **options
        )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing touched

    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("mine")
    with pytest.raises(EvaluationFolderError, match="is not empty"):
        attnflow.evaluate.faithfulness(ToyModel().functions(), ids, output=unrelated, **options)
    assert (unrelated / "notes.txt").read_text() == "mine"


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_runs(tmp_path: Path) -> None:
    from attnflow.evaluate._store import ChunkStore

    settings = {"methods": ["rollout"]}
    chunks = [(0, 3)]
    with (
        ChunkStore(tmp_path, settings, chunks).open(),
        pytest.raises(EvaluationFolderError, match="another evaluation is writing"),
        ChunkStore(tmp_path, settings, chunks).open(),
    ):
        pass
    with ChunkStore(tmp_path, settings, chunks).open() as store:  # released: usable again
        store.write(0, {"x": np.arange(3)})
        with pytest.raises(EvaluationFolderError, match="appeared while"):
            store.write(0, {"x": np.arange(1, 4)})
        np.testing.assert_array_equal(store.read(0)["x"], np.arange(3))


def _identified(seed: int) -> attnflow.evaluate.ModelFunctions:
    model = ToyModel(seed)
    return attnflow.evaluate.ModelFunctions(
        model.predict, model.attentions, model.input_gradients, identity=f"toy seed {seed}"
    )


def test_a_rerun_with_another_model_is_refused_naming_it(
    tmp_path: Path, dataset: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    # Issue 22.1: the folder records the model's identity; another model's rerun (or a
    # resumed run) is refused rather than given the first model's chunks.
    ids, mask, _ = dataset
    options: dict[str, Any] = {
        "replacement": UNK,
        "mask": mask,
        "references": ["blank_out"],
        "fractions": None,
        "chunk_size": 4,
    }
    attnflow.evaluate.faithfulness(_identified(2), ids, output=tmp_path, **options)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(
        EvaluationFolderError,
        match=r"in model \(the folder's: toy seed 2; this run's: toy seed 5\)",
    ):
        attnflow.evaluate.faithfulness(_identified(5), ids, output=tmp_path, **options)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing touched
    # force=True discards the first model's results: the report is the second model's.
    forced = attnflow.evaluate.faithfulness(
        _identified(5), ids, output=tmp_path, force=True, **options
    )
    fresh = attnflow.evaluate.faithfulness(_identified(5), ids, **options)
    for key in fresh.samples:
        np.testing.assert_array_equal(forced.samples[key], fresh.samples[key], err_msg=key)
    assert json.loads((tmp_path / "evaluation.json").read_text())["model"] == "toy seed 5"


def _closures(weights: np.ndarray) -> attnflow.evaluate.ModelFunctions:
    """A model as a new user writes it: a factory of closures over its weights, no identity."""

    def predict(ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        logits = weights[ids].sum(axis=1)[:, :2]
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def attentions(ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        states = weights[ids]
        w = np.exp(np.einsum("bid,bjd->bij", states, states))[:, None, None]
        w = np.repeat(np.repeat(w, HEADS, axis=2), LAYERS, axis=1)
        return w / w.sum(axis=-1, keepdims=True)

    return attnflow.evaluate.ModelFunctions(predict, attentions)


def test_closures_over_other_weights_never_get_the_first_models_table(
    tmp_path: Path, dataset: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    # Without an identity, the folder records a digest of the functions: their code and
    # the weights they captured. A factory's second model is refused, not served the
    # first one's results; the first model's rerun resumes.
    ids, mask, _ = dataset
    options: dict[str, Any] = {
        "replacement": UNK,
        "mask": mask,
        "references": ["blank_out"],
        "fractions": None,
        "chunk_size": 4,
    }
    rng = np.random.default_rng(3)
    first, second = (rng.normal(size=(VOCABULARY, 4)) for _ in range(2))
    attnflow.evaluate.faithfulness(_closures(first), ids, output=tmp_path, **options)
    recorded = json.loads((tmp_path / "evaluation.json").read_text())["model"]
    assert recorded.startswith("functions sha256:")
    again = attnflow.evaluate.faithfulness(_closures(first.copy()), ids, output=tmp_path, **options)
    fresh_first = attnflow.evaluate.faithfulness(_closures(first), ids, **options)
    assert again.to_markdown() == fresh_first.to_markdown()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(EvaluationFolderError, match=r"differs in model \(the folder's: functions"):
        attnflow.evaluate.faithfulness(_closures(second), ids, output=tmp_path, **options)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    forced = attnflow.evaluate.faithfulness(
        _closures(second), ids, output=tmp_path, force=True, **options
    )
    fresh = attnflow.evaluate.faithfulness(_closures(second), ids, **options)
    assert forced.to_markdown() == fresh.to_markdown() != fresh_first.to_markdown()


def test_functions_whose_state_cannot_be_read_are_never_resumed(
    tmp_path: Path,
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Bound methods of an object (its state is its own): no digest can tell two such
    # models apart, so their folder is written once and refused afterwards.
    ids, mask, _ = dataset
    options: dict[str, Any] = {
        "replacement": UNK,
        "mask": mask,
        "references": ["blank_out"],
        "fractions": None,
    }
    attnflow.evaluate.faithfulness(ToyModel(2).functions(), ids, output=tmp_path, **options)
    assert "cannot be resumed" in caplog.text
    assert json.loads((tmp_path / "evaluation.json").read_text())["model"] is None
    other = ToyModel(5)
    with pytest.raises(EvaluationFolderError, match="cannot be resumed: its model functions"):
        attnflow.evaluate.faithfulness(other.functions(), ids, output=tmp_path, **options)
    assert other.calls == 0  # refused before any work
    forced = attnflow.evaluate.faithfulness(
        other.functions(), ids, output=tmp_path, force=True, **options
    )
    fresh = attnflow.evaluate.faithfulness(ToyModel(5).functions(), ids, **options)
    assert forced.to_markdown() == fresh.to_markdown()


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (
            functools.partial(attnflow.rollout, residual=0.3),
            functools.partial(attnflow.rollout, residual=0.6),
        ),
        (attnflow.rollout, attnflow.raw),
        (lambda a, **k: attnflow.rollout(a, **k) * 2, lambda a, **k: attnflow.rollout(a, **k) ** 2),
    ],
    ids=["partial-options", "function", "lambda"],
)
def test_another_function_under_a_method_name_is_refused(
    tmp_path: Path, dataset: tuple[np.ndarray, np.ndarray, np.ndarray], first: Any, second: Any
) -> None:
    ids, mask, _ = dataset
    options: dict[str, Any] = {
        "replacement": UNK,
        "mask": mask,
        "references": ["blank_out"],
        "fractions": None,
    }
    attnflow.evaluate.faithfulness(
        _identified(2), ids, output=tmp_path, methods={"mine": first}, **options
    )
    again = attnflow.evaluate.faithfulness(
        _identified(2), ids, output=tmp_path, methods={"mine": first}, **options
    )  # the same function: resumed
    with pytest.raises(
        EvaluationFolderError, match=r"in functions 'mine' \(the folder's: .*; this run's: "
    ):
        attnflow.evaluate.faithfulness(
            _identified(2), ids, output=tmp_path, methods={"mine": second}, **options
        )
    fresh = attnflow.evaluate.faithfulness(_identified(2), ids, methods={"mine": first}, **options)
    np.testing.assert_array_equal(again.samples["scores.mine"], fresh.samples["scores.mine"])


def _damage(folder: Path, how: str) -> None:
    """Damage chunk 0 of `folder` as a user or a faulty copy might."""
    chunk = folder / "chunk-000000.npz"
    if how == "copied over":
        chunk.write_bytes((folder / "chunk-000001.npz").read_bytes())
        return
    with np.load(chunk, allow_pickle=False) as loaded:
        arrays = {name: np.array(loaded[name]) for name in loaded.files}
    if how == "rows cut":
        arrays = {k: v if v.ndim == 0 else v[:-1] for k, v in arrays.items()}
    else:  # values changed, shapes kept
        arrays["scores.rollout"] = arrays["scores.rollout"][::-1].copy()
    chunk.unlink()
    np.savez(chunk, **arrays)


@pytest.mark.parametrize("how", ["copied over", "rows cut", "values changed"])
def test_a_damaged_chunk_is_refused_by_name_and_recomputed_with_force(
    tmp_path: Path, dataset: tuple[np.ndarray, np.ndarray, np.ndarray], how: str
) -> None:
    # Issue 22.2: each chunk carries its number, samples, row count and checksum.
    ids, mask, labels = dataset
    options: dict[str, Any] = {
        "replacement": UNK,
        "mask": mask,
        "targets": labels,
        "methods": ["raw", "rollout"],
        "fractions": None,
        "chunk_size": 3,
    }
    fresh = attnflow.evaluate.faithfulness(_identified(2), ids, **options)
    attnflow.evaluate.faithfulness(_identified(2), ids, output=tmp_path, **options)
    _damage(tmp_path, how)
    expected = {
        "copied over": r"holds chunk 1 \(samples 3-5\), not chunk 0 \(samples 0-2\)",
        "rows cut": "holds 2 rows where chunk 0 has 3",
        "values changed": "does not match its checksum",
    }[how]
    model = ToyModel(2)
    functions = attnflow.evaluate.ModelFunctions(
        model.predict, model.attentions, model.input_gradients, identity="toy seed 2"
    )
    with pytest.raises(EvaluationFolderError, match=f"chunk-000000.npz {expected}"):
        attnflow.evaluate.faithfulness(functions, ids, output=tmp_path, **options)
    assert model.calls == 0  # checked before any work
    forced = attnflow.evaluate.faithfulness(functions, ids, output=tmp_path, force=True, **options)
    assert model.calls == 1  # chunk 0 only
    for key in fresh.samples:
        np.testing.assert_array_equal(forced.samples[key], fresh.samples[key], err_msg=key)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"methods": ["rollout", "shapley"]}, ValueError, "unknown methods"),
        ({"methods": {"Roll out": attnflow.rollout}}, ValueError, "method names must be"),
        ({"rows": "first"}, ValueError, "`rows` must be one of"),
        ({"references": ["saliency"]}, ValueError, "`references` must be distinct names"),
        ({"chunk_size": 0}, ValueError, "`chunk_size` must be a positive int"),
        ({"targets": [0, 1]}, ValueError, "one non-negative integer class per sample"),
        ({"where": np.ones(N + 1, dtype=bool)}, ValueError, "`where` must be a boolean array"),
        ({"n_jobs": 0}, ValueError, "`n_jobs` must be None"),
        (
            {"correlation": "pearson"},
            ValueError,
            r"`correlation` must be one of \('spearman', 'kendall', 'spearman_dense'\)",
        ),
        (
            {"blank_out_last_token": "drop"},
            ValueError,
            r"`blank_out_last_token` must be one of \('blank', 'zero'\)",
        ),
        (
            {"blank_out_score": "ratio"},
            ValueError,
            r"`blank_out_score` must be one of \('drop', 'abs', 'margin', 'abs_margin'\)",
        ),
        ({"nan": "one"}, ValueError, r"`nan` must be one of \('zero', 'omit'\)"),
        (
            {"blank_out_last_token": "zero", "references": ["input_gradients"]},
            ValueError,
            "has no 'blank_out'",
        ),
        ({"fractions": [2.0]}, ValueError, r"numbers in \(0, 1\]"),
    ],
)
def test_bad_arguments_fail_before_the_model_runs(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    ids, mask, _ = dataset
    model = ToyModel()
    with pytest.raises(error, match=match):
        attnflow.evaluate.faithfulness(model.functions(), ids, replacement=UNK, mask=mask, **kwargs)
    assert model.calls == 0


def test_gradients_reference_needs_a_gradient_function(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    ids, _, _ = dataset
    model = ToyModel()
    functions = attnflow.evaluate.ModelFunctions(model.predict, model.attentions)
    with pytest.raises(ValueError, match=r"`model\.input_gradients` is None"):
        attnflow.evaluate.faithfulness(functions, ids, replacement=UNK)
    with pytest.raises(TypeError, match=r"must be an attnflow\.evaluate\.ModelFunctions"):
        attnflow.evaluate.faithfulness(model, ids, replacement=UNK)  # type: ignore[arg-type]


def test_report_tables_and_figure(dataset: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    ids, mask, labels = dataset
    report = attnflow.evaluate.faithfulness(
        ToyModel().functions(), ids, replacement=UNK, mask=mask, targets=labels
    )
    text = report.to_markdown()
    for expected in (
        "with blank-out",
        "with input gradients",
        "comprehensiveness AOPC",
        "| rollout |",
    ):
        assert expected in text
    rows = report.records()
    assert len(rows) == 3 * LAYERS * 4  # methods x layers x (2 correlations + 2 AOPCs)
    assert json.loads(report.to_json())["accuracy"] == report.accuracy
    assert "<table>" in report._repr_html_()


def test_report_figure(dataset: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    if "numpy" not in {v.library for v in selected_variants()}:
        pytest.importorskip("matplotlib", reason="the figures are tested in the numpy session")
    ids, mask, labels = dataset
    report = attnflow.evaluate.faithfulness(
        ToyModel().functions(), ids, replacement=UNK, mask=mask, targets=labels
    )
    figure = report.plot()
    assert len(figure.axes) == 4  # two references, two AOPC panels
    first = figure.axes[0]
    lines = {line.get_label(): line for line in first.get_lines()}
    np.testing.assert_allclose(
        lines["flow"].get_ydata(), report.correlation_mean("flow", "blank_out")
    )


@pytest.mark.parametrize("fused", [False, True])
def test_saved_outputs_give_the_same_correlations(
    tmp_path: Path, dataset: tuple[np.ndarray, np.ndarray, np.ndarray], fused: bool
) -> None:
    ids, mask, labels = dataset
    model = ToyModel()
    report = attnflow.evaluate.faithfulness(
        model.functions(),
        ids,
        replacement=UNK,
        mask=mask,
        targets=labels,
        fractions=None,
        rows="max",
    )
    attentions = model.attentions(ids, mask)
    if fused:
        attentions = attnflow.fuse_heads(attentions)
    references = {r: report.samples[f"reference.{r}"] for r in ("blank_out", "input_gradients")}
    saved = attnflow.evaluate.faithfulness_from_outputs(
        attentions,
        references,
        mask=mask,
        predictions=report.samples["predicted"],
        labels=labels,
        rows="max",
        chunk_size=3,
        output=tmp_path,
    )
    assert saved.accuracy == report.accuracy
    # Fusing first changes the last bits of the scores, which can reorder near-ties:
    # correlations are compared exactly for the per-head input only.
    compared = ("scores.",) if fused else ("correlation.", "scores.")
    for key in report.samples:
        if key.startswith(compared):
            np.testing.assert_allclose(
                saved.samples[key], report.samples[key], rtol=0, atol=1e-12, err_msg=key
            )
    with pytest.raises(ValueError, match="one value per token"):
        attnflow.evaluate.faithfulness_from_outputs(
            attentions, {"blank_out": references["blank_out"][:, :3]}
        )


def test_a_folder_of_an_older_store_is_refused_as_such(
    tmp_path: Path, dataset: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> None:
    # Chunks written before the store recorded identities and checksums cannot be
    # checked: refused (naming why), recomputed with force=True.
    ids, mask, _ = dataset
    options: dict[str, Any] = {"replacement": UNK, "mask": mask, "fractions": None}
    options["references"] = ["blank_out"]
    attnflow.evaluate.faithfulness(_identified(2), ids, output=tmp_path, **options)
    manifest = json.loads((tmp_path / "evaluation.json").read_text())
    del manifest["store"], manifest["model"], manifest["functions"]
    (tmp_path / "evaluation.json").write_text(json.dumps(manifest))
    with pytest.raises(EvaluationFolderError, match="another version of attnflow"):
        attnflow.evaluate.faithfulness(_identified(2), ids, output=tmp_path, **options)
    attnflow.evaluate.faithfulness(_identified(2), ids, output=tmp_path, force=True, **options)
    assert json.loads((tmp_path / "evaluation.json").read_text())["store"] == 2


class CountingModel(ToyModel):
    """ToyModel that records every row (ids and mask) handed to `predict`."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bytes] = []

    def predict(self, ids: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        ids, mask = np.asarray(ids), np.asarray(mask)
        self.seen += [
            row.tobytes() + row_mask.tobytes() for row, row_mask in zip(ids, mask, strict=True)
        ]
        return super().predict(ids, mask)


def _counting_run(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray], chunk_size: int = 3
) -> tuple[CountingModel, attnflow.evaluate.FaithfulnessReport]:
    ids, mask, labels = dataset
    model = CountingModel()
    report = attnflow.evaluate.faithfulness(
        model.functions(),
        ids,
        replacement=UNK,
        targets=labels,
        mask=mask,
        references=["blank_out"],
        fractions=(0.2, 0.5, 1.0),
        chunk_size=chunk_size,
    )
    return model, report


def test_each_chunk_predicts_each_input_once(
    dataset: tuple[np.ndarray, np.ndarray, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pass over the unperturbed sequences per chunk, shared by every metric and method.

    Blank-out, and comprehensiveness and sufficiency of the three methods, each need the
    prediction of the originals (8 passes per chunk without the chunk's cache), and the
    methods often remove the same tokens. The results are those of the uncached path, bit
    for bit.
    """
    ids, mask, _ = dataset
    originals = [
        row.tobytes() + row_mask.tobytes() for row, row_mask in zip(ids, mask, strict=True)
    ]
    assert len(set(originals)) == SAMPLES
    model, report = _counting_run(dataset)
    for original in originals:
        assert model.seen.count(original) == 1
    one_chunk, _ = _counting_run(dataset, chunk_size=SAMPLES)
    assert len(one_chunk.seen) == len(set(one_chunk.seen))  # no input of a chunk twice

    from attnflow.evaluate import _faithfulness

    monkeypatch.setattr(
        _faithfulness, "shared_predictions", lambda predict: contextlib.nullcontext()
    )
    uncached, expected = _counting_run(dataset)
    # The prediction, blank-out, 2 metrics x 3 methods, and sufficiency at fraction 1
    # (every token kept: the original again) x 3 methods.
    for original in originals:
        assert uncached.seen.count(original) == 11
    assert len(uncached.seen) > len(model.seen)
    assert report.samples.keys() == expected.samples.keys()
    for key, values in expected.samples.items():
        np.testing.assert_array_equal(report.samples[key], values, err_msg=key)
