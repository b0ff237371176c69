"""Make a multiple-choice task file from a tokenized corpus, to watch a run learn it.

    python tools/make_tasks.py --data demo/stdlib_text_document --output tasks/stdlib_mc.jsonl \\
        [--tokenizer-type ByteTokenizer --tokenizer-model M] [--items 64] [--choices 4] \\
        [--context-chars 96] [--choice-chars 24] [--seed 0]

Each item's context is a stretch of one of the corpus's documents, its right choice the text that
follows it there, the wrong choices stretches of the same length from elsewhere in the corpus (all
in characters of the detokenized text). A model that learns the corpus scores above chance (1 /
``--choices``) on it: a check that the evaluation runs, not a benchmark. For real benchmarks see
docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from megapretrain.cli import ToolParser, non_negative_int, positive_int, user_errors
from megapretrain.data.tokenizers import build_tokenizer
from megapretrain.errors import UserError
from megapretrain.eval.tasks import corpus_documents, tasks_from_corpus


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--data", required=True, help="an indexed dataset prefix (PREFIX.bin/.idx)")
    ap.add_argument("--output", required=True, help="the new task file (JSONL)")
    ap.add_argument("--tokenizer-type", default="ByteTokenizer", help="the corpus's tokenizer")
    ap.add_argument("--tokenizer-model", help="its file or directory (ByteTokenizer needs none)")
    ap.add_argument("--items", type=positive_int, default=64)
    ap.add_argument("--choices", type=positive_int, default=4)
    ap.add_argument("--context-chars", type=positive_int, default=96)
    ap.add_argument("--choice-chars", type=positive_int, default=24)
    ap.add_argument("--seed", type=non_negative_int, default=0)
    return ap.parse_args(argv)


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.path.exists(args.output):
        raise UserError(f"--output {args.output} exists: give a new file name (nothing is "
                        "overwritten)")
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    documents = corpus_documents(args.data, tokenizer)
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    tmp = f"{args.output}.tmp{os.getpid()}"
    tasks_from_corpus(documents, tmp, num_items=args.items, num_choices=args.choices,
                      context_chars=args.context_chars, choice_chars=args.choice_chars,
                      seed=args.seed)
    os.replace(tmp, args.output)
    print(f"wrote {args.output}: {args.items} items of {args.choices} choices from "
          f"{len(documents)} documents of {args.data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
