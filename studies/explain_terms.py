"""What pretraining teaches the attention terms: `disentangled explain` over held-out text, pretrained against untrained.

    OMP_NUM_THREADS=1 python -m studies.explain_terms             # about 9 minutes on one CPU thread

Text: `disentangled.demo.data.python_docs_split` (the Python reference's topics and the standard library's docstrings, real
English that ships with Python), split by source file. The training part pretrains a `--config tiny` model (hidden
64, 4 layers, 4 heads, DeBERTa-v3 attention: c2c + c2p + p2c, 256 log buckets, shared keys) with masked LM,
`--max-steps` steps of 32 x 128 tokens, through `disentangled pretrain`; a 2,000-piece SentencePiece tokenizer is
trained on the same part. The same architecture with random weights (`--untrained-seeds`, the initialisation
pretraining starts from) is the baseline. Both are explained with `disentangled explain --texts-file` on the held-out
part (one text per document, cut at 128 tokens, [CLS]/[SEP] left out of the distance profiles).

Writes docs/explain/pretrained/ and docs/explain/untrained/ (the command's figures), docs/explain/compare_distance.png
and a record in benchmarks/records/explain_terms.jsonl (the statistics.json files stay in `--work`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

from disentangled.demo.data import python_docs_split

ROOT = Path(__file__).resolve().parents[1]


def write_texts(work: Path, max_documents: int | None) -> tuple[Path, Path]:
    """train.jsonl and held-out.jsonl ({"text": ...} per document) from the Python documentation split."""
    paths = []
    for name, documents in zip(("train.jsonl", "held-out.jsonl"), python_docs_split()):
        path = work / name
        rows = documents[:max_documents] if max_documents else documents
        path.write_text("".join(json.dumps({"text": document["text"]}) + "\n" for document in rows))
        paths.append(path)
    return paths[0], paths[1]


def main_quietly(argv: list[str]) -> tuple[int, str]:
    """`disentangled ARGV` in this process; its exit status and what it printed (also echoed)."""
    from disentangled.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(argv)
    sys.stdout.write(printed.getvalue())
    if status != 0:
        raise SystemExit(f"disentangled {' '.join(argv)} failed ({status})")
    return status, printed.getvalue()


def untrained_folder(pretrained: Path, folder: Path, seed: int) -> Path:
    """The pretrained model's architecture and tokenizer with the initial random weights of `seed`."""
    import torch

    from disentangled import DisentangledConfig, DisentangledModel

    torch.manual_seed(seed)
    DisentangledModel(DisentangledConfig.from_pretrained(pretrained)).save_pretrained(folder)
    for name in ("spm.model", "tokenizer_config.json"):
        shutil.copyfile(pretrained / name, folder / name)
    return folder


def summary(statistics: dict) -> dict:
    """Per layer and term: mean |s|, std, share and share within rows; total mean |s| and std; the mean of each
    position term over heads at δ = -2..2 and at the farthest distances either side."""
    layers = []
    for layer in statistics["layers"]:
        profile = layer["distance_profile"]
        distances = profile["distance"]
        picks = [d for d in (distances[0], -2, -1, 0, 1, 2, distances[-1]) if d in distances]
        layers.append(
            {
                "terms": {
                    term: {name: round(value, 4) for name, value in stats.items()}
                    for term, stats in layer["terms"].items()
                },
                "total": {name: round(value, 4) for name, value in layer["total"].items()},
                "profile": {
                    term: {str(d): round(profile[term][distances.index(d)], 4) for d in picks}
                    for term in statistics["terms"]
                },
            }
        )
    return {"texts": statistics["texts"], "pairs": statistics["pairs"], "layers": layers}


def plot_comparison(results: dict[str, dict], path: Path, reach: int = 16) -> Path:
    """Top: each term's standard deviation and share of the score variance, layer by layer, pretrained (solid)
    against untrained (hatched). Bottom: the mean of each term (over heads) at each relative distance |δ| <= reach,
    pretrained (solid) against untrained (dashed)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    from disentangled.explain.plots import TERM_COLORS

    terms = results["pretrained"]["terms"]
    count = len(results["pretrained"]["layers"])
    figure = Figure(figsize=(4.4 * len(terms), 7.0), layout="constrained")
    top, bottom = figure.subfigures(2, 1, height_ratios=[1, 1.1])
    bars = top.subplots(1, 2)
    width = 0.8 / (2 * len(terms))
    for ax, statistic, title in ((bars[0], "std", "std of each term"), (bars[1], "share", "share of Var(score)")):
        for position, (name, term) in enumerate((name, term) for term in terms for name in ("pretrained", "untrained")):
            values = [layer["terms"][term][statistic] for layer in results[name]["layers"]]
            offsets = [index + (position - (2 * len(terms) - 1) / 2) * width for index in range(count)]
            hatch = None if name == "pretrained" else "///"
            label = f"{term}, {name}"
            ax.bar(
                offsets,
                values,
                width,
                color=TERM_COLORS[term],
                hatch=hatch,
                alpha=1.0 if hatch is None else 0.5,
                label=label,
            )
        ax.set_xticks(range(count))
        ax.set_xlabel("layer")
        ax.set_title(title, fontsize=10)
        ax.axhline(0, color="black", linewidth=0.6)
    bars[0].set_yscale("log")
    bars[1].legend(fontsize=7, ncol=2)
    axes = bottom.subplots(1, len(terms), squeeze=False)[0]
    for ax, term in zip(axes, terms):
        for name, style in (("pretrained", "-"), ("untrained", "--")):
            for index, layer in enumerate(results[name]["layers"]):
                profile = layer["distance_profile"]
                near = [k for k, d in enumerate(profile["distance"]) if abs(d) <= reach]
                color = colormaps["viridis"](index / max(count - 1, 1))
                ax.plot(
                    [profile["distance"][k] for k in near],
                    [profile[term][k] for k in near],
                    style,
                    marker=".",
                    color=color,
                    label=f"{name}, layer {index}",
                )
        ax.axhline(0, color="black", linewidth=0.6)
        ax.axvline(0, color="grey", linewidth=0.4)
        ax.set_title(f"mean {term} by distance (mean of heads)", fontsize=10)
        ax.set_xlabel("relative distance δ(i, j) = i - j")
    axes[0].set_ylabel("mean score (scaled)")
    axes[-1].legend(fontsize=6, ncol=2)
    figure.suptitle(
        "held-out Python documentation: pretrained (solid) against untrained (hatched, dashed)", fontsize=10
    )
    figure.savefig(path, dpi=110)
    return path


def markdown_tables(record: dict) -> str:
    """The page's two tables from a record: the statistics of each term, pretrained against untrained (seed range),
    and the mean of each term at the distances near 0."""
    figures = record["figures"]
    untrained = [figures[name] for name in figures if name.startswith("untrained") and name != "untrained_seeds"]
    lines = [
        "| layer | term | mean \\|s\\| | std | share | in rows | untrained mean \\|s\\| | untrained std "
        "| untrained share (seeds) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for index, layer in enumerate(figures["pretrained"]["layers"]):
        for term, stats in [*layer["terms"].items(), ("total", layer["total"])]:
            cells = [f"{stats['mean_abs']:.3f}", f"{stats['std']:.3f}"]
            cells += [f"{100 * stats[k]:.0f}%" for k in ("share", "row_share")] if term != "total" else ["", ""]
            base = untrained[0]["layers"][index]
            other = base["total"] if term == "total" else base["terms"][term]
            cells += [f"{other['mean_abs']:.4f}", f"{other['std']:.4f}"]
            if term != "total":
                shares = [100 * run["layers"][index]["terms"][term]["share"] for run in untrained]
                cells.append(f"{min(shares):.0f}-{max(shares):.0f}%")
            else:
                cells.append("")
            lines.append(f"| {index if term == 'c2c' else ''} | {term} | " + " | ".join(cells) + " |")
    distances = sorted(figures["pretrained"]["layers"][0]["profile"]["c2c"], key=int)
    lines += [
        "",
        "| layer | term | " + " | ".join(f"δ = {d}" for d in distances) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in distances) + " |",
    ]
    for index, layer in enumerate(figures["pretrained"]["layers"]):
        for term, profile in layer["profile"].items():
            cells = [f"{profile[d]:+.2f}" if d in profile else "" for d in distances]
            lines.append(f"| {index if term == 'c2c' else ''} | {term} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=500, help="pretraining steps (default 500)")
    parser.add_argument("--pretrain-seed", type=int, default=0, help="pretraining seed (default 0)")
    parser.add_argument("--vocab-size", type=int, default=2000, help="SentencePiece pieces (default 2000)")
    parser.add_argument("--untrained-seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-texts", type=int, default=None, help="held-out texts to explain (default all)")
    parser.add_argument("--max-documents", type=int, default=None, help="a smaller corpus, for a quick check")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "explain", help="figures (default docs/explain)")
    parser.add_argument("--records", type=Path, default=ROOT / "benchmarks" / "records", help="record folder")
    parser.add_argument("--work", type=Path, default=None, help="keep the data and models here (default: temporary)")
    parser.add_argument("--tables", action="store_true", help="print the page's tables from the last record; no run")
    args = parser.parse_args(argv)

    from benchmarks.records import append_record, read_records

    if args.tables:
        seed = args.pretrain_seed
        records = [
            record
            for record in read_records("explain_terms", folder=args.records)
            if record["figures"]["pretraining"].get("seed", 0) == seed
        ]
        if not records:
            raise SystemExit(f"no explain_terms record of --pretrain-seed {seed} in {args.records}: run the benchmark")
        print(markdown_tables(records[-1]))
        return records[-1]["figures"]

    with tempfile.TemporaryDirectory() as temporary:
        work = args.work or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        train, held_out = write_texts(work, args.max_documents)
        pretrained = work / "pretrained"
        pretrain = [
            "pretrain",
            "--train-file",
            str(train),
            "--validation-file",
            str(held_out),
            "--objective",
            "mlm",
            "--config",
            "tiny",
        ]
        pretrain += [
            "--vocab-size",
            str(args.vocab_size),
            "--max-seq-length",
            "128",
            "--per-device-train-batch-size",
            "32",
        ]
        pretrain += ["--max-steps", str(args.max_steps), "--seed", str(args.pretrain_seed), "--logging-steps", "100"]
        pretrain += ["--save-strategy", "no", "--report-to", "none", "--disable-tqdm", "true"]
        _, printed = main_quietly([*pretrain, "--output-dir", str(pretrained)])
        check = re.search(r"accuracy on masked tokens ([0-9.]+) \((\d+) sequences\)", printed)

        explain = ["--texts-file", str(held_out), "--layer", "0", "--head", "0"]
        explain += ["--max-texts", str(args.max_texts)] if args.max_texts else []
        results = {}
        for name, seed in [("pretrained", None), *(("untrained", seed) for seed in args.untrained_seeds)]:
            folder = pretrained if seed is None else untrained_folder(pretrained, work / f"untrained-{seed}", seed)
            key = name if seed in (None, args.untrained_seeds[0]) else f"untrained-{seed}"
            out = args.out / name if key == name else work / f"out-{seed}"  # figures: pretrained and the first seed
            statistics = work / f"{key}.json"  # per-head profiles at every distance: large, kept out of docs/
            main_quietly(["explain", str(folder), *explain, "--out", str(out), "--json", str(statistics)])
            results[key] = json.loads(statistics.read_text())
        plot_comparison(results, args.out / "compare_distance.png")

    figures = {
        "model": "tiny preset (hidden 64, 4 layers x 4 heads), c2c + c2p + p2c, 256 log buckets, shared keys",
        "pretraining": {
            "steps": args.max_steps,
            "seed": args.pretrain_seed,
            "held_out_masked_accuracy": float(check[1]) if check else None,
            "held_out_sequences": int(check[2]) if check else None,
        },
        "explained": "held-out documents of python_docs_split, cut at 128 tokens; profiles without [CLS]/[SEP]",
        "untrained_seeds": args.untrained_seeds,
        **{name: summary(statistics) for name, statistics in results.items()},
    }
    command = ["python", "-m", "studies.explain_terms", *(argv if argv is not None else sys.argv[1:])]
    append_record("explain_terms", figures, command=command, folder=args.records)
    return figures


if __name__ == "__main__":
    run()
