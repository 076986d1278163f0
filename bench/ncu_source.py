"""Where a kernel's warps stall, instruction by instruction: a summary of Nsight Compute's source page.

    ncu ... --section SourceCounters --section WarpStateStats -o REPORT python3 ...
    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv
    python bench/ncu_source.py SOURCE.csv [TOP]

Prints the share of stall samples by opcode and the TOP instructions with the most samples (with the stall
reason columns that have any), in address order, so a loop's hot spots read in sequence.
"""

from __future__ import annotations

import csv
import sys
from collections import Counter


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    if len(sys.argv) not in (2, 3):
        print("usage: python bench/ncu_source.py SOURCE.csv [TOP]", file=sys.stderr)
        sys.exit(2)
    top = int(sys.argv[2]) if len(sys.argv) == 3 else 40
    with open(sys.argv[1], newline="") as f:
        lines = [line for line in f if line.startswith('"')]      # ncu prints notes before the table
    rows = list(csv.reader(lines))
    if not rows:
        print("no source table in", sys.argv[1])
        sys.exit(1)
    rows = rows[next((i for i, r in enumerate(rows) if len(r) > 3), 0):]   # after the kernel's name line
    header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
    col = {name: i for i, name in enumerate(header)}
    samples = next((n for n in header if n.startswith("Warp Stall Sampling (All")), None)
    source = next((n for n in header if n in ("Source", "# Source")), header[1])
    address = next((n for n in header if "Address" in n), header[0])
    if samples is None:
        print("columns:", header)
        sys.exit(1)
    total = sum(number(r[col[samples]]) for r in body) or 1.0
    by_op = Counter()
    for r in body:
        op = r[col[source]].split()
        op = [t for t in op if not t.startswith("@")]
        by_op[op[0].split(".")[0] if op else "?"] += number(r[col[samples]])
    print(f"{len(body)} instructions, {total:.0f} stall samples")
    print("by opcode:", ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(14)))
    reasons = [n for n in header if n.startswith("stall_") and "Not Issued" not in n]
    # NOPs are where the idle warps of a partition wait (warp_specialize parks them there): left out of the totals
    working = [r for r in body if not r[col[source]].split() or r[col[source]].split()[0] != "NOP"]
    busy = sum(number(r[col[samples]]) for r in working) or 1.0
    totals = Counter({n: sum(number(r[col[n]]) for r in working) for n in reasons})
    print("stall reasons but at NOPs:", ", ".join(f"{n[len('stall_'):]} {100 * v / busy:.1f}%"
                                                 for n, v in totals.most_common(10) if v))
    hot = sorted(body, key=lambda r: -number(r[col[samples]]))[:top]
    hot.sort(key=lambda r: int(r[col[address]], 16) if r[col[address]].startswith("0x") else 0)
    for r in hot:
        extra = " ".join(f"{n[len('stall_'):]}={r[col[n]]}" for n in reasons if number(r[col[n]]) > 0)
        print(f"{r[col[address]]:>8} {100 * number(r[col[samples]]) / total:5.1f}%  {r[col[source]][:70]:70s} {extra}")


if __name__ == "__main__":
    main()
