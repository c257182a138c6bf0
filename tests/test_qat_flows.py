"""End-to-end flows on small Flax models: QAT with learned scales and optax, the whole
train state saved and restored into a fresh abstract state, conversion to a quantized
inference tree, that tree through a file into an abstract target; each result checked
against an uninterrupted run, the QAT model or NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
pytest.importorskip("safetensors")
pytest.importorskip("orbax.checkpoint")

from host_mesh import host_mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxquant as jq  # noqa: E402
from jaxquant.flax import ActSpec, QuantConfig, nnx_qat, nnx_quantize, quantize_linen  # noqa: E402

X = jnp.sin(jnp.arange(64, dtype=jnp.float32) * 0.37).reshape(8, 8)
Y = jnp.cos(X[:, :3] * 2.0)
EPS = np.finfo(np.float32).eps
W4_ASYM = jq.QuantSpec(dtype=jnp.uint4, symmetric=False, axis=0, block_size=4, packed=True)
RULES = [("mid", None),
         ("head", QuantConfig(weight=W4_ASYM, learn_scale=True)),
         ("fc1", QuantConfig(weight=jq.QuantSpec(dtype=jnp.uint8, symmetric=False),
                             act=ActSpec(), learn_scale=True))]


def _save_load(kind, tmp_path, tree, target):
    """``tree`` saved with jaxquant's safetensors or orbax functions, loaded into ``target``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if kind == "safetensors":
        jq.save_safetensors(tmp_path / "c.safetensors", tree)
        return jq.load_safetensors(tmp_path / "c.safetensors", target)
    jq.save_orbax(tmp_path / "c", tree)
    return jq.load_orbax(tmp_path / "c", target)


def _assert_trees_equal(a, b):
    """Same structure, and every leaf equal bit for bit (dtype included)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        u, v = np.asarray(u), np.asarray(v)
        assert u.dtype == v.dtype and u.shape == v.shape
        np.testing.assert_array_equal(u.reshape(-1).view(np.uint8), v.reshape(-1).view(np.uint8))


# ----------------------------------------------------------------------------- linen


class LinenMLP(nn.Module):
    dtype: jnp.dtype = jnp.float32
    partitioned: bool = False

    @nn.compact
    def __call__(self, x):
        def dense(n, name, names):
            init = nn.initializers.lecun_normal()
            if self.partitioned:
                init = nn.with_partitioning(init, names)
            return nn.Dense(n, name=name, param_dtype=self.dtype, dtype=self.dtype,
                            kernel_init=init)

        x = nn.relu(dense(16, "fc1", (None, "model"))(x))
        x = nn.relu(dense(16, "mid", ("model", None))(x))
        return dense(3, "head", ("model", None))(x)



def _linen_state(qm, key, dtype=None):
    """A fresh train state: the whole variables (``params`` and ``quant``) and adam's state."""
    v = qm.init(key, X if dtype is None else X.astype(dtype))
    with jax.numpy_dtype_promotion("standard"):
        return {"variables": v, "opt": optax.adam(1e-2).init(v)}


def _linen_step(qm, x=X):
    """One jitted adam step on the whole variables, the train state donated."""
    def loss(v):
        return jnp.mean((qm.apply(v, x).astype(jnp.float32) - Y) ** 2)

    def step(state):
        g = jax.grad(loss)(state["variables"])
        with jax.numpy_dtype_promotion("standard"):
            updates, opt = optax.adam(1e-2).update(g, state["opt"], state["variables"])
            return {"variables": optax.apply_updates(state["variables"], updates), "opt": opt}

    return jax.jit(step, donate_argnums=0)


def _run(step, state, n):
    for _ in range(n):
        state = step(state)
    return state


@pytest.fixture(scope="module")
def linen_trained():
    """The QAT model of RULES after 5 steps, and its train state after 3 of them."""
    qm = quantize_linen(LinenMLP(), RULES)
    step = _linen_step(qm)
    at3 = _run(step, jax.jit(lambda: _linen_state(qm, jax.random.key(0)))(), 3)
    at3_copy = jax.tree.map(jnp.copy, at3)  # the next step donates at3
    return qm, step, at3_copy, _run(step, at3, 2)


def test_linen_lsq_train_state_resumes_bit_for_bit(linen_trained, tmp_path):
    # params, learned scales and zero points ("quant") and adam's moments saved after 3
    # steps, restored into the abstract state of a new model instance, trained 2 more
    # steps (the donating jitted step): the state of 5 uninterrupted steps, bit for bit
    _, step, at3, at5 = linen_trained
    assert set(at3["variables"]) == {"params", "quant"}
    assert set(at3["variables"]["quant"]["head"]) == {"kernel_scale", "kernel_zero_point"}
    qm = quantize_linen(LinenMLP(), RULES)
    target = jax.eval_shape(lambda: _linen_state(qm, jax.random.key(7)))
    for kind in ("safetensors", "orbax"):
        back = _save_load(kind, tmp_path / kind, at3, target)
        _assert_trees_equal(back, at3)
        _assert_trees_equal(_run(step, back, 2), at5)
    moved = at5["variables"]["quant"]["head"]["kernel_scale"]
    assert np.abs(np.asarray(moved) - np.asarray(at3["variables"]["quant"]["head"]
                                                 ["kernel_scale"])).max() > 0


def _np_codes(w, scale, zero_point, qmin, qmax, axis=None, block=None):
    """ONNX QuantizeLinear in NumPy: rint(w / s) + zp (half to even), clipped; ``block``
    rows of ``w`` share a scale row (blocked along axis 0), or one scale per column."""
    s, z = np.asarray(scale, np.float32), np.asarray(zero_point, np.float32)
    if block:
        s, z = np.repeat(s, block, axis=0)[:w.shape[0]], np.repeat(z, block, axis=0)[:w.shape[0]]
    q = np.rint(np.asarray(w, np.float32) / s) + z  # float32 / float32: correctly rounded
    return np.clip(q, qmin, qmax)


def _check_learned_qtensor(qt, kernel, scale, zero_point, fmt, block=None):
    """``qt`` holds the learned scale (at least eps), the zero point rounded half to even
    and clipped, and the codes NumPy computes with them."""
    info = jnp.iinfo(fmt)
    np.testing.assert_array_equal(np.asarray(qt.scale), np.maximum(np.asarray(scale), EPS))
    zp = np.clip(np.rint(np.asarray(zero_point)), info.min, info.max)
    np.testing.assert_array_equal(np.asarray(qt.zero_point, np.float32), zp)
    codes = _np_codes(kernel, np.maximum(np.asarray(scale), EPS), zp, info.min, info.max,
                      block=block)
    np.testing.assert_array_equal(np.asarray(jq.unpack(qt).qvalue if qt.packed else qt.qvalue,
                                             np.float32), codes)


def test_linen_deployed_tree_is_the_qat_model_and_survives_a_file(linen_trained, tmp_path):
    qm, _, _, at5 = linen_trained
    v = at5["variables"]
    quant, params = v["quant"], v["params"]
    q = qm.quantize_params(v, X)
    assert set(q) == {"params"}
    _check_learned_qtensor(q["params"]["head"]["kernel"], params["head"]["kernel"],
                           quant["head"]["kernel_scale"], quant["head"]["kernel_zero_point"],
                           jnp.uint4, block=4)
    _check_learned_qtensor(q["params"]["fc1"]["kernel"], params["fc1"]["kernel"],
                           quant["fc1"]["kernel_scale"], quant["fc1"]["kernel_zero_point"],
                           jnp.uint8)
    # the float layer ("mid", None) and every bias: untouched, and in no QTensor
    _assert_trees_equal(q["params"]["mid"], params["mid"])
    for layer in ("fc1", "head"):
        _assert_trees_equal(q["params"][layer]["bias"], params[layer]["bias"])
    assert [type(a) for a in jax.tree.leaves(q["params"]["mid"], is_leaf=jq.is_qtensor)] \
        == [type(params["mid"]["bias"])] * 2
    # W8A8 fc1 (int8 x int8 -> int32, float32 scales) and weight-only uint4 head
    apply = jax.jit(qm.apply)
    y_qat, y_inf = np.asarray(apply(v, X)), np.asarray(apply(q, X))
    np.testing.assert_allclose(y_inf, y_qat, rtol=1e-5, atol=1e-5)
    # the deployed tree through a file into the abstract tree a new process builds
    fresh = quantize_linen(LinenMLP(), RULES)
    target = jax.eval_shape(lambda: fresh.quantize_params(fresh.init(jax.random.key(9), X), X))
    back = _save_load("safetensors", tmp_path, q, target)
    _assert_trees_equal(back, q)
    np.testing.assert_array_equal(np.asarray(jax.jit(fresh.apply)(back, X)), y_inf)


# --------------------------------------------------------------- sharded and boxed trees


def test_linen_partitioned_quantized_tree_round_trips_through_files(tmp_path):
    # quantize_params of a model with nn.with_partitioning kernels gives QTensors whose
    # arrays are nn.Partitioned boxes (each array named for its own axes); saving that
    # tree failed with "AttributeError: 'Partitioned' object has no attribute 'dtype'"
    # and loading into the boxed abstract target of jax.eval_shape failed the same way
    def build(key):
        qm = quantize_linen(LinenMLP(partitioned=True), RULES)
        return qm, jax.jit(qm.init)(key, X)

    qm, v = build(jax.random.key(0))
    q = qm.quantize_params(v, X)
    assert isinstance(q["params"]["head"]["kernel"].scale, nn.Partitioned)
    want = np.asarray(jax.jit(qm.apply)(q, X))
    target = jax.eval_shape(lambda: (lambda m, v: m.quantize_params(v, X))(*build(
        jax.random.key(1))))
    for kind in ("safetensors", "orbax"):
        back = _save_load(kind, tmp_path / kind, q, target)
        specs = lambda t: jax.tree.leaves(nn.get_partition_spec(t))
        assert specs(back) == specs(q) and P("model", None) in specs(q)
        _assert_trees_equal(nn.meta.unbox(back), nn.meta.unbox(q))
        np.testing.assert_array_equal(np.asarray(jax.jit(qm.apply)(back, X)), want)


class NnxMLP(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float32, partitioned=()):
        def linear(name, i, o, names):
            init = nnx.initializers.lecun_normal()
            if name in partitioned:
                init = nnx.with_partitioning(init, names)
            return nnx.Linear(i, o, rngs=rngs, param_dtype=dtype, dtype=dtype,
                              kernel_init=init)

        self.fc1 = linear("fc1", 8, 16, (None, "model"))
        self.mid = linear("mid", 16, 16, ("model", None))
        self.head = linear("head", 16, 3, ("model", None))

    def __call__(self, x):
        return self.head(nnx.relu(self.mid(nnx.relu(self.fc1(x)))))


_nnx_call = nnx.jit(lambda model, x: model(x))


def test_nnx_quantized_model_restores_into_eval_shape_under_a_mesh(tmp_path):
    # Flax's sharded restore: the abstract model from nnx.eval_shape under jax.set_mesh.
    # nnx.eval_shape gave every Variable without a sharding a float ShapeDtypeStruct of its
    # value's shape and dtype: a QTensor kernel (fc1: partitioned, head: not) became a
    # float (in, out) array, so the checkpoint of the quantized model could not be loaded
    # into it ("the target holds an array, the file a QTensor")
    mesh = host_mesh((2, 4), ("data", "model"), jax.sharding.AxisType.Auto)
    make = lambda: nnx_quantize(nnx_qat(NnxMLP(nnx.Rngs(0), partitioned=("fc1", "mid")),
                                        RULES), RULES)
    with jax.set_mesh(mesh):
        model = make()
        want = np.asarray(_nnx_call(model, X))
        graphdef, state = nnx.split(model)
        abstract = nnx.eval_shape(make)
        for layer in (abstract.fc1, abstract.head):
            assert isinstance(layer.kernel.get_raw_value(), jq.QTensor)
        # each array on its own axes' spec, as nnx.get_partition_spec says
        assert abstract.fc1.kernel.get_raw_value().scale.sharding.spec == P("model")
        assert set(abstract.head.kernel.get_raw_value().scale.sharding.spec) <= {None}
        g2, target = nnx.split(abstract)
        back = _save_load("safetensors", tmp_path, state, target)
        _assert_trees_equal(back, state)
        assert back["fc1"]["kernel"][...].scale.sharding.spec == P("model")
        np.testing.assert_array_equal(np.asarray(_nnx_call(nnx.merge(g2, back), X)), want)


def test_nnx_lsq_train_state_resumes_bit_for_bit_and_deploys(tmp_path):
    # nnx_qat with learned scales as nnx.Param, nnx.Optimizer, a donated nnx.jit step:
    # 3 steps, the state of (model, optimizer) saved, merged into the abstract pair of a
    # fresh process, 2 more steps = 5 uninterrupted steps; then nnx_quantize uses the
    # learned scales and zero points, and the float layer stays untouched
    def make():
        model = nnx_qat(NnxMLP(nnx.Rngs(0)), RULES)
        with jax.numpy_dtype_promotion("standard"):
            return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit(donate_argnums=(0, 1))
    def step(model, opt):
        grads = nnx.grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
        with jax.numpy_dtype_promotion("standard"):
            opt.update(model, grads)

    model, opt = make()
    for _ in range(3):
        step(model, opt)
    at3 = jax.tree.map(jnp.copy, nnx.state((model, opt)))
    for _ in range(2):
        step(model, opt)
    graphdef, target = nnx.split(nnx.eval_shape(make))
    back = _save_load("safetensors", tmp_path, at3, target)
    _assert_trees_equal(back, at3)
    model2, opt2 = nnx.merge(graphdef, back)
    for _ in range(2):
        step(model2, opt2)
    _assert_trees_equal(nnx.state((model2, opt2)), nnx.state((model, opt)))

    hook, kernel = model.head.promote_dtype, model.head.kernel[...]
    mid = jax.tree.map(jnp.copy, nnx.state(model.mid))
    y_qat = np.asarray(_nnx_call(model, X))
    nnx_quantize(model, RULES)
    _check_learned_qtensor(model.head.kernel[...], kernel, hook.scale[...],
                           hook.zero_point[...], jnp.uint4, block=4)
    _assert_trees_equal(nnx.state(model.mid), mid)
    np.testing.assert_allclose(np.asarray(_nnx_call(model, X)), y_qat, rtol=1e-5, atol=1e-5)


def test_learned_zero_point_ties_round_as_in_training_bfloat16():
    # learned float zero points on exact ties (k + 0.5) and out of the code range: the
    # conversion rounds them half to even and clips them as the forward pass does, so the
    # weight-only deployed model is the QAT model exactly (bfloat16 params and compute),
    # and the gradients of the loss with respect to the learned scales at init are finite
    # and nonzero
    dtype = jnp.bfloat16
    rules = [("mid", None),
             ("head", QuantConfig(weight=jq.QuantSpec(dtype=jnp.uint4, symmetric=False),
                                  learn_scale=True)),
             ("fc1", QuantConfig(weight=jq.QuantSpec(dtype=jnp.uint8, symmetric=False,
                                                     axis=0), learn_scale=True))]
    qm = quantize_linen(LinenMLP(dtype=dtype), rules)
    x = X.astype(dtype)
    v = jax.jit(qm.init)(jax.random.key(3), x)
    grads = jax.jit(jax.grad(lambda v: jnp.sum(qm.apply(v, x).astype(jnp.float32) ** 2)))(v)
    for layer in ("fc1", "head"):
        g = np.asarray(grads["quant"][layer]["kernel_scale"])
        assert np.isfinite(g).all() and np.abs(g).max() > 0
    quant = jax.tree.map(np.array, v["quant"])
    quant["head"]["kernel_zero_point"] = np.array([2.5, 3.5, -0.5], np.float32)  # -> 2, 4, 0
    quant["head"]["kernel_scale"] *= np.float32(0.75)  # some weights clip
    quant["fc1"]["kernel_zero_point"] = np.array([-1.5, 0.5, 1.5, 254.5, 255.5, 127.5,
                                                  300.0, 6.5], np.float32)
    v = {"params": v["params"], "quant": quant}
    q = qm.quantize_params(v, x)
    params = v["params"]
    _check_learned_qtensor(q["params"]["head"]["kernel"], params["head"]["kernel"],
                           quant["head"]["kernel_scale"], quant["head"]["kernel_zero_point"],
                           jnp.uint4)
    fc1 = q["params"]["fc1"]["kernel"]
    _check_learned_qtensor(jq.QTensor(fc1.qvalue.T, fc1.scale, fc1.zero_point, axis=1),
                           params["fc1"]["kernel"].T, quant["fc1"]["kernel_scale"],
                           quant["fc1"]["kernel_zero_point"], jnp.uint8)
    np.testing.assert_array_equal(np.asarray(fc1.zero_point)[:6], [0, 0, 2, 254, 255, 128])
    apply = jax.jit(qm.apply)
    y_qat, y_inf = apply(v, x), apply(q, x)
    assert y_inf.dtype == dtype
    np.testing.assert_array_equal(np.asarray(y_inf, np.float32), np.asarray(y_qat, np.float32))
