"""``par4d bench data``: what preparing a dataset costs, and whether training slows when the data is large.

1. A text of ``--mb`` MB is generated (paragraphs of words drawn from a fixed list by a seeded generator:
   no download) and a BPE tokenizer of 4,096 tokens is trained on its first 4 MB with ``tokenizers``.
2. ``par4d data prepare`` on the whole text: MB/s and tokens/s, beside the floor a user would write by
   hand, ``tokenizers``' own ``encode_batch`` over the same paragraphs (on the first 32 MB: the floor's
   rate, not its total).
3. ``par4d train --data`` on 4 local ranks (data=4, par4d's demo GPT at vocabulary 4,096) from the
   dataset of the first 1 MB and from the whole one, alternating, ``--rounds`` times each: s/step and each
   rank's peak resident memory (``summary.json``'s ``rss_per_rank``). With ``--confine`` (root, a cgroup
   v1 memory controller), every run is in a cgroup: the small dataset's runs measure the memory a run
   takes (ranks and page cache, ``memory.max_usage_in_bytes``), and the large dataset's run in a cgroup
   that holds that much plus a tenth of the large dataset, so the data is 10x larger than the memory left
   for it and the kernel must drop shard pages to go on (page caches are dropped before each run, so the
   ranks' reads are charged to their cgroup).

JSON rows carry ``framework`` (par4d or tokenizers), ``name`` and ``s_per_iter`` (a training step, or a
prepare's seconds per GB of text).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from par4d.bench.common import emit

WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "pu", "ra", "si", "to", "ve", "zu")
         for b in ("", "n", "r", "st", "ly", "ed", "ing", "ion")]   # 80 words
CGROUP = Path("/sys/fs/cgroup/memory")


def _text(path: Path, megabytes: float, seed: int = 0) -> None:
    """``megabytes`` MB of paragraphs (3-12 sentences of 4-14 words) into ``path``."""
    rng = random.Random(seed)
    target, written = int(megabytes * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            paragraph = " ".join(" ".join(rng.choices(WORDS, k=rng.randint(4, 14))).capitalize() + "."
                                 for _ in range(rng.randint(3, 12))) + "\n\n"
            f.write(paragraph)
            written += len(paragraph)


def _tokenizer(text: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with open(text) as f:
        sample = f.read(4_000_000).split("\n\n")
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def _floor(text: Path, tokenizer) -> tuple[float, int, int]:
    """(seconds, tokens, bytes) of ``tokenizers``' encode_batch over the paragraphs of the first 32 MB,
    256 at a time."""
    with open(text) as f:
        chunk = f.read(32_000_000)
    paragraphs = [p for p in chunk.split("\n\n") if p.strip()]
    began, tokens = time.perf_counter(), 0
    for i in range(0, len(paragraphs), 256):
        tokens += sum(len(ids) for ids in tokenizer.encode(paragraphs[i:i + 256]))
    return time.perf_counter() - began, tokens, len(chunk.encode())


def _train(data: Path, out: Path, args: argparse.Namespace, cgroup: Path | None) -> dict:
    command = [sys.executable, "-m", "par4d.cli", "train", "--data", str(data), "--nproc", str(args.nproc),
               "--grid", f"data={args.nproc}", "--steps", str(args.steps), "--no-progress", "--out", str(out),
               "--save-every", "0", "--keep", "1"]

    def join() -> None:          # in the child, before exec: it and every rank it starts are in the cgroup
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    if cgroup is not None:       # the shards' pages are charged to whoever reads them first: the ranks, now
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")
        (cgroup / "memory.max_usage_in_bytes").write_text("0")
    result = subprocess.run(command, capture_output=True, text=True, preexec_fn=join if cgroup else None)
    if result.returncode:
        raise RuntimeError(f"par4d train --data {data} failed:\n{result.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    if cgroup is not None:
        summary["cgroup_max_bytes"] = int((cgroup / "memory.max_usage_in_bytes").read_text())
        summary["cgroup_limit_bytes"] = int((cgroup / "memory.limit_in_bytes").read_text())
    return summary


def _cgroup(name: str) -> Path:
    if os.geteuid() != 0 or not (CGROUP / "memory.limit_in_bytes").exists():
        raise ValueError("--confine needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
    group = CGROUP / f"par4d-bench-data-{os.getpid()}-{name}"
    group.mkdir()
    return group


def run_bench_data(args: argparse.Namespace) -> int:
    from par4d.data.prepare import prepare
    from par4d.data.tokenizer import load_tokenizer

    if args.mb < 2:
        raise ValueError(f"--mb {args.mb}: give at least 2 (the small dataset is the first 1 MB)")
    groups = {which: _cgroup(which) for which in ("small", "big")} if args.confine else {}
    try:
        with tempfile.TemporaryDirectory(dir=args.workdir, prefix="par4d-bench-data-") as work:
            return _bench(Path(work), args, groups, prepare, load_tokenizer)
    finally:
        for group in groups.values():
            group.rmdir()


def _bench(work: Path, args: argparse.Namespace, groups: dict[str, Path], prepare, load_tokenizer) -> int:
    big, small = work / "big.txt", work / "small.txt"
    print(f"generating {args.mb:,} MB of text in {work} ...", file=sys.stderr)
    _text(big, args.mb)
    with open(big) as f, open(small, "w") as g:
        g.write(f.read(1_000_000).rsplit("\n\n", 1)[0] + "\n")
    tokenizer = load_tokenizer(_tokenizer(big, work / "tok"))
    began = time.perf_counter()
    index = prepare([str(big)], tokenizer, work / "big", progress=not args.json, say=lambda line: None)
    prepare_s = time.perf_counter() - began
    prepare([str(small)], tokenizer, work / "small", progress=False, say=lambda line: None)
    tokens = sum(s["tokens"] for s in index["splits"].values())
    floor_s, floor_tokens, floor_bytes = _floor(big, tokenizer)
    gb = big.stat().st_size / 1e9
    rows = [{"framework": "par4d", "name": "par4d data prepare", "s_per_iter": prepare_s / gb, "unit": "s per GB",
             "megabytes": big.stat().st_size / 1e6, "tokens": tokens, "tokens_per_s": tokens / prepare_s,
             "mb_per_s": big.stat().st_size / 1e6 / prepare_s},
            {"framework": "tokenizers", "name": f"tokenizers encode_batch alone (first {floor_bytes / 1e6:,.0f} MB)",
             "s_per_iter": floor_s / (floor_bytes / 1e9), "unit": "s per GB", "tokens": floor_tokens,
             "tokens_per_s": floor_tokens / floor_s}]
    sizes = {which: sum(h["tokens"] for s in json.loads((work / which / "index.json").read_text())["splits"].values()
                        for h in s["shards"]) * 2 for which in ("small", "big")}
    # Confined, the large dataset also runs unconfined: what the size costs apart from what the limit costs.
    runs: dict[str, list[dict]] = {"small": [], "big": [], **({"big, confined": []} if groups else {})}
    for _ in range(args.rounds):
        for which in runs:
            if which == "big, confined":        # what a run takes, plus a tenth of the large dataset
                taken = max(s["cgroup_max_bytes"] for s in runs["small"])
                (groups["big"] / "memory.limit_in_bytes").write_text(str(taken + sizes["big"] // 10))
            group = groups.get("small" if which == "small" else "big") if which != "big" else None
            out = work / f"run-{which.replace(', ', '-')}-{len(runs[which])}"
            runs[which].append(_train(work / which.split(",")[0], out, args, group))
    for which, summaries in runs.items():
        size = sizes[which.split(",")[0]]
        confined = ", memory confined" if which == "big, confined" else ""
        row = {"framework": "par4d", "name": f"par4d train --data ({size / 2**20:,.1f} MiB of tokens{confined})",
               "grid": f"data={args.nproc}", "s_per_iter": statistics.median(s["s_per_step"] for s in summaries),
               "tokens_per_s": statistics.median(s["tokens_per_s"] for s in summaries),
               "rss_peak_mib_per_rank": max(r["peak_bytes"] for s in summaries for r in s["rss_per_rank"]) / 2**20,
               "dataset_mib": size / 2**20, "runs": len(summaries)}
        if "cgroup_max_bytes" in summaries[0]:
            row.update(cgroup_max_mib=max(s["cgroup_max_bytes"] for s in summaries) / 2**20,
                       cgroup_limit_mib=summaries[-1]["cgroup_limit_bytes"] / 2**20)
        rows.append(row)
    if not emit(rows, args.out, args.json):
        print(f"{args.mb:,} MB of generated text, BPE vocabulary 4,096; par4d train on {args.nproc} local ranks "
              f"(data={args.nproc}), {args.steps} steps, median of {args.rounds} runs each")
        for row in rows:
            extra = (f", {row['tokens_per_s']:,.0f} tokens/s" +
                     (f", peak RSS {row['rss_peak_mib_per_rank']:,.0f} MiB per rank"
                      if "rss_peak_mib_per_rank" in row else ""))
            unit = row.get("unit", "s per step")
            if "cgroup_max_mib" in row:
                limit = row["cgroup_limit_mib"]
                extra += (f"; the run's cgroup used at most {row['cgroup_max_mib']:,.0f} MiB" +
                          (f" of {limit:,.0f}" if limit < 2**40 else ""))
            print(f"{row['name']:<60} {row['s_per_iter']:8.3f} {unit}{extra}")
    return 0
