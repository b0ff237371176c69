"""Draw a run's dashboard from its metrics.jsonl into one PNG.

    python tools/plot_run.py runs/tiny                        # writes runs/tiny/dashboard.png
    python tools/plot_run.py runs/tiny --output /tmp/tiny.png

Panels (those the run logged): loss and validation loss, grad norm (before clipping), learning
rate, tokens/s, MFU, memory, loss scale (fp16) and the time breakdown (data_time, step_time and
any other ``*_s`` / ``*_time`` field). Events — checkpoint_saved, resumed, alert start and clear,
rollback, skipped_step, ... — are vertical lines on every panel, in colours no data line uses; a
rollback or a restart shades the steps it trained again, and the steps a rollback or resume
superseded are drawn dashed beside the line the run kept. Under the title: the effective training
time over every attempt on the run directory (productive step time / wall time, from
RUN_DIR/attempts.jsonl), its restarts and the time they lost. Memory, throughput, MFU and times are
drawn from zero, their range in the panel's title. Works on a run still in progress.
"""

from __future__ import annotations

import argparse
import os
import sys

from megapretrain.attempts import run_goodput
from megapretrain.cli import ToolParser, user_errors
from megapretrain.errors import DataError, UserError
from megapretrain.monitor.metrics import read_metrics, training_records
from megapretrain.monitor.progress import describe_goodput


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = ToolParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("run_dir",
                    help="a run directory (holding metrics.jsonl), or a metrics.jsonl file")
    ap.add_argument("--output", help="PNG to write (default: RUN_DIR/dashboard.png)")
    ap.add_argument("--title", help="figure title (default: the run directory)")
    return ap.parse_args(argv)


def goodput_note(run_dir: str, records: list[dict]) -> str | None:
    """The effective training time over the run's attempts: from its ledger, else its last
    ``summary`` event that carries it (a run from before the ledger: none)."""
    g = run_goodput(run_dir)
    if g is None:
        g = next((r for r in reversed(records)
                  if r.get("event") == "summary" and "effective_training" in r), None)
    return None if g is None else describe_goodput(g)


@user_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    records = read_metrics(args.run_dir)
    if not training_records(records):
        raise DataError(f"{args.run_dir}: metrics.jsonl has no training lines yet (lines with iter "
                        "and loss)")
    run_dir = args.run_dir if os.path.isdir(args.run_dir) else os.path.dirname(args.run_dir) or "."
    output = args.output or os.path.join(run_dir, "dashboard.png")
    if not output.lower().endswith(".png"):
        raise UserError(f"--output {output}: the dashboard is a PNG; give a name ending in .png")
    from megapretrain.monitor.plots import plot_dashboard

    plot_dashboard(records, output, args.title or os.path.abspath(run_dir), goodput_note(run_dir,
                                                                                       records))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
