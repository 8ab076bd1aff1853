"""The results as a markdown report (one table per benchmark) and PNG plots
(tokens/s or peak memory against length, one plot per benchmark and size), and
`merge`, which joins the results.json of separate runs into one report.

Each part of a merged report keeps the roofline of its own run: utilisation
figures only mean something against the device state they were measured in.
"""

from __future__ import annotations

import json
import os

import jax


def merge(dirs: list[str], results: dict) -> dict:
  """Fill `results` with the rows of each dir's results.json, and a line per part."""
  parts = []
  for d in dirs:
    with open(os.path.join(d, "results.json")) as f:
      parts.append(json.load(f))
  results["rows"] = [r for p in parts for r in p["rows"]]
  results["roofline"] = parts[0].get("roofline") if parts else None
  results["parts"] = [{"command": p["command"], "date": p["date"], "roofline": p.get("roofline"),
                       "seconds": p.get("seconds")} for p in parts]
  return results


def _fmt(v, kind=""):
  if v is None:
    return ""
  if kind == "pct":
    return f"{100 * v:.1f}%"
  if kind == "x":
    return f"{v:.2f}x"
  if isinstance(v, float):
    if abs(v) >= 100:
      return f"{v:,.0f}"
    return f"{v:.3g}"
  return str(v)


def _key(r):
  return tuple(r.get(k) for k in ("bench", "config", "mode", "batch", "seq_len", "dtype"))


def add_ratios(rows):
  """ratio = our tokens/s over this row's, for rows with the same bench and shape.
  For the SSD our best chunk is compared with each peer row."""
  for r in rows:
    if "tokens_per_s" not in r or r["bench"] in ("loader",):
      continue
    ours = [o for o in rows if _key(o) == _key(r) and o["impl"].startswith("ours")
            and o["impl"] not in ("ours (recompute)", "ours (host loop)")]
    if ours:
      r["ours_over_this"] = max(o["tokens_per_s"] for o in ours) / r["tokens_per_s"]


def markdown(results) -> str:
  rows = results.get("rows", [])
  add_ratios(rows)
  out = ["# mamba_train benchmarks", "",
         f"{results['date']} · {results['machine']} · jax {jax.__version__} · "
         f"command: `{results['command']}`", ""]
  for p in results.get("parts", []):
    rfp = p.get("roofline") or {}
    out.append(f"- `{p['command']}` ({p['date']}, {p.get('seconds') or 0:.0f} s): matmul "
               f"{rfp.get('matmul_flops', 0) / 1e9:.0f} GFLOP/s, copy {rfp.get('copy_bytes_per_s', 0) / 1e9:.1f} GB/s"
               + (f", matvec read {rfp['matvec_bytes_per_s'] / 1e9:.1f} GB/s" if rfp.get("matvec_bytes_per_s") else ""))
  if results.get("parts"):
    out += ["", "MFU and bandwidth figures of each row use the roofline measured in its own run.", ""]
  rf = results.get("roofline")
  if rf and not results.get("parts"):
    out += ["## Roofline of this device (measured in the same run)", "",
            "| measure | value |", "|---|---|"]
    for k, v in rf.items():
      out.append(f"| {k} | {v / 1e9:.1f} G/s |")
    out.append("")
  sections = [
      ("ssd", "SSD scan alone (b, l, h 24, p 64, n 128)",
       [("impl", ""), ("mode", ""), ("chunk", ""), ("dtype", ""), ("tokens_per_s", ""), ("gflops", ""),
        ("frac_matmul_peak", "pct"), ("compile_s", ""), ("ours_over_this", "x")]),
      ("forward", "Forward (prefill, logits)",
       [("config", ""), ("impl", ""), ("batch", ""), ("seq_len", ""), ("dtype", ""), ("tokens_per_s", ""),
        ("mfu", "pct"), ("compile_s", ""), ("peak_bytes", "mib"), ("ours_over_this", "x")]),
      ("train", "Train step (forward, backward, AdamW)",
       [("config", ""), ("impl", ""), ("batch", ""), ("seq_len", ""), ("dtype", ""), ("tokens_per_s", ""),
        ("mfu", "pct"), ("compile_s", ""), ("compile_cpu_s", ""), ("peak_bytes", "mib"), ("ours_over_this", "x")]),
      ("decode", "Decode (greedy, tokens/s; bytes per token x tokens/s over the copy bandwidth, "
                 "and over the batch-1 matvec read rate)",
       [("config", ""), ("impl", ""), ("batch", ""), ("seq_len", ""), ("tokens_per_s", ""),
        ("bw_util", "pct"), ("matvec_util", "pct"), ("ours_over_this", "x")]),
      ("decode_tpu", ("Decode step compiled for one TPU v6e (AOT): XLA's bytes a token, "
                      "fusions, DMAs and other ops a token (a scanned body counted per layer)"),
       [("config", ""), ("dtype", ""), ("batch", ""), ("decode_impl", ""), ("layers", ""), ("weights", ""),
        ("xla_bytes", ""), ("hbm_bytes_est", ""), ("min_bytes_f32", ""), ("fusions", ""), ("dmas", ""), ("other", ""),
        ("ops", ""), ("ops_per_layer", ""), ("head_ops", ""), ("compile_cpu_s", "")]),
      ("compile", "Compile time (wall and this process's CPU seconds)",
       [("impl", ""), ("program", ""), ("config", ""), ("n_layer", ""), ("batch", ""), ("seq_len", ""),
        ("target", ""), ("lower_cpu_s", ""), ("compile_s", ""), ("compile_cpu_s", ""), ("count_cpu_s", ""),
        ("xla_flops", ""), ("xla_bytes", "")]),
      ("memory", "Peak memory (XLA memory analysis: arguments + outputs + scratch - donated)",
       [("program", ""), ("config", ""), ("batch", ""), ("seq_len", ""), ("dtype", ""), ("peak_bytes", "mib"),
        ("temp_bytes", "mib"), ("compile_s", "")]),
      ("loader", "Data loader", [("batch", ""), ("seq_len", ""), ("tokens_per_s", "")]),
  ]
  for bench, title, cols in sections:
    rs = [r for r in rows if r["bench"] == bench]
    if not rs:
      continue
    names = {"tokens_per_s": "tokens/s", "gflops": "GFLOP/s", "frac_matmul_peak": "of matmul peak",
             "mfu": "MFU", "compile_s": "compile s", "compile_cpu_s": "compile cpu s",
             "lower_cpu_s": "lower cpu s", "count_cpu_s": "counting compiles cpu s",
             "peak_bytes": "peak MiB", "temp_bytes": "scratch MiB", "ours_over_this": "ours / this",
             "bw_util": "of copy bandwidth", "matvec_util": "of matvec read rate", "xla_flops": "XLA FLOPs",
             "xla_bytes": "XLA bytes",
             "min_bytes_f32": "f32 params + state once",
             "hbm_bytes_est": "HBM bytes (est.)", "fusions": "fusions a token",
             "dmas": "DMAs a token", "other": "other ops a token"}
    out += [f"## {title}", "", "| " + " | ".join(names.get(c, c) for c, _ in cols) + " |",
            "|" + "---|" * len(cols)]
    for r in rs:
      cells = []
      for c, kind in cols:
        v = r.get(c)
        if kind == "mib" and v is not None:
          cells.append(f"{v / 2**20:,.0f}")
        else:
          cells.append(_fmt(v, kind))
      out.append("| " + " | ".join(cells) + " |")
    out.append("")
  rl_rows = [r for r in rows if r.get("roofline")]
  for r in rl_rows:
    rl = r["roofline"]
    out.append(f"{r['impl']} {r['program']} on {r['target']}: XLA counts {r['xla_flops']:.3g} FLOPs and "
               f"{r['xla_bytes']:.3g} bytes (every layer counted), intensity {rl['intensity']:.0f} "
               f"FLOP/byte: {rl['bound']}-bound, {rl['time_s'] * 1e3:.1f} ms at the datasheet peaks "
               f"(compute {rl['compute_s'] * 1e3:.1f} ms, memory {rl['memory_s'] * 1e3:.1f} ms).")
  return "\n".join(out) + "\n"


def plots(results, out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = results.get("rows", [])
  made = []

  def line_plot(bench, fname, ylabel, title, key="tokens_per_s", filt=lambda r: True, label=lambda r: r["impl"]):
    rs = [r for r in rows if r["bench"] == bench and filt(r) and r.get(key) is not None]
    if not rs:
      return
    fig, ax = plt.subplots(figsize=(6, 4))
    for lab in sorted({label(r) for r in rs}):
      pts = sorted((r["seq_len"], r[key]) for r in rs if label(r) == lab)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=lab)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length" if bench != "decode" else "context length")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, fname)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    made.append(path)

  for size in sorted({r.get("config") for r in rows if r.get("config")}):
    for bench in ("forward", "train"):
      line_plot(bench, f"{bench}_{size}.png", "tokens/s", f"{bench} {size}: tokens/s vs length",
                filt=lambda r, s=size: r.get("config") == s)
    line_plot("decode", f"decode_{size}.png", "tokens/s", f"decode {size}: tokens/s vs context",
              filt=lambda r, s=size: r.get("config") == s)
    line_plot("memory", f"memory_{size}.png", "peak bytes (XLA)", f"{size}: peak memory vs length",
              key="peak_bytes", filt=lambda r, s=size: r.get("config") == s, label=lambda r: r["program"])
  return made
