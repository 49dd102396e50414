"""compare — the harness: proves that both backends compute the same function, and times them.

``python -m compare`` (:mod:`compare.cli`) runs the suite (:mod:`compare.suite`) over the
contenders of :mod:`compare.backends`, checks every result against the fp64 oracle of
:mod:`moe_spec.oracle` (:mod:`compare.metrics`), and writes the reports (:mod:`compare.report`).
:func:`compare.router.fused_moe` picks the measured-fastest backend per (shape, T, quant).

Reading order of the suite: :mod:`~compare.cases` (the spec of a run, one case, the time budget) →
:mod:`~compare.numerics` (one backend against the oracle) → :mod:`~compare.timed` (against the
clock) → :mod:`~compare.compilation` (JIT study, CuTe PTX) → :mod:`~compare.suite` (all cases);
then the output: :mod:`~compare.results` (the JSON record, merging) → :mod:`~compare.tables`
(banner, columns) → :mod:`~compare.report`, :mod:`~compare.markdown`, :mod:`~compare.plots` →
:mod:`~compare.outputs` (where and how files are written).

The sharded layer a user runs on several GPUs: :mod:`compare.distributed` (tensor- and
expert-parallel) and :mod:`compare.launch` (starting the ranks). The JIT section of the report is
product too: :mod:`compare.warm_study` (nothing compiles after a backend's warm-up) and
:mod:`compare.jitdemo` (``do_not_specialize`` on one small kernel). The studies, which the
product never imports, are in :mod:`compare.studies`.

This is the top layer: it imports the specification (``moe_spec``) and both backends; nothing
imports it.
"""
