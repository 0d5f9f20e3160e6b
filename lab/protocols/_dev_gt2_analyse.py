"""Analyse the development runs: hit@1 (top layer and best layer) per variant and task.

A record, like ``_dev_gt2.py``: written against attnflow as of commit 34f2e4c, whose
``attnflow.evaluate`` exported ``source_ranks`` (private since).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from attnflow.evaluate import source_ranks

folder = Path(sys.argv[1])
seeds = sys.argv[2].split(",")
rows: dict[str, dict[str, str]] = {}
for task in ("copying", "retrieval", "stated_facts"):
    for seed in seeds:
        path = folder / f"dev-{task}-{seed}.npz"
        if not path.exists():
            continue
        data = np.load(path, allow_pickle=True)
        correct = data["correct"]
        sources = data["sources"]
        contexts = [tuple(c) for c in data["contexts"]]
        for key in data.files:
            if not key.startswith("s/"):
                continue
            name = key[2:]
            scores = data[key]
            ranks = np.stack(
                [
                    source_ranks(np.asarray(s, dtype=float)[None], [src], contexts=[ctx])[0]
                    for s, src, ctx in zip(scores, sources, contexts, strict=True)
                ]
            )[correct]
            top = np.mean(ranks[:, -1] == 1)
            best = np.max(np.mean(ranks == 1, axis=0))
            bl = int(np.argmax(np.mean(ranks == 1, axis=0)))
            cell = f"{top:.2f} ({ranks[:, -1].mean():.1f})"
            if ranks.shape[1] > 1:
                cell += f" b{bl}:{best:.2f}"
            rows.setdefault(name, {})[f"{task[:4]}{seed}"] = cell
columns = sorted({c for r in rows.values() for c in r})
print("| variant | " + " | ".join(columns) + " |")
for name, r in rows.items():
    print(f"| {name} | " + " | ".join(r.get(c, "-") for c in columns) + " |")
