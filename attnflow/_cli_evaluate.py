"""``attnflow evaluate FILE``: faithfulness tables and figures, resumable, from saved outputs.

``attnflow evaluate FILE -o FOLDER`` reads model outputs saved earlier (``.npz`` or
``.safetensors``, never unpickled): ``attentions`` ``(N, layers, [heads,] n, n)`` and
reference scores ``blank_out`` and/or ``input_gradients`` ``(N, n)``; optionally ``mask``,
``where`` ``(N, n)``, ``predictions`` and ``labels`` ``(N,)``. It writes per-chunk results
into FOLDER (a rerun resumes), then ``report.md``, ``report.json``, ``report.html`` and one
``faithfulness-<rows>.png`` per explained row. A FOLDER holding another run's results
(other settings, data or methods) or a damaged chunk is refused with what differs;
``--force`` replaces them instead.

The paper's reproductions (``agreement``, ``sentiment``) are the lab's:
``attnflow-lab evaluate agreement|sentiment`` (``pip install ./lab``).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["configure_evaluate", "run_evaluate"]

_SAVED_REFERENCES = ("blank_out", "input_gradients")
_LAB_SOURCES = ("agreement", "sentiment")
_OWN_NAMES = ("report.md", "report.json", "report.html")


def configure_evaluate(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow evaluate``."""
    from .evaluate._correlation import RANK_CORRELATIONS

    parser.add_argument(
        "source",
        help="a file of saved model outputs (.npz/.safetensors with attentions and blank_out "
        "and/or input_gradients)",
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
        help='the explained output row(s), comma-separated: an int, "max" or "mean" (default: "0")',
    )
    parser.add_argument(
        "--correlation",
        choices=RANK_CORRELATIONS,
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
        "other settings, data or methods, and damaged chunks; files this command did not "
        "write are never touched",
    )


def _parse_rows(text: str) -> list[int | str]:
    from ._cli_common import UsageError

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


def _check_folder(folder: Path) -> None:
    """Refuse a folder holding anything but an earlier run of this command."""
    from ._cli_common import UsageError

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
            f"{folder} holds files that attnflow evaluate did not write ({', '.join(foreign[:3])}); "
            "choose a new or empty folder"
        )
        raise UsageError(msg)


def _write_text(path: Path, text: str) -> None:
    """Replace one of this command's own report files atomically."""
    _replace_atomically(path, lambda file: file.write(text.encode("utf-8")))


def _replace_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write one of this command's own report files atomically, replacing the last run's."""
    from ._atomic import write_atomically

    write_atomically(path, write, replace=True, exists=FileExistsError)


def _row_name(row: int | str) -> str:
    return f"rows-{row}"


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
    """Write the Markdown, JSON and HTML reports and one figure per report.

    `reports` are keyed by explained row (or any label); `titles` names their sections
    (by default from the row) and `papers` gives published numbers to draw beside them.
    """
    from ._cli_common import has_module
    from .html import _page

    markdown = [f"# {heading}", ""]
    if preamble:
        markdown += [preamble, ""]
    pages = []
    figures: list[Path] = []
    for row, report in reports.items():
        title = (titles or {}).get(row) or _row_title(row)
        markdown += [f"## {title}", "", report.to_markdown(), ""]
        pages.append(f"<h2>{html.escape(title)}</h2>{report.to_html()}")
        if has_module("matplotlib"):
            figure = report.plot(paper=(papers or {}).get(row), title=f"{heading}: {title}")
            path = folder / f"faithfulness-{row}.png"
            _replace_atomically(path, partial(figure.savefig, format="png", dpi=150))
            figures.append(path)
            pages.append(f'<img src="{html.escape(path.name)}" alt="faithfulness by layer">')
    if appendix:
        markdown += [appendix, ""]
    summary = {str(row): report.to_dict() for row, report in reports.items()}
    _write_text(folder / "report.md", "\n".join(markdown))
    _write_text(folder / "report.json", json.dumps(summary, indent=2) + "\n")
    page = _page(
        heading,
        "body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem}"
        "table{border-collapse:collapse;margin:1rem 0}caption{text-align:left;font-weight:600;"
        "padding:.3rem 0}td,th{border:1px solid #ccc;padding:.25rem .6rem;text-align:right}"
        "td:first-child,th:first-child{text-align:left}img{max-width:100%}\n",
        f"<h1>{html.escape(heading)}</h1><p>{html.escape(preamble)}</p>{''.join(pages)}",
    )
    _write_text(folder / "report.html", page)
    return [folder / "report.md", folder / "report.json", folder / "report.html", *figures]


def _run_saved(args: argparse.Namespace, folder: Path, rows: list[int | str]) -> dict[Any, Any]:
    from ._arrayio import ArrayFileError, read_selected
    from ._cli_common import UsageError
    from ._header_checks import check_saved_outputs
    from .evaluate import faithfulness_from_outputs

    try:  # every header checked (shapes, rows) before any data is read
        arrays = read_selected(
            args.source,
            required=("attentions",),
            optional=(*_SAVED_REFERENCES, "mask", "where", "predictions", "labels"),
            check=lambda headers: check_saved_outputs(headers, _SAVED_REFERENCES, rows),
        )
    except ArrayFileError as error:
        raise UsageError(str(error)) from None
    references = {name: arrays[name] for name in _SAVED_REFERENCES if name in arrays}
    mask = arrays.get("mask")
    reports = {}
    for row in rows:
        reports[row] = faithfulness_from_outputs(
            arrays["attentions"],
            references,
            mask=None if mask is None else mask.astype(bool),
            where=None if "where" not in arrays else arrays["where"].astype(bool),
            predictions=arrays.get("predictions"),
            labels=arrays.get("labels"),
            methods=args.methods.split(","),
            rows=row,  # type: ignore[arg-type]  # checked by faithfulness_from_outputs
            correlation=args.correlation,
            chunk_size=args.chunk_size,
            output=folder / _row_name(row),
            force=args.force,
            n_jobs=args.jobs,
            progress=not args.quiet,
        )
    write_reports(folder, reports, heading=f"Faithfulness of {Path(args.source).name}")
    return reports


class FolderRefused(RuntimeError):
    """The output folder holds something this run must not reuse or replace (exit 1)."""


def run_evaluate(args: argparse.Namespace) -> int:
    """Run ``attnflow evaluate``; print the tables and where the files went."""
    from .evaluate import EvaluationFolderError

    try:
        return _run_evaluate(args)
    except (EvaluationFolderError, ValueError, FileExistsError) as error:
        text = str(error)
        if "`force=True`" not in text:
            raise
        # The library's advice in the command's words.
        raise FolderRefused(text.replace("pass `force=True`", "rerun with --force")) from None


def _run_evaluate(args: argparse.Namespace) -> int:
    from ._cli_common import UsageError

    folder = Path(args.output)
    _check_folder(folder)
    if args.jobs is not None and args.jobs < 1 and args.jobs != -1:
        msg = f"--jobs must be a positive number of threads or -1; got {args.jobs}"
        raise UsageError(msg)
    if args.source in _LAB_SOURCES and not Path(args.source).is_file():
        msg = (
            f"the paper's {args.source} reproduction is the lab's command: pip install ./lab "
            f"(from attnflow's repository), then attnflow-lab evaluate {args.source} "
            f"-o {args.output}"
        )
        raise UsageError(msg)
    if not Path(args.source).is_file():
        msg = f"{args.source} is not a file of saved model outputs"
        raise UsageError(msg)
    rows = _parse_rows(args.rows or "0")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        reports = _run_saved(args, folder, rows)
    except BaseException:
        # A refused input leaves nothing behind: the folder this run made, if still empty.
        if created and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        raise
    files = sorted(folder.glob("report.*")) + sorted(folder.glob("faithfulness-*.png"))
    for row, report in reports.items():
        print(f"\n{_row_title(row)}\n")
        print(report.to_markdown())
    print(f"\nwrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0
