"""The ranking of ``autotp estimate`` as a table, JSON (``autotp.estimate/1``) or a page.

The page draws what a person compares first: memory per GPU stacked by kind against the
capacity line, and the step time stacked by where it goes, one bar each per configuration,
best first. It is one self-contained HTML file (inline SVG, no scripts).
"""

from __future__ import annotations

import html
import json
from typing import Any

from autotp.planner.job.configure import Config, Estimate

GIB = float(1 << 30)
_MEMORY = (("parameters", "#4e79a7"), ("gradients", "#76b7b2"), ("optimizer", "#59a14f"),
           ("activations", "#f28e2b"), ("transient", "#edc948"))
_TIME = (("compute_s", "compute", "#4e79a7"), ("tp_comm_s", "tp comm", "#e15759"),
         ("ep_comm_s", "ep all-to-all", "#ff9da7"), ("cp_comm_s", "cp ring", "#f1ce63"),
         ("pp_bubble_s", "pp bubble", "#b07aa1"),
         ("dp_comm_s", "dp comm", "#9c755f"), ("optimizer_s", "optimizer", "#bab0ac"))


def to_json(est: Estimate) -> str:
    return json.dumps(est.to_dict(), indent=1) + "\n"


def _row(rank: str, c: Config, ep: bool = False, cp: bool = False) -> str:
    """One configuration; ``ep``: with the expert-parallel degree and all-to-all time;
    ``cp``: with the context-parallel degree and the ring's time."""
    m, t = c.memory, c.time
    assert m is not None and t is not None
    return (f"{rank:>4} {c.tp:>3} " + (f"{c.cp:>3} " if cp else "") +
            f"{c.pp:>3} {c.dp:>4} " + (f"{c.ep:>3} " if ep else "") +
            f"{c.micro_batch:>3} "
            f"{'on' if c.sequence_parallel else 'off':>3} {c.checkpointing:>9} "
            f"{(m.parameters + m.gradients + m.optimizer) / GIB:>8.1f} "
            f"{m.activations / GIB:>7.1f} {m.transient / GIB:>6.1f} {m.total / GIB:>7.1f} "
            f"{t.step:>8.3f} {t.compute:>8.3f} {t.tp_comm:>7.3f} " +
            (f"{t.cp_comm:>7.3f} " if cp else "") +
            (f"{t.ep_comm:>7.3f} " if ep else "") + f"{t.pp_bubble:>7.3f} "
            f"{t.dp_comm:>7.3f} {t.optimizer:>7.3f} {c.mfu:>5.1%}")


def to_table(est: Estimate, top: int = 20) -> str:
    hw = est.hardware
    fits = [c for c in est.configs if c.fits]
    refused = [c for c in est.configs if not c.fits]
    ep = any(c.ep > 1 for c in est.configs)  # a mixture of experts: ep searched or asked
    cp = any(c.cp > 1 for c in est.configs)  # context parallelism searched or asked
    lines = [
        f"autotp estimate: {est.model} on {est.gpus} x {hw.name} "
        f"({hw.memory / GIB:.0f} GiB, {hw.gpus_per_node} per node), global batch "
        f"{est.global_batch} x {est.seq} tokens, {est.dtype}, {est.precision}",
        f"{len(est.configs)} configurations, {len(fits)} fit; searched in {est.seconds:.1f} s",
        "",
        ("    " if ep else "") + ("    " if cp else "") +
        "                                  memory per GPU (GiB)               step time (s)",
        "rank  tp " + ("cp  " if cp else "") + "pp   dp " + ("ep " if ep else "") +
        " mb  sp      ckpt   states    act  trans   total     step  compute"
        "      tp " + ("     cp " if cp else "") + ("     ep " if ep else "") +
        " bubble      dp     opt   MFU",
    ]
    lines += [_row(str(i + 1), c, ep, cp) for i, c in enumerate(fits[:top])]
    if len(fits) > top:
        lines.append(f"  ... {len(fits) - top} more that fit (--top N, or --format json)")
    if not fits:
        lines.append("  none fits")
    if refused:
        lines += ["", f"refused ({len(refused)}):"]
        reasons: dict[str, list[Config]] = {}
        for c in refused:
            reasons.setdefault(_reason_kind(c.why), []).append(c)
        for kind, group in reasons.items():
            c = min(group, key=lambda x: x.memory.total if x.memory else 0.0)
            lines.append(f"  {len(group):>4} x {kind}; e.g. {c.mesh}"
                         + (f",ep={c.ep}" if c.ep > 1 else "") + f" mb={c.micro_batch} "
                         f"sp={'on' if c.sequence_parallel else 'off'} "
                         f"ckpt={c.checkpointing}: {c.why}")
    best = est.best
    if best is not None:
        lines += ["", f"best: {best.flags} --micro-batch {best.micro_batch} "
                      f"--sequence-parallel {'on' if best.sequence_parallel else 'off'} "
                      f"--checkpointing {best.checkpointing}: {best.time.step:.3f} s per step, "
                      f"{best.memory.total / GIB:.1f} GiB on the fullest GPU "
                      f"(stage {best.memory.stage}), MFU {best.mfu:.1%}"]
        if cp:
            lines += _context_lines(est, best)
        if best.experts is not None:
            experts, top_k, imbalance = best.experts
            lines.append(f"experts: {experts // (best.tp * best.ep)} of {experts} whole per "
                         f"rank{f' (ep={best.ep})' if best.ep > 1 else ''}, top "
                         f"{top_k}; under uniform routing the busiest rank computes "
                         f"{imbalance:.3f}x the mean rows (the expert products are timed "
                         f"at it; a real router's imbalance is the model's and the data's)")
    return "\n".join(lines) + "\n"


def _context_lines(est: Estimate, best: Config) -> list[str]:
    """The best configuration beside the best of the other kind (with cp, without), and why
    the one that won did."""
    other = next((c for c in est.configs if c.fits and (c.cp > 1) != (best.cp > 1)), None)
    lines = []
    if best.cp > 1:
        if other is None:
            closest = min((c for c in est.configs if c.cp == 1 and c.memory is not None),
                          key=lambda c: c.memory.total, default=None)
            why = f"; the closest, {closest.mesh}: {closest.why}" if closest else ""
            lines.append(f"without cp: none fits{why}")
        else:
            lines.append(f"without cp, the best is {_brief(other)}: the sequence split over "
                         f"cp={best.cp} takes {best.time.step / other.time.step:.2f}x its step "
                         f"time and {best.memory.total / other.memory.total:.2f}x its memory")
    elif other is not None:
        lines.append(f"with cp, the best is {_brief(other)}: "
                     f"{other.time.step / best.time.step:.2f}x this step (the ring "
                     f"{other.time.cp_comm:.3f} s of it); cp is not needed: "
                     f"{est.seq} tokens fit a GPU whole, and splitting them only adds the ring "
                     f"and shorter products")
    return lines


def _brief(c: Config) -> str:
    assert c.memory is not None and c.time is not None
    return (f"{c.mesh} mb={c.micro_batch} sp={'on' if c.sequence_parallel else 'off'} "
            f"ckpt={c.checkpointing} ({c.time.step:.3f} s, {c.memory.total / GIB:.1f} GiB)")


def _reason_kind(why: str) -> str:
    if "usable of" in why:
        return "out of memory"
    return why.split(":")[0][:60]


def to_html(est: Estimate, top: int = 30) -> str:
    hw = est.hardware
    shown = [c for c in est.configs if c.memory is not None][:top]
    width, bar, gap, left = 900, 16, 10, 260
    scale_mem = (width - left - 40) / max([hw.memory] + [c.memory.total for c in shown])
    slowest = max([c.time.step for c in shown if c.time] or [1.0])
    scale_time = (width - left - 40) / slowest
    rows = []
    for i, c in enumerate(shown):
        y = 30 + i * (2 * bar + gap)
        ep = f",ep={c.ep}" if c.ep > 1 else ""
        label = (f"{c.mesh}{ep} mb={c.micro_batch} sp={'on' if c.sequence_parallel else 'off'} "
                 f"{c.checkpointing}")
        color = "#222" if c.fits else "#b22"
        rows.append(f'<text x="4" y="{y + bar}" font-size="11" fill="{color}">'
                    f'{html.escape(label)}</text>')
        x = left
        d = c.to_dict()
        for key, fill in _MEMORY:
            w = d["memory"][key] * scale_mem
            rows.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar - 2}" '
                        f'fill="{fill}"><title>{key}: {d["memory"][key] / GIB:.2f} GiB'
                        f'</title></rect>')
            x += w
        x = left
        for key, name, fill in _TIME:
            w = d["time"][key] * scale_time
            rows.append(f'<rect x="{x:.1f}" y="{y + bar}" width="{w:.1f}" height="{bar - 2}" '
                        f'fill="{fill}" opacity="0.85"><title>{name}: {d["time"][key]:.3f} s'
                        f'</title></rect>')
            x += w
        rows.append(f'<text x="{x + 4:.1f}" y="{y + 2 * bar - 4}" font-size="10">'
                    f'{c.time.step:.3f} s, MFU {c.mfu:.0%}</text>')
    height = 40 + len(shown) * (2 * bar + gap)
    cap = left + hw.memory * scale_mem
    usable = left + hw.usable_memory * scale_mem
    legend = " ".join(f'<span style="background:{fill}">&nbsp;&nbsp;</span> {k}'
                      for k, fill in _MEMORY)
    legend_t = " ".join(f'<span style="background:{fill}">&nbsp;&nbsp;</span> {n}'
                        for _, n, fill in _TIME)
    title = (f"{est.model} on {est.gpus} x {hw.name}, global batch {est.global_batch} x "
             f"{est.seq}, {est.dtype}")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>autotp estimate: {html.escape(est.model)}</title>
<style>body{{font-family:sans-serif;margin:20px}} .k{{font-size:12px;margin:4px 0}}</style>
</head><body>
<h2>{html.escape(title)}</h2>
<p class="k">Each configuration, best first (red: does not fit): the upper bar is memory per
GPU on its fullest stage, against the dashed capacity line ({hw.memory / GIB:.0f} GiB; dotted:
usable); the lower bar is the step time by where it goes.</p>
<p class="k">memory: {legend}</p><p class="k">time: {legend_t}</p>
<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">
<line x1="{cap:.1f}" y1="20" x2="{cap:.1f}" y2="{height}" stroke="#000" stroke-dasharray="6,4"/>
<line x1="{usable:.1f}" y1="20" x2="{usable:.1f}" y2="{height}" stroke="#555"
 stroke-dasharray="2,3"/>
<text x="{cap + 3:.1f}" y="14" font-size="11">{hw.memory / GIB:.0f} GiB</text>
{chr(10).join(rows)}
</svg>
<pre>{html.escape(to_table(est, top=top))}</pre>
</body></html>
"""


def write(est: Estimate, fmt: str, top: int = 20) -> Any:
    if fmt == "json":
        return to_json(est)
    if fmt == "html":
        return to_html(est, top=max(top, 30))
    return to_table(est, top=top)
