"""The inject report's tables: repeated blocks on one row, fused modules named relative to their row, every line
within the terminal's width."""
import torch
from torch import nn

import dropin
from dropin.inject import report_text
from _tol import DEVICE


def test_collapse_merges_rows_that_differ_in_their_last_index():
    rows = [(f"blocks.{i}.mlp.fc1", "Linear", f"linear+gelu  (also blocks.{i}.mlp.act)") for i in (0, 1, 2, 3, 5)]
    rows += [("blocks.4.mlp.fc1", "Linear", "linear"), ("head", "Linear", "linear"),
             ("blocks.0.norm", "LayerNorm", "x")]
    assert report_text.collapse(rows) == [
        ("blocks.{0-3,5}.mlp.fc1", "Linear", "linear+gelu  (also blocks.{0-3,5}.mlp.act)"),
        ("blocks.4.mlp.fc1", "Linear", "linear"), ("head", "Linear", "linear"), ("blocks.0.norm", "LayerNorm", "x")]


def test_collapse_keeps_outer_indices_apart():
    rows = [(f"stages.{s}.layers.{i}.attn", "Attention", "attention") for s, n in ((0, 1), (1, 2)) for i in range(n)]
    assert report_text.collapse(rows) == [("stages.0.layers.0.attn", "Attention", "attention"),
                                          ("stages.1.layers.{0-1}.attn", "Attention", "attention")]


def test_fused_modules_named_relative_to_their_row():
    assert report_text.relative("layer1.0.conv1", ["layer1.0.bn1", "layer1.0.relu"]) == "bn1, relu"
    assert report_text.relative("conv1", ["bn1"]) == "bn1"
    assert report_text.relative("a.conv", ["b.norm"]) == "b.norm"


class _Deep(nn.Module):
    """Blocks under long names, as HF models nest them."""

    def __init__(self):
        super().__init__()
        self.encoder_with_a_long_name = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(6))
        self.encoder_with_a_long_name[2].add_module("a_projection_whose_name_fills_most_of_a_line",
                                                    nn.Linear(8, 8))

    def forward(self, x):
        for block in self.encoder_with_a_long_name:
            x = block(x)
        return x


def test_report_lines_fit_the_terminal(monkeypatch):
    """Each line within $COLUMNS (two lines a row where three columns do not fit, a long name broken after a dot);
    the six blocks on one row each; every module named."""
    report = dropin.inject_(_Deep().to(DEVICE, torch.get_default_dtype()), verify=False)
    for columns in (60, 100):
        monkeypatch.setenv("COLUMNS", str(columns))
        text = str(report)
        lines = text.splitlines()
        assert all(len(line) <= columns for line in lines[1:]), text
        assert "encoder_with_a_long_name.{0-5}.0" in text and "linear+gelu  (also 1)" in text
        assert "a_projection_whose_name_fills_most_of_a_line" in text.replace("\n    ", "")
    monkeypatch.setenv("COLUMNS", "200")
    lines = str(report).splitlines()
    assert any(line.startswith("  encoder_with_a_long_name.{0-5}.0 ") and "Linear" in line for line in lines)
