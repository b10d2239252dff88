"""The autocast corpus under `p=f32,c=bf16,o=f32` (its float16 half and the checks of the checks:
`tests/test_autocast_corpus.py`)."""

import pytest

from tests import autocast_corpus_run as corpus


@pytest.mark.parametrize(("name", "dtype", "mode"), corpus.params("bf16"))
def test_corpus_case(name, dtype, mode):
  corpus.check_case(name, dtype, mode)
