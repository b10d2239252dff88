"""`autocast` on real model code: Flax Linen and NNX, Equinox and raw JAX.

Each model is written in float32, as its framework's users write it, and run
under `jax.jit` and `jax.grad` (or the framework's own transforms) as a train
step would. Every test checks, against the same model in float32:

- the loss and the gradients (the distance `|g - g32| / |g32|` over all
  parameters at once, within a bound set by the compute dtype);
- every matrix product and convolution of the jaxpr of the gradient, forward
  and backward, takes 16-bit operands;
- where the shapes make it meaningful (activations of at least
  `MIN_SAVED_SIZE` elements), what reverse mode keeps for the backward pass
  (JAX's own `saved_residuals`, the arguments left out) is mostly 16-bit and
  at most 0.55 of the float32 model's bytes, the goal of issue #30.

Shapes are small (the whole file runs in about a minute on 2 cores); a
convolution's gradient takes XLA:CPU seconds to compile, so they are tiny.
"""

from __future__ import annotations

import warnings

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_lossscale as ols
from optax_lossscale._src.autocast import regions as autocast_regions
from optax_lossscale._src.utils import compat
from tests.autocast_helpers import matmul_inputs

HALVES = {"float16": "p=f32,c=f16,o=f32", "bfloat16": "p=f32,c=bf16,o=f32"}
# Observed: 0.5e-3 to 2e-3 (float16), 5e-3 to 1.5e-2 (bfloat16) on these models.
GRAD_TOL = {"float16": 1e-2, "bfloat16": 4e-2}
VALUE_RTOL = {"float16": 2e-3, "bfloat16": 1e-2}
MEMORY_GOAL = 0.55  # issue #30: saved residuals vs float32's


# -- what every test checks.


def grad_error(got, want) -> float:
  """`|g - g32| / |g32|` over every leaf at once (a zero-gradient leaf alone is noise)."""
  pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
  diff = sum(float(jnp.sum((g.astype(jnp.float32) - w) ** 2)) for g, w in pairs)
  return (diff / sum(float(jnp.sum(w**2)) for _, w in pairs)) ** 0.5


def residuals(fun, *args):
  """The avals reverse mode keeps for `fun`'s backward pass, its arguments left out."""
  return [
    aval for aval, where in compat.saved_residuals(fun, *args) if "from the argument" not in where
  ]


def nbytes(avals) -> int:
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in avals)


def assert_backward_keeps_16_bit(mixed, reference, *args, goal=MEMORY_GOAL):
  """Saved residuals mostly 16-bit (float32 only in small values) and <= `goal` of float32's."""
  got, want = residuals(mixed, *args), residuals(reference, *args)
  big_f32 = [
    a for a in got
    if a.dtype == jnp.float32 and np.prod(a.shape) >= autocast_regions.MIN_SAVED_SIZE
  ]  # fmt: skip
  ratio = nbytes(got) / nbytes(want)
  assert ratio <= goal, (ratio, [(str(a.dtype), a.shape) for a in got])
  assert nbytes(big_f32) <= 0.25 * nbytes(got), [a.shape for a in big_f32]
  return ratio


def assert_products_16_bit(jaxpr, half):
  products = matmul_inputs(jaxpr)
  assert products and set(products) == {(half, half)}, products


def check(loss, args, half, *, has_aux=False, memory=True, grad_tol=None):
  """Values, gradients, product dtypes and residuals of `autocast(loss)` against float32's.

  Returns the mixed function's `(value, aux)` (or value) and gradients.
  """
  mixed = ols.autocast(loss, HALVES[half])
  run = lambda f: jax.jit(jax.value_and_grad(f, has_aux=has_aux))(*args)
  with jax.default_matmul_precision("float32"):  # the reference: no TF32 on a GPU
    want, want_grads = run(loss)
  got, grads = run(mixed)
  value, want_value = (got[0], want[0]) if has_aux else (got, want)
  assert value.dtype == jnp.float32
  np.testing.assert_allclose(value, want_value, rtol=VALUE_RTOL[half])
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    assert g.dtype == w.dtype
  assert grad_error(grads, want_grads) < (grad_tol or GRAD_TOL[half])
  assert_products_16_bit(jax.make_jaxpr(jax.grad(mixed, has_aux=has_aux))(*args), half)
  if memory:
    scalar = (lambda f: lambda *a: f(*a)[0]) if has_aux else (lambda f: f)
    assert_backward_keeps_16_bit(scalar(mixed), scalar(loss), *args)
  return got, grads


def close_trees(got, want, rtol, atol=0.0):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


# -- Flax Linen.

nn = pytest.importorskip("flax.linen")


class ResBlock(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    h = nn.Conv(self.features, (3, 3))(x)
    h = nn.relu(nn.BatchNorm(use_running_average=not train)(h))
    h = nn.Conv(self.features, (3, 3))(h)
    h = nn.BatchNorm(use_running_average=not train)(h)
    h = nn.Dropout(0.2, deterministic=not train)(h)
    return nn.relu(x + h)


class ResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = ResBlock(8)(x, train)
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    return nn.Dense(10)(x.reshape(x.shape[0], -1))


def _resnet_loss(model):
  def loss(params, batch_stats, x, y, key):
    logits, updates = model.apply(
      {"params": params, "batch_stats": batch_stats},
      x,
      mutable=["batch_stats"],
      rngs={"dropout": key},
    )
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y)), updates

  return loss


def test_linen_resnet_block_with_batchnorm_dropout_and_mutable_batch_stats():
  model = ResNet()
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  y = jnp.arange(4)
  variables = model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)
  args = (variables["params"], variables["batch_stats"], x, y, jax.random.key(3))
  loss = _resnet_loss(model)
  (_, updates), _ = check(loss, args, "float16", has_aux=True)
  # The batch statistics the train step returns are float32's (same dropout mask).
  _, want = jax.jit(loss)(*args)
  close_trees(updates, want, rtol=1e-3, atol=1e-5)


def test_a_region_is_cached_with_the_values_that_leave_it():
  # Two functions with one region of the same structure (sin, cos after a
  # product) that return different values of it: the second must not reuse
  # the first one's compiled region. Before the fix g returned f's value.
  def f(w, x):
    a = jnp.sin(x @ w)
    b = jnp.cos(a)
    return jnp.sum(b @ w)

  def g(w, x):
    a = jnp.sin(x @ w)
    b = jnp.cos(a)  # noqa: F841  (computed, not used: the region returns `a` only)
    return jnp.sum(a @ w)

  w, x = jnp.eye(4) * 0.5, jnp.ones((2, 4))
  assert abs(float(f(w, x)) - float(g(w, x))) > 1.0
  for fun in (f, g):
    np.testing.assert_allclose(ols.autocast(fun, "c=f16,o=f32")(w, x), fun(w, x), rtol=1e-3)


class MLPLayer(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    h = nn.Dropout(0.1, deterministic=False)(nn.gelu(h))
    return x + checkpoint_name(nn.Dense(self.width)(h), "mlp_out"), None


class ScannedStack(nn.Module):
  width: int = 32
  policy: object = None
  remat: bool = False

  @nn.compact
  def __call__(self, x):
    layer = nn.remat(MLPLayer, policy=self.policy, prevent_cse=False) if self.remat else MLPLayer
    stack = nn.scan(
      layer,
      variable_axes={"params": 0},
      split_rngs={"params": True, "dropout": True},
      length=3,
    )
    return stack(self.width)(x, None)[0]


def _scanned(remat, policy=None):
  model = ScannedStack(remat=remat, policy=policy)
  x = jax.random.normal(jax.random.key(0), (4, 16, 32))
  params = model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)["params"]
  loss = lambda p, x, key: jnp.mean(model.apply({"params": p}, x, rngs={"dropout": key}) ** 2)
  return loss, (params, x, jax.random.key(3))


def test_linen_scan_over_layers_with_split_rngs():
  loss, args = _scanned(remat=False)
  check(loss, args, "bfloat16")


def test_linen_scan_of_remat_layers_keeps_the_policy():
  policy = jax.checkpoint_policies.save_only_these_names("mlp_out")
  loss, args = _scanned(remat=True, policy=policy)
  check(loss, args, "float16", memory=False)
  # What the policy saves under float32 (the named outputs, one per layer),
  # autocast saves too (`name` is a region boundary): the rest is recomputed.
  shapes = lambda f: sorted(a.shape for a in residuals(f, *args) if len(a.shape) == 4)
  assert shapes(ols.autocast(loss, "c=f16,o=f32")) == shapes(loss)


class Block(nn.Module):
  width: int

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h, mask=mask)
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class LM(nn.Module):
  vocab: int = 64
  width: int = 32

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.width)
    x = embed(tokens)
    mask = nn.combine_masks(
      nn.make_causal_mask(tokens), nn.make_attention_mask(tokens > 0, tokens > 0)
    )
    x = nn.jit(Block)(self.width)(x, mask)
    x = Block(self.width)(x, mask)
    return embed.attend(nn.LayerNorm()(x))


def _lm_loss(model):
  def loss(params, tokens):
    logits = model.apply({"params": params}, tokens)[:, :-1]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))

  return loss


def test_linen_lm_with_masked_attention_embed_attend_and_nn_jit():
  model = LM()
  tokens = jax.random.randint(jax.random.key(0), (4, 16), 0, 64)
  params = model.init(jax.random.key(1), tokens)["params"]
  check(_lm_loss(model), (params, tokens), "float16")


def test_linen_train_state_step_with_batch_stats_tracks_float32():
  from optax_lossscale.flax import TrainState

  class State(TrainState):
    batch_stats: dict

  model = nn.Sequential([
    nn.Dense(64), nn.BatchNorm(use_running_average=False), nn.relu, nn.Dense(10)
  ])  # fmt: skip
  x = jax.random.normal(jax.random.key(0), (32, 16))
  y = jnp.argmax(x[:, :10], -1)
  variables = model.init(jax.random.key(1), x)

  def loss(params, stats, x, y):
    logits, updates = model.apply(
      {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
    )
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y)), updates

  def train(loss_fn):
    state = State.create(
      apply_fn=model.apply,
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      tx=ols.loss_scale_optimizer(optax.adam(1e-2)),
    )

    @jax.jit
    def step(state):
      (value, updates), grads = ols.value_and_grad(loss_fn, has_aux=True)(
        state, state.params, state.batch_stats, x, y
      )
      state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
      return state, value

    values = []
    for _ in range(10):
      state, value = step(state)
      values.append(float(value))
    return state, values

  mixed = ols.autocast(loss, "p=f32,c=f16,o=f32")
  (want_state, want), (state, got) = train(loss), train(mixed)
  assert int(state.step) == 10 and int(ols.metrics(state)["total_skips"]) == 0
  assert got[-1] < 0.5 * got[0]
  np.testing.assert_allclose(got, want, rtol=2e-2)
  # The running variance after ten steps, as a whole: the statistics drift apart with the
  # parameters (on a CPU with AVX512-FP16/BF16, one running mean in 64 was 5.5% off). The
  # running mean is not compared after ten steps: the Dense bias before BatchNorm has a zero
  # gradient in exact arithmetic, so Adam steps it by +-lr on rounding noise, float32's too.
  got_var = state.batch_stats["layers_1"]["var"]
  want_var = want_state.batch_stats["layers_1"]["var"]
  assert float(jnp.linalg.norm(got_var - want_var) / jnp.linalg.norm(want_var)) < 2e-2

  # One step from the same parameters, in units every backend guarantees: each product
  # term rounds its two operands to float16 (relative error <= u = 2**-11 each) and
  # accumulates in float32, so |h' - h| <= e = 2u |x| @ |W| (+ float32's own rounding),
  # the batch mean moves by at most mean(e), and the batch variance by at most
  # mean(2 |h - mean(h)| (e + mean(e))); the running statistics take (1 - momentum) of it.
  (_, updates), (_, want_updates) = [
    f(variables["params"], variables["batch_stats"], x, y) for f in (jax.jit(mixed), loss)
  ]
  kernel = variables["params"]["layers_0"]["kernel"]
  h = x @ kernel + variables["params"]["layers_0"]["bias"]
  e = 2 * 2.0**-11 * (abs(x) @ abs(kernel)) + 1e-6 * (1 + abs(h))
  fraction = 1 - 0.99  # nn.BatchNorm's momentum
  bound = {
    "mean": fraction * e.mean(0),
    "var": fraction * (2 * abs(h - h.mean(0)) * (e + e.mean(0))).mean(0),
  }
  for name in ("mean", "var"):
    diff = abs(
      updates["batch_stats"]["layers_1"][name] - want_updates["batch_stats"]["layers_1"][name]
    )
    assert bool(jnp.all(diff <= bound[name])), (name, float(jnp.max(diff / bound[name])))


# -- Flax NNX.

nnx = pytest.importorskip("flax.nnx")


class NNXNet(nnx.Module):
  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
    )
    self.out = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    h = self.drop(nnx.relu(self.bn(self.conv(x))))
    tokens = h.reshape(h.shape[0], -1, 8)
    mask = nnx.make_causal_mask(jnp.ones(tokens.shape[:2]))
    tokens = tokens + self.attn(tokens, mask=mask)
    return self.out(tokens.mean(1))


def _nnx_loss(model, x, y):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(x), y))


def test_nnx_conv_batchnorm_dropout_attention_writes_its_state_back():
  x, y = jax.random.normal(jax.random.key(0), (4, 8, 8, 3)), jnp.arange(4)
  want_model, model = NNXNet(nnx.Rngs(0)), NNXNet(nnx.Rngs(0))
  mixed = ols.autocast(_nnx_loss, HALVES["float16"])
  want, want_grads = nnx.jit(nnx.value_and_grad(_nnx_loss))(want_model, x, y)
  got, grads = nnx.jit(nnx.value_and_grad(mixed))(model, x, y)
  np.testing.assert_allclose(got, want, rtol=VALUE_RTOL["float16"])
  assert grad_error(nnx.state(grads), nnx.state(want_grads)) < GRAD_TOL["float16"]
  # BatchNorm's statistics and the dropout RNG count, updated in place as in float32.
  close_trees(nnx.state(model, nnx.BatchStat), nnx.state(want_model, nnx.BatchStat), 1e-3, 1e-5)
  assert int(model.drop.rngs.count[...]) == int(want_model.drop.rngs.count[...]) == 1

  # The module rebuilt inside the trace from its state (statistics and RNG
  # counts passed in too: NNX refuses an update of a variable made outside).
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  grad_of = lambda params, rest, x, y: nnx.grad(mixed)(nnx.merge(graphdef, params, rest), x, y)
  assert_products_16_bit(jax.make_jaxpr(grad_of)(params, rest, x, y), "float16")
  pure = lambda params, rest, x, y: mixed(nnx.merge(graphdef, params, rest), x, y)
  reference = lambda params, rest, x, y: _nnx_loss(nnx.merge(graphdef, params, rest), x, y)
  assert_backward_keeps_16_bit(pure, reference, params, rest, x, y)


def test_nnx_optimizer_step_with_nnx_value_and_grad():
  from optax_lossscale.flax import nnx_value_and_grad

  x, y = jax.random.normal(jax.random.key(0), (4, 8, 8, 3)), jnp.arange(4)
  model = NNXNet(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, ols.loss_scale_optimizer(optax.adam(1e-2)), wrt=nnx.Param)
  mixed = ols.autocast(_nnx_loss, HALVES["bfloat16"])

  @nnx.jit
  def step(model, optimizer, x, y):
    value, grads = nnx_value_and_grad(mixed)(optimizer, model, x, y)
    optimizer.update(model, grads)
    return value

  values = [float(step(model, optimizer, x, y)) for _ in range(4)]
  assert values[-1] < values[0] and int(ols.metrics(optimizer)["total_skips"]) == 0
  assert int(model.drop.rngs.count[...]) == 4
  assert model.bn.mean[...].dtype == jnp.float32 and model.conv.kernel[...].dtype == jnp.float32


class NNXLayer(nnx.Module):
  def __init__(self, rngs, width=32):
    self.ln = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.bn = nnx.BatchNorm(4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    h = self.drop(nnx.gelu(self.bn(self.up(self.ln(x)))))
    return x + self.down(h)


class NNXStack(nnx.Module):
  """Layers made by `nnx.vmap`, run by `nnx.scan`, each under `nnx.remat`."""

  def __init__(self, rngs, depth=3):
    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NNXLayer(rngs)

    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, x):
      return nnx.remat(lambda layer, x: layer(x))(layer, x)

    return body(self.layers, x)


def test_nnx_scan_over_vmapped_layers_with_remat():
  x = jax.random.normal(jax.random.key(0), (64, 32))
  loss = lambda m, x: jnp.mean(m(x) ** 2)
  want_model, model = (
    NNXStack(nnx.Rngs(params=0, dropout=1)),
    NNXStack(nnx.Rngs(params=0, dropout=1)),
  )
  mixed = ols.autocast(loss, HALVES["float16"])
  want, want_grads = nnx.jit(nnx.value_and_grad(loss))(want_model, x)
  got, grads = nnx.jit(nnx.value_and_grad(mixed))(model, x)
  np.testing.assert_allclose(got, want, rtol=VALUE_RTOL["float16"])
  assert grad_error(nnx.state(grads), nnx.state(want_grads)) < GRAD_TOL["float16"]
  # The stacked BatchNorm statistics (one row per layer) and RNG counts, written back.
  assert model.layers.bn.mean[...].shape == (3, 128)
  close_trees(nnx.state(model, nnx.BatchStat), nnx.state(want_model, nnx.BatchStat), 2e-3, 1e-4)
  np.testing.assert_array_equal(model.layers.drop.rngs.count[...], [1, 1, 1])

  def grad_of(state, x):  # the module rebuilt inside the trace, as nnx.jit does
    return nnx.grad(mixed)(nnx.merge(graphdef, state), x)

  graphdef, state = nnx.split(model)
  assert_products_16_bit(jax.make_jaxpr(grad_of)(state, x), "float16")


# -- Equinox (an optional extra: its tests skip where it is not installed).

try:
  import equinox as eqx
except ImportError:  # pragma: no cover
  eqx = None
needs_equinox = pytest.mark.skipif(eqx is None, reason="needs equinox")
WIDTH = 32
_Module = eqx.Module if eqx is not None else object


class EqxBlock(_Module):
  ln1: object
  ln2: object
  attn: object
  mlp: object

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.ln1, self.ln2 = eqx.nn.LayerNorm(WIDTH), eqx.nn.LayerNorm(WIDTH)
    self.attn = eqx.nn.MultiheadAttention(4, WIDTH, key=k1)
    self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 4 * WIDTH, 1, activation=jax.nn.gelu, key=k2)

  def __call__(self, x):
    h = jax.vmap(self.ln1)(x)
    x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((x.shape[0],) * 2, bool)))
    return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class EqxViT(_Module):
  patch: object
  blocks: list
  head: object
  pos: jax.Array

  def __init__(self, key):
    keys = jax.random.split(key, 4)
    self.patch = eqx.nn.Conv2d(3, WIDTH, 4, stride=4, key=keys[0])
    self.blocks = [EqxBlock(keys[1])]
    self.head = eqx.nn.Linear(WIDTH, 10, key=keys[3])
    self.pos = jax.random.normal(keys[3], (16, WIDTH)) * 0.02

  def __call__(self, image):
    x = self.patch(image).reshape(WIDTH, -1).T + self.pos
    for block in self.blocks:
      x = block(x)
    return self.head(x.mean(0))


def _eqx_loss(model, x, y):
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y))


def _vit_batch():
  return jax.random.normal(jax.random.key(1), (8, 3, 16, 16)), jnp.arange(8)


@needs_equinox
def test_equinox_vit_with_conv_patches_attention_and_layer_norm():
  model = EqxViT(jax.random.key(0))
  x, y = _vit_batch()
  params, static = eqx.partition(model, eqx.is_inexact_array)
  check(lambda p, x, y: _eqx_loss(eqx.combine(p, static), x, y), (params, x, y), "float16")


@needs_equinox
def test_equinox_loss_scaled_steps_with_filter_value_and_grad():
  from optax_lossscale.equinox import filter_value_and_grad

  model = EqxViT(jax.random.key(0))
  x, y = _vit_batch()
  tx = ols.loss_scale_optimizer(optax.adam(3e-3))
  state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  mixed = ols.autocast(_eqx_loss, HALVES["float16"])

  @eqx.filter_jit
  def step(model, state):
    value, grads = filter_value_and_grad(mixed)(state, model, x, y)
    updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), state, value

  values = []
  for _ in range(4):
    model, state, value = step(model, state)
    values.append(float(value))
  assert values[-1] < values[0] and int(ols.metrics(state)["total_skips"]) == 0


@needs_equinox
def test_equinox_vit_with_bfloat16_weights_on_float32_images():
  model = EqxViT(jax.random.key(0))
  to = lambda dtype: lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a
  model16 = jax.tree.map(to(jnp.bfloat16), model)
  x, y = _vit_batch()
  with pytest.raises(TypeError):
    _eqx_loss(model16, x, y)  # as written, JAX refuses the mixed convolution
  mixed = ols.autocast(_eqx_loss, "p=bf16,c=bf16,o=f32")
  # Against the float32 program meant: the same (rounded) weights in float32.
  value_and_grad = lambda f, m: eqx.filter_jit(eqx.filter_value_and_grad(f))(m, x, y)
  want, want_grads = value_and_grad(_eqx_loss, jax.tree.map(to(jnp.float32), model16))
  value, grads = value_and_grad(mixed, model16)
  np.testing.assert_allclose(value, want, rtol=1e-2)
  assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
  assert grad_error(grads, want_grads) < GRAD_TOL["bfloat16"]
  jaxpr = eqx.filter_make_jaxpr(lambda m: eqx.filter_grad(mixed)(m, x, y))(model16)[0]
  assert_products_16_bit(jaxpr, "bfloat16")


@needs_equinox
def test_equinox_stateful_layer_called_under_autocast():
  model, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
    eqx.nn.Linear(8, 8, key=jax.random.key(0)), "weight", key=jax.random.key(1)
  )
  x = jax.random.normal(jax.random.key(2), (8,))
  call = lambda m, x, s: m(x, s)
  clone = jax.tree_util.tree_unflatten(*reversed(jax.tree_util.tree_flatten(state)))
  want, want_state = call(model, x, clone)  # a state is used once: the reference gets a clone
  got, new_state = ols.autocast(call, "c=f16,o=f32")(model, x, state)
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3)
  close_trees(new_state, want_state, rtol=1e-2, atol=1e-3)


# -- Raw JAX: a GPT block, rotary embeddings, scanned layers, checkpoint policies.

D, HEADS, T, VOCAB, LAYERS = 32, 4, 16, 64, 2


def rope(x):
  """Rotary embeddings from sin/cos tables; the halves recombined by `jnp.stack`."""
  half = x.shape[-1] // 2
  angle = jnp.arange(x.shape[1])[:, None] / 10000 ** (jnp.arange(half) / half)
  sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
  x1, x2 = x[..., ::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


def rms_norm(x, scale):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def gpt_block(x, p):
  batch = x.shape[0]
  q, k, v = jnp.split(rms_norm(x, p["g1"]) @ p["wqkv"], 3, -1)
  q, k, v = (a.reshape(batch, T, HEADS, D // HEADS) for a in (q, k, v))
  a = jax.nn.dot_product_attention(rope(q), rope(k), v, is_causal=True, implementation=None)
  x = x + checkpoint_name(a.reshape(batch, T, D) @ p["wo"], "attn_out")
  h = rms_norm(x, p["g2"])
  return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def gpt_params(key):
  keys = jax.random.split(key, 6)
  normal = lambda k, shape: jax.random.normal(k, (LAYERS, *shape)) / shape[0] ** 0.5
  return {
    "embed": jax.random.normal(keys[0], (VOCAB, D)) * 0.1,
    "layers": {
      "g1": jnp.ones((LAYERS, D)),
      "g2": jnp.ones((LAYERS, D)),
      "wqkv": normal(keys[1], (D, 3 * D)),
      "wo": normal(keys[2], (D, D)),
      "w1": normal(keys[3], (D, 4 * D)),
      "w3": normal(keys[4], (D, 4 * D)),
      "w2": normal(keys[5], (4 * D, D)),
    },
  }


def gpt_loss(remat=False, policy=None):
  def loss(params, tokens):
    x = params["embed"][tokens]
    block = jax.checkpoint(gpt_block, policy=policy) if remat else gpt_block
    x, _ = lax.scan(lambda x, layer: (block(x, layer), None), x, params["layers"])
    logits = rms_norm(x, 1.0) @ params["embed"].T
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]))

  return loss


TOKENS = jax.random.randint(jax.random.key(1), (4, T), 0, VOCAB)


def test_gpt_with_rotary_embeddings_and_scanned_layers():
  check(gpt_loss(), (gpt_params(jax.random.key(0)), TOKENS), "float16")


def test_a_dots_saveable_checkpoint_saves_the_products_it_names():
  # Under float32 the policy saves x @ w1 and the backward pass recomputes
  # only the gelu; under autocast the product is saved too (as its float32
  # result), not recomputed. Before the fix the policy saw no dot_general
  # (each product was a custom_jvp call) and recomputed every product.
  def loss(p, x):
    block = lambda p, x: x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return jnp.mean(jax.checkpoint(block, policy=jax.checkpoint_policies.dots_saveable)(p, x) ** 2)

  p = {"w1": jnp.ones((32, 128)) / 32, "w2": jnp.ones((128, 32)) / 128}
  x = jax.random.normal(jax.random.key(0), (64, 32))
  saved = lambda f: sorted(a.shape for a in residuals(f, p, x))
  assert (64, 128) in saved(loss)
  assert (64, 128) in saved(ols.autocast(loss, "c=f16,o=f32"))
  check(loss, (p, x), "float16", memory=False)


@pytest.mark.parametrize(
  "policy",
  [None, jax.checkpoint_policies.save_only_these_names("attn_out")],
  ids=["nothing_saved", "save_only_these_names"],
)
def test_gpt_with_checkpointed_layers_keeps_16_bit_residuals(policy):
  params = gpt_params(jax.random.key(0))
  loss = gpt_loss(remat=True, policy=policy)
  assert_backward_keeps_16_bit(ols.autocast(loss, "c=f16,o=f32"), loss, params, TOKENS)


def small_block(p, x):
  """A pre-norm MLP block with activations of 2048 elements: regions that keep 16 bits."""
  h = jax.nn.gelu(rms_norm(x, p["g"]) @ p["w1"] + p["b1"])
  return jnp.mean((x + h @ p["w2"]) ** 2)


def small_params(key, width=16):
  k1, k2 = jax.random.split(key)
  return {
    "g": jnp.ones(width),
    "w1": jax.random.normal(k1, (width, 4 * width)) / width**0.5,
    "b1": jnp.zeros(4 * width),
    "w2": jax.random.normal(k2, (4 * width, width)) / (2 * width),
  }


def test_per_example_gradients_jvp_hessian_pmap_and_autocast_of_grad():
  p, x = small_params(jax.random.key(0)), jax.random.normal(jax.random.key(1), (32, 16))
  mixed = ols.autocast(small_block, HALVES["float16"])
  tangent = jax.tree.map(jnp.ones_like, p)
  jvp = lambda f: jax.jit(lambda p, t: jax.jvp(lambda q: f(q, x), (p,), (t,)))(p, tangent)
  (value, slope), (want_value, want_slope) = jvp(mixed), jvp(small_block)
  np.testing.assert_allclose(value, want_value, rtol=2e-3)
  np.testing.assert_allclose(slope, want_slope, rtol=1e-2)

  w = p["w1"][:, :4]
  tiny = lambda w, x: jnp.sum(jnp.tanh(x[:4] @ w) ** 2)
  hessian = jax.jit(jax.hessian(ols.autocast(tiny, HALVES["float16"])))(w, x)
  want_hessian = jax.jit(jax.hessian(tiny))(w, x)
  np.testing.assert_allclose(hessian, want_hessian, atol=2e-3 * float(jnp.max(abs(want_hessian))))
  jaxpr = jax.make_jaxpr(jax.hessian(ols.autocast(tiny, HALVES["float16"])))(w, x)
  assert_products_16_bit(jaxpr, "float16")

  # Per-example gradients: the vmap of the gradient of the autocast loss.
  per_example = lambda f: jax.vmap(jax.grad(f), in_axes=(None, 0))
  want = jax.jit(per_example(small_block))(p, x[:, None])
  assert grad_error(jax.jit(per_example(mixed))(p, x[:, None]), want) < GRAD_TOL["float16"]
  assert_products_16_bit(jax.make_jaxpr(per_example(mixed))(p, x[:, None]), "float16")

  want_grads = jax.jit(jax.grad(small_block))(p, x)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # pmap is on its way out
    pmapped = jax.pmap(jax.grad(mixed), in_axes=(None, 0))(p, x[None])
  assert grad_error(jax.tree.map(lambda g: g[0], pmapped), want_grads) < GRAD_TOL["float16"]
  # autocast of the gradient function: the backward pass is then part of its jaxpr.
  outside = ols.autocast(jax.grad(small_block), HALVES["float16"])
  assert grad_error(jax.jit(outside)(p, x), want_grads) < GRAD_TOL["float16"]
  assert_products_16_bit(jax.make_jaxpr(outside)(p, x), "float16")


def test_fifty_float16_steps_with_loss_scaling_track_float32():
  params, loss = gpt_params(jax.random.key(0)), gpt_loss()

  def train(loss_fn):
    tx = ols.loss_scale_optimizer(optax.adam(3e-3))
    state = tx.init(params)

    @jax.jit
    def step(params, state):
      value, grads = ols.value_and_grad(loss_fn)(state, params, TOKENS)
      params, state = ols.apply_gradients(tx, grads, state, params)
      return params, state, value

    p, values = params, []
    for _ in range(50):
      p, state, value = step(p, state)
      values.append(float(value))
    return np.array(values), ols.metrics(state)

  want, _ = train(loss)
  got, metrics = train(ols.autocast(loss, HALVES["float16"]))
  assert int(metrics["total_skips"]) == 0 and float(metrics["loss_scale"]) == 2.0**15
  assert got[-1] < 0.15 * got[0]
  np.testing.assert_allclose(got, want, rtol=2e-2)


def test_an_explicit_bfloat16_product_is_kept_under_a_float16_policy():
  dense = nn.Dense(4, dtype=jnp.bfloat16)  # the hand-cast layer of a mixed model
  variables = {"params": {"kernel": jnp.full((4, 4), 100.0), "bias": jnp.zeros(4)}}
  f = lambda v, x: dense.apply(v, x).astype(jnp.float32)
  x = jnp.full((2, 4), 300.0)
  assert float(f(variables, x)[0, 0]) == 119808.0  # bfloat16's 1.2e5, finite
  np.testing.assert_array_equal(ols.autocast(f, "c=f16,o=f32")(variables, x), f(variables, x))
