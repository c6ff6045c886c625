"""`pipeline/report.html`: the funnel, the mixture, histograms and example documents, one file.

Self-contained HTML with inline SVG bars (no scripts, no network, no plotting library), so it
opens anywhere and can be attached to a bug report as is. Each number of the funnel table links
to examples of the documents behind it: removed ones by reason, changed ones by stage, and the
documents that reached the output.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from kiln.io import atomic_write

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1150px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:.2em .7em;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}tr:nth-child(even) td{background:#fafafa}
.bar{fill:#4a7bd0}.rm{fill:#e07a5f}.axis{font-size:11px;fill:#555}
pre{white-space:pre-wrap;background:#f7f7f7;padding:.5em;border-left:3px solid #e07a5f;
max-height:12em;overflow:auto;font-size:12px}.muted{color:#777}
.grid{display:flex;flex-wrap:wrap;gap:1.5em}
"""


class _Raw(str):
    """Table cell content that is already HTML."""


def _esc(value: Any) -> str:
    return value if isinstance(value, _Raw) else html.escape(str(value))


def _link(text: str, anchor: str, targets: set[str]) -> str:
    """`text` linking to `#anchor` when the page has that section, else plain."""
    if anchor not in targets:
        return html.escape(text)
    return _Raw(f'<a href="#{html.escape(anchor)}">{html.escape(text)}</a>')


def _table(header: list[str], rows: list[list[Any]], left: tuple[int, ...] = (0,)) -> str:
    def cell(tag: str, i: int, v: Any) -> str:
        cls = ' class="l"' if i in left else ""
        return f"<{tag}{cls}>{_esc(v)}</{tag}>"

    head = "".join(cell("th", i, h) for i, h in enumerate(header))
    body = "".join(
        "<tr>" + "".join(cell("td", i, v) for i, v in enumerate(r)) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _funnel_svg(funnel: list[dict[str, Any]]) -> str:
    width, row_h, label_w = 1000, 26, 150
    top = max((row["in"] for row in funnel), default=1) or 1
    parts = []
    for i, row in enumerate(funnel):
        y = i * row_h
        kept_w = (width - label_w - 260) * row["kept"] / top
        rm_w = (width - label_w - 260) * (row["in"] - row["kept"]) / top
        parts.append(f'<text class="axis" x="0" y="{y + 17}">{_esc(row["stage"])}</text>')
        parts.append(
            f'<rect class="bar" x="{label_w}" y="{y + 4}" width="{kept_w:.1f}" height="18"/>'
        )
        parts.append(
            f'<rect class="rm" x="{label_w + kept_w:.1f}" y="{y + 4}" width="{rm_w:.1f}" '
            f'height="18"/>'
        )
        parts.append(
            f'<text class="axis" x="{label_w + kept_w + rm_w + 6:.1f}" y="{y + 17}">'
            f"{row['kept']:,} kept, {row['in'] - row['kept']:,} removed</text>"
        )
    height = row_h * len(funnel)
    return f'<svg width="{width}" height="{height}">{"".join(parts)}</svg>'


def _hist_svg(title: str, counts: list[int], labels: list[str]) -> str:
    width, height, pad = 320, 140, 22
    top = max(counts, default=0) or 1
    bar_w = (width - 2) / max(len(counts), 1)
    bars = []
    for i, c in enumerate(counts):
        h = (height - pad - 14) * c / top
        x = 1 + i * bar_w
        bars.append(
            f'<rect class="bar" x="{x:.1f}" y="{height - pad - h:.1f}" width="{bar_w - 1:.1f}" '
            f'height="{h:.1f}"><title>{_esc(labels[i])}: {c:,}</title></rect>'
        )
    axis = (
        f'<text class="axis" x="0" y="{height - 6}">{_esc(labels[0])}</text>'
        f'<text class="axis" x="{width}" y="{height - 6}" text-anchor="end">'
        f"{_esc(labels[-1])}</text>"
    )
    return (
        f'<div><b>{_esc(title)}</b><br><svg width="{width}" height="{height}">'
        f'<text class="axis" x="0" y="11">max {top:,}</text>{"".join(bars)}{axis}</svg></div>'
    )


def _histograms(hists: dict[str, Any]) -> str:
    bins = hists.get("bins", {})
    labels = {
        "log10_chars": [f"10^{b:g} chars" for b in bins.get("log10_chars", [])],
        "lang_score": [f"{b:.2f}" for b in bins.get("lang_score", [])],
        "classifier_score": [f"{b:.2f}" for b in bins.get("classifier_score", [])],
        "tokens": [f"{int(b):,} tokens" for b in bins.get("tokens", [])],
    }
    titles = {
        "log10_chars": "document length as read (characters, log scale)",
        "lang_score": "language-ID score",
        "classifier_score": "quality-classifier score P(high quality)",
        "tokens": "training document length (tokens, log2 bins)",
    }
    out = []
    for source, per in hists.items():
        if source == "bins":
            continue
        charts = [
            _hist_svg(titles[key], counts, labels[key][:-1] or ["?"])
            for key, counts in per.items()
            if key in labels and sum(counts) > 0 and labels[key]
        ]
        out.append(f"<h3>{_esc(source)}</h3><div class='grid'>{''.join(charts)}</div>")
    return "".join(out)


def _removed_anchor(key: str) -> str:
    """The section id of the removed examples of one `stage/reason`."""
    return "removed-" + key.replace("/", "-")


def _output_anchor(key: str) -> str:
    """The section id of output examples: `kept`, `changed-<stage>`, `merged-<stage>`."""
    return key.replace("/", "-")


def _anchors(stats: dict[str, Any]) -> set[str]:
    """Every example section the page will have."""
    removed = {_removed_anchor(k) for k in stats.get("removed_samples", {})}
    return removed | {_output_anchor(k) for k in stats.get("output_samples", {})}


def _samples(samples: dict[str, list[dict[str, Any]]]) -> str:
    out = []
    for key in sorted(samples):
        out.append(f"<h3 id='{_esc(_removed_anchor(key))}'>{_esc(key)}</h3>")
        for r in samples[key]:
            dup = f" — duplicate of {_esc(r['duplicate_of'])}" if r.get("duplicate_of") else ""
            if "score" in r:
                dup += f" — score {_esc(r['score'])}"
            out.append(
                f"<div class='muted'>{_esc(r['id'])} ({_esc(r['file'])} record "
                f"{_esc(r['ordinal'])}){dup}</div><pre>{_esc(r.get('excerpt', ''))}</pre>"
            )
    return "".join(out)


_OUTPUT_TITLES = {
    "kept": "documents that reached the output (each passed every stage)",
    "changed": "documents {stage} changed (and kept)",
    "merged": "kept documents that {stage} merged duplicates into",
}


def _output_samples(samples: dict[str, list[dict[str, Any]]]) -> str:
    out = []
    for key in sorted(samples, key=lambda k: (k != "kept", k)):
        kind, _, stage = key.partition("/")
        title = _OUTPUT_TITLES.get(kind, key).format(stage=stage)
        out.append(f"<h3 id='{_esc(_output_anchor(key))}'>{_esc(title)}</h3>")
        for r in samples[key]:
            notes = [
                f"{h['stage']}: {h['change']} ({h['chars_before']:,} -> {h['chars_after']:,} chars)"
                for h in r.get("history", [])
            ]
            notes += [f"merged {d['id']} ({d['reason']})" for d in r.get("duplicates", [])]
            out.append(
                f"<div class='muted'>{_esc(r['id'])} ({_esc(r['file'])} record "
                f"{_esc(r['ordinal'])})</div>"
                + "".join(f"<div class='muted'>· {_esc(n)}</div>" for n in notes)
                + f"<pre>{_esc(r.get('excerpt', ''))}</pre>"
            )
    return "".join(out)


def _funnel_rows(funnel: list[dict[str, Any]], targets: set[str]) -> list[list[Any]]:
    """The funnel table; every number links to examples of its documents where there are any."""
    rows = []
    for row in funnel:
        stage = row["stage"]
        reasons = sorted(row["removed"].items(), key=lambda x: -x[1])
        links = [_link(f"{r}: {n:,}", _removed_anchor(f"{stage}/{r}"), targets) for r, n in reasons]
        first = _removed_anchor(f"{stage}/{reasons[0][0]}") if reasons else ""
        changed = row.get("changed", 0)
        merged = f"merged-{stage}"
        rows.append(
            [
                stage,
                f"{row['in']:,}",
                _link(f"{row['kept']:,}", "kept", targets),
                _link(f"{row['in'] - row['kept']:,}", first, targets),
                _link(f"{changed:,}", f"changed-{stage}", targets) if changed else "",
                _Raw(", ".join(_esc(x) for x in links))
                + (
                    _Raw(f" ({_link('merged into', merged, targets)})") if merged in targets else ""
                ),
            ]
        )
    return rows


def render_report(stats: dict[str, Any]) -> str:
    """The report page for a run's stats (as written to pipeline/stats.json)."""
    funnel = stats["funnel"]
    funnel_rows = _funnel_rows(funnel, _anchors(stats))
    mix_rows = [
        [
            name,
            f"{m['documents_before']:,}",
            f"{m['tokens_before']:,}",
            f"{m['share_before']:.1%}",
            "-" if m["target_share"] is None else f"{m['target_share']:.1%}",
            f"{m['tokens_after']:,}",
            f"{m['share_after']:.1%}",
            f"{m['documents_after']:,}",
            m["max_repeats"],
        ]
        for name, m in stats["mix"].items()
    ]
    decontam_rows = [
        [task, c["documents"], c["spans"], c["dropped"]]
        for task, c in stats.get("decontamination", {}).items()
    ]
    issues = stats.get("read_issues", {})
    split_rows = [
        [name, f"{s['documents']:,}", f"{s['tokens']:,}"]
        for name, s in stats.get("splits", {}).items()
    ]
    sections = [
        "<h1>kiln data pipeline report</h1>",
        f"<p class='muted'>config digest {_esc(stats.get('digest', ''))}</p>",
        "<h2>Output</h2>",
        _table(["split", "documents", "tokens"], split_rows),
        "".join(f"<p><b>warning:</b> {_esc(w)}</p>" for w in stats.get("warnings", [])),
        "<h2>Funnel</h2>",
        _funnel_svg(funnel),
        _table(["stage", "in", "kept", "removed", "changed", "reasons"], funnel_rows, left=(0, 5)),
        _models(stats.get("models", {})),
        "<h2>Mixture (training split, in tokens)</h2>",
        _table(
            [
                "source",
                "docs before",
                "tokens before",
                "share before",
                "target share",
                "tokens after",
                "share after",
                "docs after",
                "max repeats",
            ],
            mix_rows,
        ),
        "<h2>Decontamination (per evaluation task)</h2>",
        _table(["task", "documents touched", "spans removed", "documents dropped"], decontam_rows)
        if decontam_rows
        else "<p>No evaluation n-gram was found in the surviving documents.</p>",
        "<h2>Input problems</h2>",
        f"<pre>{_esc(_format_issues(issues))}</pre>",
        "<h2>Histograms</h2>",
        _histograms(stats.get("histograms", {})),
        "<h2>Removed documents, examples by reason</h2>",
        _samples(stats.get("removed_samples", {})),
        "<h2>Output documents, examples (with what changed them)</h2>",
        _output_samples(stats.get("output_samples", {})),
    ]
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kiln data report</title>"
        f"<style>{_CSS}</style></head><body>{''.join(sections)}</body></html>\n"
    )


def _models(models: dict[str, Any]) -> str:
    """The model-based stages: what each model was trained on, how well it did, what it applied."""
    if not models:
        return ""
    out = ["<h2>Model-based quality stages</h2>"]
    c = models.get("classifier")
    if c:
        held = c.get("held_out", {})
        out.append(
            f"<h3>classifier</h3><p>{_esc(c['model'])}: held-out accuracy "
            f"{held.get('accuracy', float('nan')):.1%} on {held.get('documents', 0):,} documents "
            f"(positive {held.get('positive_accuracy', float('nan')):.1%}, negative "
            f"{held.get('negative_accuracy', float('nan')):.1%}, at 0.5); trained on "
            f"{c.get('positive_documents', 0):,} positive ({_esc(', '.join(c.get('positive', [])))})"
            f" and {c.get('negative_documents', 0):,} negative "
            f"({_esc(', '.join(c.get('negative', [])))}) documents; threshold applied "
            f"{c['threshold']:.4f} (keep-fraction quantiles from "
            f"{c.get('quantile_documents', 0):,} held-out negative documents). Examples: <a href='#kept'>kept</a>, "
            f"<a href='#{_removed_anchor('classifier/classifier.low_score')}'>removed</a>.</p>"
        )
        if "spearman" in held:  # trained on LM annotations (kiln data annotate)
            out.append(
                f"<p>Labels: LM annotations ({_esc(', '.join(c.get('annotations', [])))}), "
                f"positive at score &ge; {c.get('positive_score', '?')}; agreement on the "
                f"held-out documents: Spearman {held['spearman']:.3f} between P(positive) and "
                f"the annotated score.</p>"
            )
    p = models.get("perplexity")
    if p:
        out.append(
            f"<h3>perplexity</h3><p>{_esc(p['model'])}: {p.get('order', '?')}-gram LM on "
            f"{p.get('tokens', 0):,} reference tokens ({_esc(', '.join(p.get('reference', [])))})"
            f"; head up to perplexity {p['head_cutoff']:.1f}, tail above {p['tail_cutoff']:.1f} "
            f"(from {p.get('sample_documents', 0):,} sample documents); kept: "
            f"{_esc(', '.join(p['keep']))}.</p>"
        )
    return "".join(out)


def _format_issues(issues: dict[str, Any]) -> str:
    if not issues or not any(issues.get("counts", {}).values()):
        return "none"
    lines = [f"{kind}: {n:,}" for kind, n in issues.get("counts", {}).items()]
    from kiln.data.pipeline.read.readers import ReadIssues

    for ex in issues.get("examples", []):
        lines.append("  " + ReadIssues.format_example(ex))
    return "\n".join(lines)


def write_report(path: Path, stats: dict[str, Any]) -> None:
    """Write the report page atomically."""
    with atomic_write(path, "w") as handle:
        handle.write(render_report(stats))
