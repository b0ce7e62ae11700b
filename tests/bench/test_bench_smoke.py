"""The benchmark runner end to end on the CPU: a smoke run appends JSON rows, and BENCHMARKS.md is generated
from rows like them; shape names parse or say what is wrong."""

import json

import pytest

from hybrax.bench import __main__ as bench_cli
from hybrax.bench import base_revision, results, shapes, summary


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_smoke_run_appends_rows_and_the_summary_shows_them(tmp_path):
    assert bench_cli.main(["--op", "gla", "--smoke", "--out", str(tmp_path / "runs")]) == 0
    written = _rows(tmp_path / "runs" / "cpu" / "gla.jsonl")
    assert [(row["mode"], row["shape"]) for row in written] == [("fwd", "gla-1x64x2x16"), ("fwd+bwd", "gla-1x64x2x16")]
    for row in written:
        assert row["smoke"] and row["time_ms"] > 0 and row["tflops"] > 0
        assert row["impl"] == "auto" and row["dtype"] == "bf16" and row["device"] == "cpu"
        assert {"jax", "jaxlib", "hybrax"} <= set(row["versions"])
        assert row["command"] == "python -m hybrax.bench --op gla --smoke --out " + str(tmp_path / "runs")
    # The summary leaves smoke rows out; the same rows unmarked make the table.
    assert "### gla" not in summary.generate(results.load(tmp_path / "runs"), tmp_path / "B.md", tmp_path, False)
    results.append([{k: v for k, v in row.items() if k != "smoke"} for row in written], tmp_path / "results", "cpu",
                   "gla")
    out = tmp_path / "BENCHMARKS.md"
    assert summary.main(["--results", str(tmp_path / "results"), "--out", str(out), "--no-plots"]) == 0
    text = out.read_text()
    assert "### gla" in text and "| `gla-1x64x2x16` | bf16 | auto |" in text
    assert f"1. `{written[0]['command']}`" in text


def test_summary_takes_an_anchor_from_an_earlier_row_and_marks_it():
    base = {"device_dir": "gpu", "device": "GPU", "op": "kda", "impl": "pallas:chunked", "shape": "kda-1x64x2x16",
            "dtype": "bf16", "mode": "fwd", "extras": {}, "commit": "abc", "command": "run"}
    earlier = {**base, "time_ms": 1.0, "anchors": {"fla": {"time_ms": 2.0, "ratio": 0.5}}}
    later = {**base, "time_ms": 0.9, "anchors": {"tokamax": {"time_ms": 9.0, "ratio": 0.1}}}
    lines = summary.table("kda", results.current([earlier, later]))
    assert lines[0].startswith("| shape | dtype | impl | ms (fwd) |")
    assert "| `kda-1x64x2x16` | bf16 | pallas:chunked | 0.900 |" in lines[2]
    assert "| 0.50 † | 0.10 |" in lines[2]


def test_help_lists_the_ops(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_cli.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert all(op in text for op in ("kda_decode", "attention_decode", "kda_cp", "kda_layer", "kda_layer_decode"))


def test_shape_names():
    shape = shapes.parse("attn-2x8192x32x8x128-w1024")
    assert (shape.batch, shape.seq_len, shape.heads, shape.kv_heads, shape.head_dim, shape.window) == (
        2, 8192, 32, 8, 128, 1024)
    packed = shapes.parse("kda-1x100x2x16-var5")
    bounds = packed.cu_seqlens()
    assert bounds[0] == 0 and bounds[-1] == 100 and len(bounds) == 6 and (bounds[1:] > bounds[:-1]).all()
    assert shapes.parse("kda_decode-64x32x128").seq_len == 1
    layer = shapes.parse("kda_layer-8x2048x2048x16x128")
    assert (layer.batch, layer.seq_len, layer.hidden, layer.heads, layer.head_dim) == (8, 2048, 2048, 16, 128)
    assert shapes.parse("kda_layer_decode-256x2048x16x128").hidden == 2048
    for name in (*shapes.SMOKE_SHAPES.values(), *(n for names in shapes.BENCHMARK_SHAPES.values() for n in names)):
        assert shapes.parse(name).name == name


@pytest.mark.parametrize("name, message", [
    ("kda-1x8192x32", "needs 4 positive integers BATCHxSEQ_LENxHEADSxHEAD_DIM"),
    ("kda_layer-1x64x2x16", "needs 5 positive integers BATCHxSEQ_LENxHIDDENxHEADSxHEAD_DIM"),
    ("mamba-1x2", "family must be one of"),
    ("kda-1x64x2x16-w8", "takes variants ['varN']"),
    ("kda-2x64x2x16-var4", "packed sequences need batch 1"),
    ("attn-1x64x6x4x16", "query heads must be a multiple of kv heads"),
])
def test_bad_shape_names_say_what_is_wrong(name, message):
    with pytest.raises(ValueError, match=f"shape {name!r}") as error:
        shapes.parse(name)
    assert message in str(error.value)


def test_base_revision_takes_a_package_folder_and_rejects_what_is_neither(tmp_path):
    (tmp_path / "tree" / "src" / "hybrax").mkdir(parents=True)
    (tmp_path / "tree" / "src" / "hybrax" / "__init__.py").write_text("")
    assert base_revision.source_folder(str(tmp_path / "tree"), tmp_path) == ((tmp_path / "tree" / "src").resolve(),
                                                                           str(tmp_path / "tree"))
    with pytest.raises(ValueError, match="--base: 'no-such-revision-x' is neither a folder nor a git revision"):
        base_revision.source_folder("no-such-revision-x", tmp_path)
    argv = ["--op", "kda", "--base", "main", "--out", "o", "--commit=abc", "--smoke"]
    assert bench_cli._without_base(argv) == ["--op", "kda", "--smoke"]
