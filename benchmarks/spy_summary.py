"""A py-spy raw profile (``py-spy record -f raw``, optionally ``--subprocesses --threads
--idle``), summarised per process and thread as text (a diagnostic's reader).

For each thread with enough samples: its share of samples spent waiting (the innermost
frame is a known blocking call: select, poll, recv, a lock, a sleep) and, of its samples,
the functions seen most (inclusive: a function counts once per sample wherever it is in
the stack). ``--under NAME`` keeps only samples whose stack holds a function named NAME
(e.g. ``_answer``) and prints their tree to ``--depth`` levels below it.

    python3 benchmarks/spy_summary.py spy.raw[.gz] [--top 25] [--min-samples 200]
    python3 benchmarks/spy_summary.py spy.raw.gz --under _answer --depth 6
"""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# Innermost frames that mean the thread is waiting rather than working.
_WAITING = frozenset(
    {
        "select",
        "poll",
        "epoll",
        "recv",
        "recv_into",
        "accept",
        "_accept",
        "wait",
        "acquire",
        "sleep",
        "_wait_for_tstate_lock",
        "get",
        "readinto",
        "read",
    }
)
_FRAME = re.compile(r"^(?P<name>.+?) \((?P<file>[^():]*?)(?::\d+)?\)$")


def _samples(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(process and thread label, frame names outermost first, count) per raw line."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", errors="replace") as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            parts = stack.split(";")
            head = [p for p in parts if p.startswith(("process ", "thread "))]
            frames = [_name(p) for p in parts if not p.startswith(("process ", "thread "))]
            process = next((h for h in reversed(head) if h.startswith("process ")), "")
            thread = next((h for h in head if h.startswith("thread ")), "thread ?")
            yield f"{_short(process)} | {thread}", frames, int(count)


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    if m is None:
        return frame
    return f"{m.group('name')} ({Path(m.group('file')).name})"


def _short(process: str) -> str:
    """'process 12:"python3 x.py --a"' -> 'process 12 python3 x.py' (the command cut short)."""
    m = re.match(r'process (\d+):"(.*)"', process)
    if m is None:
        return process
    words = m.group(2).split()
    return f"process {m.group(1)} {' '.join(Path(w).name for w in words[:3])}"


def summarise(path: Path, top: int, min_samples: int) -> str:
    totals: Counter[str] = Counter()
    waiting: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = {}
    for label, frames, n in _samples(path):
        totals[label] += n
        leaf = frames[-1].split(" (")[0].split(".")[-1] if frames else ""
        if not frames or leaf in _WAITING:
            waiting[label] += n
            continue
        seen = inclusive.setdefault(label, Counter())
        for f in set(frames):
            seen[f] += n
    out = []
    for label, total in totals.most_common():
        if total < min_samples:
            continue
        busy = total - waiting[label]
        out.append(f"\n## {label}: {total} samples, {100 * waiting[label] / total:.1f}% waiting")
        for f, n in inclusive.get(label, Counter()).most_common(top):
            out.append(f"{100 * n / total:6.1f}%  {f}")
        if busy:
            out.append(f"  (busy samples: {busy})")
    return "\n".join(out)


def tree(path: Path, under: str, depth: int, min_share: float) -> str:
    counts: Counter[tuple[str, ...]] = Counter()
    total = 0
    for label, frames, n in _samples(path):
        names = [f.split(" (")[0] for f in frames]
        hits = [i for i, name in enumerate(names) if name.split(".")[-1] == under or name == under]
        if not hits:
            continue
        total += n
        below = tuple(frames[hits[0] : hits[0] + depth + 1])
        for d in range(1, len(below) + 1):
            counts[(label, *below[:d])] += n
    out = [f"samples under {under}: {total}"]
    for key in sorted(counts):
        share = counts[key] / max(total, 1)
        if share >= min_share:
            out.append(f"{100 * share:6.1f}% {'  ' * (len(key) - 2)}{key[-1]}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--min-samples", type=int, default=200)
    parser.add_argument("--under", help="print the tree of samples below this function")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--min-share", type=float, default=0.01)
    args = parser.parse_args()
    if args.under:
        print(tree(args.raw, args.under, args.depth, args.min_share))
    else:
        print(summarise(args.raw, args.top, args.min_samples))


if __name__ == "__main__":
    main()
