"""The entry points' one-line exits: a misspelt config key and a peer lost in a
collective (the scripts': test_observability.py)."""

import subprocess

from helpers import ROOT, patched, run_train, train_command


def test_misspelt_config_key_is_one_line_exit_2(tmp_path):
  r = run_train(tmp_path / "w", "--config.optim.lrr=1")  # a 50-line traceback before
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().splitlines() == [
      "error: bad flag or --config override: 'lrr' Did you mean \"lr\" instead of \"lrr\"? "
      "(flags: --help; config keys: configs/base.py)"]
  r = run_train(tmp_path / "w", "--config.optim.lrr=1", "--debug")
  assert r.returncode != 0 and "Traceback" in r.stderr


# The scripts' one-line answers (a wrong checkpoint path among them): test_observability.py,
# every script in one child process.


def test_lost_peer_in_a_collective_is_one_line(tmp_path):
  """When a collective (gloo on CPU) notices a dead peer before the heartbeat monitor
  aborts the process, train.py says so in one line and exits 1, lock released. Faked in
  one process: process_count 2, and the first collective (the lock's broadcast) fails."""
  fake = ("import jax\nfrom jax.experimental import multihost_utils\n"
          "from mamba_train.parallel import distributed\n"
          "distributed.initialize = lambda *a, **k: False\njax.process_count = lambda: 2\n"
          "def lost(x): raise RuntimeError('Gloo connectFullMesh failed: Connection refused')\n"
          "multihost_utils.broadcast_one_to_all = lost\n")
  work = tmp_path / "run"
  cmd, env = train_command(work, [], 1)
  cmd = patched(cmd, fake)
  r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1, r.stderr[-3000:]
  assert r.stderr.strip().splitlines()[-1] == (
      "error: process 0 lost contact with another process of the job (Gloo connectFullMesh failed: "
      "Connection refused); the last complete checkpoint is none; restart every process to resume")
  assert "Traceback" not in r.stderr and not (work / ".lock").exists()
