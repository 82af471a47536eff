"""benchmarks/ship_tuned.py: a tuning cache's choices merged into the shipped file of the same name, shipped keys
kept unless --replace, the file in the tuner's format."""
import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("ship_tuned", ROOT / "benchmarks" / "ship_tuned.py")
ship_tuned = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ship_tuned)


def test_merge_into_the_shipped_file(tmp_path, capsys):
    shipped_dir, cache_dir = tmp_path / "tuned", tmp_path / "cache"
    shipped_dir.mkdir(), cache_dir.mkdir()
    name = "autotune-h200-triton3.6.0.json"
    (shipped_dir / name).write_text(json.dumps({"a|1": {"BLOCK_M": 64}, "b|2": {"BLOCK_M": 32}}, indent=0))
    (cache_dir / name).write_text(json.dumps({"a|1": {"BLOCK_M": 128}, "c|3": {"BLOCK_M": 16}}))
    assert ship_tuned.main([str(cache_dir / name), "--shipped", str(shipped_dir)]) == 0
    merged = json.loads((shipped_dir / name).read_text())
    assert merged == {"a|1": {"BLOCK_M": 64}, "b|2": {"BLOCK_M": 32}, "c|3": {"BLOCK_M": 16}}
    assert "1 added, 0 replaced, 3 in all" in capsys.readouterr().out
    ship_tuned.main([str(cache_dir / name), "--shipped", str(shipped_dir), "--replace"])
    assert json.loads((shipped_dir / name).read_text())["a|1"] == {"BLOCK_M": 128}
    assert (shipped_dir / name).read_text().startswith('{\n"a|1": {\n"BLOCK_M": 128\n}')  # (the tuner's format)
