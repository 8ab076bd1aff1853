"""Goodput: the phases of a run's wall time (train/goodput.py) add up to it, and a resumed
run counts the stopped run's step time on the steps it trains again as lost."""

import json
import shutil
import subprocess
import time

import pytest

from helpers import ROOT, train_command

PHASES = ("step", "compile", "checkpoint_save", "checkpoint_restore", "data", "eval", "setup")


def test_nested_phases_count_once(monkeypatch):
  """On a fake clock (no test depends on the machine's speed): a save nested in a step
  counts as the save's time only."""
  from mamba_train import metrics
  from mamba_train.train.goodput import Goodput, summary
  now = [100.0]
  monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
  gp = Goodput()
  with gp.phase("step"):
    now[0] += 2.0
    with gp.phase("checkpoint_save"):
      now[0] += 3.0
    now[0] += 0.5
  now[0] += 1.0  # in no phase: other
  row = gp.row()
  assert row["goodput/step_s"] == 2.5 and row["goodput/checkpoint_save_s"] == 3.0
  assert row["goodput/other_s"] == 1.0 and row["goodput/wall_s"] == 6.5
  assert sum(row[f"goodput/{k}_s"] for k in (*PHASES, "other")) == pytest.approx(row["goodput/wall_s"], abs=1e-9)
  assert summary(row).startswith("goodput: ") and "checkpoint save" in summary(row)
  with pytest.raises(ValueError, match="unknown goodput phase"):
    with gp.phase("coffee"):
      pass


def _rows(path):
  return [json.loads(line) for line in open(path)]


def _check_sums(row, wall_seen):
  """The phases but `other` cover the wall time within 5%; all of them add up to it."""
  wall = row["goodput/wall_s"]
  covered = sum(row[f"goodput/{k}_s"] for k in PHASES)
  assert covered <= wall * 1.0001 and covered >= 0.95 * wall, row
  assert covered + row["goodput/other_s"] == pytest.approx(wall, abs=1e-3)
  assert min(row[f"goodput/{k}_s"] for k in PHASES) >= 0 and row["goodput/step_s"] > 0
  assert row["goodput/compile_s"] > 0 and row["goodput/checkpoint_save_s"] > 0 and row["goodput/data_s"] > 0
  assert wall < wall_seen  # inside the process's own lifetime, as the test clocked it


def test_goodput_rows_sum_to_the_wall_time_and_a_restart_counts_what_it_redoes(tmp_path):
  work = tmp_path / "run"
  cmd, env = train_command(work, ["--config.checkpoint_every=4"], 1)  # 6 steps: checkpoints 4, 6
  runs = []
  for _ in range(2):
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    runs.append((r, time.monotonic() - t0))
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(work / "checkpoints" / "6", ignore_errors=True)  # as if killed after step 6's row
  (first, first_wall), (second, second_wall) = runs
  kept, aside = _rows(work / "metrics.jsonl"), _rows(work / "metrics.jsonl.after-4")
  ends = [row for rows in (aside, kept) for row in rows if row.get("event") == "goodput"]
  assert [row["step"] for row in ends] == [6, 6] and ends[0] in aside and ends[1] in kept
  _check_sums(ends[0], first_wall)
  _check_sums(ends[1], second_wall)
  # Every logged row carries the run's figures so far: the step time grows with the steps.
  logged = [row for row in kept if "loss" in row]
  assert [row["step"] for row in logged] == [1, 2, 3, 4, 5, 6]
  cumulative = [row["goodput/step_s"] for row in logged[:4]]
  assert cumulative == sorted(cumulative) and len({row["goodput/run"] for row in logged}) == 2
  # The resumed run lost the first run's step time after step 4's row: the run's total
  # (its closing row) less its figure at step 4 (the record's own sums).
  at = {row["step"]: row["goodput/step_s"] for row in kept + aside
        if "loss" in row and row["goodput/run"] == ends[0]["goodput/run"]}
  assert at[4] < at[6] <= ends[0]["goodput/step_s"]
  assert ends[1]["goodput/lost_to_restart_s"] == pytest.approx(ends[0]["goodput/step_s"] - at[4], abs=2e-4)
  assert ends[0]["goodput/lost_to_restart_s"] == 0
  assert "steps 5..6 are trained again" in second.stderr and "the stopped run's goodput: " in second.stderr
  for r in (first, second):
    assert "goodput: " in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]
