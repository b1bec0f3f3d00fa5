#!/usr/bin/env python3
"""Tables (Markdown, stdout) and a plot (SVG) for docs/perf.md from the JSON the GPU round writes.

    python3 bench/perf_report.py \
        --attention docs/perf-data/2026-11-30-final/bench_paged_attention.json \
        --sdpa docs/perf-data/2026-11-30-final/torch_sdpa_decode.json \
        --svg docs/perf_decode_attention.svg

--attention: Google Benchmark JSON of bench/bench_paged_attention.cu (the *_median rows are used;
.json.gz is read too).
--sdpa: JSON of bench/torch_sdpa_decode.py (optional): PyTorch SDPA on dense BF16 KV, same shapes.
--ceiling: the bandwidth the percentages and rooflines are of, in GB/s (default 4300, the H200's
measured copy ceiling); --gpu: the device named in the plot's title (default H200). For another
card pass both, e.g. --gpu H100 --ceiling 3350 (the H100 SXM's nominal HBM3 bandwidth).
No third-party modules (the plot is plain SVG).
"""
import argparse
import gzip
import json
import re
import sys

MODES = ["BF16", "FP8", "NVFP4", "ternary", "R4E4T2"]
CEILING = 4300.0  # GB/s; --ceiling sets it
GPU = "H200"  # --gpu sets it


def ceiling_label():
    return f"{CEILING / 1000:g} TB/s"


def load_json(path):
    """A JSON file, gzipped when its name ends in .gz (the stored rounds under docs/perf-data/)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def load_attention(path):
    rows = {}
    step = {}
    for b in load_json(path)["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        m = re.match(r"BM_PagedDecodeAttention/tokens:(\d+)/batch:(\d+)/mode:(\d+)/evict:(\d+)/", b["name"])
        if m:
            t, bt, mode, ev = map(int, m.groups())
            rows[(t, bt, mode, ev)] = b
            continue
        m = re.match(r"BM_ModelStep/evict:(\d+)/graph:(\d+)(?:/layout:(\d+))?/", b["name"])
        if m:
            ev, g, layout = m.groups()
            step[(int(layout or 0), int(ev), int(g))] = b
    return rows, step


def load_sdpa(path):
    out = {}
    if not path:
        return out
    for r in load_json(path)["results"]:
        out[(r["kv_len"], r["batch"])] = r
    return out


def fmt_us(x):
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def tables(rows, step, sdpa):
    keys = sorted({(t, b) for (t, b, _, _) in rows})
    print(f"Median time (µs) / GB/s of the bytes read / % of {ceiling_label()}, 0% evicted; SDPA = PyTorch "
          "scaled_dot_product_attention (default backend) on dense BF16 KV of the same shape:\n")
    print("| live tokens | batch | " + " | ".join(MODES) + " | SDPA BF16 |")
    print("|---:|---:|" + "---|" * (len(MODES) + 1))
    for t, b in keys:
        cells = []
        for mode in range(len(MODES)):
            r = rows.get((t, b, mode, 0))
            cells.append("-" if r is None else
                         f"{fmt_us(r['med_us'])} / {r['GBps']:,.0f} / {100 * r['GBps'] / CEILING:.1f}%")
        s = sdpa.get((t, b))
        cells.append("-" if s is None else f"{fmt_us(s['median_us'])} / {s['gb_s']:,.0f} / {100 * s['gb_s'] / CEILING:.1f}%")
        print(f"| {t} | {b} | " + " | ".join(cells) + " |")
    print("\nSpeed-up over our BF16 path at equal live tokens (BF16 time / time), 0% evicted, and the "
          "cost of 50% evicted slots (time at 50% / time at 0%, same live tokens):\n")
    print("| live tokens | batch | FP8 | NVFP4 | ternary | R4E4T2 | SDPA / ours BF16 | evict BF16 | FP8 | NVFP4 | ternary | R4E4T2 |")
    print("|---:|---:|" + "---:|" * 10)
    for t, b in keys:
        base = rows.get((t, b, 0, 0))
        if base is None:
            continue
        sp = [f"{base['med_us'] / rows[(t, b, m, 0)]['med_us']:.2f}x" if (t, b, m, 0) in rows else "-"
              for m in range(1, len(MODES))]
        s = sdpa.get((t, b))
        rel = f"{s['median_us'] / base['med_us']:.2f}" if s else "-"
        ev = [f"{rows[(t, b, m, 50)]['med_us'] / rows[(t, b, m, 0)]['med_us']:.2f}"
              if (t, b, m, 50) in rows and (t, b, m, 0) in rows else "-" for m in range(len(MODES))]
        print(f"| {t} | {b} | " + " | ".join(sp) + f" | {rel} | " + " | ".join(ev) + " |")
    if step:
        print("\nOne decode step's attention, 32 layers, batch 64, 1024 live tokens per stream, R4E4T2 "
              "(ternary: every third block, or every third 128-token thought segment):\n")
        print(f"| ternary | evicted | launch | median µs | bytes | roofline µs (bytes / {ceiling_label()}) "
              f"| % of {ceiling_label()} |")
        print("|---|---:|---|---:|---:|---:|---:|")
        for (layout, ev, g), r in sorted(step.items()):
            print(f"| {'segments' if layout else 'blocks'} | {ev}% | {'CUDA graph' if g else '32 launches'} | "
                  f"{r['med_us']:,.0f} | {r['bytes'] / 1e9:.2f} GB | "
                  f"{r['bytes'] / (CEILING * 1e3):.0f} | {100 * r['bytes'] / (CEILING * 1e3) / r['med_us']:.1f}% |")


def svg(rows, sdpa, path):
    """Grouped bars: GB/s of each precision per (tokens, batch), 0% evicted, plus SDPA."""
    keys = sorted({(t, b) for (t, b, _, ev) in rows if ev == 0})
    series = MODES + ["SDPA (dense BF16)"]
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#777777"]
    W, H, left, bottom, top = 980, 420, 70, 70, 40
    plot_w, plot_h = W - left - 20, H - bottom - top
    vmax = CEILING
    gw = plot_w / max(1, len(keys))
    bw = gw * 0.8 / len(series)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14">Decode attention on the {GPU}: GB/s of bytes read '
           f'(0% evicted), Llama-3-8B heads; top = {ceiling_label()}</text>']
    for frac in (0.25, 0.5, 0.75, 1.0):
        y = top + plot_h * (1 - frac)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{W - 20}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{frac * vmax:,.0f}</text>')
    for i, (t, b) in enumerate(keys):
        x0 = left + i * gw + gw * 0.1
        for j, name in enumerate(series):
            if j < len(MODES):
                r = rows.get((t, b, j, 0))
                v = r["GBps"] if r else None
            else:
                s = sdpa.get((t, b))
                v = s["gb_s"] if s else None
            if v is None:
                continue
            h = plot_h * min(v, vmax) / vmax
            out.append(f'<rect x="{x0 + j * bw:.1f}" y="{top + plot_h - h:.1f}" width="{bw - 1:.1f}" height="{h:.1f}" '
                       f'fill="{colors[j]}"><title>{name} {t} tokens batch {b}: {v:,.0f} GB/s</title></rect>')
        out.append(f'<text x="{left + i * gw + gw / 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle">{t // 1024 if t >= 1024 else t}{"K" if t >= 1024 else ""}</text>')
        out.append(f'<text x="{left + i * gw + gw / 2:.1f}" y="{top + plot_h + 27}" text-anchor="middle">b{b}</text>')
    out.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{W - 20}" y2="{top + plot_h}" stroke="#000"/>')
    for j, name in enumerate(series):
        x = left + j * 150
        out.append(f'<rect x="{x}" y="{H - 22}" width="12" height="12" fill="{colors[j]}"/>'
                   f'<text x="{x + 16}" y="{H - 12}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    global CEILING, GPU
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attention", required=True)
    ap.add_argument("--sdpa")
    ap.add_argument("--svg")
    ap.add_argument("--ceiling", type=float, default=CEILING, help="GB/s the percentages are of (default 4300)")
    ap.add_argument("--gpu", default=GPU, help="device name for the plot's title (default H200)")
    a = ap.parse_args()
    if not a.ceiling > 0:
        ap.error(f"--ceiling {a.ceiling}: must be a positive bandwidth in GB/s")
    CEILING, GPU = a.ceiling, a.gpu
    rows, step = load_attention(a.attention)
    if not rows:
        sys.exit("no *_median rows of BM_PagedDecodeAttention in " + a.attention)
    sdpa = load_sdpa(a.sdpa)
    tables(rows, step, sdpa)
    if a.svg:
        svg(rows, sdpa, a.svg)


if __name__ == "__main__":
    main()
