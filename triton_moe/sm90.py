"""Compile a Triton kernel for Hopper (sm_90a) on any machine, and read what the binary holds:
the CPU tests' and the notes' view of registers, spills, shared memory and the TTGIR.
"""

from __future__ import annotations

import os

import triton


def build_sm90(kernel, signature: dict, constexprs: dict, *, num_warps: int, num_stages: int, divisible_by_16=()):
    """``kernel`` compiled for sm_90a without a GPU (Triton's compiled kernel: ``.asm`` holds its
    TTGIR, PTX and cubin). ``signature`` types the runtime arguments (the rest are constexprs);
    a constexpr the kernel declares with a default and ``constexprs`` leaves out takes the
    default, as a launch would; ``divisible_by_16`` names the arguments Triton may assume
    divisible by 16. Needs a process without ``TRITON_INTERPRET=1``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible_by_16}
    src = ASTSource(
        kernel, signature={n: signature.get(n, "constexpr") for n in names}, constexprs=constexprs, attrs=attrs
    )
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def compile_sm90(
    kernel, signature: dict, constexprs: dict, *, num_warps: int, num_stages: int, divisible_by_16=()
) -> dict:
    """:func:`build_sm90`, and what the binary looks like: registers and spill bytes per thread
    (``ptxas -v``), shared memory, and the TTGIR text. ``tests/test_triton_sm90.py`` runs it in
    a process of its own (the test session imports the interpreted kernels)."""
    import re
    import subprocess
    import tempfile

    compiled = build_sm90(
        kernel, signature, constexprs, num_warps=num_warps, num_stages=num_stages, divisible_by_16=divisible_by_16
    )
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = re.search(r"(\d+) bytes spill stores", log)
    return {
        "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": int(spills.group(1)) if spills else 0,
        "shared_bytes": compiled.metadata.shared,
        "ttgir": compiled.asm["ttgir"],
    }
