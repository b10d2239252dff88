"""Runs `examples/fp8_flax.py` and checks what its table claims (issue 18, item 5)."""

import jax
import pytest

from tests.example_loader import load_example

pytest.importorskip("sklearn")
pytest.importorskip("flax")

example = load_example("fp8_flax.py", "optax_lossscale_fp8_example")


@pytest.fixture(scope="module")
def results():
  return example.run_all(example.STEPS, seed=0)


def test_flax_train_state_writes_the_nan_batch_into_the_fp8_metadata(results):
  flax_run = results["flax + apply_if_finite"]
  assert flax_run.skipped == [example.NAN_STEP]  # apply_if_finite skipped the update ...
  assert flax_run.nan_in_history  # ... but Flax's TrainState wrote the metadata anyway


def test_ours_skips_it_and_the_metadata_follows_the_data_as_in_the_clean_run(results):
  clean, ours, flax_run = (
    results[k] for k in ("clean", "ols skip_bad_steps", "flax + apply_if_finite")
  )
  assert ours.skipped == [example.NAN_STEP] and not ours.nan_in_history
  assert clean.skipped == [] and not clean.nan_in_history
  # The scales keep following the inputs: the shifted batches are clipped as in
  # the clean run, only on their first steps; Flax's frozen scales clip them all.
  shifted = set(example.SHIFT_STEPS)
  assert len(shifted & set(flax_run.clipped_steps)) >= len(shifted) - 2
  if jax.default_backend() == "cpu":
    # Same program, same batches after the skipped step: on CPU, the same bits.
    assert ours.clipped_steps == clean.clipped_steps
  assert len(shifted & set(ours.clipped_steps)) < len(shifted) / 2
  assert len(flax_run.clipped_steps) > len(ours.clipped_steps)
  assert abs(ours.final_loss / clean.final_loss - 1) < 0.5 and ours.test_accuracy > 0.95


def test_float16_with_loss_scaling_and_fp8_trains(results):
  run = results["float16 + loss scaling"]
  assert example.NAN_STEP in run.skipped and not run.nan_in_history
  assert run.test_accuracy > 0.95
  assert max(run.loss_scales) > 2.0**15  # the scale grew, and the fp8 metadata followed it


def test_the_table_lists_every_run(results):
  table = example.format_table(results)
  for name in example.RUNS:
    assert name in table
