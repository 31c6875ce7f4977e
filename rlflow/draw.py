"""A picture of the plan's graph as a standalone SVG (no plotting dependency).

Nodes are laid out left to right by data-flow depth; the weight-sync back edge arcs underneath. The gap between
columns fits the longest edge label, and labels are drawn last, on a white halo, so no stage box hides one.
"""

from __future__ import annotations

from html import escape

from rlflow.plan_model import Plan

COLORS = {"data": "#e8e8e8", "rollout": "#cfe2ff", "reward": "#d1f0d1", "buffer": "#fff0c2", "train": "#f8d0d0"}
W, H, GAP_X, GAP_Y = 130, 46, 80, 40
CHAR_W = 6.5  # width of a character at font-size 11 (sans-serif, generous): what a label needs between two boxes
LABEL = 'paint-order="stroke" stroke="white" stroke-width="4" stroke-linejoin="round"'


def _policy_label(policy: dict) -> str:
    kind = policy["kind"]
    extra = {k: v for k, v in policy.items() if k != "kind" and v not in (None, False, 0)}
    keys = ("eta", "queue", "mode", "filter", "long_tail_fraction")
    shown = ", ".join(f"{k}={extra[k]}" for k in keys if k in extra)
    return f"{kind}({shown})" if shown else kind


def render_svg(plan: Plan) -> str:
    """SVG text for plan.graph."""
    nodes, edges = plan.graph.nodes, plan.graph.edges
    depth: dict[str, int] = {n["name"]: 0 for n in nodes}
    for name in plan.graph.order:  # topological: parents first
        for e in edges:
            if not e["back"] and e["from"] == name and e["to"] in depth:
                depth[e["to"]] = max(depth[e["to"]], depth[name] + 1)
    columns: dict[int, list[str]] = {}
    for n in plan.graph.order:
        columns.setdefault(depth[n], []).append(n)
    longest = max((len(_policy_label(e["policy"])) for e in edges if not e["back"]), default=0)
    gap = max(GAP_X, CHAR_W * longest + 16)
    pos = {}
    for d, names in columns.items():
        for row, n in enumerate(names):
            pos[n] = (20 + d * (W + gap), 40 + row * (H + GAP_Y))
    width = 40 + (max(columns) + 1) * W + max(columns) * gap
    height = 140 + max(len(v) for v in columns.values()) * (H + GAP_Y)
    kinds = {n["name"]: n["kind"] for n in nodes}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           '<defs><marker id="a" markerWidth="8" markerHeight="8" refX="8" refY="4" orient="auto"><path d="M0,0 L8,4 L0,8 z"/></marker></defs>',
           f'<text x="20" y="22" font-size="14" font-weight="bold">{escape(plan.name)}</text>']
    labels = []  # drawn after the boxes
    for e in edges:
        if e["from"] not in pos or e["to"] not in pos:
            continue
        (x1, y1), (x2, y2) = pos[e["from"]], pos[e["to"]]
        label = escape(_policy_label(e["policy"]))
        if e["back"]:
            bottom = height - 40
            out.append(f'<path d="M{x1 + W / 2},{y1 + H} C{x1 + W / 2},{bottom} {x2 + W / 2},{bottom} {x2 + W / 2},{y2 + H}" '
                       f'fill="none" stroke="#a33" stroke-dasharray="5,3" marker-end="url(#a)"/>')
            labels.append(f'<text x="{(x1 + x2 + W) / 2}" y="{bottom - 4}" text-anchor="middle" fill="#a33" {LABEL}>{label}</text>')
        else:
            out.append(f'<line x1="{x1 + W}" y1="{y1 + H / 2}" x2="{x2}" y2="{y2 + H / 2}" stroke="#333" marker-end="url(#a)"/>')
            labels.append(f'<text x="{(x1 + W + x2) / 2}" y="{(y1 + y2 + H) / 2 - 6}" text-anchor="middle" {LABEL}>{label}</text>')
    for name, (x, y) in pos.items():
        kind = kinds[name]
        out.append(f'<rect x="{x}" y="{y}" width="{W}" height="{H}" rx="8" fill="{COLORS.get(kind, "#fff")}" stroke="#333"/>')
        out.append(f'<text x="{x + W / 2}" y="{y + 19}" text-anchor="middle" font-weight="bold">{escape(name)}</text>')
        out.append(f'<text x="{x + W / 2}" y="{y + 35}" text-anchor="middle" fill="#555">{kind}</text>')
    out += labels
    out.append("</svg>")
    return "\n".join(out)
