#!/usr/bin/env python3
"""The README's plot: aggregate decode tok/s against the batch, per context, from bench/decode.py's JSON, and the
steady tok/s that streaming clients got from bench/serve.py. Written as SVG by hand (no plotting library).

    python3 bench/plot.py [--decode bench/results/decode.json] [--serve bench/results/serve_64_clients.json]
                          [-o bench/results/decode.svg]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
W, H, LEFT, RIGHT, TOP, BOTTOM = 640, 380, 70, 20, 40, 50
COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]


def decode_series(result: dict) -> dict[str, list[tuple[int, float]]]:
    """{label: [(batch, tok/s), ...]} per model and context."""
    series = {}
    for model in result["models"]:
        name = Path(model["model"]).stem + (", fp8 KV cache" if "float8" in model.get("kv_cache_dtype", "") else "")
        for row in model["decode"]:
            label = f"engine, ctx {row['context']}" + (f" ({name})" if len(result["models"]) > 1 else "")
            series.setdefault(label, []).append((row["batch"], row["tok_s"]))
    return series


def serve_series(result: dict) -> dict[str, list[tuple[int, float]]]:
    points = [(level["clients"], level["steady_tok_s"]) for level in result["levels"] if level.get("steady_tok_s")]
    return {f"HTTP streaming clients, {result['config']['prompt_tokens']}-token prompts": points} if points else {}


def svg(series: dict[str, list[tuple[int, float]]], title: str) -> str:
    xs = [x for points in series.values() for x, _ in points]
    ymax = max(y for points in series.values() for _, y in points)
    ytop = 10 ** math.floor(math.log10(ymax)) * math.ceil(ymax / 10 ** math.floor(math.log10(ymax)))
    lx0, lx1 = math.log2(min(xs)), math.log2(max(xs))

    def px(x: float) -> float:
        return LEFT + (math.log2(x) - lx0) / max(lx1 - lx0, 1e-9) * (W - LEFT - RIGHT)

    def py(y: float) -> float:
        return H - BOTTOM - y / ytop * (H - TOP - BOTTOM)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>']
    for i in range(6):
        y = ytop * i / 5
        out.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:,.0f}</text>')
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{x}</text>')
    out.append(f'<text x="{(LEFT + W - RIGHT) / 2}" y="{H - 12}" text-anchor="middle">sessions decoding together '
               '(batch)</text>')
    out.append(f'<text x="16" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})">tokens / s, all sessions</text>')
    for i, (label, points) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in sorted(points))
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in points]
        out.append(f'<rect x="{LEFT + 12}" y="{TOP + 8 + 18 * i}" width="12" height="3" fill="{colour}"/>'
                   f'<text x="{LEFT + 30}" y="{TOP + 13 + 18 * i}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decode", default=str(RESULTS / "decode.json"))
    ap.add_argument("--serve", default=str(RESULTS / "serve_64_clients.json"))      # the latest serve run
    ap.add_argument("-o", "--output", default=str(RESULTS / "decode.svg"))
    args = ap.parse_args(argv)
    decode = json.loads(Path(args.decode).read_text())
    series = decode_series(decode)
    if args.serve and Path(args.serve).exists():
        series.update(serve_series(json.loads(Path(args.serve).read_text())))
    quants = ", ".join(dict.fromkeys(Path(m["model"]).stem.rsplit("-", 1)[-1] for m in decode["models"]))
    title = f"{decode.get('device', 'GPU')}: random Llama-3-8B {quants}, decode ({decode.get('date', '')})"
    Path(args.output).write_text(svg(series, title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
