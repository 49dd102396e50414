"""The grouped GEMM's call: the compiled function's arguments from the layer's torch tensors.

:func:`launch_args` reads a :class:`~cute_moe.config.GemmConfig`'s fields and views tensors; it imports
nothing of the package (nor the DSL), so the layer's host modules (``moe``, ``moe_fp8``) call a compiled
GEMM without sitting above the kernel's own modules in the import graph.
"""

from __future__ import annotations


def launch_args(cfg, x, w, out, blocks, row_scale, x_scale=None, w_scale=None, rows=None, quant=None) -> tuple:
    """The compiled GEMM's arguments (:class:`~cute_moe.gemm_plan.GemmLaunch`'s, but the stream: the
    environment's): the weight seen as (N_out, K, E) — gated: (I, K, half, E), gate 0 / up 1 — the expert
    being TMA's last coordinate, C as its transpose view under swap-AB, and None where the config was
    compiled without an operand (the scales of a bf16 config, the token indices of a non-gathering one,
    the epilogue's tensors of a config without ``epilogue_quant``).  ``blocks``: (expert of every token
    block, used blocks); ``rows``: the call's ``SortedRows`` (a gathering config's indices); ``quant``:
    (q_scale, q_aux) of an ``epilogue_quant`` config (``GemmLaunch``), else unused."""
    if cfg.gated:
        w = w.unflatten(1, (2, w.shape[1] // 2)).permute(2, 3, 1, 0)
    else:
        w = w.permute(1, 2, 0)
    return (
        x,
        w,
        out.t() if cfg.swap_ab else out,
        blocks[0],
        blocks[1],
        row_scale,
        x_scale,
        w_scale,
        rows.token_of_row if cfg.gather_rows else None,
        *(quant if cfg.epilogue_quant else (None, None)),
    )
