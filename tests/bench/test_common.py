"""The benchmarks' shared pieces: figures and their targets, tables, measured child processes."""

from __future__ import annotations

import sys

import pytest

from bench.common import (
    BenchError,
    allocator,
    figure,
    figures_table,
    markdown_table,
    require_data,
    run_measured,
)


def test_figure_ratio_is_ours_over_reference_and_target_decides_met():
    fast = figure("b", "speed", 300.0, 100.0, "tok/s", at_least=2.0)
    assert fast["ratio"] == pytest.approx(3.0)
    assert fast["target"] == ">= 2" and fast["met"] is True
    slow = figure("b", "speed", 150.0, 100.0, "tok/s", at_least=2.0)
    assert slow["met"] is False
    quick = figure("b", "time", 50.0, 100.0, "s", at_most=0.6)
    assert quick["ratio"] == pytest.approx(0.5) and quick["met"] is True
    assert figure("b", "time", 70.0, 100.0, "s", at_most=0.6)["met"] is False


def test_figure_without_a_value_misses_its_target_and_without_target_has_no_verdict():
    never = figure("b", "time", None, 100.0, "s", at_most=0.6)
    assert never["ratio"] is None and never["met"] is False
    plain = figure("b", "rss", 900.0, 1200.0, "MB")
    assert plain["target"] is None and plain["met"] is None
    assert figure("b", "rss", 900.0, None, "MB")["ratio"] is None


def test_tables_have_a_header_separator_and_a_row_per_entry():
    text = markdown_table(["a", "b"], [["x", "1"], ["y", "2"]])
    lines = text.splitlines()
    assert lines[0] == "| a | b |" and lines[1] == "|---|---:|" and len(lines) == 4
    rows = figures_table([figure("b", "speed", 300.0, 100.0, "tok/s", at_least=2.0)])
    assert "| b | speed (tok/s) | 300 | 100 | 3x | >= 2 | yes |" in rows


def grab(megabytes: int) -> bytearray:
    memory = bytearray(megabytes * 2**20)
    memory[::4096] = b"1" * len(memory[::4096])  # touch every page: resident, not just mapped
    return memory


def test_run_measured_reports_the_childs_own_peak_memory_and_failures(tmp_path):
    child = f"x = bytearray(300 * 2**20); x[::4096] = b'1' * {300 * 2**20 // 4096}"
    measured = run_measured([sys.executable, "-c", child], tmp_path / "grab.log")
    assert measured.returncode == 0 and measured.wall_s > 0
    assert 300 < measured.peak_rss_mb < 400
    # A big parent does not count in a small child (on Linux a forked child's peak starts at
    # its parent's until exec).
    held = grab(400)
    small = run_measured([sys.executable, "-c", "pass"], tmp_path / "small.log")
    assert small.peak_rss_mb < 100 and len(held) > 0
    with pytest.raises(BenchError, match="(?s)exited with status 3.*boom"):
        run_measured(
            [sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path / "fail.log"
        )
    with pytest.raises(BenchError, match="ran over"):
        run_measured(
            [sys.executable, "-c", "import time; time.sleep(30)"], tmp_path / "t.log", timeout_s=1
        )


def test_missing_data_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(BenchError, match=f"{tmp_path / 'nope'}.*LMPIPE_SHARED_DATA"):
        require_data(tmp_path / "nope", "WikiText-2")


def test_allocator_names_the_preloaded_library(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator() == "glibc"
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert allocator() == "tcmalloc"
    monkeypatch.setenv("LD_PRELOAD", "/opt/libfoo.so:/usr/lib/libjemalloc.so.2")
    assert allocator() == "jemalloc"
    monkeypatch.setenv("LD_PRELOAD", "/opt/libfoo.so")
    assert allocator() == "glibc"
