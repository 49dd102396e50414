"""What the bf16 fused pipeline folds into its GEMM1 — two switches, read by the plan
(:func:`cute_moe.plan.plan`) and by the byte model (:func:`cute_moe.unfused.hbm_bytes`).

Each takes back one separate pass; each has its unfused twin, which ``fusion="separate"`` always
runs and which the switch falls back to. Explicit ``configs`` are taken as given.
"""

GATED_GEMM1 = True
"""SiLU·up in GEMM1's epilogue (``GemmConfig.gated``): the ``[M_pad, 2I]`` pre-activation never
reaches memory and the SiLU·mul row kernel does not run.  False: a plain GEMM1, then the row kernel."""

GATHER_IN_PRODUCER = True
"""GEMM1's producer reads its token rows by index straight from x (``GemmConfig.gather_rows``,
:mod:`cute_moe.gather`): the sorted copy ``X_sorted [M_pad, K]`` is never written and the gather row
kernel does not run; taken when K is a multiple of the config's ``tile_k``.  False: the gather row
kernel writes ``X_sorted`` and GEMM1 loads it by TMA."""
