"""Running the corpus of `tests/autocast_corpus.py` under `autocast`, and the checks of each case.

A case is (entry, compute dtype, mode). Modes:

  eager          autocast(f)(*args), op by op (no jit)
  jit            jit(autocast(f))
  grad           jit(grad(loss of autocast(f))), w.r.t. every float32 input
  vmap           jit(vmap(autocast(f))), over a leading axis of every input (two samples)
  autocast_vmap  jit(autocast(vmap(f))): the interpreter meets the batched primitives

Each is compared with the float32 function under the same transformation.
Compiling is most of the cost: the entries of a mode are traced one by one
(a tracing error is the case's own), then compiled together, `CHUNK` entries
to a program; a program that fails to compile or run is bisected to the
entries that make it fail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import os
from typing import Any
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_lossscale as ols
from tests.autocast_corpus import BY_NAME, ENTRIES, Entry
from tests.autocast_helpers import MATMULS
from tests.autocast_known_failures import crashes, known_failure, strict

POLICIES = {"f16": "p=f32,c=f16,o=f32", "bf16": "p=f32,c=bf16,o=f32"}
COMPUTE = {"f16": jnp.float16, "bf16": jnp.bfloat16}
# The rounding error of the compute dtype (half its machine epsilon).
EPS = {"f16": 2.0**-11, "bf16": 2.0**-8}
MODES = ("eager", "jit", "grad", "vmap", "autocast_vmap")
# The float32 reference each mode compares with.
REFERENCE = {"eager": "jit", "jit": "jit", "grad": "grad", "vmap": "vmap", "autocast_vmap": "vmap"}
CHUNK = 120
# The suite runs one case per entry (its dtype and mode drawn from a hash of its name), which keeps
# it to about a minute on 2 cores; OLS_AUTOCAST_CORPUS=full runs every case (20-40 minutes).
FULL = os.environ.get("OLS_AUTOCAST_CORPUS", "") == "full"
# Primitives whose sub-jaxprs run as the function wrote them (their products are theirs); a
# `custom_vjp_call`'s body is interpreted, its products checked.
AS_WRITTEN = ("custom_vjp_call_jaxpr", "custom_linear_solve", "pallas_call")


def is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)


def is_real_float(x: Any) -> bool:
  return not is_key(x) and jnp.issubdtype(x.dtype, jnp.floating)


def float_args(entry: Entry) -> tuple[int, ...]:
  return tuple(i for i, a in enumerate(inputs(entry.name)) if is_real_float(a))


def applies(entry: Entry, mode: str) -> bool:
  if mode == "grad":
    return entry.grad and bool(float_args(entry))
  if mode in ("vmap", "autocast_vmap"):
    return entry.vmap
  return True


def cases() -> list[tuple[str, str, str]]:
  """Every case: (entry name, dtype, mode)."""
  return [(e.name, d, m) for e in ENTRIES for d in POLICIES for m in MODES if applies(e, m)]


def sampled(name: str) -> tuple[str, str]:
  """The one (dtype, mode) of an entry that the suite runs by default: fixed by its name."""
  entry = BY_NAME[name]
  combos = [(d, m) for d in POLICIES for m in MODES if applies(entry, m)]
  return combos[zlib.crc32(name.encode()) % len(combos)]


@functools.cache
def selected_cases(dtype: str) -> list[tuple[str, str, str]]:
  """The cases of `dtype` this run checks: all of them with OLS_AUTOCAST_CORPUS=full."""
  return [
    c
    for c in cases()
    if c[1] == dtype
    and (FULL or (not BY_NAME[c[0]].full_only and sampled(c[0]) == c[1:]))
    and not crashes(*c)
    and not unsupported(c[0])
  ]


def unsupported(name: str) -> str | None:
  """Why this backend cannot run the entry at all (XLA has no lowering for it here), or None."""
  backends = BY_NAME[name].backends
  if backends is None or jax.default_backend() in backends:
    return None
  return f"XLA lowers it on {', '.join(backends)} only, not on {jax.default_backend()}"


def seed(name: str) -> int:
  return zlib.crc32(name.encode())


@functools.cache
def inputs(name: str, batched: bool = False) -> tuple[Any, ...]:
  """The entry's inputs, from a seed of its name; batched: two samples stacked."""
  rng = np.random.default_rng(seed(name))
  first = BY_NAME[name].args(rng)
  if not batched:
    return first
  second = BY_NAME[name].args(rng)
  pairs = zip(first, second, strict=True)
  return tuple(jnp.stack([jnp.asarray(a), jnp.asarray(b)]) for a, b in pairs)


def _weights(shape: tuple[int, ...], phase: float = 0.3) -> Any:
  size = int(np.prod(shape))
  return jnp.asarray(np.cos(np.arange(size) * 0.7 + phase).reshape(shape).astype(np.float32))


def loss(out: Any) -> Any:
  """A scalar of every floating output, each weighted by fixed, varied weights."""
  total = jnp.zeros((), jnp.float32)
  for leaf in jax.tree.leaves(out):
    if is_key(leaf) or not jnp.issubdtype(leaf.dtype, jnp.inexact):
      continue
    w = _weights(leaf.shape)
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
      w_imag = _weights(leaf.shape, 1.1)
      total = total + jnp.sum(jnp.real(leaf) * w) + jnp.sum(jnp.imag(leaf) * w_imag)
    else:
      total = total + jnp.sum(leaf.astype(jnp.float32) * w)
  return total


def mode_fn(entry: Entry, mode: str, dtype: str | None) -> Callable[..., Any]:
  """The function a case runs; `dtype` None: the float32 reference."""
  cast = (lambda f: f) if dtype is None else (lambda f: ols.autocast(f, POLICIES[dtype]))
  if mode in ("eager", "jit"):
    return cast(entry.fn)
  if mode == "grad":
    mixed = cast(entry.fn)
    return jax.grad(lambda *a: loss(mixed(*a)), argnums=float_args(entry))
  if mode == "vmap":
    return jax.vmap(cast(entry.fn))
  if mode == "autocast_vmap":
    return cast(jax.vmap(entry.fn))
  raise ValueError(mode)


def mode_inputs(entry: Entry, mode: str) -> tuple[Any, ...]:
  return inputs(entry.name, batched=mode in ("vmap", "autocast_vmap"))


class Outcome:
  """A case's result: its outputs and jaxpr, or the exception it raised."""

  def __init__(self, out: Any = None, jaxpr: Any = None, error: BaseException | None = None):
    self.out, self.jaxpr, self.error = out, jaxpr, error


def _compile_together(
  traced: list[tuple[str, Any, Any, tuple[Any, ...]]],
) -> dict[str, Outcome]:
  """Runs the traced jaxprs in one compiled program; bisects on failure."""
  if not traced:
    return {}

  def program(all_args: list[list[Any]]) -> list[list[Any]]:
    return [
      jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a)
      for (_, closed, _, _), a in zip(traced, all_args, strict=True)
    ]

  try:
    flat = jax.block_until_ready(jax.jit(program)([jax.tree.leaves(t[3]) for t in traced]))
  except Exception as e:
    if len(traced) == 1:
      name, closed, _, _ = traced[0]
      return {name: Outcome(jaxpr=closed, error=e)}
    half = len(traced) // 2
    return {**_compile_together(traced[:half]), **_compile_together(traced[half:])}
  return {
    name: Outcome(jax.tree.unflatten(jax.tree.structure(shape), outs), closed)
    for (name, closed, shape, _), outs in zip(traced, flat, strict=True)
  }


def run_group(names: Sequence[str], mode: str, dtype: str | None) -> dict[str, Outcome]:
  """The outcomes of the entries `names` in `mode` (dtype None: float32, mode a reference)."""
  results: dict[str, Outcome] = {}
  traced = []
  for name in names:
    entry = BY_NAME[name]
    fn, args = mode_fn(entry, mode, dtype), mode_inputs(entry, mode)
    if mode == "eager":
      try:
        results[name] = Outcome(jax.block_until_ready(fn(*args)))
      except Exception as e:
        results[name] = Outcome(error=e)
      continue
    try:
      closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as e:
      results[name] = Outcome(error=e)
      continue
    traced.append((name, closed, shape, args))
  results.update(_compile_together(traced))
  return results


def params(dtype: str) -> list[Any]:
  """The selected cases of `dtype` as pytest parameters, known failures marked xfail."""
  out = []
  skipped = [
    c
    for c in cases()
    if c[1] == dtype
    and (crashes(*c) or unsupported(c[0]))
    and (FULL or (not BY_NAME[c[0]].full_only and sampled(c[0]) == c[1:]))
  ]
  for name, d, mode in selected_cases(dtype) + skipped:
    reason = known_failure(name, d, mode)
    marks = [pytest.mark.xfail(strict=strict(), reason=reason)] if reason else []
    why = crashes(name, d, mode) or unsupported(name)
    if why:
      marks = [pytest.mark.skip(reason=why)]
    out.append(pytest.param(name, d, mode, id=f"{name}-{mode}", marks=marks))
  return out


@functools.cache
def run_list(mode: str, dtype: str | None, cases_of: str) -> tuple[str, ...]:
  """The entries computed together in `mode` for the selected cases of `cases_of`.

  `dtype` None: the float32 references those cases need.
  """
  if dtype is None:
    needed = {n for n, _, m in selected_cases(cases_of) if REFERENCE[m] == mode}
    return tuple(e.name for e in ENTRIES if e.name in needed)
  return tuple(n for n, _, m in selected_cases(cases_of) if m == mode)


class Results:
  """Outcomes computed on first use, a chunk of entries of one mode and dtype at a time."""

  def __init__(self) -> None:
    self._done: dict[tuple[Any, ...], dict[str, Outcome]] = {}

  def get(self, name: str, mode: str, dtype: str | None, cases_of: str) -> Outcome:
    names = run_list(mode, dtype, cases_of)
    chunk = names.index(name) // CHUNK
    part = names[chunk * CHUNK : (chunk + 1) * CHUNK]
    if (dtype, mode, part) not in self._done:  # the same list for f16 and bf16 shares references
      self._done[dtype, mode, part] = run_group(part, mode, dtype)
    return self._done[dtype, mode, part][name]


RESULTS = Results()


# -- the checks.


def _leaves(out: Any) -> list[Any]:
  return [np.asarray(x) if not is_key(x) else x for x in jax.tree.leaves(out)]


def check_values(entry: Entry, mode: str, dtype: str, got: Any, want: Any) -> None:
  """Dtypes, exact integers, finiteness and errors within the entry's bound."""
  assert jax.tree.structure(got) == jax.tree.structure(want), (
    f"output structure {jax.tree.structure(got)} != float32's {jax.tree.structure(want)}"
  )
  tol = (entry.grad_tol or 2 * entry.tol) if mode == "grad" else entry.tol
  bound = tol * EPS[dtype]
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    where = f"output {i}"
    if is_key(w):
      assert is_key(g) and g.dtype == w.dtype, f"{where}: {g.dtype} where float32 gives {w.dtype}"
      np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w), err_msg=where)
      continue
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape, f"{where}: shape {g.shape} != {w.shape}"
    if jnp.issubdtype(w.dtype, jnp.complexfloating):
      assert jnp.issubdtype(g.dtype, jnp.complexfloating), f"{where}: {g.dtype}, not complex"
    elif jnp.issubdtype(w.dtype, jnp.floating):
      assert g.dtype == np.float32, f"{where}: {g.dtype}, not the policy's output float32"
    else:
      assert g.dtype == w.dtype, f"{where}: {g.dtype} where float32 gives {w.dtype}"
      np.testing.assert_array_equal(g, w, err_msg=f"{where}: integer/boolean results differ")
      continue
    finite = np.isfinite(w)
    bad = finite & ~np.isfinite(g)
    assert not bad.any(), f"{where}: {int(bad.sum())} non-finite values where float32's are finite"
    np.testing.assert_array_equal(g[~finite], w[~finite], err_msg=f"{where}: non-finite values")
    if finite.any():
      scale = float(np.max(np.abs(w[finite])))
      err = float(np.max(np.abs(g[finite].astype(np.complex128) - w[finite])))
      assert err <= bound * max(scale, 1e-6), (
        f"{where}: error {err:.3g} > {tol} eps * {scale:.3g} (= {bound * max(scale, 1e-6):.3g});"
        f" relative {err / max(scale, 1e-30):.3g} = {err / max(scale, 1e-30) / EPS[dtype]:.1f} eps"
      )


def products(jaxpr: Any) -> list[tuple[str, tuple[str, ...]]]:
  """Every matrix product and convolution (sub-jaxprs too, not those run as written)."""
  out = []

  def walk(jaxpr: Any) -> None:
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
      if eqn.primitive.name in MATMULS:
        out.append((eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars)))
      if eqn.primitive.name in AS_WRITTEN:
        continue
      for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(item, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
            walk(item)

  walk(jaxpr)
  return out


def check_products(entry: Entry, dtype: str, jaxpr: Any, grad: bool = False) -> None:
  """Every real floating product takes compute-dtype inputs (unless the entry fixes its own).

  Complex and integer products are not cast; nor are fp8 ones (an fp8 layer's own).
  `grad`: the jaxpr of the gradient, checked as `entry.grad_products` says.
  """
  required = (entry.grad_products or entry.products) if grad else entry.products
  if required != "compute":
    return
  want = str(np.dtype(COMPUTE[dtype]))
  wrong = [
    (name, dts)
    for name, dts in products(jaxpr)
    if all(jnp.issubdtype(jnp.dtype(d), jnp.floating) and jnp.dtype(d).itemsize > 1 for d in dts)
    and set(dts) != {want}
  ]
  assert not wrong, f"products not on {want} inputs: {wrong}"


def check_case(name: str, dtype: str, mode: str) -> None:
  """Runs a case (with the other selected cases of its mode and dtype) and checks it."""
  entry = BY_NAME[name]
  want = RESULTS.get(name, REFERENCE[mode], None, dtype)
  if want.error is not None:
    raise AssertionError(f"the float32 reference fails: {want.error!r}") from want.error
  got = RESULTS.get(name, mode, dtype, dtype)
  if got.error is not None:
    raise got.error
  check_values(entry, mode, dtype, got.out, want.out)
  if mode != "eager":  # (eager runs the jit case's function)
    check_products(entry, dtype, got.jaxpr, grad=mode == "grad")
