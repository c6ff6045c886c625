"""The pipeline's funnel and mixture as a plain-text table for the terminal."""

from __future__ import annotations

from kiln.data.manifest import Manifest


def format_funnel(manifest: Manifest) -> str:
    """Stage by stage documents in/kept/removed, top reasons, then the mixture in tokens."""
    info = manifest.pipeline
    lines = [f"{'stage':<18} {'in':>11} {'kept':>11} {'removed':>9}  top reasons"]
    for row in info.get("funnel", []):
        removed = row["in"] - row["kept"]
        top = sorted(row["removed"].items(), key=lambda kv: -kv[1])[:3]
        reasons = ", ".join(f"{r} {n:,}" for r, n in top)
        lines.append(
            f"{row['stage']:<18} {row['in']:>11,} {row['kept']:>11,} {removed:>9,}  {reasons}"
        )
    lines.append("")
    lines.append(
        f"{'source':<18} {'tokens before':>14} {'share':>6} {'tokens after':>14} {'share':>6}"
    )
    for name, m in info.get("mix", {}).items():
        lines.append(
            f"{name:<18} {m['tokens_before']:>14,} {m['share_before']:>6.1%} "
            f"{m['tokens_after']:>14,} {m['share_after']:>6.1%}"
        )
    for split, entry in manifest.splits.items():
        lines.append(f"{split}: {entry.tokens:,} tokens in {entry.documents:,} documents")
    decontam = info.get("decontamination", {})
    if decontam:
        parts = [f"{t} {c['documents']} docs/{c['spans']} spans" for t, c in decontam.items()]
        lines.append("decontamination: " + "; ".join(parts))
    return "\n".join(lines)
