"""Adversarial checkpoint cases beyond tests/test_checkpoint.py: sharded sub-byte codes, and
clear errors for damaged or malformed headers, missing tensors, unsaveable leaves, bad paths
and targets whose QTensor metadata or paths do not fit."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from host_mesh import host_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant._checkpoint import load_orbax, load_safetensors, save_orbax, save_safetensors
from jaxquant._serialization import encode, header_metadata


def _bits(tree):
    return [(np.dtype(x.dtype), x.shape, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("save, load", [(save_safetensors, load_safetensors),
                                        (save_orbax, load_orbax)])
def test_sharded_sub_byte_codes_save_and_load_back(tmp_path, save, load):
    """Codes and per-channel scales / zero points sharded consistently over 8 devices, one
    code per device along the packed axis (a shard holds part of a byte): they save, and the
    sharded target gets them back bit for bit on its shardings, empty codes included."""
    mesh = host_mesh((8,), ("x",))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    tree = {"u4": jq.quantize(x, dtype=jnp.uint4, axis=1, symmetric=False),
            "i2": jq.quantize(x, dtype=jnp.int2, axis=1),
            "f6": jq.QTensor(jnp.arange(32, dtype=jnp.uint8).reshape(4, 8), jnp.float32(0.5),
                             codebook="float6_e2m3fn"),
            "empty": jq.quantize(jnp.ones((8, 0)), dtype=jnp.uint4, axis=0, symmetric=False)}
    spec = {2: P(None, "x"), 1: P("x"), 0: P()}
    sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec[a.ndim])), tree)
    sharded["empty"] = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P("x"))),
                                    tree["empty"])
    save(tmp_path / "a", sharded)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          sharded)
    back = load(tmp_path / "a", target)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(target), strict=True):
        assert got.sharding == want.sharding
    save(tmp_path / "b", back)  # what a sharded load gives saves again
    assert _bits(load(tmp_path / "b")) == _bits(tree)
    filled = ("u4", "i2", "f6")  # (NumPy cannot read jit's sharded empty arrays: jax's bug)
    assert _bits([back[k] for k in filled]) == _bits([tree[k] for k in filled])


def test_damaged_version_key_is_a_corrupted_header_not_an_unknown_version(tmp_path):
    """A flipped bit in the key "version" drops the version: the header's CRC-32 fails, which
    says more than 'unknown version None; a newer file needs a newer jaxquant'."""
    path = tmp_path / "m.safetensors"
    save_safetensors(path, {"w": jnp.ones(2)})
    raw = path.read_bytes()
    assert raw.count(b'\\"version\\"') == 1
    path.write_bytes(raw.replace(b'\\"version\\"', b'\\"versiom\\"'))
    with pytest.raises(ValueError, match="corrupted jaxquant metadata: its CRC-32 is"):
        load_safetensors(path)


@pytest.mark.parametrize("key, field, value, message", [
    ("w/qvalue", "axis", True, "packed axis True is out of range for shape"),
    ("w/qvalue", "axis", -1, r"packed axis -1 is out of range for shape \[3, 8\]"),
    ("w/qvalue", "axis", 2, r"packed axis 2 is out of range for shape \[3, 8\]"),
    ("w/qvalue", "dtype", "object", "no 'packed' storage for dtype object"),
    ("b", "shape", [4.5], r"shape \[4.5\] is not a list of non-negative integers"),
])
def test_tensor_entry_that_encode_never_writes_is_malformed(tmp_path, key, field, value,
                                                           message):
    """Under a valid CRC-32 (a header edited and re-checksummed), a tensor entry with a packed
    axis out of range or 6-bit codes of a non-integer dtype (they failed deep inside the decoder)
    or a fractional dimension (truncated to an integer, it loaded) is a malformed header."""
    tree = {"w": jq.QTensor(jnp.arange(24, dtype=jnp.uint8).reshape(3, 8) % 64,
                            jnp.float32(0.5), codebook="float6_e2m3fn"),
            "b": jnp.arange(4, dtype=jnp.uint8)}
    header, tensors = encode(tree, to_host=True)
    header["tensors"][key][field] = value
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file(tensors, path, metadata=header_metadata(header, None))
    with pytest.raises(ValueError, match=f"m.safetensors: malformed jaxquant header: {message}"):
        load_safetensors(path)


@pytest.mark.parametrize("leaf, message", [
    (jax.random.key(0), r"'state/rng': cannot store a PRNG key array \(key<fry>\); save "
                        r"jax.random.key_data"),
    (np.ones(2, np.complex128), "'state/rng': cannot store dtype complex128: no safetensors "
                                "dtype of its width"),
    (jax.ShapeDtypeStruct((2,), jnp.float32), "'state/rng': only concrete arrays can be saved"),
])
def test_unsaveable_leaf_is_named(tmp_path, leaf, message):
    with pytest.raises(TypeError, match=message):
        save_safetensors(tmp_path / "m.safetensors", {"state": {"rng": leaf}})
    assert not (tmp_path / "m.safetensors").exists()


def test_loading_a_directory_or_saving_into_a_missing_one_names_it(tmp_path):
    save_orbax(tmp_path / "ckpt", {"w": jnp.ones(2)})
    with pytest.raises(IsADirectoryError, match="ckpt: is a directory, not a safetensors file "
                                                r"\(load_orbax reads"):
        load_safetensors(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match="nodir/m.safetensors: no directory .*nodir' to "
                                                "write the file into"):
        save_safetensors(tmp_path / "nodir" / "m.safetensors", {"w": jnp.ones(2)})


def test_target_with_two_leaves_at_one_path_names_the_path(tmp_path):
    save_safetensors(tmp_path / "m.safetensors", {"a": {"b": jnp.ones(2)}})
    leaf = jax.ShapeDtypeStruct((2,), jnp.float32)
    with pytest.raises(ValueError, match="the target has two leaves with the same path 'a/b'; "
                                         "rename one of the keys"):
        load_safetensors(tmp_path / "m.safetensors", {"a/b": leaf, "a": {"b": leaf}})


@pytest.mark.parametrize("name", ["w/qvalue", "w/scale", "w/zero_point"])
def test_tensor_of_the_header_missing_from_the_file(tmp_path, name):
    tree = {"w": jq.quantize(jnp.arange(8.0).reshape(2, 4), dtype=jnp.uint4, axis=1,
                             symmetric=False)}
    header, tensors = encode(tree, to_host=True)
    path = tmp_path / "m.safetensors"
    safetensors.numpy.save_file({k: v for k, v in tensors.items() if k != name}, path,
                                metadata=header_metadata(header, None))
    with pytest.raises(ValueError, match=f"tensor '{name}' of the header is missing from the "
                                         f"file: corrupted or edited file"):
        load_safetensors(path)


_X = jnp.linspace(-1.0, 1.0, 64).reshape(2, 32)


def _bf16_global_scale(qt):
    """``qt`` (two-level scales) with its per-tensor scale of the block scales in bfloat16."""
    inner = qt.scale
    inner = jq.QTensor(inner.qvalue, inner.scale.astype(jnp.bfloat16), axis=inner.axis,
                       block_size=inner.block_size, dtype=inner.dtype)
    return jq.QTensor(qt.qvalue, inner, axis=qt.axis, block_size=qt.block_size, dtype=qt.dtype)


@pytest.mark.parametrize("key, leaf, error, message", [
    ("w", lambda: jq.quantize(_X, dtype=jnp.int4, axis=1, block_size=8), ValueError,
     "'w': QTensor block_size mismatch: the target expects 8, the file holds 16"),
    ("w", lambda: jq.quantize(_X.astype(jnp.bfloat16), dtype=jnp.int4, axis=1, block_size=16),
     TypeError, "'w': QTensor dtype mismatch: the target expects bfloat16, the file holds "
                "float32"),
    ("w", lambda: jq.quantize(_X, dtype=jnp.int4, axis=1, block_size=16,
                              scale_dtype=jnp.bfloat16),
     TypeError, "'w/scale': dtype mismatch: the target expects bfloat16, the file holds float32"),
    ("c", lambda: jq.quantize(_X, dtype="fp4", axis=0), ValueError,
     "'c': QTensor codebook mismatch: the target expects 'fp4', the file holds 'nf4'"),
    ("n", lambda: jq.quantize(_X, dtype=jnp.float4_e2m1fn, axis=1, block_size=16), TypeError,
     "'n': the target has an array scale, the file a QTensor scale"),
    ("n", lambda: _bf16_global_scale(jq.quantize(_X, dtype="nvfp4")), TypeError,
     "'n/scale/scale': dtype mismatch: the target expects bfloat16, the file holds float32"),
])
def test_target_qtensor_metadata_mismatch_names_both_sides(tmp_path, key, leaf, error, message):
    """Block size, dtype, scale dtype, codebook and a two-level scale are checked against the
    target (its nested scale too) before any data is read."""
    tree = {"w": jq.quantize(_X, dtype=jnp.int4, axis=1, block_size=16),
            "n": jq.quantize(_X, dtype="nvfp4"), "c": jq.quantize(_X, dtype="nf4", axis=0)}
    save_safetensors(tmp_path / "m.safetensors", tree)
    target = jax.eval_shape(lambda: tree)
    target[key] = jax.eval_shape(leaf)
    with pytest.raises(error, match=message):
        load_safetensors(tmp_path / "m.safetensors", target)


def test_save_orbax_refuses_an_existing_directory_before_encoding(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        save_orbax(tmp_path / "ckpt", {"w": "not an array"})  # encoding would raise TypeError
    assert not any((tmp_path / "ckpt").iterdir())


def test_threads_saving_the_same_file_do_not_collide(tmp_path):
    """Each writer has its own temporary file: every save succeeds, the file is one of them."""
    import concurrent.futures

    trees = [{"w": jq.quantize(jnp.full((64, 64), i + 1.0), dtype=jnp.int8)} for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: save_safetensors(tmp_path / "m.safetensors", t), trees * 4))
    back = load_safetensors(tmp_path / "m.safetensors")
    assert any(_bits(back) == _bits(t) for t in trees)
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"]


def test_a_dtype_jax_cannot_hold_is_refused_at_save(tmp_path):
    """A NumPy float6 array would save but never load: refused up front, nothing written."""
    import ml_dtypes

    leaf = np.zeros(4, ml_dtypes.float6_e2m3fn)
    with pytest.raises(TypeError, match="'w'.*float6_e2m3fn.*JAX has no arrays"):
        save_safetensors(tmp_path / "a.safetensors", {"w": leaf})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("fn", [save_safetensors, save_orbax, load_safetensors, load_orbax])
@pytest.mark.parametrize("bad", [None, 3])
def test_a_path_that_is_not_a_path_is_a_type_error_naming_it(fn, bad):
    argname = "directory" if "orbax" in fn.__name__ else "path"
    args = (bad, {"w": jnp.ones(2)}) if fn.__name__.startswith("save") else (bad,)
    with pytest.raises(TypeError, match=rf"^{argname} must be a str or os.PathLike, got "
                                        rf"{type(bad).__name__}\.$"):
        fn(*args)


@pytest.mark.parametrize("fn", [save_safetensors, save_orbax, load_safetensors, load_orbax])
def test_an_empty_path_is_a_value_error_naming_it(fn, tmp_path, monkeypatch):
    # before: save_safetensors("") wrote its temporary file next to the working directory
    # and failed renaming it to "" (FileNotFoundError)
    monkeypatch.chdir(tmp_path)
    argname = "directory" if "orbax" in fn.__name__ else "path"
    args = ("", {"w": jnp.ones(2)}) if fn.__name__.startswith("save") else ("",)
    with pytest.raises(ValueError, match=rf"^{argname} must name a file or directory, got an "
                                         rf"empty string\.$"):
        fn(*args)
    assert not any(tmp_path.iterdir()) and not any(
        p.name.startswith(".jaxquant-") for p in tmp_path.parent.iterdir())


def test_a_bytes_path_is_a_path(tmp_path):
    path = bytes(tmp_path / "w.safetensors")
    save_safetensors(path, {"w": jnp.arange(3.0)})
    np.testing.assert_array_equal(load_safetensors(path)["w"], np.arange(3.0))


def test_save_safetensors_onto_a_directory_and_load_orbax_of_a_file_say_so(tmp_path):
    # Before: an IsADirectoryError naming the temporary file, and "no such directory".
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError, match=r"d: is a directory; save_safetensors writes a "
                                                r"file \(save_orbax writes"):
        save_safetensors(tmp_path / "d", {"w": jnp.ones(2)})
    assert list((tmp_path / "d").iterdir()) == [] and sorted(tmp_path.iterdir()) == [
        tmp_path / "d"]
    save_safetensors(tmp_path / "f", {"w": jnp.ones(2)})
    with pytest.raises(NotADirectoryError, match=r"f: is a file, not an orbax checkpoint "
                                                 r"directory \(load_safetensors reads"):
        load_orbax(tmp_path / "f")


@pytest.mark.parametrize("kw", [dict(dtype=jnp.int4), dict(dtype=jnp.uint4, axis=0, symmetric=False),
                                dict(dtype="float6_e2m3fn", axis=1), dict(dtype=jnp.int2, axis=1)])
def test_nbytes_is_what_the_file_stores_packed_or_not(tmp_path, kw):
    """Unpacked int4 codes of shape (3, 5) counted 8 bytes (rounded once over the array); the
    file, like jq.pack, stores them per row: 9."""
    qt = jq.quantize(jnp.linspace(-1.0, 1.0, 15).reshape(3, 5), **kw)
    assert qt.nbytes == jq.pack(qt).nbytes
    save_safetensors(tmp_path / "q", {"q": qt})
    with open(tmp_path / "q", "rb") as f:
        stored = {k: v for k, v in safetensors.deserialize(f.read())}
    assert sum(len(v["data"]) for v in stored.values()) == qt.nbytes


def test_stacked_float6_layers_load_back(tmp_path):
    """The constructor's check of float6 codes read placeholders' values: loading a stack of
    float6 layers (each layer checked on ShapeDtypeStructs) failed."""
    w = jnp.linspace(-3.0, 3.0, 180).reshape(3, 6, 10)
    stack = jax.vmap(lambda a: jq.quantize(a, dtype="float6_e2m3fn"))(w)
    for save, load in [(save_safetensors, load_safetensors), (save_orbax, load_orbax)]:
        save(tmp_path / save.__name__, {"w": stack})
        back = load(tmp_path / save.__name__)["w"]
        np.testing.assert_array_equal(back.qvalue, stack.qvalue)
    abstract = jq.QTensor(jax.ShapeDtypeStruct((4, 8), jnp.uint8),
                          jax.ShapeDtypeStruct((), jnp.float32), codebook="float6_e2m3fn")
    assert abstract.shape == (4, 8)


def test_saving_onto_a_symbolic_link_writes_the_file_it_names(tmp_path):
    # before: os.replace put a regular file in place of the link ("latest" -> a step's
    # file), the file it named kept the old checkpoint; the CLI already followed links
    runs = tmp_path / "runs"
    runs.mkdir()
    save_safetensors(runs / "step-100.safetensors", {"w": jnp.zeros(4)})
    link = tmp_path / "latest.safetensors"
    link.symlink_to(os.path.join("runs", "step-100.safetensors"))  # relative, as `ln -s`
    new = {"w": jq.quantize(jnp.arange(4.0), dtype=jnp.int4)}
    save_safetensors(link, new)
    assert link.is_symlink() and sorted(os.listdir(runs)) == ["step-100.safetensors"]
    back = load_safetensors(runs / "step-100.safetensors", new)
    np.testing.assert_array_equal(np.asarray(back["w"].dequantize()),
                                  np.asarray(new["w"].dequantize()))
