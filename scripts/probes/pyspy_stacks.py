"""Where one function's wall time goes, from a ``py-spy record --format raw`` file.

``python scripts/probes/pyspy_stacks.py RAW ROOT [--rate HZ] [--depth N]``
keeps the samples whose stack passes through a frame named ``ROOT`` (for
example ``_timed_load``: one staging on the engine's staging thread),
and prints the time under it as a tree of the frames below ``ROOT``, each
with its share and its seconds (samples / rate), cut at ``--depth`` levels
and at 1% of the total; then the leaf frames that took the most.

Record with ``--idle`` so that waits (for the GIL, a lock, the GPU) are
sampled too: the tree is then wall time, not CPU time. ``--threads`` is not
needed; the file's own per-process lines are ignored.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

#: ``name (file:line)``; the line number is dropped so a function's lines add up.
FRAME = re.compile(r"^(?P<name>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    match = FRAME.match(frame.strip())
    if match is None:
        return frame.strip()
    return f"{match['name']} ({match['file'].rsplit('/', 2)[-1]})"


def read(path: str, root: str) -> list[tuple[list[str], int]]:
    """Each kept stack, from the frame below ``root`` to the leaf, with its count."""
    kept = []
    with open(path, errors="replace") as raw:
        for line in raw:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            names = [f.strip().split(" (", 1)[0] for f in frames]
            below = [i for i, name in enumerate(names) if name.rsplit(".", 1)[-1] == root]
            if below:
                kept.append(([frame_name(f) for f in frames[below[0] + 1 :]], int(count)))
    return kept


def tree(stacks: list[tuple[list[str], int]], depth: int) -> dict[tuple[str, ...], int]:
    totals: dict[tuple[str, ...], int] = defaultdict(int)
    for frames, count in stacks:
        for level in range(min(depth, len(frames)) + 1):
            totals[tuple(frames[:level])] += count
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw")
    parser.add_argument("root")
    parser.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate")
    parser.add_argument("--depth", type=int, default=6)
    args = parser.parse_args()
    stacks = read(args.raw, args.root)
    total = sum(count for _, count in stacks)
    if not total:
        print(f"no sample passes through {args.root}")
        return
    print(f"{args.root}: {total} samples, {total / args.rate:.2f} s of wall time")
    totals = tree(stacks, args.depth)

    def show(path: tuple[str, ...]) -> None:
        children = sorted(
            (p for p in totals if len(p) == len(path) + 1 and p[: len(path)] == path),
            key=lambda p: -totals[p],
        )
        for child in children:
            if totals[child] < 0.01 * total:
                continue
            share = totals[child] / total
            seconds = totals[child] / args.rate
            print(f"{'  ' * len(path)}{share:6.1%} {seconds:7.2f} s  {child[-1]}")
            show(child)

    show(())
    leaves: Counter[str] = Counter()
    for frames, count in stacks:
        leaves[frames[-1] if frames else args.root] += count
    print("\nleaf frames:")
    for name, count in leaves.most_common(15):
        print(f"{count / total:6.1%} {count / args.rate:7.2f} s  {name}")


if __name__ == "__main__":
    main()
