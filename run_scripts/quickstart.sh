#!/usr/bin/env bash
# End to end on CPU in a few minutes: install, build a corpus from the Python standard library,
# tokenize it, train configs/tiny.yaml. Running it again resumes from the latest checkpoint.
# Extra arguments are config overrides, e.g.: bash run_scripts/quickstart.sh --train.iters 600
# DEMO_MB (default 40) sets the size of the demo corpus it builds the first time.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
DEMO_MB="${DEMO_MB:-40}"
[[ "$DEMO_MB" =~ ^[1-9][0-9]*$ ]] || { echo "error: DEMO_MB=$DEMO_MB must be a positive whole number of MB" >&2; exit 2; }
mkdir -p demo
if [ ! -f demo/corpus.jsonl ]; then
  python tools/build_demo_corpus.py --output demo/corpus.jsonl --max-mb "$DEMO_MB"
fi
if [ ! -f demo/stdlib_text_document.idx ]; then
  python tools/preprocess_data.py --input demo/corpus.jsonl --output-prefix demo/stdlib \
    --tokenizer-type ByteTokenizer --json-keys text --append-eod --workers 2
fi
python -m megapretrain.train --config configs/tiny.yaml "$@"
cat <<MSG

Watch:  .venv/bin/tensorboard --logdir runs/tiny/tensorboard     (with logging.tensorboard on, the default)
        python tools/plot_run.py runs/tiny
Train further (the same run.dir resumes from its latest checkpoint; the learning rate stays at its end
value, --schedule.rewarm_iters N re-warms it):
  bash run_scripts/quickstart.sh --train.iters 600
MSG
