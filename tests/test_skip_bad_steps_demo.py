"""Runs the core of `examples/skip_bad_steps_demo.py` and checks what it claims."""

import math

import numpy as np
import pytest

from tests.example_loader import load_example

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

demo = load_example("skip_bad_steps_demo.py", "optax_lossscale_skip_demo")


@pytest.fixture(scope="module")
def results():
  return demo.run_all(demo.STEPS, seed=0)


def test_without_a_guard_the_run_ends_in_nan(results):
  unguarded = results["no guard"]
  assert math.isnan(unguarded.final_loss)
  # Finite up to the NaN batch, NaN from it on: the NaN step poisoned Adam.
  assert all(math.isfinite(v) for v in unguarded.losses[: demo.NAN_STEP])
  assert all(math.isnan(v) for v in unguarded.losses[demo.NAN_STEP :])


def test_guarded_run_skips_exactly_the_bad_batches_and_lands_near_the_clean_run(results):
  clean, guarded = results["clean"], results["skip_bad_steps"]
  assert guarded.spike_skips == [demo.SPIKE_STEP]
  assert guarded.nonfinite_skips == [demo.NAN_STEP]
  assert clean.spike_skips == clean.nonfinite_skips == []
  assert abs(guarded.final_loss / clean.final_loss - 1) < 0.05
  # The clean run's trajectory until the spike batch (to 1%: the two
  # scans are different XLA programs, whose last-bit differences bfloat16 grows).
  np.testing.assert_allclose(
    guarded.losses[: demo.SPIKE_STEP], clean.losses[: demo.SPIKE_STEP], rtol=1e-2
  )


def test_apply_if_finite_skips_the_nan_but_not_the_spike(results):
  peer, clean = results["apply_if_finite"], results["clean"]
  assert peer.nonfinite_skips == [demo.NAN_STEP] and peer.spike_skips == []
  assert peer.final_loss > results["skip_bad_steps"].final_loss
  assert math.isfinite(peer.final_loss) and peer.final_loss > clean.final_loss


def test_table_and_plot(results, tmp_path):
  table = demo.format_table(results)
  row = next(line for line in table.splitlines() if line.startswith("skip_bad_steps "))
  assert f"{demo.SPIKE_STEP}: spike" in row and f"{demo.NAN_STEP}: nan/inf" in row
  demo.plot(results, tmp_path / "plot.png")
  assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rejects_runs_too_short_to_reach_the_bad_batches(capsys):
  with pytest.raises(SystemExit):
    demo.parse_args(["--steps", str(demo.NAN_STEP)])
  assert "--steps must be more than" in capsys.readouterr().err
