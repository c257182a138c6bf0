"""Checkpoints: safetensors and orbax round trips, corruption, targets, shardings."""

import dataclasses
import json
import os
import re
import shutil
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from host_mesh import cpu_normal, host_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxquant as jq
from jaxquant._checkpoint import load_safetensors, save_safetensors
from jaxquant._serialization import FORMAT_VERSION, encode, header_metadata

SUBBYTE = ("int2", "uint2", "int4", "uint4", "float4_e2m1fn")


# --- trees ----------------------------------------------------------------------------


def _codes(rng, fmt: jq.Format, shape):
    """Random codes over the whole format: every bit pattern (NaN, inf, -0) for floats."""
    if fmt.is_integer:
        codes = rng.integers(fmt.qmin, fmt.qmax + 1, size=shape).astype(fmt.dtype)
    elif fmt.bits == 4:
        codes = rng.integers(0, 16, size=shape).astype(ml_dtypes.uint4).view(fmt.dtype)
    else:
        codes = np.frombuffer(rng.bytes(int(np.prod(shape))), fmt.dtype).reshape(shape)
    return jax.device_put(codes)  # no compile, unlike jnp.asarray


_pack_codes = jax.jit(jq.pack, static_argnums=1)  # one compile per dtype and axis


def _qtensor(rng, fmt, shape, axis, block_size, zero_point, scale_dtype=np.float32):
    if block_size:
        sshape = list(shape)
        sshape[axis] = -(-shape[axis] // block_size)
    else:
        sshape = [] if axis is None else [shape[axis]]
    scale = jax.device_put(rng.uniform(0.01, 2, size=sshape).astype(scale_dtype))
    zp = None
    if zero_point:
        zp = (_codes(rng, fmt, sshape) if fmt.is_integer
              else jnp.zeros(sshape, fmt.dtype))
    return jq.QTensor(_codes(rng, fmt, shape), scale, zp, axis=axis, block_size=block_size,
                      dtype=scale_dtype)


def _every_format_tree():
    """Every format x per-tensor / per-axis / blocked x zero point or not, packed too."""
    rng = np.random.default_rng(0)
    tree = {}
    for name, fmt in jq.FORMATS.items():
        # 5 x 7: odd lengths leave a partial packed byte and a partial last block.
        for gran, axis, block in (("tensor", None, None), ("axis", 1, None), ("block", 1, 3)):
            for zp in (False, True):
                qt = _qtensor(rng, fmt, (5, 7), axis, block, zp)
                tree.setdefault(name, {})[f"{gran}_zp{int(zp)}"] = qt
                if name in SUBBYTE:
                    for suffix, axis in (("packed", -1), ("packed0", 0)):
                        packed = dataclasses.replace(qt, qvalue=_pack_codes(qt.qvalue, axis))
                        tree[name][f"{gran}_zp{int(zp)}_{suffix}"] = packed
    tree["bf16_scales"] = _qtensor(rng, jq.FORMATS["int8"], (4, 6), 0, None, True,
                                   scale_dtype=ml_dtypes.bfloat16)
    tree["scalar_int4"] = _qtensor(rng, jq.FORMATS["int4"], (), None, None, True)
    tree["plain"] = {
        "f32": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
        "bf16": jnp.asarray(rng.standard_normal((4,)), jnp.bfloat16),
        "f16": jnp.asarray(np.array([1.5, -0.0, np.inf], np.float16)),
        "int32": jnp.arange(-3, 3, dtype=jnp.int32),
        "uint8": jnp.arange(7, dtype=jnp.uint8),
        "bool": jnp.array([True, False, True]),
        "scalar": jnp.float32(2.5),
        "empty": jnp.zeros((0, 3), jnp.float32),
        "int4": _codes(rng, jq.FORMATS["int4"], (3, 5)),
        "uint2_scalar": jnp.asarray(np.array(3, ml_dtypes.uint2)),
        "float8_e4m3fn": _codes(rng, jq.FORMATS["float8_e4m3fn"], (6,)),
        "float8_e3m4": jnp.asarray(np.frombuffer(rng.bytes(4), ml_dtypes.float8_e3m4)),
        "packed_uint4": _pack_codes(_codes(rng, jq.FORMATS["uint4"], (2, 9)), -1),
    }
    return tree


def _model_tree():
    """A realistic parameter tree quantized by path rules."""
    rng = np.random.default_rng(1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))
    params = {"params": {
        "embed": {"embedding": f(32, 16).astype(jnp.bfloat16)},
        "layers_0": {"attn": {"kernel": f(16, 48), "bias": f(48)},
                     "mlp": {"kernel": f(16, 64), "bias": f(64).astype(jnp.bfloat16)}},
        "head": {"kernel": f(64, 8)},
        "norm": {"scale": jnp.ones(16, jnp.float32)},
    }, "step": jnp.array(1000, jnp.int32)}
    rules = [("attn/kernel", jq.QuantSpec(dtype=jnp.int8)),
             ("mlp/kernel", jq.QuantSpec(dtype=jnp.int4, block_size=8, packed=True)),
             ("head/kernel", jq.QuantSpec(dtype=jnp.uint4, symmetric=False, axis=None)),
             ("embed", jq.QuantSpec(dtype=jnp.float8_e4m3fn, axis=0))]
    return params, rules, jq.quantize_tree(params, rules)


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


def assert_identical(a, b):
    """Same structure (QTensor metadata and packing included), types, dtypes, shapes, bits."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert isinstance(y, jax.Array) == isinstance(x, jax.Array)
        assert (np.dtype(y.dtype), y.shape) == (np.dtype(x.dtype), x.shape)
        assert _bits(y) == _bits(x)
    for x, y in zip(jax.tree.leaves(a, is_leaf=jq.is_qtensor),
                    jax.tree.leaves(b, is_leaf=jq.is_qtensor), strict=True):
        assert type(x) is type(y)
        if jq.is_qtensor(x):
            assert (y.axis, y.block_size, y.dtype, y.packed) == \
                (x.axis, x.block_size, x.dtype, x.packed)
            assert repr(y) == repr(x)


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "model.safetensors")


# --- round trips ----------------------------------------------------------------------


def test_every_format_round_trips_bit_exact(path):
    tree = _every_format_tree()
    save_safetensors(path, tree, metadata={"model": "test"})
    back = load_safetensors(path)
    assert_identical(tree, back)
    assert back["int4"]["axis_zp1"].qvalue.dtype == jnp.int4 and not back["int4"]["axis_zp1"].packed
    assert back["int4"]["axis_zp1_packed0"].qvalue.axis == 0
    with safetensors.safe_open(path, framework="np") as f:
        assert f.metadata()["model"] == "test"


def test_model_tree_round_trips_and_dequantizes_identically(path):
    _, _, q = _model_tree()
    save_safetensors(path, q)
    back = load_safetensors(path)
    assert_identical(q, back)
    for x, y in zip(jax.tree.leaves(jq.dequantize_tree(q)),
                    jax.tree.leaves(jq.dequantize_tree(back)), strict=True):
        assert _bits(x) == _bits(y)


def test_file_is_self_describing(path):
    _, _, q = _model_tree()
    save_safetensors(path, q)
    with safetensors.safe_open(path, framework="np") as f:
        header = json.loads(f.metadata()["jaxquant"])
        stored = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    assert header["format"] == "jaxquant.checkpoint" and header["version"] == FORMAT_VERSION
    assert header["leaves"]["params/layers_0/mlp/kernel"] == {
        "kind": "qtensor", "axis": 1, "block_size": 8, "dtype": "float32", "packed": True,
        "zero_point": False}
    assert header["leaves"]["step"] == {"kind": "array"}
    spec = header["tensors"]["params/layers_0/mlp/kernel/qvalue"]
    assert {k: spec[k] for k in ("dtype", "shape", "encoding", "axis")} == \
        {"dtype": "int4", "shape": [16, 64], "encoding": "packed", "axis": 1}
    assert stored["params/layers_0/mlp/kernel/qvalue"] == ("U8", [16, 32])
    assert stored["params/embed/embedding/qvalue"] == ("F8_E4M3", [32, 16])
    assert stored["params/head/kernel/zero_point"] == ("U8", [1])  # uint4 zero point: packed
    assert stored["params/embed/embedding/scale"] == ("F32", [32])
    assert header["leaves"]["params/embed/embedding"]["dtype"] == "bfloat16"
    assert set(stored) == set(header["tensors"])


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0,), ()])
def test_empty_and_scalar_float6_codes_round_trip(path, shape):
    """float6 codes are stored four per three bytes; an empty or 0-d array has nothing to pack."""
    codes = np.arange(int(np.prod(shape)), dtype=np.uint8).reshape(shape) % 64
    tree = {"w": jq.QTensor(jnp.asarray(codes), jnp.float32(0.5), codebook="float6_e2m3fn")}
    save_safetensors(path, tree)
    with safetensors.safe_open(path, framework="np") as f:
        stored = f.get_tensor("w/qvalue")
    assert stored.dtype == np.uint8 and stored.size == 0 if codes.size == 0 else stored.size == 1
    back = load_safetensors(path)
    assert back["w"].codebook == "float6_e2m3fn" and back["w"].shape == shape
    assert np.asarray(back["w"].qvalue).tobytes() == codes.tobytes()
    assert_identical(tree, load_safetensors(path, jax.eval_shape(lambda: tree)))


def test_int4_is_stored_at_half_a_byte_per_code(tmp_path):
    def data_bytes(tree, name):
        p = str(tmp_path / name)
        save_safetensors(p, tree)
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        return os.path.getsize(p) - 8 - n

    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 256)), jnp.float32)
    int4 = data_bytes({"w": jq.quantize(x, dtype=jnp.int4)}, "a")
    int8 = data_bytes({"w": jq.quantize(x, dtype=jnp.int8)}, "b")
    assert int4 == 256 * 256 // 2 + 4  # codes + one float32 scale
    assert int8 == 256 * 256 + 4
    assert data_bytes({"w": jq.quantize(x, dtype=jnp.int2)}, "c") == 256 * 256 // 4 + 4


def test_unpacked_codes_are_packed_on_save_and_come_back_unpacked(path):
    qt = jq.quantize(jnp.linspace(-1, 1, 15).reshape(3, 5), dtype=jnp.int4, axis=0)
    save_safetensors(path, {"w": qt})
    with safetensors.safe_open(path, framework="np") as f:
        stored = f.get_tensor("w/qvalue")
    assert stored.dtype == np.uint8 and stored.shape == (3, 3)
    assert _bits(stored) == _bits(jq.pack_bits(qt.qvalue))
    back = load_safetensors(path)["w"]
    assert not back.packed and back.qvalue.dtype == jnp.int4
    assert _bits(back.qvalue) == _bits(qt.qvalue)


def test_int64_leaf_without_x64_stays_exact_numpy(path):
    tree = {"ids": np.array([2**40, -1], np.int64), "f": np.arange(3.0)}
    save_safetensors(path, tree)
    back = load_safetensors(path)
    assert isinstance(back["ids"], np.ndarray) and back["ids"].dtype == np.int64
    assert back["ids"].tolist() == [2**40, -1]
    assert back["f"].dtype == np.float64 and back["f"].tolist() == [0.0, 1.0, 2.0]


def test_bare_leaf_and_empty_tree(tmp_path):
    qt = jq.quantize(jnp.ones((2, 4)), dtype=jnp.uint2, symmetric=False)
    save_safetensors(tmp_path / "a", qt)
    assert_identical(qt, load_safetensors(tmp_path / "a"))
    save_safetensors(tmp_path / "b", {})
    assert load_safetensors(tmp_path / "b") == {}


# --- corrupted files ------------------------------------------------------------------


def _small_file(path):
    rng = np.random.default_rng(2)
    tree = {"w": _qtensor(rng, jq.FORMATS["int4"], (3, 5), 1, None, True),
            "b": jnp.asarray([1.0, -2.0], jnp.bfloat16)}
    save_safetensors(path, tree, metadata={"note": "x"})
    with open(path, "rb") as f:
        return tree, f.read()


@pytest.mark.parametrize("keep", [0, 5, 8, 40, -1, -7])
def test_truncated_file_raises(path, keep):
    _, raw = _small_file(path)
    with open(path, "wb") as f:
        f.write(raw[:keep] if keep >= 0 else raw[:len(raw) + keep])
    with pytest.raises(ValueError, match="not a valid safetensors file .truncated or corrupted"):
        load_safetensors(path)


def test_flipped_byte_in_data_area_fails_the_checksum(path):
    _, raw = _small_file(path)
    b = bytearray(raw)
    b[-1] ^= 0x10  # the last tensor's last byte
    with open(path, "wb") as f:
        f.write(b)
    with pytest.raises(ValueError, match=r"checksum mismatch in tensor '(b|w/.*)'.*corrupted"):
        load_safetensors(path)


def test_corrupted_header_raises(path):
    _, raw = _small_file(path)
    pos = raw.index(b'axis\\":1') + len(b'axis\\":')  # the QTensor's axis, in the JSON string
    b = bytearray(raw)
    b[pos] = ord("0")
    with open(path, "wb") as f:
        f.write(b)
    with pytest.raises(ValueError, match="corrupted jaxquant metadata: its CRC-32"):
        load_safetensors(path)


def _flips_that_load(path, raw: bytes, odd_mask: int, even_mask: int, **load_kw) -> list:
    """The positions where a flipped bit (``odd_mask`` at odd positions, ``even_mask`` at
    even ones) still loads as a tree."""
    silent = []
    for pos in range(len(raw)):
        b = bytearray(raw)
        b[pos] ^= odd_mask if pos % 2 else even_mask
        with open(path, "wb") as f:
            f.write(b)
        try:
            load_safetensors(path, **load_kw)
        except (ValueError, TypeError):
            continue
        silent.append(pos)
    return silent


def test_every_single_byte_flip_is_detected(path):
    """No flipped bit anywhere in the file (header or data) yields a tree."""
    _, raw = _small_file(path)
    assert _flips_that_load(path, raw, 0x01, 0x80) == []


def test_every_single_byte_flip_is_detected_with_allow_plain(path):
    """allow_plain reads files without jaxquant's metadata, not jaxquant files whose header
    key was damaged: a flipped bit in the key "jaxquant" is a corrupted file, not a plain one."""
    _, raw = _small_file(path)
    assert _flips_that_load(path, raw, 0x01, 0x02, allow_plain=True) == []
    b = bytearray(raw)
    key = raw.index(b'"jaxquant":') + 1
    b[key] = ord("J")
    with open(path, "wb") as f:
        f.write(b)
    with pytest.raises(ValueError, match="corrupted jaxquant metadata: a 'jaxquant.crc32' "
                                         "checksum but no 'jaxquant' header"):
        load_safetensors(path, allow_plain=True)


def test_unknown_version_and_foreign_files(path):
    header, tensors = encode({"w": jnp.ones(2)}, to_host=True)
    safetensors.numpy.save_file(tensors, path,
                                metadata=header_metadata(header | {"version": 99}, None))
    with pytest.raises(ValueError, match="unknown jaxquant checkpoint version 99; this jaxquant "
                                         "reads versions 1, 2"):
        load_safetensors(path)
    safetensors.numpy.save_file({"a.b": np.ones(2, np.float32), "x/y": np.zeros(1, np.int8)}, path)
    with pytest.raises(ValueError, match="not a jaxquant checkpoint"):
        load_safetensors(path)
    plain = load_safetensors(path, allow_plain=True)
    assert plain["a.b"].dtype == jnp.float32 and plain["x"]["y"].dtype == jnp.int8


def test_version_1_files_still_load(path):
    """Version 2 added codebooks and QTensor scales; a version-1 file means the same."""
    tree = {"w": jq.quantize(jnp.arange(8.0).reshape(2, 4), axis=1)}
    header, tensors = encode(tree, to_host=True)
    safetensors.numpy.save_file(tensors, path,
                                metadata=header_metadata(header | {"version": 1}, None))
    back = load_safetensors(path, tree)
    np.testing.assert_array_equal(np.asarray(back["w"].qvalue), np.asarray(tree["w"].qvalue))


def test_extra_tensor_in_file_is_reported(path):
    header, tensors = encode({"w": jnp.ones(2)}, to_host=True)
    safetensors.numpy.save_file(tensors | {"stray": np.ones(1, np.float32)}, path,
                                metadata=header_metadata(header, None))
    with pytest.raises(ValueError, match="tensor 'stray' in the file is not in its jaxquant header"):
        load_safetensors(path)


@pytest.mark.parametrize("leaf, field", [("w", "axis"), ("w", "packed"), ("w", "dtype"),
                                         ("w", "block_size"), ("w", "zero_point"),
                                         ("n", "axis"), ("n/scale", "axis"),
                                         ("n/scale", "dtype")])
def test_header_entry_missing_a_field_is_malformed(path, leaf, field):
    """A QTensor entry (nvfp4's nested scale entry too) without a required field, under a
    valid CRC-32, is a malformed header, not a bare KeyError."""
    tree = {"w": jq.quantize(jnp.arange(-7.0, 8.0).reshape(3, 5), dtype=jnp.int4, axis=1),
            "n": jq.quantize(jnp.linspace(-1.0, 1.0, 64).reshape(2, 32), dtype="nvfp4",
                             packed=True)}
    header, tensors = encode(tree, to_host=True)
    entry = header["leaves"]["n"]["scale"] if leaf == "n/scale" else header["leaves"][leaf]
    del entry[field]
    safetensors.numpy.save_file(tensors, path, metadata=header_metadata(header, None))
    with pytest.raises(ValueError, match=f"malformed jaxquant header: the QTensor entry "
                                         f"'{leaf}' lacks '{field}'; a QTensor entry holds "
                                         f"'axis', 'block_size', 'dtype', 'packed'"):
        load_safetensors(path)


@pytest.mark.parametrize("field, value", [("dtype", None), ("dtype", 32), ("packed", "yes"),
                                          ("packed", 1), ("zero_point", 0), ("zero_point", None)])
def test_header_entry_with_a_mistyped_field_is_malformed(path, field, value):
    """Under a valid CRC-32, a QTensor entry whose dtype is not a dtype name (null would read
    as NumPy's default float64) or whose packed / zero_point is not a boolean is malformed."""
    tree = {"w": jq.quantize(jnp.arange(-7.0, 9.0).reshape(4, 4), dtype=jnp.int4, axis=1)}
    header, tensors = encode(tree, to_host=True)
    header["leaves"]["w"][field] = value
    safetensors.numpy.save_file(tensors, path, metadata=header_metadata(header, None))
    with pytest.raises(ValueError, match=f"malformed jaxquant header: the QTensor entry 'w' has "
                                         f"{field}={value!r}"):
        load_safetensors(path)


@pytest.mark.parametrize("crc", [None, "123", 1.5, True])
def test_every_tensor_needs_its_integer_crc32(path, crc):
    """jaxquant writes a CRC-32 for every tensor (versions 1 and 2); a header entry without
    one would skip the data check, so it is malformed."""
    header, tensors = encode({"w": jnp.ones(2)}, to_host=True)
    if crc is None:
        del header["tensors"]["w"]["crc32"]
    else:
        header["tensors"]["w"]["crc32"] = crc
    safetensors.numpy.save_file(tensors, path, metadata=header_metadata(header, None))
    with pytest.raises(ValueError, match=f"malformed jaxquant header: tensor 'w' has no integer "
                                         f"crc32 .got {re.escape(repr(crc))}"):
        load_safetensors(path)


@pytest.mark.parametrize("version", [True, 2.0, "2"])
def test_version_must_be_an_integer(path, version):
    header, tensors = encode({"w": jnp.ones(2)}, to_host=True)
    safetensors.numpy.save_file(tensors, path,
                                metadata=header_metadata(header | {"version": version}, None))
    with pytest.raises(ValueError, match=f"unknown jaxquant checkpoint version {version!r}"):
        load_safetensors(path)


def test_header_leaf_without_a_kind_is_malformed(path):
    header, tensors = encode({"b": jnp.ones(2)}, to_host=True)
    del header["leaves"]["b"]["kind"]
    safetensors.numpy.save_file(tensors, path, metadata=header_metadata(header, None))
    with pytest.raises(ValueError, match=r"malformed jaxquant header: leaf 'b' has kind None; "
                                         r"expected one of \['array', 'packed', 'qtensor'\]"):
        load_safetensors(path)


def test_allow_plain_reads_a_plain_file_with_jaxquant_prefixed_metadata(path):
    """Only the exact 'jaxquant' key marks a jaxquant file; other keys are the user's."""
    safetensors.numpy.save_file({"w": np.arange(3, dtype=np.float32)}, path,
                                metadata={"jaxquant_tool": "x", "jaxquant.note": "y"})
    back = load_safetensors(path, allow_plain=True)
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(3, dtype=np.float32))
    with pytest.raises(ValueError, match="not a jaxquant checkpoint"):
        load_safetensors(path)


# --- targets ---------------------------------------------------------------------------


def test_target_errors_name_path_expected_and_received(path):
    _, _, q = _model_tree()
    save_safetensors(path, q)
    abstract = jax.eval_shape(lambda: q)

    def variant(**changes):
        t = jax.tree.map(lambda x: x, abstract, is_leaf=jq.is_qtensor)
        for k, v in changes.items():
            *parents, last = k.split("/")
            node = t
            for part in parents:
                node = node[part]
            if v is None:
                del node[last]
            else:
                node[last] = v
        return t

    with pytest.raises(ValueError, match="key 'stepp' of the target is missing from the file"):
        load_safetensors(path, {**abstract, "stepp": abstract["step"]})
    with pytest.raises(ValueError, match=r"unexpected key 'params/norm/scale' in the file: the "
                                         r"target has no leaf at that path"):
        load_safetensors(path, variant(**{"params/norm/scale": None}))
    with pytest.raises(TypeError, match=r"'params/norm/scale': dtype mismatch: the target expects "
                                        r"bfloat16, the file holds float32"):
        load_safetensors(path, variant(**{"params/norm/scale": jax.ShapeDtypeStruct((16,), jnp.bfloat16)}))
    with pytest.raises(ValueError, match=r"'params/norm/scale': shape mismatch: the target expects "
                                         r"\(8,\), the file holds \(16,\)"):
        load_safetensors(path, variant(**{"params/norm/scale": jnp.ones(8)}))
    with pytest.raises(TypeError, match=r"'params/layers_0/attn/kernel/qvalue': dtype mismatch: "
                                        r"the target expects int4, the file holds int8"):
        load_safetensors(path, variant(**{"params/layers_0/attn/kernel": jax.eval_shape(
            lambda: jq.quantize(jnp.ones((16, 48)), dtype=jnp.int4, axis=1))}))
    with pytest.raises(ValueError, match=r"'params/layers_0/attn/kernel': QTensor axis mismatch: "
                                         r"the target expects None, the file holds 1"):
        load_safetensors(path, variant(**{"params/layers_0/attn/kernel": jax.eval_shape(
            lambda: jq.quantize(jnp.ones((16, 48)), dtype=jnp.int8))}))
    with pytest.raises(ValueError, match=r"'params/head/kernel': the target expects no zero point, "
                                         r"the file holds a zero point"):
        load_safetensors(path, variant(**{"params/head/kernel": jax.eval_shape(
            lambda: jq.QTensor(jnp.zeros((64, 8), jnp.uint4), jnp.ones(())))}))
    with pytest.raises(TypeError, match=r"'params/head/kernel': the target holds an array, the "
                                        r"file a QTensor"):
        load_safetensors(path, variant(**{"params/head/kernel": jnp.ones((64, 8))}))
    with pytest.raises(ValueError, match=r"'params/head/kernel/qvalue': packed axis mismatch: the "
                                         r"target expects 0, the file holds 1"):
        load_safetensors(path, variant(**{"params/head/kernel": jax.eval_shape(
            lambda: jq.pack(q["params"]["head"]["kernel"], axis=0))}))
    with pytest.raises(TypeError, match=r"'step': target leaves must be arrays"):
        load_safetensors(path, variant(step=7))


def test_wrong_key_reports_both_sides(path):
    save_safetensors(path, {"encoder": {"w": jnp.ones(2)}})
    with pytest.raises(ValueError, match=r"key 'decoder/w' of the target is missing from the file; "
                                         r"the file holds 'encoder/w'"):
        load_safetensors(path, {"decoder": {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}})
    with pytest.raises(ValueError, match=r"unexpected key 'encoder/w' in the file"):
        load_safetensors(path, {})


def test_target_decides_packing(path):
    _, _, q = _model_tree()
    save_safetensors(path, q)
    unpacked = jax.eval_shape(lambda: jq.unpack(q["params"]["layers_0"]["mlp"]["kernel"]))
    target = jax.tree.map(lambda x: x, q, is_leaf=jq.is_qtensor)
    target["params"]["layers_0"]["mlp"]["kernel"] = unpacked
    target["params"]["head"]["kernel"] = jq.pack(q["params"]["head"]["kernel"])
    back = load_safetensors(path, target)
    assert not back["params"]["layers_0"]["mlp"]["kernel"].packed
    assert back["params"]["head"]["kernel"].packed
    assert_identical(jax.tree.map(jq.unpack, q, is_leaf=jq.is_qtensor),
                     jax.tree.map(jq.unpack, back, is_leaf=jq.is_qtensor))


def test_abstract_sharded_target_keeps_shardings(path):
    mesh = host_mesh((2, 4), ("data", "model"))
    params, rules, q = _model_tree()
    save_safetensors(path, q)
    abstract = jax.eval_shape(lambda: jq.quantize_tree(params, rules))

    def shard(x):
        dims = {2: ("data", "model"), 1: ("model",), 0: ()}[x.ndim]
        spec = P(*(d if n % mesh.shape[d] == 0 else None for d, n in zip(dims, x.shape, strict=True)))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    target = jax.tree.map(shard, abstract)
    back = load_safetensors(path, target)
    assert_identical(q, back)
    arrays = jax.tree.leaves(back)
    specs = jax.tree.leaves(target)
    assert len(arrays) == len(specs)
    for x, t in zip(arrays, specs, strict=True):
        assert x.sharding == t.sharding, (x.shape, x.sharding, t.sharding)
    kernel = back["params"]["layers_0"]["attn"]["kernel"]
    assert kernel.qvalue.sharding.spec == P("data", "model")
    assert kernel.scale.sharding.spec == P("model")
    assert len(kernel.qvalue.addressable_shards) == 8
    # A sharded tree saves as it is (gathered to the host) and loads back the same.
    save_safetensors(path + ".2", back)
    assert_identical(q, load_safetensors(path + ".2"))
    # Unpacked sub-byte codes go straight onto their sharding too.
    mlp = jax.eval_shape(lambda: jq.unpack(q["params"]["layers_0"]["mlp"]["kernel"]))
    target["params"]["layers_0"]["mlp"]["kernel"] = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data"))), mlp)
    codes = load_safetensors(path, target)["params"]["layers_0"]["mlp"]["kernel"].qvalue
    assert codes.dtype == jnp.int4 and codes.sharding == NamedSharding(mesh, P("data"))
    assert _bits(codes) == _bits(jq.unpack(q["params"]["layers_0"]["mlp"]["kernel"]).qvalue)


@pytest.mark.parametrize("spec", [jq.QuantSpec(), jq.QuantSpec(dtype=jnp.int4, block_size=8),
                                  jq.QuantSpec(dtype="nvfp4"), jq.QuantSpec(stacked=1)],
                         ids=["per-channel", "int4-blocks", "nvfp4", "stacked"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_placeholders_on_a_mesh_keep_shardings(path, spec, axis_type):
    # jax.eval_shape gives no output shardings on Auto axes (and an abstract mesh on Explicit
    # ones, which loading refuses outside set_mesh); quantize_tree of placeholders must still
    # give those of the concrete tree, or the load lands on one device.
    mesh = host_mesh((2, 4), ("data", "model"), getattr(jax.sharding.AxisType, axis_type))
    sharding = NamedSharding(mesh, P(None, "data", "model"))
    x = jax.device_put(cpu_normal(2, 16, 64), sharding)
    q = jq.quantize_tree({"w": x}, spec)
    target = jq.quantize_tree({"w": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)},
                              spec)
    concrete, abstract = jax.tree.leaves(q), jax.tree.leaves(target)
    assert [a.sharding for a in abstract] == [a.sharding for a in concrete]
    assert target["w"].qvalue.sharding.spec == P(None, "data", "model")
    save_safetensors(path, q)
    back = load_safetensors(path, target)
    assert_identical(q, back)
    assert [a.sharding for a in jax.tree.leaves(back)] == [a.sharding for a in concrete]
    floats = jq.dequantize_tree(target)["w"]
    assert floats.sharding == jq.dequantize_tree(q)["w"].sharding


# --- saving errors ----------------------------------------------------------------------


def test_save_errors(path):
    with pytest.raises(TypeError, match="leaf 'step' is a int; checkpoints hold arrays"):
        save_safetensors(path, {"step": 3})
    with pytest.raises(ValueError, match="two leaves have the same path 'a/b'"):
        save_safetensors(path, {"a/b": jnp.ones(1), "a": {"b": jnp.ones(1)}})
    with pytest.raises(ValueError, match="metadata key 'jaxquant' is reserved"):
        save_safetensors(path, {"w": jnp.ones(1)}, metadata={"jaxquant": "x"})
    with pytest.raises(TypeError, match="metadata must map str to str"):
        save_safetensors(path, {"w": jnp.ones(1)}, metadata={"n": 1})
    with pytest.raises(TypeError, match="only concrete arrays can be saved"):
        save_safetensors(path, {"w": jax.ShapeDtypeStruct((2,), jnp.float32)})
    # placeholders and tracers of every format name the leaf (float6 codes: JAX's error, no
    # leaf named; tracers: JAX's TracerArrayConversionError)
    x = jnp.ones((8, 32))
    for kw in (dict(dtype=jnp.int4), dict(dtype="float6_e2m3fn", axis=1), {}):
        abstract = jax.eval_shape(lambda x, kw=kw: jq.quantize(x, **kw), x)
        with pytest.raises(TypeError, match=r"^'w/qvalue': only concrete arrays can be saved, "
                                            r"got ShapeDtypeStruct\.$"):
            save_safetensors(path, {"w": abstract})

        def traced(x, kw=kw):
            save_safetensors(path, {"w": jq.quantize(x, **kw)})
            return x

        with pytest.raises(TypeError, match=r"^'w/qvalue': only concrete arrays can be saved, "
                                            r"got DynamicJaxprTracer\."):
            jax.jit(traced)(x)
    assert not os.path.exists(path)


# --- orbax ----------------------------------------------------------------------------


def test_orbax_round_trip_every_format_and_sharded_target(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    from jaxquant._checkpoint import load_orbax, save_orbax

    tree = _every_format_tree()
    save_orbax(tmp_path / "a", tree)
    assert_identical(tree, load_orbax(tmp_path / "a"))

    mesh = host_mesh((8,), ("x",))
    params, rules, q = _model_tree()
    sharded = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P("x") if x.shape and x.shape[0] % 8 == 0
                                                  else P())), q)
    save_orbax(tmp_path / "b", sharded)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          sharded)
    back = load_orbax(tmp_path / "b", target)
    assert_identical(q, back)
    for x, t in zip(jax.tree.leaves(back), jax.tree.leaves(target), strict=True):
        assert x.sharding == t.sharding
    with pytest.raises(ValueError, match="unexpected key 'step' in the file"):
        load_orbax(tmp_path / "b", {k: v for k, v in target.items() if k != "step"})
    save_orbax(tmp_path / "c", {})
    assert load_orbax(tmp_path / "c") == {}


def test_orbax_corrupted_data_fails_the_checksum(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    from jaxquant._checkpoint import load_orbax, save_orbax

    save_orbax(tmp_path / "a", {"w": jnp.arange(1024, dtype=jnp.float32)})
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "a") for f in fs
             if os.sep + "d" + os.sep in os.path.join(d, f)]
    data = max(files, key=os.path.getsize)
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ValueError, match="checksum mismatch in tensor 'w'"):
        load_orbax(tmp_path / "a")
    shutil.rmtree(tmp_path / "a")


def test_orbax_64_bit_leaves_without_x64_stay_exact_numpy(tmp_path):
    """As load_safetensors: int64/uint64/float64 come back as the exact NumPy arrays."""
    pytest.importorskip("orbax.checkpoint")
    from jaxquant._checkpoint import load_orbax, save_orbax

    assert not jax.config.jax_enable_x64
    tree = {"ids": np.array([2**40, -1], np.int64), "u": np.array([2**63 + 5], np.uint64),
            "f": np.arange(3.0), "w": jnp.ones(2)}
    save_orbax(tmp_path / "a", tree)
    back = load_orbax(tmp_path / "a")
    for k in ("ids", "u", "f"):
        assert isinstance(back[k], np.ndarray) and back[k].dtype == tree[k].dtype
        assert back[k].tobytes() == tree[k].tobytes()
    assert isinstance(back["w"], jax.Array)
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}
    assert load_orbax(tmp_path / "a", target)["ids"].tolist() == [2**40, -1]


def test_orbax_missing_foreign_or_damaged_checkpoint(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    import orbax.checkpoint as ocp

    from jaxquant._checkpoint import load_orbax, save_orbax

    with pytest.raises(FileNotFoundError, match="no_ckpt: no such directory: expected an orbax "
                                                "checkpoint directory"):
        load_orbax(tmp_path / "no_ckpt")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match="empty: not an orbax checkpoint"):
        load_orbax(tmp_path / "empty")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(tmp_path / "plain"), {"w": np.ones(3, np.float32)})
        ckptr.wait_until_finished()
    with pytest.raises(ValueError, match="plain: an orbax checkpoint without a jaxquant header"):
        load_orbax(tmp_path / "plain")
    save_orbax(tmp_path / "a", {"w": jnp.arange(1024, dtype=jnp.float32)})
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "a") for f in fs
             if os.sep + "d" + os.sep in os.path.join(d, f)]
    os.remove(max(files, key=os.path.getsize))  # the array's data file
    with pytest.raises(ValueError, match="a: cannot read the checkpoint's arrays .a missing or "
                                         "corrupted data file"):
        load_orbax(tmp_path / "a")


@pytest.mark.parametrize("name, field", [("_METADATA", b'"key_metadata"'),
                                         ("_sharding", b'sharding_type')])
def test_orbax_damaged_metadata_file_is_a_value_error(tmp_path, name, field):
    """A damaged field in orbax's own metadata files is a corrupted checkpoint (ValueError),
    not orbax's bare KeyError."""
    pytest.importorskip("orbax.checkpoint")
    from jaxquant._checkpoint import load_orbax, save_orbax

    save_orbax(tmp_path / "a", {"w": jnp.arange(8, dtype=jnp.float32)})
    meta = tmp_path / "a" / name
    raw = meta.read_bytes()
    assert field in raw
    meta.write_bytes(raw.replace(field, field.upper(), 1))
    with pytest.raises(ValueError, match="a: cannot read the checkpoint's metadata .corrupted"):
        load_orbax(tmp_path / "a")
