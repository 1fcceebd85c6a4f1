"""Fetch what the Search-R1 replication needs: the 2018 Wikipedia corpus, FlashRAG's QA splits and (asked) the e5 index.

    python recipes/prepare_search_r1_data.py --out_dir data/search_r1                 # corpus + NQ + HotpotQA
    python recipes/prepare_search_r1_data.py --out_dir data/search_r1 --e5            # + the e5 Flat FAISS index
    python recipes/prepare_search_r1_data.py --out_dir data/search_r1 --bm25          # + build BM25 once, timed

Files come from the Hub through `huggingface_hub` (Search-R1's own sources): `PeterJinGo/wiki-18-corpus`
(`wiki-18.jsonl.gz`, unpacked to `wiki-18.jsonl`, 21M passages of 100 words), `RUC-NLPIR/FlashRAG_datasets`
(`<name>/<split>.jsonl`) and `PeterJinGo/wiki-18-e5-index` (`part_aa` + `part_ab`, joined into `e5_Flat.index`).
Run it again after an interruption: finished files are kept, an interrupted download resumes where it stopped
(`huggingface_hub` keeps the partial file; with `--mirror` a `.part` file is continued). `--mirror DIR` reads the
same files from a local copy laid out as `DIR/<repo id>/<file>` (an offline machine, a shared disk). Every file is
checked (the corpus rows and the QA rows parse, with the offending file and line named otherwise) and its size and
time are printed. Then:

    python -m trl_multiturn.search.server --corpus data/search_r1/wiki-18.jsonl --retriever bm25 --port 8000
    accelerate launch recipes/search_agent.py --config recipes/configs/search_r1_qwen2.5_3b.yaml \
        --dataset data/search_r1/nq/train.jsonl,data/search_r1/hotpotqa/train.jsonl \
        --eval_dataset data/search_r1/nq/test.jsonl
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from pathlib import Path

CORPUS_REPO, CORPUS_FILE = "PeterJinGo/wiki-18-corpus", "wiki-18.jsonl.gz"
QA_REPO = "RUC-NLPIR/FlashRAG_datasets"
E5_REPO, E5_PARTS = "PeterJinGo/wiki-18-e5-index", ("part_aa", "part_ab")
CHUNK = 8 << 20


def _size(path: Path) -> str:
    return f"{path.stat().st_size / 2**20:,.1f} MiB"


def fetch(repo: str, filename: str, out_dir: Path, mirror: Path | None) -> Path:
    """``repo``'s ``filename`` at ``out_dir/filename``: kept if already there, else downloaded (an interrupted
    download resumes)."""
    out = out_dir / filename
    if out.exists():
        print(f"  {out} already there ({_size(out)})", flush=True)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if mirror is not None:
        source = mirror / repo / filename
        if not source.is_file():
            raise FileNotFoundError(f"{source} does not exist: --mirror {mirror} must hold {repo}'s {filename} at "
                                    f"<mirror>/{repo}/{filename} (or drop --mirror to download from the Hub).")
        part = out.with_name(out.name + ".part")
        done = part.stat().st_size if part.exists() else 0
        if done:
            print(f"  resuming {filename} at {done / 2**20:,.1f} MiB", flush=True)
        with open(source, "rb") as src, open(part, "ab") as dst:
            src.seek(done)
            shutil.copyfileobj(src, dst, CHUNK)
        part.rename(out)
    else:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

        try:  # hf_hub_download keeps an interrupted download under out.parent/.cache and resumes it
            got = Path(hf_hub_download(repo, filename, repo_type="dataset", local_dir=out_dir))
        except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as exc:
            raise RuntimeError(f"could not download {filename} from the Hub dataset {repo} ({type(exc).__name__}: "
                               f"{exc}). Check the network (and HF_HUB_OFFLINE, HF_ENDPOINT), or pass --mirror DIR "
                               f"with a copy at DIR/{repo}/{filename}.") from exc
        if got.resolve() != out.resolve():
            got.replace(out)
    print(f"  {out}: {_size(out)} in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def unpack_corpus(gz: Path, out: Path) -> Path:
    """``wiki-18.jsonl.gz`` -> ``wiki-18.jsonl`` (through a .part file, so an interrupted unpacking restarts)."""
    if out.exists():
        return out
    start = time.perf_counter()
    part = out.with_name(out.name + ".part")
    with gzip.open(gz, "rb") as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, CHUNK)
    part.rename(out)
    print(f"  unpacked {out}: {_size(out)} in {time.perf_counter() - start:.1f} s", flush=True)
    return out


def check_jsonl(path: Path, kind: str) -> int:
    """Rows of a corpus ("corpus": 'contents' or 'text') or QA file ("qa": 'question' and 'golden_answers')."""
    rows = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({exc.msg}); delete the file and run again to "
                                 f"fetch it anew.") from exc
            keys = sorted(row) if isinstance(row, dict) else []
            if kind == "corpus":
                ok, need = "contents" in keys or "text" in keys, "'contents' (or 'title' and 'text')"
            else:
                ok, need = "question" in keys and "golden_answers" in keys, "'question' and 'golden_answers'"
            if not ok:
                raise ValueError(f"{path}:{lineno} has keys {keys}; a {kind} row needs {need}. Delete the file and run "
                                 f"again to fetch it anew, or fix the row.")
            rows += 1
    if not rows:
        raise ValueError(f"{path} holds no rows; delete it and run again to fetch it anew.")
    return rows


def join_parts(parts: list[Path], out: Path) -> Path:
    if not out.exists():
        part = out.with_name(out.name + ".part")
        with open(part, "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, dst, CHUNK)
        part.rename(out)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="data/search_r1", help="Where the files go (about 14 GB, 80 GB with --e5).")
    parser.add_argument("--qa", nargs="+", default=["nq:train,test", "hotpotqa:train,dev"],
                        help="FlashRAG datasets and splits, as name:split,split (FlashRAG's nq has test, hotpotqa dev).")
    parser.add_argument("--e5", action="store_true", help="Also fetch the e5 Flat FAISS index (about 65 GB).")
    parser.add_argument("--bm25", action="store_true",
                        help="Also build the BM25 index over the corpus once, to print its build time and size (the "
                             "retrieval server builds it again at start; needs about 2x the corpus in memory).")
    parser.add_argument("--keep_gz", action="store_true", help="Keep wiki-18.jsonl.gz after unpacking it.")
    parser.add_argument("--mirror", default=None, help="Read the files from DIR/<repo id>/<file> instead of the Hub.")
    args = parser.parse_args(argv)
    out, mirror = Path(args.out_dir), (Path(args.mirror) if args.mirror else None)
    report: dict = {}
    t0 = time.perf_counter()

    print(f"[corpus] {CORPUS_REPO}/{CORPUS_FILE}", flush=True)
    corpus = out / "wiki-18.jsonl"
    if not corpus.exists():
        gz = fetch(CORPUS_REPO, CORPUS_FILE, out, mirror)
        unpack_corpus(gz, corpus)
        if not args.keep_gz:
            gz.unlink()
    report["corpus"] = {"path": str(corpus), "rows": check_jsonl(corpus, "corpus"), "bytes": corpus.stat().st_size}
    print(f"  {report['corpus']['rows']:,} passages", flush=True)

    for spec in args.qa:
        name, _, splits = spec.partition(":")
        if not name or not splits:
            parser.error(f"--qa {spec!r}: write name:split[,split], e.g. nq:train,test")
        for split in splits.split(","):
            print(f"[qa] {QA_REPO}/{name}/{split}.jsonl", flush=True)
            path = fetch(QA_REPO, f"{name}/{split}.jsonl", out, mirror)
            report[f"{name}/{split}"] = {"path": str(path), "rows": check_jsonl(path, "qa"), "bytes": path.stat().st_size}
            print(f"  {report[f'{name}/{split}']['rows']:,} questions", flush=True)

    if args.e5:
        print(f"[e5] {E5_REPO}", flush=True)
        index = out / "e5_Flat.index"
        if not index.exists():
            parts = [fetch(E5_REPO, p, out, mirror) for p in E5_PARTS]
            join_parts(parts, index)
            for p in parts:
                p.unlink()
        report["e5"] = {"path": str(index), "bytes": index.stat().st_size}
        print(f"  {index}: {_size(index)}", flush=True)

    if args.bm25:
        from trl_multiturn.search import BM25Retriever, load_corpus

        print("[bm25] building over the corpus", flush=True)
        retriever = BM25Retriever(load_corpus(str(corpus)))
        report["bm25"] = {"seconds": retriever.build_time_s, "index_bytes": retriever.index_bytes}
        print(f"  {len(retriever):,} passages indexed in {retriever.build_time_s:.1f} s, "
              f"{retriever.index_bytes / 2**20:,.1f} MiB of scores", flush=True)

    report["seconds"] = time.perf_counter() - t0
    (out / "prepare_report.json").write_text(json.dumps(report, indent=2))
    print(f"done in {report['seconds'] / 60:.1f} min; sizes and row counts in {out / 'prepare_report.json'}", flush=True)
    return report


if __name__ == "__main__":
    main()
