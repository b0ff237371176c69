"""Any rank of a run on one CPU: the trainer's own program on fake tensors and the fake process
group, measured — peak memory and its parts, every collective's bytes per group, FLOPs, the
checkpoint file — without a GPU (``tools/simulate.py``).

- :mod:`.run`: one rank simulated (:func:`~.run.simulate_rank`);
- :mod:`.measure`: the instrumentation and the memory timeline's categories, for a simulated
  rank and a real one alike;
- :mod:`.report`: which ranks to simulate (``--roles``), the planner's figures beside them, and
  the text, Markdown and JSON of the result.
"""
