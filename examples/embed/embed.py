#!/usr/bin/env python3
"""Sentence embeddings and their cosine similarities: an embedding context (mean pooling) turns a handful
of sentences into unit vectors in one batched decode, their dot products make a similarity matrix, and a
generation context reranks the sentences for a query."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import model_path, parser

from lloyal_pool import Pool

SENTENCES = [
    "The cat is sleeping on the sofa.",
    "A cat naps on the couch.",
    "Stock markets fell sharply today.",
    "Shares dropped steeply on Wall Street.",
    "Paris is the capital of France.",
]


def main() -> int:
    ap = parser(__doc__.split("\n\n")[0])
    ap.add_argument("--pooling", default="mean", choices=["mean", "last", "cls"])
    ap.add_argument("--query", default="Where does the cat sleep?", help="the query to rerank the sentences for")
    ap.add_argument("sentences", nargs="*", help="sentences to compare (default: a built-in handful)")
    args = ap.parse_args()
    sentences = args.sentences or SENTENCES

    with Pool(1) as pool:
        model = pool[0].load_model(model_path(args.model))
        ctx = model.new_context(n_ctx=1024, embeddings=True, pooling=args.pooling)
        vectors = ctx.embed(sentences)  # (n, n_embd), each of L2 norm 1
        similarity = vectors @ vectors.T  # cosine similarities
        print(f"{len(sentences)} sentences, {vectors.shape[1]}-dimensional {ctx.pooling}-pooled embeddings")
        print("cosine similarity:")
        print("      " + " ".join(f"{j:>6}" for j in range(len(sentences))))
        for i, row in enumerate(similarity):
            print(f"{i:>4}  " + " ".join(f"{x:6.3f}" for x in row) + f"  {sentences[i]}")
        for i, row in enumerate(similarity):
            j = max((k for k in range(len(sentences)) if k != i), key=lambda k: row[k])
            print(f"nearest to {i}: {j} ({row[j]:.3f})")

        judge = model.new_context(n_ctx=1024, n_seq_max=len(sentences))
        scores = judge.rerank(args.query, sentences)  # the query's mean log-prob, one decode for all
        print(f"rerank for {args.query!r}:")
        for score, text in sorted(zip(scores, sentences, strict=True), reverse=True):
            print(f"  {score:8.3f}  {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
