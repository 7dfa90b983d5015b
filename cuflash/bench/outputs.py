"""The raw numbers a cuflash-bench run writes beside its tables: --json (the settings, the
device, every record and footnote), --csv (one row per measurement of every table) and
--plot (the speed table's TFLOP/s against the sequence length). cuflash.bench.cli calls them.
"""

from __future__ import annotations

import csv
import json

from . import e2e, host, speed

CSV_FIELDS = ("table", "dtype", "mode", "seqlen", "hdim", "batch", "heads", "kv_heads", "causal",
              "backend", "pattern", "density", "tiles", "status", "ms", "tflops", "flops",
              "host_us", "peak_bytes", "bytes_read", "bytes_written", "bytes_source", "error")


def settings(args) -> dict:
    keep = ("tables", "seqlens", "hdims", "dtypes", "causal", "modes", "peers", "io",
            "memory_seqlens", "sparse_seqlen", "repeats", "warmup", "tiles", "tablefmt", "wide")
    out = {k: getattr(args, k) for k in keep}
    out["repeats"] = out["repeats"] or "auto"
    out["tiles"] = [list(t) for t in out["tiles"]]
    return out


def _row(**values) -> dict:
    row = {k: "" for k in CSV_FIELDS}
    for k, v in values.items():
        row[k] = "" if v is None else v
    return row


def csv_rows(results: dict) -> list:
    """One row per measurement of every table in results (the JSON document)."""
    rows = []
    for r in (results.get("speed") or {}).get("records", []):
        for name, e in r["backends"].items():
            rows.append(_row(table="speed", dtype=r.get("dtype"), mode=r.get("mode", "fwd"),
                             seqlen=r["seqlen"], hdim=r["hdim"], batch=r["batch"],
                             heads=r["heads"], causal=r["causal"], backend=name,
                             status=e["status"], ms=e["ms"], tflops=e["tflops"],
                             flops=r["flops"], error=e.get("error")))
    for r in (results.get("memory") or {}).get("records", []):
        for name, e in r["backends"].items():
            rows.append(_row(table="memory", dtype=r["dtype"], mode="fwdbwd", seqlen=r["seqlen"],
                             hdim=r["hdim"], batch=r["batch"], heads=r["heads"],
                             causal=r["causal"], backend=name, status=e["status"],
                             peak_bytes=e.get("peak_bytes"), error=e.get("error")))
    res = (results.get("io") or {}).get("result")
    if res:
        g = res["shape"]
        common_fields = dict(table="io", dtype=res["dtype"], seqlen=g["seq"], hdim=g["hdim"],
                             batch=g["batch"], heads=g["heads"], causal=False)
        entries = [(name, "fwdbwd", "", e) for name, e in res["methods"].items()]
        entries += [("cuflash", "fwd", "x".join(map(str, s["tiles"])), s) for s in res["sweep"]]
        for name, mode, tiles, e in entries:
            flop = e["gflop"] * 1e9
            tflops = flop / (e["ms"] * 1e-3) / 1e12 if e.get("ms") else None
            sources = [("analytical", e["analytical"])]
            if e.get("ncu") and e["ncu"].get("status") == "ok":
                sources.append(("ncu", e["ncu"]))
            for source, traffic in sources:
                rows.append(_row(**common_fields, mode=mode, backend=name, tiles=tiles,
                                 status=e["status"], ms=e.get("ms"), tflops=tflops, flops=flop,
                                 bytes_read=traffic["read"], bytes_written=traffic["write"],
                                 bytes_source=source, error=e.get("error")))
    for r in (results.get("sparse") or {}).get("records", []):
        for name, e in r["backends"].items():
            rows.append(_row(table="sparse", dtype=r["dtype"], mode=r["mode"], seqlen=r["seqlen"],
                             hdim=r["hdim"], batch=r["batch"], heads=r["heads"], causal=False,
                             backend=name, pattern=r["pattern"], density=r["density"],
                             status=e["status"], ms=e["ms"], flops=r["flops"],
                             tflops=(r["flops"] / (e["ms"] * 1e-3) / 1e12
                                     if e["ms"] and r["flops"] else None),
                             error=e.get("error")))
    for r in (results.get("varlen") or {}).get("records", []):
        for name, e in r["backends"].items():
            rows.append(_row(table="varlen", dtype=r["dtype"], mode=r["mode"], seqlen=r["longest"],
                             hdim=r["hdim"], batch=r["sequences"], heads=r["heads_q"],
                             kv_heads=r["heads_kv"], causal=r["causal"], backend=name,
                             pattern=r["batch"], status=e["status"], ms=e["ms"],
                             tflops=e["tflops"], flops=r["useful_flops"], error=e["error"]))
    for name, e in ((results.get("host") or {}).get("results") or {}).items():
        b, h, n, d = host.HOST_SHAPE
        rows.append(_row(table="host", dtype="bfloat16", mode=host.CASE_BY_NAME[name].mode,
                         seqlen=n, hdim=d, batch=b, heads=h, kv_heads=h, causal=host.CAUSAL,
                         backend=name, status=e["status"], host_us=e["us"], error=e["error"]))
    for r in (results.get("e2e") or {}).get("records", []):
        g = r["shape"]
        for name, e in r["backends"].items():
            rows.append(_row(table="e2e", dtype="bfloat16", mode="fwdbwd", seqlen=g["seq"],
                             hdim=g["hdim"], batch=g["batch"], heads=g["heads"],
                             kv_heads=g["kv_heads"], causal=e2e.CAUSAL, backend=name,
                             status=e["status"], ms=e["ms"], host_us=e["host_us"],
                             error=e["error"]))
    return rows


def write_csv(path: str, results: dict) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(csv_rows(results))


JSON_EXPANDED_DEPTH = 3  # containers this deep and shallower get a line per item: a record a line


def without_call_times(value):
    """A copy in which each measurement's per-call times become their count, min and max."""
    if isinstance(value, list):
        return [without_call_times(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: without_call_times(v) for k, v in value.items() if k != "times_ms"}
    if "times_ms" in value:
        times = value["times_ms"] or []
        out.update(calls=len(times), min_ms=min(times, default=None),
                   max_ms=max(times, default=None))
    return out


def compact_json(value, depth: int = 0) -> str:
    """JSON with a line per item down to JSON_EXPANDED_DEPTH, all deeper on that line."""
    if depth >= JSON_EXPANDED_DEPTH or not isinstance(value, (dict, list)) or not value:
        return json.dumps(value, separators=(",", ":"), default=str)
    pad = " " * (depth + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {compact_json(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    items = [pad + compact_json(v, depth + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"


def write_json(path: str, results: dict) -> None:
    with open(path, "w") as f:
        f.write(compact_json(without_call_times(results)) + "\n")


def plot_speed(path: str, records: list, args) -> None:
    """TFLOP/s against sequence length, one line per backend (and dtype when several), one
    panel per (mode, head dim, causal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, h, c) for m in args.modes for h in args.hdims for c in args.causal_modes]
    cols = len(args.hdims) * len(args.causal_modes)
    rows = len(args.modes)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for k, (mode, hdim, causal) in enumerate(panels):
        ax = axes[k // cols][k % cols]
        for dtype in args.dtypes:
            for name in speed.backend_names(args, mode):
                points = sorted((r["seqlen"], r["backends"][name]["tflops"]) for r in records
                                if r.get("mode") == mode and r["hdim"] == hdim
                                and r["causal"] == causal and r.get("dtype") == dtype
                                and name in r["backends"] and r["backends"][name]["tflops"])
                if not points:
                    continue
                label = name if len(args.dtypes) == 1 else f"{name} {dtype}"
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.seqlens)
        ax.set_xticklabels([str(n) for n in args.seqlens], fontsize=7)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(f"{speed.MODE_NAMES[mode]}, hdim {hdim}, causal {'yes' if causal else 'no'}",
                     fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
