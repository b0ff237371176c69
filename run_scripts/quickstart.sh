#!/usr/bin/env bash
# End to end on CPU in a few minutes: install, build a corpus from the Python standard library,
# tokenize it, train configs/tiny.yaml. Running it again resumes from the latest checkpoint.
# Extra arguments are config overrides, e.g.: bash run_scripts/quickstart.sh --train.iters 600
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
mkdir -p demo
if [ ! -f demo/corpus.jsonl ]; then
  python tools/build_demo_corpus.py --output demo/corpus.jsonl --max-mb 40
fi
if [ ! -f demo/stdlib_text_document.idx ]; then
  python tools/preprocess_data.py --input demo/corpus.jsonl --output-prefix demo/stdlib \
    --tokenizer-type ByteTokenizer --json-keys text --append-eod --workers 2
fi
python -m megapretrain.train --config configs/tiny.yaml "$@"
cat <<MSG

Run directory: runs/tiny
  metrics      runs/tiny/metrics.jsonl         (one JSON line per logged step / eval / event)
  tensorboard  .venv/bin/tensorboard --logdir runs/tiny/tensorboard
  checkpoints  runs/tiny/checkpoints/          (latest: runs/tiny/checkpoints/latest)
Resume or extend (same run.dir resumes from the latest checkpoint):
  bash run_scripts/quickstart.sh --train.iters 600
  .venv/bin/python -m megapretrain.train --config configs/tiny.yaml --train.iters 600
MSG
