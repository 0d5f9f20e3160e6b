"""``attnflow gradient-rollout`` and ``attnflow encoder-decoder``: the variants' commands.

Imported by :mod:`attnflow._cli` when one of these commands runs or is configured; the
input reading, output naming, atomic writing and the top-tokens table are ``_cli``'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ._arrayio import ArrayFileError, ArrayHeader, read_array, read_header, read_selected
from ._cli_common import UsageError, has_module
from ._cli_flags import (
    add_decoder_flags,
    add_flow_limits,
    add_mask_and_tokens,
    errors_in_flags,
    flow_limits,
    in_flags,
)
from ._cli_methods import (
    _attention_accept,
    _decoder_options,
    _first_row_table,
    _layer_axis,
    _mask_accept,
    _output_and_selection,
    _output_path,
    _parse_heads,
    _parse_layers,
    _parse_rows,
    _read_tokens,
    _write_output,
)
from ._deprecation import REMOVED_IN
from ._header_checks import check_encoder_decoder
from ._methods import METHODS
from ._validation import check_layers, check_rows

__all__ = [
    "configure_encoder_decoder",
    "configure_gradient_rollout",
    "run_encoder_decoder",
    "run_gradient_rollout",
]

_GRADIENT_FLAGS = {
    "normalize_result": "--normalize-result",
    "normalize": "--normalize-result",
    "exclude_self": "--exclude-self",
    "rule": "--rule",
    # Attentions and gradients may share one file: keep their array names.
    "attentions": "`attentions`",
}
"""gradient-rollout's flags where they differ from flow's (``--normalize-result``, not
``--raw-values``)."""
_ENCODER_DECODER_ARRAYS = ("encoder", "decoder", "cross")
_ENCODER_DECODER_GRADIENTS = tuple(f"{name}_gradients" for name in _ENCODER_DECODER_ARRAYS)


class _NormalizeResult(argparse.Action):
    """``--normalize-result``; its old spelling ``--normalize`` works until 0.2, with a note."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,  # noqa: ARG002 - argparse's signature
        namespace: argparse.Namespace,
        values: object,  # noqa: ARG002 - a flag takes no value
        option_string: str | None = None,
    ) -> None:
        if option_string == "--normalize":
            print(
                "attnflow: --normalize is renamed --normalize-result (same meaning); "
                f"--normalize will be removed in attnflow {REMOVED_IN}.",
                file=sys.stderr,
            )
        setattr(namespace, self.dest, True)


def _shared_options(parser: argparse.ArgumentParser, *, name: str) -> None:
    _output_and_selection(parser, name=name)
    parser.add_argument(
        "--residual",
        type=float,
        default=None,
        help="weight of the identity (default 0.5); only for --rule "
        + ("weighted" if name in METHODS and METHODS[name].gradients else "rollout"),
    )
    parser.add_argument(
        "--normalize-result",
        "--normalize",
        dest="normalize_result",
        action=_NormalizeResult,
        nargs=0,
        default=False,
        help="divide each row of the result by its sum (--normalize is its deprecated spelling)",
    )
    parser.add_argument(
        "--top", type=int, default=10, help="tokens to show in the table (default 10)"
    )
    parser.add_argument(
        "--no-validate", action="store_true", help="skip the checks on the attention values"
    )


def _check_residual_rule(
    args: argparse.Namespace, *, applies_to: tuple[str, ...]
) -> dict[str, float]:
    """``--residual``: refused with a rule that ignores it, checked in [0, 1]."""
    from ._validation import check_residual

    if args.residual is None:
        return {}
    if args.rule not in applies_to:
        rules = " or ".join(f"--rule {rule}" for rule in applies_to)
        msg = (
            f"--residual applies to {rules} only (--rule {args.rule} adds the "
            f"identity itself); got --residual {args.residual} with --rule {args.rule}"
        )
        raise UsageError(msg)
    try:
        return {"residual": check_residual(args.residual)}
    except (TypeError, ValueError):
        msg = f"--residual must be a number in [0, 1]; got {args.residual}"
        raise UsageError(msg) from None


# -- attnflow gradient-rollout ------------------------------------------------------------


def _check_gradients(gradients: ArrayHeader, attentions: ArrayHeader, path: Path) -> None:
    """Refuse gradients that are not floats shaped as the attention, before reading either."""
    if gradients.dtype.kind != "f" or gradients.shape != attentions.shape:
        msg = (
            f"{path}: the gradients {gradients.name!r} must be floating point and shaped as "
            f"the attention, {attentions.shape}; the file stores {gradients.stored} of shape "
            f"{gradients.shape}"
        )
        raise UsageError(msg)


def configure_gradient_rollout(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow gradient-rollout``."""
    parser.add_argument(
        "input",
        help="attention weights (*batch, layers, heads, n, n): .npy, .npz or .safetensors; "
        "without --gradients an .npz/.safetensors holding arrays 'attentions' and 'gradients'",
    )
    parser.add_argument(
        "--gradients",
        help="the gradients dy/dA, shaped like the attentions, same layer order (.npy, .npz "
        "or .safetensors); default: the array 'gradients' of INPUT",
    )
    parser.add_argument("--key", help="the attention array to read (default 'attentions')")
    parser.add_argument("--gradients-key", help="the gradient array to read (default 'gradients')")
    parser.add_argument(
        "--rule",
        choices=("gae", "weighted"),
        default="gae",
        help="gae: Chefer et al.'s additive rule (default); weighted: rollout of the "
        "gradient-weighted attention",
    )
    _shared_options(parser, name="gradient_rollout")
    parser.add_argument(
        "--exclude-self",
        action="store_true",
        help="zero each row's own position (with --rows 0: Chefer's [CLS] row without [CLS])",
    )
    # --receptive-field, --exclude
    add_decoder_flags(
        parser, uniform="the rule's result on uniform causal attention with unit gradients"
    )
    add_mask_and_tokens(parser)  # --mask, --mask-key, --tokens


def run_gradient_rollout(args: argparse.Namespace) -> int:
    """Read attentions and gradients, run :func:`attnflow.gradient_rollout`, write, report."""
    import attnflow

    method = "gradient_rollout"
    try:
        rows = _parse_rows(args.rows)
        layers = _parse_layers(args.layers)
        options: dict[str, object] = _decoder_options(args)
        options |= _check_residual_rule(args, applies_to=("weighted",))
        source = Path(args.input)
        if args.gradients is None and source.suffix.lower() == ".npy":
            msg = (
                f"{source} is an .npy file, which holds one array: pass --gradients GRADS, or "
                "an .npz/.safetensors holding 'attentions' and 'gradients'"
            )
            raise UsageError(msg)
        # The attention's header against --rows, --layers and --exclude, before the
        # output's "exists" check and before any data is read.
        header = read_header(source, key=args.key, default="attentions")
        try:
            _attention_accept({"heads": "mean", "rows": rows, "layers": layers, **options})(header)
        except (TypeError, ValueError, IndexError) as error:
            msg = f"{source}: {in_flags(str(error), flags=_GRADIENT_FLAGS)}"
            raise UsageError(msg) from None
        output = _output_path(source, args.output, method, force=args.force)
        # Every header before any data: the gradients and the mask must fit the attention.
        gradients_file = source if args.gradients is None else Path(args.gradients)
        gradients_key = args.gradients_key or ("gradients" if args.gradients is None else None)
        gradients_header = read_header(gradients_file, key=gradients_key, default="gradients")
        _check_gradients(gradients_header, header, gradients_file)
        mask_accept = _mask_accept(header, fused=False)
        if args.mask:
            mask_accept(read_header(args.mask, key=args.mask_key, default="mask"))
        attentions = read_array(source, key=args.key, default="attentions")
        gradients = read_array(gradients_file, key=gradients_key, default="gradients")
        mask = None
        if args.mask:
            mask = read_array(args.mask, key=args.mask_key, default="mask", accept=mask_accept)
        tokens = _read_tokens(args.tokens, attentions, option="--tokens")
    except (ArrayFileError, OSError) as error:
        raise UsageError(in_flags(str(error), flags=_GRADIENT_FLAGS)) from None

    with errors_in_flags(ValueError, TypeError, IndexError, flags=_GRADIENT_FLAGS):
        result = attnflow.gradient_rollout(
            attentions,
            gradients,
            rule=args.rule,
            normalize_result=args.normalize_result,
            rows=rows,
            layers=layers,  # type: ignore[arg-type]
            mask=mask,
            exclude_self=args.exclude_self,
            validate=not args.no_validate,
            **options,  # type: ignore[arg-type]
        )
    values = np.asarray(result)
    axis = _layer_axis(values, rows=rows, layers=layers, each=False)
    table = _first_row_table(values, tokens, top=args.top, layer_axis=axis)  # before writing
    written = _write_output(output, {method: values}, force=args.force)
    print(f"{method}: {source} -> {written}, shape {tuple(values.shape)}, dtype {values.dtype}")
    print("\n".join(table))
    return 0


# -- attnflow encoder-decoder -------------------------------------------------------------


def configure_encoder_decoder(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``attnflow encoder-decoder``."""
    parser.add_argument(
        "input",
        help="an .npz or .safetensors holding 'encoder' (*batch, L_e, heads, S, S), 'decoder' "
        "(*batch, L_d, heads, T, T) and 'cross' (*batch, L_d, heads, T, S); optionally "
        "'source_mask', 'target_mask' and, for --rule gae, 'encoder_gradients', "
        "'decoder_gradients', 'cross_gradients'",
    )
    parser.add_argument(
        "--rule",
        choices=("rollout", "gae", "flow"),
        default="rollout",
        help="rollout: residual in every sub-layer (default); gae: Chefer et al.'s "
        "encoder-decoder rules (needs the gradients); flow: max-flow on the rollout "
        "model's graph (rows normalised unless --raw-values)",
    )
    parser.add_argument(
        "--raw-values",
        action="store_true",
        help="--rule flow: raw max-flow values, rows not normalised",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="--rule flow: hide the progress bar"
    )
    add_flow_limits(parser, applies="--rule flow: ")  # --jobs, --max-seconds
    _shared_options(parser, name="encoder_decoder")
    parser.add_argument(
        "--heads",
        default="mean",
        help="'mean', 'max', 'min', 'none' (heads already fused) or weights (h1,h2,...); "
        "--rule gae needs 'mean'",
    )
    parser.add_argument("--source-tokens", help="a text file with one source token per line")
    parser.add_argument("--target-tokens", help="a text file with one target token per line")


def run_encoder_decoder(args: argparse.Namespace) -> int:
    """Read the three attention families and compose them (rollout, GAE or flow)."""
    import attnflow

    try:
        rows = _parse_rows(args.rows)
        layers = _parse_layers(args.layers)
        if args.heads == "each":
            msg = (
                "--heads must be 'mean', 'max', 'min', 'none' or weights for "
                "'attnflow encoder-decoder' (no per-head maps); got 'each'"
            )
            raise UsageError(msg)
        heads = _parse_heads(args.heads, method="encoder-decoder")
        if args.rule == "gae" and heads != "mean":
            msg = (
                "--heads must be 'mean' with --rule gae (Chefer's rule averages the "
                f"gradient-weighted heads); got --heads {args.heads}"
            )
            raise UsageError(msg)
        options: dict[str, object] = {**_check_residual_rule(args, applies_to=("rollout", "flow"))}
        if args.rule == "flow":
            if args.normalize_result:
                msg = (
                    "--normalize-result applies to --rule rollout or gae (--rule flow "
                    "normalises rows unless --raw-values); got --normalize-result with "
                    "--rule flow"
                )
                raise UsageError(msg)
            options["normalize_result"] = not args.raw_values
            options["progress"] = not args.no_progress and has_module("tqdm")
            options |= flow_limits(args)  # n_jobs, max_seconds
        else:
            for flag, given in (
                ("--raw-values", args.raw_values),
                ("--no-progress", args.no_progress),
                ("--jobs", args.jobs is not None),
                ("--max-seconds", args.max_seconds is not None),
            ):
                if given:
                    msg = f"{flag} applies to --rule flow only; got {flag} with --rule {args.rule}"
                    raise UsageError(msg)
            options["rule"] = args.rule
            options["normalize_result"] = args.normalize_result
        source = Path(args.input)
        if source.suffix.lower() not in {".npz", ".safetensors"}:
            msg = (
                "INPUT must be an .npz or .safetensors file holding 'encoder', 'decoder' and "
                f"'cross'; got {source.name!r}"
            )
            raise UsageError(msg)
        output = _output_path(source, args.output, "encoder_decoder", force=args.force)
        gae = args.rule == "gae"

        def check(headers: Mapping[str, ArrayHeader]) -> None:
            n_layers, n_target = check_encoder_decoder(headers, fused=heads is None, gradients=gae)
            check_layers(layers, n_layers)
            check_rows(rows, n_target)

        # Every header checked together (shapes, --rows, --layers) before any data is read;
        # arrays the rule does not use are never read.
        arrays = read_selected(
            source,
            required=_ENCODER_DECODER_ARRAYS + (_ENCODER_DECODER_GRADIENTS if gae else ()),
            optional=("source_mask", "target_mask"),
            check=check,
            why=dict.fromkeys(_ENCODER_DECODER_ARRAYS, "needed by every rule")
            | dict.fromkeys(_ENCODER_DECODER_GRADIENTS, "needed by --rule gae"),
        )
        encoder, decoder, cross = (arrays[name] for name in _ENCODER_DECODER_ARRAYS)
        if gae:
            options["gradients"] = tuple(arrays[name] for name in _ENCODER_DECODER_GRADIENTS)
        source_tokens = _read_tokens(args.source_tokens, encoder, option="--source-tokens")
        target_tokens = _read_tokens(args.target_tokens, decoder, option="--target-tokens")
    except (ArrayFileError, OSError) as error:
        raise UsageError(in_flags(str(error))) from None

    compose = (
        attnflow.encoder_decoder_flow if args.rule == "flow" else attnflow.encoder_decoder_rollout
    )
    with errors_in_flags(ValueError, TypeError, IndexError, RuntimeError):
        result = compose(
            encoder,
            decoder,
            cross,
            heads=heads,
            rows=rows,
            layers=layers,  # type: ignore[arg-type]
            source_mask=arrays.get("source_mask"),
            target_mask=arrays.get("target_mask"),
            validate=not args.no_validate,
            **options,  # type: ignore[arg-type]
        )
    values = {"source": np.asarray(result.source), "target": np.asarray(result.target)}
    tables = []  # laid out before writing: nothing is written if this fails
    for name, labels in (("source", source_tokens), ("target", target_tokens)):
        n_target = values["target"].shape[-1]  # `rows` index the decoder positions
        axis = _layer_axis(values[name], rows=rows, layers=layers, each=False, n_tokens=n_target)
        table = _first_row_table(
            values[name], labels, top=args.top, what=f"{name} tokens", layer_axis=axis
        )
        tables.append("\n".join(table))
    written = _write_output(output, values, force=args.force)
    shapes = ", ".join(f"{name} {tuple(value.shape)}" for name, value in values.items())
    print(f"encoder-decoder: {source} -> {written}, {shapes}, dtype {values['source'].dtype}")
    print("\n".join(tables))
    return 0
