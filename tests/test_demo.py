"""Runs `examples/demo.py` for a few steps and checks what it reports."""

import json

import jax
import numpy as np
import pytest

from tests.example_loader import load_example

STEPS = 100

demo = load_example("demo.py", "optax_lossscale_demo")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("demo")
  results = demo.main(["--steps", str(STEPS), "--out", str(out), "--seed", "0"])
  return out, results


def test_writes_png_and_json_matching_the_run(demo_run):
  out, results = demo_run
  assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  summary = json.loads((out / "demo.json").read_text())
  assert summary["steps"] == STEPS and summary["seed"] == 0
  assert [r["name"] for r in summary["runs"]] == [s.name for s in demo.SETTINGS]
  for stored, result in zip(summary["runs"], results, strict=True):
    assert stored["losses"] == result.losses
    assert len(stored["losses"]) == len(stored["loss_scales"]) == STEPS
    assert stored["final_loss"] == result.final_loss
    assert stored["test_accuracy"] == result.test_accuracy
    assert stored["mean_underflow"] == result.mean_underflow


def test_table_prints_the_numbers_of_the_run(demo_run):
  _, results = demo_run
  table = demo.format_table(results)
  for result in results:
    row = next(line for line in table.splitlines() if line.startswith(result.name + "  "))
    final_loss, accuracy, skipped, retries, scale, underflow = row[len(result.name) :].split()
    assert float(final_loss) == pytest.approx(result.final_loss, abs=1e-5)
    assert float(accuracy.rstrip("%")) == pytest.approx(100 * result.test_accuracy, abs=0.05)
    assert int(skipped) == len(result.skipped_steps)
    assert int(retries) == result.retries
    base, _, exponent = scale.partition("^")
    scale = 2.0 ** int(exponent) if exponent else float(base)
    assert scale == result.final_loss_scale
    if result.mean_underflow is None:
      assert underflow == "n/a"
    else:
      assert float(underflow.rstrip("%")) == pytest.approx(100 * result.mean_underflow, abs=0.05)


def test_unscaled_float16_loses_gradients_and_scaled_tracks_float32(demo_run):
  _, (f32, f16, scaled, _, _) = demo_run
  assert f32.underflow is None
  # Without scaling float16 flushes a real share of the gradient entries to
  # zero at every step; with the scale it keeps (almost) all of them. How much
  # is lost depends on how the backend fuses float16 arithmetic (measured:
  # 14.4% of the entries on CPU, 8.2% on an H100).
  assert min(f16.underflow) > 0
  assert f16.mean_underflow > 0.05
  assert scaled.mean_underflow < f16.mean_underflow / 20
  np.testing.assert_allclose(scaled.losses, f32.losses, rtol=5e-3)
  assert abs(scaled.test_accuracy - f32.test_accuracy) <= 0.01


@pytest.mark.skipif(
  jax.default_backend() != "cpu",
  reason="magnitudes of XLA:CPU's float16 arithmetic (a GPU fusion loses fewer entries)",
)
def test_on_cpu_the_lost_signal_slows_the_loss(demo_run):
  _, (f32, f16, _, _, _) = demo_run
  assert min(f16.underflow) > 0.01
  assert f16.final_loss > 1.1 * f32.final_loss


def test_loss_scale_follows_the_dynamic_schedule(demo_run):
  _, (f32, f16, scaled, retried, _) = demo_run
  assert f32.loss_scales == f16.loss_scales == [1.0] * STEPS
  # No overflow this early: the retrying run is the same run, with no retry.
  assert retried.loss_scales == scaled.loss_scales and retried.retries == 0
  # No overflow this early, so the scale doubles every GROWTH_PERIOD steps.
  assert scaled.skipped_steps == []
  expected = [demo.INITIAL_LOSS_SCALE * 2.0 ** (i // demo.GROWTH_PERIOD) for i in range(STEPS)]
  assert scaled.loss_scales == expected
  assert scaled.final_loss_scale == demo.INITIAL_LOSS_SCALE * 2.0 ** (STEPS // demo.GROWTH_PERIOD)


def test_runs_are_deterministic(demo_run):
  _, results = demo_run
  scaled_setting = demo.SETTINGS[2]

  class Silent:
    def update(self, n):
      pass

  again = demo.train(scaled_setting, demo.load_data(0), STEPS, 0, Silent())
  assert again == results[2]


def test_rejects_nonpositive_steps(capsys):
  with pytest.raises(SystemExit):
    demo.parse_args(["--steps", "0"])
  assert "--steps must be a positive integer; got 0" in capsys.readouterr().err


def test_autocast_row_tracks_float32_without_a_hand_cast(demo_run):
  _, (f32, f16, scaled, _, mixed) = demo_run
  # The float32 model through autocast keeps (almost) every gradient entry, as
  # the hand-cast scaled run does, and trains like float32.
  assert mixed.mean_underflow < f16.mean_underflow / 20
  np.testing.assert_allclose(mixed.losses, f32.losses, rtol=5e-3)
  assert abs(mixed.test_accuracy - f32.test_accuracy) <= 0.01
  assert mixed.loss_scales == scaled.loss_scales  # the same scale schedule
