"""compare — the harness: proves that both backends compute the same function, and times them.

``python -m compare`` (:mod:`compare.cli`) runs the suite (:mod:`compare.suite`) over the
contenders of :mod:`compare.backends`, checks every result against the fp64 oracle of
:mod:`moe_spec.oracle` (:mod:`compare.metrics`), and writes the reports (:mod:`compare.report`).
:func:`compare.router.fused_moe` picks the measured-fastest backend per (shape, T, quant).

This is the top layer: it imports the specification (``moe_spec``) and both backends; nothing
imports it.
"""
