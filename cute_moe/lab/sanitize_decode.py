"""Calls of the one-launch decode kernel to run under compute-sanitizer (GPU only).

    compute-sanitizer --tool memcheck python -m cute_moe.lab.sanitize_decode
    compute-sanitizer --tool racecheck python -m cute_moe.lab.sanitize_decode --tokens 1 5
    compute-sanitizer --tool synccheck python -m cute_moe.lab.sanitize_decode

A small bf16 layer (E = 8, top_k = 2, K = 256, I = 128: the sanitizer slows every access, and the
kernel's tiles, tasks and protocol are the same at any size) called twice per token count through
:func:`cute_moe.decode.decode_fused_moe`; each line printed says whether the rerun is bit-equal (the
counters reset themselves). The tool's summary is the result; notes/results/ keeps the runs
(sanitizer_*_cute_decode.md).
"""

from __future__ import annotations

import sys

from moe_spec.cli import ArgumentParser, needs_cuda

E, TOP_K, K, I = 8, 2, 256, 128  # noqa: E741


def main(argv=None) -> None:
    p = ArgumentParser(prog="python -m cute_moe.lab.sanitize_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 5], help="token counts, each 1 … 32 [1 5]")
    a = p.parse_args(argv)
    bad = [T for T in a.tokens if not 1 <= T * TOP_K <= 64]
    if bad:
        p.error(f"--tokens: {bad[0]} tokens: the kernel serves 1 … 64 (token, slot) pairs, top_k = {TOP_K}")
    needs_cuda(p.prog)
    import torch

    from moe_spec.problem import MoEShape, make_inputs

    from ..decode import decode_fused_moe

    shape = MoEShape("sanitize", E, TOP_K, K, I, f"sanitizer layer: E {E}, top_k {TOP_K}, K {K}, I {I}")
    for T in a.tokens:
        kw = make_inputs(shape, T, None, seed=T).to("cuda").kwargs()
        args = {k: kw[k] for k in ("x", "w1", "w2", "topk_weights", "topk_ids")}
        first, again = decode_fused_moe(**args), decode_fused_moe(**args)
        torch.cuda.synchronize()
        equal = torch.equal(first.view(torch.int16), again.view(torch.int16))
        print(f"T {T} ({T * TOP_K} pairs): rerun bit-equal {equal}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
