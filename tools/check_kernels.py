"""Compile every Triton kernel ahead of time for sm_80/sm_90 at the shipped configs' shapes, through the
project's own ops; exit non-zero on a compile error, a spill, or shared memory over the limit."""

from megapretrain.kernel_check import main

raise SystemExit(main())
