"""Aggregate benchmark measurements into one report dict (JSON-ready) and render it as rich tables.

summarize(measurements, names, kinds, ...) -> report dict; render(report, console) prints the human tables.
"""

from __future__ import annotations

import statistics

from specrun.bench.neartie import first_diff as _first_diff
from specrun.bench.runner import Measurement
from specrun.decoding.stats import PHASES

STEP_PHASES = tuple(p for p in PHASES if p != "prefill")  # + "other": wall time no phase accounts for
BASELINES = ("hf_ar", "specrun_ar")
AR_RUNS = (*BASELINES, "compiled_ar")  # one token a step: a share of the memory roofline means something


def _median(xs):
    return statistics.median(xs) if xs else None


def _paired_ratio(by_name: dict, name: str, base: str, rate) -> float | None:
    """Median over repeats of rate(name, r) / rate(base, r) (interleaving makes the pairs comparable)."""
    if base not in by_name or name not in by_name:
        return None
    pairs = [(rate(a), rate(b)) for a, b in zip(by_name[name], by_name[base])]
    ratios = [x / y for x, y in pairs if x is not None and y]
    return _median(ratios)


def _phases(ms: list[Measurement]) -> tuple[dict[str, float], float, float]:
    """Summed over repeats -> (fraction of decode time per phase incl. 'other', outside-forward fraction, prefill s)."""
    totals = dict.fromkeys((*STEP_PHASES, "other"), 0.0)
    prefill = decode = 0.0
    for m in ms:
        ph = m.stats.get("phase_seconds", {})
        pre = float(ph.get("prefill", 0.0))
        prefill += pre
        decode += m.seconds - pre
        for p in STEP_PHASES:
            totals[p] += float(ph.get(p, 0.0))
    totals["other"] = max(0.0, decode - sum(totals[p] for p in STEP_PHASES))
    if decode <= 0:
        return {}, 0.0, prefill
    frac = {p: v / decode for p, v in totals.items()}
    return frac, 1.0 - frac["forward"], prefill / len(ms)


def _run_row(name: str, kind: str, ms: list[Measurement], by_name: dict) -> dict:
    tps = [len(m.token_ids) / m.seconds for m in ms]
    med = _median(tps)
    row = {
        "name": name, "kind": kind, "tokens": len(ms[0].token_ids), "tokens_per_s": med,
        "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps), "tokens_per_s_all": tps,
        "spread": (max(tps) - min(tps)) / med if med else None,
        "seconds": _median([m.seconds for m in ms]),
    }
    for base in BASELINES:
        row[f"ratio_to_{base}"] = _paired_ratio(by_name, name, base, lambda m: len(m.token_ids) / m.seconds)
    if kind == "specrun":
        st = [m.stats for m in ms]
        row["mean_accepted"] = _median([s.get("mean_accepted", 0.0) for s in st])
        row["steps"] = _median([s.get("steps", 0) for s in st])
        row["mean_trie_nodes"] = _median([s.get("mean_trie_nodes", 0.0) for s in st])
        for key in ("alpha", "beta"):
            vals = [s[key] for s in st if isinstance(s.get(key), (int, float))]
            row[key] = _median(vals)
        row["tokens_by_drafter"] = st[0].get("tokens_by_drafter", {})
        row["by_length"] = st[0].get("by_length", [])  # accepted/step and tokens per drafter per 512 generated
        for key in ("expected_acceptance", "observed_acceptance"):  # sampled: drafted mass vs accepted, per node
            vals = [s[key] for s in st if isinstance(s.get(key), (int, float))]
            row[key] = _median(vals)
        row["likeliest_share"] = st[0].get("likeliest_share")  # sampled: the likeliest-chain oracle (first repeat)
        row["oracle_accepted"] = st[0].get("oracle_accepted")
        row["phase_fraction"], row["outside_forward_fraction"], row["prefill_seconds"] = _phases(ms)
        row["draft_compile_seconds"] = st[0].get("draft_compile_seconds")  # once per process, before the timed steps
        row["draft_packages_built"] = st[0].get("draft_packages_built")  # 0: loaded from the cache
        row["draft_eager"] = bool(st[0].get("draft_eager"))  # torch's 4-bit draft ran uncompiled
        row["layers_packages"] = st[0].get("layers_packages")  # compiled layers: seconds building or loading each
    else:
        row["mean_accepted"] = None
    return row


def _lengths(by_name: dict, lengths: tuple[int, ...]) -> list[dict]:
    """Per watched length: cumulative tok/s to reach it, and tok/s over the segment since the previous length."""
    out, prev = [], 0
    for n in sorted(lengths):
        def cum(m, n=n):
            s = m.at_length.get(n)
            return n / s if s else None

        def seg(m, n=n, prev=prev):
            s, s0 = m.at_length.get(n), m.at_length.get(prev, 0.0) if prev else 0.0
            return (n - prev) / (s - s0) if s and s > s0 else None

        runs = []
        for name, ms in by_name.items():
            row = {"name": name, "tokens_per_s": _median([v for v in map(cum, ms) if v]),
                   "segment_tokens_per_s": _median([v for v in map(seg, ms) if v])}
            for base in BASELINES:
                row[f"ratio_to_{base}"] = _paired_ratio(by_name, name, base, cum)
                row[f"segment_ratio_to_{base}"] = _paired_ratio(by_name, name, base, seg)
            runs.append(row)
        out.append({"length": n, "since": prev, "runs": runs})
        prev = n
    return out


def summarize(measurements: list[Measurement], kinds: dict[str, str], lengths: tuple[int, ...] = (),
              greedy: bool = True, notes: list[str] = (), meta: dict | None = None) -> dict:
    """-> {"runs": [...], "identical", "mismatches", "hf_ar_matches_specrun_ar", "lengths", "notes", **meta}"""
    by_name: dict[str, list[Measurement]] = {}
    for m in measurements:
        by_name.setdefault(m.name, []).append(m)
    for ms in by_name.values():
        ms.sort(key=lambda m: m.repeat)
    spec_names = [n for n in by_name if kinds[n] == "specrun"]
    ref_name = "specrun_ar" if "specrun_ar" in by_name else (spec_names[0] if spec_names else None)
    mismatches = []
    if ref_name is not None:
        ref = by_name[ref_name][0].token_ids
        for name in spec_names:
            for m in by_name[name]:
                d = _first_diff(m.token_ids, ref)
                if d is not None:
                    mismatches.append({"name": name, "repeat": m.repeat, "first_diff": d, "reference": ref_name,
                                       "tokens": len(m.token_ids), "reference_tokens": len(ref)})
    hf_match = None
    if greedy and "hf_ar" in by_name and "specrun_ar" in by_name:
        d = _first_diff(by_name["hf_ar"][0].token_ids, by_name["specrun_ar"][0].token_ids)
        hf_match = {"identical": d is None, "first_diff": d}
    report = dict(meta or {})
    report.update({
        "runs": [_run_row(n, kinds[n], ms, by_name) for n, ms in by_name.items()],
        "identical": not mismatches, "mismatches": mismatches, "reference": ref_name,
        "hf_ar_matches_specrun_ar": hf_match, "lengths": _lengths(by_name, lengths) if lengths else [],
        "notes": list(notes),
    })
    return report


def annotate_divergences(report: dict, measurements: list[Measurement], check) -> None:
    """Give every mismatch and every specrun run its near-tie verdict (docs/design.md section 2).

    check(reference_tokens, tokens) -> Divergence; adds gap/near_tie/tolerance to each mismatch and per run row
    identical, first_diff, gap, near_tie (first mismatching repeat); report["lossless"]: every mismatch a near tie.
    """
    if not report["mismatches"]:
        for r in report["runs"]:
            if r["kind"] == "specrun":
                r.update(identical=True, first_diff=None, gap=None, near_tie=None)
        report["lossless"] = True
        return
    ref = next(m for m in measurements if m.name == report["reference"] and m.repeat == 0).token_ids
    tokens = {(m.name, m.repeat): m.token_ids for m in measurements}
    for mm in report["mismatches"]:
        d = check(ref, tokens[(mm["name"], mm["repeat"])])
        mm.update(gap=d.gap, near_tie=d.near_tie, tolerance=d.tolerance, reference_token=d.reference_token,
                  other_token=d.other_token)
    for r in report["runs"]:
        if r["kind"] != "specrun":
            continue
        mine = [mm for mm in report["mismatches"] if mm["name"] == r["name"]]
        first = mine[0] if mine else {}
        r.update(identical=not mine, first_diff=first.get("first_diff"), gap=first.get("gap"),
                 near_tie=all(mm["near_tie"] for mm in mine) if mine else None)
    report["lossless"] = all(mm["near_tie"] for mm in report["mismatches"])


def add_roofline(report: dict, roof: dict) -> None:
    """report["roofline"]: the step's bytes and measured bandwidth (roofline.roofline), and each AR run's share of it:
    per repeat against the probes around it where they bracket the repeats (NAME_shares; NAME_share their median),
    else its median tok/s against the median probe."""
    from specrun.bench.roofline import repeat_shares, share

    shares = {}
    for r in report["runs"]:
        if r["name"] in AR_RUNS:
            each = repeat_shares(roof, r["tokens_per_s_all"])
            shares[f"{r['name']}_share"] = _median(each) if each else share(roof, r["tokens_per_s"])
            if each:
                shares[f"{r['name']}_shares"] = each
    report["roofline"] = {**roof, **shares}


def _f(x, fmt="{:.2f}", none="-"):
    return none if x is None else fmt.format(x)


def render(report: dict, console) -> None:
    """Human tables: throughput and ratios, phase split per specrun run, ratios per length, then notes."""
    from rich.table import Table

    t = Table(title=f"specrun bench: {report.get('tokens', '?')} new tokens, {report.get('repeat', '?')} repeats, "
                    f"{report.get('mode', '')}")
    for c in ("run", "tok/s", "min-max", "x hf_ar", "x specrun_ar", "accepted/step", "alpha", "beta", "outside fwd"):
        t.add_column(c, justify="left" if c == "run" else "right")
    for r in report["runs"]:
        t.add_row(r["name"], _f(r["tokens_per_s"], "{:.1f}"),
                  f"{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}", _f(r["ratio_to_hf_ar"]),
                  _f(r["ratio_to_specrun_ar"]), _f(r.get("mean_accepted")), _f(r.get("alpha")), _f(r.get("beta")),
                  _f(r.get("outside_forward_fraction"), "{:.0%}"))
    console.print(t)
    spec = [r for r in report["runs"] if r.get("phase_fraction")]
    if spec:
        p = Table(title="time per phase (share of decode time, prefill excluded)")
        p.add_column("run")
        cols = [*STEP_PHASES, "other"]
        for c in (*cols, "prefill s"):
            p.add_column(c, justify="right")
        for r in spec:
            p.add_row(r["name"], *(_f(r["phase_fraction"].get(c), "{:.1%}") for c in cols),
                      _f(r.get("prefill_seconds"), "{:.3f}"))
        console.print(p)
    by_len = [r for r in spec if r.get("by_length")]
    if by_len:
        bt = Table(title="accepted tokens per step by generated length (first repeat)")
        bt.add_column("run")
        starts = sorted({b["from"] for r in by_len for b in r["by_length"]})
        for a in starts:
            bt.add_column(f"{a}+", justify="right")
        for r in by_len:
            acc = {b["from"]: b["mean_accepted"] for b in r["by_length"]}
            bt.add_row(r["name"], *(_f(acc.get(a)) for a in starts))
        console.print(bt)
    sampled = [r for r in spec if r.get("expected_acceptance") is not None]
    for r in sampled:
        console.print(f"{r['name']}: drafted children's probability mass {r['expected_acceptance']:.3f} vs observed "
                      f"acceptance {r['observed_acceptance']:.3f} per path node (must agree)")
    for r in (r for r in spec if r.get("oracle_accepted")):
        chains = ", ".join(f"depth {d}: {v:.2f}" for d, v in r["oracle_accepted"].items())
        console.print(f"{r['name']} (first repeat): {r['likeliest_share']:.1%} of the sampled tokens were their row's "
                      f"likeliest; drafting chains of the likeliest tokens would give tokens per step {chains}")
    if report.get("lengths"):
        lt = Table(title="by generated length: tok/s to reach it (x hf_ar, x specrun_ar); segment x specrun_ar")
        lt.add_column("run")
        for blk in report["lengths"]:
            lt.add_column(str(blk["length"]), justify="right")
        for i, r in enumerate(report["lengths"][0]["runs"]):
            cells = []
            for blk in report["lengths"]:
                x = blk["runs"][i]
                cells.append(f"{_f(x['tokens_per_s'], '{:.1f}')} ({_f(x['ratio_to_hf_ar'])}, "
                             f"{_f(x['ratio_to_specrun_ar'])}); seg {_f(x['segment_ratio_to_specrun_ar'])}")
            lt.add_row(r["name"], *cells)
        console.print(lt)
    if report["identical"]:
        console.print(f"[green]all specrun runs produced identical tokens[/green] (reference {report['reference']})")
    else:
        for m in report["mismatches"]:
            tie = ""
            if "near_tie" in m:
                verdict = "a near tie" if m["near_tie"] else "[red]NOT a near tie[/red]"
                tie = f": AR score gap {m['gap']:.4g} (tolerance {m['tolerance']:.3g}), {verdict}"
            console.print(f"[yellow]differs[/yellow] {m['name']} repeat {m['repeat']}: first differs from "
                          f"{m['reference']} at token {m['first_diff']}{tie}")
    hm = report.get("hf_ar_matches_specrun_ar")
    if hm is not None:
        console.print("hf_ar tokens " + ("match specrun_ar" if hm["identical"] else
                                         f"differ from specrun_ar from token {hm['first_diff']}"))
    roof = report.get("roofline")
    if roof:
        mb = (roof["weight_bytes"] + roof["kv_bytes"]) / 1e6
        parts = [f"{name[: -len('_share')]} {v:.0%}" for name, v in roof.items() if name.endswith("_share") and v]
        probes = roof.get("bandwidth_probes") or []
        console.print(f"memory roofline: {mb:.0f} MB read per token (weights + KV at {roof['mean_context']} keys) at "
                      f"{roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s measured (median of "
                      f"{', '.join(f'{b / 1e9:.1f}' for b in probes)}) = {1 / roof['min_seconds_per_token']:.1f}"
                      f" tok/s at most for AR; reached: {', '.join(parts) or '-'}")
    for n in report.get("notes", []):
        console.print(f"note: {n}")
