"""The harness's studies: one-off measurements behind the notes, each run by hand as
``python -m compare.studies.<name>``; their results live in ``notes/results/``.

- :mod:`~compare.studies.profile`: where a layer's time goes, kernel by kernel (torch profiler).
- :mod:`~compare.studies.eager`: an eager call against its graph replay; the host's cost alone.
- :mod:`~compare.studies.scaling`: the layer on two GPUs, tensor- and expert-parallel, against one.
- :mod:`~compare.studies.stall`, :mod:`~compare.studies.stall_model`: what one rank's JIT compilation
  costs the other ranks, measured and modelled.
- :mod:`~compare.studies.dist_numerics`: which splits of the layer still compute the single-process function.
- :mod:`~compare.studies.hf_bench`: whole transformers models with their experts implementations and ours.

A study may import the product (:mod:`compare`, the backends, :mod:`moe_spec`); the product, the
main job (``python -m compare``) included, never imports a study (tests/test_repo.py holds it).
"""
