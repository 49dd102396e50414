"""No host synchronization inside fused_moe, and the device-side data checks, on a GPU.

* Every backend and format it builds runs a warm call under ``torch.cuda.set_sync_debug_mode("error")``:
  any operation that makes the host wait for the GPU (``.item()``, ``bool(tensor)``, a
  device→host copy, ``nonzero``, …) raises.
* A bad id on the GPU: the call does not raise and reads nothing out of bounds (run this file under
  ``compute-sanitizer --tool memcheck`` with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` to see it), the
  token's output row is NaN, the others finite, and ``moe_spec.validate.check()`` raises naming
  ``topk_ids`` — then, cleared, raises nothing.
"""

import pytest
import torch

from moe_spec.problem import MoEShape, make_inputs
from moe_spec.quant import FORMATS, get_format
from moe_spec.validate import check

pytestmark = pytest.mark.gpu

# K and I multiples of 128 (fp8_block's blocks; cute_moe's 16-byte TMA rows); small enough to compile
# and run in seconds
SHAPE = MoEShape("nosync", 16, 4, 256, 128, "test: 16 experts, top-4")
CASES = [(b, q) for b in ("triton_moe", "cute_moe") for q in FORMATS]


def _backend(name):
    if name == "triton_moe":
        from triton_moe import fused_moe
    else:
        from cute_moe import fused_moe
    return fused_moe


@pytest.mark.parametrize("T", [1, 8, 300], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("backend, quant", CASES, ids=[f"{b}-{get_format(q).label}" for b, q in CASES])
def test_no_sync_inside_fused_moe(backend, quant, T):
    fused_moe = _backend(backend)
    kw = make_inputs(SHAPE, T, quant, seed=T).to("cuda").kwargs()
    fused_moe(**kw)  # warm-up outside the mode: compilation, the error word, workspaces
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fused_moe(**kw)
        out = fused_moe(**kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert out.shape == kw["x"].shape and bool(torch.isfinite(out).all())
    check()


@pytest.mark.parametrize("backend, quant", CASES, ids=[f"{b}-{get_format(q).label}" for b, q in CASES])
@pytest.mark.parametrize("bad", [16, -1, 2**31 - 1], ids=["E", "negative", "int32_max"])
def test_a_bad_id_sets_the_flag_and_check_names_topk_ids(backend, quant, bad):
    fused_moe = _backend(backend)
    check()  # a clean word to start from
    kw = make_inputs(SHAPE, 8, quant, seed=5).to("cuda").kwargs()
    kw["topk_ids"][3, 2] = bad
    out = fused_moe(**kw)  # no sync, no raise, nothing out of bounds
    torch.cuda.synchronize()
    assert bool(out[3].isnan().all())
    rest = torch.arange(8, device="cuda") != 3
    assert bool(torch.isfinite(out[rest]).all())
    with pytest.raises(ValueError, match=r"^topk_ids: expected ids in \[0, E\)"):
        check()
    check()  # cleared
