"""bench_infinity's report: the interleaved probe and step rows summarized (median and min-max
of each, the step's GB/s as a fraction of the probe's; zerokern.bench.disk_probe) and written
as benchmarks/results/infinity-<model>.json and .md."""

from __future__ import annotations

from . import common
from . import disk_probe as dp

COLS = [("what", "what"), ("loss", "loss"), ("fwd_bwd_s", "forward+backward s"),
        ("seconds", "step or probe s"), ("kernel_s", "cpu kernel s"),
        ("io_wait_s", "waiting for disk s"), ("GB", "GB read+written"), ("GBps", "GB/s"),
        ("rss_GiB", "RSS GiB")]


def summary(args, rows, pattern, psi, rep, rss, build_s, ram_gib, peak_gib) -> dict:
    """The JSON payload: the run's arguments, the rows, and the spreads of probe and step."""
    steps = [r for r in rows if r["what"].startswith("step")]
    probes = [r for r in rows if r["what"] == "disk probe"]
    frac = dp.fraction([r["GBps"] for r in steps], [r["GBps"] for r in probes], pattern.direct)
    return {"model": args.model, "params": psi, "state_GB_fp32": 12 * psi / 1e9,
            "disk_bytes": rep.get("disk_measured_total"),
            "ram_GiB": ram_gib, "peak_rss_GiB": peak_gib, "rss_GiB": rss, "build_s": build_s,
            "bytes_per_step_GB": pattern.bytes_per_step / 1e9, "direct_io": pattern.direct,
            "pattern": {"buffers": len(pattern.numels), "files_per_buffer": len(pattern.specs[0]),
                        "request_MiB": pattern.chunk * 4 / 2**20, "buffer_sets": pattern.depth,
                        "in_flight_max": pattern.in_flight},
            "probe_GBps": dp.spread([r["GBps"] for r in probes]),
            "probe_GBps_first_last": [probes[0]["GBps"], probes[-1]["GBps"]],
            "step_s": dp.spread([r["seconds"] for r in steps]),
            "step_GBps": dp.spread([r["GBps"] for r in steps]),
            "kernel_s": dp.spread([r["kernel_s"] for r in steps]),
            "io_wait_s": dp.spread([r["io_wait_s"] for r in steps]),
            "step_of_probe": frac, "rows": rows, "memory_report": rep,
            "warmup": args.warmup, "batch": args.batch, "seq": args.seq, "lr": args.lr}


def _rng(s: dict, fmt: str = ".2f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}}, n={s['n']})"


def write(args, env: dict, s: dict) -> None:
    """Write infinity-<model>.json and .md under args.out and print the markdown."""
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / (getattr(args, "name", None) or f"infinity-{args.model}")
    common.write_json(stem.with_suffix(".json"), {"env": env, **s})
    pat, f = s["pattern"], s["step_of_probe"]
    io = ("O_DIRECT" if s["direct_io"] else "buffered + fadvise(DONTNEED): O_DIRECT is "
          "unavailable under --path, the page cache may serve some reads")
    q = f["paired"]
    head = q["median"] if q else f["median_pct"]
    verdict = ((f"each step against the mean of the probes before and after it **{q['median']:.0f}%"
                f"** (min-max {q['min']:.0f}-{q['max']:.0f}%, n={q['n']}); " if q else "")
               + f"median over median {f['median_pct']:.0f}%, range over all samples "
               f"{f['min_pct']:.0f}-{f['max_pct']:.0f}%")
    if head > 100:
        verdict = "not a fraction of the disk's ceiling (" + verdict + ")"
    md = (f"# ZeRO-Infinity on {env.get('usable_cpus')} cores: GPT {args.model}, "
          f"{s['params'] / 1e9:.2f}B params, offload='nvme'\n\n{common.markdown_env(env)}\n"
          f"- load average (1, 5, 15 min) before / after the timed part: "
          f"{', '.join(f'{v:.2f}' for v in env['loadavg_before'])} / "
          f"{', '.join(f'{v:.2f}' for v in env['loadavg_after'])}\n\n"
          f"- fp32 master + m + v: {s['state_GB_fp32']:.1f} GB (RAM: {s['ram_GiB']:.1f} GiB); "
          f"on disk, double-buffered: {(s['disk_bytes'] or 0) / 2**30:.1f} GiB\n"
          f"- peak RSS (VmHWM): **{s['peak_rss_GiB']:.1f} GiB** of {s['ram_GiB']:.1f} GiB RAM; "
          "RSS by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in s["rss_GiB"].items())
          + " GiB\n"
          f"- the step's I/O: {pat['buffers']} buffers x {pat['files_per_buffer']} files, "
          f"{pat['request_MiB']:.0f} MiB requests, {pat['buffer_sets']} buffer sets (at most "
          f"{pat['in_flight_max']} requests in flight), {io}; "
          f"{s['bytes_per_step_GB']:.1f} GB read+written per step\n"
          f"- disk probe (that I/O replayed on the step's own files, no compute), GB/s, median "
          f"(min-max): {_rng(s['probe_GBps'])}; first / last probe "
          f"{s['probe_GBps_first_last'][0]:.2f} / {s['probe_GBps_first_last'][1]:.2f}\n"
          f"- optimizer step: {_rng(s['step_s'], '.1f')} s = {_rng(s['step_GBps'])} GB/s; cpu "
          f"kernel {_rng(s['kernel_s'], '.1f')} s, waiting for the disk "
          f"{_rng(s['io_wait_s'], '.1f')} s\n"
          f"- the step's GB/s as a fraction of the probe's: {verdict}"
          + (f"; {f['note']}" if f["note"] else "") + "\n"
          f"- optimizer built (model cast, state files written) in {s['build_s']:.0f} s; "
          f"{s['warmup']} warm-up steps, then probe and step interleaved\n\n"
          f"{common.markdown_table(s['rows'], COLS)}\n")
    common.write_text(stem.with_suffix(".md"), md)
    print(md)

