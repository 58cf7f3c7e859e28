"""`posprobe geometry`: geometry of W_pos (learned APE) and of the positional part of the residual stream."""

from __future__ import annotations

import argparse

HELP = "PCA / cosine / sinusoid-fit geometry of W_pos and of per-position residual means."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from posprobe.cli import add_model_arguments
    from posprobe.cli.probe import add_text_arguments

    add_model_arguments(p)
    add_text_arguments(p)
    p.add_argument("--layers", default=None, help="comma-separated layers for the residual view (default: first, middle, last)")
    p.add_argument("--point", default="resid_post", choices=["resid_pre", "resid_mid", "resid_post"])
    p.add_argument("--skip-first", type=int, default=1, help="leave out the first N positions of the residual view "
                                                             "(BOS/CLS outliers; default 1)")
    p.add_argument("--components", type=int, default=6, help="principal components to report (default 6)")
    p.add_argument("--max-pos", type=int, default=None, help="W_pos rows to analyse (default: all)")
    p.add_argument("--out", required=True, help="output folder (report.html, geometry.parquet/.csv, meta.json)")


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from posprobe.cli.probe import int_list, load_rows
    from posprobe.backend.facts import model_facts
    from posprobe.analyses.geometry import geometry_figures, residual_geometry, wpos_geometry
    from posprobe.backend.loading import load_model
    from posprobe.report.result import Result

    layers = int_list(args.layers)
    model = load_model(args.model, device=args.device, dtype=args.dtype, n_ctx=args.n_ctx)
    facts = model_facts(model)
    if layers is None:
        layers = tuple(sorted({0, facts.n_layers // 2, facts.n_layers - 1}))
    rows = load_rows(model, args.text, args.window, args.max_windows)
    parts = []
    if facts.has_w_pos:
        parts.append(wpos_geometry(model, n_components=args.components, max_pos=args.max_pos))
    parts.append(residual_geometry(model, rows, list(layers), point=args.point, n_components=args.components,
                                   skip_first=args.skip_first))
    df = pd.concat([r.df for r in parts], ignore_index=True)
    meta = dict(parts[-1].meta, analysis="geometry", views=[r.meta["analysis"] for r in parts],
                text=args.text or "built-in")
    sin = df[df.quantity.isin(["explained_variance", "sin_period", "sin_r2"])]
    sin = sin.assign(layer=sin["layer"].astype("string").fillna("-"))  # W_pos has no layer
    table = sin.pivot_table(index=["source", "layer", "k"], columns="quantity", values="value").round(3)
    summary = ("<p>Residual view: mean of the residual stream at each position over the rows (content averages "
               f"out), positions from {args.skip_first}. Sinusoid fit of each principal component's score against "
               "position: period in positions, R&sup2; of the fit (a period at the search bound, 4x the span, means a "
               "monotonic component with no full cycle).</p>" + table.to_html(classes="pp-table", border=0))
    paths = Result(df, meta).save(args.out, name="geometry", figures=geometry_figures(df),
                                  title=f"Position geometry: {facts.name}", summary_html=summary)
    print(f"wrote {paths['report']}")
    return 0
