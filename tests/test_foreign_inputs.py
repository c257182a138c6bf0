"""Arrays of other libraries (a PyTorch ``state_dict``) as inputs: converted as `jnp.asarray`
converts them (bfloat16 through DLPack), with the same codes as their NumPy values; objects that
only look like arrays are refused naming the argument."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxquant as jq

torch = pytest.importorskip("torch")


def _numpy(t):
    return t.float().numpy().astype(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 \
        else t.numpy()


def test_quantize_and_fake_quant_take_torch_tensors():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    for t in (w, w.to(torch.bfloat16), w.to(torch.float16)):
        want = jq.quantize(_numpy(t), axis=0)
        got = jq.quantize(t, axis=0)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.qvalue, want.qvalue)
        np.testing.assert_array_equal(jq.fake_quant(t, axis=0), jq.fake_quant(_numpy(t), axis=0))


def test_quantize_tree_and_report_of_a_torch_state_dict():
    g = torch.Generator().manual_seed(1)
    state = {"fc.weight": torch.randn(8, 16, generator=g), "fc.bias": torch.randn(8, generator=g),
             "emb.weight": torch.randn(4, 16, generator=g).to(torch.bfloat16),
             "pos_ids": torch.arange(6).reshape(2, 3)}
    numpy_state = {k: _numpy(v) for k, v in state.items()}
    q, want = jq.quantize_tree(state), jq.quantize_tree(numpy_state)
    assert sorted(k for k, v in q.items() if jq.is_qtensor(v)) == ["emb.weight", "fc.weight"]
    for k in ("emb.weight", "fc.weight"):
        assert q[k].dtype == want[k].dtype
        np.testing.assert_array_equal(q[k].qvalue, want[k].qvalue)
    assert q["pos_ids"] is state["pos_ids"]  # kept as it was
    assert jq.tree_nbytes(state) == jq.tree_nbytes(numpy_state)
    rows = {r.path: r for r in jq.quantization_report(state, q)}
    want_rows = {r.path: r for r in jq.quantization_report(numpy_state, want)}
    assert rows == want_rows


class _HasDtype:
    dtype = np.dtype(np.float32)


@pytest.mark.parametrize("x", [_HasDtype(), jax.ShapeDtypeStruct((2, 2), jnp.float32)],
                         ids=["object with a dtype", "ShapeDtypeStruct"])
def test_objects_that_only_have_a_dtype_are_refused_naming_x(x):
    with pytest.raises(TypeError, match=rf"^x must be an array, got {type(x).__name__}"):
        jq.quantize(x)
    with pytest.raises(TypeError, match=rf"^x must be an array, got {type(x).__name__}"):
        jq.fake_quant(x)


@pytest.mark.parametrize("save, load", [(jq.save_safetensors, jq.load_safetensors),
                                        (jq.save_orbax, jq.load_orbax)])
def test_a_quantized_state_dict_with_torch_leaves_left_float_is_saved(tmp_path, save, load):
    """quantize_tree keeps unmatched torch tensors; saving them said "only concrete arrays
    can be saved, got Tensor"."""
    if save is jq.save_orbax:
        pytest.importorskip("orbax.checkpoint")
    g = torch.Generator().manual_seed(2)
    state = {"fc.weight": torch.randn(8, 16, generator=g), "fc.bias": torch.randn(8, generator=g),
             "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16)}
    q = jq.quantize_tree(state)
    assert isinstance(q["fc.bias"], torch.Tensor)
    save(tmp_path / "m", q)
    back = load(tmp_path / "m")
    np.testing.assert_array_equal(back["fc.bias"], state["fc.bias"].numpy())
    np.testing.assert_array_equal(back["norm.weight"], _numpy(state["norm.weight"]))
    np.testing.assert_array_equal(back["fc.weight"].qvalue, q["fc.weight"].qvalue)


@pytest.mark.parametrize("save, load", [(jq.save_safetensors, jq.load_safetensors),
                                        (jq.save_orbax, jq.load_orbax)])
def test_64_bit_torch_leaves_are_saved_at_their_own_width(tmp_path, save, load):
    """int64 / float64 torch tensors went through jnp.asarray, which (x64 disabled) narrowed
    them to 32 bits: 2**40 was stored as 0. NumPy arrays of the same values were exact."""
    if save is jq.save_orbax:
        pytest.importorskip("orbax.checkpoint")
    state = {"ids": torch.tensor([2**40, -1, 7]), "f64": torch.tensor([1 + 2**-40], dtype=torch.float64),
             "half": torch.tensor([0.1], dtype=torch.bfloat16)}
    save(tmp_path / "m", state)
    back = load(tmp_path / "m")
    for name in ("ids", "f64"):
        assert np.dtype(back[name].dtype) == state[name].numpy().dtype
        np.testing.assert_array_equal(np.asarray(back[name]), state[name].numpy())
    np.testing.assert_array_equal(back["half"], _numpy(state["half"]))


def test_parameters_and_quantized_torch_leaves():
    param = torch.nn.Parameter(torch.randn(4, 8))
    with pytest.raises(TypeError, match=r"(?s)^x must be an array, got Parameter .*detach"):
        jq.quantize(param)
    np.testing.assert_array_equal(jq.quantize(param.detach()).qvalue,
                                  jq.quantize(param.detach().numpy()).qvalue)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates its quantized tensors
        qint = torch.quantize_per_tensor(torch.randn(4, 8), 0.1, 0, torch.quint8)
    tree = jq.quantize_tree({"w": torch.randn(4, 8), "q": qint})
    assert tree["q"] is qint and jq.is_qtensor(tree["w"])  # kept: no NumPy or JAX dtype
    with pytest.raises(TypeError, match=r"^leaf 'q': a leaf of dtype torch\.quint8 has no NumPy"):
        jq.tree_nbytes({"q": qint})
