"""Summarise py-spy's raw (collapsed) stacks: the functions holding most samples, by
own time and by total time.  python benchmarks/collapse_top.py FILE [N]"""

from __future__ import annotations

import collections
import sys


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    with open(path, encoding="utf-8") as lines:
        collapsed = lines.read().splitlines()
    for line in collapsed:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    print(f"{samples} samples")
    for title, counter in (("own", own), ("total", total)):
        print(f"-- by {title}")
        for frame, n in counter.most_common(top):
            print(f"{100 * n / samples:6.1f}%  {frame}")


if __name__ == "__main__":
    main()
