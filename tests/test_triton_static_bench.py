"""``python -m triton_moe.lab.bench_static`` on the CPU: its report renders every row kind, and it refuses
a bad ``--deadline-s`` or a machine without CUDA in one line, before any work."""

import json

import pytest

from triton_moe.lab import bench_static


def test_the_static_scale_report_renders(tmp_path):
    def row(T, dyn, sta):
        return dict(
            shape="mixtral-8x7b",
            T=T,
            dynamic_us=dyn,
            static_us=sta,
            rel_l2_dynamic=6.1e-3,
            rel_l2_static=6.2e-3,
            static_vs_dynamic=1.5e-3,
            dynamic_runs=[dyn],
            static_runs=[sta],
        )

    results = dict(
        date="d",
        device="dev",
        commit="c",
        command="cmd",
        cut=["deepseek-v3:tp8 T=4096"],
        rows=[
            row(1, 40.0, 36.0),
            row(4096, 3900.0, 3700.0),
            dict(shape="qwen3-30b-a3b", T=1, error="RuntimeError('x')"),
        ],
    )
    bench_static._write(tmp_path, results)
    md = (tmp_path / "static.md").read_text()
    assert "| mixtral-8x7b | 1 | 40.0 | 36.0 | 0.900 | 6.1e-03 | 6.2e-03 | 1.5e-03 |" in md, md
    assert "| mixtral-8x7b | 4096 | 3900.0 | 3700.0 | 0.949 |" in md, md
    assert (
        "| qwen3-30b-a3b | 1 | error: RuntimeError('x') |" in md and "Not run (deadline): deepseek-v3:tp8 T=4096" in md
    )
    assert json.loads((tmp_path / "static.json").read_text())["rows"][1]["static_us"] == 3700.0


def test_every_cell_is_fp8_tensor_on_a_catalog_shape():
    from moe_spec.problem import get_shape

    assert len(bench_static.CELLS) == len(set(bench_static.CELLS)) == 9
    for spec, T in bench_static.CELLS:
        get_shape(spec)  # raises on a name the catalog lacks
        assert T in (1, 128, 4096)


@pytest.mark.parametrize("argv, needle", [(["--deadline-s", "0"], "--deadline-s: must be positive"), ([], "CUDA")])
def test_bad_options_and_no_gpu_are_refused_in_one_line(argv, needle, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        bench_static.main(["--out", str(tmp_path / "new"), *argv])
    assert caught.value.code != 0
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
